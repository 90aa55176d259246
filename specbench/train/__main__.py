"""`python -m specbench.train target=<model> drafter=draft_lm [key=value ...]`

Builds (or reuses) the self-distillation set of the target, trains the drafter with a
progress bar, resumable checkpoints and a fixed seed, and writes a checkpoint folder with a
card to `out` (default checkpoints/<target>/<drafter>).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    import hydra
    from omegaconf import OmegaConf

    @hydra.main(config_path="../../conf", config_name="train", version_base="1.3")
    def _app(cfg):
        import torch

        from specbench.models import ConfigError, eos_ids, load_model, load_tokenizer, resolve_device, resolve_dtype
        from specbench.runner import CONF_DIR, group_options
        from specbench.train import distill, loop

        try:
            if cfg.target in group_options("model"):
                mcfg = OmegaConf.load(CONF_DIR / "model" / f"{cfg.target}.yaml")
            else:
                mcfg = OmegaConf.create({"name": Path(str(cfg.target)).name, "path": str(cfg.target), "chat": True,
                                         "attn_implementation": "sdpa"})
            if cfg.drafter.kind != "draft_lm":
                raise ConfigError(f"drafter kind '{cfg.drafter.kind}' is not implemented yet; choices: draft_lm")
            device = resolve_device(cfg.device)
            dtype = resolve_dtype(cfg.dtype, device)
            if dtype != torch.float32 and device.type == "cpu":
                raise ConfigError("train on the CPU in fp32 (dtype=fp32)")
            target = load_model(mcfg, device, dtype)
            tok = load_tokenizer(mcfg)
        except ConfigError as e:
            print(f"specbench.train: error: {e}", file=sys.stderr)
            sys.exit(2)
        for p in target.parameters():
            p.requires_grad_(False)
        torch.manual_seed(int(cfg.seed))
        name = str(cfg.target)
        root = distill.build(target, tok, name, cfg.data, device, dtype, chat=bool(mcfg.get("chat", True)),
                             progress=bool(cfg.progress))
        items = distill.load(root)
        dmeta = {**distill.stats(items), **{k: v for k, v in
                                            __import__("json").loads((root / "meta.json").read_text()).items()
                                            if k in ("dropped_for_benchmark_overlap", "key")}}
        out = Path(str(cfg.out))
        if not out.is_absolute():
            out = REPO / out
        out.mkdir(parents=True, exist_ok=True)
        res = loop.train(cfg, target, items, out, eos_ids(target, tok), progress=bool(cfg.progress))
        command = "python -m specbench.train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        loop.finish(cfg, res, out, name, dmeta, command)
        s = res["summary"]
        print(f"[train] wrote {out}: eval KL {s['eval_kl']:.3f}, top-1 agreement {s['eval_top1_agreement']:.1%}")

    _app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
