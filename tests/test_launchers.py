"""The command line and Hydra's launchers end to end (``python -m specbench``, a subprocess each):
a sweep without -m ending with the summary, a sweep killed with SIGKILL then resumed, joblib's two
workers sharing one records file, submitit_local (the slurm launcher's path) running a sweep."""

import subprocess
import sys

import pytest

from specbench.run import records as R

from conftest import REPO


def test_cli_sweep_end_to_end(tiny_dirs, tmp_path):
    """`python -m specbench a=x,y` sweeps without -m and ends with the summary table."""
    out = subprocess.run(
        [sys.executable, "-m", "specbench", "ar_baseline=sweep", "model=hf", f"model.path={tiny_dirs['target']}", "dataset=jsonl",
         f"dataset.path={tiny_dirs['questions']}", "method=pld,leviathan", "bs=1,3", "K=2", "limit=3",
         "max_new_tokens=8", "draft_model=self_layers", "draft_model.layers=1", f"results_dir={tmp_path}", "progress=false"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert sorted((r["method"], r["bs"]) for r in recs) == sorted(
        [("ar", 1), ("pld", 1), ("leviathan", 1), ("ar", 3), ("pld", 3), ("leviathan", 3)])
    assert len({r["sweep_id"] for r in recs}) == 1
    assert "speedup" in out.stdout and "leviathan" in out.stdout and "verify" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "specbench", "method=medusa9"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == ("specbench: error: unknown method 'medusa9'; did you mean medusa? choices: ar, combo, dflash, dspark, eagle, leviathan, lookahead, medusa, "
                                   "mtp, peagle, pld, recycle, reject, rest, sam, specdec, suffix, or module:Class (a proposer from "
                                   "your own package)")


def test_kill_9_mid_sweep_then_resume(tiny_dirs, tmp_path):
    """A sweep killed with SIGKILL keeps every finished record; rerun with resume=true, it
    runs only what is missing, and every job ends with exactly one ok record."""
    import signal
    import time as _time

    args = [sys.executable, "-m", "specbench", "ar_baseline=sweep", "model=hf", f"model.path={tiny_dirs['target']}", "dataset=jsonl",
            f"dataset.path={tiny_dirs['questions']}", "method=pld,leviathan", "K=1,2,3", "limit=4",
            "max_new_tokens=48", "draft_model=self_layers", "draft_model.layers=1", f"results_dir={tmp_path}", "progress=false"]
    path = tmp_path / "records.jsonl"
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = _time.time() + 240
    while _time.time() < deadline and proc.poll() is None and len(R.read(path)) < 3:
        _time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = R.read(path)
    assert 3 <= len(before) < 7, "the sweep was not cut in the middle"
    out = subprocess.run(args + ["resume=true"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(path)
    jobs = [(r["method"], r["K"]) for r in recs]
    want = [("ar", None)] + [(m, k) for m in ("pld", "leviathan") for k in (1, 2, 3)]
    assert sorted(jobs, key=str) == sorted(want, key=str)  # each job once: nothing lost, nothing repeated
    assert all(r["status"] == "ok" and r["metrics"]["match_ar"] == 1.0 for r in recs)
    assert out.stderr.count("already recorded") == len(before) - 1  # the recorded method jobs were skipped


def test_joblib_launcher_two_workers(tiny_dirs, tmp_path):
    """Hydra's joblib launcher, 2 worker processes sharing one records file: every record
    whole, each AR baseline run exactly once and paired with its methods, then resume."""
    args = [sys.executable, "-m", "specbench", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "ar_baseline=sweep", "model=hf",
            f"model.path={tiny_dirs['target']}", "dataset=jsonl", f"dataset.path={tiny_dirs['questions']}",
            "method=pld,leviathan", "bs=1,2", "K=2,3", "limit=3", "max_new_tokens=16", "draft_model=self_layers",
            "draft_model.layers=1", f"results_dir={tmp_path}", "progress=false"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert len(recs) == len((tmp_path / "records.jsonl").read_text().splitlines())  # no line lost or mixed
    assert sorted((r["method"], r["bs"]) for r in recs if r["method"] == "ar") == [("ar", 1), ("ar", 2)]
    ar = {r["bs"]: r for r in recs if r["method"] == "ar"}
    methods_ = [r for r in recs if r["method"] != "ar"]
    assert len(methods_) == 8 and all(r["status"] == "ok" for r in recs)
    for r in methods_:
        assert r["metrics"]["match_ar"] == 1.0
        assert r["metrics"]["speedup"] == pytest.approx(r["metrics"]["tokens_per_s"] / ar[r["bs"]]["metrics"]["tokens_per_s"])
    assert "speedup" in out.stdout  # the summary table of the parent process
    again = subprocess.run(args + ["resume=true"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(R.read(tmp_path / "records.jsonl")) == len(recs)  # nothing measured twice


def test_the_submitit_launcher_runs_a_sweep(tiny_dirs, tmp_path):
    """hydra/launcher=submitit_local: the same pickling, job arrays and result collection as
    submitit_slurm (documented for clusters), on this machine: every job recorded once, paired."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    args = [sys.executable, "-m", "specbench", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
            "hydra.launcher.tasks_per_node=1", "hydra.launcher.cpus_per_task=1", "model=hf",
            f"model.path={tiny_dirs['target']}", "dataset=jsonl", f"dataset.path={tiny_dirs['questions']}",
            "method=pld,lookahead", "limit=2", "max_new_tokens=8", "warmup=false", f"results_dir={tmp_path}",
            "progress=false"]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    recs = R.read(tmp_path / "records.jsonl")
    assert sorted(r["method"] for r in recs) == ["ar", "ar", "lookahead", "pld"]
    assert all(r["status"] == "ok" and r["metrics"]["match_ar"] == 1.0 for r in recs)
    assert all(r.get("paired_with") for r in recs)
