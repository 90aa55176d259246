"""Measuring one method over a prompt set: the engine run batch by batch (``MethodRun``, which
two runs can take in turns), its timers, memory and energy, and the compile warm-up. The metric
maths is ``specbench.run.metrics``."""

from __future__ import annotations

import hashlib
import math
import random
import sys
import time
from typing import Any, Protocol

import torch
from omegaconf import DictConfig, OmegaConf

from specbench import methods
from specbench.run import data as D
from specbench.run import metrics as M
from specbench.errors import ConfigError
from specbench.hf import eos_ids
from specbench.decode.graphs import pool_of
from specbench.models import compiled_graphs, is_compiled
from specbench.paths import CONF_DIR
from specbench.run.monitor import NvmlMonitor, PeakMemory, weight_bytes
from specbench.decode.timing import PhaseTimer, sync
from specbench.decode.verify import SIBLING_RATES, Sampling, Synthetic


def build_requests(cfg, tokenizer):
    qs = D.load_questions(cfg.dataset, cfg.limit)
    if cfg.ctx is not None:
        filler = tokenizer("\n\n".join(D.long_texts()[:8]), add_special_tokens=False)["input_ids"]
        for i, q in enumerate(qs):
            q.ctx_ids = D.render_ctx(tokenizer, q.turns[0], bool(cfg.model.get("chat", True)), cfg.ctx,
                                     filler[(i * 997) % max(1, len(filler) // 2):])
            q.turns = q.turns[:1]
    return qs


class Run(Protocol):
    """What ``run_methods`` (and ``tune``) drive: one method over the prompt set, unit by unit.
    ``MethodRun`` (our engine) and ``vllm_engine.VllmRun`` implement it, each with a ``Tally``."""

    name: str
    proposer: Any  # the record's method side: ``describe()`` and ``lossless``
    K: int  # positions of the per-position acceptance

    def units(self) -> list[tuple[int, int]]: ...

    def run_unit(self, unit: tuple[int, int], progress=None) -> None: ...

    def metrics(self) -> tuple[dict, list[dict]]: ...

    def close(self) -> None: ...


class Tally:
    """What a run's units produced, kept alike on both backends: the request records, the timed
    wall (per repeat), the batches, the per-step trace; and the metrics computed from them."""

    def __init__(self, cfg: DictConfig, tokenizer, K: int, reach: int, npos: int, n_questions: int):
        self.cfg, self.tokenizer, self.K, self.reach, self.npos = cfg, tokenizer, K, reach, npos
        self.n_questions = n_questions
        self.repeats = int(cfg.get("repeats") or 1)
        self.continuous = cfg.get("batching", "static") == "continuous"
        self.requests: list[dict] = []
        self.wall, self.n_batches = 0.0, 0
        self.rep_tokens, self.rep_wall = [0] * self.repeats, [0.0] * self.repeats
        self.trace: list[tuple[float, int, int]] = []  # (step duration, rows in flight, tokens) of every decoding step
        # thinking.open / .close as token ids (None: the tokenizer has neither): each request's steps inside
        self.think = M.thinking_tags(tokenizer, cfg.get("thinking"))

    def units(self) -> list[tuple[int, int]]:
        """(repeat, first question) of every batch, in order; repeats=N measures the set N times.
        ``batching=continuous``: the whole set is one stream of requests per repeat."""
        if self.continuous:
            return [(rep, 0) for rep in range(self.repeats)]
        return [(rep, start) for rep in range(self.repeats) for start in range(0, self.n_questions, self.cfg.bs)]

    def check_positions(self, prompt: list[int]) -> None:
        if len(prompt) + self.cfg.max_new_tokens + self.reach + 1 > self.npos:
            raise ConfigError(f"a prompt of {len(prompt)} tokens + max_new_tokens={self.cfg.max_new_tokens} + "
                              f"{self.reach} draft positions exceeds the {self.npos} positions of the job's models")

    def timed(self, rep: int, seconds: float) -> None:
        """A timed unit (a batch's turn, or a stream) of repeat ``rep`` took ``seconds``."""
        self.wall += seconds
        self.rep_wall[rep] += seconds
        self.n_batches += 1

    def request(self, q, turn: int, unit: int, rep: int, prompt: list[int], r) -> dict:
        """A finished request's record (and its scratch fields for the job's metrics), kept."""
        toks = r.tokens
        n = len(toks)
        text = self.tokenizer.decode(toks, skip_special_tokens=True)
        self.rep_tokens[rep] += n
        itl = [b - a for a, b in zip([r.t_first] + r.chunks[:-1], r.chunks)]
        rec = {
            "id": q.id, "turn": turn + 1, "batch": unit,
            **({"repeat": rep} if self.repeats > 1 else {}),
            "category": q.category, "prompt_tokens": len(prompt),
            "new_tokens": n, "steps": r.steps, "wall_s": r.t_done - r.t_arrival, "ttft_s": r.t_first - r.t_arrival,
            "tpot_s": (r.t_done - r.t_first) / (n - 1) if n > 1 else None,
            **({"arrival_s": r.t_arrival, "queue_s": r.t_admit - r.t_arrival} if self.continuous else {}),
            "accepted": sum(r.accept_lens), "accepts": M.encode_accepts(r.accept_lens),
            "eos": r.hit_eos, "out_sha": hashlib.sha1(str(toks).encode()).hexdigest()[:16],
            "prompt_sha": hashlib.sha1(str(prompt).encode()).hexdigest()[:16],
            "tokens": toks,
            **({"thinking_steps": M.thinking_steps(prompt, toks, r.accept_lens, self.think)} if self.think else {}),
            "_lens": r.accept_lens, "_nodes": sum(r.drafted), "_fnodes": sum(r.nodes), "_vnodes": sum(r.valid_nodes),
            "_text": text, "_itl": itl,
        }
        self.requests.append(rec)
        return rec

    def streams(self) -> list[tuple[float, list[tuple[float, float]]]]:
        """Each stream (a repeat of ``batching=continuous``): its wall time and every request's
        (admitted, done) seconds on its clock, from the request records (both backends write them)."""
        spans: dict[int, list] = {}
        for rq in self.requests:
            a = rq["arrival_s"]
            spans.setdefault(rq.get("repeat", 0), []).append((a + rq["queue_s"], a + rq["wall_s"]))
        return [(self.rep_wall[rep], s) for rep, s in sorted(spans.items())]

    def metrics(self, times: dict, iterations: int) -> tuple[dict, list[dict]]:
        """The job's metrics from its requests (``times``: the phases' seconds; ``iterations``: the
        decoding steps of the batch), once, after its last unit (it takes the requests' scratch
        fields). Memory and energy are the run's to add."""
        requests, wall = self.requests, self.wall
        lens = [x for rq in requests for x in rq.pop("_lens")]
        nodes = [sum(rq.pop(k) for rq in requests) for k in ("_nodes", "_fnodes", "_vnodes")]
        itls = [x for rq in requests for x in rq.pop("_itl")]
        new_tokens = sum(rq["new_tokens"] for rq in requests)
        metrics = {
            "new_tokens": new_tokens,
            "wall_s": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else None,
            **M.acceptance(lens, self.K, requests, *nodes),
            "acceptance_by": M.acceptance_by(requests, self.K),  # per category, turn, thinking span
            **({"thinking_tags": {k: self.cfg.thinking.get(k) for k in ("open", "close")}} if self.think else {}),
            "iterations": iterations,
            "batches": self.n_batches,
            **M.phases(times, wall),
            **M.latency(requests, itls, wall),
            "goodput": M.goodput(self.cfg, requests, wall),
            "in_flight": M.in_flight(self.trace, int(self.cfg.bs), self.streams() if self.continuous else None),
            "speedup": None,
            "match_ar": None,
        }
        if self.repeats > 1:  # each pass over the prompt set on its own: the spread between repeats
            metrics["repeat_tokens_per_s"] = [t / w if w > 0 else None for t, w in zip(self.rep_tokens, self.rep_wall)]
        return metrics, requests


class MethodRun:
    """One method over the prompt set, a unit (one batch of prompts, every turn, one repeat) at
    a time, so that two runs can take turns on the same units (``ar_baseline=paired``). Each
    run keeps its own generator, torch's global RNG state, timer and monitors between units:
    its tokens and measurements do not depend on what ran in between."""

    def __init__(self, cfg: DictConfig, method_name: str, model, tokenizer, device, dtype, questions):
        from specbench.decode.engine import Engine

        self.cfg, self.name, self.model, self.tokenizer, self.device = cfg, method_name, model, tokenizer, device
        self.questions = questions
        mcfg = OmegaConf.merge(cfg, {"method": OmegaConf.load(CONF_DIR / "method" / f"{method_name}.yaml")}) \
            if method_name != cfg.method.name else cfg
        self.proposer = methods.get(method_name)(mcfg, model, tokenizer, device, dtype)
        self.K = _spec_len(mcfg, method_name, device) or 0  # positions of the per-position acceptance
        acc = accept_of(cfg)
        self.chat = bool(cfg.model.get("chat", True))
        eos = eos_ids(model, tokenizer)
        method = methods.get(method_name)

        def engine(timer):  # its own seeded stream of synthetic acceptance draws, if any
            sampling = Sampling(float(cfg.temperature), int(cfg.top_k), float(cfg.top_p),
                                None if acc is None else Synthetic(acc["rates"], int(cfg.seed), acc["sibling_rates"]))
            return Engine(model, self.proposer, sampling, device, dtype, eos, timer,
                          prefill_chunk=cfg.get("prefill_chunk"), graphs=self.pool)

        # compile=graphs: the target's forwards replayed from graphs over its pool's fixed buffers
        self.pool = pool_of(model, device, dtype) if cfg.get("compile") == "graphs" else None
        self.compiled = is_compiled(model) or self.pool is not None
        fresh = self.proposer.snapshot()  # what it has learned across requests: nothing yet
        if cfg.warmup:  # the job's own shapes: a full batch of its ragged prompts (padding masks, tree masks)
            qs = questions[:int(cfg.bs)]  # the first batch, as the timed job will see it
            ids = [q.ctx_ids if cfg.ctx is not None else D.render(tokenizer, [], q.turns[0], self.chat) for q in qs]
            if self.compiled:  # every graph the timed job can need, with the method's taps in place
                warm_compiled(model, len(ids), device, dtype, self.proposer.hidden_layers)
            engine(PhaseTimer(device)).generate(ids, 8, torch.Generator(device).manual_seed(0))
            if self.pool is not None:  # room for the job's longest turns, and every bucket it can meet, now
                print(f"[specbench] {method_name}: compile=graphs: capturing the target's forwards for each "
                      f"(rows, nodes) bucket up to bs={len(ids)} (untimed; minutes on a CPU)", file=sys.stderr)
                self.pool.reserve(len(ids), self._graph_width(ids))
                self.pool.warm(len(ids), self.K + 1)
            self.proposer.restore(fresh)  # the warm-up's answers are the timed prompts': forgotten
        self._fresh, self._rep = fresh, 0
        self.timer = PhaseTimer(device)
        self.eng = engine(self.timer)
        self.gen = torch.Generator(device).manual_seed(int(cfg.seed))
        torch.manual_seed(int(cfg.seed))
        self._rng = _rng_state(device)
        self.tally = Tally(cfg, tokenizer, self.K, method.reach(mcfg, device), method.positions(mcfg, model.config),
                           len(questions))
        self.continuous = self.tally.continuous
        self.mem, self.nvml = PeakMemory(device), NvmlMonitor(device)
        self.weight_bytes = weight_bytes([model, *self.proposer.modules()])  # this run's models, shared ones once
        self.graphs_timed = 0  # graphs torch.compile made inside the timing (shapes the warm-up did not meet)
        self.rate = rate_of(cfg)

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
            extra += self.pool.nbytes()
        return self.weight_bytes + extra

    def units(self) -> list[tuple[int, int]]:
        return self.tally.units()

    def _take_trace(self) -> None:
        """The engine's per-step trace of its last call, as step durations."""
        prev = 0.0
        for t, rows, n in self.eng.trace:
            self.tally.trace.append((t - prev, rows, n))
            prev = t

    def _run_stream(self, rep: int, progress=None) -> None:
        """``batching=continuous``: every question's first turn a request, arriving at ``rate``
        (Poisson, seeded; inf: all at once), at most ``bs`` in flight; a later turn is a new request
        that arrives when the turn before it is answered (it holds that answer)."""
        cfg, tokenizer = self.cfg, self.tokenizer
        from specbench.decode.engine import Request, Requests

        rng = random.Random(int(cfg.seed))
        history = [[] for _ in self.questions]
        prompts, reqs, t = {}, [], 0.0
        for i, q in enumerate(self.questions):
            prompt = q.ctx_ids if cfg.ctx is not None else D.render(tokenizer, [], q.turns[0], self.chat)
            self.tally.check_positions(prompt)
            prompts[(i, 0)] = prompt
            reqs.append(Request((i, 0), prompt, t))
            t += rng.expovariate(self.rate) if math.isfinite(self.rate) else 0.0
        queue = Requests(reqs)

        def on_done(key, r, now):
            i, turn = key
            q = self.questions[i]
            rec = self.tally.request(q, turn, i, rep, prompts[key], r)
            history[i].append((q.turns[turn], rec["_text"]))
            if turn + 1 < len(q.turns) and cfg.ctx is None:
                nxt = D.render(tokenizer, history[i], q.turns[turn + 1], self.chat)
                self.tally.check_positions(nxt)
                prompts[(i, turn + 1)] = nxt
                queue.add(Request((i, turn + 1), nxt, now))
            if progress is not None:
                progress.update(1)

        _set_rng_state(self.device, self._rng)
        with self.timer.watching([self.model, *self.proposer.modules()]), self.mem, self.nvml:
            graphs = self._made()
            sync(self.device)
            harness, t0 = self.eng.harness_s, time.perf_counter()
            self.eng.serve(queue, int(cfg.max_new_tokens), self.gen, concurrency=int(cfg.bs), on_done=on_done)
            sync(self.device)
            # decoding, hashing and rendering the next turn (on_done) are the harness's, not the engine's
            dt = time.perf_counter() - t0 - (self.eng.harness_s - harness)
            self.graphs_timed += self._made() - graphs
        self._take_trace()
        self.tally.timed(rep, dt)
        self._rng = _rng_state(self.device)

    def run_unit(self, unit: tuple[int, int], progress=None) -> None:
        if unit[0] != self._rep:  # each repeat starts from the same state: none of its answers learned
            self.proposer.restore(self._fresh)
            self._rep = unit[0]
        if self.continuous:
            return self._run_stream(unit[0], progress)
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
                self.tally.check_positions(max(prompts, key=len))
                graphs = self._made()
                sync(device)
                t = time.perf_counter()
                out = self.eng.generate(prompts, int(cfg.max_new_tokens), self.gen)
                sync(device)
                dt = time.perf_counter() - t
                self.graphs_timed += self._made() - graphs
                self.tally.timed(rep, dt)
                self._take_trace()
                for i, r in zip(rows, out):
                    q = batch[i]
                    rec = self.tally.request(q, turn, n_batches_q, rep, prompts[rows.index(i)], r)
                    history[i].append((q.turns[turn], rec["_text"]))
                if progress is not None:
                    progress.update(len(rows))
        self._rng = _rng_state(device)

    def _made(self) -> int:
        """Graphs made so far: captured by the pool (compile=graphs), compiled (compile=true), or none."""
        if self.pool is not None:
            return self.pool.made
        return compiled_graphs() if self.compiled else 0

    def metrics(self) -> tuple[dict, list[dict]]:
        """The job's metrics and its requests, once, after its last unit."""
        metrics, requests = self.tally.metrics(self.timer.totals(), self.eng.iterations)
        metrics.update({
            "peak_mem_bytes": self.own_peak(),
            "process_peak_bytes": self.mem.peak,  # the whole process's (allocator or RSS): every run in it
            "energy_j": self.nvml.energy_j,
            "nvml": self.nvml.result,
        })
        if self.compiled:
            metrics["compile"] = {"graphs_in_timing": self.graphs_timed}
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


def rate_of(cfg) -> float:
    """``rate``: requests per second (Poisson arrivals) or ``inf`` (all at once)."""
    r = cfg.get("rate", "inf")
    return math.inf if r is None or str(r).lower() in ("inf", "infinity") else float(r)


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


def run_methods(cfg: DictConfig, names: list[str], model, tokenizer, device, dtype, questions, progress=None,
                run_cls=None):
    """Run methods over all questions, taking turns unit by unit (ABBA: the first method runs
    first in even units, last in odd ones, so a drift of the host's speed hits them alike);
    returns one (metrics, requests, proposer) per method. ``run_cls``: ``MethodRun`` (our engine)
    or one with its interface (``vllm_engine.VllmRun``)."""
    runs = []
    try:
        for n in names:
            runs.append((run_cls or MethodRun)(cfg, n, model, tokenizer, device, dtype, questions))
        for i, unit in enumerate(runs[0].units()):
            for run in (runs if i % 2 == 0 else runs[::-1]):
                if progress is not None:
                    progress.set_postfix_str(run.name)
                run.run_unit(unit, progress)
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
