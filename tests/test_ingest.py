"""Acceptance traces recorded elsewhere become records (analysis.ingest): SpecDecode-Bench's
per-position traces, vLLM's per-request spec-decode metrics, SPEED-Bench's speculation profile."""

import json

import pytest

from conftest import REPO
from specbench.analysis import ingest
from specbench.errors import ConfigError

SDB = REPO / "tests" / "fixtures" / "specdecode_bench" / "gsm8k_24.jsonl"


def test_a_run_at_K_is_read_from_a_per_position_trace():
    # tokens a step from each output position would emit; the prefill emitted position 0
    acc = [3, 1, 1, 4, 2, 1, 1, 5, 1, 1]
    assert ingest.walk(acc, 5) == [2, 3, 1]  # 0 -> 3 -> 7 -> 9 (the last step cut at the output's end)
    assert ingest.walk(acc, 1) == [1, 0, 1, 0, 0, 1]  # 0 -> 2 -> 3 -> 5 -> 6 -> 7 -> 9
    assert ingest.walk(acc, None) == ingest.walk(acc, 5)
    assert sum(a + 1 for a in ingest.walk(acc, 2)) == len(acc) - 1  # every token after the prefill's, once


def test_specdecode_bench_traces_become_records_with_their_metrics():
    recs = ingest.ingest(SDB, "specdecode-bench", "1,3", "eagle3,ngram,combined")
    assert [(r["method"], r["K"]) for r in recs] == [("eagle", 1), ("eagle", 3), ("ngram", 1), ("ngram", 3),
                                                     ("combined", 1), ("combined", 3)]
    lines = [json.loads(x) for x in SDB.read_text().splitlines()]
    for r in recs:
        m = r["metrics"]
        steps = [ingest.DIGITS.index(c) for q in r["requests"] for c in q["accepts"]]
        assert m["steps"] == len(steps) and m["tau"] == pytest.approx(1 + sum(steps) / len(steps))
        assert sum(m["accept_len_hist"]) == m["steps"] and len(m["accept_rate_per_pos"]) == r["K"]
        assert m["accept_rate_per_pos"][0] == pytest.approx(sum(a >= 1 for a in steps) / len(steps))
        assert r["lossless"] is True and r["backend"] == "specdecode-bench" and r["dataset"] == "gsm8k_24"
        assert r["source"]["proposer"] in ("eagle3", "ngram", "combined")
    eagle = recs[1]
    q, d = eagle["requests"][0], lines[0]
    assert q["id"] == d["id"] and q["prompt_tokens"] == len(d["prompt_token_ids"])
    assert q["new_tokens"] == len(d["acc_eagle"]["acc_len"])
    assert [ingest.DIGITS.index(c) + 1 for c in q["reach"]] == d["acc_eagle"]["acc_len"]
    assert eagle["metrics"]["tau"] > recs[0]["metrics"]["tau"] > recs[2]["metrics"]["tau"]  # K=3 > K=1 > n-gram
    both = recs[5]["requests"][0]["reach"]
    assert both == "".join(max(a, b) for a, b in zip(eagle["requests"][0]["reach"], recs[3]["requests"][0]["reach"]))


def test_ingested_records_draw_the_acceptance_figures(tmp_path):
    from specbench.analysis import report

    for r in ingest.ingest(SDB, "specdecode-bench", "3", "eagle3,ngram"):
        ingest.R.append(tmp_path / "records.jsonl", r)
    written = {p.name for p in report.build(tmp_path / "records.jsonl", tmp_path / "rep")}
    assert {"acceptance_per_position.png", "accept_length_hist.png", "sweep.md"} <= written


def _vllm_response(rid, accepted, drafted, k, completion=None):
    sd = {"mean_acceptance_length": 1 + sum(accepted) / len(accepted), "num_spec_tokens": k,
          "acceptance_histogram": [sum(a == j for a in accepted) for j in range(k + 1)],
          "num_spec_steps": len(accepted), "num_accepted_draft_tokens": sum(accepted),
          "num_draft_tokens": sum(drafted), "per_step_accepted": accepted, "per_step_drafted": drafted}
    return {"id": rid, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": completion},
            "metrics": {"time_to_first_token_ms": 9.0, "speculative_decoding": sd}}


def test_vllm_per_request_metrics_become_a_record(tmp_path):
    f = tmp_path / "responses.jsonl"
    rows = [_vllm_response("a", [3, 0, 1], [3, 3, 3], 3, completion=1 + 4 + 1 + 2 + 2),  # 2 undrafted steps
            _vllm_response("b", [2, 2], [3, 3], 3)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    [rec] = ingest.ingest(f, "vllm", model="meta-llama/Llama-3.1-8B-Instruct")
    assert rec["K"] == 3 and rec["backend"] == "vllm" and rec["source"]["order"] == "steps"
    a, b = rec["requests"]
    assert a["accepts"] == "30100" and a["undrafted_steps"] == 2 and a["new_tokens"] == 10
    assert b["accepts"] == "22" and b["prompt_tokens"] == 12
    m = rec["metrics"]
    assert m["steps"] == 7 and m["tau"] == pytest.approx(1 + 8 / 7)
    assert m["accept_rate_per_pos"] == pytest.approx([4 / 7, 3 / 7, 1 / 7])
    assert m["accept_rate_per_pos_cond"] == pytest.approx([4 / 7, 3 / 4, 1 / 3])
    assert m["tau_per_request"] == pytest.approx(((1 + 4 / 5) + 3) / 2)
    # summary level: the histogram without the order
    del rows[1]["metrics"]["speculative_decoding"]["per_step_accepted"]
    f.write_text(json.dumps(rows[1]) + "\n")
    [rec] = ingest.ingest(f, "vllm")
    assert rec["requests"][0]["accepts"] == "22" and rec["source"]["order"] == "histogram"


def test_speed_bench_profile_becomes_a_record(tmp_path):
    hist = {"1": 40, "2": 30, "3": 20, "4": 10}  # emitted tokens per step: steps
    prof = {"schema_version": "1.0", "measured": True, "method": "eagle3", "num_speculative_tokens": 3,
            "target_model": {"name": "meta-llama/Llama-3.1-8B-Instruct"}, "verification_method": "longest_prefix",
            "marginal_accept_rates": [0.6, 0.3, 0.1], "conditional_accept_rates": [0.6, 0.5, 1 / 3],
            "mean_accept_length": 2.0, "acceptance_length_histogram": hist, "per_category": {"coding": 2.3},
            "measurement_conditions": {"dataset": "speed_bench_qualitative", "engine": "vllm"}}
    f = tmp_path / "speculation_profile.json"
    f.write_text(json.dumps(prof))
    [rec] = ingest.ingest(f, "speed-bench")
    m = rec["metrics"]
    assert rec["model"] == "meta-llama/Llama-3.1-8B-Instruct" and rec["method"] == "eagle3" and rec["K"] == 3
    assert rec["dataset"] == "speed_bench_qualitative" and rec["lossless"] is None
    assert m["accept_rate_per_pos"] == pytest.approx(prof["marginal_accept_rates"])
    assert m["accept_rate_per_pos_cond"] == pytest.approx(prof["conditional_accept_rates"])
    assert m["tau"] == pytest.approx(prof["mean_accept_length"]) and m["accept_len_hist"] == [40, 30, 20, 10]
    assert rec["source"]["per_category"] == {"coding": 2.3}
    f.write_text(json.dumps({**prof, "measured": False}))
    with pytest.raises(ConfigError, match="unmeasured stub"):
        ingest.ingest(f, "speed-bench")


def test_bad_input_is_one_line(tmp_path, capsys):
    f = tmp_path / "x.jsonl"
    f.write_text('{"id": 1, "acc": {}}\n')
    with pytest.raises(ConfigError, match="not SpecDecode-Bench's layout"):
        ingest.ingest(f, "specdecode-bench")
    with pytest.raises(ConfigError, match="--per-request-spec-decode-metrics detailed"):
        ingest.ingest(f, "vllm")
    f.write_text("{not json\n")
    with pytest.raises(SystemExit):
        ingest.main([str(f), "--format", "vllm", "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("x.jsonl:1: not JSON (Expecting property name enclosed in double quotes)")
    with pytest.raises(ConfigError, match="--K must be"):
        ingest.ingest(SDB, "specdecode-bench", "0")
    with pytest.raises(ConfigError, match="unknown proposer medusa"):
        ingest.ingest(SDB, "specdecode-bench", "3", "medusa")
