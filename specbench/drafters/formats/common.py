"""What the published formats share: the one-line ``FormatError``, an HF folder's weight files
and keys, an EAGLE drafter's single weight file (with speculators' key names read as SafeAILab's),
and speculators' config."""

from __future__ import annotations

import json
from pathlib import Path

import torch


class FormatError(ValueError):
    """A published checkpoint that does not match its format or its target (one line)."""


def weight_files(p: Path) -> list[Path]:
    """An HF folder's weight files (one or sharded; safetensors preferred, as transformers does)."""
    st = sorted(p.glob("model*.safetensors"))
    return st or sorted(p.glob("pytorch_model*.bin"))


def model_keys(p: Path) -> set[str]:
    keys = set()
    for f in weight_files(p):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                keys |= set(h.keys())
        else:
            keys |= set(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return keys


EAGLE_WEIGHTS = ("pytorch_model.bin", "model.safetensors")


def eagle_file(folder) -> Path | None:
    p = Path(str(folder)).expanduser()
    return next((p / f for f in EAGLE_WEIGHTS if (p / f).exists()), None)


def eagle_state(folder) -> dict:
    """The weights, under SafeAILab's key names (a ``speculators`` checkpoint's ``layers.0.`` is
    EAGLE-3's ``midlayer.``)."""
    f = eagle_file(folder)
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(f))
    else:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)  # mapped: read as used
    if speculators_raw(folder) is not None:
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    return state


def eagle_keys(folder) -> set[str]:
    """The weight file's keys, without reading its tensors (safetensors' header; a mapped .bin)."""
    f = eagle_file(folder)
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            return set(h.keys())
    return set(eagle_state(folder))


def speculators_raw(folder) -> dict | None:
    p = Path(str(folder)).expanduser() / "config.json"
    if not p.exists():
        return None
    raw = json.loads(p.read_text())
    return raw if "speculators_model_type" in raw else None


def write_folder(folder, state: dict, config: dict) -> None:
    """A published layout's folder: ``model.safetensors`` (whole or absent: written aside, then
    renamed) and ``config.json``."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors.tmp"))
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
