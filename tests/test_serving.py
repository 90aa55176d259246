"""serving.batching=continuous: requests join the running batch as rows finish. Every method stays
token-identical to plain greedy decoding with ragged prompts, rows joining and leaving in
every order (staggered starts, early EOS), arrivals spread in time and follow-up requests."""

from functools import partial

import pytest
import torch

import test_engine
import test_feature_methods
import test_search_methods
import test_training_free
from helpers import DEVICE, prompts_of, reference_greedy, serve_engine, tiny_llama
from specbench.methods.base import Proposer

N_NEW = 16
LENGTHS = [7, 3, 12, 5, 9, 4, 15]  # ragged; with concurrency 3, rows join three times or more


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def refs(model):
    prompts = prompts_of(LENGTHS, seed=11)
    return prompts, [reference_greedy(model, p, N_NEW) for p in prompts]


def block_drafter(name, model):
    """A random one-layer DFlash / DSpark drafter (rnn Markov head, confidence cut 0.3), a
    two-layer P-EAGLE one, or an MTP module (speculators' layout), for ``model``."""
    import tempfile
    from pathlib import Path

    import test_dflash
    import test_dspark
    import test_mtp
    import test_peagle

    folder = Path(tempfile.mkdtemp(prefix="specbench-")) / name
    if name == "mtp":
        return test_mtp.proposer(model, test_mtp.random_mtp(model, folder), DEVICE, K=3)
    if name == "peagle":
        return test_peagle.proposer(model, test_peagle.random_peagle(model, folder, depths=3), DEVICE)
    if name == "dflash":
        return test_dflash.proposer(model, test_dflash.random_dflash(model, folder, block=4, layers=1), DEVICE)
    return test_dspark.proposer(model, test_dspark.random_dspark(model, folder, block=4, layers=1, kind="rnn"), DEVICE,
                                threshold=0.3)


def make(name, model, truth, datastore):
    if name in ("dflash", "dspark", "peagle", "mtp"):
        return block_drafter(name, model)
    if name in ("ar", "pld", "leviathan_self", "leviathan_other", "oracle_tree", "reject"):
        return test_engine.make(name, model, truth)
    if name in ("eagle", "eagle_small_vocab", "medusa", "medusa_chain"):
        return test_feature_methods.make(name, model)
    if name in test_training_free.NAMES or name == "suffix_own":
        if name == "suffix_own":  # the request's own tree only: a row's drafts are its own
            return test_training_free.make("suffix", model, global_tree=False)
        return test_training_free.make(name, model)
    return test_search_methods.make(name, model, datastore)


cases = test_search_methods.cases  # the REST datastore fixture and what it indexes
datastore = test_search_methods.datastore


def cut(ref, eos):
    return ref[:ref.index(eos) + 1] if eos is not None and eos in ref else ref


@pytest.mark.parametrize("early_eos", [False, True])
@pytest.mark.parametrize("name", ["ar", "pld", "leviathan_self", "leviathan_other", "oracle_tree", "reject", "eagle",
                                  "eagle_small_vocab", "medusa", "medusa_chain", "lookahead", "lookahead_n2", "rest",
                                  "specdec", "sam", "sam_recycle", "suffix", "suffix_own", "recycle", "combo",
                                  "dflash", "dspark", "peagle", "mtp"])
def test_greedy_identity_with_rows_joining(model, refs, datastore, name, early_eos):
    prompts, want = refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}
    eos = want[2][4] if early_eos else None  # a token some rows emit early: they leave mid-batch
    prop = make(name, model, truth, datastore)
    res, eng = serve_engine(model, prop, prompts, N_NEW, concurrency=3, eos=() if eos is None else {eos})
    for r, ref in zip(res, want):
        assert r.tokens == cut(ref, eos)
        assert len(r.accept_lens) == r.steps
    # oracle_tree's drafts draw from one generator shared by the rows
    # Token Recycling's matrix and SuffixDecoding's global tree are shared by the rows (as their
    # papers share them across queries), and so are they in the methods that wrap them
    if name not in ("oracle_tree", "recycle", "sam_recycle", "suffix", "combo"):
        # a row's drafts depend on that row alone: its acceptance is what it is decoded alone, so a
        # joining row's method state (a drafter's cache, a pool, an index) was built right
        from helpers import run_engine

        for p, r in zip(prompts, res):
            alone = run_engine(model, make(name, model, truth, datastore), [p], N_NEW, eos=() if eos is None else {eos})
            assert r.accept_lens == alone[0].accept_lens
    assert max(b for _, b, _ in eng.trace) == 3  # the cap was reached and held
    assert sum(n for _, _, n in eng.trace) == sum(len(r.tokens) - 1 for r in res)  # every decoded token traced
    starts = sorted(r.t_admit for r in res)
    assert starts[3] > starts[0]  # later requests joined a running batch


def test_arrivals_wait_and_follow_ups_join(model):
    """Requests arriving later are not started before they arrive; a request added by
    ``on_done`` (a follow-up turn) joins too; an idle engine waits for the next arrival."""
    from specbench.decode.engine import Engine, Request, Requests
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    prompts = prompts_of([6, 4, 9], seed=3)
    arrivals = [0.0, 0.0, 0.3]  # the third arrives after the first two are done
    eng = Engine(model, Proposer(test_engine.cfg_for(), model, None, DEVICE, torch.float32), Sampling(), DEVICE,
                 torch.float32, set(), PhaseTimer(DEVICE))
    reqs = Requests([Request(i, p, a) for i, (p, a) in enumerate(zip(prompts, arrivals))])
    follow = prompts_of([5], seed=4)[0]

    def on_done(key, r, now):
        if key == 0:
            reqs.add(Request("0b", follow, now))

    out = eng.serve(reqs, 8, concurrency=2, on_done=on_done)
    assert set(out) == {0, 1, 2, "0b"}
    assert out[2].t_admit >= 0.3 and out[2].t_arrival == 0.3
    assert out["0b"].t_admit >= out[0].t_done
    for key, p in [(0, prompts[0]), (1, prompts[1]), (2, prompts[2]), ("0b", follow)]:
        assert out[key].tokens == reference_greedy(model, p, 8)


def test_a_method_with_row_state_and_no_add_rows_cannot_join_rows():
    class Stateful(Proposer):
        def start(self, state, hidden=None):
            self.rows = len(state.seqs)

    class Stateless(Proposer):
        pass

    assert not Stateful.joins_rows() and Stateless.joins_rows() and Proposer.joins_rows()
    from specbench.methods.eagle import Eagle
    from specbench.methods.lookahead import Lookahead

    assert Eagle.joins_rows() and Lookahead.joins_rows()


# ----------------------------------------------------------------------- chunked prefill
CHUNKED = ["ar", "pld", "leviathan_self", "eagle", "medusa", "lookahead", "specdec", "sam", "suffix_own"]


@pytest.mark.parametrize("batching", ["static", "continuous"])
@pytest.mark.parametrize("name", CHUNKED)
def test_chunked_prefill_is_token_identical_and_drafts_the_same(model, refs, datastore, name, batching):
    """prefill_chunk: each prompt prefilled alone in pieces of 4 tokens (1-4 pieces each), between
    decoding steps when rows are in flight. The tokens are greedy's, and every row drafts and
    accepts as with the whole-prompt prefill: the cache and the method's prompt state (a
    drafter's cache, EAGLE's and Medusa's features, an index) are the same."""
    from helpers import run_engine

    prompts, want = refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}

    def go(chunk):
        prop = make(name, model, truth, datastore)
        if batching == "static":
            return run_engine(model, prop, prompts, N_NEW, prefill_chunk=chunk)
        return serve_engine(model, prop, prompts, N_NEW, concurrency=3, prefill_chunk=chunk)[0]

    whole, pieces = go(None), go(4)
    for r, w, ref in zip(pieces, whole, want):
        assert r.tokens == ref
        assert r.accept_lens == w.accept_lens


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_prefill_any_piece_size(model, refs, chunk):
    prompts, want = refs
    res = test_feature_methods.make("eagle", model)
    out = serve_engine(model, res, prompts, N_NEW, concurrency=4, prefill_chunk=chunk)[0]
    assert [r.tokens for r in out] == want


def test_chunked_prefill_keeps_rows_decoding_between_pieces(model):
    """A long prompt joining a running batch is prefilled a piece at a time, and the row in
    flight decodes between the pieces (the separate prefill would stall it for the whole
    prompt). A static batch still starts decoding only once every prompt is in."""
    short, long_ = prompts_of([4, 60], seed=5)
    res, eng = serve_engine(model, None, [short, long_], N_NEW, concurrency=2, prefill_chunk=8)
    assert res[1].tokens == reference_greedy(model, long_, N_NEW)
    steps_before = sum(t < res[1].t_first for t in res[0].chunks)
    assert steps_before >= 5  # 60 tokens in pieces of 8 (the short prompt took 4 of the first 8)
    whole, eng2 = serve_engine(model, None, [short, long_], N_NEW, concurrency=2)
    assert sum(t < whole[1].t_first for t in whole[0].chunks) == 0  # together, in one padded forward

    from specbench.decode.engine import Engine
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    eng = Engine(model, Proposer(test_engine.cfg_for(), model, None, DEVICE, torch.float32), Sampling(), DEVICE,
                 torch.float32, set(), PhaseTimer(DEVICE), prefill_chunk=8)
    out = eng.generate([short, long_], N_NEW)
    assert min(t for t, _, _ in eng.trace) >= max(r.t_first for r in out)  # the static batch started together
    assert all(b == 2 for _, b, _ in eng.trace[:3])
    with pytest.raises(ValueError, match="prefill_chunk"):
        Engine(model, None, Sampling(), DEVICE, torch.float32, set(), PhaseTimer(DEVICE), prefill_chunk=0)


def _prefilled(model, prompts):
    """A ``RaggedCache`` of ``prompts`` prefilled together."""
    from specbench.decode.kv import RaggedCache

    c = RaggedCache(model, DEVICE, torch.float32)
    c.prefill(prompts)
    return c


def _one_step(c, toks):
    """One token per row on ``c`` (its logits), committed."""
    toks = torch.tensor(toks)[:, None]
    with torch.inference_mode():
        out = c.forward(toks, torch.zeros_like(toks), None).logits
    c.commit(torch.zeros(len(toks), 1, dtype=torch.long), torch.ones(len(toks), dtype=torch.long))
    return out


def test_add_rows_merges_several_caches_at_once(model):
    """``RaggedCache.add_rows(a, b)`` equals adding a then b: same rows, starts, lengths, and the
    next forward's logits."""
    ps = prompts_of([5, 9, 3, 7], seed=8)

    cache = partial(_prefilled, model)

    one = cache(ps[:1])
    one.add_rows(cache(ps[1:3]), cache(ps[3:]), room=10)
    two = cache(ps[:1])
    two.add_rows(cache(ps[1:3]), room=10)
    two.add_rows(cache(ps[3:]), room=10)
    assert one.start.tolist() == two.start.tolist() and one.length.tolist() == two.length.tolist()
    toks = torch.tensor([[3], [4], [5], [6]])
    depth = torch.zeros_like(toks)
    with torch.inference_mode():
        a, b = one.forward(toks, depth, None).logits, two.forward(toks, depth, None).logits
    assert torch.allclose(a, b, atol=1e-5)


def test_rows_join_in_place_where_the_buffers_have_room(model):
    """A row that leaves frees its buffer row; a narrower row joining later is written into it
    (no new buffers, the rows in flight not moved), and the batch computes what a cache rebuilt
    from scratch computes. A wider one rebuilds, with room for ``rows`` rows."""
    ps = prompts_of([9, 6, 8, 4, 12], seed=9)

    cache, step = partial(_prefilled, model), _one_step

    a = cache(ps[:3])
    a.add_rows(cache(ps[3:4]), room=8, rows=4)  # rebuilt, with a spare row: none yet (4 rows)
    assert a.cache.layers[0]._base[0].shape[0] == 4
    step(a, [5, 6, 7, 8])
    a.select_rows(torch.tensor([0, 2, 3]))  # row 1 leaves: its buffer row is spare
    ptr = a.cache.layers[0]._base[0].data_ptr()
    a.add_rows(cache(ps[1:2]), room=8)  # 6 tokens, narrower than the batch: in place
    assert a.cache.layers[0]._base[0].data_ptr() == ptr and a.batch_size == 4
    # the same rows, built from scratch
    b = cache([ps[0] + [5], ps[2] + [7], ps[3] + [8]])
    b.add_rows(cache(ps[1:2]), room=8)
    assert a.length.tolist() == b.length.tolist()
    assert torch.allclose(step(a, [1, 2, 3, 4]), step(b, [1, 2, 3, 4]), atol=1e-5)
    a.add_rows(cache(ps[4:]), room=8, rows=6)  # 12 tokens, wider than the batch: rebuilt
    assert a.cache.layers[0]._base[0].shape[0] == 6 and a.batch_size == 5
    b.add_rows(cache(ps[4:]), room=8)
    assert torch.allclose(step(a, [1, 2, 3, 4, 5]), step(b, [1, 2, 3, 4, 5]), atol=1e-5)


def test_a_wider_row_joins_in_place_into_the_slack_left_of_the_batch(model):
    """Buffers rebuilt with ``wider`` keep as many slots left of the batch as it is wide: a row up
    to twice as wide then joins in place (the window grows leftwards, the rows in flight get zeros
    there), and the batch computes what a cache built from scratch computes. Every slot outside
    what the rows attend to is poisoned with NaN first (the new buffers come filled with NaN, too),
    so a slot left unwritten shows."""
    ps = prompts_of([9, 6, 8, 4, 14], seed=10)

    cache, step = partial(_prefilled, model), _one_step

    a = cache(ps[:3])
    torch.use_deterministic_algorithms(True)  # empty tensors come filled with NaN
    try:
        a.add_rows(cache(ps[3:4]), room=8, rows=5, wider=True)
    finally:
        torch.use_deterministic_algorithms(False)
    layer = a.cache.layers[0]
    assert layer._span == (9, 9) and layer._base[0].shape[0] == 5
    for lay in a.cache.layers:  # poison what no row may read: the slack, the room, the spare row
        off, W = lay._span
        for t in lay._base:
            t[:, :, :off] = float("nan")
            t[:, :, off + W:] = float("nan")
            t[4:] = float("nan")
    b = cache(ps[:3])
    b.add_rows(cache(ps[3:4]), room=8)
    assert torch.allclose(step(a, [5, 6, 7, 8]), step(b, [5, 6, 7, 8]), atol=1e-5)
    ptr = layer._base[0].data_ptr()
    a.add_rows(cache(ps[4:]), room=8, rows=5, wider=True)  # 14 tokens, wider than the batch's 10
    assert a.cache.layers[0]._base[0].data_ptr() == ptr, "a joiner within the slack must not rebuild"
    assert a.C == 14 and a.cache.layers[0]._span == (5, 14)
    b.add_rows(cache(ps[4:]), room=8)
    assert a.start.tolist() == b.start.tolist() and a.length.tolist() == b.length.tolist()
    out = step(a, [1, 2, 3, 4, 5])
    assert not out.isnan().any()
    assert torch.allclose(out, step(b, [1, 2, 3, 4, 5]), atol=1e-5)



def test_a_follow_up_due_before_a_later_first_turn_is_admitted_first(model):
    """``Requests`` keeps arrival order when a follow-up is added: a turn-2 request ready now, with
    rows free, is not held behind a first turn that arrives seconds later."""
    from specbench.decode.engine import Engine, Request, Requests
    from specbench.decode.timing import PhaseTimer
    from specbench.decode.verify import Sampling

    q = Requests([Request("a", [5, 6], 0.0), Request("late", [7, 8], 6.5)])
    assert [r.key for r in q.take(1, 0.0)] == ["a"]
    q.add(Request("a2", [9], 2.0))
    assert q.next_arrival() == 2.0 and q.take(2, 2.5)[0].key == "a2"  # before today's fix: [] until 6.5
    prompts = prompts_of([6, 4], seed=3)
    eng = Engine(model, Proposer(test_engine.cfg_for(), model, None, DEVICE, torch.float32), Sampling(), DEVICE,
                 torch.float32, set(), PhaseTimer(DEVICE))
    reqs = Requests([Request(0, prompts[0], 0.0), Request(1, prompts[1], 1.5)])

    def on_done(key, r, now):
        if key == 0:
            reqs.add(Request("0b", prompts_of([5], seed=4)[0], now))

    out = eng.serve(reqs, 4, concurrency=2, on_done=on_done)
    assert out["0b"].t_admit < 1.5  # admitted as soon as it was due, not after request 1 arrived


def test_the_harness_work_between_turns_is_not_timed_as_the_engines(tiny_dirs, tmp_path, monkeypatch):
    """serving.batching=continuous: decoding an answer, hashing it and rendering the next turn (on_done) is
    the harness's work; a tokenizer whose decode sleeps 50 ms moves neither the wall nor accept."""
    import time as _time

    from specbench.run import runner
    from specbench.models import load_tokenizer
    from helpers import tiny_cfg

    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"serving.batching": "continuous"}, bs=2, limit=3, max_new_tokens=6, warmup=False,
                   **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1}})
    cls = type(load_tokenizer(cfg.model))
    plain = cls.decode
    calls = []

    def slow(self, *a, **k):
        calls.append(1)
        _time.sleep(0.05)
        return plain(self, *a, **k)

    monkeypatch.setattr(cls, "decode", slow)
    recs = runner.run(cfg, sweep_id="slow")
    for rec in recs:
        m = rec["metrics"]
        slept = 0.05 * len(rec["requests"])  # one decode per finished request (two turns each)
        assert m["time_s"]["accept"] < 0.5 * slept, (rec["method"], m["time_s"], slept)
        phases = sum(m["time_s"][p] for p in ("prefill", "draft", "verify", "accept"))
        assert m["wall_s"] < phases + 0.5 * slept, (rec["method"], m["wall_s"], phases, slept)
    assert calls


def test_a_row_leaving_moves_the_others_in_a_few_ops_per_layer_not_one_per_row(model):
    """select_rows gathers the rows that move in one op per layer and tensor (at bs 128 on a 32-layer
    model, a copy per moved row was ~8,000 small copies), and the batch computes what a cache built
    from the kept rows alone computes."""
    ps = prompts_of([9, 6, 8, 4, 12, 7, 5, 10], seed=12)
    a = _prefilled(model, ps)

    class Count(torch.overrides.TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        a.select_rows(torch.tensor([1, 2, 3, 4, 5, 6, 7]))  # row 0 leaves: 7 rows move
    layers = len(a.cache.layers)
    assert Count.n <= 12 * layers + 12, Count.n
    b = _prefilled(model, ps[1:])
    toks = [5, 6, 7, 8, 9, 10, 11]
    assert torch.allclose(_one_step(a, toks), _one_step(b, toks), atol=1e-5)


def test_a_rebuild_frees_each_old_layer_before_making_the_next(model):
    """A wider joiner rebuilds the buffers: each layer's old buffers are released before the next
    layer's are made, so the rebuild holds one layer twice at most, not the whole cache (about 2x the
    KV at the peak on a GPU)."""
    import weakref

    ps = prompts_of([5, 6, 4], seed=13)
    a = _prefilled(model, ps[:2])
    old = [weakref.ref(t) for layer in a.cache.layers for t in (layer._k, layer._v)]
    alive_at_alloc = []
    plain = torch.Tensor.new_empty

    def new_empty(self, *args, **kw):
        alive_at_alloc.append(sum(r() is not None for r in old))
        return plain(self, *args, **kw)

    wide = _prefilled(model, [list(range(3, 20))])  # 17 tokens: wider than the batch, so a rebuild
    torch.Tensor.new_empty = new_empty
    try:
        a.add_rows(wide, room=8, rows=3)
    finally:
        torch.Tensor.new_empty = plain
    L = len(a.cache.layers)
    assert len(alive_at_alloc) == 2 * L
    # when layer i's new buffers are made, only layers i.. still hold old ones (2 tensors each)
    assert alive_at_alloc == [2 * (L - i // 2) for i in range(2 * L)], alive_at_alloc
    assert all(r() is None for r in old)
