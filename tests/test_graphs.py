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


# the drafters' forwards (EAGLE's steps, DFlash's and DSpark's block and context, P-EAGLE's step,
# the draft models of Leviathan, SpecDec and MTP) are captured too: at bs 4 only, beside the issue's
# AR, PLD and EAGLE at bs 1 and 4
DRAFTERS = {"eagle", "dflash", "dspark", "peagle", "leviathan", "specdec", "mtp"}
CASES = [(name, bs) for name in ("ar", "pld", "eagle") for bs in (1, 4)] + [(n, 4) for n in sorted(DRAFTERS - {"eagle"})]


@pytest.mark.parametrize("name,bs", CASES)
def test_graphs_decode_as_eager_and_compile_nothing_after_the_warm_up(tiny, name, bs):
    """50 steps (AR: 50 tokens a row), rows leaving at an EOS one by one; the second batch (other
    prompts, the same method, as a job's timed batches follow its warm-up) meets only the buckets
    the first batch and ``warm`` met: no graph made, no recompile."""
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
    drafted = pool.drafts.made
    assert (drafted > 0) == (name in DRAFTERS)  # the drafter's forwards are graphs too
    got = generate(model, prop, second, 50, eos, pool)
    assert got == ref
    assert any(len(r) < 50 for r in got) or bs == 1  # rows left early
    assert pool.made == made and counters["stats"]["unique_graphs"] == graphs
    assert pool.drafts.made == drafted


def test_a_replayed_drafter_forward_is_model_time_and_its_timers_stay_out_of_the_graph(tiny):
    """The drafter's methods are wrapped by the phase timer (model time, whatever the entry); a
    graph made from them holds no timer call, and its replay is charged as one forward."""
    model, tok, folder = tiny
    model._specbench_graphs = None
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    prop = make("eagle", model, tok, folder)
    timer = PhaseTimer(torch.device("cpu"))
    eng = Engine(model, prop, Sampling(), torch.device("cpu"), torch.float32, set(), timer, graphs=pool)
    with timer.watching([model, prop.drafter]):
        eng.generate(prompts_of([5, 9], 3), 12)
        assert "step" in vars(prop.drafter)  # still wrapped once the graphs are made
    assert pool.drafts.graphs and timer._depth == 0
    assert timer.totals()["forward"] > 0


def test_a_drafter_cache_with_graphs_keeps_its_buffers_and_refuses_to_grow(tiny):
    from specbench.drafters.cache import DrafterCache

    model, tok, folder = tiny
    model._specbench_graphs = None
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    GraphCache(model, torch.device("cpu"), torch.float32, pool).prefill([[5, 6, 7], [8, 9]], room=8)
    owner = object()
    cache = DrafterCache(1, 2, 8, 2, torch.device("cpu"), torch.float32, 16, 6, graphs=pool, owner=owner)
    assert cache.fixed == pool.width and cache.width == pool.width + 6
    again = DrafterCache(1, 2, 8, 2, torch.device("cpu"), torch.float32, 16, 6, graphs=pool, owner=owner)
    assert again.keys[0].data_ptr() == cache.keys[0].data_ptr()  # the job's buffers, batch after batch
    ptr = cache.keys[0].data_ptr()
    cache.select_rows([1])
    assert cache.keys[0].data_ptr() == ptr and cache.keys[0].shape[0] == 1  # rows leave in place
    kv = torch.ones(1, 2, 1, 8)
    cache.append([(kv, kv)], torch.ones(1, dtype=torch.long), [1])
    assert cache.upto() == cache.fixed and cache.visible(1).shape == (1, 1, pool.width)
    with pytest.raises(ConfigError, match="compile=graphs"):
        cache.scratch(7)  # past the scratch room the method asked for
    with pytest.raises(ConfigError, match="static batches"):
        cache.add_rows(again)


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
    with pytest.raises(ConfigError, match=r"not kernel=auto \(native here\)"):  # what the user set, and what it meant
        check_compile("graphs", "native", "auto")
    with pytest.raises(ConfigError, match="true, false or graphs"):
        check_compile("graph", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_eager_tokens(tiny):
    model, tok, folder = tiny
    model.to("cuda")
    try:
        model._specbench_graphs = None
        prompts = prompts_of([5, 9, 12], 2)
        for name in ("ar", "pld", *sorted(DRAFTERS)):
            ref = generate(model, make(name, model, tok, folder, "cuda"), prompts, 32, device="cuda")
            pool = pool_of(model, torch.device("cuda"), torch.float32)
            prop = make(name, model, tok, folder, "cuda")
            first = generate(model, prop, prompts, 32, pool=pool, device="cuda")  # captures
            pool.warm(len(prompts), 4)
            again = generate(model, prop, prompts, 32, pool=pool, device="cuda")  # replays only
            assert first == ref and again == ref, name
            assert (pool.drafts.made > 0) == (name in DRAFTERS), name
            pool.close()
    finally:
        model.to("cpu")


def test_a_graph_of_the_same_shapes_made_with_other_hooks_is_never_replayed(tiny):
    """Pools one after another (jobs), the first without the hidden-state tap (AR's graph), the
    others with it: each traces its own graph and hands over the tapped states (dynamo, by default
    blind to hooks, replayed AR's graph for a tapped method, which found no states)."""
    from specbench.decode.hidden import Tap

    model, tok, folder = tiny
    cpu = torch.device("cpu")
    for names in [(), ("final",), ("final",)]:
        model._specbench_graphs = None
        pool = pool_of(model, cpu, torch.float32)
        cache = GraphCache(model, cpu, torch.float32, pool)
        with torch.inference_mode(), Tap(model, names) as tap:
            pool.tap = tap
            cache.prefill([[5, 6, 7], [8, 9, 10]], room=8)
            tap.take()
            cache.forward(torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), None)
            assert sorted(tap.out) == list(names)
        pool.close()


@pytest.mark.parametrize("name,pairing", [("eagle", "sweep"), ("dflash", "paired")])
def test_a_graphed_job_decodes_as_eager_with_no_graph_made_in_the_timing(tiny_dirs, tmp_path, name, pairing):
    """Through the runner (its warm-up, its timers on the drafter; paired: AR and the method in one
    job, sharing the pool): the same tokens as the eager job, every graph made before the timing,
    the drafter's among them, each run's own counted."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omegaconf import OmegaConf

    from helpers import tiny_cfg
    from specbench import methods
    from specbench.run import runner

    target = AutoModelForCausalLM.from_pretrained(tiny_dirs["target"], dtype=torch.float32)
    tiny_method = methods.get(name).tiny(target, AutoTokenizer.from_pretrained(tiny_dirs["target"]), tmp_path / name)
    method = {**OmegaConf.to_container(methods.settings(name)), **tiny_method["method"]}
    run = {"bs": 2, "kernel": "torch", "method": method, "max_new_tokens": 16, "model.name": "tiny",
           "ar_baseline": pairing}
    eager = runner.run(tiny_cfg(tiny_dirs, tmp_path, **run), sweep_id="e")
    graphed = runner.run(tiny_cfg(tiny_dirs, tmp_path, compile="graphs", warmup=True, **run), sweep_id="g")
    assert [r["status"] for r in graphed] == ["ok", "ok"], [r.get("error") for r in graphed]
    for e, g in zip(eager, graphed):
        assert [r["tokens"] for r in g["requests"]] == [r["tokens"] for r in e["requests"]]
        assert g["compile"] == "graphs" and g["metrics"]["compile"]["graphs_in_timing"] == 0
    assert [g["metrics"]["compile"]["drafter_graphs"] > 0 for g in graphed] == [False, True]
    assert graphed[1]["metrics"]["time_s"]["forward"] > 0


def test_a_draft_models_pool_is_sized_as_its_targets_from_the_first_batch(tiny):
    """A draft model's pool (``GraphPool.child``) takes the room the target's was reserved, rounded
    as the target's buffers are: a later, longer batch makes neither anew (inside the timing)."""
    model, tok, folder = tiny
    draft, _ = audit._tiny_target(folder / "draft")
    model._specbench_graphs = None
    cpu = torch.device("cpu")
    pool = pool_of(model, cpu, torch.float32)
    pool.reserve(2, 300)  # as the runner does before its warm-up
    with torch.inference_mode():
        GraphCache(model, cpu, torch.float32, pool).prefill([[5, 6, 7], [8, 9]], room=8)
        GraphCache(draft, cpu, torch.float32, pool.child(draft)).prefill([[5, 6, 7], [8, 9]], room=8)
    assert pool.width == pool.child(draft).width == 512 and pool.child(draft).rows == 2
    pool.close()
    assert not pool.children


@pytest.mark.parametrize("name", ["eagle", "leviathan"])
def test_a_graphed_runs_cache_bytes_count_the_targets_buffers_once(tiny, name):
    """On the CPU a run's peak counts the target's KV cache (the engine's) and the method's own
    tensors (``held_bytes``): with graphs the method's drafter buffers or its draft model's pool,
    never the target's pool again through them (the drafter's cache and the draft's pool point at it)."""
    from specbench.decode.memory import held_bytes

    model, tok, folder = tiny
    model._specbench_graphs = None
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    prop = make(name, model, tok, folder)
    generate(model, prop, prompts_of([5, 9, 12, 7], 4), 8, pool=pool)
    own = pool.owned_nbytes(prop)
    assert own > 0 and held_bytes(prop) <= own + 64 * 1024  # its buffers and its small per-row state
    pool.close()


def test_a_graphed_specdec_has_room_for_its_queries_past_a_long_prompt(tiny):
    """SpecDec's draft cache is made with room for the answers and a step's queries: prompts that
    end near the pool's 256-slot rounding (no reserve, as with warmup=false) decode as eager."""
    model, tok, folder = tiny
    model._specbench_graphs = None
    prompts = prompts_of([250, 240], 5)
    ref = generate(model, make("specdec", model, tok, folder), prompts, 8)
    pool = pool_of(model, torch.device("cpu"), torch.float32)
    assert generate(model, make("specdec", model, tok, folder), prompts, 8, pool=pool) == ref
    pool.close()
