"""Training on a handful of sequences: no trainer loops without progress (a data set smaller
than one batch trains in smaller batches, settings that leave nothing to train are refused in
one line), the trainer says what it will cost, and every drafter kind trains through
`python -m specbench.train` on a tiny random target and decodes token-identical to AR."""

import os
import random
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import save_tiny_hf
from helpers import CPU, greedy_cases, run_engine
from specbench import drafters, methods
from specbench.drafters import formats
from specbench.errors import ConfigError
from specbench.paths import CONF_DIR
from specbench.train import loop

SMALL = ["train.seq_len=48", "progress=false"]
FEATURES = ["features.conversations=4", "features.respond=4", "features.max_prompt_tokens=24", "features.max_tokens=48",
            "features.max_new_tokens=12"]
DATA = ["data.max_prompt_tokens=24", "data.max_new_tokens=12"]
MASK = ["drafter.mask_token_id=95"]  # the tiny tokenizer has no mask token, and its added ones occur in the data
# drafter kind -> the method that loads what it writes, that method's settings, the kind's own data settings
KINDS = {
    "draft_lm": ("leviathan", {}, DATA + ["data.prompts=6", "data.respond=3"]),
    "specdec": ("specdec", {}, DATA + ["drafter.data.prompts=6", "drafter.data.respond=6"]),
    "medusa": ("medusa", {}, FEATURES),
    "eagle": ("eagle", {"version": 2}, FEATURES),
    "eagle3": ("eagle", {"version": 3}, FEATURES),
    "mtp": ("mtp", {}, FEATURES),
    "peagle": ("peagle", {}, FEATURES + MASK),
    "dflash": ("dflash", {}, FEATURES + MASK),
    "dspark": ("dspark", {}, FEATURES + MASK),
}


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """An 8-layer tiny target saved as an HF folder (every drafter kind's taps fit it), and its
    parent folder (the training runs' working folder and cache)."""
    root = tmp_path_factory.mktemp("train_small")
    return save_tiny_hf(root / "tiny8", layers=8), root


def train_cli(tiny, kind: str, out, *args: str, timeout: float = 60):
    """``python -m specbench.train`` on the tiny target, run in its parent folder (the target is
    named relative to it: a card names no path of this machine), on one thread (the tiny model
    gains nothing from two, and a busy machine stalls them)."""
    folder, root = tiny
    env = {**os.environ, "SPECBENCH_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "specbench.train", f"target={folder.name}", f"drafter={kind}",
                           f"out={out}", "hydra.run.dir=hydra", *args], cwd=root, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_feature_set_smaller_than_a_batch_trains(tiny8, tmp_path):
    """The issue's first try: 8 sequences (one held out) against train.batch_size=8 spun forever.
    Now the batch shrinks to the 7 there are, said in one line, and the run says what it costs."""
    run = train_cli(tiny8, "dflash", tmp_path / "dflash", "train.steps=3", *FEATURES, *MASK, *SMALL)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "[train] wrote" in run.stdout
    assert "[train] 7 training sequences, fewer than train.batch_size=8: batches of 7" in run.stderr
    assert "[train] feature set: 4 answers of up to 12 tokens" in run.stderr  # the teacher pass's cost, before it
    assert "[train] train dflash: " in run.stderr and " s a step, about " in run.stderr


def test_a_setting_with_nothing_to_train_is_one_line(tiny8, tmp_path):
    run = train_cli(tiny8, "medusa", tmp_path / "medusa", "train.steps=0")
    assert run.returncode == 2
    assert run.stderr.strip() == "specbench.train: error: train.steps=0: nothing to train; set train.steps >= 1"


def train_cfg(kind: str, **train):
    cfg = OmegaConf.load(CONF_DIR / "train.yaml")
    cfg.drafter = OmegaConf.load(CONF_DIR / "drafter" / f"{kind}.yaml")
    if cfg.drafter.get("data"):
        cfg.data = OmegaConf.merge(cfg.data, cfg.drafter.data)
    return OmegaConf.merge(cfg, {"train": train})


@pytest.mark.parametrize("kind, change, match", [
    ("eagle", {"train": {"steps": 0}}, "train.steps=0: nothing to train"),
    ("eagle", {"train": {"batch_size": 0}}, "train.batch_size=0"),
    ("eagle", {"train": {"eval_frac": 1.0}}, r"train.eval_frac=1.0: the share held out must be in \[0, 1\)"),
    ("eagle", {"train": {"seq_len": 1}}, "train.seq_len=1 holds no position drafter=eagle trains on: "
                                         "set train.seq_len >= 2"),
    ("mtp", {"train": {"seq_len": 4}}, "train.seq_len >= 5"),  # its 3 recursive steps past a token
    ("dflash", {"train": {"seq_len": 2}}, "train.seq_len >= 3"),
    ("medusa", {"features": {"respond": 1, "conversations": 0}}, "features.respond \\+ features.conversations = 1"),
    ("draft_lm", {"data": {"prompts": 1}}, "data.prompts = 1: one sequence is held out"),
    ("specdec", {"data": {"respond": 3}}, r"answered prompts \(drafter.data.respond\) = 3"),
])
def test_settings_that_leave_nothing_to_train_are_refused(kind, change, match):
    loop.check(train_cfg(kind))  # the defaults train
    with pytest.raises(ConfigError, match=match):
        loop.check(OmegaConf.merge(train_cfg(kind), change))


def test_the_batch_shrinks_to_the_sequences_there_are(capsys):
    tcfg = train_cfg("eagle").train
    evals, trains, bs = loop.split(list(range(100)), tcfg)
    assert (len(evals), len(trains), bs) == (3, 97, 8) and capsys.readouterr().err == ""
    evals, trains, bs = loop.split(list(range(5)), tcfg)
    assert (evals, trains, bs) == ([0], [1, 2, 3, 4], 4)
    assert capsys.readouterr().err == "[train] 4 training sequences, fewer than train.batch_size=8: batches of 4\n"
    assert all(len(b) == 4 for b, _ in zip(loop.batches(trains, bs, 48, random.Random(0)), range(5)))
    with pytest.raises(ConfigError, match="1 sequence\\(s\\), 1 held out for the evaluation: none left to train on"):
        loop.split([0], tcfg)
    with pytest.raises(ValueError, match="batches of 8 sequences from 4"):  # never a loop that yields nothing
        next(loop.batches(trains, 8, 48, random.Random(0)))


def test_the_progress_bar_says_what_a_step_and_the_run_cost(tmp_path, capsys):
    class Toy(torch.nn.Linear):
        def own_state(self):
            return self.state_dict()

    model = Toy(4, 1)
    x = torch.randn(8, 4)
    tcfg = OmegaConf.merge(train_cfg("eagle").train, {"steps": 4, "save_every": 100})
    loop.fit(model, list(model.parameters()), lambda skip=False: (model(x).square().mean(),), tcfg,
             tmp_path / "state.pt", False, "train toy", progress=True)
    err = capsys.readouterr().err
    assert " s/step, ~" in err and " in all" in err
    assert [loop.duration(s) for s in (0.2, 40, 720, 9000)] == ["under 1 s", "40 s", "12 min", "2.5 h"]


def test_every_drafter_kind_is_in_the_table():
    assert set(KINDS) == {p.stem for p in (CONF_DIR / "drafter").glob("*.yaml")}


def test_one_table_names_each_kind_its_architecture_format_and_trainer():
    """``drafters.KINDS`` is the one table of drafter kinds: each conf/drafter yaml's kind is a row,
    its architecture imports, its format is one ``drafters.formats`` reads, and its trainer has the
    interface ``python -m specbench.train`` looks up (``specbench.train``'s docstring)."""
    import importlib

    from specbench.train import trainer

    assert set(drafters.KINDS) == {OmegaConf.load(p).kind for p in (CONF_DIR / "drafter").glob("*.yaml")}
    for kind, row in drafters.KINDS.items():
        importlib.import_module(row.architecture)
        assert row.format is None or formats.module(row.format)
        t = trainer(kind)
        assert t.DATA in ("features", "distill", "answers"), kind
        assert all(callable(getattr(t, f)) for f in ("min_seq_len", "train", "finish", "said")), kind
        assert t.DATA != "features" or callable(t.layers), kind
    with pytest.raises(ConfigError, match="unknown drafter kind 'nope'; choices: draft_lm, specdec, medusa"):
        trainer("nope")


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_drafter_kind_trains_and_decodes_as_ar(tiny8, tmp_path, kind):
    """`python -m specbench.train drafter=<kind>` for 2 steps on a handful of sequences ends within
    a minute; its folder loads through its method, and greedy decoding at bs 1 is AR's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    method, settings, args = KINDS[kind]
    out = tmp_path / kind
    run = train_cli(tiny8, kind, out, "train.steps=2", *args, *SMALL)
    assert run.returncode == 0, run.stderr[-2000:]
    fmt = drafters.KINDS[kind].format  # written in the format the kind table names
    assert (formats.detect(out) == fmt) if fmt else drafters.read_meta(out)["kind"] == kind
    folder = tiny8[0]
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    own = {} if method == "leviathan" else {"checkpoint": str(out)}  # leviathan reads draft_model
    cfg = OmegaConf.create({"K": 3, "sampling": {"temperature": 0.0}, "model": {"name": folder.name, "path": str(folder)},
                            "draft_model": {"name": "trained", "path": str(out), "layers": None},
                            "method": {**methods.settings(method), **own, **settings}})
    methods.get(method).check(cfg, target.config)
    prop = methods.get(method)(cfg, target, AutoTokenizer.from_pretrained(folder), CPU, torch.float32)
    prompts, refs = greedy_cases(target, 16)[1]
    assert [r.tokens for r in run_engine(target, prop, prompts, 16)] == refs
