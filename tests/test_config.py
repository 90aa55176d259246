"""Config composition of every group, the one-line errors for bad input, and runner jobs
(recorded failures, AR baseline reuse, records schema) on tiny HF folders."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from specbench import methods
from specbench.run import records as R
from specbench import hf, models, paths
from specbench.run import measure, runner, schema
from specbench.__main__ import preprocess
from specbench.errors import ConfigError

from conftest import REPO

CONF = str(REPO / "conf")
GROUPS = ["method", "model", "dataset", "draft_model", "logger", "accept"]


def composed(overrides=()):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    opts = paths.group_options(group)
    assert opts
    for opt in opts:
        cfg = composed([f"{group}={opt}"])
        if group == "draft_model":  # draft options name a kind: self_layers, hf, or a trained checkpoint
            assert cfg.draft_model.name in ("auto", "self_layers", "hf", "trained")
        elif group == "model" and opt == "random":  # a random-weight model is named by its shape
            assert cfg.model.name == f"random-{cfg.model.shape}"
        else:
            assert cfg[group].name == opt
        if group == "method":
            assert opt in methods.builtin()  # every method yaml has a registered module


def test_every_registered_method_has_a_config():
    assert set(methods.builtin()) == set(paths.group_options("method"))


def test_default_sweep_and_multirun_mode():
    raw = OmegaConf.load(REPO / "conf" / "config.yaml")
    assert raw.hydra.mode == "MULTIRUN"
    assert set(raw.hydra.sweeper.params.method.split(",")) == {"ar", "pld", "lookahead"}


def test_preprocess_rejects_unknown_choices_and_rewrites_draft():
    with pytest.raises(ConfigError, match="unknown method 'eagle2'; did you mean eagle\\? choices: ar, combo, dflash, dspark, eagle, leviathan, lookahead, medusa, mtp, peagle, pld, recycle, reject, rest, sam, specdec, suffix"):
        preprocess(["method=pld,eagle2"])
    # a method's own keys: eagle.depth=... is method.depth=...
    assert preprocess(["method=eagle", "eagle.depth=4,6", "eagle.top_k=3"]) == \
        ["method=eagle", "method.depth=4,6", "method.top_k=3"]
    # ... but only when that method runs alone: a key of one method must not reach another's jobs
    for argv in (["method=eagle,medusa", "eagle.depth=4"], ["eagle.depth=4"], ["method=eagle", "medusa.tree=chain"]):
        with pytest.raises(ConfigError, match="needs method=.* alone"):
            preprocess(argv)
    with pytest.raises(ConfigError, match="unknown model 'llama9'"):
        preprocess(["model=llama9"])
    with pytest.raises(ConfigError, match="unknown dataset"):
        preprocess(["dataset=nope"])
    assert preprocess(["draft_model=org/some-draft", "bs=1,2"]) == ["draft_model=hf", "draft_model.path=org/some-draft", "bs=1,2"]
    assert preprocess(["draft_model=self_layers"]) == ["draft_model=self_layers"]


def test_the_draft_group_has_one_name():
    """``draft=`` (the draft model's group before ``draft_model=``, in no release) is an unknown key like
    any other: refused in one line that points at ``draft_model``, on the command line and in code."""
    with pytest.raises(ConfigError, match="unknown key draft; did you mean draft_model"):
        preprocess(["draft=org/some-draft"])
    cfg = composed()
    with open_dict(cfg):
        cfg.draft = {"name": "self_layers", "layers": 2}
    with pytest.raises(ConfigError, match="draft.*draft_model"):
        schema.check(cfg)


TOP_KEYS = ("model, dataset, draft_model, method, logger, accept, K, bs, batching, rate, prefill_chunk, slo, tune, thinking, "
            "ctx, limit, max_new_tokens, temperature, top_k, top_p, seed, dtype, device, kernel, backend, vllm, "
            "compile, warmup, repeats, resume, ar_baseline, results_dir, records, progress")


@pytest.mark.parametrize("argv,msg", [
    (["method=pld", "pld.kk=3"], "unknown key pld.kk; pld's keys: max_ngram, min_ngram"),
    (["method=pld", "+method.kk=3"], "unknown key method.kk; pld's keys: max_ngram, min_ngram"),
    (["method=pld", "++method.kk=3"], "unknown key method.kk; pld's keys: max_ngram, min_ngram"),
    (["method=pld", "method.max_ngrams=4"], "unknown key method.max_ngrams; did you mean method.max_ngram? pld's keys: "
                                            "max_ngram, min_ngram"),
    (["method=eagle", "eagle.dpeth=4"], "unknown key eagle.dpeth; did you mean eagle.depth? eagle's keys: version, "
                                        "checkpoint, top_k, depth, total_tokens, tree"),
    (["+method.kk=3"], "unknown key method.kk; ar's keys: none"),  # the default sweep's first method: ar
    (["method=pld,lookahead", "method.max_ngram=2"], "method.max_ngram is pld's, not lookahead's: set it with "
                                                     "method=pld alone and sweep the others in a separate command "
                                                     "(lookahead's keys: W, N, G, pool_cap, prompt_ngrams)"),
    (["experiment=eagle3", "method.max_ngram=2"], "unknown key method.max_ngram; eagle's keys: "),  # its sweep
    (["bss=4"], f"unknown key bss; did you mean bs? top-level keys: {TOP_KEYS}"),
    (["+bss=4"], f"unknown key bss; did you mean bs? top-level keys: {TOP_KEYS}"),
    (["~bss"], f"unknown key bss; did you mean bs? top-level keys: {TOP_KEYS}"),
    (["+model.pathh=x"], "unknown key model.pathh; did you mean model.path? model's keys: package, file, path, chat, "
                         "attn_implementation, shape, logit_std, tokenizer"),
    (["draft_model.layer=2"], "unknown key draft_model.layer; did you mean draft_model.layers? draft_model's keys: "
                              "label, path, layers"),
    (["draft.layers=2"], f"unknown key draft.layers; did you mean draft_model? top-level keys: {TOP_KEYS}"),
    (["slo.ttft=5"], "unknown key slo.ttft; did you mean slo.ttft_ms? slo's keys: ttft_ms, tpot_ms"),
    (["vllm.eager=true"], "unknown key vllm.eager; vllm's keys: python, enforce_eager, max_num_batched_tokens, "
                          "block_size, prefix_caching, kv_cache_gb, threads"),
    (["accept=synthetic", "accept.rate=0.5"], "unknown key accept.rate; did you mean accept.rates? accept's keys: rates"),
    (["method=eagel"], "unknown method 'eagel'; did you mean eagle? choices: ar, combo, dflash"),
    (["experiment=headlin"], "unknown experiment 'headlin'; did you mean headline? choices: "),
    (["+experiment=headline"], "a preset is experiment=headline (no +)"),
    (["kernel=native,avx2"], "unknown kernel 'avx2'; choices: auto, torch, onednn, native"),  # before the sweep
    (["batching=dynamic"], "unknown batching 'dynamic'; choices: static, continuous"),
    (["dataset.order=categorie"], "unknown dataset.order 'categorie'; did you mean categories? choices: file, "),
    (["model=smollm2"], "unknown model 'smollm2'; did you mean smollm2-135m? choices: "),
])
def test_an_unknown_key_is_refused_in_one_line_with_the_valid_keys(argv, msg):
    """A key nothing declares (a method's settings: its yaml; the run's: specbench/run/schema.py)
    is refused before Hydra starts, whether it is set (``pld.kk=3``) or added (``+method.kk=3``),
    never ignored; the line lists the valid keys and the closest of them."""
    with pytest.raises(ConfigError) as e:
        preprocess(argv)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def test_declared_keys_pass_through():
    argv = ["method=pld", "method.max_ngram=2,3", "pld.min_ngram=1", "bs=1,2", "model=hf", "model.path=x",
            "+draft_model.label=x", "~dataset.language", "slo.ttft_ms=200", "tune.K=[1,2]", "vllm.threads=0-1",
            "hydra.launcher.n_jobs=2", "hydra/launcher=joblib", "--multirun", "logger=wandb", "logger.project=p"]
    assert preprocess(argv) == [a.replace("pld.", "method.") for a in argv]
    assert preprocess(["experiment=eagle3", "method.version=3"]) == ["experiment=eagle3", "method.version=3"]
    argv = ["experiment=search", "hydra.sweeper.params=null", "method=rest", "method.datastore=python_code"]
    assert preprocess(argv) == argv


def test_an_unknown_key_is_refused_by_the_command_line_before_anything_runs(tmp_path):
    """Both forms on the command line: one line, exit 2, no job run, no record written."""
    for arg, msg in (("pld.kk=3", "unknown key pld.kk; pld's keys: max_ngram, min_ngram"),
                     ("+method.kk=3", "unknown key method.kk; pld's keys: max_ngram, min_ngram")):
        out = subprocess.run([sys.executable, "-m", "specbench", "method=pld", arg, f"results_dir={tmp_path}"],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.strip() == f"specbench: error: {msg}", out.stderr[-2000:]
    assert not (tmp_path / "records.jsonl").exists()


def test_an_unknown_key_in_a_composed_config_is_refused_before_the_model_loads(tiny_dirs, tmp_path):
    """A config built in code or by a preset (no command line to check) is held to the same keys."""
    pld = {"name": "pld", "max_ngram": 3, "min_ngram": 1}
    for over, msg in (({"method": {**pld, "kk": 3}}, "unknown key method.kk; pld's keys: max_ngram, min_ngram"),
                      ({"bss": 4}, "unknown key bss; did you mean bs? top-level keys: "),
                      ({"model.pathh": "x"}, "unknown key model.pathh; did you mean model.path? model's keys: "),
                      ({"slo.ttft": 5}, "unknown key slo.ttft; did you mean slo.ttft_ms? slo's keys: ttft_ms, tpot_ms"),
                      ({"method": {"name": "eagel"}}, "unknown method 'eagel'; did you mean eagle? choices: ")):
        with pytest.raises(ConfigError) as e:
            runner.validate(tiny_cfg(tiny_dirs, tmp_path, **over))
        assert str(e.value).startswith(msg), str(e.value)
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, method={**pld, "kk": 3}), sweep_id="typo")
    assert [(r["status"], r["error"]) for r in recs] == [("error", "unknown key method.kk; pld's keys: max_ngram, "
                                                                   "min_ngram")]


def register_fakes(monkeypatch, **classes):
    """Register test-only proposer classes under these method names for one test."""
    real_get = methods.get
    for name in classes:
        monkeypatch.setitem(methods.REGISTRY, name, "x:y")
    monkeypatch.setattr(methods, "get", lambda n: classes.get(n) or real_get(n))


def tiny_cfg(tiny_dirs, tmp_path, **over):
    # the sweep's AR run once (the default pairs every job with its own AR): tests ask for paired
    cfg = composed(["model=hf", "dataset=jsonl", "draft_model=self_layers", "ar_baseline=sweep"])
    with open_dict(cfg):
        cfg.model.path = str(tiny_dirs["target"])
        cfg.dataset.path = str(tiny_dirs["questions"])
        cfg.results_dir = str(tmp_path)
        cfg.records = str(tmp_path / "records.jsonl")
        cfg.max_new_tokens = 12
        cfg.limit = 4
        cfg.progress = False
        cfg.draft_model.layers = 1
        for k, v in over.items():
            OmegaConf.update(cfg, k, v, force_add=True)
    return cfg


@pytest.mark.parametrize("over,msg", [
    ({"K": 0}, "K must be an integer >= 1"),
    ({"bs": 0}, "bs must be an integer >= 1"),
    ({"batching": "dynamic"}, "unknown batching 'dynamic'; choices: static, continuous"),
    ({"batching": "continuous", "rate": 0}, "rate must be inf or a number of requests per second > 0, got 0"),
    ({"rate": 2.0}, "rate applies to batching=continuous"),
    ({"prefill_chunk": 0}, "prefill_chunk must be an integer >= 1 or null, got 0"),
    ({"slo": {"tpot_ms": -1, "ttft_ms": None}}, "slo.tpot_ms must be a number > 0 or null"),
    ({"ctx": 100000}, "exceeds the 512 positions of the job's models"),
    ({"K": True}, "K must be an integer >= 1, got True"),
    ({"K": 2.5}, "K must be an integer >= 1, got 2.5"),
    ({"bs": "8"}, "bs must be an integer >= 1, got '8'"),
    ({"dataset.max_turns": -1}, "dataset.max_turns must be an integer >= 1 or null, got -1"),
    ({"top_p": "high"}, "top_p must be a number in (0, 1], got 'high'"),
    ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
    ({"warmup": "no"}, "warmup must be true or false, got 'no'"),
    ({"dtype": "int8"}, "unknown dtype 'int8'; choices: auto, fp32"),
    ({"limit": 0}, "limit must be an integer >= 1 or null, got 0"),
    ({"dataset.path": "???"}, "dataset=jsonl needs dataset.path=<...> (a .jsonl file of questions)"),
    ({"model.path": "???"}, "model=hf needs model.path=<...> (a hub id or a local folder)"),
    ({"draft_model.layers": 0}, "draft_model.layers must be an integer >= 1 or null, got 0"),
    ({"dataset.path": "/no/such/file.jsonl"}, "does not exist"),
    ({"model.path": "/no/such/model"}, "model path '/no/such/model' does not exist"),
    ({"temperature": -1.0}, "temperature must be a number >= 0, got -1.0"),
    ({"kernel": "triton"}, "unknown kernel 'triton'; choices: auto, torch, onednn, native"),
    ({"compile": "yes"}, "compile must be true, false or graphs, got 'yes'"),
    ({"compile": True, "kernel": "onednn"}, "compile=true compiles torch's kernels, not kernel=onednn"),
    ({"ar_baseline": "nearest"}, "unknown ar_baseline 'nearest'; choices: sweep, any, paired"),
    ({"top_p": 0.0}, "top_p must be a number in (0, 1]"),
    ({"method": {"name": "eagle9"}}, "unknown method 'eagle9'"),
    ({"method": {"name": "leviathan"}, "draft_model.layers": 5}, "draft_model.layers must be an integer in 1..1"),
    ({"method": {"name": "eagle", "version": 2, "top_k": "auto", "depth": 0, "total_tokens": "auto",
                 "checkpoint": "checkpoints/smollm2-135m/eagle"}}, "eagle.depth must be 'auto' or an integer >= 1"),
    ({"method": {"name": "eagle", "version": 3, "top_k": 4, "depth": 3, "total_tokens": 8,
                 "checkpoint": "checkpoints/smollm2-135m/eagle"}}, "holds an EAGLE-1/2 drafter; set eagle.version=2"),
    ({"method": {"name": "eagle", "version": 2, "top_k": 4, "depth": 3, "total_tokens": 8,
                 "checkpoint": "checkpoints/smollm2-135m/eagle"}}, "was trained for smollm2-135m, not"),
    ({"method": {"name": "eagle", "version": 2, "top_k": 4, "depth": 3, "total_tokens": 8,
                 "checkpoint": "checkpoints/smollm2-135m/medusa"}}, "holds a medusa drafter, not a eagle drafter"),
    ({"method": {"name": "medusa", "tree": "bushy", "accept": "exact", "tree_size": None, "eps": 0.09, "delta": 0.3,
                 "checkpoint": "checkpoints/smollm2-135m/medusa"}}, "medusa.tree must be default, chain or a published tree"),
    ({"method": {"name": "medusa", "tree": "chain", "accept": "exact", "tree_size": None, "eps": 0.09, "delta": 0.3,
                 "checkpoint": "/no/such/heads"}}, "is not a drafter checkpoint"),
    ({"method": {"name": "lookahead", "W": 0, "N": 3, "G": 3}}, "lookahead.W must be 'auto' or an integer >= 1"),
    ({"method": {"name": "reject", "token": 10**9}}, "reject.token must be a token id"),
    ({"method": {"name": "lookahead", "W": 5, "N": 1, "G": 3}}, "lookahead.N must be 'auto' or an integer >= 2"),
    ({"method": {"name": "rest", "datastore": "/no/such/store.jsonl", "num_draft": 64, "max_suffix": 16,
                 "min_suffix": 2}}, "rest.datastore '/no/such/store.jsonl' is neither sharegpt nor python_code"),
    ({"method": {"name": "combo", "of": ["pld", "suffix"], "opts": {"pld": {"max_ngam": 2}}, "max_nodes": "auto",
                 "prior": 0.5}}, "unknown key combo.opts.pld.max_ngam; did you mean combo.opts.pld.max_ngram? pld's keys: max_ngram, "
                                 "min_ngram"),
    ({"method": {"name": "sam", "min_match": 2, "corpus": None, "corpus_tokens": 300000, "static_bias": 4,
                 "fallback": "recycle", "fallback_opts": {"tree_sise": 4}}},
     "unknown key sam.fallback_opts.tree_sise; did you mean sam.fallback_opts.tree_size? recycle's keys: topk, tree_size, tree, warm"),
    ({"method": {"name": "specdec", "beta": 0, "tol": 1.0, "checkpoint": "checkpoints/smollm2-135m/specdec"}},
     "specdec.beta must be an integer >= 1"),
    ({"method": {"name": "specdec", "beta": 2, "tol": -1, "checkpoint": "checkpoints/smollm2-135m/specdec"}},
     "specdec.tol must be a number > 0"),
    ({"method": {"name": "specdec", "beta": 1, "tol": 1.0, "checkpoint": "/no/such/drafter"}},
     "is not a drafter checkpoint"),
])
def test_bad_inputs(tiny_dirs, tmp_path, over, msg):
    cfg = tiny_cfg(tiny_dirs, tmp_path, **over)
    with pytest.raises(ConfigError, match=re.escape(msg)):
        runner.validate(cfg)


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


def test_the_position_limit_counts_the_methods_deepest_node(tiny_dirs, tmp_path):
    """K=4 leaves room for ctx=495 on 512 positions (495 + 12 + 4 + 1); Lookahead's window
    (W=5, N=3: nodes 6 deep) does not, whatever K says."""
    pld = {"name": "pld", "max_ngram": 3, "min_ngram": 1}
    runner.validate(tiny_cfg(tiny_dirs, tmp_path, ctx=495, method=pld))
    with pytest.raises(ConfigError, match=re.escape("ctx=495 + max_new_tokens=12 + 6 draft positions exceeds")):
        runner.validate(tiny_cfg(tiny_dirs, tmp_path, ctx=495, method={"name": "lookahead", "W": 5, "N": 3, "G": 3}))
    runner.validate(tiny_cfg(tiny_dirs, tmp_path, ctx=493, method={"name": "lookahead", "W": 5, "N": 3, "G": 3}))


def test_a_draft_model_with_fewer_positions_bounds_the_job(tiny_dirs, tmp_path):
    import shutil

    short = tmp_path / "short_draft"
    shutil.copytree(tiny_dirs["draft"], short)
    conf = json.loads((short / "config.json").read_text())
    conf["max_position_embeddings"] = 64
    (short / "config.json").write_text(json.dumps(conf))
    cfg = tiny_cfg(tiny_dirs, tmp_path, ctx=40, method={"name": "leviathan"})
    with open_dict(cfg):
        cfg.draft_model = {"name": "hf", "path": str(short), "layers": None}
    runner.validate(cfg)  # 40 + 12 + 4 + 1 <= 64
    cfg.ctx = 50
    with pytest.raises(ConfigError, match="exceeds the 64 positions of the job's models"):
        runner.validate(cfg)


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


def test_shipped_model_configs_match_the_conversion():
    """The copies in specbench/model_configs are what validation reads on a cold cache: the
    fields it and the methods use must be those of the converted model."""
    from transformers import AutoConfig

    for d in sorted(models.SHIPPED_CONFIGS.iterdir()):
        c = AutoConfig.from_pretrained(d)
        assert d.name in paths.group_options("model")
        mcfg = OmegaConf.load(paths.CONF_DIR / "model" / f"{d.name}.yaml")
        assert mcfg.package and not mcfg.path
        assert hf.max_positions(c) > 0 and c.vocab_size > 0 and c.num_hidden_layers > 0


@pytest.mark.slow
def test_shipped_model_configs_equal_the_converted_folders():
    from transformers import AutoConfig

    for d in sorted(models.SHIPPED_CONFIGS.iterdir()):
        mcfg = OmegaConf.load(paths.CONF_DIR / "model" / f"{d.name}.yaml")
        converted = AutoConfig.from_pretrained(models.model_dir(mcfg)).to_dict()
        shipped = AutoConfig.from_pretrained(d).to_dict()
        for k in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
            converted.pop(k, None)
            shipped.pop(k, None)
        assert shipped == converted, d.name


def test_draft_with_another_vocabulary_is_refused(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "leviathan"}})
    with open_dict(cfg):
        cfg.draft_model = {"name": "hf", "path": str(tiny_dirs["other"]), "layers": None}
    with pytest.raises(ConfigError, match="another vocabulary"):
        runner.validate(cfg)
    cfg.draft_model.path = str(tiny_dirs["draft"])
    runner.validate(cfg)  # same vocabulary: fine


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
        alone = runner.run(tiny_cfg(tiny_dirs, tmp_path / f"alone{T}", bs=2, temperature=T, **pld), sweep_id="a")
        order.clear()
        paired = [runner.run(tiny_cfg(tiny_dirs, tmp_path / f"paired{T}", bs=2, temperature=T, ar_baseline="paired",
                                      **pld), sweep_id="p") for _ in range(2)]
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


def test_first_divergence_bookkeeping():
    assert R.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert R.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert R.first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early (an EOS)
    ar = [{"id": "a", "turn": 1, "prompt_sha": "p", "tokens": [1, 2, 3, 4]},
          {"id": "a", "turn": 2, "prompt_sha": "q", "tokens": [7, 7]},
          {"id": "b", "turn": 1, "prompt_sha": "r", "tokens": [5, 6]}]
    ref = {(r["id"], r["turn"], 0): r for r in ar}
    mine = [{"id": "a", "turn": 1, "prompt_sha": "p", "tokens": [1, 2, 9, 4]},
            {"id": "a", "turn": 2, "prompt_sha": "other", "tokens": [7, 8]},  # its prompt already differs
            {"id": "b", "turn": 1, "prompt_sha": "r", "tokens": [5, 6]}]
    d = R.divergence(mine, ref)
    assert d == {"compared": 2, "diverged": 1, "median_at": 2, "first_at": 2, "positions": [2]}
    assert mine[0]["diverge_at"] == 2 and "diverge_at" not in mine[1] and mine[2]["diverge_at"] is None


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
    monkeypatch.setitem(methods.REGISTRY, "broken", "specbench.methods.no_such_module:X")  # a method that fails to import
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


def test_ctx_prompts_have_exact_length(tiny_dirs, tmp_path, monkeypatch):
    from specbench.run import data as D

    monkeypatch.setattr(D, "long_texts", lambda: [" ".join(f"w{i % 90}" for i in range(400))])
    cfg = tiny_cfg(tiny_dirs, tmp_path, ctx=64)
    tok = runner.load_tokenizer(cfg.model)
    qs = runner.build_requests(cfg, tok)
    assert all(len(q.ctx_ids) == 64 and len(q.turns) == 1 for q in qs)
    recs = runner.run(cfg, sweep_id="c")
    assert all(r["prompt_tokens"] == 64 for r in recs[0]["requests"])
    cfg = tiny_cfg(tiny_dirs, tmp_path, ctx=3)
    with pytest.raises(ConfigError, match="shorter than the prompt"):
        runner.build_requests(cfg, tok)


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


def test_records_reader_skips_a_cut_line(tmp_path):
    p = tmp_path / "records.jsonl"
    R.append(p, {"method": "ar", "status": "ok"})
    with p.open("a") as f:
        f.write('{"method": "pld", "sta')
    assert [r["method"] for r in R.read(p)] == ["ar"]
    assert json.loads(p.read_text().splitlines()[0])["status"] == "ok"
    R.append(p, {"method": "leviathan", "status": "ok"})  # the next record after the cut survives
    assert [r["method"] for r in R.read(p)] == ["ar", "leviathan"]


def test_trained_draft_for_another_model_is_refused(tiny_dirs, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "drafter.json").write_text(json.dumps({"kind": "draft_lm", "target": "smollm2-135m",
                                                 "target_vocab_size": 49152, "layers": 1}))
    (ck / "model.safetensors").write_bytes(b"")
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "leviathan"}})
    with open_dict(cfg):
        cfg.draft_model = {"name": "hf", "path": str(ck), "layers": None}
    with pytest.raises(ConfigError, match="was trained for smollm2-135m"):
        runner.validate(cfg)


def test_shipped_draft_config_points_at_a_checkpoint():
    cfg = OmegaConf.load(REPO / "conf" / "draft_model" / "smollm2-135m-draft.yaml")
    from specbench.drafters import is_draft_checkpoint

    path = paths.resolve_path(cfg.path)
    if not is_draft_checkpoint(path):
        pytest.skip("no shipped draft checkpoint in this checkout")
    meta = json.loads((REPO / cfg.path / "drafter.json").read_text())
    assert meta["target"] == "smollm2-135m" and meta["target_vocab_size"] == 49152


def test_concurrent_first_runs_convert_once(tmp_path, monkeypatch):
    """Two processes (here: threads with their own lock handles) asking for a packaged model
    that is not converted yet: one converts, the other waits and finds the folder whole."""
    import threading
    import time as _time

    from omegaconf import OmegaConf

    monkeypatch.setenv("SPECBENCH_CACHE", str(tmp_path))
    calls = []

    def slow_convert(mcfg, out):
        calls.append(out)
        _time.sleep(0.5)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_text("x")

    monkeypatch.setattr(models, "_convert_gguf", slow_convert)
    mcfg = OmegaConf.create({"name": "packaged", "path": None, "package": "p", "file": "f.gguf"})
    got = []
    threads = [threading.Thread(target=lambda: got.append(models.model_dir(mcfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2 and got[0] == got[1]
    assert (Path(got[0]) / "model.safetensors").exists()


def test_models_with_a_recurrent_state_are_refused():
    from transformers import LlamaConfig

    hf.check_rollback(LlamaConfig())  # attention only: fine
    hybrid = LlamaConfig()
    hybrid.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ConfigError, match="recurrent layers \\(linear_attention\\)"):
        hf.check_rollback(hybrid)
    ssm = LlamaConfig()
    ssm.model_type = "mamba2"
    with pytest.raises(ConfigError, match="cannot be rolled back"):
        hf.check_rollback(ssm)


def test_code_state_tells_uncommitted_states_apart(tmp_path):
    """``<sha>-dirty`` for any change let resume and ar_baseline=any pair records of different
    code: the label carries a hash of the diff and of untracked source files."""
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    (tmp_path / ".gitignore").write_text("results/\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-qm", "c")
    clean = R.code_state(tmp_path)
    assert clean and "dirty" not in clean
    (tmp_path / "m.py").write_text("x = 2\n")
    a = R.code_state(tmp_path)
    (tmp_path / "m.py").write_text("x = 3\n")
    b = R.code_state(tmp_path)
    assert a.startswith(clean + "-dirty-") and b.startswith(clean + "-dirty-") and a != b
    assert R.code_state(tmp_path) == b  # the same state, the same label
    (tmp_path / "new_method.py").write_text("y = 1\n")  # an untracked source file is code
    c = R.code_state(tmp_path)
    assert c != b
    (tmp_path / "new_method.py").write_text("y = 2\n")
    assert R.code_state(tmp_path) != c
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "records.jsonl").write_text("{}\n")  # ignored: not code
    (tmp_path / "notes.bin").write_bytes(b"\0")  # not a source file
    assert R.code_state(tmp_path) == R.code_state(tmp_path)
    d = R.code_state(tmp_path)
    (tmp_path / "results" / "records.jsonl").write_text("{}\n{}\n")
    assert R.code_state(tmp_path) == d
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "new_method.py").unlink()
    assert R.code_state(tmp_path) == clean
    assert R.code_state(tmp_path / "results") is not None  # a subfolder of the work tree: the same repo


@pytest.mark.parametrize("lines,msg", [
    (['[1, 2]'], r"q.jsonl:1: a question line is a JSON object with 'turns', got a list"),
    (['{"question_id": 7, "turns": ["a"]}', '{"question_id": 7, "turns": ["b"]}'],
     "q.jsonl:2: question_id 7 is already on line 1; ids must be unique"),
    (['{"turns": ["a"]}', '{"question_id": 1, "turns": ["b"]}'],  # the line number is the first one's id
     "q.jsonl:2: question_id 1 is already on line 1"),
    (['{"question_id": 1, "turns": "a"}'], "'turns' must be a non-empty list of strings"),
    (['{"question_id": 1}'], "'turns' must be a non-empty list of strings"),
    (['{"question_id": 1, "turns": [1'], "not a question line"),
])
def test_bad_jsonl_lines_fail_in_one_line_with_a_record(tiny_dirs, tmp_path, lines, msg):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    from specbench.run import data as D

    with pytest.raises(ConfigError, match=msg.replace("[", r"\[")):
        D.read_jsonl_questions(path)
    cfg = tiny_cfg(tiny_dirs, tmp_path / "res", **{"dataset.path": str(path), "limit": None})
    (rec,) = runner.run(cfg, "s1")  # recorded, no traceback, the sweep goes on
    assert rec["status"] == "error" and "q.jsonl" in rec["error"]
    assert [r["status"] for r in R.read(cfg.records)] == ["error"]


def test_mt_bench_default_order_covers_every_category_first():
    """`dataset.order=categories` (MT-Bench's default) takes questions round-robin over the
    categories, so the default limit=8 asks one of each (the file's first ten are all writing)."""
    from specbench.run import data as D

    cfg = composed([])
    assert cfg.dataset.order == "categories" and cfg.limit == 8
    qs = D.load_questions(cfg.dataset, cfg.limit)
    assert len({q.category for q in qs}) == 8 == len(qs)
    in_file = D.load_questions(OmegaConf.merge(cfg.dataset, {"order": "file"}), 8)
    assert {q.category for q in in_file} == {"writing"}
    qs = [D.Question(str(i), c, ["t"]) for i, c in enumerate("aaabbc")]
    assert [q.id for q in D.by_category(qs)] == ["0", "3", "5", "1", "4", "2"]


def test_continuous_batching_records_serving_metrics_and_pairs_its_own_ar(tiny_dirs, tmp_path):
    """batching=continuous: the job serves every turn as a request at concurrency bs (the second
    turn arrives when the first is answered), token-identical to the static job; records the
    serving settings (in the AR pairing key: a continuous job never pairs with a static AR),
    latency percentiles, goodput under the SLO and rows in flight; Poisson arrivals are seeded."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    static = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **pld), sweep_id="s")
    cont = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, batching="continuous", slo={"ttft_ms": 1e6, "tpot_ms": 1e-6},
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
    poisson = [runner.run(tiny_cfg(tiny_dirs, tmp_path / f"p{i}", bs=2, batching="continuous", rate=50.0,
                                   method={"name": "ar"}), sweep_id="p") for i in range(2)]
    arrivals = [sorted(rq["arrival_s"] for rq in run[0]["requests"] if rq["turn"] == 1) for run in poisson]
    assert arrivals[0] == arrivals[1] and arrivals[0][0] == 0 and arrivals[0][-1] > 0  # seeded, spread
    assert poisson[0][0]["serving"]["rate"] == 50.0
    # the report: the serving plot and speedup against concurrency (two concurrencies per line)
    runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=1, batching="continuous", **pld), sweep_id="s")
    runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=1, **pld), sweep_id="s")
    from specbench.analysis import report
    from specbench.analysis.load import load

    df = load(tmp_path / "records.jsonl")
    assert set(df["label"]) >= {"ar", "ar [continuous]"} and df["label"].str.endswith("[continuous]").sum() >= 4
    written = {p.name for p in report.build(tmp_path / "records.jsonl", tmp_path / "report")}
    assert {"throughput_vs_tpot.png", "speedup_vs_concurrency.png"} <= written


def test_chunked_prefill_is_recorded_pairs_its_own_ar_and_keeps_the_tokens(tiny_dirs, tmp_path):
    """prefill_chunk=N: the prompts are prefilled alone in pieces (static and continuous); the
    record says so (in the AR pairing key: it pairs with an AR prefilled the same way), its tokens
    are the padded prefill's, and the report labels it as its own series."""
    pld = {"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}}
    static = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, **pld), sweep_id="s")
    chunked = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, prefill_chunk=3, **pld), sweep_id="s")
    cont = runner.run(tiny_cfg(tiny_dirs, tmp_path, bs=2, batching="continuous", prefill_chunk=3, **pld), sweep_id="s")
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
    vllm = tiny_cfg(tiny_dirs, tmp_path, backend="vllm", prefill_chunk=3, method={"name": "ar"})
    from specbench.engines.vllm import engine as vllm_engine

    from specbench.errors import ConfigError

    with pytest.raises(ConfigError, match="vllm.max_num_batched_tokens"):
        vllm_engine.check(vllm, "ar")


@pytest.mark.parametrize("arch", ["Qwen2", "Qwen3", "Mistral"])
def test_the_default_draft_fits_any_target(tiny_dirs, tmp_path, arch):
    """draft_model=auto (the default): the target's first layers on a model the shipped draft was not
    trained for, so leviathan runs (and stays token-identical) on any target; the shipped draft on
    the packaged SmolLM2; a setting the chosen draft does not take is refused in one line."""
    import shutil

    import transformers

    from specbench.methods.leviathan import Leviathan, resolved

    cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    torch.manual_seed(0)
    mc = cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2, pad_token_id=0)
    folder = tmp_path / arch
    model_cls(mc).save_pretrained(folder)
    for f in tiny_dirs["target"].iterdir():  # the tiny word-level tokenizer
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, folder / f.name)
    cfg = composed(["model=hf", "dataset=jsonl", "method=leviathan", "ar_baseline=paired"])
    with open_dict(cfg):
        cfg.model.path, cfg.dataset.path = str(folder), str(tiny_dirs["questions"])
        cfg.results_dir, cfg.records = str(tmp_path), str(tmp_path / "records.jsonl")
        cfg.limit, cfg.max_new_tokens, cfg.progress, cfg.K = 2, 8, False, 2
    assert cfg.draft_model.name == "auto"
    if arch == "Qwen2":  # transformers reads a Qwen2 folder's tokenizer as Qwen2's BPE: our words vanish
        rec, = runner.run(cfg, sweep_id=arch)
        assert rec["status"] == "error" and "its prompt renders to no tokens with Qwen2Tokenizer" in rec["error"]
        return
    ar, rec = runner.run(cfg, sweep_id=arch)
    assert rec["status"] == "ok", rec["error"]
    assert rec["draft"] == "self_layers:2" and rec["metrics"]["match_ar"] == 1.0
    smol = composed(["method=leviathan"])
    assert resolved(smol).draft_model.label == "smollm2-135m-draft"
    assert Leviathan.draft_label(smol) == "smollm2-135m-draft"
    with open_dict(smol):
        smol.draft_model.layers = 2
    with pytest.raises(ConfigError, match="draft_model.layers=2: draft_model=auto runs the shipped draft smollm2-135m-draft"):
        resolved(smol)
    trained = composed(["method=leviathan", "draft_model=smollm2-135m-draft", "draft_model.layers=2"])
    with pytest.raises(ConfigError, match="draft_model.layers=2 applies to draft_model=self_layers"):
        resolved(trained)


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
