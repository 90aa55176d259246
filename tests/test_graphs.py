"""``compile=graphs`` (``specbench.decode.graphs``): the target's decode and verify forwards at
static shapes over fixed buffers, traced whole (``fullgraph``) on the CPU and captured as CUDA graphs
on a GPU. Greedy output is the eager engine's; after the warm-up no graph is made and nothing
recompiles, with rows leaving the batch."""

import tempfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from specbench import audit
from specbench.decode.engine import Engine
from specbench.decode.graphs import GraphCache, bucket, pool_of
from specbench.decode.timing import PhaseTimer
from specbench.decode.verify import Sampling
from specbench.errors import ConfigError


@pytest.fixture(scope="module")
def tiny():
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, tok = audit._tiny_target(folder / "target")
        yield model, tok, folder


def make(name, model, tok, folder, device="cpu"):
    return audit.tiny_proposer(name, model, tok, folder, device)


def prompts_of(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def generate(model, prop, prompts, n, eos=(), pool=None, device="cpu"):
    dev = torch.device(device)
    eng = Engine(model, prop, Sampling(), dev, torch.float32, set(eos), PhaseTimer(dev), graphs=pool)
    return [r.tokens for r in eng.generate(prompts, n)]


def test_buckets_are_powers_of_two_within_the_rows():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 9, 64, 65)] == [1, 2, 4, 4, 8, 16, 64, 128]
    assert bucket(3, cap=3) == 3 and bucket(1, cap=3) == 1


@pytest.mark.parametrize("name", ["ar", "pld", "eagle"])
@pytest.mark.parametrize("bs", [1, 4])
def test_graphs_decode_as_eager_and_compile_nothing_after_the_warm_up(tiny, name, bs):
    """50 steps (AR: 50 tokens a row), rows leaving at an EOS one by one; the second batch (other
    prompts) meets only the buckets the first batch and ``warm`` met: no graph made, no recompile."""
    model, tok, folder = tiny
    model._specbench_graphs = None
    first, second = prompts_of([5, 9, 12, 7][:bs], 0), prompts_of([11, 6, 8, 10][:bs], 1)
    ref = generate(model, make(name, model, tok, folder), second, 50)
    eos = {ref[0][len(ref[0]) // 3]}  # the first row leaves a third of the way in, the others when they meet it
    ref = generate(model, make(name, model, tok, folder), second, 50, eos)
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    prop = make(name, model, tok, folder)
    generate(model, prop, first, 50, eos, pool)  # the warm-up batch
    pool.warm(bs, 4)
    made, graphs = pool.made, counters["stats"]["unique_graphs"]
    got = generate(model, make(name, model, tok, folder), second, 50, eos, pool)
    assert got == ref
    assert any(len(r) < 50 for r in got) or bs == 1  # rows left early
    assert pool.made == made and counters["stats"]["unique_graphs"] == graphs


def test_a_forward_past_the_buffers_is_refused(tiny):
    model, tok, folder = tiny
    model._specbench_graphs = None
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    cache = GraphCache(model, torch.device("cpu"), torch.float32, pool)
    with torch.inference_mode():
        cache.prefill([[5, 6, 7]], room=4)
        n = pool.width  # wider than the room left
        with pytest.raises(ConfigError, match="passes the cache"):
            cache.forward(torch.ones(1, n, dtype=torch.long), torch.arange(n)[None], None)
        with pytest.raises(ConfigError, match="static batches"):
            cache.add_rows(cache)


def test_the_settings_that_graphs_cannot_run_are_refused():
    from specbench.models import check_compile

    check_compile("graphs", "torch")
    with pytest.raises(ConfigError, match="add kernel=torch"):
        check_compile("graphs", "native")
    with pytest.raises(ConfigError, match="true, false or graphs"):
        check_compile("graph", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_eager_tokens(tiny):
    model, tok, folder = tiny
    model.to("cuda")
    try:
        model._specbench_graphs = None
        prompts = prompts_of([5, 9, 12], 2)
        for name in ("ar", "pld", "eagle"):
            ref = generate(model, make(name, model, tok, folder, "cuda"), prompts, 32, device="cuda")
            pool = pool_of(model, torch.device("cuda"), torch.float32)
            got = generate(model, make(name, model, tok, folder, "cuda"), prompts, 32, pool=pool, device="cuda")
            assert got == ref, name
    finally:
        model.to("cpu")
