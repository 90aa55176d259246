"""Every record a job writes, built in one place (``RecordBuilder``): its settings and environment
(the fields that pair it with an AR record and find it on resume), then either what its run
measured and its pairing with its AR record, or the failure that stopped it. The schema is
``docs/records.md``; reading, pairing keys and the index are ``records``."""

from __future__ import annotations

import math
import time
import uuid

import torch
from omegaconf import DictConfig, OmegaConf

from specbench import kernels, methods
from specbench.decode.verify import Sampling
from specbench.engines.vllm import engine as vllm_engine
from specbench.errors import ConfigError
from specbench.run import data as D, quality
from specbench.run import records as R
from specbench.run.measure import _spec_len, accept_of
from specbench.run.workload import Serving


class RecordBuilder:
    """The records of one job (its settings ``cfg``, on ``device`` in ``dtype``, of sweep ``sweep_id``)."""

    def __init__(self, cfg: DictConfig, device, dtype, sweep_id: str):
        self.cfg, self.device, self.dtype, self.sweep_id = cfg, device, dtype, sweep_id

    @classmethod
    def of(cls, job) -> "RecordBuilder":
        return cls(job.cfg, job.device, job.dtype, job.sweep_id)

    def settings(self, method_name: str, refused: bool = False) -> dict:
        """A record of method ``method_name`` with the job's settings and environment, not yet
        measured. A refused job's record (``refused``) keeps the kernel setting as given (resolving
        ``auto`` can build the native extension), and a setting that does not convert (K='x', a
        missing path: what refused it) as given (``???`` where one is missing)."""
        cfg, device = self.cfg, self.device

        def of(make, key: str | None = None):
            if not refused:
                return make()
            try:
                return make()
            except Exception:  # noqa: BLE001 - the settings that refused the job may not convert
                return _raw(cfg, key) if key else None

        on_vllm = of(lambda: vllm_engine.wanted(cfg)) or False
        resolve_kernel = not refused and not on_vllm  # vLLM runs its own kernels
        accept = of(lambda: accept_of(cfg))
        serving = of(lambda: serving_of(cfg))
        return {
            "schema": R.SCHEMA, "sweep_id": self.sweep_id, "job_id": uuid.uuid4().hex[:16],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "status": "ok", "error": None, "method": method_name,
            "model": of(lambda: cfg.model.path or cfg.model.name, "model.path") or _raw(cfg, "model.name"),
            "draft": of(lambda: _draft_label(cfg, method_name)),
            "K": of(lambda: _spec_len(cfg, method_name, device), "K"), "bs": of(lambda: int(cfg.bs), "bs"),
            "ctx": of(lambda: cfg.ctx, "ctx"),
            "dataset": of(lambda: D.label(cfg.dataset), "dataset.name"),
            "limit": of(lambda: cfg.limit, "limit"),
            # flat, as before the settings moved into the sampling node (records pair across)
            "temperature": of(lambda: Sampling.of(cfg).temperature, "sampling.temperature"),
            "top_k": of(lambda: Sampling.of(cfg).top_k, "sampling.top_k"),
            "top_p": of(lambda: Sampling.of(cfg).top_p, "sampling.top_p"),
            "max_new_tokens": of(lambda: int(cfg.max_new_tokens), "max_new_tokens"),
            "dtype": str(self.dtype).replace("torch.", ""), "device": device.type,
            "kernel": None if on_vllm else _kernel_of(cfg, device) if resolve_kernel else _raw(cfg, "kernel"),
            "kernel_isa": _kernel_isa(cfg, device) if resolve_kernel else None,
            # only when not eager (older records pair as eager): true (torch.compile) or "graphs" (captured forwards)
            **({"compile": cfg.get("compile")} if of(lambda: cfg.get("compile")) else {}),
            # accept=synthetic: only for a method that drafts (AR decodes the same either way, and pairs)
            **({"accept": accept} if accept and method_name != "ar" else {}),
            **(_vllm_fields(cfg) if on_vllm else {}),  # only for backend=vllm: older records are our engine's
            "method_opts": of(lambda: OmegaConf.to_container(cfg.method, resolve=True), "method")
            if method_name == _raw(cfg, "method.name") else {"name": method_name},
            "seed": of(lambda: int(cfg.seed), "seed"),
            "dataset_cfg": of(lambda: OmegaConf.to_container(cfg.dataset, resolve=True), "dataset"),
            "model_cfg": of(lambda: OmegaConf.to_container(cfg.model, resolve=True), "model"), "lossless": True,
            "method_cfg": {},
            **({"repeats": repeats} if (repeats := of(lambda: int(cfg.get("repeats") or 1)) or 1) > 1 else {}),
            **({"serving": serving} if serving else {}),
            # K=auto: true, or the cost model it was priced on (tune.cost); what was chosen, and why
            **({"K_auto": of(lambda: cfg.K_auto), "tuned": of(lambda: OmegaConf.to_container(cfg.tuned))}
               if of(lambda: cfg.get("K_auto")) and method_name == _raw(cfg, "method.name") and method_name != "ar"
               else {}),
            "env": R.env_info(device), "metrics": None, "requests": [],
        }

    def measured(self, method_name: str, metrics: dict, requests: list[dict], proposer, questions) -> dict:
        """The record of a finished run: ``metrics`` and ``requests`` (their scratch text dropped,
        once the task score has read it), and the method's side (``proposer``: ``describe()``,
        ``lossless``)."""
        rec = self.settings(method_name)
        # task score (GSM8K accuracy, HumanEval pass@1) where the data set has one; outside the timing
        metrics["quality"] = quality.score(self.cfg.dataset.name, {q.id: q for q in questions}, requests)
        for r in requests:
            r.pop("_text", None)
        rec["metrics"], rec["requests"] = metrics, requests
        rec["lossless"] = bool(proposer.lossless) and "accept" not in rec
        rec["method_cfg"] = proposer.describe()
        return rec

    def failed(self, method_name: str, status: str, msg: str) -> dict:
        """The record of a job that failed (``status``: error, oom) with one line, ``msg``; its
        device and dtype may not be known yet (CPU and float32 then)."""
        b = RecordBuilder(self.cfg, self.device or torch.device("cpu"), self.dtype or torch.float32, self.sweep_id)
        rec = b.settings(method_name, refused=True)
        rec["status"], rec["error"] = status, msg
        return rec


def against_ar(rec: dict, ar: dict | None) -> None:
    """A measured record's speedup, token match and quality against its AR record ``ar`` (AR's
    own: 1; None: none found)."""
    if rec["method"] == "ar":
        rec["metrics"]["speedup"] = 1.0
        if rec["temperature"] == 0:
            rec["metrics"]["match_ar"] = 1.0
        return
    if ar is None:
        return
    m, a = rec["metrics"], ar["metrics"]
    if m.get("tokens_per_s") and a.get("tokens_per_s"):
        m["speedup"] = m["tokens_per_s"] / a["tokens_per_s"]
    if rec["temperature"] == 0:
        ref = {(r["id"], r["turn"], r.get("repeat", 0)): r for r in ar["requests"]}
        same = [R.ar_request(ref, r).get("out_sha") == r["out_sha"] for r in rec["requests"]]
        m["match_ar"] = sum(same) / len(same) if same else None
        m["divergence"] = R.divergence(rec["requests"], ref)
    q, qa = m.get("quality"), a.get("quality")
    if q and qa:
        q["ar_value"] = qa.get("value")
    rec["ar_sweep_id"] = ar.get("sweep_id")
    rec["ar_job_id"] = ar.get("job_id")  # the exact AR record (a sweep can hold several with the same settings)
    rec["ar_paired"] = rec.get("paired_with") == ar.get("job_id")  # run beside it, or an AR job run apart


def serving_of(cfg) -> dict | None:
    """How a job was loaded (in the record and its AR pairing key): for a continuous job, requests
    in flight (``bs``), arrivals, and how joining requests are prefilled (``separate``: together in
    a left-padded forward of their own; ``chunked``: each alone, ``prefill_chunk`` tokens between
    decoding steps). A static job has it only when its prompts are prefilled in pieces; None
    otherwise (so older records still pair)."""
    srv = Serving.of(cfg)
    chunk, rate = srv.prefill_chunk, srv.rate
    how = {"prefill": "chunked", "prefill_chunk": chunk} if chunk is not None else {"prefill": "separate"}
    if not srv.continuous:
        return {"batching": "static", **how} if chunk is not None else None
    return {"batching": "continuous", "concurrency": int(cfg.bs), "rate": rate if math.isfinite(rate) else "inf",
            **how}


def _draft_label(cfg, method_name):
    try:
        return methods.get(method_name).draft_label(cfg)
    except Exception:  # noqa: BLE001 - a method that cannot even be imported is recorded as failed
        return None


def _kernel_of(cfg, device) -> str | None:
    """The resolved linear-layer kernel path of a job (the raw setting when it cannot be)."""
    try:
        return kernels.resolve(cfg.get("kernel", "torch"), device)
    except ConfigError:
        return cfg.get("kernel")


def _kernel_isa(cfg, device) -> str | None:
    """The vector instructions the job's kernel path runs its linears with (native tiles are AVX2 or
    AVX-512 by CPU), None where torch or oneDNN choose."""
    try:
        return kernels.kernel_isa(kernels.resolve(cfg.get("kernel", "torch"), device))
    except ConfigError:
        return None


def _raw(cfg, key: str):
    """A setting as given, unresolved (None where it cannot be read)."""
    try:
        v = OmegaConf.select(cfg, key, throw_on_missing=False, throw_on_resolution_failure=False)
    except Exception:  # noqa: BLE001
        return None
    return OmegaConf.to_container(v, resolve=False) if isinstance(v, DictConfig) else v


def _vllm_fields(cfg) -> dict:
    try:
        ver = vllm_engine.version(vllm_engine.python_of(cfg))
    except ConfigError:  # a refused job's record: no vLLM to ask
        ver = None
    return {"backend": "vllm", "backend_version": ver, "vllm_cfg": vllm_engine.settings(cfg)}
