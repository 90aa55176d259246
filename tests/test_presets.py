"""Benchmark presets (conf/experiment): every preset and every sweep of its benchmark
composes into jobs that pass the schema; a bench runs its steps, then the report; the Makefile's
help lists its targets."""

import subprocess

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from specbench import methods
from conftest import REPO
from specbench import bench
from specbench.run import schema
from specbench.paths import CONF_DIR


def composed(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_container(compose("config", overrides=overrides), resolve=True)


def sweeps(name):
    """The override lists of the preset's sweep steps (what follows ``experiment=NAME``)."""
    marker = f"experiment={name}"
    return [cmd[cmd.index(marker) + 1:] for cmd in bench.steps(name, []) if marker in cmd]


@pytest.fixture(autouse=True)
def _needs(monkeypatch):
    """What presets ask for in ``needs``: a folder each (composing reads no weights)."""
    monkeypatch.setenv("EAGLE3", "checkpoints/smollm2-135m/eagle")
    monkeypatch.setenv("MTP", "checkpoints/smollm2-135m/mtp")
    monkeypatch.setenv("DFLASH", "checkpoints/smollm2-135m/dflash")
    monkeypatch.setenv("DSPARK", "checkpoints/smollm2-135m/dspark")
    monkeypatch.setenv("PEAGLE", "checkpoints/smollm2-135m/peagle")


@pytest.mark.parametrize("name", bench.names())
def test_every_preset_composes_into_valid_jobs(name):
    n = 0
    for overrides in sweeps(name):
        own = [o for o in overrides if o.startswith("hydra.")]
        for job in bench.jobs(name, overrides):
            cfg = OmegaConf.create(composed([f"experiment={name}", *own, *job]))
            schema.check(cfg)
            assert cfg.method.name in methods.builtin()
            n += 1
    assert n > 0


def test_a_bench_runs_its_steps_then_the_report(monkeypatch):
    monkeypatch.delenv("EAGLE3")
    with pytest.raises(SystemExit, match="set EAGLE3=<an EAGLE-3 drafter folder"):
        bench.steps("eagle3", [])
    cmds = bench.steps("floor", ["limit=2", "results_dir=/tmp/x"])
    assert [c[2] if c[0] != "cat" else "cat" for c in cmds] == ["specbench"] * 3 + ["specbench.analysis.report", "cat"]
    assert all(c[-2:] == ["limit=2", "results_dir=/tmp/x"] for c in cmds[:3])
    assert cmds[3][3:] == ["/tmp/x", "--out", "/tmp/x/report"] and cmds[4] == ["cat", "/tmp/x/report/identity.md"]
    with pytest.raises(SystemExit, match="no preset 'nope'; choices: cpu, draft"):
        bench.steps("nope", [])
    with pytest.raises(SystemExit, match="no preset 'regres'; did you mean regress"):
        bench.steps("regres", [])


def test_plan_takes_its_flag_before_or_after_the_preset(capsys):
    assert bench.main(["--plan", "regress"]) == 0 == bench.main(["regress", "--plan"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0] == out[1] and "[6 jobs:" in out[0]


def test_make_help_lists_the_targets():
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for target in ("run", "test", "bench", "regress", "gpu-check"):
        assert any(line.split()[0] == target for line in out.splitlines() if line.strip())


def test_plan_checks_every_job_of_a_benchmark_and_runs_nothing(capsys):
    """``--plan``: each step with its jobs, each held to the checks a job makes before its weights
    load; the workloads preset: MT-Bench's 8 categories, both turns, then three input lengths."""
    lines = bench.plan("workloads", [])
    assert len(lines) == 3 and lines[2].endswith("--out results/bench-workloads/report")
    assert "[3 jobs: method=pld dataset=mt_bench; method=suffix" in lines[0]
    assert "[9 jobs: " in lines[1] and all(f"ctx={n}" in lines[1] for n in (1024, 2048, 4096))
    cfg = OmegaConf.create(composed(["experiment=workloads", *bench.jobs("workloads", [])[0]]))
    assert (cfg.limit, cfg.dataset.order, cfg.dataset.max_turns, cfg.ar_baseline) == (8, "categories", None, "paired")
    assert bench.main(["workloads", "--plan", "ctx=8192"]) == 2  # beyond SmolLM2's 8192 positions, refused now
    assert "ctx=8192 + max_new_tokens=128" in capsys.readouterr().err
