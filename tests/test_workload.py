"""The workload every engine's run is driven by (specbench.run.workload): static batches and their
turns, a question's next turn holding its history, Poisson arrivals from the seed, and the tally of
what came back; against a stand-in engine (no model) and a character tokenizer."""

import heapq
import random
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from specbench.decode.engine import RowResult
from specbench.errors import ConfigError
from specbench.run import data as D
from specbench.run.data import Question
from specbench.run.workload import Workload

# questions with 2, 1 and 2 turns
QUESTIONS = [Question("a", "math", ["one plus one?", "and times two?"]), Question("b", "code", ["hello"]),
             Question("c", "math", ["why?", "why not?"])]


class Chars:
    """A tokenizer of characters (ids are code points), without a chat template."""

    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, toks, skip_special_tokens=True):
        return "".join(chr(t) for t in toks)


def answer(prompt: list[int], t0: float = 0.0, t1: float = 0.0) -> RowResult:
    """The stand-in engine's answer to a prompt: its length in letters (3 tokens, 2 steps)."""
    toks = [ord("x")] + [ord("a") + len(prompt) % 26] * 2
    return RowResult(tokens=toks, steps=2, accept_lens=[0, 1], drafted=[1, 1], nodes=[1, 1], valid_nodes=[1, 1],
                     t_first=t0 + 0.1, t_done=t1, t_arrival=t0, t_admit=t0, chunks=[t1 - 0.05, t1])


class Engine:
    """Decodes a static batch in 0.5 s; serves a stream one request at a time, 1 s each, on a
    clock of its own, handing each answer to the workload at its finish time."""

    def __init__(self):
        self.batches, self.served = [], []  # prompts of each static batch; (key, arrival, done) in a stream

    def batch(self, prompts):
        self.batches.append(prompts)
        return [answer(p, 0.0, 0.5) for p in prompts], 0.5

    def stream(self, requests, answered):
        queue = [(r.arrival, n, r) for n, r in enumerate(requests)]
        heapq.heapify(queue)
        now, n = 0.0, len(queue)
        while queue:
            at, _, r = heapq.heappop(queue)
            start = max(now, at)
            now = start + 1.0
            self.served.append((r.key, r.arrival, now, r.prompt))
            nxt = answered(r.key, answer(r.prompt, r.arrival, now), now)
            if nxt is not None:
                heapq.heappush(queue, (nxt.arrival, n, nxt))
                n += 1
        return now


def workload(serving=None, **over):
    cfg = OmegaConf.create({"bs": 2, "max_new_tokens": 4, "repeats": 1,
                            "serving": {"batching": "static", "rate": "inf", "slo": {}, **(serving or {})},
                            "seed": 3, "ctx": None, "model": {"chat": False}, **over})
    return Workload(SimpleNamespace(cfg=cfg, tokenizer=Chars(), questions=QUESTIONS), K=2, reach=2, npos=4096)


def test_static_batches_run_turn_by_turn_with_their_history():
    w, eng = workload(), Engine()
    assert w.units() == [(0, 0), (0, 2)]  # bs=2: two batches of the three questions
    assert w.warmup_prompts() == [D.render(Chars(), [], q.turns[0], False) for q in QUESTIONS[:2]]
    for unit in w.units():
        w.run(unit, eng)
    # batch 0: both first turns, then a's second alone; batch 1: c's two turns
    assert [len(b) for b in eng.batches] == [2, 1, 1, 1]
    first_a = eng.batches[0][0]
    a_answer = Chars().decode(answer(first_a).tokens)
    assert eng.batches[1][0] == D.render(Chars(), [(QUESTIONS[0].turns[0], a_answer)], QUESTIONS[0].turns[1], False)
    rows = [(r["id"], r["turn"], r["batch"]) for r in w.tally.requests]
    assert rows == [("a", 1, 0), ("b", 1, 0), ("a", 2, 0), ("c", 1, 1), ("c", 2, 1)]
    assert w.tally.wall == pytest.approx(4 * 0.5) and w.tally.n_batches == 4  # each turn of a batch timed


def test_a_unit_starts_without_the_history_of_the_one_before():
    """repeats=2: the second pass renders the same prompts as the first (no answer carried over)."""
    w, eng = workload(repeats=2), Engine()
    assert w.units() == [(0, 0), (0, 2), (1, 0), (1, 2)]
    for unit in w.units():
        w.run(unit, eng)
    assert eng.batches[:4] == eng.batches[4:]
    assert [r["repeat"] for r in w.tally.requests] == [0] * 5 + [1] * 5
    metrics, _ = w.tally.metrics({}, 8)
    assert metrics["repeat_tokens_per_s"] == pytest.approx([15 / 2.0, 15 / 2.0])  # 5 answers of 3 tokens per pass


def test_a_stream_takes_poisson_arrivals_from_the_seed_and_each_next_turn_when_answered():
    w, eng = workload({"batching": "continuous", "rate": 2.0}), Engine()
    assert w.units() == [(0, 0)]
    w.run((0, 0), eng)
    rng = random.Random(3)
    gaps = [rng.expovariate(2.0) for _ in range(2)]
    firsts = {key[0]: at for key, at, _, _ in eng.served if key[1] == 0}
    assert firsts == pytest.approx({0: 0.0, 1: gaps[0], 2: gaps[0] + gaps[1]})
    done = {key: t for key, _, t, _ in eng.served}
    for key, at, _, prompt in eng.served:
        if key[1] == 1:  # a next turn arrives when the turn before it is answered, holding that answer
            assert at == done[(key[0], 0)]
            assert len(prompt) > len(QUESTIONS[key[0]].turns[1])
    assert len(eng.served) == 5 and w.tally.wall == pytest.approx(eng.served[-1][2])
    recs = {(r["id"], r["turn"]): r for r in w.tally.requests}
    assert recs[("a", 2)]["arrival_s"] == done[(0, 0)] and all("queue_s" in r for r in recs.values())
    assert [r["batch"] for r in w.tally.requests] == [key[0] for key, *_ in eng.served]  # the question's index
    again = Engine()  # the same seed: the same arrivals, on any engine and in every repeat
    workload({"batching": "continuous", "rate": 2.0}).run((0, 0), again)
    assert [s[:2] for s in again.served] == [s[:2] for s in eng.served]
    at_once = Engine()
    workload({"batching": "continuous"}).run((0, 0), at_once)  # rate=inf: every first turn at 0
    assert [at for key, at, _, _ in at_once.served if key[1] == 0] == [0.0, 0.0, 0.0]


def test_the_tally_keeps_each_answer_and_the_metrics_of_the_job():
    w, eng = workload(), Engine()
    progress = SimpleNamespace(n=0, update=lambda k: setattr(progress, "n", progress.n + k))
    for unit in w.units():
        w.run(unit, eng, progress)
    assert progress.n == 5  # one per answered turn
    metrics, requests = w.tally.metrics({}, 10)
    assert [r["new_tokens"] for r in requests] == [3] * 5 and metrics["new_tokens"] == 15
    assert metrics["wall_s"] == pytest.approx(2.0) and metrics["tokens_per_s"] == pytest.approx(7.5)
    assert metrics["steps"] == 10 and metrics["tau"] == pytest.approx(1.5)  # accepted 0 then 1 in each request
    assert metrics["batches"] == 4 and metrics["iterations"] == 10
    for r in requests:
        assert r["prompt_tokens"] > 0 and r["accepts"] == "01" and "_text" in r and "arrival_s" not in r
        assert r["wall_s"] == pytest.approx(0.5) and r["ttft_s"] == pytest.approx(0.1)


def test_a_prompt_past_the_models_positions_is_refused_before_it_runs():
    cfg = OmegaConf.create({"bs": 2, "max_new_tokens": 4, "repeats": 1,
                            "serving": {"batching": "static", "rate": "inf", "slo": {}},
                            "seed": 3, "ctx": None, "model": {"chat": False}})
    w, eng = Workload(SimpleNamespace(cfg=cfg, tokenizer=Chars(), questions=QUESTIONS), 2, 2, npos=19), Engine()
    with pytest.raises(ConfigError, match=r"a prompt of 13 tokens \+ max_new_tokens=4 \+ 2 draft positions exceeds "
                                          r"the 19 positions"):
        w.run((0, 0), eng)  # "one plus one?" is the batch's longest prompt
    assert eng.batches == []
