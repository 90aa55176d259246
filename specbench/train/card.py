"""A drafter checkpoint's card (README.md) and metadata (drafter.json): portable, and made from
the code's current defaults.

    python -m specbench.train.card [--check] [FOLDER ...]    (default: every folder under checkpoints/)

Training writes both (``write``): the sections that describe a kind come from its trainer (the
module ``specbench.drafters.KINDS`` names: ``card_body`` and ``card_use``), a plain card where it
has none. This command writes them again after the code's defaults change (a tree size, a K);
``--check`` (run by the tests) exits 1 where a card is stale or where either file names a path
of the machine that trained it. Measurements of a checkpoint are dated benchmarks and live in
docs/benchmarks/drafters.md, not in its card.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shlex
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = "docs/benchmarks/drafters.md"

# Settings that name files of the machine that trained (inputs cached there): never part of the
# data key, meaningless elsewhere. `out` is dropped from the command: its default is where the
# checkpoint is shipped (checkpoints/<target>/<name>).
LOCAL_SETTINGS = ("sources", "dir")
LOCAL_ARGS = ("features.sources", "features.dir", "data.dir", "out")
_ABS = re.compile(r"(?:^|[\s=:,(\['\"])((?:/|~/)[^\s/'\",)\]]+/[^\s'\",)\]]*)")


def absolute_paths(obj) -> list[str]:
    """Every absolute path (``/a/b``, ``~/a``) inside the strings of a JSON-like object."""
    if isinstance(obj, dict):
        return [p for v in obj.values() for p in absolute_paths(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in absolute_paths(v)]
    return _ABS.findall(obj) if isinstance(obj, str) else []


def portable(meta: dict) -> dict:
    """``meta`` without what only the training machine knows: local input files and ``out``
    (also in the command). Raises ValueError if an absolute path is still left."""
    m = copy.deepcopy(meta)
    m.pop("measured", None)  # measurements are dated benchmarks: docs/benchmarks/drafters.md
    for section in ("feature_settings", "data_settings"):
        for key in LOCAL_SETTINGS:
            if key in (m.get(section) or {}):
                m[section][key] = None
    if m.get("command"):
        args = shlex.split(m["command"])
        keep = [a for a in args if a.split("=", 1)[0] not in LOCAL_ARGS]
        m["command"] = " ".join(shlex.quote(a) for a in keep)
    left = absolute_paths(m)
    if left:
        raise ValueError(f"drafter metadata names machine paths: {', '.join(sorted(set(left)))}")
    return m


def _where(folder: Path) -> str:
    try:
        return str(folder.resolve().relative_to(REPO))
    except ValueError:
        return "<this folder>"


def method_defaults(name: str) -> dict:
    """Method ``name``'s default settings (its ``Settings``)."""
    from omegaconf import OmegaConf

    from specbench import methods

    return OmegaConf.to_container(methods.settings(name))


def run_block(method: str, where: str) -> list[str]:
    """A card's lines that run ``method`` with the checkpoint at ``where`` (``<method>.checkpoint=``
    left out where the method's default names it already)."""
    pick = "" if method_defaults(method).get("checkpoint") == where else f" {method}.checkpoint={where}"
    return ["```bash", f"python -m specbench method={method}{pick}", "```", ""]


def _trainer(kind: str):
    """The module ``drafters.KINDS`` names as ``kind``'s trainer (None: a kind not in the table)."""
    from specbench import drafters
    from specbench.train import trainer

    return trainer(kind) if kind in drafters.KINDS else None


def _namesake_use(meta: dict, where: str) -> list[str]:
    """The Use lines of a kind whose trainer writes none: its namesake method, if there is one."""
    from specbench import methods

    kind = meta["kind"]
    if kind not in methods.builtin():
        return []
    return ["```bash", f"python -m specbench method={kind} {kind}.checkpoint={where}", "```", ""]


def use_lines(meta: dict, folder: Path) -> list[str]:
    """How a run picks this checkpoint, and the defaults it then runs with (read from the code
    and configs now, so a card never states an old tree size): its trainer's ``card_use``."""
    use = getattr(_trainer(meta["kind"]), "card_use", _namesake_use)
    return ["## Use", "", *use(meta, _where(folder)), ""]


def losses(s: dict) -> str:
    """The final train loss and the held-out loss of a training summary ``s``."""
    return (f"- final train loss (last 20 steps): {s['train_loss_last20']:.3f}; held-out loss {s['eval_loss']:.3f} "
            f"({s['eval_sequences']} sequences)")


def budget(s: dict, ts: dict) -> str:
    """A training run's steps, batch and learning rate (its summary ``s``, its settings ``ts``)."""
    return f"{s['steps']} steps, batch {ts['batch_size']} x up to {ts['seq_len']} tokens, AdamW lr {ts['lr']}"


def agreement(s: dict, per: str, agree: str, drafts: str) -> str:
    """The held-out agreement line of a drafter that drafts several tokens: top-1 agreement ``per``
    slot, step or depth (``agree``), and the expected accepted drafts of ``drafts`` (a step, a block)."""
    return (f"- held-out top-1 agreement with the target's greedy token, per {per}: {agree}; expected accepted "
            f"drafts {drafts}: {s['eval_expected_accepted']:.2f}")


def feature_data(meta: dict) -> list[str]:
    """The Data section of a drafter trained on the feature set (DFlash, DSpark, MTP, P-EAGLE)."""
    d, fs = meta["data"], meta["feature_settings"]
    return ["", "## Data",
            f"- {d['sequences']} sequences of the ShareGPT training slice ({d['tokens']:,} token positions): "
            f"{d['answered']} first turns answered by the target itself (greedy, up to {fs['max_new_tokens']} tokens) "
            f"and {d['sequences'] - d['answered']} whole conversations (up to {fs['max_tokens']} tokens); "
            f"dropped: {d['dropped']}; feature set key {d['key']}"]


def feature_meta(cfg, result: dict, target_name: str, data_meta: dict, command: str, **fields) -> dict:
    """The drafter.json of a drafter trained on the feature set by the block, MTP and P-EAGLE
    trainers: ``fields`` (its kind, vocabulary sizes), then its settings, data, training summary and
    command."""
    dr = cfg.drafter
    return {**fields, "seed": int(cfg.seed), "drafter": {k: dr[k] for k in dr}, "data": data_meta,
            "feature_settings": {k: cfg.features[k] for k in cfg.features},
            "train_settings": {k: cfg.train[k] for k in cfg.train}, "train_summary": result["summary"],
            "loss_curve_every_10_steps": result["loss_curve"], "command": command}


def _plain_body(meta: dict) -> list[str]:
    """A kind whose trainer has no ``card_body``: its held-out scores as its trainer reports them."""
    s = meta.get("train_summary", {})
    return [f"# {meta['name']}: {meta['kind']} drafter for {meta['target']}", "",
            f"Trained {s.get('steps')} steps; held out: " + ", ".join(f"{k} {v}" for k, v in s.items() if k.startswith("eval_")),
            ""]


def render(meta: dict, folder: Path) -> str:
    """The card of a checkpoint whose (portable) metadata is ``meta``."""
    body = getattr(_trainer(meta["kind"]), "card_body", _plain_body)(meta)
    lines = [*body, *([""] if body[-1] != "" else []), *use_lines(meta, folder)]
    if meta.get("command"):
        lines += ["## Reproduce", "", "```bash", meta["command"], "```", ""]
    lines += ["## Measured", "", f"Benchmarks of the shipped checkpoints, dated and with their commands: `{BENCHMARKS}`.",
              ""]
    return "\n".join(lines)


def files(folder: Path, meta: dict) -> dict[str, str]:
    m = portable(meta)
    return {"drafter.json": json.dumps(m, indent=1, default=str) + "\n", "README.md": render(m, folder)}


def write(folder: Path, meta: dict) -> None:
    """Write a checkpoint's drafter.json and README.md (portable, from the current defaults)."""
    for name, text in files(Path(folder), meta).items():
        (Path(folder) / name).write_text(text)


def shipped() -> list[Path]:
    return sorted(p.parent for p in (REPO / "checkpoints").glob("*/*/drafter.json"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.train.card", description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", type=Path, help="checkpoint folders (default: every one under checkpoints/)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a card or drafter.json differs")
    a = ap.parse_args(argv)
    stale = []
    for folder in a.folders or shipped():
        try:
            meta = json.loads((folder / "drafter.json").read_text())
            want = files(folder, meta)
        except (OSError, ValueError, KeyError) as e:
            print(f"specbench.train.card: error: {folder}: {e}", file=sys.stderr)
            return 2
        for name, text in want.items():
            have = (folder / name).read_text() if (folder / name).exists() else None
            if have != text:
                stale.append(folder / name)
                if not a.check:
                    (folder / name).write_text(text)
    verb = "stale" if a.check else "written"
    for p in stale:
        print(f"{verb}: {p}")
    if a.check and stale:
        print("specbench.train.card: cards differ from the code's defaults; run `python -m specbench.train.card`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
