"""`python -m specbench.train target=<model> drafter=draft_lm [key=value ...]`

Builds (or reuses) the self-distillation set of the target, trains the drafter with a
progress bar, resumable checkpoints and a fixed seed, and writes a checkpoint folder with a
card to `out` (default checkpoints/<target>/<drafter>).
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
        from specbench import drafters
        from specbench.train import distill, loop

        mcfg = model_cfg(str(cfg.target), "sdpa")
        kinds = [*drafters.KINDS, "eagle3", "dflash", "dspark", "mtp", "peagle"]  # written in their authors' layouts (drafters.formats)
        if cfg.drafter.kind not in kinds:
            raise ConfigError(f"unknown drafter kind '{cfg.drafter.kind}'; choices: {', '.join(kinds)}")
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
        if cfg.drafter.kind in loop.FEATURE_KINDS:  # feature-level drafters train on the feature set
            from specbench.train import features, heads

            if cfg.drafter.kind in ("eagle3", "peagle"):  # the states at the inputs of layers 2, L//2, L-3, and the teacher's
                from specbench.drafters.eagle3 import tap_layers

                cfg.features.layers = [*tap_layers(int(target.config.get_text_config().num_hidden_layers)), "final"]
            if cfg.drafter.kind in ("dflash", "dspark"):  # the states after its target layers, and the teacher's
                from specbench.drafters.dflash import taps_of
                from specbench.train.dflash import layer_ids

                n = int(target.config.get_text_config().num_hidden_layers)
                cfg.features.layers = [t for t in taps_of(layer_ids(cfg.drafter, n), n) if t != "final"] + ["final"]

            root = features.build(target, tok, name, cfg.features, device, dtype, chat=bool(mcfg.get("chat", True)),
                                  progress=bool(cfg.progress))
            items = features.load(root)
            meta = json.loads((root / "meta.json").read_text())
            dmeta = {**features.stats(items), "dropped": meta["dropped"], "key": meta["key"]}
            if cfg.drafter.kind == "peagle":
                from specbench.train import peagle

                res = peagle.train(cfg, target, tok, items, out, eos_ids(target, tok), device, progress=bool(cfg.progress))
                peagle.finish(cfg, res, out, name, dmeta, command)
                print(f"[train] wrote {out}: held-out top-1 agreement per depth "
                      f"{[round(x, 3) for x in res['summary']['eval_top1_agreement']]}")
                return
            if cfg.drafter.kind == "mtp":
                from specbench.train import mtp

                res = mtp.train(cfg, target, items, out, device, progress=bool(cfg.progress))
                mtp.finish(cfg, res, out, name, dmeta, command)
                s = res["summary"]
                print(f"[train] wrote {out}: held-out top-1 agreement per step "
                      f"{[round(x, 3) for x in s['eval_top1_agreement']]}, expected accepted {s['eval_expected_accepted']:.2f}")
                return
            if cfg.drafter.kind in ("dflash", "dspark"):
                from specbench.train import dflash

                res = dflash.train(cfg, target, tok, items, out, device, progress=bool(cfg.progress))
                dflash.finish(cfg, res, out, name, dmeta, command)
                s = res["summary"]
                print(f"[train] wrote {out}: held-out top-1 agreement per slot "
                      f"{[round(x, 3) for x in s['eval_top1_agreement']]}, expected accepted {s['eval_expected_accepted']:.2f}")
                return
            res = heads.train(cfg, target, items, out, eos_ids(target, tok), device, progress=bool(cfg.progress))
            heads.finish(cfg, res, out, name, dmeta, command)
            s = res["summary"]
            print(f"[train] wrote {out}: held-out top-1 agreement {[round(x, 3) for x in s['eval_top1_agreement']]}")
            return
        root = distill.build(target, tok, name, cfg.data, device, dtype, chat=bool(mcfg.get("chat", True)),
                             progress=bool(cfg.progress))
        items = distill.load(root)
        dmeta = {**distill.stats(items), **{k: v for k, v in json.loads((root / "meta.json").read_text()).items()
                                            if k in ("dropped_for_benchmark_overlap", "key")}}
        if cfg.drafter.kind == "specdec":
            from specbench.train import specdec

            res = specdec.train(cfg, target, items, out, eos_ids(target, tok), progress=bool(cfg.progress))
            specdec.finish(cfg, res, out, name, dmeta, command)
            s = res["summary"]
            print(f"[train] wrote {out}: held-out agreement per query "
                  f"{[round(x, 3) for x in s['eval_query_agreement']]}, chain tau {s['eval_chain_tau']:.2f}")
            return
        res = loop.train(cfg, target, items, out, eos_ids(target, tok), progress=bool(cfg.progress))
        loop.finish(cfg, res, out, name, dmeta, command)
        s = res["summary"]
        print(f"[train] wrote {out}: eval KL {s['eval_kl']:.3f}, top-1 agreement {s['eval_top1_agreement']:.1%}")

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
