"""What a job asks of an engine, the same for every engine: the prompt set (``build_requests``),
cut into units (a static batch and its turns, or one stream of requests per repeat), each request a
key, a prompt and an arrival time (``decode.requests.Request``), a question's next turn once its turn
is answered, and the tally of what came back (``Tally``: request records, walls, metrics).

An engine's run only drives its engine (``Driver``): ``batch`` decodes one static batch's turn,
``stream`` serves requests as they arrive, at most ``bs`` in flight, and hands each finished one to
the workload's ``answered``, which may return the question's next turn.

The harness's time is not the engine's. A static batch's next turn is rendered between two timed
calls. In a stream, ``answered`` runs while the stream runs (it records the request and renders the
next turn): an engine leaves that time off its clock (wall, arrivals, queue, TTFT) wherever it
stops for it. Our engine stops for it always (it runs in this process), vLLM's worker when no other
request is in flight (its engine core goes on decoding the others meanwhile: that time is theirs).
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from omegaconf import DictConfig

from specbench.decode.requests import Request
from specbench.errors import ConfigError
from specbench.run import data as D
from specbench.run import metrics as M


@dataclass
class Job:
    """One validated, loaded sweep point: its settings, what it runs on, and the records it has
    written so far."""

    cfg: DictConfig
    method: str  # the method of the sweep point (a paired job also runs "ar")
    model: Any  # None on backend=vllm (vLLM loads it in its own process)
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    questions: list
    sweep_id: str
    written: list[dict] = field(default_factory=list)
    bar: Any = None  # the job's progress bar (tqdm)


def build_requests(cfg, tokenizer):
    """The job's questions (``ctx=N``: each first turn alone, in a prompt of N tokens)."""
    qs = D.load_questions(cfg.dataset, cfg.limit)
    if cfg.ctx is not None:
        filler = tokenizer("\n\n".join(D.long_texts()[:8]), add_special_tokens=False)["input_ids"]
        for i, q in enumerate(qs):
            q.ctx_ids = D.render_ctx(tokenizer, q.turns[0], bool(cfg.model.get("chat", True)), cfg.ctx,
                                     filler[(i * 997) % max(1, len(filler) // 2):])
            q.turns = q.turns[:1]
    return qs


@dataclass(frozen=True)
class Serving:
    """How a job's requests arrive and are batched: the run config's ``serving`` node, read whole
    here (``of``). ``rate``: requests per second (Poisson arrivals) or inf (all at once);
    ``prefill_chunk``: None (joining prompts prefilled together, left-padded) or tokens a piece;
    ``ttft_ms``, ``tpot_ms``: the goodput SLO (None: no bound)."""

    batching: str = "static"
    rate: float = math.inf
    prefill_chunk: int | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def continuous(self) -> bool:
        return self.batching == "continuous"

    @classmethod
    def of(cls, cfg) -> "Serving":
        s = cfg.get("serving") or {}
        r, chunk, slo = s.get("rate", "inf"), s.get("prefill_chunk"), s.get("slo") or {}
        return cls(str(s.get("batching") or "static"),
                   math.inf if r is None or str(r).lower() in ("inf", "infinity") else float(r),
                   None if chunk is None else int(chunk), slo.get("ttft_ms"), slo.get("tpot_ms"))


class Driver(Protocol):
    """An engine's run, as the workload drives it."""

    def batch(self, prompts: list[list[int]]) -> tuple[list, float]:
        """One static batch's turn: a result per prompt (``decode.engine.RowResult``), in order,
        and the seconds it took."""
        ...

    def stream(self, requests: list[Request], answered: Callable[[Any, Any, float], Request | None]) -> float:
        """Serve ``requests`` (and every next turn ``answered(key, result, now)`` returns, arriving
        at ``now``) until none is left; the stream's seconds."""
        ...


class Workload:
    """The job's prompt set as units for one run: ``run(unit, driver)`` hands the unit's requests to
    the driver, keeps each answer (``tally``) and makes each question's next turn from it (its
    history: every earlier turn and answer). ``K``: positions of the per-position acceptance;
    ``reach`` and ``npos``: draft positions past the answer, and the models' positions."""

    def __init__(self, job, K: int, reach: int, npos: int):
        cfg = job.cfg
        self.cfg, self.tokenizer, self.questions = cfg, job.tokenizer, job.questions
        self.chat = bool(cfg.model.get("chat", True))
        self.bs = int(cfg.bs)
        self.tally = Tally(cfg, job.tokenizer, K, reach, npos, len(job.questions))
        self.continuous = self.tally.continuous
        self.rate = self.tally.serving.rate
        self._history: dict[int, list[tuple[str, str]]] = {}  # question -> its (turn, answer) pairs so far
        self._prompts: dict[tuple[int, int], list[int]] = {}  # (question, turn) -> its prompt, until answered
        self._rep, self._progress = 0, None

    def units(self) -> list[tuple[int, int]]:
        return self.tally.units()

    def warmup_prompts(self) -> list[list[int]]:
        """The first batch's first turns, as the timed job will see them."""
        return [self._prompt(i, 0) for i in range(min(self.bs, len(self.questions)))]

    def run(self, unit: tuple[int, int], driver: Driver, progress=None) -> None:
        """Unit ``unit`` (repeat, first question) through ``driver``: the stream, or the batch turn by
        turn (the rows whose question has another turn)."""
        rep, start = unit
        self._rep, self._progress = rep, progress
        self._history.clear()
        self._prompts.clear()
        if self.continuous:
            self.tally.timed(rep, driver.stream(self._arrivals(), self.answered))
            return
        items = [self._request(i, 0, 0.0) for i in range(start, min(start + self.bs, len(self.questions)))]
        while items:
            self.tally.check_positions(max((r.prompt for r in items), key=len))
            results, seconds = driver.batch([r.prompt for r in items])
            self.tally.timed(rep, seconds)
            items = [n for r, res in zip(items, results) if (n := self.answered(r.key, res)) is not None]

    def answered(self, key: tuple[int, int], result, now: float = 0.0) -> Request | None:
        """Turn ``key`` (question, turn) answered with ``result`` at ``now`` (on the engine's clock):
        its record kept; returns the question's next turn, arriving at ``now``, or None."""
        i, turn = key
        q = self.questions[i]
        rec = self.tally.request(q, turn, i if self.continuous else i // self.bs, self._rep, self._prompts.pop(key),
                                 result)
        self._history.setdefault(i, []).append((q.turns[turn], rec["_text"]))
        if self._progress is not None:
            self._progress.update(1)
        if turn + 1 >= len(q.turns) or self.cfg.ctx is not None:
            return None
        nxt = self._request(i, turn + 1, now)
        if self.continuous:  # a static batch checks its turn's longest prompt
            self.tally.check_positions(nxt.prompt)
        return nxt

    def _arrivals(self) -> list[Request]:
        """Every question's first turn, arriving at ``rate`` (Poisson, seeded: the same arrivals on
        every engine and repeat; inf: all at once)."""
        rng = random.Random(int(self.cfg.seed))
        out, t = [], 0.0
        for i in range(len(self.questions)):
            out.append(self._request(i, 0, t))
            self.tally.check_positions(out[-1].prompt)
            t += rng.expovariate(self.rate) if math.isfinite(self.rate) else 0.0
        return out

    def _prompt(self, i: int, turn: int) -> list[int]:
        q = self.questions[i]
        if self.cfg.ctx is not None:
            return q.ctx_ids
        return D.render(self.tokenizer, self._history.get(i, []), q.turns[turn], self.chat)

    def _request(self, i: int, turn: int, at: float) -> Request:
        prompt = self._prompts[(i, turn)] = self._prompt(i, turn)
        return Request((i, turn), prompt, at)


class Tally:
    """What a run's units produced, kept alike on every engine: the request records, the timed
    wall (per repeat), the batches, the per-step trace; and the metrics computed from them."""

    def __init__(self, cfg: DictConfig, tokenizer, K: int, reach: int, npos: int, n_questions: int):
        self.cfg, self.tokenizer, self.K, self.reach, self.npos = cfg, tokenizer, K, reach, npos
        self.n_questions = n_questions
        self.repeats = int(cfg.get("repeats") or 1)
        self.serving = Serving.of(cfg)
        self.continuous = self.serving.continuous
        self.requests: list[dict] = []
        self.wall, self.n_batches = 0.0, 0
        self.rep_tokens, self.rep_wall = [0] * self.repeats, [0.0] * self.repeats
        self.trace: list[tuple[float, int, int]] = []  # (step duration, rows in flight, tokens) of every decoding step
        # thinking.open / .close as token ids (None: the tokenizer has neither): each request's steps inside
        self.think = M.thinking_tags(tokenizer, cfg.get("thinking"))

    def units(self) -> list[tuple[int, int]]:
        """(repeat, first question) of every batch, in order; repeats=N measures the set N times.
        ``serving.batching=continuous``: the whole set is one stream of requests per repeat."""
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
        """Each stream (a repeat of ``serving.batching=continuous``): its wall time and every request's
        (admitted, done) seconds on its clock, from the request records (every engine writes them)."""
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
            "goodput": M.goodput(self.serving.ttft_ms, self.serving.tpot_ms, requests, wall),
            "in_flight": M.in_flight(self.trace, int(self.cfg.bs), self.streams() if self.continuous else None),
            "speedup": None,
            "match_ar": None,
        }
        if self.repeats > 1:  # each pass over the prompt set on its own: the spread between repeats
            metrics["repeat_tokens_per_s"] = [t / w if w > 0 else None for t, w in zip(self.rep_tokens, self.rep_wall)]
        return metrics, requests
