"""One sweep job (``run``, Hydra's entry): validate (``validation``), load (cached across the jobs
of a sweep) into a ``Job``, pair with its AR baseline (found, run once under a lock, or run in
turns: ``ar_baseline=paired``; ``_run_job``), time the method on the engine (``method_records``
over ``measure``'s timed runs), and append the record; a failure is recorded and the
sweep goes on. Records are built by ``recordbuild``; the table at the end is ``summary``.
Re-exported here: ``validate``, ``MethodRun``, ``build_requests``, ``Job``
(their modules hold them)."""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from specbench import kernels, loggers
from specbench.engines.vllm import engine as vllm_engine
from specbench.errors import ConfigError
from specbench.models import cached_model, load_tokenizer, resolve_device, resolve_dtype
from specbench.paths import file_lock
from specbench.run import records as R, tune
from specbench.run.measure import MethodRun, _spec_len, run_methods
from specbench.run.recordbuild import RecordBuilder, against_ar
from specbench.run.validation import check_prompts, validate
from specbench.run.workload import Job, build_requests

__all__ = ["run", "method_records", "sweep_id_of", "FAILED", "SweepAborted", "Job"]

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


def method_records(job: Job, names: list[str]) -> list[dict]:
    """One record per method of ``names`` (taking turns unit by unit when there are several)."""
    run_cls = vllm_engine.VllmRun if vllm_engine.wanted(job.cfg) else MethodRun
    build = RecordBuilder.of(job)
    return [build.measured(name, metrics, requests, proposer, job.questions)
            for name, (metrics, requests, proposer) in zip(names, run_methods(job, names, run_cls))]


# ---------------------------------------------------------------------------- a job
def sweep_id_of(cfg) -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        return Path(HydraConfig.get().sweep.dir).name
    except Exception:  # noqa: BLE001 - outside Hydra (tests)
        return time.strftime("%Y-%m-%d_%H-%M-%S-") + f"{time.time_ns() // 1000 % 1000000:06d}"


def run(cfg: DictConfig, sweep_id: str | None = None) -> list[dict]:
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
                                            kernels.resolve(cfg.get("kernel", "torch"), device),
                                            cfg.get("compile", False) is True)  # graphs: captured by the engine
        if tune.wanted(cfg):  # K=auto: the setting chosen now (piloted on held-out prompts), then checked as any
            cfg, _ = tune.choose(Job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id))
            check_prompts(cfg, questions, tokenizer, npos, device)
    except ConfigError as e:
        return [_fail(RecordBuilder(cfg, device, dtype, sweep_id), method_name, "error", str(e))]
    except (torch.OutOfMemoryError, MemoryError) as e:
        msg = _one_line(e)
        _free(device)
        return [_fail(RecordBuilder(cfg, device, dtype, sweep_id), method_name, "oom", f"loading: {msg}")]
    except Exception as e:  # noqa: BLE001 - a method that fails to import, a model that fails to load
        traceback.print_exc(file=sys.stderr)
        return [_fail(RecordBuilder(cfg, device, dtype, sweep_id), method_name, "error", f"loading: {_one_line(e)}")]
    loaded = Job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id)
    if not bool(cfg.get("resume", False)):
        return _run_job(loaded, False)
    # resume: decide and run under this job's lock, so that two sweeps resumed at once never both run it
    probe = RecordBuilder.of(loaded).settings(method_name)
    tag = hashlib.sha1(repr((R.job_key(probe), R.env_key(probe))).encode()).hexdigest()[:12]
    with file_lock(Path(f"{cfg.records}.job-{tag}.lock")):
        # this job's ok record from an earlier run (same settings, machine and code)
        done = R.find_done(R.index(cfg.records), probe)
        if done is not None:
            print(f"[specbench] resume: {_job_name(cfg, method_name, device)} is already recorded (sweep "
                  f"{done.get('sweep_id')}); skipped", file=sys.stderr)
            return []
        return _run_job(loaded, True)


def _run_job(job: Job, resume: bool) -> list[dict]:
    """A validated, loaded job: its AR baseline (found, run, or paired) and the method."""
    cfg, method_name = job.cfg, job.method
    paired = cfg.ar_baseline == "paired" and method_name != "ar"
    probe = RecordBuilder.of(job).settings("ar")
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
    recs = _measured(job, name, lambda: method_records(job, [name]))
    return None if recs is None else _keep(job, recs[0], ar)


def _run_paired(job: Job, name: str) -> dict | None:
    """Measure AR and a method taking turns on the same batches (``ar_baseline=paired``):
    both records are written, the method's speedup is against this AR record."""
    recs = _measured(job, name, lambda: method_records(job, ["ar", name]))
    if recs is None:
        return None
    ar, rec = recs
    ar["paired_with"], rec["paired_with"] = rec["job_id"], ar["job_id"]
    if _keep(job, ar, None) is None:
        return None
    return _keep(job, rec, ar)


def _measured(job: Job, name: str, attempt) -> list[dict] | None:
    """``attempt()``'s records, or None after recording its failure under ``name`` (the sweep goes
    on) unless the failure leaves the device unusable."""
    failure = None
    try:
        return attempt()
    except KeyboardInterrupt:
        _fail(RecordBuilder.of(job), name, "error", "interrupted (KeyboardInterrupt)")
        raise
    except (torch.OutOfMemoryError, MemoryError) as e:
        failure = ("oom", _one_line(e))
    except ConfigError as e:
        failure = ("error", str(e))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        traceback.print_exc(file=sys.stderr)
        failure = ("error", _one_line(e))
        if _poisons_device(e):
            job.written.append(_fail(RecordBuilder.of(job), name, *failure))
            raise SweepAborted(f"{failure[1]}: the CUDA context is unusable after a device-side error, so "
                               "no later job can run in this process; records so far are kept; fix the "
                               "cause and rerun the sweep") from None
    # out of the except block: the traceback (and the KV cache it holds) is gone
    _free(job.device)
    job.written.append(_fail(RecordBuilder.of(job), name, *failure))
    return None


def _keep(job: Job, rec: dict, ar: dict | None) -> dict | None:
    """Pair ``rec`` with the AR record ``ar``, append and log it; None when it could not be written."""
    against_ar(rec, ar)
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


def _fail(build: RecordBuilder, method_name: str, status: str, msg: str) -> dict:
    """Record a failed job (``build``: its records' builder) and say so; the sweep goes on."""
    print(f"specbench: {status}: {msg}", file=sys.stderr, flush=True)
    FAILED.append(msg)
    rec = build.failed(method_name, status, msg)
    _append(build.cfg, rec)
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


