"""Prompt sets read through Hugging Face ``datasets`` (``dataset=hf``) and the benchmarks read by name
from the user's files (``dataset=spec_bench``, ``dataset=speed_bench``): each layout built here, in the
test, offline; every refusal one line; a ``ctx`` beyond the model's window refused. The jsonl
questions (a bad line: one line and a record), MT-Bench's default order and ``ctx`` prompts."""

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf, open_dict  # noqa: E402

from specbench.__main__ import preprocess  # noqa: E402
from specbench.errors import ConfigError  # noqa: E402
from specbench.run import data as D  # noqa: E402
from specbench.run import records as R  # noqa: E402
from specbench.run import runner  # noqa: E402

from conftest import REPO  # noqa: E402
from helpers import tiny_cfg  # noqa: E402

ROWS = {"text": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10"],
        "conv": [["w1 w2", "w3"], ["w4"], ["w5 w6", "w7", "w8"], ["w9"]],
        "label": [0, 1, 0, 1],
        "topic": ["alpha", "beta", "alpha", "gamma"],
        "uid": ["a", "b", "c", "d"]}


def composed(overrides=()):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def dcfg(name="hf", **over):
    """The dataset group of ``dataset=<name>`` as the yaml composes it, with ``over`` set."""
    cfg = composed([f"dataset={name}"]).dataset
    with open_dict(cfg):
        for k, v in over.items():
            cfg[k] = v
    return cfg


def load(tmp_path, limit=None, **over):
    return D.load_questions(dcfg(cache_dir=str(tmp_path / "hf-cache"), **over), limit)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfdata")
    ds = datasets.Dataset.from_dict(ROWS)
    ds.to_parquet(root / "set.parquet")
    ds.to_json(root / "set.jsonl")  # one JSON object per line
    ds.to_csv(root / "set.csv", index=False)
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(root / "saved")
    ds.save_to_disk(root / "saved_one")
    ds.select([]).to_parquet(root / "empty.parquet")
    datasets.Dataset.from_dict({"conv": [["w1", None]], "uid": ["x"]}).to_parquet(root / "bad_turn.parquet")
    return root


# ---------------------------------------------------------------------------- dataset=hf
def test_hf_reads_parquet_json_csv_and_save_to_disk_with_the_columns_named(files, tmp_path):
    for f in ("set.parquet", "set.jsonl", "set.csv"):
        qs = load(tmp_path, path=str(files / f), prompt="text", id="uid", category="topic")
        assert [(q.id, q.category, q.turns) for q in qs][:2] == [("a", "alpha", ["w1 w2 w3"]), ("b", "beta", ["w4 w5"])]
    qs = load(tmp_path, path=str(files / "saved"), split="train", turns="conv")
    assert [q.turns for q in qs] == ROWS["conv"] and [q.id for q in qs] == ["0", "1", "2", "3"]  # ids: row numbers
    assert {q.category for q in qs} == {"default"}
    assert len(load(tmp_path, path=str(files / "saved"), split="test", turns="conv")) == 2
    assert len(load(tmp_path, path=str(files / "saved_one"), prompt="text")) == 4  # one split: no split to name
    assert (tmp_path / "hf-cache").is_dir()  # dataset.cache_dir is datasets' cache


def test_hf_filters_categories_then_orders_and_limits(files, tmp_path):
    kw = dict(path=str(files / "set.parquet"), prompt="text", id="uid", category="topic")
    assert [q.id for q in load(tmp_path, categories="alpha", **kw)] == ["a", "c"]
    assert [q.id for q in load(tmp_path, categories=["gamma", "beta"], **kw)] == ["b", "d"]
    assert [q.id for q in load(tmp_path, limit=3, order="categories", **kw)] == ["a", "b", "d"]  # one per category
    assert [q.id for q in load(tmp_path, limit=2, max_turns=1, **kw)] == ["a", "b"]


@pytest.mark.parametrize("over,msg", [
    ({"prompt": "txt"}, "dataset=hf: no column 'txt' for dataset.prompt; did you mean text? columns there: text, conv, "
                        "label, topic, uid"),
    ({"prompt": "text", "category": "topc"}, "no column 'topc' for dataset.category; did you mean topic?"),
    ({"prompt": "text", "id": "label"}, "dataset=hf: id 0 is on rows 0 and 2; ids must be unique"),
    ({"prompt": "label"}, "dataset=hf: row 0 (id 0): column 'label' holds int, not text; dataset.prompt names a "
                          "column of strings (columns: text, conv, label, topic, uid)"),
    ({"turns": "text"}, "column 'text' holds one string, not a list of turns: use dataset.prompt=text"),
    ({"prompt": "text", "turns": "conv"}, "set dataset.prompt (one turn per row) or dataset.turns"),
    ({}, "dataset=hf needs dataset.prompt=<column> (one turn per row) or dataset.turns=<column> (a list of turns); "
         "columns there: text, conv, label, topic, uid"),
    ({"prompt": "text", "split": "test"}, "set.parquet holds one split: drop dataset.split=test"),
    ({"prompt": "text", "config": "en"}, "dataset.config names a config of a hub data set"),
    ({"prompt": "text", "categories": ["alpha", "xyz"], "category": "topic"},
     "dataset=hf has no category 'xyz'; categories there: alpha, beta, gamma"),
])
def test_hf_refusals_are_one_line_naming_the_columns(files, tmp_path, over, msg):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, path=str(files / "set.parquet"), **over)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_hf_refuses_an_empty_split_a_bad_turn_and_a_missing_or_ambiguous_split(files, tmp_path):
    for over, msg in (({"path": str(files / "empty.parquet"), "prompt": "text"},
                       "empty.parquet holds no rows (columns: text, conv, label, topic, uid)"),
                      ({"path": str(files / "bad_turn.parquet"), "turns": "conv"},
                       "row 0 (id 0): column 'conv' must hold a non-empty list of strings, got a null "
                       "(columns: conv, uid)"),
                      ({"path": str(files / "saved"), "turns": "conv"},
                       "has several splits: choose one with dataset.split=<...> (splits: train, test)"),
                      ({"path": str(files / "saved"), "turns": "conv", "split": "tets"},
                       "has no split 'tets'; did you mean test? choose one with dataset.split=<...>"),
                      ({"path": str(files / "nope.parquet"), "prompt": "text"}, "does not exist")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            load(tmp_path, **over)


def test_hf_keys_are_declared_and_a_misspelt_one_refused():
    """`dataset.prompt=...` and the other new keys compose and pass the schema; a typo is refused
    with the closest key; `dataset.name=<config>` (load_dataset's spelling) points at dataset.config."""
    args = ["dataset=hf", "dataset.path=x.parquet", "dataset.prompt=text", "dataset.id=uid", "dataset.category=c",
            "dataset.categories=[a,b]", "dataset.split=test", "dataset.cache_dir=/tmp/c"]
    assert preprocess(args) == args
    cfg = composed(args)
    assert cfg.dataset.prompt == "text" and list(cfg.dataset.categories) == ["a", "b"]
    with pytest.raises(ConfigError, match=r"unknown key dataset.promt; did you mean dataset.prompt\?"):
        preprocess(["dataset=hf", "dataset.promt=text"])
    with pytest.raises(ConfigError, match="a hub data set's config is dataset.config=wikitext-2"):
        preprocess(["dataset=hf", "dataset.name=wikitext-2"])
    from specbench.run import schema

    with pytest.raises(ConfigError, match=re.escape("dataset=hf needs dataset.path=<...> (a hub id, a save_to_disk")):
        schema.check(composed(["dataset=hf"]))
    with pytest.raises(ConfigError, match=re.escape("dataset=speed_bench needs dataset.split=<...> (qualitative or")):
        schema.check(composed(["dataset=speed_bench", "dataset.path=x"]))
    assert D.label(cfg.dataset) == "hf:x.parquet:test"


# ---------------------------------------------------------------------------- Spec-Bench
def write_spec_bench(path, per=2):
    """Spec-Bench's question.jsonl layout: question_id (int), category, turns; sorted by category."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        n = 0
        for cat in D.SPEC_BENCH_CATEGORIES:
            for _ in range(per):
                n += 1
                turns = [f"w{n} w{n + 1}"] + ([f"w{n + 2}"] if cat in D.SPEC_BENCH_CATEGORIES[:8] else [])
                f.write(json.dumps({"question_id": n, "category": cat, "turns": turns}) + "\n")
    return path


def test_spec_bench_keeps_its_categories_from_the_file_or_the_repository(tmp_path):
    clone = tmp_path / "Spec-Bench"
    q = write_spec_bench(clone / "data" / "spec_bench" / "question.jsonl")
    for path in (q, clone, q.parent):
        qs = load(tmp_path, name="spec_bench", path=str(path))
        assert len(qs) == 26 and [x.category for x in qs[:13]] == list(D.SPEC_BENCH_CATEGORIES)  # one each first
    qs = load(tmp_path, name="spec_bench", path=str(q), limit=4, order="file")
    assert [x.category for x in qs] == ["writing"] * 2 + ["roleplay"] * 2
    qs = load(tmp_path, name="spec_bench", path=str(q), categories=["rag", "translation"])
    assert [x.category for x in qs] == ["translation", "rag", "translation", "rag"]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question_id": 1, "category": "mine", "turns": ["w1"]}) + "\n")
    with pytest.raises(ConfigError, match="holds none of Spec-Bench's categories"):
        load(tmp_path, name="spec_bench", path=str(other))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no question.jsonl in"):
        load(tmp_path, name="spec_bench", path=str(tmp_path / "empty"))


def test_the_per_category_table_orders_categories_as_spec_bench_does():
    from specbench.analysis import tables

    cats = ["rag", "coding", "zeta", "writing", "qa", "alpha", "math_reasoning"]
    assert D.category_order(cats) == ["writing", "coding", "qa", "math_reasoning", "rag", "alpha", "zeta"]
    assert tables.category_order is D.category_order


# ---------------------------------------------------------------------------- SPEED-Bench
def speed_rows(n=6, placeholder=False):
    """SPEED-Bench's columns (its dataset card): question_id, category, sub_category, turns, source,
    src_id, difficulty, multiturn."""
    cats = ["coding", "math", "multilingual"]
    turns = [[f"w{i} w{i + 1}"] + ([f"w{i + 2}"] if i % 2 else []) for i in range(n)]
    if placeholder:
        turns[1] = [D.hfdata.SPEED_PLACEHOLDER + "\n\n{article}"]
    return datasets.Dataset.from_dict({
        "question_id": [f"q{i}" for i in range(n)], "category": [cats[i % 3] for i in range(n)],
        "sub_category": ["s"] * n, "turns": turns, "source": ["src"] * n, "src_id": [str(i) for i in range(n)],
        "difficulty": ["easy"] * n, "multiturn": [bool(i % 2) for i in range(n)]})


def test_speed_bench_reads_each_published_layout(tmp_path):
    ds = speed_rows()
    hub = tmp_path / "hub"  # hf download nvidia/SPEED-Bench --repo-type dataset --local-dir hub
    (hub / "qualitative").mkdir(parents=True)
    ds.to_parquet(hub / "qualitative" / "test-00000-of-00001.parquet")
    prepared = tmp_path / "data"  # Model-Optimizer's prepare_data.py --output_dir data
    (prepared / "speed" / "throughput_1k").mkdir(parents=True)
    ds.to_parquet(prepared / "speed" / "throughput_1k" / "test.parquet")
    datasets.DatasetDict({"test": ds}).save_to_disk(tmp_path / "saved" / "qualitative")
    ds.to_json(tmp_path / "qualitative.jsonl")
    for path, split in ((hub, "qualitative"), (prepared, "throughput_1k"), (prepared / "speed", "throughput_1k"),
                        (prepared / "speed" / "throughput_1k", "throughput_1k"), (tmp_path / "saved", "qualitative"),
                        (tmp_path / "saved" / "qualitative", "qualitative"),
                        (tmp_path / "qualitative.jsonl", "qualitative"), (tmp_path, "qualitative")):
        qs = load(tmp_path, name="speed_bench", path=str(path), split=split, order="file")
        assert [q.id for q in qs] == [f"q{i}" for i in range(6)], path
        assert qs[1].turns == ["w1 w2", "w3"] and qs[2].category == "multilingual"
    qs = load(tmp_path, name="speed_bench", path=str(hub), split="qualitative", limit=3)  # round-robin: one each
    assert [q.category for q in qs] == ["coding", "math", "multilingual"]
    cfg = dcfg("speed_bench", path=str(hub), split="qualitative")
    assert D.label(cfg) == "speed_bench:qualitative"


def test_speed_bench_refuses_placeholders_bad_splits_and_missing_columns(tmp_path):
    (tmp_path / "qualitative").mkdir()
    speed_rows(placeholder=True).to_parquet(tmp_path / "qualitative" / "test.parquet")
    with pytest.raises(ConfigError, match=re.escape("question q1 (math) still holds the hub's placeholder for a "
                                                    "licensed source: fetch the turns with NVIDIA Model-Optimizer's "
                                                    "examples/specdec_bench/prepare_data.py --config qualitative")):
        load(tmp_path, name="speed_bench", path=str(tmp_path), split="qualitative")
    with pytest.raises(ConfigError, match="needs dataset.split=qualitative or throughput_<N>k, got 'qualtative'; "
                                          "did you mean qualitative?"):
        load(tmp_path, name="speed_bench", path=str(tmp_path), split="qualtative")
    with pytest.raises(ConfigError, match=re.escape("no split throughput_8k in") + ".*there: hf-cache, qualitative"):
        load(tmp_path, name="speed_bench", path=str(tmp_path), split="throughput_8k")
    datasets.Dataset.from_dict({"question_id": ["1"], "prompt": ["w1"]}).to_parquet(tmp_path / "throughput_2k.parquet")
    with pytest.raises(ConfigError, match="no column 'turns' for dataset.turns; columns there: question_id, prompt"):
        load(tmp_path, name="speed_bench", path=str(tmp_path), split="throughput_2k")
    with pytest.raises(ConfigError, match="dataset path '.*nowhere' does not exist"):
        D.check(dcfg("speed_bench", path=str(tmp_path / "nowhere"), split="qualitative"))


# ---------------------------------------------------------------------------- a job, and ctx
def job_cfg(tiny_dirs, tmp_path, *over):
    cfg = composed(["model=hf", "method=pld", "ar_baseline=sweep", "draft_model=self_layers", *over])
    with open_dict(cfg):
        cfg.model.path = str(tiny_dirs["target"])
        cfg.results_dir, cfg.records = str(tmp_path), str(tmp_path / "records.jsonl")
        cfg.max_new_tokens, cfg.progress, cfg.draft_model.layers = 6, False, 1
    return cfg


def test_a_job_on_an_hf_parquet_records_its_data_set_and_a_bad_column_fails_in_one_line(tiny_dirs, files, tmp_path):
    cfg = job_cfg(tiny_dirs, tmp_path, "dataset=hf", f"dataset.path={files / 'set.parquet'}", "dataset.prompt=text",
                  "dataset.category=topic", "limit=2", f"dataset.cache_dir={tmp_path / 'c'}")
    recs = runner.run(cfg, sweep_id="hf")
    assert [(r["method"], r["status"]) for r in recs] == [("ar", "ok"), ("pld", "ok")]
    assert recs[1]["dataset"] == f"hf:{files / 'set.parquet'}" and recs[1]["metrics"]["match_ar"] == 1.0
    assert [q["category"] for q in recs[1]["requests"]] == ["alpha", "beta"]
    with open_dict(cfg):
        cfg.dataset.prompt = "txet"
    rec, = runner.run(cfg, sweep_id="hf")
    assert rec["status"] == "error" and rec["error"] == (
        "dataset=hf: no column 'txet' for dataset.prompt; did you mean text? columns there: text, conv, label, "
        "topic, uid")
    assert len(R.read(tmp_path / "records.jsonl")) == 3


def test_a_ctx_beyond_the_models_window_is_refused_in_one_line(tiny_dirs, tmp_path):
    """The tiny target has 512 positions: ctx=600 is beyond its window, refused before anything loads,
    with the longest ctx that fits; that ctx passes and one more does not."""
    cfg = job_cfg(tiny_dirs, tmp_path, "dataset=jsonl", f"dataset.path={tiny_dirs['questions']}", "ctx=600", "K=4")
    with pytest.raises(ConfigError) as e:
        runner.validate(cfg)
    assert str(e.value) == ("ctx=600 + max_new_tokens=6 + 4 draft positions exceeds the 512 positions of the job's "
                            "models: ctx=600 is beyond their context window; ctx <= 501 fits (lower max_new_tokens "
                            "for more)")
    cfg.ctx = 501
    runner.validate(cfg)
    cfg.ctx = 502
    with pytest.raises(ConfigError, match=r"exceeds the 512 positions of the job's models: ctx <= 501 fits"):
        runner.validate(cfg)
    cfg.ctx, cfg.max_new_tokens = 8, 600
    with pytest.raises(ConfigError, match="no ctx fits"):
        runner.validate(cfg)
    OmegaConf.update(cfg, "ctx", 600)
    cfg.max_new_tokens = 6
    rec, = runner.run(cfg, sweep_id="ctx")
    assert rec["status"] == "error" and "ctx=600 is beyond their context window" in rec["error"]


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
