"""Published drafter layouts (``specbench.drafters.published``): fixtures written by the authors'
reference code (``tests/fixtures/make_reference.py``) load and give the reference's outputs; a
layout that does not match, or a drafter for another target, is refused in one line; our heads
exported in the published layout load back with the same logits; the engine stays token-identical
to AR with published heads."""

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO
from helpers import CPU, greedy_cases, run_engine, tiny_llama
from methods.medusa import Medusa
from specbench import backends
from specbench.backends import extension
from specbench.drafters import published
from specbench.drafters.medusa import MedusaHeads
from specbench.errors import ConfigError

FIXTURES = REPO / "tests" / "fixtures"
MEDUSA1 = [FIXTURES / "medusa1-L1", FIXTURES / "medusa1-L2"]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, scale=4.0)  # the target the fixtures were made on


def medusa_cfg(folder, **kw):
    m = {"name": "medusa", "checkpoint": str(folder), "tree": "default", "tree_size": "auto", "accept": "exact",
         "eps": 0.09, "delta": 0.3, **kw}
    return OmegaConf.create({"K": 3, "method": m, "model": {"name": "tiny", "path": "tiny"}})


@pytest.mark.parametrize("folder", MEDUSA1, ids=lambda p: p.name)
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_medusa1_fixture_gives_the_reference_logits(target, folder, kernel):
    if kernel == "native" and extension.unavailable():
        pytest.skip(f"native kernels: {extension.unavailable()}")
    assert published.detect(folder) == "medusa1"
    heads = published.load_medusa1(folder, target, CPU, torch.float32)
    backends.apply(heads, kernel)
    ref = torch.load(folder / "reference.pt", weights_only=True)
    with torch.no_grad():
        out = heads(ref["hidden"])
    assert out.shape == ref["logits"].shape
    assert torch.allclose(out, ref["logits"], rtol=1e-4, atol=1e-4), (out - ref["logits"]).abs().max()


def test_a_layout_that_does_not_match_is_refused_in_one_line(target, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(MEDUSA1[0], bad)
    state = torch.load(bad / published.MEDUSA1_HEADS, weights_only=True)
    state["0.1.linear.weight"] = state.pop("0.0.linear.weight")  # a renamed key
    torch.save(state, bad / published.MEDUSA1_HEADS)
    with pytest.raises(published.FormatError) as e:
        published.load_medusa1(bad, target, CPU, torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and "missing ['0.0.linear.weight']" in msg and "unexpected ['0.1.linear.weight']" in msg
    (bad / "config.json").write_text('{"medusa_num_heads": 4, "medusa_num_layers": 1}')  # declares a head it lacks
    with pytest.raises(published.FormatError, match=r"missing \['0.0.linear.weight', '3.0.linear.bias'"):
        published.check_medusa1(bad, target.config)
    (bad / "config.json").write_text("{}")
    with pytest.raises(published.FormatError, match="no medusa_num_heads"):
        published.check_medusa1(bad, target.config)


def test_a_drafter_for_another_target_is_refused(target):
    wider = tiny_llama(seed=0, vocab=128)
    with pytest.raises(published.FormatError, match="the target has 128 tokens x 64: a drafter for another target"):
        published.check_medusa1(MEDUSA1[0], wider.config)
    with pytest.raises(ConfigError, match="a drafter for another target"):
        Medusa.check(medusa_cfg(MEDUSA1[0]), wider.config)
    Medusa.check(medusa_cfg(MEDUSA1[0]), target.config)  # fits


def test_our_heads_exported_load_back_with_our_logits(target, tmp_path):
    from specbench.train.export import export_medusa

    torch.manual_seed(0)
    vocab = torch.arange(3, 90, 2)  # a draft vocabulary: the export fills the rest from the target
    ours = MedusaHeads(target, vocab, 3)
    with torch.no_grad():
        ours.weight.normal_(0, 0.2)
        ours.bias.normal_(0, 0.2)
    export_medusa(ours, target, tmp_path / "out", "tiny")
    ref_keys = set(torch.load(MEDUSA1[0] / published.MEDUSA1_HEADS, weights_only=True))
    assert set(torch.load(tmp_path / "out" / published.MEDUSA1_HEADS, weights_only=True)) == ref_keys  # the reference's layout
    back = published.load_medusa1(tmp_path / "out", target, CPU, torch.float32)
    f = torch.randn(5, 64)
    with torch.no_grad():
        assert torch.allclose(back(f)[..., vocab], ours(f), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_with_published_heads(target, bs):
    """Through the method's own loading (``medusa.checkpoint`` = the fixture): a published
    checkpoint measures no head accuracies, so the method drafts a chain of its heads' top-1."""
    prompts, refs = greedy_cases(target, 20)[bs]
    cfg = medusa_cfg(MEDUSA1[0])
    Medusa.check(cfg, target.config)
    assert Medusa.spec_len(cfg, CPU) == 3
    prop = Medusa(cfg, target, None, CPU, torch.float32)
    assert prop.describe()["tree"] == "chain" and prop.describe()["checkpoint_format"] == "medusa1"
    res = run_engine(target, prop, prompts, 20)
    assert [r.tokens for r in res] == refs
