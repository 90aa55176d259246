"""One sweep job: validate (``validation``), load (cached across the jobs of a sweep), pair with
its AR baseline (found, run once under a lock, or run in turns: ``ar_baseline=paired``), run the
method through the engine (``measure``), and append the record; a failure is recorded and the
sweep goes on. The table at the end: ``summary``. Re-exported here: ``validate``, ``MethodRun``,
``build_requests``, ``Job`` (their modules hold them)."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specbench import backends, loggers, methods
from specbench.engines.vllm import engine as vllm_engine
from specbench.errors import ConfigError
from specbench.models import cached_model, load_tokenizer, resolve_device, resolve_dtype
from specbench.paths import file_lock
from specbench.run import data as D, quality, tune
from specbench.run import records as R
from specbench.run.measure import MethodRun, _spec_len, accept_of, run_methods
from specbench.run.validation import check_prompts, validate
from specbench.run.workload import Job, build_requests, rate_of

__all__ = ["job", "measure", "fill_against_ar", "sweep_id_of", "FAILED", "SweepAborted", "Job"]

FAILED: list[str] = []  # one-line errors of this sweep's jobs (sets the exit code)

# `device=cuda:${mod:${hydra:job.num},4}`: one GPU per job of a parallel launcher (joblib)
if not OmegaConf.has_resolver("mod"):
    OmegaConf.register_new_resolver("mod", lambda a, b: int(a) % int(b))
# `limit=${max:${bs},4}`: a sweep over batch sizes with a full batch of prompts each, and at least 4
if not OmegaConf.has_resolver("max"):
    OmegaConf.register_new_resolver("max", lambda *a: max(int(x) for x in a))


def _job_name(cfg, method_name, device) -> str:
    k = _spec_len(cfg, method_name, device)
    return f"{method_name} bs={cfg.bs}" + (f" K={k}" if k is not None else "") + (f" ctx={cfg.ctx}" if cfg.ctx else "")


def _draft_label(cfg, method_name):
    try:
        return methods.get(method_name).draft_label(cfg)
    except Exception:  # noqa: BLE001 - a method that cannot even be imported is recorded as failed
        return None


def _kernel_of(cfg, device) -> str | None:
    """The resolved linear-layer kernel path of a job (the raw setting when it cannot be)."""
    try:
        return backends.resolve(cfg.get("kernel", "torch"), device)
    except ConfigError:
        return cfg.get("kernel")


def _kernel_isa(cfg, device) -> str | None:
    """The vector instructions the job's kernel path runs its linears with (native tiles are AVX2 or
    AVX-512 by CPU), None where torch or oneDNN choose."""
    try:
        return backends.kernel_isa(backends.resolve(cfg.get("kernel", "torch"), device))
    except ConfigError:
        return None


def _record_base(cfg, method_name, device, dtype, sweep_id, refused: bool = False) -> dict:
    """The record's settings and environment: one builder for every job. A refused job's record
    (``refused``) keeps the kernel setting as given (resolving ``auto`` can build the native
    extension), and a setting that does not convert (K='x', a missing path: what refused it) as
    given (``???`` where one is missing)."""

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
        "schema": R.SCHEMA, "sweep_id": sweep_id, "job_id": uuid.uuid4().hex[:16], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "ok", "error": None, "method": method_name,
        "model": of(lambda: cfg.model.path or cfg.model.name, "model.path") or _raw(cfg, "model.name"),
        "draft": of(lambda: _draft_label(cfg, method_name)),
        "K": of(lambda: _spec_len(cfg, method_name, device), "K"), "bs": of(lambda: int(cfg.bs), "bs"),
        "ctx": of(lambda: cfg.ctx, "ctx"),
        "dataset": of(lambda: D.label(cfg.dataset), "dataset.name"),
        "limit": of(lambda: cfg.limit, "limit"), "temperature": of(lambda: float(cfg.temperature), "temperature"),
        "top_k": of(lambda: int(cfg.top_k), "top_k"), "top_p": of(lambda: float(cfg.top_p), "top_p"),
        "max_new_tokens": of(lambda: int(cfg.max_new_tokens), "max_new_tokens"),
        "dtype": str(dtype).replace("torch.", ""), "device": device.type,
        "kernel": None if on_vllm else _kernel_of(cfg, device) if resolve_kernel else _raw(cfg, "kernel"),
        "kernel_isa": _kernel_isa(cfg, device) if resolve_kernel else None,
        # only when not eager (older records pair as eager): true (torch.compile) or "graphs" (captured forwards)
        **({"compile": cfg.get("compile")} if of(lambda: cfg.get("compile")) else {}),
        # accept=synthetic: only for a method that drafts (AR decodes the same either way, and pairs)
        **({"accept": accept} if accept and method_name != "ar" else {}),
        **(_vllm_fields(cfg) if on_vllm else {}),  # only for backend=vllm: older records are our engine's
        "method_opts": of(lambda: OmegaConf.to_container(cfg.method, resolve=True), "method")
        if method_name == _raw(cfg, "method.name") else {"name": method_name},
        "seed": of(lambda: int(cfg.seed), "seed"), "dataset_cfg": of(lambda: OmegaConf.to_container(cfg.dataset, resolve=True),
                                                                     "dataset"),
        "model_cfg": of(lambda: OmegaConf.to_container(cfg.model, resolve=True), "model"), "lossless": True,
        "method_cfg": {},
        **({"repeats": repeats} if (repeats := of(lambda: int(cfg.get("repeats") or 1)) or 1) > 1 else {}),
        **({"serving": serving} if serving else {}),
        **({"K_auto": True, "tuned": of(lambda: OmegaConf.to_container(cfg.tuned))}  # K=auto: what was chosen, and why
           if of(lambda: cfg.get("K_auto")) and method_name == _raw(cfg, "method.name") and method_name != "ar" else {}),
        "env": R.env_info(device), "metrics": None, "requests": [],
    }


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


def serving_of(cfg) -> dict | None:
    """How a job was loaded (in the record and its AR pairing key): for a continuous job, requests
    in flight (``bs``), arrivals, and how joining requests are prefilled (``separate``: together in
    a left-padded forward of their own; ``chunked``: each alone, ``prefill_chunk`` tokens between
    decoding steps). A static job has it only when its prompts are prefilled in pieces; None
    otherwise (so older records still pair)."""
    chunk = cfg.get("prefill_chunk")
    how = {"prefill": "chunked", "prefill_chunk": int(chunk)} if chunk is not None else {"prefill": "separate"}
    if cfg.get("batching", "static") != "continuous":
        return {"batching": "static", **how} if chunk is not None else None
    rate = rate_of(cfg)
    return {"batching": "continuous", "concurrency": int(cfg.bs), "rate": rate if math.isfinite(rate) else "inf",
            **how}


def measure(job: Job, names: list[str]) -> list[dict]:
    """One record per method of ``names`` (taking turns unit by unit when there are several)."""
    cfg = job.cfg
    out = []
    run_cls = vllm_engine.VllmRun if vllm_engine.wanted(cfg) else MethodRun
    for name, (metrics, requests, proposer) in zip(names, run_methods(job, names, run_cls)):
        rec = _record_base(cfg, name, job.device, job.dtype, job.sweep_id)
        # task score (GSM8K accuracy, HumanEval pass@1) where the data set has one; outside the timing
        metrics["quality"] = quality.score(cfg.dataset.name, {q.id: q for q in job.questions}, requests)
        for r in requests:
            r.pop("_text", None)
        rec["metrics"], rec["requests"] = metrics, requests
        rec["lossless"] = bool(proposer.lossless) and "accept" not in rec
        rec["method_cfg"] = proposer.describe()
        out.append(rec)
    return out


def fill_against_ar(rec: dict, ar: dict) -> None:
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


# ---------------------------------------------------------------------------- a job
def sweep_id_of(cfg) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().sweep.dir).name
    except Exception:  # noqa: BLE001 - outside Hydra (tests)
        return time.strftime("%Y-%m-%d_%H-%M-%S-") + f"{time.time_ns() // 1000 % 1000000:06d}"


def job(cfg: DictConfig, sweep_id: str | None = None) -> list[dict]:
    """Run one sweep point (plus its AR baseline when missing); returns the records written."""
    sweep_id = sweep_id or sweep_id_of(cfg)
    method_name = cfg.method.name
    device = dtype = None
    try:
        npos = validate(cfg)
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.dtype, device)
        if device.type == "cuda":  # CUDA events and synchronize() act on the current device
            torch.cuda.set_device(device)
        tokenizer = load_tokenizer(cfg.model)
        questions = build_requests(cfg, tokenizer)
        if cfg.bs > len(questions):  # it would run a smaller batch than the record says
            raise ConfigError(f"bs={cfg.bs} is larger than the {len(questions)} prompts of dataset={cfg.dataset.name} "
                              f"limit={cfg.limit}: raise limit (null = all) or lower bs")
        check_prompts(cfg, questions, tokenizer, npos, device)
        if vllm_engine.wanted(cfg):  # vLLM loads the model in its own process
            model = None
        else:
            model, tokenizer = cached_model(cfg.model, device, dtype,
                                            backends.resolve(cfg.get("kernel", "torch"), device),
                                            cfg.get("compile", False) is True)  # graphs: captured by the engine
        if tune.wanted(cfg):  # K=auto: the setting chosen now (piloted on held-out prompts), then checked as any
            cfg, _ = tune.choose(Job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id))
            check_prompts(cfg, questions, tokenizer, npos, device)
    except ConfigError as e:
        return [_fail(cfg, method_name, device, dtype, sweep_id, "error", str(e))]
    except (torch.OutOfMemoryError, MemoryError) as e:
        msg = _one_line(e)
        _free(device)
        return [_fail(cfg, method_name, device, dtype, sweep_id, "oom", f"loading: {msg}")]
    except Exception as e:  # noqa: BLE001 - a method that fails to import, a model that fails to load
        traceback.print_exc(file=sys.stderr)
        return [_fail(cfg, method_name, device, dtype, sweep_id, "error", f"loading: {_one_line(e)}")]
    loaded = Job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id)
    if not bool(cfg.get("resume", False)):
        return _job(loaded, False)
    # resume: decide and run under this job's lock, so that two sweeps resumed at once never both run it
    probe = _record_base(cfg, method_name, device, dtype, sweep_id)
    tag = hashlib.sha1(repr((R.job_key(probe), R.env_key(probe))).encode()).hexdigest()[:12]
    with file_lock(Path(f"{cfg.records}.job-{tag}.lock")):
        # this job's ok record from an earlier run (same settings, machine and code)
        done = R.find_done(R.index(cfg.records), probe)
        if done is not None:
            print(f"[specbench] resume: {_job_name(cfg, method_name, device)} is already recorded (sweep "
                  f"{done.get('sweep_id')}); skipped", file=sys.stderr)
            return []
        return _job(loaded, True)


def _job(job: Job, resume: bool) -> list[dict]:
    """A validated, loaded job: its AR baseline (found, run, or paired) and the method."""
    cfg, method_name = job.cfg, job.method
    paired = cfg.ar_baseline == "paired" and method_name != "ar"
    probe = _record_base(cfg, "ar", job.device, job.dtype, job.sweep_id)
    scope = None if cfg.ar_baseline == "any" or resume else job.sweep_id
    ar = None if paired else _find_ar(cfg, probe, scope)
    n_turns = sum(len(q.turns) for q in job.questions)
    n_runs = (1 if method_name == "ar" or ar is not None else 2) * int(cfg.get("repeats") or 1)
    job.bar = _bar(n_runs * n_turns, _job_name(cfg, method_name, job.device), cfg.progress)
    try:
        if paired:  # its own AR baseline, taking turns with it batch by batch
            _run_paired(job, method_name)
            return job.written
        if ar is None or method_name == "ar":
            # each AR baseline runs once: a job (of this process or a parallel worker) that finds
            # none takes that baseline's lock, looks again, and runs it if it is still missing
            tag = hashlib.sha1(repr(R.baseline_key(probe)).encode()).hexdigest()[:12]
            with file_lock(Path(f"{cfg.records}.ar-{tag}.lock")):
                ar = _find_ar(cfg, probe, scope)
                if method_name == "ar" and ar is not None and ar.get("sweep_id") == job.sweep_id:
                    print(f"[specbench] ar bs={cfg.bs}: the same AR job already ran in this sweep; reusing it",
                          file=sys.stderr)
                    return job.written
                if ar is None:
                    ar = _run_one(job, "ar", None)
        if method_name != "ar":
            _run_one(job, method_name, ar)
    finally:
        job.bar.close()
    return job.written


def _find_ar(cfg, probe, scope) -> dict | None:
    """The whole AR record that pairs with ``probe`` (``records.find_ar`` over the index)."""
    entry = R.find_ar(R.index(cfg.records), probe, scope)
    return None if entry is None else R.load(cfg.records, entry)


def _run_one(job: Job, name: str, ar: dict | None) -> dict | None:
    """Measure one method, pair it with the AR record ``ar``, append and log the record."""
    recs = _measured(job, name, lambda: measure(job, [name]))
    return None if recs is None else _keep(job, recs[0], ar)


def _run_paired(job: Job, name: str) -> dict | None:
    """Measure AR and a method taking turns on the same batches (``ar_baseline=paired``):
    both records are written, the method's speedup is against this AR record."""
    recs = _measured(job, name, lambda: measure(job, ["ar", name]))
    if recs is None:
        return None
    ar, rec = recs
    ar["paired_with"], rec["paired_with"] = rec["job_id"], ar["job_id"]
    if _keep(job, ar, None) is None:
        return None
    return _keep(job, rec, ar)


def _measured(job: Job, name: str, run) -> list[dict] | None:
    """``run()``'s records, or None after recording its failure under ``name`` (the sweep goes
    on) unless the failure leaves the device unusable."""
    failure = None
    try:
        return run()
    except KeyboardInterrupt:
        _fail(job.cfg, name, job.device, job.dtype, job.sweep_id, "error", "interrupted (KeyboardInterrupt)")
        raise
    except (torch.OutOfMemoryError, MemoryError) as e:
        failure = ("oom", _one_line(e))
    except ConfigError as e:
        failure = ("error", str(e))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        traceback.print_exc(file=sys.stderr)
        failure = ("error", _one_line(e))
        if _poisons_device(e):
            job.written.append(_fail(job.cfg, name, job.device, job.dtype, job.sweep_id, *failure))
            raise SweepAborted(f"{failure[1]}: the CUDA context is unusable after a device-side error, so "
                               "no later job can run in this process; records so far are kept; fix the "
                               "cause and rerun the sweep") from None
    # out of the except block: the traceback (and the KV cache it holds) is gone
    _free(job.device)
    job.written.append(_fail(job.cfg, name, job.device, job.dtype, job.sweep_id, *failure))
    return None


def _keep(job: Job, rec: dict, ar: dict | None) -> dict | None:
    """Pair ``rec`` with the AR record ``ar``, append and log it; None when it could not be written."""
    if rec["method"] == "ar":
        rec["metrics"]["speedup"] = 1.0
        if rec["temperature"] == 0:
            rec["metrics"]["match_ar"] = 1.0
    elif ar is not None:
        fill_against_ar(rec, ar)
    if not _append(job.cfg, rec):
        return None
    job.written.append(rec)
    try:
        loggers.log_record(job.cfg, rec)
    except Exception as e:  # noqa: BLE001 - a logger never costs a measurement
        print(f"specbench: warning: logger failed: {_one_line(e)}", file=sys.stderr)
    return rec


def _bar(total, desc, enabled):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


class SweepAborted(RuntimeError):
    """A failure after which no later job of this process can be trusted to run."""


def _poisons_device(e: BaseException) -> bool:
    """A device-side CUDA error (an assert in a kernel, an illegal address) leaves the
    context unusable: every later CUDA call in the process fails or hangs."""
    msg = str(e)
    return "device-side assert" in msg or "illegal memory access" in msg or \
        type(e).__name__ == "AcceleratorError" or msg.startswith("CUDA error")


def _free(device) -> None:
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


def _fail(cfg, method_name, device, dtype, sweep_id, status, msg) -> dict:
    print(f"specbench: {status}: {msg}", file=sys.stderr, flush=True)
    FAILED.append(msg)
    dev = device or torch.device("cpu")
    rec = _record_base(cfg, method_name, dev, dtype or torch.float32, sweep_id, refused=True)
    rec["status"], rec["error"] = status, msg
    _append(cfg, rec)
    return rec


def _append(cfg, rec: dict) -> bool:
    """Append the record; if that fails (disk full, read-only), print it whole to stderr
    so the measurement is not lost, and fail the job."""
    try:
        R.append(cfg.records, rec)
        return True
    except OSError as e:
        print(json.dumps(rec, default=str), file=sys.stderr, flush=True)
        msg = (f"could not append the {rec['method']} record to {cfg.records} ({_one_line(e)}); "
               "it is printed whole on the line above")
        print(f"specbench: error: {msg}", file=sys.stderr, flush=True)
        FAILED.append(msg)
        return False


