"""A step's cost on a named GPU (analysis.costmodel) and the replay of per-position traces on it
(analysis.replay) against SpecDecode-Bench's own simulator (tests/fixtures/specdecode_bench/make.py
ran it on the fixture's 24 requests)."""

import json

import pytest

from conftest import REPO
from specbench.analysis import costmodel as C, ingest, replay
from specbench.errors import ConfigError

FIX = REPO / "tests" / "fixtures" / "specdecode_bench"


def test_the_roofline_is_the_datasheet_over_the_bytes_and_the_flops():
    h100, l8 = C.GPUS["h100-sxm"], C.SHAPES["llama-3.1-8b"]
    assert l8.linear_params() == pytest.approx(7.50e9, rel=0.01)  # 8.03 B less the embedding (a lookup)
    assert l8.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    cost = C.resolve("h100:llama-3.1-8b:0")
    assert cost.overhead_s == 0 and cost.gpu is h100
    weights = l8.linear_params() * 2 / 3.35e12
    assert cost.target(1, 1, 0) == pytest.approx(weights)  # one token: the weights' stream
    kv = 32 * 1024
    assert cost.target(32, 1, kv) == pytest.approx(weights + kv * l8.kv_bytes_per_token() / 3.35e12)
    flops = 2 * l8.linear_params() * 128 * 16 + 4 * 32 * 32 * 128 * 16 * 128 * 1024
    assert cost.target(128, 16, 128 * 1024) == pytest.approx(flops / 989e12)  # compute-bound
    assert C.resolve("h100-sxm:llama-3.1-8b").overhead_s == C.STEP_OVERHEAD_S
    assert C.resolve("b200:llama-3.1-70b").target(1, 1, 0) < C.resolve("h100:llama-3.1-70b").target(1, 1, 0)
    assert C.resolve("l4:qwen3-8b:1.5").overhead_s == pytest.approx(1.5e-3)


def test_the_shapes_we_ship_match_their_configs():
    for name in ("llama-3.1-8b", "smollm2-135m"):
        cfg = json.loads((REPO / "specbench" / "shapes" / f"{name}.json").read_text())
        s = C.SHAPES[name]
        assert (s.layers, s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab, s.tied) == (
            cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"], bool(cfg.get("tie_word_embeddings")))


def test_specdecode_bench_constants_and_a_fit_that_recovers_them():
    sdb = C.resolve("specdecode-bench-h100")
    assert sdb.target(1, 1, 1000) == pytest.approx(3.92645679e-08 * 1000 + 2.10103129e-05 + 5.88590713e-03)
    assert sdb.draft("ngram", 8, 4, 1000, 0.01) == pytest.approx(0.01 * 0.005875)
    assert sdb.draft("eagle3", 8, 4, 1000, 0.01) == pytest.approx(2.37768493e-09 * 1000 + 8.41429603e-07 * 4
                                                                  + 2.13526175e-03)
    curve = C.to_curve(sdb, [1, 8, 32], [1, 2, 4, 8], 512, "llama-3.1-8b")  # what analysis.profile would record
    fit = C.fit_linear(curve)
    assert fit.c_kv == pytest.approx(sdb.c_kv, rel=1e-6) and fit.c_tok == pytest.approx(sdb.c_tok, rel=1e-6)
    assert fit.c_fixed == pytest.approx(sdb.c_fixed + sdb.overhead_s, rel=1e-6) and fit.fit["max_rel_err"] < 1e-9
    one = {"target": {"4": curve["target"]["8"]}, "ctx": 512}  # one batch size: kv does not vary
    assert C.fit_linear(one).c_kv == 0.0


def test_a_fitted_model_round_trips_through_the_cli(tmp_path, capsys):
    curves = tmp_path / "cost_curves.jsonl"
    curves.write_text(json.dumps(C.to_curve(C.resolve("specdecode-bench-h100"), [1, 16], [1, 4], 256, "m")) + "\n")
    assert C.main(["fit", str(curves), "--out", str(tmp_path / "mine.json")]) == 0
    mine = C.resolve(str(tmp_path / "mine.json"))
    assert mine.target(16, 4, 16 * 256) == pytest.approx(C.step(C.resolve("specdecode-bench-h100"), 16, 4, 16 * 256))
    assert C.main(["show", "--cost", str(tmp_path / "mine.json"), "--bs", "1,16", "--n", "1,4"]) == 0
    assert "bs=16" in capsys.readouterr().out


@pytest.mark.parametrize("spec, msg", [("h10:llama-3.1-8b", "unknown gpu h10; did you mean h100"),
                                       ("h100:llama-8b", "unknown model shape llama-8b; did you mean"),
                                       ("h100", "unknown cost model 'h100'"),
                                       ("h100:llama-3.1-8b:fast", "must be milliseconds"),
                                       ("nowhere.json", "does not exist")])
def test_a_bad_cost_model_is_one_line(spec, msg):
    with pytest.raises(ConfigError, match=msg):
        C.resolve(spec)


def _fixture_requests():
    recs = ingest.ingest(FIX / "gsm8k_24.jsonl", "specdecode-bench", "1", "eagle3,ngram")
    return replay.requests_of(recs)[0]


def test_the_replay_gives_specdecode_benchs_speedups():
    """Within 2% where its simulator is deterministic, 5% for n-gram at a fixed K (drawn at random)."""
    ref = json.loads((FIX / "reference_small.json").read_text())
    reqs, cost = _fixture_requests(), C.resolve("specdecode-bench-h100")
    pol = {"FIXED_1": "fixed-1", "FIXED_3": "fixed-3", "FIXED_5": "fixed-5", "ORACLE": "oracle"}
    for row in ref["rows"]:
        ours = replay.replay(reqs, cost, row["bs"], pol[row["policy"]], row["proposer"], "gsm8k")
        tol = 0.05 if row["proposer"] == "ngram" and row["policy"] != "ORACLE" else 0.02
        assert ours == pytest.approx(row["speedup"], rel=tol), row


def test_padding_to_the_widest_row_and_our_combined_oracle_differ_where_they_should():
    reqs, cost = _fixture_requests(), C.resolve("specdecode-bench-h100")
    for bs in (1, 32):
        own = replay.replay(reqs, cost, bs, "fixed-3", "ngram", "gsm8k", width="own")
        widest = replay.replay(reqs, cost, bs, "fixed-3", "ngram", "gsm8k", width="widest")
        assert widest == own if bs == 1 else widest < own  # padded rows pay for the widest
        assert replay.replay(reqs, cost, bs, "oracle", "eagle3", "gsm8k", width="widest") == \
            replay.replay(reqs, cost, bs, "oracle", "eagle3", "gsm8k")  # copies alike: nothing to pad
    theirs = replay.replay(reqs, cost, 8, "oracle", "combined", "gsm8k")
    ours = replay.replay(reqs, cost, 8, "oracle", "combined", "gsm8k", combine="ours")
    eagle = replay.replay(reqs, cost, 8, "oracle", "eagle3", "gsm8k")
    assert ours < theirs  # EAGLE's drafting charged at its own cost, not n-gram's
    assert ours >= eagle * 0.99  # and never much below EAGLE-3 alone (a path of the DP)


def test_the_replay_prices_traces_on_a_named_gpu():
    reqs = _fixture_requests()
    h100 = C.resolve("h100:llama-3.1-8b")
    one, many = (replay.replay(reqs, h100, bs, "fixed-5", "eagle3", "gsm8k") for bs in (1, 128))
    tau = ingest.ingest(FIX / "gsm8k_24.jsonl", "specdecode-bench", "5", "eagle3")[0]["metrics"]["tau"]
    assert 1.5 < one < tau and many < one  # at bs 128 the verify of 6 tokens a row is compute-bound


def test_the_replay_refuses_traces_without_positions(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({
        "id": "a", "usage": {"completion_tokens": 5},
        "metrics": {"speculative_decoding": {"num_spec_tokens": 3, "per_step_accepted": [3], "per_step_drafted": [3]}}}))
    with pytest.raises(ConfigError, match="no per-position traces"):
        replay.requests_of(ingest.ingest(f, "vllm"))
    two = ingest.ingest(FIX / "gsm8k_24.jsonl", "specdecode-bench", "1", "eagle3") + \
        ingest.ingest(FIX / "gsm8k_24.jsonl", "specdecode-bench", "1", "eagle3", dataset="other")
    with pytest.raises(ConfigError, match="records of 2 data sets .gsm8k_24, other.: pick one with --dataset"):
        replay.requests_of(two)
    assert len(replay.requests_of(two, "other")[0]) == 24


def test_a_cost_models_curve_prices_the_bound_and_the_simulator(tmp_path):
    """``costmodel curve`` writes beside the records what analysis.profile would: the report's
    batch-aware bound and simulator read it as they read a measured curve."""
    import shutil

    from specbench.analysis import bounds
    from specbench.analysis.load import load, load_cost_curves

    shutil.copy(FIX.parent / "records.jsonl", tmp_path / "records.jsonl")
    assert C.main(["curve", "--cost", "h100:llama-3.1-8b", "--model", "tiny-llama", "--device", "cpu", "--dtype",
                   "float32", "--bs", "1,2,4", "--n", "1,2,3,4,5,6", "--ctx", "512", "--results-dir", str(tmp_path)]) == 0
    curves = load_cost_curves(tmp_path / "records.jsonl")
    assert [c["cost_model"] for c in curves] == ["h100-sxm:llama-3.1-8b"]
    df = load(tmp_path / "records.jsonl")
    bound = bounds.batch_aware(df, curves)
    sd = df["method"] != "ar"
    assert bound[sd].notna().all() and (bound[sd] > 0).all()
    # and the simulator replays the jobs' traces on it
    assert not bounds.simulated(df, curves).empty


def test_the_replay_cli(tmp_path, capsys):
    out = tmp_path / "records.jsonl"
    assert ingest.main([str(FIX / "gsm8k_24.jsonl"), "--format", "specdecode-bench", "--K", "3", "--out", str(out)]) == 0
    assert "eagle K=3 on gsm8k_24: 24 requests" in capsys.readouterr().out
    assert replay.main([str(out), "--bs", "1,8", "--policy", "oracle", "--json", str(tmp_path / "s.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split()[:2] for x in lines] == [["eagle3", "oracle"], ["ngram", "oracle"], ["combined", "oracle"]]
    got = json.loads((tmp_path / "s.json").read_text())
    ref = {(r["proposer"], r["bs"]): r["speedup"] for r in json.loads((FIX / "reference_small.json").read_text())["rows"]
           if r["policy"] == "ORACLE"}
    for row in got["rows"]:
        for bs, s in row["speedups"].items():
            assert s == pytest.approx(ref[(row["proposer"], int(bs))], rel=1e-3)
    with pytest.raises(SystemExit):
        replay.main([str(out), "--cost", "h100:llama"])
    assert "unknown model shape llama" in capsys.readouterr().err
