"""Benchmark presets (conf/experiment): every preset and every sweep of its benchmark
composes into jobs that pass the schema; a preset runs the jobs its old Makefile target ran; the
Makefile's help lists its targets."""

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
    """The override lists of the preset's sweep steps (what follows ``+experiment=NAME``)."""
    marker = f"+experiment={name}"
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
            cfg = OmegaConf.create(composed([f"+experiment={name}", *own, *job]))
            schema.check(cfg)
            assert cfg.method.name in methods.builtin()
            n += 1
    assert n > 0


# The old Makefile targets' commands (before the presets): a preset runs the same jobs.
OLD = {
    "regress": ["method=ar,pld,leviathan bs=1,3 K=3 limit=3 max_new_tokens=32 dataset=mt_bench dataset.order=file "
                "draft_model=smollm2-135m-draft dtype=fp32 kernel=torch device=cpu ar_baseline=sweep progress=false "
                "results_dir=results/regress"],
    "search": ["method=lookahead,rest,specdec dataset=mt_bench dataset.order=file limit=10 max_new_tokens=128 dtype=fp32 "
               "progress=false results_dir=results/bench-search",
               "method=rest method.datastore=python_code dataset=humaneval limit=10 max_new_tokens=128 dtype=fp32 "
               "progress=false results_dir=results/bench-search",
               "method=specdec method.beta=1,2,4 method.tol=2 dataset=gsm8k limit=10 max_new_tokens=128 dtype=fp32 "
               "progress=false results_dir=results/bench-search",
               "method=lookahead,rest,specdec,pld bs=1,8,32 limit=32 dataset.order=file dataset.max_turns=1 "
               "max_new_tokens=24 dtype=fp32 progress=false results_dir=results/bench-search"],
    "tune": [f"dataset=mt_bench dataset.max_turns=1 limit=24 max_new_tokens=64 batching=continuous bs=1,4,16 "
             f"ar_baseline=paired progress=false results_dir=results/bench-tune {x}"
             for x in ("method=pld K=1,2,4,8,auto", "method=eagle K=auto",
                       "method=eagle method.depth=1 method.total_tokens=2",
                       "method=eagle method.depth=2 method.total_tokens=6",
                       "method=eagle method.depth=4 method.total_tokens=16")],
    "floor": [f"dataset=mt_bench dataset.order=file limit=10 dataset.max_turns=1 max_new_tokens=96 progress=false "
              f"results_dir=results/bench-floor {x}"
              for x in ("method=ar bs=1,8 dtype=fp32,bf16", "method=reject K=1 dtype=fp32,bf16",
                        "method=pld,leviathan,eagle,medusa,lookahead,rest,specdec dtype=fp32,bf16")],
}


def _old_jobs(command):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (batch,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(command.split()), None)
    return batch


@pytest.mark.parametrize("name", sorted(OLD))
def test_a_preset_runs_the_jobs_of_its_old_target(name):
    def configs(jobs_of):
        out = []
        for prefix, jobs in jobs_of:
            for job in jobs:
                cfg = composed([*prefix, *job])
                cfg.pop("bench", None)  # the preset's recipe, read by specbench.bench only
                out.append(OmegaConf.to_yaml(OmegaConf.create(cfg), sort_keys=True))
        return sorted(out)

    old = configs([([], _old_jobs(c)) for c in OLD[name]])
    new = configs([([f"+experiment={name}", *[o for o in s if o.startswith("hydra.")]], bench.jobs(name, s))
                   for s in sweeps(name)])
    assert new == old


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
    cfg = OmegaConf.create(composed(["+experiment=workloads", *bench.jobs("workloads", [])[0]]))
    assert (cfg.limit, cfg.dataset.order, cfg.dataset.max_turns, cfg.ar_baseline) == (8, "categories", None, "paired")
    assert bench.main(["workloads", "--plan", "ctx=8192"]) == 2  # beyond SmolLM2's 8192 positions, refused now
    assert "ctx=8192 + max_new_tokens=128" in capsys.readouterr().err
