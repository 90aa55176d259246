"""A method from another package (examples/plugin): found through its entry point, or named as
``module:Class``, its settings its own dataclass; greedy identity with AR through the engine and
through the command line."""

import json
import os
import subprocess
import sys
import tomllib

import pytest
from omegaconf import OmegaConf

from specbench import methods
from conftest import REPO
from helpers import CPU, greedy_cases, run_engine, tiny_llama
from specbench.run import records as R
from specbench.errors import ConfigError

PLUGIN = REPO / "examples" / "plugin"
TARGET = "specbench_plugin_example.bigram:BigramChain"


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """examples/plugin as pip would leave it: its source importable and a dist-info beside it
    with the entry points of its pyproject.toml (no pip, no network). Returns the PYTHONPATH."""
    meta = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    site = tmp_path / "site"
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    eps = meta["entry-points"]["specbench.methods"]
    (info / "entry_points.txt").write_text("[specbench.methods]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
    path = [str(site), str(PLUGIN / "src")]
    for p in path:
        monkeypatch.syspath_prepend(p)
    methods.plugins.cache_clear()
    yield os.pathsep.join(path)
    methods.plugins.cache_clear()


def test_the_entry_point_names_the_method_and_its_settings(installed):
    assert "bigram" in methods.names() and methods.target("bigram") == TARGET
    node = methods.settings("bigram")
    assert node.name == "bigram" and node.successor == "latest" and node.max_draft == 0
    assert methods.settings(TARGET).name == TARGET  # the class named itself: the same settings
    node.max_draft = "many"  # Hydra's node coerces nothing: the dataclass's types are held by check_types
    with pytest.raises(ConfigError, match="bigram.max_draft must be an integer, got 'many'"):
        methods.check_types(node, "bigram")


def test_bad_outside_methods_are_refused_in_one_line(installed):
    with pytest.raises(KeyError, match="cannot import no_such_pkg.mod:X"):
        methods.get("no_such_pkg.mod:X")
    with pytest.raises(KeyError, match="is not a methods.base.Proposer subclass"):
        methods.get("json:dumps")
    with pytest.raises(KeyError, match="unknown method 'bigrams'"):
        methods.get("bigrams")
    from specbench.__main__ import preprocess, store_configs

    assert preprocess(["method=bigram", "bigram.successor=first"]) == ["method=bigram", "method.successor=first"]
    with pytest.raises(ConfigError, match="cannot import no_such_pkg.mod:X"):
        store_configs(["method=ar,no_such_pkg.mod:X"])


def test_an_outside_methods_unknown_key_is_refused_in_one_line(installed, tmp_path, monkeypatch):
    """A plug-in's keys are its ``Settings`` dataclass's fields: any other is refused in both forms
    (``bigram.kk=3``, ``+method.kk=3``), as a built-in method's, and so is a value of the wrong type;
    a class without ``Settings`` takes no keys."""
    from specbench.__main__ import preprocess

    for argv, msg in ((["method=bigram", "bigram.max_drafts=2"],
                       "unknown key bigram.max_drafts; did you mean bigram.max_draft? bigram's keys: successor, max_draft"),
                      (["method=bigram", "+method.kk=3"], "unknown key method.kk; bigram's keys: successor, max_draft"),
                      ([f"method={TARGET}", "method.successr=first"],
                       f"unknown key method.successr; did you mean method.successor? {TARGET}'s keys: successor, max_draft")):
        with pytest.raises(ConfigError) as e:
            preprocess(argv)
        assert str(e.value) == msg
    with pytest.raises(ConfigError) as e:
        preprocess(["method=bigram", "bigram.max_draft=lots"])
    assert str(e.value) == "bigram.max_draft must be an integer, got 'lots'"
    assert "\n" not in str(e.value)
    (tmp_path / "bare.py").write_text("from specbench.api import Proposer\nclass Bare(Proposer):\n    name = 'bare'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as e:
        preprocess(["method=bare:Bare", "method.depth=3"])
    assert str(e.value) == "unknown key method.depth; bare:Bare's keys: none"


@pytest.mark.parametrize("successor", ["latest", "first"])
@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_through_the_engine(installed, successor, bs):
    model = tiny_llama(seed=0, scale=4.0)  # sharp: its greedy outputs repeat, so chains get accepted
    prompts, refs = greedy_cases(model, 24)[bs]
    cfg = OmegaConf.create({"K": 4, "method": methods.settings("bigram")})
    cfg.method.successor = successor
    cls = methods.get("bigram")
    cls.check(cfg, None)
    res = run_engine(model, cls(cfg, model, None, CPU, None), prompts, 24)
    assert [r.tokens for r in res] == refs
    assert sum(sum(r.accept_lens) for r in res) > 0  # its drafts were accepted, not just refused


def test_the_command_line_runs_it_from_its_entry_point_and_by_class(installed, tiny_dirs, tmp_path):
    env = {**os.environ, "PYTHONPATH": installed + os.pathsep + os.environ.get("PYTHONPATH", "")}
    base = [sys.executable, "-m", "specbench", "model=hf", f"model.path={tiny_dirs['target']}", "dataset=jsonl",
            f"dataset.path={tiny_dirs['questions']}", "limit=2", "max_new_tokens=12", "progress=false",
            "warmup=false", f"results_dir={tmp_path}"]
    run = subprocess.run(base + ["method=bigram", "bigram.successor=first"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    run = subprocess.run(base + [f"method={TARGET}", "method.max_draft=2"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = {r["method"]: r for r in R.read(tmp_path / "records.jsonl")}
    assert set(recs) == {"ar", "bigram", TARGET}
    for name in ("bigram", TARGET):
        assert recs[name]["status"] == "ok" and recs[name]["metrics"]["match_ar"] == 1.0, json.dumps(recs[name])[:500]
    assert recs["bigram"]["method_opts"]["successor"] == "first" and recs[TARGET]["K"] == 2
    bad = subprocess.run(base + ["method=bigram", "bigram.max_draft=lots"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "max_draft" in bad.stderr


def test_an_installed_wheel_runs_without_the_checkout(tiny_dirs, tmp_path):
    """A non-editable install carries the configs, the kernels' source and every subpackage:
    the wheel of this checkout, installed into a folder, runs a job from elsewhere."""
    pytest.importorskip("setuptools")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(wheels.glob("specbench-*.whl"))
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr[-2000:]
    for f in ("specbench/conf/config.yaml", "specbench/conf/experiment/headline.yaml",
              "specbench/kernels/csrc/few_rows.cpp", "specbench/drafters/eagle.py",
              "specbench/drafters/trees/medusa.json", "specbench/train/card.py", "specbench/methods/pld.py",
              "specbench/analysis/report.py"):
        assert (site / f).exists(), f
    assert not (site / "methods").exists() and not (site / "analysis").exists()  # no top-level package of those names
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-m", "specbench", "method=pld", "model=hf", f"model.path={tiny_dirs['target']}",
                          "dataset=jsonl", f"dataset.path={tiny_dirs['questions']}", "limit=1", "max_new_tokens=8",
                          "progress=false", "warmup=false", f"results_dir={tmp_path / 'out'}", "kernel=torch"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    recs = R.read(tmp_path / "out" / "records.jsonl")
    assert [r["status"] for r in recs] == ["ok", "ok"]
    assert "site" in subprocess.run([sys.executable, "-c", "import specbench; print(specbench.__file__)"], cwd=tmp_path,
                                    env=env, capture_output=True, text=True).stdout  # the installed copy ran
