"""`python -m specbench.train target=<model> drafter=draft_lm [key=value ...]`

Builds (or reuses) the self-distillation or feature set of the target, trains the drafter with
the trainer its kind names (``specbench.drafters.KINDS``; the interface: ``specbench.train``),
with a progress bar, resumable checkpoints and a fixed seed, and writes a checkpoint folder with
a card to `out` (default checkpoints/<target>/<drafter>).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    import hydra

    from specbench.paths import CONF_DIR

    def _train(cfg):
        import torch

        from specbench.errors import ConfigError
        from specbench.hf import eos_ids
        from specbench.models import load_model, load_tokenizer, model_cfg, resolve_device, resolve_dtype
        from specbench.train import distill, features, loop, trainer as trainer_of

        mcfg = model_cfg(str(cfg.target), "sdpa")
        trainer = trainer_of(str(cfg.drafter.kind))  # the module drafters.KINDS names for the kind
        if cfg.drafter.get("data"):  # a drafter may ask for its own distillation settings (merged, then keyed)
            from omegaconf import OmegaConf

            OmegaConf.set_struct(cfg, False)
            cfg.data = OmegaConf.merge(cfg.data, cfg.drafter.data)
        loop.check(cfg)  # before the target loads and its teacher pass runs
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        if dtype != torch.float32 and device.type == "cpu":
            raise ConfigError("train on the CPU in fp32 (dtype=fp32)")
        target = load_model(mcfg, device, dtype)
        tok = load_tokenizer(mcfg)
        for p in target.parameters():
            p.requires_grad_(False)
        torch.manual_seed(int(cfg.seed))
        name = str(cfg.target)
        out = Path(str(cfg.out))
        if not out.is_absolute():
            out = REPO / out
        out.mkdir(parents=True, exist_ok=True)
        command = "python -m specbench.train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        chat, progress = bool(mcfg.get("chat", True)), bool(cfg.progress)
        if trainer.DATA == "features":  # the target's states at the layers the drafter reads, and the teacher's
            cfg.features.layers = trainer.layers(cfg, int(target.config.get_text_config().num_hidden_layers))
            root = features.build(target, tok, name, cfg.features, device, dtype, chat=chat, progress=progress)
            items = features.load(root)
            meta = json.loads((root / "meta.json").read_text())
            dmeta = {**features.stats(items), "dropped": meta["dropped"], "key": meta["key"]}
        else:
            root = distill.build(target, tok, name, cfg.data, device, dtype, chat=chat, progress=progress)
            items = distill.load(root)
            dmeta = {**distill.stats(items), **{k: v for k, v in json.loads((root / "meta.json").read_text()).items()
                                                if k in ("dropped_for_benchmark_overlap", "key")}}
        res = trainer.train(cfg, target, tok, items, out, eos_ids(target, tok), device, progress=progress)
        trainer.finish(cfg, res, out, name, dmeta, command)
        print(f"[train] wrote {out}: {trainer.said(res['summary'])}")

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
    def _app(cfg):
        from specbench.errors import ConfigError

        try:
            _train(cfg)
        except ConfigError as e:  # a setting or data set that cannot train, before or after the target loads
            print(f"specbench.train: error: {e}", file=sys.stderr)
            sys.exit(2)

    _app()
    return 0


if __name__ == "__main__":
    sys.exit(main())
