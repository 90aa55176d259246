"""Acceptance where it differs (metrics.acceptance_by): tau and alpha_i per category, per turn and
inside or outside a thinking span, from the steps each request records; on a synthetic stream with
known spans, through a job's tally, and from records written before the field."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specbench.errors import ConfigError
from specbench.paths import CONF_DIR
from specbench.run import metrics as M
from specbench.run import schema
from specbench.run.workload import Tally

FIX = Path(__file__).parent / "fixtures" / "records.jsonl"
OPEN, CLOSE = 5, 6
TAGS = ({OPEN}, {CLOSE})


class Tok:
    """A tokenizer with ``<think>`` and ``</think>`` as tokens of its own (or without them)."""

    def __init__(self, tags=True):
        self.vocab = {"a": 1, "b": 2, **({"<think>": OPEN, "</think>": CLOSE} if tags else {})}

    def get_vocab(self):
        return dict(self.vocab)

    def decode(self, toks, skip_special_tokens=True):
        return " ".join(map(str, toks))


# (prompt, output tokens, accepted drafts per step, the steps that began inside, as ranges)
STREAMS = [
    # the prefill's token opens the span; step 1 emits the close (it began inside: inside); 2, 3 outside
    ([1, 2, 3], [OPEN, 10, 11, 12, CLOSE, 13, 14, 15, 16], [2, 1, 0, 1], [[0, 2]]),
    # the chat template opens the span in the prompt; the first step closes it
    ([1, OPEN], [20, 21, CLOSE, 22], [1, 0], [[0, 1]]),
    # no thinking at all; then a span opened and closed twice (two ranges)
    ([1, 2], [30, 31, 32], [0, 1], []),
    ([1], [40, OPEN, 41, CLOSE, 42, OPEN, 43, 44], [0, 0, 1, 0, 1], [[1, 3], [4, 5]]),
]


@pytest.mark.parametrize("prompt,tokens,lens,spans", STREAMS)
def test_thinking_steps_are_the_steps_that_began_inside_a_span(prompt, tokens, lens, spans):
    assert M.thinking_steps(prompt, tokens, lens, TAGS) == spans


def test_acceptance_inside_and_outside_the_span_of_a_known_stream():
    reqs = [{"category": c, "turn": t, "accepts": M.encode_accepts(lens),
             "thinking_steps": M.thinking_steps(p, toks, lens, TAGS)}
            for (p, toks, lens, _), c, t in zip(STREAMS, ("math", "code", "math", "code"), (1, 2, 1, 2))]
    by = M.acceptance_by(reqs, K=2)
    # inside: steps with 2, 1 (first), 1 (second), 0, 1 (fourth: steps 1, 2 and 4) accepted
    inside, outside = [2, 1, 1, 0, 1, 1], [0, 1, 0, 0, 1, 0, 0]
    for part, lens in (("inside", inside), ("outside", outside)):
        got = by["thinking"][part]
        assert got["steps"] == len(lens)
        assert got["tau"] == pytest.approx(1 + sum(lens) / len(lens))
        assert got["accept_rate_per_pos"] == pytest.approx([sum(x >= i for x in lens) / len(lens) for i in (1, 2)])
    assert by["turn"]["1"]["steps"] == 6 and by["turn"]["2"]["steps"] == 7
    assert by["category"]["math"]["tau"] == pytest.approx(1 + 5 / 6)
    # every split adds up to the job's own steps and tau
    whole = M.acceptance([x for r in reqs for x in M.decode_accepts(r["accepts"])], 2, [])
    for split in ("category", "turn", "thinking"):
        parts = by[split].values()
        assert sum(p["steps"] for p in parts) == whole["steps"]
        assert 1 + sum(p["steps"] * (p["tau"] - 1) for p in parts) / whole["steps"] == pytest.approx(whole["tau"])
    assert "thinking" not in M.acceptance_by([{k: v for k, v in r.items() if k != "thinking_steps"} for r in reqs], 2)
    assert M.acceptance_by([{"turn": 1}], 2) == {}  # requests without accepts: nothing to split


def test_the_tags_are_tokens_of_the_tokenizer_or_off():
    on = OmegaConf.create({"open": "<think>", "close": "</think>"})
    assert M.thinking_tags(Tok(), on) == TAGS
    assert M.thinking_tags(Tok(tags=False), on) is None  # SmolLM2, Gemma-3: neither tag is a token
    assert M.thinking_tags(Tok(), OmegaConf.create({"open": None, "close": None})) is None
    assert M.thinking_tags(Tok(), None) is None


def _tally(tok, thinking):
    cfg = OmegaConf.create({"bs": 1, "max_new_tokens": 16, "repeats": 1, "serving": {"batching": "static", "slo": {}},
                            **({"thinking": thinking} if thinking is not None else {})})
    return Tally(cfg, tok, 2, 2, 4096, len(STREAMS))


def _run(tally):
    for i, (prompt, toks, lens, _) in enumerate(STREAMS):
        r = SimpleNamespace(tokens=toks, accept_lens=lens, steps=len(lens), t_first=0.1, t_done=0.5, t_arrival=0.0,
                            t_admit=0.0, chunks=[0.1 * (j + 2) for j in range(len(lens))], hit_eos=False,
                            drafted=[2] * len(lens), nodes=[2] * len(lens), valid_nodes=[2] * len(lens))
        tally.request(SimpleNamespace(id=str(i), category="c", turns=["x"]), 0, i, 0, prompt, r)
        tally.timed(0, 0.5)
    return tally.metrics({}, 10)


def test_a_job_records_each_requests_thinking_steps_and_the_split():
    metrics, requests = _run(_tally(Tok(), {"open": "<think>", "close": "</think>"}))
    assert [rq["thinking_steps"] for rq in requests] == [s for *_, s in STREAMS]
    assert metrics["acceptance_by"]["thinking"]["inside"]["steps"] == 6
    assert metrics["thinking_tags"] == {"open": "<think>", "close": "</think>"}
    assert metrics["acceptance_by"]["turn"]["1"]["tau"] == pytest.approx(metrics["tau"])
    # a tokenizer without the tags, or a config without the setting: no span, no split, the rest as before
    for tally in (_tally(Tok(tags=False), {"open": "<think>", "close": "</think>"}), _tally(Tok(), None)):
        metrics, requests = _run(tally)
        assert not any("thinking_steps" in rq for rq in requests)
        assert "thinking" not in metrics["acceptance_by"] and "thinking_tags" not in metrics
        assert set(metrics["acceptance_by"]) == {"category", "turn"}


def test_records_before_the_field_get_their_split_from_their_requests():
    from specbench.analysis.load import load
    from specbench.analysis.splits import split_rows

    df = load(FIX)  # written before acceptance_by: computed from each request's accepts and turn
    pld = df[(df["method"] == "pld") & (df["bs"] == 1) & (df["K"] == 4)].iloc[0]
    by = pld["acceptance_by"]
    assert set(by) == {"category", "turn"} and set(by["turn"]) == {"1", "2"}
    steps = sum(p["steps"] for p in by["turn"].values())
    assert steps == pld["steps"]
    assert 1 + sum(p["steps"] * (p["tau"] - 1) for p in by["turn"].values()) / steps == pytest.approx(pld["tau"])
    rows = split_rows(df)
    assert {"turn 1", "turn 2"} <= set(rows["part"]) and "inside thinking" not in set(rows["part"])


def test_the_thinking_setting_is_held_to_the_schema():
    def composed(overrides):
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            return compose("config", overrides=overrides)

    cfg = composed([])
    assert OmegaConf.to_container(cfg.thinking) == {"open": "<think>", "close": "</think>"}
    schema.check(composed(["thinking.open='<|begin_of_thought|>'", "thinking.close=null"]))
    with pytest.raises(ConfigError, match="thinking.open must be a string"):
        schema.check(composed(["thinking.open=3"]))
    with pytest.raises(ConfigError):
        schema.check_key("thinking.opn")
