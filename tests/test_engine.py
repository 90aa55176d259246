"""Greedy token identity of every method against plain decoding (fp32, tiny models)."""

import pytest
import torch

from helpers import DEVICE, greedy_cases, cfg_for, run_engine, tiny_llama
from specbench.methods.base import Proposer
from specbench.methods.leviathan import Leviathan
from specbench.methods.pld import NgramIndex, PromptLookup, lookup
from specbench.methods.reject import Reject
from specbench.decode.tree import Draft
from specbench.models import self_layers_draft

N_NEW = 24


class OracleTree(Proposer):
    """Test-only tree proposer: per row a tree whose branches mix the true greedy
    continuation (known from a reference run) with wrong tokens, in varying places, so
    that acceptance walks different branches at different depths."""

    name = "oracle_tree"

    def __init__(self, model, truth: dict, seed=0):
        super().__init__(cfg_for(), model, None, DEVICE, torch.float32)
        self.truth = truth  # tuple(prompt) -> full greedy continuation
        self.g = torch.Generator().manual_seed(seed)

    def propose(self, state):
        rows_tok, rows_par = [], []
        for seq, plen in zip(state.seqs, state.prompt_lens):
            cont = self.truth[tuple(seq[:plen])]
            done = len(seq) - plen
            right = cont[done:done + 4]
            wrong = [(t + 7) % 90 + 3 for t in right]
            # root -> [wrong0, right0]; right0 -> [right1, wrong1]; right1 -> right2 -> [wrong3, right3]
            cut = int(torch.randint(0, 4, (1,), generator=self.g))  # corrupt the true path here
            path = [r if i != cut else w for i, (r, w) in enumerate(zip(right, wrong))]
            toks = [wrong[0], path[0], path[1], wrong[1], path[2], wrong[3], path[3]] if len(right) == 4 else []
            pars = [0, 0, 2, 2, 3, 5, 5] if toks else []
            rows_tok.append(toks)
            rows_par.append(pars)
        n = max(len(t) for t in rows_tok)
        if n == 0:
            return None
        B = len(rows_tok)
        tokens = torch.zeros(B, n, dtype=torch.long)
        parents = torch.arange(n)[None].repeat(B, 1)
        valid = torch.zeros(B, n, dtype=torch.bool)
        for b, (t, p) in enumerate(zip(rows_tok, rows_par)):
            tokens[b, :len(t)] = torch.tensor(t)
            parents[b, :len(p)] = torch.tensor(p)
            valid[b, :len(t)] = True
        return Draft(tokens=tokens, parents=parents, valid=valid)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def cases(model):
    return greedy_cases(model, N_NEW + 8)


def make(name, model, truth):
    if name == "ar":
        return None
    if name == "pld":
        return PromptLookup(cfg_for(K=3), model, None, DEVICE, torch.float32)
    if name == "leviathan_self":
        return Leviathan(cfg_for(K=3), model, None, DEVICE, torch.float32, draft_model=self_layers_draft(model, 1))
    if name == "leviathan_other":
        return Leviathan(cfg_for(K=5), model, None, DEVICE, torch.float32, draft_model=tiny_llama(seed=3, scale=4.0))
    if name == "oracle_tree":
        return OracleTree(model, truth)
    if name == "reject":
        return Reject(cfg_for(K=2, method={"name": "reject", "token": 5}), model, None, DEVICE, torch.float32)
    raise KeyError(name)


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("name", ["ar", "pld", "leviathan_self", "leviathan_other", "oracle_tree", "reject"])
def test_greedy_identity(model, cases, name, bs):
    prompts, refs = cases[bs]
    truth = {tuple(p): r for p, r in zip(prompts, refs)}
    res = run_engine(model, make(name, model, truth), prompts, N_NEW)
    for r, ref in zip(res, refs):
        assert r.tokens == ref[:N_NEW]
        assert len(r.accept_lens) == r.steps
    if name == "oracle_tree":  # the tree path was really walked, several nodes deep
        assert max(max(r.accept_lens) for r in res) >= 3
        assert sum(sum(r.accept_lens) for r in res) > sum(r.steps for r in res)


def test_eos_ends_each_row_alone(model, cases):
    prompts, refs = cases[4]
    eos = refs[1][5]  # a token row 1 emits early
    for prop in (None, PromptLookup(cfg_for(K=3), model, None, DEVICE, torch.float32)):
        res = run_engine(model, prop, prompts, N_NEW, eos={eos})
        for r, ref in zip(res, refs):
            want = ref[:N_NEW]
            if eos in want:
                want = want[:want.index(eos) + 1]
            assert r.tokens == want
            assert r.hit_eos == (eos in ref[:N_NEW])


class OracleChain(Proposer):
    """Test-only: drafts the next K tokens of the true greedy continuation (all accepted)."""

    name = "oracle_chain"

    def __init__(self, model, truth: dict, K: int):
        super().__init__(cfg_for(), model, None, DEVICE, torch.float32)
        self.truth, self.K = truth, K

    def propose(self, state):
        rows = [self.truth[tuple(s[:p])][len(s) - p:len(s) - p + self.K] for s, p in zip(state.seqs, state.prompt_lens)]
        return Draft.from_lists(rows, DEVICE) if any(rows) else None


def test_accept_lens_count_only_kept_drafts(model, cases):
    """A step whose accepted drafts run past an EOS counts only the drafts it keeps (tau
    must not count tokens that were cut)."""
    prompts, refs = cases[1]
    truth = {tuple(p): r for p, r in zip(prompts, refs)}
    eos = refs[0][3]
    assert eos not in refs[0][:3]
    r = run_engine(model, OracleChain(model, truth, K=6), prompts, N_NEW, eos={eos})[0]
    assert r.tokens == refs[0][:4] and r.hit_eos
    # the first token comes from the prefill; one step accepted 6 drafts, kept 3 (up to the EOS)
    assert r.steps == 1 and r.accept_lens == [3]


def test_max_new_tokens_one(model, cases):
    prompts, refs = cases[4]
    res = run_engine(model, None, prompts, 1)
    assert [r.tokens for r in res] == [ref[:1] for ref in refs]


def test_rows_keep_what_they_accept(model, cases):
    """Rows accept different counts in the same step; none is cut to the batch minimum."""
    prompts, refs = cases[4]
    truth = {tuple(p): r for p, r in zip(prompts, refs)}
    res = run_engine(model, OracleTree(model, truth, seed=5), prompts, N_NEW)
    per_step = list(zip(*[r.accept_lens[:3] for r in res]))
    assert any(len(set(s)) > 1 for s in per_step)  # ragged acceptance happened
    for r, ref in zip(res, refs):
        assert r.tokens == ref[:N_NEW]


def test_pld_index_answers_as_the_scan():
    """The incremental n-gram index gives the scan's answer at every step of growing
    sequences (small vocabularies: many repeats, ties, EOS cuts)."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        vocab = 3 + trial % 6
        seq = torch.randint(0, vocab, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        max_n, min_n = 1 + trial % 4, 1 + (trial % 4 > 1)
        ix = NgramIndex(max_n, min_n)
        for _ in range(25):
            eos = {trial % vocab} if trial % 3 == 0 else set()
            assert ix.lookup(seq, 4, eos) == lookup(seq, 4, max_n, min_n, eos), (seq, max_n, min_n)
            seq = seq + torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()


def test_pld_lookup():
    seq = [1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]
    assert lookup(seq, 3, 3) == [4, 5, 1]  # earliest match of [1, 2, 3]
    assert lookup([5, 6, 7], 2, 3) == []
    assert lookup([4, 8, 4], 4, 2) == [8, 4]  # falls back to a 1-gram, continuation runs to the end


def test_slab_layer_keeps_what_a_concatenating_cache_keeps():
    """The engine's cache layer appends in place; under the RaggedCache's own edits (crop to a
    slice, drop left padding, select rows, move slots in place) it must hold exactly what
    torch.cat would."""
    from specbench.decode.slab import SlabLayer, narrow as _narrow

    g = torch.Generator().manual_seed(0)
    layer, keys, vals = SlabLayer(), None, None

    def new(n, b):
        return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)

    b, checked = 3, 0
    for step in range(40):
        k, v = new(1 + step % 5, b)
        got_k, got_v = layer.update(k, v)
        keys = k if keys is None else torch.cat([keys, k], 2)
        vals = v if vals is None else torch.cat([vals, v], 2)
        assert torch.equal(got_k, keys) and torch.equal(got_v, vals), step
        op = step % 4
        if op == 0:  # crop (as RaggedCache does it, or by hand: the layer finds its offset again)
            keep = max(1, keys.shape[2] - 2)
            if step % 8:
                _narrow(layer, 0, keep)
            else:
                layer.keys, layer.values = layer.keys[:, :, :keep], layer.values[:, :, :keep]
            keys, vals = keys[:, :, :keep], vals[:, :, :keep]
        elif op == 1 and keys.shape[2] > 3:  # drop left padding
            _narrow(layer, 1, None)
            keys, vals = keys[:, :, 1:], vals[:, :, 1:]
        if op < 2 and layer._span is not None:  # the offset _narrow kept is the buffer's own
            kept = layer._offset()
            layer.keys, layer.values = layer.keys, layer.values  # the same views, set from outside
            assert layer._span is None and kept == layer._offset() is not None, step
            checked += 1
        elif op == 2:  # move a slot in place
            layer.keys[0, :, 0] = layer.keys[0, :, -1]
            keys[0, :, 0] = keys[0, :, -1]
        elif op == 3 and step == 15:  # a row leaves the batch
            sel = torch.tensor([0, 2])
            layer.keys, layer.values = layer.keys[sel], layer.values[sel]
            keys, vals, b = keys[sel], vals[sel], 2
    assert layer._k.shape[2] < 4 * keys.shape[2] + 64  # grew by doubling, not per step
    assert checked >= 10


@pytest.mark.parametrize("aligned", [True, False])
def test_commit_all_keeps_what_commit_keeps(model, aligned):
    """``commit_all`` (a draft model's own step: every row keeps all its new slots) leaves the
    cache as ``commit`` with every node kept does: rows ending at the cache's end (no copy) and
    ragged rows (slots moved behind each prefix)."""
    from specbench.decode.kv import RaggedCache

    caches = [RaggedCache(model, DEVICE, torch.float32) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            c.prefill([[5, 6, 7, 8, 9], [10, 11, 12]])
            if not aligned:  # row 0 keeps 2 of 3 new nodes, row 1 all 3: they end apart
                toks = torch.tensor([[20, 21, 22], [30, 31, 32]])
                c.forward(toks, torch.arange(3)[None].expand(2, 3), None)
                c.commit(torch.arange(3)[None].expand(2, 3), torch.tensor([2, 3]))
        assert bool(((caches[0].start + caches[0].length) == caches[0].C).all()) == aligned
        step = torch.tensor([[40, 41], [50, 51]])
        for i, c in enumerate(caches):
            c.forward(step, torch.arange(2)[None].expand(2, 2), None)
            if i == 0:
                c.commit_all()
            else:
                c.commit(torch.arange(2)[None].expand(2, 2), torch.tensor([2, 2]))
        a, b = caches
        assert torch.equal(a.length, b.length) and torch.equal(a.start, b.start) and a.C == b.C
        for la, lb in zip(a.cache.layers, b.cache.layers):
            for rb in range(2):  # each row's committed slots
                s, e = int(a.start[rb]), int(a.start[rb] + a.length[rb])
                assert torch.equal(la.keys[rb, :, s:e], lb.keys[rb, :, s:e])
                assert torch.equal(la.values[rb, :, s:e], lb.values[rb, :, s:e])
        nxt = torch.tensor([[60], [70]])
        outs = [c.forward(nxt, torch.zeros(2, 1, dtype=torch.long), None).logits for c in caches]
        assert torch.allclose(outs[0], outs[1], atol=1e-6)


def test_cache_is_sized_once_per_batch_and_rows_leave_in_place(model):
    """With the batch's room given at prefill, no layer's buffer is ever replaced mid-batch
    (no doubling, no copy while the old one lives) and rows that leave are compacted inside the
    same storage; the rows that stay decode exactly as in a cache that never held the others."""
    from specbench.decode.kv import RaggedCache

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
    with torch.inference_mode():
        c = RaggedCache(model, DEVICE, torch.float32)
        c.prefill(prompts, room=12 + 4)
        ptrs = [(la._k.untyped_storage().data_ptr(), la._v.untyped_storage().data_ptr()) for la in c.cache.layers]
        caps = [la._k.shape[2] for la in c.cache.layers]
        assert caps == [5 + 16] * len(caps)
        ref = RaggedCache(model, DEVICE, torch.float32)  # rows 1 and 3 only, from the start
        ref.prefill([prompts[1], prompts[3]])
        kept = {0: 2, 1: 1, 2: 0, 3: 2}  # nodes each row keeps a step
        live = [0, 1, 2, 3]
        for step in range(6):
            for cache, rows in ((c, live), (ref, [1, 3])):
                toks = torch.tensor([[20 + step, 30 + step, 40 + step]] * len(rows))
                cache.forward(toks, torch.arange(3)[None].expand(len(rows), 3), None)
                cache.commit(torch.arange(3)[None].expand(len(rows), 3), torch.tensor([kept[r] for r in rows]))
            if step == 1:  # rows 0 and 2 finish
                c.select_rows(torch.tensor([1, 3]))
                live = [1, 3]
        assert [(la._k.untyped_storage().data_ptr(), la._v.untyped_storage().data_ptr())
                for la in c.cache.layers] == ptrs  # the same buffers throughout
        assert c.length.tolist() == ref.length.tolist()
        nxt = torch.tensor([[60], [70]])
        a = c.forward(nxt, torch.zeros(2, 1, dtype=torch.long), None).logits
        b = ref.forward(nxt, torch.zeros(2, 1, dtype=torch.long), None).logits
        assert torch.allclose(a, b, atol=1e-5)


def test_forward_nodes_are_the_verify_width_with_ragged_drafts(model):
    """At bs 8 PLD's drafts are ragged (rows find continuations of different lengths, or none), and
    every row runs the verify forward's width [B, n + 1] whatever it drafted: each step records, per
    row, the n nodes it ran (``nodes``: the record's ``forward_nodes``) and apart its own real ones
    (``valid_nodes``)."""
    prompts = [[5 + b, 6, 7, 8, 9, 5 + b, 6, 7] if b % 3 == 0 else [5 + b, 6 + b, 7, 8 + b] * (1 + b % 3)
               if b % 3 == 1 else [10 + 7 * j + b for j in range(6)] for b in range(8)]
    shapes = []
    hook = model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        res = run_engine(model, PromptLookup(cfg_for(K=4), model, None, DEVICE, torch.float32), prompts, 12)
    finally:
        hook.remove()
    verifies = shapes[1:]  # after the batch's prefill, one verify forward a step
    assert len(verifies) == max(r.steps for r in res)
    for s, (rows, width) in enumerate(verifies):
        live = [r for r in res if r.steps > s]  # a static batch: finished rows have left it
        assert rows == len(live)
        assert [r.nodes[s] for r in live] == [width - 1] * rows  # the width run, whatever the row drafted
        assert all(r.valid_nodes[s] <= width - 1 for r in live)
    assert any(v < n for r in res for v, n in zip(r.valid_nodes, r.nodes))  # the drafts were ragged
    assert any(v > 0 for r in res for v in r.valid_nodes)


class BadParents(Proposer):
    """Test-only: a two-node tree whose second node names itself as its parent, from step ``at`` on."""

    name = "bad_parents"

    def __init__(self, model, at: int):
        super().__init__(cfg_for(), model, None, DEVICE, torch.float32)
        self.at, self.steps = at, 0

    def propose(self, state):
        self.steps += 1
        B = len(state.seqs)
        par = [[0, 2 if self.steps >= self.at else 1]] * B
        return Draft(tokens=torch.full((B, 2), 5, device=DEVICE), parents=torch.tensor(par, device=DEVICE))


@pytest.mark.parametrize("at", [1, 3])
def test_a_draft_whose_parent_is_not_earlier_is_refused(model, cases, at):
    """On the batch's first step before the verify forward; later, with the step's one read (its
    geometry is clamped meanwhile, so no index goes out of range first)."""
    prompts, _ = cases[1]
    with pytest.raises(ValueError, match="must point to an earlier node"):
        run_engine(model, BadParents(model, at), prompts, 12)
