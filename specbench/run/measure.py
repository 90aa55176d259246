"""Measuring one method over a prompt set on our engine: the run unit by unit (``MethodRun``, which
two runs can take in turns; its units, prompts and tallies are its ``workload``), its timers, memory
and energy, and the compile warm-up. The metric maths is ``specbench.run.metrics``."""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf

from specbench import methods
from specbench.hf import eos_ids
from specbench.decode.requests import Request, Requests
from specbench.decode.graphs import pool_of
from specbench.models import compiled_graphs, is_compiled
from specbench.run.monitor import NvmlMonitor, PeakMemory, weight_bytes
from specbench.run.workload import Workload
from specbench.decode.timing import PhaseTimer, sync
from specbench.decode.verify import SIBLING_RATES, Sampling, Synthetic


class TimedRun(Protocol):
    """What ``run_methods`` (and ``tune``) drive: one method over the prompt set, unit by unit.
    ``MethodRun`` (our engine) and ``vllm_engine.VllmRun`` implement it, each driven by its
    ``Workload`` (``workload.Driver``)."""

    name: str
    proposer: Any  # the record's method side: ``describe()`` and ``lossless``
    K: int  # positions of the per-position acceptance

    def units(self) -> list[tuple[int, int]]: ...

    def run_unit(self, unit: tuple[int, int], progress=None) -> None: ...

    def metrics(self) -> tuple[dict, list[dict]]: ...

    def close(self) -> None: ...


def method_cfg(cfg: DictConfig, method_name: str) -> DictConfig:
    """The job's config for method ``method_name``: the job's own, or with that method's own settings
    (a paired job's AR)."""
    from specbench import methods

    if method_name == cfg.method.name:
        return cfg
    out = OmegaConf.create(OmegaConf.to_container(cfg))
    out.method = methods.settings(method_name)
    return out


class MethodRun:
    """One method over the prompt set on our engine, a unit (one batch of prompts, every turn, one
    repeat; or a stream) at a time, so that two runs can take turns on the same units
    (``ar_baseline=paired``). Each run keeps its own generator, torch's global RNG state, timer and
    monitors between units: its tokens and measurements do not depend on what ran in between."""

    def __init__(self, job, method_name: str):
        from specbench.decode.engine import Engine

        cfg, model, tokenizer, device, dtype = job.cfg, job.model, job.tokenizer, job.device, job.dtype
        self.cfg, self.name, self.model, self.device = cfg, method_name, model, device
        mcfg = method_cfg(cfg, method_name)
        method = methods.get(method_name)
        self.proposer = method(mcfg, model, tokenizer, device, dtype)
        self.K = _spec_len(mcfg, method_name, device) or 0  # positions of the per-position acceptance
        self.workload = Workload(job, self.K, method.reach(mcfg, device), method.positions(mcfg, model.config))
        acc = accept_of(cfg)
        eos = eos_ids(model, tokenizer)

        def engine(timer):  # its own seeded stream of synthetic acceptance draws, if any
            sampling = Sampling.of(cfg, None if acc is None else Synthetic(acc["rates"], int(cfg.seed),
                                                                            acc["sibling_rates"]))
            return Engine(model, self.proposer, sampling, device, dtype, eos, timer,
                          prefill_chunk=self.workload.tally.serving.prefill_chunk, graphs=self.pool)

        # compile=graphs: the target's forwards replayed from graphs over its pool's fixed buffers
        self.pool = pool_of(model, device, dtype) if cfg.get("compile") == "graphs" else None
        self.compiled = is_compiled(model)  # compile=true (compile=graphs: the pool, below)
        fresh = self.proposer.snapshot()  # what it has learned across requests: nothing yet
        made = self._captured()
        # compile=graphs on a GPU: what its warm-up left allocated (the buffers and every graph's own pool)
        held = torch.cuda.memory_allocated(device) if self.pool is not None and device.type == "cuda" else None
        self.capture_bytes = None
        if cfg.warmup:  # the job's own shapes: a full batch of its ragged prompts (padding masks, tree masks)
            ids = self.workload.warmup_prompts()  # the first batch, as the timed job will see it
            if self.compiled:  # every graph the timed job can need, with the method's taps in place (the
                # pool's are captured by its own warm-up below)
                warm_compiled(model, len(ids), device, dtype, self.proposer.hidden_layers)
            if self.pool is not None:  # the buffers the warm-up makes, and its drafter's, are the job's
                self.pool.reserve(len(ids), self._graph_width(ids))
            engine(PhaseTimer(device)).generate(ids, 8, torch.Generator(device).manual_seed(0))
            if self.pool is not None:  # room for the job's longest turns, and every bucket it can meet, now
                own = " and its own models'" if self.proposer.modules() else ""
                cpu = "" if device.type == "cuda" else (" On the CPU each is traced whole (fullgraph, eager backend): no "
                                                        "graph break, no host read; its speed is eager's.")
                print(f"[specbench] {method_name}: compile=graphs: capturing the target's forwards{own} for each "
                      f"(rows, nodes) bucket up to bs={len(ids)} (untimed).{cpu}", file=sys.stderr)
                self.pool.warm(len(ids), self.K + 1)
            self.proposer.restore(fresh)  # the warm-up's answers are the timed prompts': forgotten
            if held is not None:
                self.capture_bytes = torch.cuda.memory_allocated(device) - held
        # compile=graphs: the graphs this run made (a paired job's AR and method share the pool)
        self.graphs_made = [b - a for a, b in zip(made, self._captured())]
        self._fresh, self._rep = fresh, 0
        self.timer = PhaseTimer(device)
        self.eng = engine(self.timer)
        self.gen = torch.Generator(device).manual_seed(int(cfg.seed))
        torch.manual_seed(int(cfg.seed))
        self._rng = _rng_state(device)
        self.mem, self.nvml = PeakMemory(device), NvmlMonitor(device)
        self.weight_bytes = weight_bytes([model, *self.proposer.modules()])  # this run's models, shared ones once
        self.graphs_timed = 0  # graphs torch.compile made inside the timing (shapes the warm-up did not meet)

    def close(self) -> None:
        """Release what the run holds outside this process (nothing: our engine is in it), and
        compile=graphs' pool (its buffers, graphs and hooks on the target)."""
        if self.pool is not None:
            self.pool.close()

    def _graph_width(self, ids) -> int:
        """Slots compile=graphs' buffers get before the timing: the longest first prompt twice (a
        second turn carries the first), two answers, and the widest forward padded; a longer batch
        still grows them, and its captures count in ``graphs_in_timing``."""
        longest = max(len(p) for p in ids)
        return 2 * longest + 2 * int(self.cfg.max_new_tokens) + 256

    def own_peak(self) -> int:
        """The run's own peak memory: its models' weights (shared ones once), plus on a GPU the most
        its units allocated on top of what was allocated when each began (other runs' models and
        caches, present in a paired job or kept across jobs, are not counted), on the CPU the most its
        caches held at once: the target's KV cache's buffers and the method's own tensors (its
        drafter's cache; the process's RSS counts every run in it: ``process_peak_bytes``)."""
        extra = self.mem.transient if self.device.type == "cuda" else self.eng.peak_cache_bytes
        if self.pool is not None and self.device.type == "cuda":  # its buffers were made before the timing
            extra += self.pool.nbytes() + self.pool.owned_nbytes(self.proposer)  # the target's, its drafter's
        return self.weight_bytes + extra

    def units(self) -> list[tuple[int, int]]:
        return self.workload.units()

    def run_unit(self, unit: tuple[int, int], progress=None) -> None:
        if unit[0] != self._rep:  # each repeat starts from the same state: none of its answers learned
            self.proposer.restore(self._fresh)
            self._rep = unit[0]
        _set_rng_state(self.device, self._rng)
        with self.timer.watching([self.model, *self.proposer.modules()]), self.mem, self.nvml:
            self.workload.run(unit, self, progress)
        self._rng = _rng_state(self.device)

    def _timed(self, call):
        """(what ``call()`` returns, its seconds less the harness's: the engine stops for the
        ``on_done`` callbacks a stream makes), counting the graphs made inside the timing."""
        graphs, made = self._made(), self._captured()
        sync(self.device)
        harness, t0 = self.eng.harness_s, time.perf_counter()
        out = call()
        sync(self.device)
        dt = time.perf_counter() - t0 - (self.eng.harness_s - harness)
        self.graphs_timed += self._made() - graphs
        self.graphs_made = [n + b - a for n, a, b in zip(self.graphs_made, made, self._captured())]
        self._take_trace()
        return out, dt

    def batch(self, prompts: list[list[int]]) -> tuple[list, float]:
        """One static batch's turn through the engine, timed (``workload.Driver``)."""
        return self._timed(lambda: self.eng.generate(prompts, int(self.cfg.max_new_tokens), self.gen))

    def stream(self, requests: list[Request], answered) -> float:
        """``serving.batching=continuous``: the requests served, at most ``bs`` in flight, each next turn
        queued as its turn is answered (``workload.Driver``); the stream's seconds, less the time
        spent in ``answered`` (the harness's: the engine stops for it)."""
        queue = Requests(requests)

        def on_done(key, r, now):
            nxt = answered(key, r, now)
            if nxt is not None:
                queue.add(nxt)

        return self._timed(lambda: self.eng.serve(queue, int(self.cfg.max_new_tokens), self.gen,
                                                  concurrency=int(self.cfg.bs), on_done=on_done))[1]

    def _take_trace(self) -> None:
        """The engine's per-step trace of its last call, as step durations."""
        prev = 0.0
        for t, rows, n in self.eng.trace:
            self.workload.tally.trace.append((t - prev, rows, n))
            prev = t

    def _captured(self) -> tuple[int, int]:
        """compile=graphs: (graphs, drafter graphs) the pool has made so far."""
        return (self.pool.made, self.pool.drafts.made) if self.pool is not None else (0, 0)

    def _made(self) -> int:
        """Graphs made so far: captured by the pool (compile=graphs), compiled (compile=true), or none."""
        if self.pool is not None:
            return self._captured()[0]
        return compiled_graphs() if self.compiled else 0

    def metrics(self) -> tuple[dict, list[dict]]:
        """The job's metrics and its requests, once, after its last unit."""
        metrics, requests = self.workload.tally.metrics(self.timer.totals(), self.eng.iterations)
        metrics.update({
            "peak_mem_bytes": self.own_peak(),
            "process_peak_bytes": self.mem.peak,  # the whole process's (allocator or RSS): every run in it
            "energy_j": self.nvml.energy_j,
            "nvml": self.nvml.result,
        })
        if self.compiled or self.pool is not None:
            metrics["compile"] = {"graphs_in_timing": self.graphs_timed}
            if self.pool is not None:  # what was captured (graphs: all, drafter_graphs: of those, the method's own)
                metrics["compile"].update(graphs=self.graphs_made[0], drafter_graphs=self.graphs_made[1])
                if self.capture_bytes is not None:
                    metrics["compile"]["capture_bytes"] = self.capture_bytes
                if self.proposer.modules() and not self.graphs_made[1]:  # Medusa's heads: no cache of their own
                    eager = sorted({type(m).__name__ for m in self.proposer.modules()})
                    metrics["compile"]["eager_models"] = eager
                    print(f"\n[specbench] note: {self.name}: compile=graphs captured the target's forwards; its own "
                          f"models ({', '.join(eager)}) ran eagerly (metrics.compile.eager_models)", file=sys.stderr)
            if self.graphs_timed:
                print(f"[specbench] warning: {self.name}: torch.compile made {self.graphs_timed} graph(s) inside the "
                      "timing (shapes its warm-up did not meet): its speed includes compiling; rerun with repeats=2 "
                      "and read the second pass (metrics.repeat_tokens_per_s)", file=sys.stderr)
        return metrics, requests


def accept_of(cfg) -> dict | None:
    """``accept=synthetic``'s settings as a record keeps them (``{"name", "rates", "sibling_rates"}``,
    the published sibling profile where the config leaves it null); None when the engine verifies as
    usual (``accept=exact``)."""
    a = cfg.get("accept")
    if a is None or a.get("name", "exact") == "exact":
        return None
    r, sib = a.get("rates"), a.get("sibling_rates")
    sib = SIBLING_RATES if sib is None else sib if OmegaConf.is_list(sib) else [sib]
    return {"name": str(a.name), "rates": [float(x) for x in (r if OmegaConf.is_list(r) else [r])],
            "sibling_rates": [float(x) for x in sib]}


@torch.inference_mode()
def warm_compiled(model, bs: int, device, dtype, taps=()) -> None:
    """Compile, outside the timing, the graphs a job's forwards can need: torch.compile with
    dynamic shapes still makes one graph per kind of call, and specialises a size of 1. So:
    prefill and decode forwards at the job's batch size and at one row (rows leave the batch as
    they finish), dense and ragged (padding masks), one new token and several, chain and tree
    (a tree always takes a mask), with the method's hidden-state taps (``taps``) hooked."""
    from specbench.decode.hidden import Tap
    from specbench.decode.kv import RaggedCache

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


def run_methods(job, names: list[str], run_cls: type[TimedRun] | None = None):
    """Run methods over the job's questions, taking turns unit by unit (ABBA: the first method runs
    first in even units, last in odd ones, so a drift of the host's speed hits them alike);
    returns one (metrics, requests, proposer) per method. ``run_cls``: ``MethodRun`` (our engine)
    or another ``TimedRun`` (``vllm_engine.VllmRun``). Progress goes to ``job.bar``."""
    runs = []
    try:
        for n in names:
            runs.append((run_cls or MethodRun)(job, n))
        for i, unit in enumerate(runs[0].units()):
            for run in (runs if i % 2 == 0 else runs[::-1]):
                if job.bar is not None:
                    job.bar.set_postfix_str(run.name)
                run.run_unit(unit, job.bar)
        return [(*run.metrics(), run.proposer) for run in runs]
    finally:
        for run in runs:
            run.close()


def _spec_len(cfg, method_name, device) -> int | None:
    """The job's recorded K: the method's speculation length (None: it has no fixed one)."""
    try:
        return methods.get(method_name).spec_len(cfg, device)
    except Exception:  # noqa: BLE001 - as _draft_label
        return None
