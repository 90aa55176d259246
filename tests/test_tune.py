"""K=auto (specbench.run.tune): each setting a method lists is piloted on held-out prompts at the
job's batch size and priced with the batch-aware bound; the job runs the best and records why."""

import pytest

from specbench.run import runner
from specbench.run import tune
from specbench.run.workload import Job
from specbench.errors import ConfigError
from helpers import tiny_cfg

PLD = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}


def test_auto_pilots_held_out_prompts_and_records_the_choice(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, bs=2, K="auto", **{"tune.K": [1, 2, 4], "tune.tokens": 8}, **PLD)
    ar, rec = runner.run(cfg, sweep_id="s")
    assert ar["method"] == "ar" and "tuned" not in ar and "K_auto" not in ar
    t = rec["tuned"]
    assert rec["K_auto"] is True and [c["setting"] for c in t["candidates"]] == [{"K": 1}, {"K": 2}, {"K": 4}]
    best = max(t["candidates"], key=lambda c: c["bound"])
    assert t["chosen"] == best["setting"] and rec["K"] == best["setting"]["K"]
    # the pilot's prompt is the question after limit=4, never a measured one
    assert t["prompts"] == ["4"] and "4" not in {rq["id"] for rq in rec["requests"]}
    for c in t["candidates"]:  # each candidate's own bound from its measured tau and costs
        assert c["bound"] == pytest.approx(c["tau"] * t["cost_s"]["1"] / (c["t_draft"] + c["t_verify"]))
        assert len(c["accept_rate_per_pos"]) >= c["setting"]["K"]
    assert rec["metrics"]["match_ar"] == 1.0 and t["bs"] == 2
    # a fixed-K job with the chosen K is another job (resume does not take one for the other)
    from specbench.run import records as R
    fixed = dict(rec, K_auto=None)
    fixed.pop("K_auto")
    assert R.job_key(fixed) != R.job_key(rec)
    # the report: K=auto beside every fixed K measured at that batch size
    for k in (1, 4):
        runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, K=k, **PLD), sweep_id="s")
    from specbench.analysis import report
    from specbench.run.summary import summary_table

    written = {p.name for p in report.build(tmp_path / "records.jsonl", tmp_path / "report")}
    assert {"tuned_vs_fixed.png", "tuned.md"} <= written
    table = (tmp_path / "report" / "tuned.md").read_text()
    assert "pld (K=auto)" in table and f"K={rec['K']}" in table and "| 2 |" in table
    row = next(line for line in table.splitlines() if line.startswith("| pld (K=auto)"))
    assert row.split("|")[7].strip() == "2"  # both fixed settings measured at bs=2 are compared
    assert f"auto:{rec['K']}" in summary_table([rec])


def test_auto_picks_the_largest_bound(tiny_dirs, tmp_path, monkeypatch):
    """The choice is the bound's argmax: a long K with the best tau loses when its verify costs
    more than its tokens are worth (a narrower tie wins)."""
    taus = {1: 1.6, 2: 2.0, 4: 2.4}
    monkeypatch.setattr(tune, "_pilot", lambda job: {"tau": taus[int(job.cfg.K)], "accept_rate_per_pos": [],
                                                     "width": int(job.cfg.K) + 1, "t_draft": 0.0, "t_verify_pilot": 0.0,
                                                     "spec_len": int(job.cfg.K)})
    cost = {1: 1.0, 2: 1.1, 3: 1.2, 5: 2.4}  # T(bs, n): a wide verify is dear
    monkeypatch.setattr(tune, "forward_times", lambda model, bs, ns, *a, **k: {n: cost[n] for n in ns})
    cfg = tiny_cfg(tiny_dirs, tmp_path, K="auto", **{"tune.K": [1, 2, 4]}, **PLD)
    from specbench.models import load_model, load_tokenizer
    import torch

    model, tok = load_model(cfg.model, torch.device("cpu"), torch.float32), load_tokenizer(cfg.model)
    job = Job(cfg, "pld", model, tok, torch.device("cpu"), torch.float32, [], "s")
    out, info = tune.choose(job)
    assert info["chosen"] == {"K": 2} and out.K == 2 and out.K_auto  # 2.0/1.2 beats 1.6/1.1 and 2.4/2.4
    assert [round(c["bound"], 3) for c in info["candidates"]] == [round(1.6 / 1.1, 3), round(2.0 / 1.2, 3), 1.0]
    assert "<- chosen" in tune.table(info).splitlines()[3] and info["beats_ar"]
    cost[1] = 0.5  # AR's step so cheap that no candidate's bound reaches 1: said, and the best still runs
    out, info = tune.choose(job)
    assert info["chosen"] == {"K": 2} and not info["beats_ar"] and "not expected to beat AR" in tune.table(info)


def test_auto_prices_on_a_gpu_cost_model(tiny_dirs, tmp_path, monkeypatch):
    """``tune.cost``: the acceptance piloted here, priced on a GPU's cost model at the job's batch
    size (SpecDecode-Bench's H100 fit): nothing is profiled, the draft time is the model's for the
    method's kind, and the choice moves with the batch as the model says."""
    import torch

    from specbench.analysis import costmodel
    from specbench.models import load_model, load_tokenizer

    taus = {1: 1.6, 2: 2.0, 4: 2.4}
    monkeypatch.setattr(tune, "_pilot", lambda job: {"tau": taus[int(job.cfg.K)], "accept_rate_per_pos": [],
                                                     "width": int(job.cfg.K) + 1, "t_draft": 9.0, "t_verify_pilot": 0.0,
                                                     "spec_len": int(job.cfg.K)})
    monkeypatch.setattr(tune, "forward_times", lambda *a, **k: pytest.fail("profiled the target"))
    H = costmodel.SPECDECODE_BENCH_H100
    chosen = {}
    for bs in (1, 128):
        cfg = tiny_cfg(tiny_dirs, tmp_path, bs=bs, K="auto", **{"tune.K": [1, 2, 4], "tune.cost": H.name}, **PLD)
        model, tok = load_model(cfg.model, torch.device("cpu"), torch.float32), load_tokenizer(cfg.model)
        out, info = tune.choose(Job(cfg, "pld", model, tok, torch.device("cpu"), torch.float32, [], "s"))
        kv = bs * info["ctx"]
        assert info["cost_model"] == H.name and f"on {H.name}" in tune.table(info)
        assert info["cost_s"]["1"] == pytest.approx(costmodel.step(H, bs, 1, kv))
        for c in info["candidates"]:
            w = c["width"]
            assert c["t_verify"] == pytest.approx(costmodel.step(H, bs, w, kv)) and c["t_draft_here"] == 9.0
            assert c["t_draft"] == pytest.approx(H.ngram_share * H.target(bs, w, kv))  # PLD: n-gram drafting
            assert c["bound"] == pytest.approx(c["tau"] * info["cost_s"]["1"] / (c["t_draft"] + c["t_verify"]))
        chosen[bs] = info["chosen"]["K"]
    # a verify of 5 costs the H100 about what one does at bs 1, and more than twice as much at bs 128
    assert chosen == {1: 4, 128: 2}
    # an EAGLE tree drafts one forward per depth: priced at depth + 1, not at its width
    from specbench.run.tune import _modelled

    rows = [{"tree": True, "width": 17.0, "spec_len": 4, "t_draft": 1.0}, {"tree": False, "width": 5.0, "spec_len": 4,
                                                                            "t_draft": 1.0}]
    eagle = tiny_cfg(tiny_dirs, tmp_path, method={"name": "eagle"})
    R = costmodel.resolve("h100:llama-3.1-8b")
    _modelled(eagle, "h100:llama-3.1-8b", rows, 1, 512)
    for r in rows:
        assert r["t_draft"] == pytest.approx(R.draft("eagle", 1, 5, 512, R.target(1, r["width"], 512)))
    monkeypatch.setattr(__import__("specbench").methods.get("pld"), "cost_kind", None)
    with pytest.raises(ConfigError, match="tune.cost prices n-gram and EAGLE-style drafting only, and pld declares"):
        tune.check(cfg, model.config, torch.device("cpu"))


def test_auto_sizes_a_tree_method_by_its_own_keys(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, K="auto", **{"tune.tokens": 8},
                   method={"name": "lookahead", "W": "auto", "N": "auto", "G": "auto", "pool_cap": None,
                           "prompt_ngrams": True})
    ar, rec = runner.run(cfg, sweep_id="s")
    t = rec["tuned"]
    assert all(set(c["setting"]) == {"method.W", "method.N", "method.G"} for c in t["candidates"])
    chosen = t["chosen"]
    assert {k: rec["method_opts"][k.split(".")[1]] for k in chosen} == chosen
    assert rec["K"] == chosen["method.N"] - 1 and rec["metrics"]["match_ar"] == 1.0


@pytest.mark.parametrize("over,msg", [
    ({"K": "x"}, "K must be an integer >= 1, got 'x' (or auto"),
    ({"K": "auto", "tune.K": [0, 2]}, "tune.K must be a list of integers >= 1"),
    ({"K": "auto", "limit": None}, "K=auto pilots on questions held out from the measured ones"),
    ({"K": "auto", "limit": 5}, "has no questions after limit=5 to pilot on"),
    ({"K": "auto", "tune.cost": "h100:llama-9b"}, "unknown model shape llama-9b"),
])
def test_auto_refusals(tiny_dirs, tmp_path, over, msg):
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, **{**PLD, **over}), sweep_id="s")
    assert recs[-1]["status"] == "error" and msg in recs[-1]["error"], recs[-1]["error"]


def test_auto_for_ar_is_a_plain_ar_job(tiny_dirs, tmp_path):
    (rec,) = runner.run(tiny_cfg(tiny_dirs, tmp_path, K="auto", method={"name": "ar"}), sweep_id="s")
    assert rec["status"] == "ok" and "tuned" not in rec


def test_auto_refuses_a_method_that_reads_k_but_lists_nothing(tiny_dirs, tmp_path, monkeypatch):
    from specbench import methods

    monkeypatch.setattr(methods.get("pld"), "tune_space", classmethod(lambda cls, cfg, device: []))
    with pytest.raises(ConfigError, match="lists no settings to choose among"):
        tune.candidates(tiny_cfg(tiny_dirs, tmp_path, K="auto", **PLD), __import__("torch").device("cpu"))


def test_the_cost_of_a_verify_is_timed_in_the_shape_the_job_runs(monkeypatch):
    """forward_time prices ragged rows through the masked path (every real batch of bs > 1 is
    left-padded) and a tree's nodes through a 4D ancestor mask, not dense equal rows in a chain."""
    import torch

    from helpers import CPU, tiny_llama
    from specbench import costs
    from specbench.decode.kv import RaggedCache

    seen = []
    plain = RaggedCache.forward

    def forward(self, tokens, depth, anc, **kw):
        seen.append((self.is_dense(), anc is not None, int(depth.max())))
        return plain(self, tokens, depth, anc, **kw)

    monkeypatch.setattr(RaggedCache, "forward", forward)
    m = tiny_llama(device=CPU)
    for kw, want in (({}, (True, False, 6)), ({"ragged": True}, (False, False, 6)),
                     ({"ragged": True, "tree": True}, (False, True, 2))):
        seen.clear()
        assert costs.forward_time(m, 3, 7, 16, CPU, torch.float32, 1, 96, **kw) > 0
        assert set(seen) == {want}, (kw, seen)


def test_the_pilot_prices_the_verify_width_its_steps_ran(tiny_dirs, tmp_path, monkeypatch):
    """K=auto prices a setting at the width its pilot's verify forwards ran (forward_nodes + 1: in a
    ragged batch every row runs the widest row's draft), not at the rows' mean own draft
    (valid_nodes + 1), which prices ragged drafts as if unpadded."""
    import torch

    from specbench.decode.kv import RaggedCache
    from specbench.models import load_model, load_tokenizer
    from specbench.run import metrics as M
    from specbench.run.workload import build_requests

    shapes, plain = [], RaggedCache.forward  # (rows, width) of every verify forward
    monkeypatch.setattr(RaggedCache, "forward", lambda self, tokens, *a, **k: (
        shapes.append(tuple(tokens.shape)), plain(self, tokens, *a, **k))[1])
    seen, acceptance = [], M.acceptance
    monkeypatch.setattr(M, "acceptance", lambda *a, **k: seen.append(acceptance(*a, **k)) or seen[-1])
    cfg = tiny_cfg(tiny_dirs, tmp_path, bs=4, K=4, warmup=False, **PLD)
    cpu = torch.device("cpu")
    model, tok = load_model(cfg.model, cpu, torch.float32), load_tokenizer(cfg.model)
    pilot = tune._pilot(Job(cfg, "pld", model, tok, cpu, torch.float32, build_requests(cfg, tok), "s"))
    ran = sum(b * w for b, w in shapes) / sum(b for b, _ in shapes)  # per row-step, the root included
    assert pilot["width"] == pytest.approx(ran)
    assert pilot["width"] > seen[-1]["valid_nodes"] + 1 + 0.1  # the rows' drafts were ragged
