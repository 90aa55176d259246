"""The oneDNN linear path (``kernel=onednn``): same numbers as torch's within fp32 rounding,
greedy identity of the engine on it, and training untouched."""

import pytest
import torch

from helpers import CPU, cfg_for, greedy_cases, reference_greedy, run_engine, tiny_llama
from methods.pld import PromptLookup
from methods.reject import Reject
from specbench import kernels
from specbench.models import ConfigError

pytestmark = pytest.mark.skipif(not kernels.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def packed():
    m = tiny_llama(seed=0, scale=4.0)
    ref = tiny_llama(seed=0, scale=4.0)
    assert kernels.apply(m, "onednn") == 2 * 7 + 1  # q k v o gate up down per layer + the head
    assert kernels.apply(m, "onednn") == 0  # idempotent
    return m, ref


def test_same_logits_as_torch(packed):
    m, ref = packed
    x = torch.randint(3, 96, (3, 17))
    with torch.inference_mode():
        a, b = m(x).logits, ref(x).logits
    assert (a - b).abs().max() < 1e-4
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("bs", [1, 4])
def test_greedy_identity_on_the_packed_path(packed, bs):
    m, _ = packed
    prompts, _ = greedy_cases(m, 1)[bs]
    refs = [reference_greedy(m, p, 20) for p in prompts]  # recomputation through the same kernels
    for prop in (None, PromptLookup(cfg_for(K=3), m, None, CPU, torch.float32),
                 Reject(cfg_for(K=2, method={"name": "reject", "token": 5}), m, None, CPU, torch.float32)):
        assert [r.tokens for r in run_engine(m, prop, prompts, 20)] == refs


def test_training_and_other_dtypes_keep_torchs_path(packed):
    m, _ = packed
    lin = m.model.layers[0].mlp.up_proj
    x = torch.randn(2, 64, requires_grad=True)
    lin(x).sum().backward()  # autograd through the layer as loaded
    assert x.grad is not None and lin.weight.grad is not None
    bf = tiny_llama(seed=1).to(torch.bfloat16)
    assert kernels.apply(bf, "onednn") == 0


def test_resolve():
    assert kernels.resolve("torch", CPU) == "torch"
    assert kernels.resolve("auto", CPU) == "onednn"
    assert kernels.resolve("auto", torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match="kernel=onednn is a CPU path"):
        kernels.resolve("onednn", torch.device("cuda"))
    with pytest.raises(ConfigError, match="unknown kernel"):
        kernels.resolve("fast", CPU)


def test_a_copied_or_reloaded_layer_computes_with_its_own_weights():
    """Drafts are built by deep-copying the target's layers and loading trained weights into
    them: the packed weight must follow (a stale one cost Leviathan its acceptance)."""
    import copy

    m = tiny_llama(seed=0)
    kernels.apply(m, "onednn")
    layer = m.model.layers[0].mlp.up_proj
    x = torch.randn(3, 64)
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.mul_(2.0)  # in place, as load_state_dict does
    with torch.inference_mode():
        assert torch.allclose(twin(x), 2 * layer(x), atol=1e-5)
        other = tiny_llama(seed=5).model.layers[0].mlp.up_proj
        twin.load_state_dict(other.state_dict())
        assert torch.allclose(twin(x), torch.nn.functional.linear(x, other.weight), atol=1e-5)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight), atol=1e-5)
