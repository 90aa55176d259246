"""Optional experiment loggers. `logger=wandb` sends each job's config, metrics, acceptance
per position and time split to Weights & Biases (set WANDB_MODE=offline to log locally)."""

from __future__ import annotations

from omegaconf import OmegaConf

from specbench.errors import ConfigError


def check(cfg) -> None:
    if cfg.logger.name == "wandb":
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("logger=wandb needs the wandb package (pip install wandb)") from None


def log_record(cfg, rec: dict) -> None:
    if cfg.logger.name != "wandb" or rec.get("status") != "ok":
        return
    import wandb

    m = rec["metrics"]
    name = f"{rec['method']}-bs{rec['bs']}" + (f"-K{rec['K']}" if rec.get("K") else "") + \
        (f"-ctx{rec['ctx']}" if rec.get("ctx") else "")
    config = {k: v for k, v in rec.items() if k not in ("metrics", "requests")}
    config["hydra_cfg"] = OmegaConf.to_container(cfg, resolve=True)
    run = wandb.init(project=cfg.logger.project, entity=cfg.logger.get("entity"), group=rec["sweep_id"], name=name,
                     config=config, reinit="finish_previous", dir=cfg.results_dir,
                     tags=[rec["method"], str(rec["model"]).split("/")[-1], rec["dataset"]])
    scalars = {k: v for k, v in m.items() if isinstance(v, (int, float)) and v is not None}
    scalars.update({f"time_s/{k}": v for k, v in m["time_s"].items()})
    scalars.update({f"accept_rate/pos_{i + 1}": a for i, a in enumerate(m["accept_rate_per_pos"])})
    for k, v in (m.get("nvml") or {}).items():
        if v is not None:
            scalars[f"nvml/{k}"] = v
    run.summary.update(scalars)
    table = wandb.Table(columns=["position", "accept_rate"],
                        data=[[i + 1, a] for i, a in enumerate(m["accept_rate_per_pos"])])
    run.log({**scalars, "accept_rate_per_pos": table,
             "accept_len_hist": wandb.Table(columns=["accepted", "steps"],
                                            data=[[i, n] for i, n in enumerate(m["accept_len_hist"])])})
    run.finish()
