"""Medusa's published heads. ``medusa1``: FasterDecoding's Medusa-1 heads (Cai et al. 2024), e.g.
``FasterDecoding/medusa-vicuna-7b-v1.3``: ``config.json`` with ``medusa_num_heads`` and
``medusa_num_layers``, and ``medusa_lm_head.pt``, the state of a list of heads, each ``num_layers``
residual blocks ``x + SiLU(W x + b)`` (keys ``{head}.{layer}.linear.weight`` and ``.bias``) and a
full-vocabulary output layer of its own (``{head}.{num_layers}.weight``), all reading the target's
last hidden state after its final norm. The reference builds the blocks of a head as one module
repeated, so their keys repeat the same tensors; each is read as its own here, which computes the
same. ``medusa2``: Medusa-2, the heads inside the fine-tuned target's folder (below)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specbench.drafters.formats.common import FormatError, model_keys, weight_files
from specbench.drafters.medusa import MedusaHeads
from specbench.hf import text_config

NAMES = ("medusa1", "medusa2")
MEDUSA1_HEADS = "medusa_lm_head.pt"


def detect(folder) -> str | None:
    p = Path(str(folder)).expanduser()
    if (p / MEDUSA1_HEADS).exists() and (p / "config.json").exists():
        return "medusa1"
    if (p / "config.json").exists() and "medusa_num_heads" in json.loads((p / "config.json").read_text()) \
            and any(k.startswith(MEDUSA2_PREFIX) for k in model_keys(p)):
        return "medusa2"
    return None


def medusa1_shape(folder) -> tuple[int, int]:
    """(heads, residual blocks per head) from the checkpoint's config.json."""
    cfg = json.loads((Path(folder).expanduser() / "config.json").read_text())
    try:
        return int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{folder}: config.json names no medusa_num_heads (not a Medusa-1 checkpoint)") from None


def medusa1_keys(heads: int, layers: int) -> set[str]:
    keys = {f"{h}.{layers}.weight" for h in range(heads)}
    for h in range(heads):
        for k in range(layers):
            keys |= {f"{h}.{k}.linear.weight", f"{h}.{k}.linear.bias"}
    return keys


# Medusa-2 (Cai et al. 2024, the heads trained jointly with the target, e.g.
# ``FasterDecoding/medusa-1.0-vicuna-7b-v1.5``): the fine-tuned target itself, an HF model folder
# whose config.json adds ``medusa_num_heads`` / ``medusa_num_layers`` and whose weights hold the
# heads beside the model's own, under ``medusa_head.`` with Medusa-1's key layout. The target must
# be that fine-tuned model (``model.path`` = the same folder): its heads read its states.

MEDUSA2_PREFIX = "medusa_head."


def _medusa2_state(p: Path) -> dict:
    """The ``medusa_head.`` tensors of a Medusa-2 model folder, under Medusa-1's key names."""
    state = {}
    for f in weight_files(p):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                state |= {k[len(MEDUSA2_PREFIX):]: h.get_tensor(k) for k in h.keys() if k.startswith(MEDUSA2_PREFIX)}
        else:
            part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            state |= {k[len(MEDUSA2_PREFIX):]: v for k, v in part.items() if k.startswith(MEDUSA2_PREFIX)}
    return state


def read(folder) -> tuple[dict, int, int]:
    """(heads' state under Medusa-1's key names, heads, blocks) of a Medusa-1 or Medusa-2 folder."""
    heads, layers = medusa1_shape(folder)
    p = Path(folder).expanduser()
    two = not (p / MEDUSA1_HEADS).exists()
    state = _medusa2_state(p) if two else torch.load(p / MEDUSA1_HEADS, map_location="cpu", weights_only=True)
    want, have = medusa1_keys(heads, layers), set(state)
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        if two:
            missing, unexpected = [MEDUSA2_PREFIX + k for k in missing], [MEDUSA2_PREFIX + k for k in unexpected]
        raise FormatError(f"{folder}: not the Medusa-{2 if two else 1} layout its config.json declares ({heads} heads x {layers} "
                          f"blocks): missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                          f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    return state, heads, layers


def check(folder, target_config, state: tuple | None = None) -> tuple[int, int]:
    """The checkpoint's (heads, blocks) when it fits ``target_config``; else FormatError.
    ``state``: ``read(folder)`` when the caller has it (the file is read once)."""
    state, heads, layers = state or read(folder)
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    for h in range(heads):
        for k in range(layers):
            if tuple(state[f"{h}.{k}.linear.weight"].shape) != (d, d):
                raise FormatError(f"{folder}: head {h} block {k} is {tuple(state[f'{h}.{k}.linear.weight'].shape)}, "
                                  f"the target's hidden size is {d}: a drafter for another target")
        if tuple(state[f"{h}.{layers}.weight"].shape) != (V, d):
            raise FormatError(f"{folder}: head {h}'s output layer is {tuple(state[f'{h}.{layers}.weight'].shape)}, "
                              f"the target has {V} tokens x {d}: a drafter for another target")
    return heads, layers


class Medusa1Heads(MedusaHeads):
    """Medusa-1 heads with their own output layers: ``MedusaHeads``' first residual block per
    head, ``n_layers - 1`` more, then a full-vocabulary output layer per head; head k turns the
    target's last hidden state into logits for token t+1+k."""

    def __init__(self, target, heads: int, layers: int):
        V = int(text_config(target.config).vocab_size)
        super().__init__(target, torch.arange(V), heads)  # the whole vocabulary
        d = self.weight.shape[-1]
        self.n_layers = layers
        self.more_weight = nn.Parameter(torch.zeros(heads, layers - 1, d, d))
        self.more_bias = nn.Parameter(torch.zeros(heads, layers - 1, d))
        self.head = nn.Parameter(torch.zeros(heads, V, d))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        for k in range(self.n_layers - 1):
            h = h + F.silu(torch.einsum("hni,hoi->hno", h, self.more_weight[:, k].to(h.dtype))
                           + self.more_bias[:, k, None].to(h.dtype))
        return torch.einsum("hni,hvi->hnv", h, self.head.to(h.dtype))


def load(folder, target, device, dtype) -> Medusa1Heads:
    got = read(folder)
    heads, layers = check(folder, target.config, got)
    state = got[0]
    m = Medusa1Heads(target, heads, layers)
    with torch.no_grad():
        for h in range(heads):
            m.weight[h].copy_(state[f"{h}.0.linear.weight"])
            m.bias[h].copy_(state[f"{h}.0.linear.bias"])
            for k in range(1, layers):
                m.more_weight[h, k - 1].copy_(state[f"{h}.{k}.linear.weight"])
                m.more_bias[h, k - 1].copy_(state[f"{h}.{k}.linear.bias"])
            m.head[h].copy_(state[f"{h}.{layers}.weight"])
    for p in m.parameters():
        p.requires_grad_(False)
    return m.to(device=device, dtype=dtype).eval()


def save(folder, blocks_w: torch.Tensor, blocks_b: torch.Tensor, heads_w: torch.Tensor,
                 base_model: str) -> None:
    """Write Medusa-1's layout: ``blocks_w`` [H, L, d, d], ``blocks_b`` [H, L, d], ``heads_w`` [H, V, d]."""
    H, L = blocks_w.shape[:2]
    state = {}
    for h in range(H):
        for k in range(L):
            state[f"{h}.{k}.linear.weight"] = blocks_w[h, k].detach().clone().contiguous()
            state[f"{h}.{k}.linear.bias"] = blocks_b[h, k].detach().clone().contiguous()
        state[f"{h}.{L}.weight"] = heads_w[h].detach().clone().contiguous()
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / MEDUSA1_HEADS)
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": int(H), "medusa_num_layers": int(L),
                                                 "base_model_name_or_path": base_model}, indent=1) + "\n")
