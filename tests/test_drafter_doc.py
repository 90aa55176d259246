"""docs/adding-a-drafter-method.md's drafter method, written where a newcomer writes it: the
architecture, the trainer, the drafter's and the method's yaml and the method copied from the page
(removed afterwards), its row added to the kind table. Trained through the table's lookup on a tiny
target, it writes a checkpoint with a card, loads through its method and decodes token-identical
to plain greedy at bs 1 and 4 and with rows joining a running batch."""

import re
import sys

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO
from helpers import DEVICE, reference_greedy, run_engine, serve_engine
from test_feature_methods import feature_setup, patch_eval_slice  # noqa: F401 (a fixture)
from specbench.paths import CONF_DIR

DOC = REPO / "docs" / "adding-a-drafter-method.md"


def doc_blocks(section: str, lang: str) -> list[str]:
    """The ``lang`` code blocks of the page's section ``section`` ("1", "5")."""
    body = re.search(rf"^## {section}\.(.*?)(?=^## |\Z)", DOC.read_text(), re.S | re.M).group(1)
    return re.findall(rf"```{lang}\n(.*?)```", body, re.S)


@pytest.fixture
def documented(monkeypatch):
    """The page's files in place and its row in ``drafters.KINDS`` (all undone afterwards)."""
    from specbench import drafters

    files = {REPO / "specbench" / "drafters" / "next_head.py": doc_blocks("1", "python")[0],
             REPO / "specbench" / "train" / "next_head.py": doc_blocks("3", "python")[0],
             CONF_DIR / "drafter" / "next_head.yaml": doc_blocks("4", "yaml")[0],
             REPO / "methods" / "next_head.py": doc_blocks("5", "python")[0]}
    assert not any(f.exists() for f in files)
    row = doc_blocks("2", "python")[0].strip().rstrip(",")
    name, kind = eval("{" + row + "}", {"Kind": drafters.Kind}).popitem()
    monkeypatch.setitem(drafters.KINDS, name, kind)
    try:
        for f, text in files.items():
            f.write_text(text)
        yield name
    finally:
        for f in files:
            f.unlink(missing_ok=True)
        for mod in ("specbench.drafters.next_head", "specbench.train.next_head", "specbench.methods.next_head"):
            sys.modules.pop(mod, None)


def test_the_documented_drafter_method_trains_and_decodes_as_greedy(feature_setup, monkeypatch, documented):
    from specbench import methods
    from specbench.train import features, loop, trainer

    target, tok, convs, cfg, root = feature_setup
    patch_eval_slice(monkeypatch, convs)
    c = OmegaConf.merge(cfg, {"train": {"steps": 60}})
    c.drafter = OmegaConf.load(CONF_DIR / "drafter" / "next_head.yaml")
    loop.check(c)  # the table's lookup: its DATA and min_seq_len
    t = trainer(documented)
    c.features.layers = t.layers(c, int(target.config.num_hidden_layers))
    items = features.load(features.build(target, tok, "tiny", c.features, DEVICE, torch.float32, progress=False,
                                         convs=convs))
    out0, out = root / "next_head_0", root / "next_head"
    out0.mkdir()
    out.mkdir()
    before = t.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, tok, items, out0, {2}, DEVICE,
                     progress=False)["summary"]
    res = t.train(c, target, tok, items, out, {2}, DEVICE, progress=False)
    assert res["summary"]["eval_loss"] < before["eval_loss"]  # it learned
    assert t.said(res["summary"]).startswith("held-out top-1 agreement ")
    t.finish(c, res, out, "tiny", {**features.stats(items), "dropped": {}, "key": "k"},
             "python -m specbench.train drafter=next_head")
    card = (out / "README.md").read_text()
    assert card.startswith("# next_head: next_head drafter for tiny") and "method=next_head next_head.checkpoint=" in card

    mcfg = OmegaConf.create({"K": 1, "sampling": {"temperature": 0.0}, "model": {"name": "tiny", "path": None},
                             "method": {**methods.settings(documented), "checkpoint": str(out)}})
    cls = methods.get(documented)
    cls.check(mcfg, target.config)
    prompts = [items[i]["tokens"][:8].tolist() for i in range(4)]
    refs = [reference_greedy(target, p, 16) for p in prompts]
    for bs in (1, 4):
        got = run_engine(target, cls(mcfg, target, tok, DEVICE, torch.float32), prompts[:bs], 16)
        assert [r.tokens for r in got] == refs[:bs]
    assert sum(sum(r.accept_lens) for r in got) > 0  # its drafts are accepted
    got, _ = serve_engine(target, cls(mcfg, target, tok, DEVICE, torch.float32), prompts + prompts[:2], 16,
                          concurrency=3)
    assert [r.tokens for r in got] == refs + refs[:2]
