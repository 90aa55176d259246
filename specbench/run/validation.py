"""Checking a job before anything loads: every setting against the schema, the method's own
checks, and the positions a job needs (the context, each first-turn prompt, max_new_tokens and
the method's deepest draft node) against what its models can take. One ConfigError line."""

from __future__ import annotations

from omegaconf import DictConfig

from specbench import methods
from specbench.run import data as D
from specbench import kernels, loggers
from specbench.run import schema
from specbench.run import tune
from specbench.run.workload import Serving
from specbench.errors import ConfigError
from specbench.hf import check_rollback, text_config
from specbench.models import check_compile, load_config, resolve_device, resolve_dtype


def validate(cfg: DictConfig) -> int:
    """Every check that needs no model weights (and no conversion, no kernel build), cheapest
    first; raises ConfigError with one line. Returns the positions the job's models can take."""
    try:
        method = methods.get(cfg.method.name)
    except KeyError as e:  # unknown, or an outside class that does not import
        raise ConfigError(e.args[0]) from None
    schema.check(cfg)  # types and ranges of every setting but the method's own
    methods.check_keys(cfg.method, cfg.method.name)  # the method's: only the keys it declares ...
    methods.check_types(cfg.method, cfg.method.name)  # ... of the types and in the ranges it declares
    on_vllm = cfg.get("backend", "specbench") == "vllm"
    if on_vllm and (cfg.get("accept") or {}).get("name", "exact") != "exact":
        raise ConfigError("accept=synthetic draws acceptance in specbench's own verifier; backend=vllm verifies "
                          "in vLLM: drop accept=synthetic or use backend=specbench")
    if on_vllm:
        from specbench.engines.vllm import engine as vllm_engine

        vllm_engine.check(cfg, cfg.method.name)
    serving = Serving.of(cfg)  # checked above (schema.check)
    if serving.continuous and not method.joins_rows() and not on_vllm:
        raise ConfigError(f"method {cfg.method.name} keeps per-row state and has no add_rows, so rows cannot join "
                          "its running batch: run it with serving.batching=static, or give it add_rows (methods/base.py)")
    loggers.check(cfg)
    D.check(cfg.dataset)  # its file is there (a hub id is opened with the questions)
    device = resolve_device(cfg.device)
    resolve_dtype(cfg.dtype, device)
    compile_ = cfg.get("compile", False)  # the kernel resolved only when it matters (auto may build the extension)
    check_compile(compile_, kernels.resolve(cfg.get("kernel", "torch"), device) if compile_ else None, cfg.get("kernel"))
    if compile_ == "graphs" and serving.continuous:
        raise ConfigError("compile=graphs runs static batches (rows leave, none join), not serving.batching=continuous: "
                          "use serving.batching=static, or compile=true")
    if compile_ == "graphs" and serving.prefill_chunk:
        raise ConfigError("compile=graphs prefills whole prompts, not serving.prefill_chunk pieces: leave it unset "
                          "(serving.prefill_chunk=null), or use compile=true")
    mconf = load_config(cfg.model)
    if compile_ == "graphs" and "sliding_attention" in (getattr(text_config(mconf), "layer_types", None) or []):
        raise ConfigError("compile=graphs: models with sliding-window layers (Gemma 3) are not captured yet; "
                          "run them with compile=false or compile=true")
    check_rollback(mconf)
    cands = []  # K=auto: each candidate setting the method lists, those that pass its checks
    if tune.wanted(cfg):
        cands = [c for _, c in tune.check(cfg, mconf, device)]
    if not cands:
        method.check(cfg, mconf)  # a method owns its own config checks
        cands = [cfg]
    npos = method.positions(cfg, mconf)
    if cfg.ctx is not None:
        reach = max(method.reach(c, device) for c in cands)
        most = npos - cfg.max_new_tokens - reach - 1  # the longest context these settings leave room for
        if cfg.ctx > most:
            fits = f"ctx <= {most} fits" if most >= 1 else "no ctx fits"
            beyond = f"ctx={cfg.ctx} is beyond their context window; " if cfg.ctx >= npos else ""
            raise ConfigError(f"ctx={cfg.ctx} + max_new_tokens={cfg.max_new_tokens} + {reach} draft positions "
                              f"exceeds the {npos} positions of the job's models: {beyond}{fits} (lower "
                              "max_new_tokens for more)")
    return npos


def check_prompts(cfg, questions, tokenizer, npos: int, device) -> None:
    """Refuse, before any weights load, a first-turn prompt too long for the models' positions
    with max_new_tokens and the method's deepest draft node (later turns, which hold the
    answers, are checked as they come). ``K=auto``: after the setting is chosen."""
    if tune.wanted(cfg):
        return
    reach = methods.get(cfg.method.name).reach(cfg, device)
    chat = bool(cfg.model.get("chat", True))
    for q in questions:
        n = len(q.ctx_ids) if cfg.ctx is not None else len(D.render(tokenizer, [], q.turns[0], chat))
        if n == 0:
            raise ConfigError(f"question {q.id}: its prompt renders to no tokens with {type(tokenizer).__name__} "
                              "(a tokenizer that does not fit the model's files?)")
        if n + cfg.max_new_tokens + reach + 1 > npos:
            raise ConfigError(f"question {q.id}: a prompt of {n} tokens + max_new_tokens={cfg.max_new_tokens} + "
                              f"{reach} draft positions exceeds the {npos} positions of the job's models; lower "
                              "max_new_tokens or drop the question")
