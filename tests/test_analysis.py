"""Bound math against hand-computed values, the simulator on hand-made traces, the report
against the fixture records file, the regression compare, NVML and wandb loggers."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from specbench.analysis import bounds, compare, figures, report, simulate, tables, theory
from specbench.analysis.load import load
from specbench.costs import interp
from specbench.run import records as R

FIX = Path(__file__).parent / "fixtures"


def test_leviathan_closed_form_by_hand():
    # alpha 0.8, gamma 4: (1 - 0.8^5) / 0.2 = (1 - 0.32768) / 0.2 = 3.3616
    assert theory.expected_tokens(0.8, 4) == pytest.approx(3.3616)
    # c = 0.1: S = 3.3616 / 1.4 = 2.40114...
    assert theory.leviathan_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4)
    assert theory.expected_tokens(1.0, 3) == 4.0
    assert theory.expected_tokens(0.0, 5) == 1.0
    with pytest.raises(ValueError):
        theory.expected_tokens(1.5, 2)


def test_per_position_and_alpha_estimates():
    alphas = [0.8, 0.64, 0.512]  # i.i.d. 0.8 exactly
    assert theory.per_position_tokens(alphas) == pytest.approx(2.952)
    assert theory.alpha_from_positions(alphas) == pytest.approx(0.8)
    assert theory.per_position_tokens(alphas) == pytest.approx(theory.expected_tokens(0.8, 3))
    assert theory.alpha_from_tau(theory.expected_tokens(0.6, 4), 4) == pytest.approx(0.6, abs=1e-8)
    assert theory.alpha_from_tau(1.0, 4) == 0.0 and theory.alpha_from_tau(9, 4) == 1.0


def test_batch_aware_and_tree_forms():
    # tau 2.5, T_ar 10 ms, draft 4 ms, verify 12 ms -> 2.5 * 10 / 16 = 1.5625
    assert theory.batch_aware_speedup(2.5, 0.010, 0.004, 0.012) == pytest.approx(1.5625)
    # over a whole job: no prefill -> the step form; AR 100 decoded tokens in 1 s + 0.5 s of
    # prefill, the method 100 in 100 / 2.5 steps of 16 ms = 0.64 s + 0.5 s -> 1.5 / 1.14
    job = dict(bs=1, tokens=101, decoded=100, tokens_ar=101, decoded_ar=100)
    assert theory.batch_aware_job(2.5, 0.010, 0.004, 0.012, prefill_s=0, prefill_ar_s=0, **job) \
        == pytest.approx(1.5625)
    assert theory.batch_aware_job(2.5, 0.010, 0.004, 0.012, prefill_s=0.5, prefill_ar_s=0.5, **job) \
        == pytest.approx(1.5 / 1.14)
    # bs=4: 100 decoded tokens are 25 batch steps for AR, 10 for the method
    job4 = dict(job, bs=4)
    assert theory.batch_aware_job(2.5, 0.010, 0.004, 0.012, prefill_s=0.1, prefill_ar_s=0.1, **job4) \
        == pytest.approx((0.1 + 0.25) / (0.1 + 0.16))
    # root -> a (0.8), root -> b (0.5), a -> c (0.6): 1 + 0.8 + 0.5 + 0.48 = 2.78
    assert theory.tree_expected_tokens([0, 0, 1], [0.8, 0.5, 0.6]) == pytest.approx(2.78)


def test_interp_cost_curve():
    curve = {"1": {"1": 0.010, "4": 0.016}, "8": {"1": 0.020, "4": 0.040}}
    assert interp(curve, 1, 1) == 0.010
    assert interp(curve, 1, 2) == pytest.approx(0.012)
    assert interp(curve, 1, 7) == pytest.approx(0.022)  # extrapolated along the last slope
    assert interp(curve, 6, 4) == 0.040  # nearest profiled batch size


def test_bound_reads_the_curve_of_the_jobs_host_state():
    """Of several curves, the bound reads the one whose T(bs, 1) is nearest the AR record's
    own decode step; without an in-run step, the newest."""
    quiet = {"time": "a", "target": {"1": {"1": 0.020, "8": 0.030}}}
    starved = {"time": "b", "target": {"1": {"1": 0.032, "8": 0.040}}}
    newest = {"time": "c", "target": {"1": {"1": 0.021, "8": 0.026}}}
    assert bounds.nearest_state([quiet, starved], 1, {"t_verify": 2.9, "iterations": 100}) is starved
    assert bounds.nearest_state([quiet, starved], 1, {"t_verify": 2.2, "iterations": 100}) is quiet
    assert bounds.nearest_state([quiet, starved], 1, {"t_verify": 2.2, "iterations": 0}) is starved  # newest
    assert bounds.nearest_state([quiet, newest], 1, {"t_verify": 2.06, "iterations": 100}) is newest
    # through the report: the fixture's curves and a copy slowed 3x (its AR records' own steps
    # sit within 15% of the fixture's T(1)): the bound reads the fixture's, whatever the order
    df = load(FIX / "records.jsonl")
    curves = [json.loads(x) for x in (FIX / "cost_curves.jsonl").read_text().splitlines() if x.strip()]
    slow = [dict(c, target={b: {n: 3.0 * t for n, t in row.items()} for b, row in c["target"].items()})
            for c in curves]
    one = bounds.batch_aware(df, curves)
    assert one.notna().sum() == 12
    assert bounds.batch_aware(df, curves + slow).equals(one) and bounds.batch_aware(df, slow + curves).equals(one)
    assert ((bounds.batch_aware(df, slow) - one).abs()[one.notna()] > 1e-2).all()  # the slow curve alone reads differently


def test_report_says_when_a_bound_reads_another_host_state(tmp_path, capsys):
    """Each bound's curve against the paired AR's own step ("curve / AR step"): near 1 for the
    fixture's curves; a curve from a 3x slower state, the only one there, reads 3x and the
    report says so, one line per job."""
    df = load(FIX / "records.jsonl")
    curves = [json.loads(x) for x in (FIX / "cost_curves.jsonl").read_text().splitlines() if x.strip()]
    gap = bounds.curve_state_gap(df, curves)
    assert gap.notna().sum() == 12 and gap.between(1 / bounds.STATE_GAP, bounds.STATE_GAP).sum() == 12
    slow = [dict(c, target={b: {n: 3.0 * t for n, t in row.items()} for b, row in c["target"].items()})
            for c in curves]
    assert (bounds.curve_state_gap(df, slow) / gap).dropna().round(9).eq(3.0).all()
    (tmp_path / "recs").mkdir()
    (tmp_path / "recs" / "records.jsonl").write_text((FIX / "records.jsonl").read_text())
    (tmp_path / "recs" / "cost_curves.jsonl").write_text("".join(json.dumps(c) + "\n" for c in slow))
    capsys.readouterr()
    report.build(tmp_path / "recs", tmp_path / "rep")
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[report]")]
    assert len(warned) == 12 and all("another host state" in x for x in warned)
    assert "curve / AR step" in (tmp_path / "rep" / "sweep.csv").read_text()  # the full table
    report.build(FIX, tmp_path / "rep2")  # the fixture's own curves: nothing to say
    assert "[report]" not in capsys.readouterr().err


def test_a_compiled_job_reads_only_a_compiled_curve():
    """compile=true jobs are priced with curves profiled with --compile, eager jobs with eager
    ones: a job with no curve of its kind gets no bound."""
    df = load(FIX / "records.jsonl")
    curves = [json.loads(x) for x in (FIX / "cost_curves.jsonl").read_text().splitlines() if x.strip()]
    n_bounds = bounds.curve_state_gap(df, curves).notna().sum()
    assert n_bounds == 12
    compiled = [dict(c, compile=True) for c in curves]
    assert bounds.curve_state_gap(df, compiled).notna().sum() == 0  # eager jobs, compiled curves only
    df_c = df.assign(compile=True)
    assert bounds.curve_state_gap(df_c, curves).notna().sum() == 0
    assert bounds.curve_state_gap(df_c, compiled).notna().sum() == n_bounds


def test_simulator_by_hand():
    T = {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5}.get  # seconds per forward of n tokens
    steps = [3, 0, 1]  # K=3, draft 0.1 s/token
    tok, sec = simulate.fixed_k(steps, 3, 0.1, T)
    assert (tok, sec) == (7, pytest.approx(3 * (0.3 + 2.5)))
    tok, sec = simulate.oracle_k(steps, 0.1, T)
    assert (tok, sec) == (7, pytest.approx((0.3 + 2.5) + 1.0 + (0.1 + 1.5)))
    assert simulate.speedup(tok, sec, T) == pytest.approx(7 / 5.4)
    # combined oracle: A accepts 3 at 0 then 0; B accepts 0 at 0, then 3 at position 1
    tok, sec = simulate.combined_oracle({"A": [3, 0], "B": [0, 3]}, {"A": 0.0, "B": 0.0}, T)
    assert tok == 5 and sec == pytest.approx(2.5 + 1.0)  # A's 4 tokens at position 0, then one AR step
    assert simulate.decode_accepts("03a") == [0, 3, 10]


def test_report_from_fixture(tmp_path):
    written = report.build(FIX, tmp_path / "rep")
    names = {p.name for p in written}
    for fig in ("speedup_vs_batch", "speedup_vs_k", "acceptance_per_position", "time_split", "speedup_vs_bound",
                "accept_length_hist", "simulator"):
        assert f"{fig}.pdf" in names and f"{fig}.png" in names, fig
        assert (tmp_path / "rep" / f"{fig}.png").stat().st_size > 10_000
    for tab in ("sweep", "per_category"):
        assert f"{tab}.md" in names and f"{tab}.tex" in names
    md = (tmp_path / "rep" / "per_category.md").read_text()
    assert "overall" in md and "writing" in md and "coding" in md
    tex = (tmp_path / "rep" / "sweep.tex").read_text()
    assert tex.startswith(r"\begin{table}") and r"\bottomrule" in tex


def test_report_tables_fit_a_page_and_the_csv_keeps_every_column(tmp_path):
    """The sweep table a paper uses has at most 8 columns (the method, the settings that vary,
    tau, the speedup with its CI, ...) and names the settings all rows share; the per-category
    table has a speedup per category, overall and tau; the CSVs beside them keep everything."""
    import pandas as pd

    report.build(FIX, tmp_path / "rep")
    md = (tmp_path / "rep" / "sweep.md").read_text().splitlines()
    head = next(x for x in md if x.startswith("| method"))
    cols = [c.strip() for c in head.strip("|").split("|")]
    assert len(cols) <= tables.PAPER_COLUMNS and {"tau", "speedup (95% CI)"} <= set(cols)
    assert "model=" in md[0] and "model" not in cols  # one model in the fixture: said once, above
    assert all(len(r.strip("|").split("|")) == len(cols) for r in md if r.startswith("| "))
    full = pd.read_csv(tmp_path / "rep" / "sweep.csv")
    assert {"tok/s", "95% CI", "bound", "batch bound", "verify %", "match AR %", "peak MiB"} <= set(full.columns)
    assert len(full.drop_duplicates(subset=["method", "K", "bs", "tau", "speedup"])) == \
        len([r for r in md if r.startswith("| ")]) - 1
    paired = pd.DataFrame({"method": ["ar", "ar", "pld"], "model": "m", "dataset": "d", "dtype": "fp32",
                           "kernel": "native", "T": 0.0, "bs": 1, "K": [None, None, 4], "ctx": None,
                           "tau": [1.0, 1.0, 1.6], "speedup": [1.0, 1.0, 1.1], "95% CI": [None, None, "1.0-1.2"],
                           "match AR %": 100.0})
    t, _ = tables.paper_sweep(paired)  # a paired sweep's AR baselines read the same: shown once
    assert list(t["method"]) == ["ar", "pld"]
    cat = (tmp_path / "rep" / "per_category.md").read_text().splitlines()
    ccols = [c.strip() for c in next(x for x in cat if x.startswith("| method")).strip("|").split("|")]
    assert ccols[-2:] == ["overall", "tau"] and "writing" in ccols
    assert "speedup overall" in pd.read_csv(tmp_path / "rep" / "per_category.csv").columns


def test_report_numbers_match_records():
    df = load(FIX)
    recs = [r for r in R.read(FIX / "records.jsonl") if r["status"] == "ok"]
    assert len(df) == len(recs)
    lev = df[(df["method"] == "leviathan") & (df["bs"] == 1) & (df["K"] == 4)].iloc[0]
    raw = next(r for r in recs if r["method"] == "leviathan" and r["bs"] == 1 and r["K"] == 4)
    ar = next(r for r in recs if r["method"] == "ar" and r["bs"] == 1)
    c = (raw["metrics"]["time_s"]["draft"] / raw["metrics"]["iterations"] / 4) / (
        ar["metrics"]["time_s"]["verify"] / ar["metrics"]["iterations"])
    assert lev["c"] == pytest.approx(c)
    a = raw["metrics"]["accept_rate_per_pos"]
    assert lev["alpha"] == pytest.approx(sum(a) / (1 + sum(a[:-1])))
    assert lev["bound_leviathan"] == pytest.approx(theory.leviathan_speedup(lev["alpha"], 4, c))
    cat = tables.per_category(df)
    overall = cat[("tau", "overall")].loc[("leviathan (self_layers:1) (unpaired)", 0.0, 4, 1)]  # ar_baseline=sweep
    assert overall == pytest.approx(raw["metrics"]["tau"])


def test_report_cli_filters(tmp_path, capsys):
    from specbench.analysis.report import main

    assert main([str(FIX / "records.jsonl"), "--method", "pld", "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "speedup_vs_k.png" in out
    sweep = (tmp_path / "r" / "sweep.md").read_text()
    assert "pld" in sweep and "leviathan" not in sweep


def test_compare_passes_on_itself_and_fails_on_broken_acceptance(tmp_path, capsys):
    base = FIX / "records.jsonl"
    assert compare.main([str(base), str(base), "--bench-json", str(tmp_path / "b.json")]) == 0
    entries = json.loads((tmp_path / "b.json").read_text())
    assert all({"name", "unit", "value"} <= set(e) for e in entries) and entries
    # a method whose acceptance broke: pld's accepted-length counts shift
    recs = R.read(base)
    for r in recs:
        if r["method"] == "pld" and r["bs"] == 1 and r["K"] == 2:
            h = r["metrics"]["accept_len_hist"]
            h[0] += 1
            h[-1] -= 1
            r["metrics"]["tau"] -= 0.01
    broken = tmp_path / "new.jsonl"
    for r in recs:
        R.append(broken, r)
    assert compare.main([str(broken), str(base)]) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "accept_len_hist changed" in out and "pld K=2 bs=1" in out


def test_compare_speed_is_reported_not_failed(tmp_path, capsys):
    base = FIX / "records.jsonl"
    recs = R.read(base)
    for r in recs:
        if r.get("metrics"):
            r["metrics"]["tokens_per_s"] *= 0.5
    slow = tmp_path / "slow.jsonl"
    for r in recs:
        R.append(slow, r)
    assert compare.main([str(slow), str(base)]) == 0
    assert "slower than the baseline" in capsys.readouterr().out
    assert compare.main([str(slow), str(base), "--fail-on-speed"]) == 1


def test_compare_missing_job_fails(tmp_path):
    base = FIX / "records.jsonl"
    recs = R.read(base)[:-1]
    part = tmp_path / "part.jsonl"
    for r in recs:
        R.append(part, r)
    assert compare.main([str(part), str(base)]) == 1


def test_nvml_monitor_with_a_fake_driver(monkeypatch):
    fake = types.SimpleNamespace(
        NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetPowerUsage=lambda h: 150_000, nvmlDeviceGetClockInfo=lambda h, c: 1500,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2 << 30),
    )
    counter = iter([1_000_000, 1_250_000, 2_000_000, 2_100_000])
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(counter)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    from specbench.run.monitor import NvmlMonitor
    import time

    mon = NvmlMonitor(index=0, interval_s=0.01)
    with mon:
        time.sleep(0.05)
    r = mon.result
    assert r["energy_j"] == pytest.approx(250.0) and r["power_w_mean"] == 150.0
    assert r["mem_used_max_bytes"] == 2 << 30 and r["sm_clock_mhz_mean"] == 1500 and r["samples"] >= 1
    n = r["samples"]
    with mon:  # a second block (a paired job's next unit): energy between the blocks is not its own
        time.sleep(0.05)
    assert mon.result["energy_j"] == pytest.approx(350.0) and mon.result["samples"] > n


def test_nvml_monitor_without_gpu_is_silent():
    import torch

    from specbench.run.monitor import NvmlMonitor

    with NvmlMonitor(torch.device("cpu")) as mon:
        pass
    assert mon.result is None and mon.energy_j is None


def test_wandb_logger_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from omegaconf import OmegaConf

    from specbench import loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rec = next(r for r in R.read(FIX / "records.jsonl") if r["method"] == "leviathan")
    cfg = OmegaConf.create({"logger": {"name": "wandb", "project": "specbench-test", "entity": None},
                            "results_dir": str(tmp_path)})
    loggers.log_record(cfg, rec)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "no offline run written"
    tables = list(runs[0].rglob("accept_rate_per_pos_*.table.json"))
    assert tables, "the per-position acceptance table was not logged"
    data = json.loads(tables[0].read_text())["data"]
    assert [row[1] for row in data] == pytest.approx(rec["metrics"]["accept_rate_per_pos"])


def test_nvml_handle_follows_the_torch_device_by_uuid(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=2,3 torch's cuda:1 is NVML's GPU 3: the handle is found by
    UUID, never by torch's index."""
    import torch

    fake = types.SimpleNamespace(nvmlInit=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: f"index-{i}",
                                 nvmlDeviceGetHandleByUUID=lambda u: {"GPU-aaaa": "gpu3"}[u])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(uuid="aaaa" if torch.device(d).index == 1 else "bbbb"))
    from specbench.run.monitor import NvmlMonitor

    assert NvmlMonitor(torch.device("cuda:1")).h == "gpu3"
    assert NvmlMonitor(torch.device("cuda:0")).h is None  # unknown UUID: no reading rather than a wrong one


def test_bootstrap_interval_resamples_batches_paired_with_ar():
    from specbench.analysis.theory import batch_units, bootstrap_speedup

    # bs=2: rows of a batch share its clock; a batch's time is its slowest row's
    ar = [{"id": f"q{i}", "turn": 1, "batch": i // 2, "new_tokens": 10, "wall_s": 1.0 + 0.1 * (i % 2)}
          for i in range(8)]
    assert batch_units(ar, 2)[(0, 0)] == (20, 1.1)
    same = [dict(r, wall_s=r["wall_s"] / 2) for r in ar]  # exactly 2x faster on every batch
    lo, hi = bootstrap_speedup(same, ar, 2)
    assert abs(lo - 2.0) < 1e-9 and abs(hi - 2.0) < 1e-9
    noisy = [dict(r, wall_s=r["wall_s"] / (1.5 if r["batch"] % 2 else 2.5)) for r in ar]
    lo, hi = bootstrap_speedup(noisy, ar, 2)
    point = sum(r["new_tokens"] for r in noisy) / sum(batch_units(noisy, 2)[(0, b)][1] for b in range(4)) / (80 / 4.4)
    assert lo < point < hi and 1.5 <= lo and hi <= 2.5
    # records without a batch index: runs of bs distinct ids
    legacy = [{k: v for k, v in r.items() if k != "batch"} for r in ar]
    assert batch_units(legacy, 2) == batch_units(ar, 2)
    assert bootstrap_speedup(same[:2], ar[:2], 2) is None  # one batch: no interval


def identity_records(batch_sizes) -> list[dict]:
    """The fixture's AR and PLD (K=4) records at these batch sizes, every request given the same
    made-up prompt and 10 output tokens in all of them (identical outputs throughout)."""
    recs = [r for r in R.read(FIX / "records.jsonl") if r["method"] in ("ar", "pld") and r["bs"] in batch_sizes
            and r["K"] in (None, 4)]
    keys = sorted({(rq["id"], rq["turn"]) for rq in recs[0]["requests"]})
    for r in recs:
        for rq in r["requests"]:
            i = keys.index((rq["id"], rq["turn"]))
            rq["prompt_sha"] = f"p{i}"
            rq["tokens"] = list(range(i, i + 10))
    return recs


def test_identity_table_reads_first_divergence_from_tokens(tmp_path):
    """AR at bs=1 is the reference; AR at bs=2 is a floor row; a method that changes token 5
    of one request reads one diverged output at position 5."""
    recs = identity_records((1, 2))
    pld1 = next(r for r in recs if r["method"] == "pld" and r["bs"] == 1)
    pld1["requests"][3]["tokens"][5] = 999
    pld1["requests"][4]["prompt_sha"] = "another prompt"  # not compared
    for r in recs:
        R.append(tmp_path / "records.jsonl", r)
    t = tables.identity_table(load(tmp_path / "records.jsonl"))
    row = t[(t["method"] == "pld") & (t["bs"] == 1)].iloc[0]
    assert (row["compared"], row["diverged"], row["median first divergence"], row["earliest"]) == (11, 1, 5.0, 5)
    assert row["identical %"] == pytest.approx(100 * 10 / 11)
    floor = t[t["method"] == "ar (floor)"].iloc[0]
    assert floor["bs"] == 2 and floor["identical %"] == 100.0 and floor["diverged"] == 0
    assert set(t["vs AR bs"]) == {1}


def test_profile_roofline_and_spread(capsys):
    from specbench.analysis.profile import forward_bytes, forward_flops, print_curves, profile
    from helpers import CPU, tiny_llama

    m = tiny_llama()
    w = sum(p.numel() for p in m.parameters()) * 4
    # 2 layers x (K and V) x 2 KV heads x head_dim 16 x 10 positions x 3 rows x 4 bytes
    assert forward_bytes(m, 3, 10, torch.float32) == w + 2 * 2 * 2 * 16 * 10 * 3 * 4
    # linears per layer: q, o 64x64; k, v 64x32; gate, up, down 64x128; output layer 96x64. Per new
    # token: 2 FLOPs a weight, and 2 products x 2 FLOPs x 2 layers x 4 heads x 16 x (8 + 2) keys
    lin = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 96 * 64
    assert forward_flops(m, 3, 2, 8) == 3 * 2 * (2 * lin + 2 * 2 * 2 * 4 * 16 * 10)
    c = profile(m, None, [1, 2], [1, 3], 8, CPU, torch.float32, reps=1, repeats=3)
    for b in ("1", "2"):
        for n in ("1", "3"):
            lo, hi = c["target_spread"][b][n]
            assert lo <= c["target"][b][n] <= hi
            assert c["roofline"][b][n] == pytest.approx(forward_bytes(m, int(b), 8 + int(n), torch.float32)
                                                       / (c["bandwidth_gbs"] * 1e9))
            assert c["compute_floor"][b][n] == pytest.approx(forward_flops(m, int(b), int(n), 8)
                                                             / (c["compute_gflops"] * 1e9))
            med, rlo, rhi = c["ratio_in_repeat"][b][n]
            assert rlo <= med <= rhi and (n != "1" or rlo == rhi == 1.0)
    assert c["bandwidth_gbs"] > 0.1 and c["repeats"] == 3
    print_curves(c, [1, 2], [1, 3])
    out = capsys.readouterr().out
    assert "x roofline" in out and "read bandwidth" in out and "x floors" in out
    lo, hi = c["compute_spread_gflops"]
    assert 0 < lo <= c["compute_gflops"] <= hi


def test_per_category_keeps_each_data_set_apart():
    """Over several data sets, each job's categories and overall stay on rows of their own (the
    training-free baseline: MT-Bench, HumanEval and GSM8K in one file)."""
    from specbench.analysis.load import load
    from specbench.analysis import report

    path = Path(__file__).resolve().parent.parent / "results/baselines/bench-training-free-cpu-2026-11-26.jsonl.gz"
    df = load(path)
    cat = tables.per_category(df)
    for ds in ("mt_bench", "humaneval", "gsm8k"):
        raw = df[(df["method"] == "pld") & (df["dataset"] == ds)].iloc[0]
        assert cat[("tau", "overall")].loc[(f"pld ({ds})", 0.0, 4, 1)] == pytest.approx(raw["tau"])


def test_an_interval_that_misses_its_point_still_plots(tmp_path):
    """A percentile interval of a ratio of ratios (two batches resampled) can lie wholly above or
    below its point estimate: the error bar then starts at the point instead of failing."""
    from specbench.analysis.load import load
    from specbench.analysis import report

    df = load(FIX / "records.jsonl")
    sd = df["method"] != "ar"
    df.loc[sd, "speedup_lo"] = df.loc[sd, "speedup"] + 0.05
    df.loc[sd, "speedup_hi"] = df.loc[sd, "speedup"] + 0.10
    written = []
    figures.fig_speedup_vs(df, tmp_path, written, "bs", "batch size (log2)", "speedup_vs_batch", log2=True)
    assert any(p.name == "speedup_vs_batch.png" for p in written)


def test_bootstrap_interval_does_not_narrow_with_repeats_of_the_same_prompts():
    """Repeats re-time the same prompts: a batch's repeats are resampled together, so 16 repeats of
    4 batches give the interval of 4 batches, not of 64 independent ones."""
    from specbench.analysis.theory import bootstrap_speedup

    ar = [{"id": f"q{i}", "turn": 1, "batch": i // 2, "new_tokens": 10, "wall_s": 1.0} for i in range(8)]
    noisy = [dict(r, wall_s=r["wall_s"] / (1.2 if r["batch"] % 2 else 2.0) / (1 + 0.1 * r["batch"])) for r in ar]
    lo1, hi1 = bootstrap_speedup(noisy, ar, 2)

    def repeated(rs, n):
        return [dict(r, repeat=k) for k in range(n) for r in rs]

    lo16, hi16 = bootstrap_speedup(repeated(noisy, 16), repeated(ar, 16), 2)
    assert lo16 <= lo1 + 1e-9 and hi16 >= hi1 - 1e-9, ((lo1, hi1), (lo16, hi16))
    one = [r for r in noisy if r["batch"] == 0]
    assert bootstrap_speedup(repeated(one, 16), repeated([r for r in ar if r["batch"] == 0], 16), 2) is None


def test_a_speedup_above_its_bound_is_flagged_in_words(tmp_path):
    """Speedup 1.9 with tau 1.4: not a result (each step emits tau tokens and costs at least a
    forward), flagged in the sweep's summary and in the report's table."""
    from specbench.run import records as R
    from specbench.run.summary import summary_table

    base = {"status": "ok", "model": "m", "dataset": "mt_bench", "bs": 1, "K": 4, "temperature": 0.0,
            "sweep_id": "s", "requests": []}
    bad = dict(base, method="pld", job_id="p", metrics={"speedup": 1.9, "tau": 1.4, "tokens_per_s": 19.0})
    fine = dict(base, method="lookahead", job_id="l", metrics={"speedup": 1.3, "tau": 1.4, "tokens_per_s": 13.0})
    ar = dict(base, method="ar", job_id="a", K=None, metrics={"speedup": 1.0, "tau": 1.0, "tokens_per_s": 10.0})
    assert "rerun paired" in R.above_bound(bad) and R.above_bound(fine) is None and R.above_bound(ar) is None
    assert "the AR run beside it was slowed" in R.above_bound(dict(bad, paired_with="a"))
    table = summary_table([ar, bad, fine])
    assert "1.90x unpaired !" in table and "pld bs=1 K=4: speedup 1.90x is above its bound tau=1.40" in table
    assert "lookahead bs=1 K=4:" not in table
    p = tmp_path / "records.jsonl"
    for r in (ar, bad, fine):
        R.append(p, r)
    from specbench.analysis.load import load
    from specbench.analysis.tables import paper_sweep, sweep_table

    df = load(p)
    assert df.set_index("method").loc["pld", "above_bound"].startswith("speedup 1.90x")
    df["bound_batch"] = float("nan")
    t, _ = paper_sweep(sweep_table(df))
    assert "AR slowed?" in t[t["method"] == "pld"]["speedup (95% CI)"].iloc[0]
    assert "AR slowed?" not in t[t["method"] == "lookahead"]["speedup (95% CI)"].iloc[0]


def test_the_summary_and_the_report_say_which_ar_each_speedup_stands_on(tmp_path):
    """A default sweep of three methods writes three AR records: the AR job, and each paired job's
    own AR, labelled by its method in the summary. A speedup taken from an AR run apart from it
    (ar_baseline=sweep or any) is marked unpaired in the summary, the records (``ar_paired``;
    records written before the field say it through ``paired_with``) and the report's tables."""
    from specbench.analysis.tables import paper_sweep, sweep_table
    from specbench.run.summary import summary_table

    base = {"status": "ok", "model": "m", "dataset": "mt_bench", "bs": 1, "K": 4, "temperature": 0.0,
            "sweep_id": "s", "requests": []}
    ar = dict(base, method="ar", job_id="a0", K=None, metrics={"speedup": 1.0, "tau": 1.0, "tokens_per_s": 10.0})
    sd = {"speedup": 1.3, "tau": 1.5, "tokens_per_s": 13.0}
    pld = dict(base, method="pld", job_id="p", ar_job_id="a1", paired_with="a1", ar_paired=True, metrics=sd)
    look = dict(base, method="lookahead", job_id="l", ar_job_id="a2", paired_with="a2", ar_paired=True, metrics=sd)
    recs = [ar, dict(ar, job_id="a1", paired_with="p"), pld, dict(ar, job_id="a2", paired_with="l"), look]
    rows = summary_table(recs).splitlines()[2:]
    assert [r.split("  ")[0] for r in rows] == ["ar", "ar (for pld)", "pld", "ar (for lookahead)", "lookahead"]
    assert "unpaired" not in summary_table(recs)
    apart = dict(base, method="suffix", job_id="x", ar_job_id="a0", ar_paired=False, metrics=sd)
    table = summary_table([ar, apart])
    assert "1.30x unpaired" in table.splitlines()[3] and "unpaired: " in table  # and a line saying what it means
    # records written before ar_paired: a paired job's record has paired_with, another's has not
    old_paired = {k: v for k, v in pld.items() if k != "ar_paired"}
    old_apart = {k: v for k, v in apart.items() if k != "ar_paired"}
    assert R.ar_paired(old_paired) is True and R.ar_paired(old_apart) is False and R.ar_paired(ar) is None
    assert "1.30x unpaired" in summary_table([ar, old_apart])
    p = tmp_path / "records.jsonl"
    for r in (*recs[:2], old_paired, old_apart):
        R.append(p, r)
    df = load(p)
    assert df.set_index("method")["ar_paired"].to_dict() == {"ar": None, "pld": True, "suffix": False}
    df["bound_batch"] = float("nan")
    full = sweep_table(df)
    assert full.set_index("method")["AR"].to_dict() == {"ar": "-", "pld": "paired", "suffix": "unpaired"}
    t, _ = paper_sweep(full)
    assert t[t["method"] == "suffix"]["speedup (95% CI)"].iloc[0] == "1.30x (unpaired)"
    assert t[t["method"] == "pld"]["speedup (95% CI)"].iloc[0] == "1.30x"
    rq = [{"id": "q", "turn": 1, "category": "writing", "batch": 0, "new_tokens": 10, "wall_s": 1.0, "steps": 10,
           "accepted": 0}]
    p2 = tmp_path / "cat.jsonl"
    for r in (dict(ar, requests=rq), dict(old_paired, ar_job_id="a0", requests=rq), dict(old_apart, requests=rq)):
        R.append(p2, r)
    assert set(tables.per_category(load(p2)).index.get_level_values("method")) == {"pld", "suffix (unpaired)"}


def test_the_summary_names_the_settings_a_sweep_varied_that_no_column_shows():
    """compile=false,graphs or pld.max_ngram=2,4 made rows that read alike: the name says the mode
    ([graphs], [compiled]) and a settings column what else varied (a method's keys and draft compared
    between its own records), absent when nothing did."""
    from specbench.run.summary import summary_table

    base = {"status": "ok", "model": "m", "dataset": "mt_bench", "bs": 1, "K": 4, "temperature": 0.0,
            "sweep_id": "s", "requests": [], "metrics": {"speedup": 1.2, "tau": 1.5, "tokens_per_s": 12.0}}
    eager = dict(base, method="pld", job_id="a", method_opts={"name": "pld", "max_ngram": 2}, draft=None)
    recs = [eager, dict(eager, job_id="b", compile="graphs"),
            dict(eager, job_id="c", method_opts={"name": "pld", "max_ngram": 4}),
            dict(base, method="eagle", job_id="d", draft="checkpoints/x")]
    table = summary_table(recs).splitlines()
    assert "settings" in table[0]
    assert [r.split("  ")[0] for r in table[2:6]] == ["pld", "pld [graphs]", "pld", "eagle"]  # the mode, sweep or not
    assert ["pld.max_ngram=2" in table[2], "pld.max_ngram=2" in table[3], "pld.max_ngram=4" in table[4]] == [True] * 3
    assert "draft=" not in "\n".join(table)  # eagle's draft is its own, not swept
    assert "settings" not in summary_table([eager, dict(eager, job_id="e", bs=4)])


def test_identity_table_takes_its_reference_ar_from_the_same_engine_kernel_and_compile(tmp_path):
    """A vLLM AR at bs 1 (other tokens) beside ours changes none of our rows: each engine's rows are
    held to its own AR."""
    recs = identity_records((1,))
    p = tmp_path / "records.jsonl"
    for r in recs:
        R.append(p, r)
    ours = tables.identity_table(load(p))
    vllm = json.loads(json.dumps(next(r for r in recs if r["method"] == "ar")))
    vllm.update(job_id="vllm-ar", backend="vllm", backend_version="0.32.0", kernel=None)
    for rq in vllm["requests"]:
        rq["tokens"] = [t + 1000 for t in rq["tokens"]]
    p2 = tmp_path / "both.jsonl"
    for r in [vllm, *recs]:  # vLLM's AR first: the earliest AR at the smallest batch size
        R.append(p2, r)
    both = tables.identity_table(load(p2))
    assert both.equals(ours) and (ours["identical %"] == 100.0).all()


def test_a_report_of_twelve_methods_shows_all_twelve_in_every_per_method_figure(tmp_path, monkeypatch):
    """No figure drops a job (the bounds figure takes more panels) and no two series look alike (the
    palette's colours repeat with another marker, or hatch for bars)."""
    import matplotlib.colors as mcolors

    recs = R.read(FIX / "records.jsonl")
    ar = next(r for r in recs if r["method"] == "ar" and r["bs"] == 1)
    pld = next(r for r in recs if r["method"] == "pld" and r["bs"] == 1 and r["K"] == 4)
    p = tmp_path / "records.jsonl"
    R.append(p, ar)
    names = [f"method{i:02d}" for i in range(12)]
    for i, name in enumerate(names):
        R.append(p, dict(json.loads(json.dumps(pld)), method=name, job_id=f"j{i}"))
    figs = {}
    monkeypatch.setattr(figures, "save", lambda fig, out, name, written: figs.setdefault(name, fig))
    report.build(p, tmp_path / "rep")
    ticks = [t.get_text() for ax in figs["speedup_vs_bound"].axes for t in ax.get_xticklabels()]
    assert sorted(n for n in names if any(t.startswith(n) for t in ticks)) == names
    lines = [ln for ln in figs["acceptance_per_position"].axes[0].get_lines() if ln.get_label().startswith("method")]
    assert len(lines) == 12
    assert len({(mcolors.to_hex(ln.get_color()), ln.get_marker()) for ln in lines}) == 12
    rows = [t.get_text() for t in figs["accept_length_hist"].axes[0].get_yticklabels()]  # many series: a bar each
    assert sorted(n for n in names if any(t.startswith(n) for t in rows)) == names


def test_the_example_ci_workflow_parses_and_runs_what_the_makefile_has():
    """examples/ci: a GitHub Actions job that runs `make regress` and publishes the benchmark JSON
    the Makefile writes, with the tool whose format analysis.compare writes."""
    import re

    import yaml

    from conftest import REPO

    wf = yaml.safe_load((REPO / "examples" / "ci" / "specbench-regress.yml").read_text())
    steps = wf["jobs"]["regress"]["steps"]
    make = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", make, re.M))
    runs = [s["run"] for s in steps if "run" in s]
    for cmd in runs:
        for target in re.findall(r"make ([a-z][a-z0-9-]*)", cmd):
            assert target in targets, target
    assert "make regress" in runs
    pub = next(s for s in steps if "github-action-benchmark" in s.get("uses", ""))
    assert pub["with"]["tool"] == "customBiggerIsBetter"
    assert f"--bench-json {pub['with']['output-file-path'].replace('results/regress', '$(REGRESS_DIR)')}" in make


def test_a_bound_reads_the_curve_profiled_in_the_shape_its_job_verifies():
    """A chain job at bs 1 reads the dense curve; a tree job at bs 4 the ragged, tree-masked one
    (analysis.profile --ragged --tree); with only dense curves, those."""
    dense, shaped = {"name": "dense"}, {"name": "shaped", "ragged": True, "tree": True}
    chain1 = {"bs": 1, "K": 4, "forward_nodes": 4.0}
    tree4 = {"bs": 4, "K": 3, "forward_nodes": 7.0}
    assert bounds.same_shape([dense, shaped], chain1) == [dense]
    assert bounds.same_shape([dense, shaped], tree4) == [shaped]
    assert bounds.same_shape([dense], tree4) == [dense]


def test_a_bound_prices_the_verify_width_run_and_older_records_keep_what_they_counted(tmp_path, monkeypatch):
    """The batch-aware bound prices a verify at the width its forwards ran (``forward_nodes`` + 1: a
    ragged batch pays for its padding), not at the rows' own drafts (``valid_nodes``). A record
    written before the width was kept counted each row's own nodes under ``forward_nodes``: it loads
    with that count as ``valid_nodes`` and no width, still pairs with its AR record, and its bound is
    priced at the count it has."""
    recs = R.read(FIX / "records.jsonl")
    ar = next(r for r in recs if r["method"] == "ar" and r["bs"] == 4)
    pld = next(r for r in recs if r["method"] == "pld" and r["bs"] == 4 and r["K"] == 4)
    p = tmp_path / "records.jsonl"
    R.append(p, ar)
    for job, nodes in (("new", {"forward_nodes": 4.0, "valid_nodes": 1.5}), ("old", {"forward_nodes": 1.5})):
        rec = json.loads(json.dumps(pld))
        rec["job_id"] = job
        rec["metrics"].update(nodes)
        R.append(p, rec)
    df = load(p)
    new, old = (df[df["job_id"] == j].iloc[0] for j in ("new", "old"))
    assert (new["forward_nodes"], new["valid_nodes"]) == (4.0, 1.5)
    assert old["forward_nodes"] != old["forward_nodes"] and old["valid_nodes"] == 1.5  # no width: NaN
    widths = []
    monkeypatch.setattr(bounds, "interp", lambda T, b, n: widths.append((b, n)) or interp(T, b, n))
    curves = [json.loads(x) for x in (FIX / "cost_curves.jsonl").read_text().splitlines() if x.strip()]
    bound = bounds.batch_aware(df, curves)
    assert bound[new.name] == bound[new.name] and bound[old.name] == bound[old.name]  # both paired, both priced
    assert widths == [(4, 1), (4, 5.0), (4, 1), (4, 2.5)]  # T(bs, 1), then each job's verify width
    assert bound[new.name] < bound[old.name]  # the padding the old record could not show is paid for


def test_the_per_category_table_never_mixes_two_jobs_of_a_method(tmp_path):
    """Two PLD jobs that differ in what they ran (input length, new tokens) are two rows of the
    per-category table, each with its own categories; a category one job lacks is empty, not the
    other job's number (the workloads preset's first step and its ctx sweep once shared a row)."""
    base = {"status": "ok", "model": "m", "dataset": "mt_bench", "bs": 1, "K": 4, "temperature": 0.0,
            "sweep_id": "s", "max_new_tokens": 128}

    def rq(cat, wall):
        return {"id": cat, "turn": 1, "category": cat, "batch": 0, "new_tokens": 10, "wall_s": wall, "steps": 5,
                "accepted": 5}

    recs = []
    for i, (ctx, n, cats, wall) in enumerate([(None, 128, ("writing", "coding"), 0.5), (1024, 64, ("writing",), 0.25)]):
        ar = dict(base, method="ar", job_id=f"a{i}", K=None, ctx=ctx, max_new_tokens=n, paired_with=f"p{i}",
                  metrics={"speedup": 1.0, "tau": 1.0, "tokens_per_s": 10.0}, requests=[rq(c, 1.0) for c in cats])
        pld = dict(base, method="pld", job_id=f"p{i}", ar_job_id=f"a{i}", ar_paired=True, ctx=ctx, max_new_tokens=n,
                   metrics={"speedup": 1.0 / wall, "tau": 2.0, "tokens_per_s": 10.0 / wall},
                   requests=[rq(c, wall) for c in cats])
        recs += [ar, pld]
    p = tmp_path / "records.jsonl"
    for r in recs:
        R.append(p, r)
    cat = tables.per_category(load(p))
    assert len(cat) == 2
    first, second = (cat.xs(k, level="method") for k in sorted(cat.index.get_level_values("method")))
    assert first[("speedup", "coding")].iloc[0] == pytest.approx(2.0)
    assert second[("speedup", "writing")].iloc[0] == pytest.approx(4.0)
    assert second[("speedup", "coding")].isna().all()  # not the first job's 2.0


def test_report_keeps_apart_what_the_summary_and_the_series_used_to_merge(tmp_path):
    """A K=auto job priced on a GPU cost model is a series of its own beside a profiled K=auto job
    (the tuned table compares each with the same fixed settings); jobs that differ only in their
    compile mode are two rows of the per-category table; a long error is printed whole under the
    summary table, once."""
    from specbench.analysis.load import untuned
    from specbench.run.summary import summary_table

    base = {"status": "ok", "model": "m", "dataset": "mt_bench", "bs": 1, "K": 2, "temperature": 0.0, "sweep_id": "s",
            "max_new_tokens": 16}
    rq = [{"id": "q", "turn": 1, "category": "writing", "batch": 0, "new_tokens": 10, "wall_s": 1.0, "steps": 5,
           "accepted": 5}]
    ar = dict(base, method="ar", job_id="a", K=None, metrics={"speedup": 1.0, "tau": 1.0, "tokens_per_s": 10.0},
              requests=rq)

    def sd(job, speedup, **kw):
        return dict(base, method="pld", job_id=job, ar_job_id="a", ar_paired=False, requests=rq,
                    metrics={"speedup": speedup, "tau": 2.0, "tokens_per_s": 10.0 * speedup}, **kw)

    recs = [ar, sd("f", 1.2), sd("p", 1.3, K_auto=True, tuned={"chosen": {"K": 2}}),
            sd("h", 1.1, K_auto="specdecode-bench-h100", tuned={"chosen": {"K": 2}})]
    p = tmp_path / "records.jsonl"
    for r in recs:
        R.append(p, r)
    t = tables.tuned_table(load(p)).set_index("method")
    assert {untuned(m) for m in t.index} == {"pld (unpaired)"} and len(t) == 2
    assert t["tuned speedup"].to_dict() == {"pld (K=auto) (unpaired)": 1.3,
                                            "pld (K=auto on specdecode-bench-h100) (unpaired)": 1.1}
    assert set(t["best fixed speedup"]) == {1.2}
    R.append(p, sd("g", 1.4, compile="graphs"))
    cat = tables.per_category(load(p))
    assert {"pld, compile=graphs (unpaired)", "pld, compile=False (unpaired)"} <= set(cat.index.get_level_values("method"))
    err = "bs=3 is larger than the 2 prompts of dataset=mt_bench limit=2: raise limit (null = all) or lower bs"
    table = summary_table([dict(base, method="pld", job_id=f"e{i}", status="error", error=err, metrics=None)
                           for i in range(2)])
    assert table.count(f"  ! {err}") == 1
