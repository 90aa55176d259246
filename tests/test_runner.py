"""The runner's jobs on tiny HF folders (``specbench.run.runner``): a refused job written as one
error record and the sweep going on, the AR baseline found, reused, run once or paired, the record
a job writes (its keys, K, kernel, compile, repeats, serving, chunked prefill, peak memory), a
failure recorded or the sweep stopped, and resume."""

import dataclasses
import json

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from specbench import methods, models, paths
from specbench.errors import ConfigError
from specbench.run import measure, records as R, runner

from conftest import REPO
from helpers import composed, register_fakes, tiny_cfg


def test_a_refused_job_writes_one_error_record_and_the_sweep_goes_on(tiny_dirs, tmp_path):
    """Settings that fail validation, even ones that cannot be converted or are missing, give one
    error record each (no second exception while writing it) and the next job runs."""
    for over, msg in (({"dataset.path": "???"}, "dataset=jsonl needs dataset.path"),
                      ({"model.path": "???"}, "model=hf needs model.path"),
                      ({"K": True}, "K must be an integer >= 1, got True"),
                      ({"K": "many"}, "K must be an integer >= 1, got 'many'"),
                      ({"dataset.max_turns": -1}, "dataset.max_turns must be")):
        recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}},
                                   **over), sweep_id="bad")
        assert len(recs) == 1 and recs[0]["status"] == "error" and recs[0]["error"].startswith(msg), recs[0]["error"]
    ok = runner.run(tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}),
                    sweep_id="bad")
    assert [r["status"] for r in ok] == ["ok", "ok"]
    assert [r["status"] for r in R.read(tmp_path / "records.jsonl")] == ["error"] * 5 + ["ok", "ok"]


def test_a_prompt_too_long_is_refused_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch):
    qs = tmp_path / "long.jsonl"
    qs.write_text(json.dumps({"question_id": 1, "turns": ["w1 w2"]}) + "\n" +
                  json.dumps({"question_id": 2, "turns": [" ".join(f"w{i % 90}" for i in range(600))]}) + "\n")
    monkeypatch.setattr(runner, "cached_model", lambda *a, **k: pytest.fail("the model was loaded"))
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"dataset.path": str(qs), "method": {"name": "pld", "max_ngram": 3,
                                                                                 "min_ngram": 1}})
    rec, = runner.run(cfg, sweep_id="long")
    assert rec["status"] == "error" and rec["error"].startswith("question 2: a prompt of ")
    assert "exceeds the 512 positions of the job's models" in rec["error"]


def test_a_refusal_on_a_cold_cache_converts_no_model_and_builds_no_kernel(tmp_path, monkeypatch):
    """On an empty cache a refused job must answer at once: no GGUF conversion (~30 s) to read
    the target's config, no native kernel build (~40 s) to label the error record."""
    from specbench.kernels import extension

    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted the GGUF to refuse a job"))
    monkeypatch.setattr(extension, "unavailable", lambda: pytest.fail("built the kernel to refuse a job"))
    for over, msg in ((["method=eagle", "method.depth=0"], "eagle.depth must be 'auto' or an integer >= 1"),
                      (["method=pld", "K=true"], "K must be an integer >= 1, got True"),
                      (["method=pld", "ctx=8190"], "ctx=8190 + max_new_tokens=64 + 4 draft positions exceeds the 8192")):
        cfg = composed([*over, f"results_dir={tmp_path}"])
        rec, = runner.run(cfg, sweep_id="cold")
        assert rec["status"] == "error" and rec["error"].startswith(msg), rec["error"]
        assert rec["kernel"] == "auto"  # the setting as given
    assert not (paths.cache_dir() / "models").exists()


REQUIRED = ["schema", "sweep_id", "status", "error", "method", "model", "draft", "K", "bs", "ctx", "dataset",
            "limit", "temperature", "max_new_tokens", "dtype", "device", "seed", "env", "metrics", "requests"]


METRICS = ["new_tokens", "wall_s", "tokens_per_s", "steps", "tau", "draft_nodes", "forward_nodes", "valid_nodes", "quality",
           "accept_rate_per_pos", "accept_len_hist",
           "time_s", "verify_share", "ttft_s", "tpot_s", "peak_mem_bytes", "energy_j", "speedup", "match_ar"]


def test_repeats_time_the_prompt_set_n_times_and_pair_with_a_repeated_ar(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, bs=2, repeats=3, **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}})
    recs = runner.run(cfg, sweep_id="s1")
    assert [r["method"] for r in recs] == ["ar", "pld"] and all(r["repeats"] == 3 for r in recs)
    m = recs[1]["metrics"]
    assert len(m["repeat_tokens_per_s"]) == 3 and len(recs[1]["requests"]) == 3 * 8
    assert sorted({rq["repeat"] for rq in recs[1]["requests"]}) == [0, 1, 2]
    assert m["new_tokens"] == 3 * sum(rq["new_tokens"] for rq in recs[1]["requests"] if rq["repeat"] == 0)
    # a job without repeats does not pair with the repeated AR job: it runs its own
    single = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **{"method": {"name": "leviathan"}}), sweep_id="s1")
    assert [r["method"] for r in single] == ["ar", "leviathan"] and "repeats" not in single[0]
    with pytest.raises(ConfigError, match="repeats must be an integer >= 1"):
        runner.validate(tiny_cfg(tiny_dirs, tmp_path, repeats=0))


def test_job_records_and_reuses_ar(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, bs=2, **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}})
    recs = runner.run(cfg, sweep_id="s1")
    assert [r["method"] for r in recs] == ["ar", "pld"]  # the AR baseline ran first
    cfg2 = tiny_cfg(tiny_dirs, tmp_path, bs=2, **{"method": {"name": "leviathan"}})
    recs2 = runner.run(cfg2, sweep_id="s1")
    assert [r["method"] for r in recs2] == ["leviathan"]  # reused the sweep's AR job
    lines = R.read(tmp_path / "records.jsonl")
    assert len(lines) == 3
    for rec in lines:
        assert rec["status"] == "ok"
        for k in REQUIRED:
            assert k in rec, k
        for k in METRICS:
            assert k in rec["metrics"], k
        m = rec["metrics"]
        assert m["match_ar"] == 1.0  # greedy fp32: token-identical to AR
        assert set(m["time_s"]) >= {"prefill", "draft", "verify", "accept", "other"}
        assert len(rec["requests"]) == 8  # 4 questions x 2 turns
        assert sum(m["accept_len_hist"]) == m["steps"]
        assert rec["env"]["torch"] == torch.__version__
    lev = lines[2]["metrics"]
    assert lev["divergence"] == {"compared": 8, "diverged": 0, "median_at": None, "first_at": None, "positions": []}
    assert all(rq["diverge_at"] is None and rq["tokens"] for rq in lines[2]["requests"])
    assert len(lev["accept_rate_per_pos"]) == 4
    assert lev["speedup"] == pytest.approx(lev["tokens_per_s"] / lines[0]["metrics"]["tokens_per_s"])
    # a second sweep runs its own AR job; ar_baseline=any reuses the first
    assert [r["method"] for r in runner.run(cfg2, sweep_id="s2")] == ["ar", "leviathan"]
    cfg3 = tiny_cfg(tiny_dirs, tmp_path, bs=2, ar_baseline="any", **{"method": {"name": "pld"}})
    assert [r["method"] for r in runner.run(cfg3, sweep_id="s3")] == ["pld"]


def test_kernel_is_recorded_and_pairs_ar_on_the_same_path(tiny_dirs, tmp_path):
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, kernel="onednn", **pld), sweep_id="k")
    assert [(r["method"], r["kernel"]) for r in recs] == [("ar", "onednn"), ("pld", "onednn")]
    assert recs[1]["metrics"]["match_ar"] == 1.0
    # the torch path is another baseline: a torch job runs its own AR
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, kernel="torch", **pld), sweep_id="k")
    assert [(r["method"], r["kernel"]) for r in recs] == [("ar", "torch"), ("pld", "torch")]


def test_compile_changes_no_token_pairs_with_a_compiled_ar_and_counts_graphs_in_the_timing(tiny_dirs, tmp_path,
                                                                                             capsys):
    """compile=true: the target's forward through torch.compile (dynamic shapes); greedy output
    identical to the eager job's; the records say compile and pair only with a compiled AR; the
    graphs compiled inside the timing are counted and warned about (here all of them: no
    warm-up); the shape warm-up a warmed job runs first compiles what it needs once."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    eager = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, limit=2, kernel="torch", **pld), sweep_id="c")
    comp = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, limit=2, kernel="torch", compile=True, warmup=False, **pld),
                      sweep_id="c")
    # the eager AR of the same sweep is no baseline for a compiled job: it runs its own
    assert [(r["method"], r.get("compile")) for r in comp] == [("ar", True), ("pld", True)]
    assert "compile" not in eager[0] and "compile" not in eager[1]
    assert comp[1]["ar_job_id"] == comp[0]["job_id"] and comp[1]["metrics"]["match_ar"] == 1.0
    for e, c in zip(eager, comp):
        assert [r["tokens"] for r in c["requests"]] == [r["tokens"] for r in e["requests"]]
        assert "compile" not in e["metrics"]
    assert comp[0]["metrics"]["compile"]["graphs_in_timing"] >= 1  # the first compiled forwards were timed
    assert "inside the timing" in capsys.readouterr().err
    model = runner.cached_model(tiny_cfg(tiny_dirs, tmp_path).model, torch.device("cpu"), torch.float32, "torch",
                                True)[0]
    assert models.is_compiled(model)
    measure.warm_compiled(model, 1, torch.device("cpu"), torch.float32)
    before = models.compiled_graphs()
    measure.warm_compiled(model, 1, torch.device("cpu"), torch.float32)
    assert models.compiled_graphs() == before


def test_paired_baseline_takes_turns_and_changes_no_token(tiny_dirs, tmp_path, monkeypatch):
    """ar_baseline=paired: each method job runs its own AR, the two taking turns batch by batch
    (ABBA), with the same tokens (greedy and sampled) as when each runs alone; the method's
    speedup and the analysis pair it with that exact AR record."""
    from specbench.analysis.load import ar_baselines, load

    order = []
    real = runner.MethodRun.run_unit

    def spy(self, unit, progress=None):
        order.append((self.name, unit[1]))
        return real(self, unit, progress)

    monkeypatch.setattr(runner.MethodRun, "run_unit", spy)
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    for T in (0.0, 1.0):
        alone = runner.run(tiny_cfg(tiny_dirs, tmp_path / f"alone{T}", bs=2, **{"sampling.temperature": T}, **pld),
                           sweep_id="a")
        assert [r["temperature"] for r in alone] == [T, T]  # flat in the record, as before sampling.*
        order.clear()
        paired = [runner.run(tiny_cfg(tiny_dirs, tmp_path / f"paired{T}", bs=2, **{"sampling.temperature": T},
                                      ar_baseline="paired", **pld), sweep_id="p") for _ in range(2)]
        assert order[:4] == [("ar", 0), ("pld", 0), ("pld", 2), ("ar", 2)]  # limit=4, bs=2: two batches
        for ar, rec in paired:
            assert [ar["method"], rec["method"]] == ["ar", "pld"]
            assert rec["ar_job_id"] == ar["job_id"] and rec["paired_with"] == ar["job_id"]
            assert ar["paired_with"] == rec["job_id"]
            assert rec["metrics"]["speedup"] == pytest.approx(rec["metrics"]["tokens_per_s"] /
                                                              ar["metrics"]["tokens_per_s"])
            assert rec["metrics"]["batches"] == ar["metrics"]["batches"] == 4  # 2 batches x 2 turns
            for x, y in zip((ar, rec), alone):  # taking turns changes no token, not even sampled ones
                assert [q["tokens"] for q in x["requests"]] == [q["tokens"] for q in y["requests"]]
        if T == 0:
            assert paired[0][1]["metrics"]["match_ar"] == 1.0
        # two AR records with the same settings: each method job is read against its own
        df = load(tmp_path / f"paired{T}" / "records.jsonl")
        of = ar_baselines(df)
        for _, row in df[df["method"] == "pld"].iterrows():
            assert of(row)["job_id"] == row["ar_job_id"]
        assert of(df[df["method"] == "ar"].iloc[0]) is None


def test_each_speedup_says_whether_its_ar_ran_beside_it(tiny_dirs, tmp_path):
    """ar_baseline=paired: the speedup stands on the AR run beside it (``ar_paired`` true); sweep and
    any: on an AR job run apart (false), even one another job ran paired. The summary labels a
    paired AR by its method and marks the speedups that are not paired."""
    from specbench.run.summary import summary_table

    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    ar, rec = runner.run(tiny_cfg(tiny_dirs, tmp_path, ar_baseline="paired", **pld), sweep_id="p")
    assert rec["ar_paired"] is True and "ar_paired" not in ar
    apart = runner.run(tiny_cfg(tiny_dirs, tmp_path, **pld), sweep_id="s")  # the sweep's AR job, then pld
    assert [r["method"] for r in apart] == ["ar", "pld"] and apart[1]["ar_paired"] is False
    lev = runner.run(tiny_cfg(tiny_dirs, tmp_path, ar_baseline="any", **{"method": {"name": "leviathan"}}),
                     sweep_id="a")
    assert [r["method"] for r in lev] == ["leviathan"] and lev[0]["ar_paired"] is False
    assert [r["ar_paired"] for r in R.read(tmp_path / "records.jsonl") if r["method"] != "ar"] == [True, False, False]
    rows = summary_table([ar, rec, *apart, *lev]).splitlines()[2:]
    assert rows[0].startswith("ar (for pld) ") and rows[2].startswith("ar ") and not rows[2].startswith("ar (")
    assert ["unpaired" in r for r in rows[:5]] == [False, False, False, True, True]


def test_ar_pairing_covers_every_prompt_and_model_setting(tiny_dirs, tmp_path):
    """A method job pairs only with an AR job of the same prompts, model settings and (for
    ar_baseline=any) the same machine and code."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    assert [r["method"] for r in runner.run(tiny_cfg(tiny_dirs, tmp_path, **pld), sweep_id="s")] == ["ar", "pld"]
    for over in ({"dataset.max_turns": 1}, {"model.chat": False}, {"model.attn_implementation": "eager"}):
        recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, **pld, **over), sweep_id="s")
        assert [r["method"] for r in recs] == ["ar", "pld"], over  # its own AR, not the first one
        assert recs[1]["metrics"]["match_ar"] == 1.0
        key = next(iter(over))
        section, field = key.split(".")
        assert recs[0][f"{section}_cfg"][field] == over[key]
    # ar_baseline=any: an AR record from another host (or code version) is not reused
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["env"]["host"] = "elsewhere"
    path.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, ar_baseline="any", **pld), sweep_id="s2")
    assert [r["method"] for r in recs] == ["ar", "pld"]


def test_bs_beyond_the_prompts_is_refused(tiny_dirs, tmp_path):
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=8), sweep_id="b")  # limit=4
    assert recs[0]["status"] == "error" and recs[0]["error"].startswith("bs=8 is larger than the 4 prompts")


def test_a_failed_append_prints_the_record_and_fails_the_job(tiny_dirs, tmp_path, monkeypatch, capsys):
    def full(path, rec):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(R, "append", full)
    n = len(runner.FAILED)
    assert runner.run(tiny_cfg(tiny_dirs, tmp_path), sweep_id="a") == []
    err = capsys.readouterr().err
    rec = json.loads(next(line for line in err.splitlines() if line.startswith("{")))
    assert rec["method"] == "ar" and rec["metrics"]["new_tokens"] > 0  # the measurement survives on stderr
    assert "could not append the ar record" in err and len(runner.FAILED) == n + 1


def test_a_device_side_error_stops_the_sweep_after_recording(tiny_dirs, tmp_path, monkeypatch):
    from specbench.methods.base import Proposer

    class Poisoned(Proposer):
        def propose(self, state):
            raise RuntimeError("CUDA error: device-side assert triggered")

    register_fakes(monkeypatch, poisoned=Poisoned)
    with pytest.raises(runner.SweepAborted, match="CUDA context is unusable"):
        runner.run(tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "poisoned"}}), sweep_id="p")
    recs = R.read(tmp_path / "records.jsonl")
    assert [(r["method"], r["status"]) for r in recs] == [("ar", "ok"), ("poisoned", "error")]


def test_forward_time_counted_once_and_hooks_removed_on_error(tiny_dirs, tmp_path, monkeypatch):
    from helpers import tiny_llama
    from specbench.decode.timing import PhaseTimer

    model = tiny_llama(seed=0)
    timer = PhaseTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="boom"):
        with timer.watching([model, model]):  # e.g. a draft that is the target object itself
            assert len(model._forward_hooks) == 1 and len(model._forward_pre_hooks) == 1
            raise RuntimeError("boom")
    assert not model._forward_hooks and not model._forward_pre_hooks
    # and through a real job that fails: the cached target keeps no hook
    from specbench.methods.base import Proposer

    class Exploding(Proposer):
        def propose(self, state):
            raise RuntimeError("kaboom")

    register_fakes(monkeypatch, exploding=Exploding)
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "exploding"}})
    assert runner.run(cfg, sweep_id="h")[-1]["status"] == "error"
    target = runner.cached_model(cfg.model, torch.device("cpu"), torch.float32)[0]
    assert not target._forward_hooks and not target._forward_pre_hooks


def test_failing_jobs_are_recorded_and_the_sweep_goes_on(tiny_dirs, tmp_path, monkeypatch):
    from specbench.methods.base import Proposer

    class Exploding(Proposer):
        name = "exploding"

        def propose(self, state):
            raise RuntimeError("kaboom\nsecond line")

    class OOM(Proposer):
        name = "oom"

        def propose(self, state):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    register_fakes(monkeypatch, exploding=Exploding, oom=OOM)
    for name, status in (("exploding", "error"), ("oom", "oom")):
        cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": name}})
        recs = runner.run(cfg, sweep_id="f")
        assert recs[-1]["status"] == status and recs[-1]["method"] == name
        assert "\n" not in recs[-1]["error"]
    cfg = tiny_cfg(tiny_dirs, tmp_path, K=0, **{"method": {"name": "pld"}})
    assert runner.run(cfg, sweep_id="f")[0]["error"].startswith("K must be")
    real_plugins = methods.plugins
    monkeypatch.setattr(methods, "plugins", lambda: {**real_plugins(), "broken": "specbench.methods.no_such_module:X"})
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "broken"}})
    assert runner.run(cfg, sweep_id="f")[0]["error"].startswith(
        "method 'broken': cannot import specbench.methods.no_such_module:X (ModuleNotFoundError")
    lines = R.read(tmp_path / "records.jsonl")
    assert [r["status"] for r in lines] == ["ok", "error", "oom", "error", "error"]  # ar ok, then the failures


def test_the_recorded_K_is_the_methods_own(tiny_dirs, tmp_path, monkeypatch):
    """A job records the speculation length its method runs, not a K the method ignores: EAGLE's
    tree depth, Lookahead's N - 1, none for REST and AR; the analysis tables keep jobs without one."""
    from specbench.analysis import load, report, tables
    from specbench.methods.ar import AR
    from specbench.methods.eagle import AUTO, Eagle
    from specbench.methods.lookahead import Lookahead
    from specbench.methods.pld import PromptLookup
    from specbench.methods.rest import Rest

    cpu = torch.device("cpu")

    def c(**m):
        return OmegaConf.create({"K": 5, "method": m})

    assert Eagle.spec_len(c(top_k="auto", depth="auto", total_tokens="auto"), cpu) == AUTO["cpu"]["depth"] != 5
    assert Eagle.spec_len(c(top_k=2, depth=3, total_tokens=9), cpu) == 3
    assert Lookahead.spec_len(c(W=2, N=4, G=2), cpu) == 3
    assert Rest.spec_len(c(datastore="x"), cpu) is None and AR.spec_len(c(), cpu) is None
    assert PromptLookup.spec_len(c(), cpu) == 5
    from specbench.methods.medusa import Medusa

    shipped = str(REPO / "checkpoints" / "smollm2-135m" / "medusa")  # 4 heads
    assert Medusa.spec_len(OmegaConf.create({"K": 6, "method": {"checkpoint": shipped}}), cpu) == 4
    assert Medusa.spec_len(OmegaConf.create({"K": 3, "method": {"checkpoint": shipped}}), cpu) == 3

    class Unshaped(PromptLookup):  # drafts like PLD, reports no fixed length (as REST does)
        name = "unshaped"
        Settings = dataclasses.make_dataclass("Settings", [("name", str, "unshaped"), ("max_ngram", int, 3),
                                                           ("min_ngram", int, 1)])  # PLD's keys, declared

        @classmethod
        def spec_len(cls, cfg, device):
            return None

    register_fakes(monkeypatch, unshaped=Unshaped)
    for name in ("pld", "unshaped"):
        cfg = tiny_cfg(tiny_dirs, tmp_path, K=3, **{"method": {"name": name, "max_ngram": 3, "min_ngram": 1}})
        recs = runner.run(cfg, sweep_id="k")
    recs = {r["method"]: r for r in R.read(tmp_path / "records.jsonl")}
    assert (recs["ar"]["K"], recs["pld"]["K"], recs["unshaped"]["K"]) == (None, 3, None)
    assert len(recs["pld"]["metrics"]["accept_rate_per_pos"]) == 3  # positions up to K, as before
    df = load.load(tmp_path / "records.jsonl")
    table = tables.sweep_table(df).set_index("method")
    assert table.loc["pld", "K"] == 3 and table.loc["unshaped", "K"] is pd.NA
    cats = tables.per_category(df).reset_index()
    assert set(cats["method"]) == {"pld (unpaired)", "unshaped (unpaired)"}  # ar_baseline=sweep
    assert cats.loc[cats["method"] == "unshaped (unpaired)", "K"].isna().all()


def test_resume_skips_recorded_jobs(tiny_dirs, tmp_path, capsys):
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    assert [r["method"] for r in runner.run(tiny_cfg(tiny_dirs, tmp_path, **pld), sweep_id="r1")] == ["ar", "pld"]
    # a new sweep with resume=true: the recorded job is skipped and says so
    assert runner.run(tiny_cfg(tiny_dirs, tmp_path, resume=True, **pld), sweep_id="r2") == []
    assert "already recorded (sweep r1); skipped" in capsys.readouterr().err
    # a job not recorded yet runs, paired with the recorded AR job (no second AR)
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, resume=True, K=2, **pld), sweep_id="r2")
    assert [r["method"] for r in recs] == ["pld"] and recs[0]["ar_sweep_id"] == "r1"
    # a method option is part of the job: another max_ngram is another job
    other = {"method": {"name": "pld", "max_ngram": 2, "min_ngram": 1}}
    assert [r["method"] for r in runner.run(tiny_cfg(tiny_dirs, tmp_path, resume=True, **other), "r2")] == ["pld"]
    # without resume, a new sweep measures again
    assert [r["method"] for r in runner.run(tiny_cfg(tiny_dirs, tmp_path, **pld), sweep_id="r3")] == ["ar", "pld"]


def test_the_sampling_and_serving_nodes_are_recorded_flat_as_before(tiny_dirs, tmp_path):
    """sampling.* and serving.* are nodes of the config, but a record keeps the fields it had when they
    were top-level keys (temperature, top_k, top_p; serving), so records written before pair with
    those written after (records.BASELINE_KEYS)."""
    import torch

    from specbench.run import records
    from specbench.run.recordbuild import RecordBuilder

    cfg = tiny_cfg(tiny_dirs, tmp_path, kernel="torch", bs=2, method={"name": "ar"},
                   **{"sampling.temperature": 0.7, "sampling.top_p": 0.9, "serving.batching": "continuous",
                      "serving.rate": 4.0})
    rec = RecordBuilder(cfg, torch.device("cpu"), torch.float32, "s").settings("ar")
    assert (rec["temperature"], rec["top_k"], rec["top_p"]) == (0.7, 0, 0.9) and "sampling" not in rec
    assert rec["serving"] == {"batching": "continuous", "concurrency": 2, "rate": 4.0, "prefill": "separate"}
    assert {"temperature", "top_k", "top_p", "serving"} <= set(records.BASELINE_KEYS)  # still what pairs AR


def test_continuous_batching_records_serving_metrics_and_pairs_its_own_ar(tiny_dirs, tmp_path):
    """serving.batching=continuous: the job serves every turn as a request at concurrency bs (the second
    turn arrives when the first is answered), token-identical to the static job; records the
    serving settings (in the AR pairing key: a continuous job never pairs with a static AR),
    latency percentiles, goodput under the SLO and rows in flight; Poisson arrivals are seeded."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    static = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **pld), sweep_id="s")
    cont = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, serving={"batching": "continuous",
                                                                   "slo": {"ttft_ms": 1e6, "tpot_ms": 1e-6}},
                               **pld), sweep_id="s")
    assert [r["method"] for r in cont] == ["ar", "pld"]  # its own AR: the static one does not pair
    for s_rec, c_rec in zip(static, cont):
        assert "serving" not in s_rec and c_rec["serving"] == {"batching": "continuous", "concurrency": 2,
                                                               "rate": "inf", "prefill": "separate"}
        key = lambda rq: (rq["id"], rq["turn"])  # noqa: E731
        assert {key(rq): rq["tokens"] for rq in c_rec["requests"]} == {key(rq): rq["tokens"] for rq in s_rec["requests"]}
        m = c_rec["metrics"]
        assert m["match_ar"] == 1.0 and len(c_rec["requests"]) == 8
        assert m["latency"]["ttft_s"]["p50"] <= m["latency"]["ttft_s"]["p99"] and m["latency"]["itl_s"]["n"] > 0
        assert m["goodput"]["share"] == 0.0  # no request meets a TPOT under a nanosecond
        # shares of the stream's wall at 1..bs in flight; the rest is time with none (here only the
        # edges of the stream: every request is there from the start)
        assert m["in_flight"]["mean"] <= 2 and 0.95 < sum(m["in_flight"]["time_share"]) <= 1 + 1e-6
        assert all(rq["queue_s"] >= 0 for rq in c_rec["requests"])
        assert s_rec["metrics"]["goodput"] is None and s_rec["metrics"]["latency"]["e2e_s"]["n"] == 8
    second = [rq for rq in cont[1]["requests"] if rq["turn"] == 2]
    first = {rq["id"]: rq for rq in cont[1]["requests"] if rq["turn"] == 1}
    for rq in second:  # a follow-up turn arrives once its first turn is answered
        assert rq["arrival_s"] >= first[rq["id"]]["arrival_s"] + first[rq["id"]]["wall_s"] - 1e-6
    poisson = [runner.run(tiny_cfg(tiny_dirs, tmp_path / f"p{i}", bs=2, serving={"batching": "continuous", "rate": 50.0},
                                   method={"name": "ar"}), sweep_id="p") for i in range(2)]
    arrivals = [sorted(rq["arrival_s"] for rq in run[0]["requests"] if rq["turn"] == 1) for run in poisson]
    assert arrivals[0] == arrivals[1] and arrivals[0][0] == 0 and arrivals[0][-1] > 0  # seeded, spread
    assert poisson[0][0]["serving"]["rate"] == 50.0
    # the report: the serving plot and speedup against concurrency (two concurrencies per line)
    runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=1, **{"serving.batching": "continuous"}, **pld), sweep_id="s")
    runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=1, **pld), sweep_id="s")
    from specbench.analysis import report
    from specbench.analysis.load import load

    df = load(tmp_path / "records.jsonl")
    assert set(df["label"]) >= {"ar", "ar [continuous]"} and df["label"].str.endswith("[continuous]").sum() >= 4
    written = {p.name for p in report.build(tmp_path / "records.jsonl", tmp_path / "report")}
    assert {"throughput_vs_tpot.png", "speedup_vs_concurrency.png"} <= written


def test_chunked_prefill_is_recorded_pairs_its_own_ar_and_keeps_the_tokens(tiny_dirs, tmp_path):
    """serving.prefill_chunk=N: the prompts are prefilled alone in pieces (static and continuous); the
    record says so (in the AR pairing key: it pairs with an AR prefilled the same way), its tokens
    are the padded prefill's, and the report labels it as its own series."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    static = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **pld), sweep_id="s")
    chunked = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **{"serving.prefill_chunk": 3}, **pld), sweep_id="s")
    cont = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, serving={"batching": "continuous", "prefill_chunk": 3}, **pld),
                      sweep_id="s")
    assert [r["method"] for r in chunked] == ["ar", "pld"] and [r["method"] for r in cont] == ["ar", "pld"]
    assert chunked[1]["serving"] == {"batching": "static", "prefill": "chunked", "prefill_chunk": 3}
    assert cont[1]["serving"] == {"batching": "continuous", "concurrency": 2, "rate": "inf", "prefill": "chunked",
                                  "prefill_chunk": 3}
    key = lambda rq: (rq["id"], rq["turn"])  # noqa: E731
    for recs in (chunked, cont):
        for rec, s_rec in zip(recs, static):
            assert {key(rq): rq["tokens"] for rq in rec["requests"]} == \
                {key(rq): rq["tokens"] for rq in s_rec["requests"]}
            assert rec["metrics"]["match_ar"] == 1.0
    from specbench.analysis.load import load

    labels = set(load(tmp_path / "records.jsonl")["label"])
    assert {"pld K=4 [prefill 3]", "pld K=4 [continuous, prefill 3]"} <= labels or \
        {"pld [prefill 3]", "pld [continuous, prefill 3]"} <= labels, labels
    vllm = tiny_cfg(tiny_dirs, tmp_path, backend="vllm", **{"serving.prefill_chunk": 3}, method={"name": "ar"})
    from specbench.engines.vllm import engine as vllm_engine

    from specbench.errors import ConfigError

    with pytest.raises(ConfigError, match="vllm.max_num_batched_tokens"):
        vllm_engine.check(vllm, "ar")


def test_an_ar_jobs_peak_memory_is_its_own_paired_or_alone(tiny_dirs, tmp_path):
    """Peak memory counts the run's own models and caches: AR paired with Leviathan (whose draft
    model is loaded beside it) reads what AR alone reads; the method's own peak adds its draft."""
    over = {"method": {"name": "leviathan"}, "draft_model": {"name": "hf", "path": str(tiny_dirs["draft"]), "layers": None,
                                                       "label": None}, "K": 2}
    ar_paired, lev = runner.run(tiny_cfg(tiny_dirs, tmp_path / "p", ar_baseline="paired", **over), sweep_id="p")
    alone, = runner.run(tiny_cfg(tiny_dirs, tmp_path / "a", **{"method": {"name": "ar"}}), sweep_id="a")
    assert ar_paired["method"] == "ar" and alone["method"] == "ar"
    assert ar_paired["metrics"]["peak_mem_bytes"] == alone["metrics"]["peak_mem_bytes"] > 0
    assert lev["metrics"]["peak_mem_bytes"] > ar_paired["metrics"]["peak_mem_bytes"]  # + the draft model
    assert ar_paired["metrics"]["process_peak_bytes"] >= ar_paired["metrics"]["peak_mem_bytes"] - (1 << 20)
