"""Our trained drafters in their authors' published layouts, so the reference code (and engines
that read those layouts) can run them:

    python -m specbench.train.export --format medusa checkpoints/smollm2-135m/medusa OUT
    python -m specbench.train.export --format eagle  <an EAGLE drafter trained with drafter.input_norm=false> OUT
    python -m specbench.train.export --format eagle3 <an EAGLE-3 drafter> OUT

(``specbench.drafters.formats`` holds the layouts.)

``medusa``: Medusa-1's ``config.json`` + ``medusa_lm_head.pt``. Our heads score a draft vocabulary
through the target's output layer; Medusa-1 gives every head a full-vocabulary output layer of
its own, so the export writes the target's whole output layer into each: on the draft
vocabulary's tokens the exported heads' logits are ours, and the other tokens get the target's
scores of the head's state.

``eagle``: SafeAILab's EAGLE-1/2 ``config.json`` + ``pytorch_model.bin`` (``fc`` and layer 0).
That layer has no input norm, so only a drafter trained without one exports (the default
``drafter=eagle`` normalises its input: refused, saying so). EAGLE-1 drafts over the target's
whole vocabulary; ours over the draft vocabulary's rows of it: the same scores on those tokens.

``eagle3``: the trainer already writes SafeAILab's EAGLE-3 layout; the export checks it
against the target and writes it again (e.g. into another folder, as bf16).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

FORMATS = ("medusa", "eagle", "eagle3")  # each the published layout of the drafter kind of its name


def export_medusa(heads, target, out, base_model: str) -> None:
    """``heads``: our ``MedusaHeads`` on ``target``; writes Medusa-1's layout to ``out``."""
    from specbench.drafters.formats.medusa import save as save_medusa1

    H = heads.n_heads
    w = target.get_output_embeddings().weight.detach().float()
    save_medusa1(out, heads.weight.detach().float()[:, None], heads.bias.detach().float()[:, None],
                 w[None].expand(H, -1, -1), base_model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.train.export", description=__doc__.splitlines()[0])
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("checkpoint", help="a specbench drafter folder (drafter.json + model.safetensors)")
    ap.add_argument("out", help="folder to write the published layout into")
    a = ap.parse_args(argv)
    from specbench import drafters
    from specbench.errors import ConfigError
    from specbench.models import load_model, model_cfg
    from specbench.paths import resolve_path

    from specbench.drafters import formats

    folder = resolve_path(a.checkpoint)
    cpu = torch.device("cpu")
    try:
        if not drafters.is_draft_checkpoint(folder):
            raise ConfigError(f"{a.checkpoint} is not a specbench drafter checkpoint (no drafter.json)")
        meta = drafters.read_meta(folder)
        if meta.get("kind") != a.format:
            raise ConfigError(f"{a.checkpoint} holds a {meta.get('kind')} drafter; --format {a.format} exports "
                              f"a {a.format} drafter")
        mcfg = model_cfg(meta["target"])
        target = load_model(mcfg, cpu, torch.float32)
        if a.format == "medusa":
            heads = drafters.load(folder, target, cpu, torch.float32, kind="medusa")
            export_medusa(heads, target, Path(a.out), str(mcfg.get("path") or meta["target"]))
        elif a.format == "eagle":
            formats.eagle1.save(Path(a.out), drafters.load(folder, target, cpu, torch.float32, kind="eagle"))
        else:
            formats.eagle3.save(Path(a.out), formats.eagle3.load(folder, target, cpu, torch.float32))
    except (ConfigError, formats.FormatError) as e:
        print(f"specbench.train.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out} ({a.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
