"""One sweep job: validate, load (cached across the jobs of a sweep), run the method through
the engine over the prompt set in batches, measure, and append the record."""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

import methods
from specbench import data as D
from specbench import loggers, quality, schema
from specbench import kernels
from specbench import records as R
from specbench.models import (CONF_DIR, ConfigError, cached_model, check_compile, check_rollback, compiled_graphs,
                              eos_ids, file_lock, is_compiled, load_config, load_tokenizer,
                              resolve_device, resolve_dtype)
from specbench.monitor import NvmlMonitor
from specbench.timing import PHASES, PhaseTimer, sync
from specbench.verify import Sampling

AR_BASELINES = ("sweep", "any", "paired")
FAILED: list[str] = []  # one-line errors of this sweep's jobs (sets the exit code)

# `device=cuda:${mod:${hydra:job.num},4}`: one GPU per job of a parallel launcher (joblib)
if not OmegaConf.has_resolver("mod"):
    OmegaConf.register_new_resolver("mod", lambda a, b: int(a) % int(b))


# ---------------------------------------------------------------------------- validation

def validate(cfg: DictConfig) -> int:
    """Every check that needs no model weights (and no conversion, no kernel build), cheapest
    first; raises ConfigError with one line. Returns the positions the job's models can take."""
    if cfg.method.name not in methods.REGISTRY:
        raise ConfigError(f"unknown method '{cfg.method.name}'; choices: {', '.join(methods.names())}")
    schema.check(cfg)  # types and ranges of every setting but the method's own
    loggers.check(cfg)
    if cfg.dataset.name == "jsonl":
        if not Path(str(cfg.dataset.path)).expanduser().exists():
            raise ConfigError(f"dataset path '{cfg.dataset.path}' does not exist")
    device = resolve_device(cfg.device)
    resolve_dtype(cfg.dtype, device)
    compile_ = cfg.get("compile", False)  # the kernel resolved only when it matters (auto may build the extension)
    check_compile(compile_, kernels.resolve(cfg.get("kernel", "torch"), device) if compile_ is True else None)
    mconf = load_config(cfg.model)
    check_rollback(mconf)
    method = methods.get(cfg.method.name)
    method.check(cfg, mconf)  # a method owns its own config checks
    npos = method.positions(cfg, mconf)
    if cfg.ctx is not None:
        reach = method.reach(cfg, device)
        if cfg.ctx + cfg.max_new_tokens + reach + 1 > npos:
            raise ConfigError(f"ctx={cfg.ctx} + max_new_tokens={cfg.max_new_tokens} + {reach} draft positions "
                              f"exceeds the {npos} positions of the job's models")
    return npos


def check_prompts(cfg, questions, tokenizer, npos: int, device) -> None:
    """Refuse, before any weights load, a first-turn prompt too long for the models' positions
    with max_new_tokens and the method's deepest draft node (later turns, which hold the
    answers, are checked as they come)."""
    reach = methods.get(cfg.method.name).reach(cfg, device)
    chat = bool(cfg.model.get("chat", True))
    for q in questions:
        n = len(q.ctx_ids) if cfg.ctx is not None else len(D.render(tokenizer, [], q.turns[0], chat))
        if n + cfg.max_new_tokens + reach + 1 > npos:
            raise ConfigError(f"question {q.id}: a prompt of {n} tokens + max_new_tokens={cfg.max_new_tokens} + "
                              f"{reach} draft positions exceeds the {npos} positions of the job's models; lower "
                              "max_new_tokens or drop the question")


# ---------------------------------------------------------------------------- loading
# ---------------------------------------------------------------------------- measuring
class PeakMemory:
    """Peak GPU allocator memory, or peak process RSS sampled every 20 ms on the CPU: the
    highest over every block it has been entered for."""

    def __init__(self, device):
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        except OSError:
            return 0

    def __enter__(self):
        self._stop.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = max(self.peak, self.rss())

            def loop():
                while not self._stop.wait(0.02):
                    self.peak = max(self.peak, self.rss())

            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = max(self.peak, int(torch.cuda.max_memory_allocated(self.device)))
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.rss())


def encode_accepts(lens: list[int]) -> str:
    """Per-step accepted draft counts, one base-36 digit a step."""
    return "".join("0123456789abcdefghijklmnopqrstuvwxyz"[min(x, 35)] for x in lens)


def build_requests(cfg, tokenizer):
    qs = D.load_questions(cfg.dataset, cfg.limit)
    if cfg.ctx is not None:
        filler = tokenizer("\n\n".join(D.long_texts()[:8]), add_special_tokens=False)["input_ids"]
        for i, q in enumerate(qs):
            q.ctx_ids = D.render_ctx(tokenizer, q.turns[0], bool(cfg.model.get("chat", True)), cfg.ctx,
                                     filler[(i * 997) % max(1, len(filler) // 2):])
            q.turns = q.turns[:1]
    return qs


class MethodRun:
    """One method over the prompt set, a unit (one batch of prompts, every turn, one repeat) at
    a time, so that two runs can take turns on the same units (``ar_baseline=paired``). Each
    run keeps its own generator, torch's global RNG state, timer and monitors between units:
    its tokens and measurements do not depend on what ran in between."""

    def __init__(self, cfg: DictConfig, method_name: str, model, tokenizer, device, dtype, questions):
        from specbench.engine import Engine

        self.cfg, self.name, self.model, self.tokenizer, self.device = cfg, method_name, model, tokenizer, device
        self.questions = questions
        mcfg = OmegaConf.merge(cfg, {"method": OmegaConf.load(CONF_DIR / "method" / f"{method_name}.yaml")}) \
            if method_name != cfg.method.name else cfg
        self.proposer = methods.get(method_name)(mcfg, model, tokenizer, device, dtype)
        self.K = _spec_len(mcfg, method_name, device) or 0  # positions of the per-position acceptance
        sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p))
        self.chat = bool(cfg.model.get("chat", True))
        eos = eos_ids(model, tokenizer)
        method = methods.get(method_name)
        self.npos = method.positions(mcfg, model.config)
        self.reach = method.reach(mcfg, device)

        def engine(timer):
            return Engine(model, self.proposer, sampling, device, dtype, eos, timer)

        self.compiled = is_compiled(model)
        if cfg.warmup:  # the job's own shapes: a full batch of its ragged prompts (padding masks, tree masks)
            qs = questions[:int(cfg.bs)]  # the first batch, as the timed job will see it
            ids = [q.ctx_ids if cfg.ctx is not None else D.render(tokenizer, [], q.turns[0], self.chat) for q in qs]
            if self.compiled:  # every graph the timed job can need, with the method's taps in place
                warm_compiled(model, len(ids), device, dtype, self.proposer.hidden_layers)
            engine(PhaseTimer(device)).generate(ids, 8, torch.Generator(device).manual_seed(0))
        self.timer = PhaseTimer(device)
        self.eng = engine(self.timer)
        self.gen = torch.Generator(device).manual_seed(int(cfg.seed))
        torch.manual_seed(int(cfg.seed))
        self._rng = _rng_state(device)
        self.repeats = int(cfg.get("repeats") or 1)
        self.requests: list[dict] = []
        self.wall, self.n_batches = 0.0, 0
        self.rep_tokens, self.rep_wall = [0] * self.repeats, [0.0] * self.repeats
        self.mem, self.nvml = PeakMemory(device), NvmlMonitor(device)
        self.graphs_timed = 0  # graphs torch.compile made inside the timing (shapes the warm-up did not meet)

    def units(self) -> list[tuple[int, int]]:
        """(repeat, first question) of every batch, in order; repeats=N measures the set N times."""
        return [(rep, start) for rep in range(self.repeats) for start in range(0, len(self.questions), self.cfg.bs)]

    def run_unit(self, unit: tuple[int, int], progress=None) -> None:
        cfg, device, tokenizer = self.cfg, self.device, self.tokenizer
        rep, start = unit
        batch = self.questions[start:start + cfg.bs]
        n_batches_q = start // cfg.bs  # the batch a request belongs to: the unit error bars resample
        history = [[] for _ in batch]
        _set_rng_state(device, self._rng)
        with self.timer.watching([self.model, *self.proposer.modules()]), self.mem, self.nvml:
            for turn in range(max(len(q.turns) for q in batch)):
                rows = [i for i, q in enumerate(batch) if turn < len(q.turns)]
                if cfg.ctx is not None:
                    prompts = [batch[i].ctx_ids for i in rows]
                else:
                    prompts = [D.render(tokenizer, history[i], batch[i].turns[turn], self.chat) for i in rows]
                longest = max(len(p) for p in prompts)
                if longest + cfg.max_new_tokens + self.reach + 1 > self.npos:
                    raise ConfigError(f"a prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} + "
                                      f"{self.reach} draft positions exceeds the {self.npos} positions of the "
                                      "job's models")
                graphs = compiled_graphs() if self.compiled else 0
                sync(device)
                t = time.perf_counter()
                out = self.eng.generate(prompts, int(cfg.max_new_tokens), self.gen)
                sync(device)
                dt = time.perf_counter() - t
                if self.compiled:
                    self.graphs_timed += compiled_graphs() - graphs
                self.wall += dt
                self.rep_wall[rep] += dt
                self.n_batches += 1
                for i, r in zip(rows, out):
                    q = batch[i]
                    toks = r.tokens
                    text = tokenizer.decode(toks, skip_special_tokens=True)
                    history[i].append((q.turns[turn], text))
                    n = len(toks)
                    self.rep_tokens[rep] += n
                    prompt = prompts[rows.index(i)]
                    self.requests.append({
                        "id": q.id, "turn": turn + 1, "batch": n_batches_q,
                        **({"repeat": rep} if self.repeats > 1 else {}),
                        "category": q.category, "prompt_tokens": len(prompt),
                        "new_tokens": n, "steps": r.steps, "wall_s": r.t_done, "ttft_s": r.t_first,
                        "tpot_s": (r.t_done - r.t_first) / (n - 1) if n > 1 else None,
                        "accepted": sum(r.accept_lens), "accepts": encode_accepts(r.accept_lens),
                        "eos": r.hit_eos, "out_sha": hashlib.sha1(str(toks).encode()).hexdigest()[:16],
                        "prompt_sha": hashlib.sha1(str(prompt).encode()).hexdigest()[:16],
                        "tokens": toks,
                        "_lens": r.accept_lens, "_nodes": sum(r.drafted), "_fnodes": sum(r.nodes), "_text": text,
                    })
                if progress is not None:
                    progress.update(len(rows))
        self._rng = _rng_state(device)

    def metrics(self) -> tuple[dict, list[dict]]:
        """The job's metrics and its requests, once, after its last unit (it takes the
        requests' scratch fields)."""
        requests, wall = self.requests, self.wall
        times = self.timer.totals()
        all_lens = [x for rq in requests for x in rq.pop("_lens")]
        all_nodes = sum(rq.pop("_nodes") for rq in requests)
        fwd_nodes = sum(rq.pop("_fnodes") for rq in requests)
        row_steps = len(all_lens)
        depth = max([self.K] + all_lens)
        hist = Counter(all_lens)
        new_tokens = sum(rq["new_tokens"] for rq in requests)
        time_s = {p: times.get(p, 0.0) for p in PHASES}
        time_s["other"] = max(0.0, wall - sum(time_s.values()))
        time_s["forward"] = times.get("forward", 0.0)
        ttfts = [rq["ttft_s"] for rq in requests]
        tpots = [rq["tpot_s"] for rq in requests if rq["tpot_s"] is not None]
        metrics = {
            "new_tokens": new_tokens,
            "wall_s": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else None,
            "steps": row_steps,
            "iterations": self.eng.iterations,
            "batches": self.n_batches,
            "tau": 1.0 + sum(all_lens) / row_steps if row_steps else 1.0,
            "draft_nodes": all_nodes / row_steps if row_steps else 0.0,  # candidates verified per row per step
            "forward_nodes": fwd_nodes / row_steps if row_steps else 0.0,  # + non-candidate nodes (Lookahead's window)
            "accept_rate_per_pos": [sum(1 for x in all_lens if x >= i) / row_steps for i in range(1, depth + 1)]
            if row_steps else [],
            "accept_len_hist": [hist.get(i, 0) for i in range(depth + 1)],
            "time_s": time_s,
            "verify_share": time_s["verify"] / wall if wall > 0 else None,
            "engine_overhead": (wall - time_s["forward"]) / wall if wall > 0 else None,
            "ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
            "tpot_s": sum(tpots) / len(tpots) if tpots else None,
            "peak_mem_bytes": self.mem.peak,
            "energy_j": self.nvml.energy_j,
            "nvml": self.nvml.result,
            "speedup": None,
            "match_ar": None,
        }
        if self.compiled:
            metrics["compile"] = {"graphs_in_timing": self.graphs_timed}
            if self.graphs_timed:
                print(f"[specbench] warning: {self.name}: torch.compile made {self.graphs_timed} graph(s) inside the "
                      "timing (shapes its warm-up did not meet): its speed includes compiling; rerun with repeats=2 "
                      "and read the second pass (metrics.repeat_tokens_per_s)", file=sys.stderr)
        if self.repeats > 1:  # each pass over the prompt set on its own: the spread between repeats
            metrics["repeat_tokens_per_s"] = [t / w if w > 0 else None for t, w in zip(self.rep_tokens, self.rep_wall)]
        return metrics, requests


@torch.inference_mode()
def warm_compiled(model, bs: int, device, dtype, taps=()) -> None:
    """Compile, outside the timing, the graphs a job's forwards can need: torch.compile with
    dynamic shapes still makes one graph per kind of call, and specialises a size of 1. So:
    prefill and decode forwards at the job's batch size and at one row (rows leave the batch as
    they finish), dense and ragged (padding masks), one new token and several, chain and tree
    (a tree always takes a mask), with the method's hidden-state taps (``taps``) hooked."""
    from specbench.hidden import Tap
    from specbench.kv import RaggedCache

    def steps(cache):
        B = cache.batch_size
        for n in (1, 2, 3):
            for anc in (None, torch.ones(n, n, dtype=torch.bool, device=device).tril()[None].expand(B, n, n)):
                cache.forward(torch.ones(B, n, dtype=torch.long, device=device),
                              torch.arange(n, device=device)[None].expand(B, n), anc)
                cache.commit(torch.zeros(B, 1, dtype=torch.long, device=device),
                             torch.zeros(B, dtype=torch.long, device=device))

    with Tap(model, taps):
        for B in sorted({1, bs}):
            for ragged in (False, True) if B > 1 else (False,):
                cache = RaggedCache(model, device, dtype)
                cache.prefill([[1 + i % 7] * (8 + (i if ragged else 0)) for i in range(B)])
                steps(cache)
                # finished rows leave (the cache's layers then hold selected rows, another code path):
                # down to B - 1 rows (a size that stays dynamic) and to one row (a specialised size)
                for rows in sorted({B - 1, 1} - {0, B}, reverse=True):
                    cache.select_rows(torch.arange(rows, device=device))
                    steps(cache)


def _rng_state(device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def run_methods(cfg: DictConfig, names: list[str], model, tokenizer, device, dtype, questions, progress=None):
    """Run methods over all questions, taking turns unit by unit (ABBA: the first method runs
    first in even units, last in odd ones, so a drift of the host's speed hits them alike);
    returns one (metrics, requests, proposer) per method."""
    runs = [MethodRun(cfg, n, model, tokenizer, device, dtype, questions) for n in names]
    for i, unit in enumerate(runs[0].units()):
        for run in (runs if i % 2 == 0 else runs[::-1]):
            if progress is not None:
                progress.set_postfix_str(run.name)
            run.run_unit(unit, progress)
    return [(*run.metrics(), run.proposer) for run in runs]


def _spec_len(cfg, method_name, device) -> int | None:
    """The job's recorded K: the method's speculation length (None: it has no fixed one)."""
    try:
        return methods.get(method_name).spec_len(cfg, device)
    except Exception:  # noqa: BLE001 - as _draft_label
        return None


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
        return kernels.resolve(cfg.get("kernel", "torch"), device)
    except ConfigError:
        return cfg.get("kernel")


def _kernel_isa(cfg, device) -> str | None:
    """The vector instructions the job's kernel path runs its linears with (avx2's tiles are AVX2 or
    AVX-512 by CPU), None where torch or oneDNN choose."""
    try:
        return kernels.kernel_isa(kernels.resolve(cfg.get("kernel", "torch"), device))
    except ConfigError:
        return None


def _record_base(cfg, method_name, device, dtype, sweep_id, resolve_kernel: bool = True) -> dict:
    """The record's settings and environment. ``resolve_kernel=False`` (a refused job's record)
    keeps the kernel setting as given: resolving ``auto`` can build the avx2 extension."""
    return {
        "schema": R.SCHEMA, "sweep_id": sweep_id, "job_id": uuid.uuid4().hex[:16], "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "status": "ok", "error": None, "method": method_name,
        "model": cfg.model.path or cfg.model.name,
        "draft": _draft_label(cfg, method_name),
        "K": _spec_len(cfg, method_name, device), "bs": int(cfg.bs), "ctx": cfg.ctx,
        "dataset": cfg.dataset.name if cfg.dataset.name != "jsonl" else f"jsonl:{cfg.dataset.path}",
        "limit": cfg.limit, "temperature": float(cfg.temperature), "top_k": int(cfg.top_k), "top_p": float(cfg.top_p),
        "max_new_tokens": int(cfg.max_new_tokens), "dtype": str(dtype).replace("torch.", ""), "device": device.type,
        "kernel": _kernel_of(cfg, device) if resolve_kernel else cfg.get("kernel"),
        "kernel_isa": _kernel_isa(cfg, device) if resolve_kernel else None,
        **({"compile": True} if cfg.get("compile") else {}),  # only when true: older records pair as eager
        "method_opts": OmegaConf.to_container(cfg.method, resolve=True) if method_name == cfg.method.name
        else {"name": method_name},
        "seed": int(cfg.seed), "dataset_cfg": OmegaConf.to_container(cfg.dataset, resolve=True),
        "model_cfg": OmegaConf.to_container(cfg.model, resolve=True), "lossless": True, "method_cfg": {},
        **({"repeats": int(cfg.repeats)} if int(cfg.get("repeats") or 1) > 1 else {}),
        "env": R.env_info(device), "metrics": None, "requests": [],
    }


def measure(cfg, names: list[str], model, tokenizer, device, dtype, questions, sweep_id, progress=None) -> list[dict]:
    """One record per method of ``names`` (taking turns unit by unit when there are several)."""
    out = []
    for name, (metrics, requests, proposer) in zip(names, run_methods(cfg, names, model, tokenizer, device, dtype,
                                                                     questions, progress)):
        rec = _record_base(cfg, name, device, dtype, sweep_id)
        # task score (GSM8K accuracy, HumanEval pass@1) where the data set has one; outside the timing
        metrics["quality"] = quality.score(cfg.dataset.name, {q.id: q for q in questions}, requests)
        for r in requests:
            r.pop("_text", None)
        rec["metrics"], rec["requests"] = metrics, requests
        rec["lossless"] = bool(proposer.lossless)
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
    written: list[dict] = []
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
        model, tokenizer = cached_model(cfg.model, device, dtype, kernels.resolve(cfg.get("kernel", "torch"), device),
                                        bool(cfg.get("compile", False)))
    except ConfigError as e:
        return [_fail(cfg, method_name, device, dtype, sweep_id, "error", str(e))]
    except (torch.OutOfMemoryError, MemoryError) as e:
        msg = _one_line(e)
        _free(device)
        return [_fail(cfg, method_name, device, dtype, sweep_id, "oom", f"loading: {msg}")]
    except Exception as e:  # noqa: BLE001 - a method that fails to import, a model that fails to load
        traceback.print_exc(file=sys.stderr)
        return [_fail(cfg, method_name, device, dtype, sweep_id, "error", f"loading: {_one_line(e)}")]
    if not bool(cfg.get("resume", False)):
        return _job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id, written, False)
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
        return _job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id, written, True)


def _job(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id, written, resume) -> list[dict]:
    """A validated, loaded job: its AR baseline (found, run, or paired) and the method."""
    paired = cfg.ar_baseline == "paired" and method_name != "ar"
    probe = _record_base(cfg, "ar", device, dtype, sweep_id)
    scope = None if cfg.ar_baseline == "any" or resume else sweep_id
    ar = None if paired else _find_ar(cfg, probe, scope)
    n_turns = sum(len(q.turns) for q in questions)
    n_runs = (1 if method_name == "ar" or ar is not None else 2) * int(cfg.get("repeats") or 1)
    bar = _bar(n_runs * n_turns, _job_name(cfg, method_name, device), cfg.progress)
    try:
        if paired:  # its own AR baseline, taking turns with it batch by batch
            _run_paired(cfg, method_name, model, tokenizer, device, dtype, questions, sweep_id, bar, written)
            return written
        if ar is None or method_name == "ar":
            # each AR baseline runs once: a job (of this process or a parallel worker) that finds
            # none takes that baseline's lock, looks again, and runs it if it is still missing
            tag = hashlib.sha1(repr(R.baseline_key(probe)).encode()).hexdigest()[:12]
            with file_lock(Path(f"{cfg.records}.ar-{tag}.lock")):
                ar = _find_ar(cfg, probe, scope)
                if method_name == "ar" and ar is not None and ar.get("sweep_id") == sweep_id:
                    print(f"[specbench] ar bs={cfg.bs}: the same AR job already ran in this sweep; reusing it",
                          file=sys.stderr)
                    return written
                if ar is None:
                    ar = _run_one(cfg, "ar", None, model, tokenizer, device, dtype, questions, sweep_id, bar, written)
        if method_name != "ar":
            _run_one(cfg, method_name, ar, model, tokenizer, device, dtype, questions, sweep_id, bar, written)
    finally:
        bar.close()
    return written


def _find_ar(cfg, probe, scope) -> dict | None:
    """The whole AR record that pairs with ``probe`` (``records.find_ar`` over the index)."""
    entry = R.find_ar(R.index(cfg.records), probe, scope)
    return None if entry is None else R.load(cfg.records, entry)


def _run_one(cfg, name, ar, model, tokenizer, device, dtype, questions, sweep_id, bar, written) -> dict | None:
    """Measure one method, pair it with the AR record ``ar``, append and log the record."""
    recs = _measured(cfg, name, device, dtype, sweep_id, written,
                     lambda: measure(cfg, [name], model, tokenizer, device, dtype, questions, sweep_id, bar))
    return None if recs is None else _keep(cfg, recs[0], ar, written)


def _run_paired(cfg, name, model, tokenizer, device, dtype, questions, sweep_id, bar, written) -> dict | None:
    """Measure AR and a method taking turns on the same batches (``ar_baseline=paired``):
    both records are written, the method's speedup is against this AR record."""
    recs = _measured(cfg, name, device, dtype, sweep_id, written,
                     lambda: measure(cfg, ["ar", name], model, tokenizer, device, dtype, questions, sweep_id, bar))
    if recs is None:
        return None
    ar, rec = recs
    ar["paired_with"], rec["paired_with"] = rec["job_id"], ar["job_id"]
    if _keep(cfg, ar, None, written) is None:
        return None
    return _keep(cfg, rec, ar, written)


def _measured(cfg, name, device, dtype, sweep_id, written, run) -> list[dict] | None:
    """``run()``'s records, or None after recording its failure under ``name`` (the sweep goes
    on) unless the failure leaves the device unusable."""
    failure = None
    try:
        return run()
    except KeyboardInterrupt:
        _fail(cfg, name, device, dtype, sweep_id, "error", "interrupted (KeyboardInterrupt)")
        raise
    except (torch.OutOfMemoryError, MemoryError) as e:
        failure = ("oom", _one_line(e))
    except ConfigError as e:
        failure = ("error", str(e))
    except Exception as e:  # noqa: BLE001 - recorded, the sweep goes on
        traceback.print_exc(file=sys.stderr)
        failure = ("error", _one_line(e))
        if _poisons_device(e):
            written.append(_fail(cfg, name, device, dtype, sweep_id, *failure))
            raise SweepAborted(f"{failure[1]}: the CUDA context is unusable after a device-side error, so "
                               "no later job can run in this process; records so far are kept; fix the "
                               "cause and rerun the sweep") from None
    # out of the except block: the traceback (and the KV cache it holds) is gone
    _free(device)
    written.append(_fail(cfg, name, device, dtype, sweep_id, *failure))
    return None


def _keep(cfg, rec, ar, written) -> dict | None:
    """Pair ``rec`` with the AR record ``ar``, append and log it; None when it could not be written."""
    if rec["method"] == "ar":
        rec["metrics"]["speedup"] = 1.0
        if rec["temperature"] == 0:
            rec["metrics"]["match_ar"] = 1.0
    elif ar is not None:
        fill_against_ar(rec, ar)
    if not _append(cfg, rec):
        return None
    written.append(rec)
    try:
        loggers.log_record(cfg, rec)
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
    try:
        rec = _record_base(cfg, method_name, dev, dtype or torch.float32, sweep_id, resolve_kernel=False)
    except Exception:  # noqa: BLE001 - settings that failed validation may not convert (K='x', a missing path)
        rec = _raw_record(cfg, method_name, dev, sweep_id)
    rec["status"], rec["error"] = status, msg
    _append(cfg, rec)
    return rec


def _raw_record(cfg, method_name, device, sweep_id) -> dict:
    """A refused job's record whose settings are kept as given (``???`` where one is missing)."""
    def raw(key):
        try:
            v = OmegaConf.select(cfg, key, throw_on_missing=False, throw_on_resolution_failure=False)
        except Exception:  # noqa: BLE001
            return None
        return OmegaConf.to_container(v, resolve=False) if isinstance(v, DictConfig) else v

    rec = {"schema": R.SCHEMA, "sweep_id": sweep_id, "job_id": uuid.uuid4().hex[:16],
           "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "status": "error", "error": None, "method": method_name,
           "model": raw("model.path") or raw("model.name"), "draft": None}
    for key in ("K", "bs", "ctx", "limit", "temperature", "top_k", "top_p", "max_new_tokens", "dtype", "seed",
                "kernel"):
        rec[key] = raw(key)
    rec.update({"dataset": raw("dataset.name"), "device": device.type, "dataset_cfg": raw("dataset"),
                "model_cfg": raw("model"), "method_opts": raw("method"), "lossless": None,
                "env": R.env_info(device), "metrics": None, "requests": []})
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


# ---------------------------------------------------------------------------- summary
def summary_table(recs: list[dict]) -> str:
    cols = ["method", "model", "dataset", "bs", "K", "ctx", "tok/s", "speedup", "tau", "verify", "match_ar", "score",
            "status"]
    rows = []
    for r in recs:
        m = r.get("metrics") or {}

        def f(x, fmt):
            return "-" if x is None else format(x, fmt)

        rows.append([r.get("method"), str(r.get("model")).split("/")[-1], r.get("dataset"), str(r.get("bs")),
                     f(r.get("K"), "d"), f(r.get("ctx"), "d"), f(m.get("tokens_per_s"), ".1f"),
                     f(m.get("speedup"), ".2f") + ("x" if m.get("speedup") is not None else ""),
                     f(m.get("tau"), ".2f"), f(m.get("verify_share"), ".0%"), f(m.get("match_ar"), ".0%"),
                     f((m.get("quality") or {}).get("value"), ".0%"),
                     r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error')}"[:60]])
    widths = [max(len(c), *(len(str(row[i])) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object


class SummaryCallback(Callback):
    """Prints the sweep's table when a sweep (or single run) ends."""

    def _print(self, config) -> None:
        records = OmegaConf.select(config, "records") or "results/records.jsonl"
        sid = Path(str(config.hydra.sweep.dir)).name
        recs = [R.load(records, e) for e in R.index(records) if e.get("sweep_id") == sid]
        if not recs:
            print("\n[specbench] no records written by this sweep", file=sys.stderr)
            return
        print(f"\nspecbench sweep {sid}: {len(recs)} records in {records}\n")
        print(summary_table(recs), flush=True)
        # jobs that ran in other processes (a parallel launcher's workers) set the exit code too
        FAILED.extend(r.get("error") or r.get("status") for r in recs
                      if r.get("status") != "ok" and (r.get("error") or r.get("status")) not in FAILED)

    def on_multirun_end(self, config, **kwargs) -> None:
        self._print(config)

    def on_run_end(self, config, **kwargs) -> None:
        self._print(config)
