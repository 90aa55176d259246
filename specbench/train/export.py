"""Our trained drafters in their authors' published layouts, so the reference code (and engines
that read those layouts) can run them:

    python -m specbench.train.export --format medusa checkpoints/smollm2-135m/medusa OUT

``medusa``: Medusa-1's ``config.json`` + ``medusa_lm_head.pt`` (``specbench.drafters.published``).
Our heads score a draft vocabulary through the target's output layer; Medusa-1 gives every head a
full-vocabulary output layer of its own, so the export writes the target's whole output layer
into each: on the draft vocabulary's tokens the exported heads' logits are ours, and the other
tokens get the target's scores of the head's state. (EAGLE's layouts: not yet.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

FORMATS = ("medusa",)


def export_medusa(heads, target, out, base_model: str) -> None:
    """``heads``: our ``MedusaHeads`` on ``target``; writes Medusa-1's layout to ``out``."""
    from specbench.drafters.published import save_medusa1

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

    folder = resolve_path(a.checkpoint)
    try:
        if not drafters.is_draft_checkpoint(folder):
            raise ConfigError(f"{a.checkpoint} is not a specbench drafter checkpoint")
        meta = drafters.read_meta(folder)
        if meta.get("kind") != "medusa":
            raise ConfigError(f"{a.checkpoint} holds a {meta.get('kind')} drafter; --format {a.format} exports medusa")
        mcfg = model_cfg(meta["target"])
        target = load_model(mcfg, torch.device("cpu"), torch.float32)
        heads = drafters.load(folder, target, torch.device("cpu"), torch.float32, kind="medusa")
        export_medusa(heads, target, Path(a.out), str(mcfg.get("path") or meta["target"]))
    except ConfigError as e:
        print(f"specbench.train.export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out} ({a.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
