"""Config composition of every group, the one-line errors for bad input (the command line's
``preprocess``, the schema, ``validation``) and the draft a config resolves to, on tiny HF folders.
The jobs themselves: test_runner.py; the records file: test_records.py; the command line's sweeps
and Hydra's launchers: test_launchers.py; the model loader: test_models.py; prompt sets:
test_data_sets.py."""

import json
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from specbench import methods, paths
from specbench.run import runner, schema
from specbench.__main__ import preprocess
from specbench.errors import ConfigError

from conftest import REPO
from helpers import composed, tiny_cfg

GROUPS = ["method", "model", "dataset", "draft_model", "logger", "accept"]


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes(group):
    opts = methods.names() if group == "method" else paths.group_options(group)  # methods: the config store's
    assert opts
    for opt in opts:
        cfg = composed([f"{group}={opt}"])
        if group == "draft_model":  # draft options name a kind: self_layers, hf, or a trained checkpoint
            assert cfg.draft_model.name in ("auto", "self_layers", "hf", "trained")
        elif group == "model" and opt == "random":  # a random-weight model is named by its shape
            assert cfg.model.name == f"random-{cfg.model.shape}"
        else:
            assert cfg[group].name == opt


def test_every_registered_method_has_its_settings_and_no_yaml():
    assert not paths.group_options("method")  # a method's settings are its dataclass, not a yaml
    assert all(composed([f"method={name}"]).method.keys() == methods.settings(name).keys() for name in methods.builtin())


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


TOP_KEYS = ("model, dataset, draft_model, method, logger, accept, K, bs, sampling, serving, tune, thinking, "
            "ctx, limit, max_new_tokens, seed, dtype, device, kernel, backend, vllm, "
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
    (["serving.slo.ttft=5"], "unknown key serving.slo.ttft; did you mean serving.slo.ttft_ms? serving.slo's keys: "
                             "ttft_ms, tpot_ms"),
    # a setting that moved into a node: its new key suggested (the old top-level one is refused)
    (["temperature=0.5"], f"unknown key temperature; did you mean sampling.temperature? top-level keys: {TOP_KEYS}"),
    (["top_p=0.9"], f"unknown key top_p; did you mean sampling.top_p? top-level keys: {TOP_KEYS}"),
    (["batching=continuous"], f"unknown key batching; did you mean serving.batching? top-level keys: {TOP_KEYS}"),
    (["+rate=2"], f"unknown key rate; did you mean serving.rate? top-level keys: {TOP_KEYS}"),
    (["slo.ttft_ms=5"], f"unknown key slo.ttft_ms; did you mean serving.slo.ttft_ms? top-level keys: {TOP_KEYS}"),
    (["serving.ttft_ms=5"], "unknown key serving.ttft_ms; did you mean serving.slo.ttft_ms? serving's keys: batching, "
                            "rate, prefill_chunk, slo"),
    (["vllm.eager=true"], "unknown key vllm.eager; vllm's keys: python, enforce_eager, max_num_batched_tokens, "
                          "block_size, prefix_caching, kv_cache_gb, threads"),
    (["accept=synthetic", "accept.rate=0.5"], "unknown key accept.rate; did you mean accept.rates? accept's keys: rates"),
    (["method=eagel"], "unknown method 'eagel'; did you mean eagle? choices: ar, combo, dflash"),
    (["experiment=headlin"], "unknown experiment 'headlin'; did you mean headline? choices: "),
    (["+experiment=headline"], "a preset is experiment=NAME (no +); did you mean headline? presets: cpu, "),
    (["+experiment=headlin"], "a preset is experiment=NAME (no +); did you mean headline? presets: cpu, "),
    (["pld=3"], "pld is a method: method=pld runs it, pld.<key>=... sets its keys (max_ngram, min_ngram)"),
    (["method=PLD"], "unknown method 'PLD'; did you mean pld? choices: "),
    (["method=my_pkg.last_token"], "unknown method 'my_pkg.last_token'; choices: "),
    (["kernel=native,avx2"], "unknown kernel 'avx2'; choices: auto, torch, onednn, native"),  # before the sweep
    (["serving.batching=dynamic"], "unknown serving.batching 'dynamic'; choices: static, continuous"),
    (["dataset.order=categorie"], "unknown dataset.order 'categorie'; did you mean categories? choices: file, "),
    (["model=smollm2"], "unknown model 'smollm2'; did you mean smollm2-135m? choices: "),
])
def test_an_unknown_key_is_refused_in_one_line_with_the_valid_keys(argv, msg):
    """A key nothing declares (a method's settings: its Settings; the run's: specbench/run/schema.py)
    is refused before Hydra starts, whether it is set (``pld.kk=3``) or added (``+method.kk=3``),
    never ignored; the line lists the valid keys and the closest of them."""
    with pytest.raises(ConfigError) as e:
        preprocess(argv)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value), str(e.value)


def test_declared_keys_pass_through():
    argv = ["method=pld", "method.max_ngram=2,3", "pld.min_ngram=1", "bs=1,2", "model=hf", "model.path=x",
            "+draft_model.label=x", "~dataset.language", "serving.slo.ttft_ms=200", "sampling.temperature=0,0.7",
            "serving.batching=static,continuous", "serving.rate=4", "tune.K=[1,2]", "vllm.threads=0-1",
            "hydra.launcher.n_jobs=2", "hydra/launcher=joblib", "--multirun", "logger=wandb", "logger.project=p"]
    assert preprocess(argv) == [a.replace("pld.", "method.") for a in argv]
    assert preprocess(["experiment=eagle3", "method.version=3"]) == ["experiment=eagle3", "method.version=3"]
    argv = ["experiment=search", "hydra.sweeper.params=null", "method=rest", "method.datastore=python_code"]
    assert preprocess(argv) == argv


@pytest.mark.parametrize("argv,msg", [
    (["ctx=abc"], "ctx must be an integer >= 1 or null, got 'abc'"),
    (["bs=1,0"], "bs must be an integer >= 1, got 0"),
    (["sampling.temperature=hot"], "sampling.temperature must be a number >= 0, got 'hot'"),
    (["serving.batching=contiuous"], "unknown serving.batching 'contiuous'; did you mean continuous?"),
    (["kernel=avx2"], "unknown kernel 'avx2'; choices: auto, torch, onednn, native"),
    (["serving=continuous"], "serving holds settings, not a value: set serving.<key>=... (batching, rate, "
                             "prefill_chunk, slo)"),
    (["+sampling.temperature=0.7"], "sampling.temperature is a setting already: set it without the + "
                                    "(sampling.temperature=0.7)"),
])
def test_a_bad_command_line_value_is_refused_before_the_sweep(argv, msg):
    """A value its declared type, range or choices do not take, set on the command line, stops the
    command in one line (no job runs, no record); one only a job can tell (K=true) is its record's."""
    with pytest.raises(ConfigError) as e:
        preprocess(argv)
    assert str(e.value).startswith(msg)
    assert preprocess(["K=true", "ctx=null", "bs=${K}"]) == ["K=true", "ctx=null", "bs=${K}"]


def test_the_summary_shows_a_refused_jobs_bad_value_as_given():
    from specbench.run.summary import summary_table

    rec = {"method": "pld", "model": "m", "dataset": "d", "bs": 1, "K": True, "ctx": "abc", "status": "error",
           "error": "ctx must be an integer >= 1 or null, got 'abc'", "metrics": {}}
    assert "abc" in summary_table([rec])


def test_an_unknown_key_is_refused_by_the_command_line_before_anything_runs(tmp_path):
    """Both forms on the command line: one line, exit 2, no job run, no record written."""
    for arg, msg in (("pld.kk=3", "unknown key pld.kk; pld's keys: max_ngram, min_ngram"),
                     ("+method.kk=3", "unknown key method.kk; pld's keys: max_ngram, min_ngram"),
                     ("temperature=0.5", f"unknown key temperature; did you mean sampling.temperature? top-level keys: "
                                         f"{TOP_KEYS}")):
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
                      ({"serving.slo.ttft": 5}, "unknown key serving.slo.ttft; did you mean serving.slo.ttft_ms? "
                                                "serving.slo's keys: ttft_ms, tpot_ms"),
                      ({"temperature": 0.5}, "unknown key temperature; did you mean sampling.temperature? top-level "
                                             "keys: "),
                      ({"method": {"name": "eagel"}}, "unknown method 'eagel'; did you mean eagle? choices: ")):
        with pytest.raises(ConfigError) as e:
            runner.validate(tiny_cfg(tiny_dirs, tmp_path, **over))
        assert str(e.value).startswith(msg), str(e.value)
    recs = runner.run(tiny_cfg(tiny_dirs, tmp_path, method={**pld, "kk": 3}), sweep_id="typo")
    assert [(r["status"], r["error"]) for r in recs] == [("error", "unknown key method.kk; pld's keys: max_ngram, "
                                                                   "min_ngram")]


@pytest.mark.parametrize("over,msg", [
    ({"K": 0}, "K must be an integer >= 1"),
    ({"bs": 0}, "bs must be an integer >= 1"),
    ({"serving.batching": "dynamic"}, "unknown serving.batching 'dynamic'; choices: static, continuous"),
    ({"serving.batching": "continuous", "serving.rate": 0}, "serving.rate must be inf or a number of requests per "
                                                            "second > 0, got 0"),
    ({"serving.rate": 2.0}, "serving.rate applies to serving.batching=continuous"),
    ({"serving.prefill_chunk": 0}, "serving.prefill_chunk must be an integer >= 1 or null, got 0"),
    ({"serving.slo": {"tpot_ms": -1, "ttft_ms": None}}, "serving.slo.tpot_ms must be a number > 0 or null"),
    ({"ctx": 100000}, "exceeds the 512 positions of the job's models"),
    ({"K": True}, "K must be an integer >= 1, got True"),
    ({"K": 2.5}, "K must be an integer >= 1, got 2.5"),
    ({"bs": "8"}, "bs must be an integer >= 1, got '8'"),
    ({"dataset.max_turns": -1}, "dataset.max_turns must be an integer >= 1 or null, got -1"),
    ({"sampling.top_p": "high"}, "sampling.top_p must be a number in (0, 1], got 'high'"),
    ({"sampling.top_p": 1.5}, "sampling.top_p must be a number in (0, 1], got 1.5"),
    ({"warmup": "no"}, "warmup must be true or false, got 'no'"),
    ({"dtype": "int8"}, "unknown dtype 'int8'; choices: auto, fp32"),
    ({"limit": 0}, "limit must be an integer >= 1 or null, got 0"),
    ({"dataset.path": "???"}, "dataset=jsonl needs dataset.path=<...> (a .jsonl file of questions)"),
    ({"model.path": "???"}, "model=hf needs model.path=<...> (a hub id or a local folder)"),
    ({"draft_model.layers": 0}, "draft_model.layers must be an integer >= 1 or null, got 0"),
    ({"dataset.path": "/no/such/file.jsonl"}, "does not exist"),
    ({"model.path": "/no/such/model"}, "model path '/no/such/model' does not exist"),
    ({"sampling.temperature": -1.0}, "sampling.temperature must be a number >= 0, got -1.0"),
    ({"kernel": "triton"}, "unknown kernel 'triton'; choices: auto, torch, onednn, native"),
    ({"compile": "yes"}, "unknown compile 'yes'; choices: false, true, graphs"),
    ({"compile": True, "kernel": "onednn"}, "compile=true compiles torch's kernels, not kernel=onednn"),
    ({"compile": "graphs", "kernel": "torch", "serving.batching": "continuous"},
     "compile=graphs runs static batches (rows leave, none join), not serving.batching=continuous"),
    ({"compile": "graphs", "kernel": "torch", "serving.prefill_chunk": 64},
     "compile=graphs prefills whole prompts, not serving.prefill_chunk pieces: leave it unset"),
    ({"ar_baseline": "nearest"}, "unknown ar_baseline 'nearest'; choices: sweep, any, paired"),
    ({"sampling.top_p": 0.0}, "sampling.top_p must be a number in (0, 1]"),
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


def test_draft_with_another_vocabulary_is_refused(tiny_dirs, tmp_path):
    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "leviathan"}})
    with open_dict(cfg):
        cfg.draft_model = {"name": "hf", "path": str(tiny_dirs["other"]), "layers": None}
    with pytest.raises(ConfigError, match="another vocabulary"):
        runner.validate(cfg)
    cfg.draft_model.path = str(tiny_dirs["draft"])
    runner.validate(cfg)  # same vocabulary: fine


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


