"""Verification rules on hand-built trees, KV commit of a tree path, and statistical tests
that sampled speculative decoding follows the target distribution."""

import itertools

import pytest
import torch

from helpers import DEVICE, cfg_for, chi2_pvalue, run_engine, tiny_llama
from specbench.methods.leviathan import Leviathan
from specbench.decode.tree import Draft, tree_geometry
from specbench.decode.kv import RaggedCache
from specbench.models import self_layers_draft
from specbench.decode.verify import Sampling, verify, warp

V = 12


def peaked(ids, V=V):
    """Logits [len(ids), V] whose argmax at node i is ids[i]."""
    x = torch.randn(len(ids), V) * 0.1
    for i, t in enumerate(ids):
        x[i, t] = 5.0
    return x


def test_tree_geometry():
    depth, anc = tree_geometry(torch.tensor([[0, 0, 2, 2, 3]]))
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert anc[0, 5].nonzero().flatten().tolist() == [0, 2, 3, 5]
    assert anc[0, 4].nonzero().flatten().tolist() == [0, 2, 4]


def test_tree_geometry_matches_a_walk_down_the_parents():
    """Random trees (a deep chain among them, where the closure needs every squaring): each
    node's ancestors are what following its parent pointers reaches, its depth their count."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 31, 64):
        par = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                      torch.randint(0, 10**6, (n - 1,), generator=g) % torch.arange(2, n + 1)])
                           for _ in range(3)] + [torch.arange(n)])  # the last row: one chain of n
        depth, anc = tree_geometry(par)
        for b in range(par.shape[0]):
            for i in range(n + 1):
                path, j = {i}, i
                while j:
                    j = int(par[b, j - 1])
                    path.add(j)
                assert set(anc[b, i].nonzero().flatten().tolist()) == path, (n, b, i)
                assert int(depth[b, i]) == len(path) - 1


def test_a_drafts_geometry_is_its_parents_once():
    """The engine's mask and the verification's walk share one ``tree_geometry`` per draft."""
    d = Draft(tokens=torch.tensor([[4, 5, 7, 8, 1]]), parents=torch.tensor([[0, 0, 2, 2, 3]]))
    depth, anc = d.geometry()
    ref = tree_geometry(d.parents)
    assert torch.equal(depth, ref[0]) and torch.equal(anc, ref[1])
    assert d.geometry()[1] is anc  # computed once
    assert Draft(tokens=d.tokens, parents=torch.tensor([[0, 1, 2, 3, 4]])).geometry()[0].tolist() == [[0, 1, 2, 3, 4, 5]]


def test_greedy_tree_walk():
    # root -> {1:4, 2:5}; 2 -> {3:7, 4:8}; 3 -> {5:1}
    d = Draft(tokens=torch.tensor([[4, 5, 7, 8, 1]]), parents=torch.tensor([[0, 0, 2, 2, 3]]))
    logits = peaked([5, 0, 7, 9, 0, 0])[None]  # argmax: root 5, node2 7, node3 9
    v = verify(logits, d, Sampling(), None)
    assert v.accepted == [[5, 7]]
    assert v.counts.tolist() == [3]
    assert v.keep[0, :3].tolist() == [0, 2, 3]
    assert v.extra.tolist() == [9]  # node 3's child (1) is wrong: correction from node 3


def test_greedy_tree_list_walk_gives_the_tensor_walks_verdict(monkeypatch):
    """Small trees on the DEVICE are walked on lists; the vectorised walk (taken beyond
    ``LIST_WALK`` nodes) must give the same greedy verdict: random trees, rows and invalid nodes,
    a small vocabulary so that many nodes match and ties in depth occur."""
    import specbench.decode.walk as W

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 6, 15, 40):
        for _ in range(20):
            B = 3
            par = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long),
                                          torch.randint(0, 10**6, (n - 1,), generator=g) % torch.arange(2, n + 1)])
                               for _ in range(B)])
            d = Draft(tokens=torch.randint(0, 3, (B, n), generator=g), parents=par,
                      valid=torch.rand(B, n, generator=g) < 0.9)
            logits = torch.randn(B, n + 1, 3, generator=g)
            monkeypatch.setattr(W, "LIST_WALK", 10**9)
            a = verify(logits, d, Sampling(), None)
            monkeypatch.setattr(W, "LIST_WALK", 0)
            b = verify(logits, d, Sampling(), None)
            assert torch.equal(a.counts, b.counts) and a.accepted == b.accepted and torch.equal(a.extra, b.extra)
            for r in range(B):
                c = int(a.counts[r])
                assert a.keep[r, :c].tolist() == b.keep[r, :c].tolist(), (n, r)


def test_greedy_invalid_nodes_never_accepted():
    d = Draft(tokens=torch.tensor([[5, 7]]), parents=torch.tensor([[0, 1]]),
              valid=torch.tensor([[True, False]]))
    v = verify(peaked([5, 7, 3])[None], d, Sampling(), None)
    assert v.accepted == [[5]] and v.extra.tolist() == [7]
    d.candidate = torch.tensor([[False, True]])
    d.valid = None
    v = verify(peaked([5, 7, 3])[None], d, Sampling(), None)
    assert v.accepted == [[]] and v.extra.tolist() == [5]


@pytest.mark.parametrize("mover", ["torch", "extension"])
def test_tree_commit_matches_recompute(mover, monkeypatch):
    """After committing a tree path, the cache continues exactly as a fresh forward; the slots
    moved by torch's indexing per layer or by the extension's ``move_slots`` for all layers."""
    from specbench.decode import kv
    from specbench.kernels import extension

    if mover == "torch":
        monkeypatch.setattr(kv, "slot_mover", lambda tensors: None)
    elif extension.unavailable() is not None:
        pytest.skip(f"native extension: {extension.unavailable()}")
    else:
        extension.load()  # loaded: the cache's commit takes move_slots
        used = []
        real = kv.slot_mover
        monkeypatch.setattr(kv, "slot_mover", lambda tensors: used.append(1) or real(tensors))
    m = tiny_llama(seed=2)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    c = RaggedCache(m, DEVICE, torch.float32)
    c.prefill(prompts)
    # two rows, tree root -> {a, b}; b -> {c}; keep root, b, c for row 0 and root, a for row 1
    toks = torch.tensor([[20, 21, 22, 23], [30, 31, 32, 33]])
    parents = torch.tensor([[0, 0, 2], [0, 0, 2]])
    depth, anc = tree_geometry(parents)
    c.forward(toks, depth, anc)
    c.commit(torch.tensor([[0, 2, 3], [0, 1, 0]]), torch.tensor([3, 2]))
    nxt = torch.tensor([[40], [41]])
    got = c.forward(nxt, torch.zeros(2, 1, dtype=torch.long), None, logits_to_keep=1).logits[:, -1]
    seqs = [prompts[0] + [20, 22, 23, 40], prompts[1] + [30, 31, 41]]
    for b, s in enumerate(seqs):
        want = m(torch.tensor([s])).logits[0, -1]
        assert torch.allclose(got[b], want, atol=1e-5), (b, (got[b] - want).abs().max())
    if mover == "extension":  # the extension moved the slots
        assert used and real([torch.zeros(1, 1, 1, 4)]) is not None


# ----------------------------------------------------------------------- sampling
S = Sampling(temperature=1.0)


def first_token_counts(logits_root, draft_fn, n=6000, seed=0):
    """Empirical distribution of the first emitted token over n independent verifications."""
    g = torch.Generator().manual_seed(seed)
    d = draft_fn(n, g)
    logits = logits_root.expand(n, d.n + 1, V).clone()
    v = verify(logits, d, S, g)
    first = torch.tensor([a[0] if a else int(e) for a, e in zip(v.accepted, v.extra.tolist())])
    return torch.bincount(first, minlength=V)


@pytest.fixture(scope="module")
def pq():
    g = torch.Generator().manual_seed(7)
    p_logits = torch.randn(V, generator=g) * 1.5
    q_logits = torch.randn(V, generator=g) * 1.5
    return p_logits, q_logits


def chain_with_q(q_logits):
    def fn(n, g):
        q = torch.softmax(q_logits, -1)
        x = torch.multinomial(q.expand(n, V), 1, generator=g)
        return Draft.chain(x, q=q.expand(n, 1, V).clone())
    return fn


def test_chain_sampling_is_lossless(pq):
    p_logits, q_logits = pq
    counts = first_token_counts(p_logits[None, None], chain_with_q(q_logits))
    assert chi2_pvalue(counts, torch.softmax(p_logits, -1)) > 1e-3


@pytest.mark.parametrize("with_q", [True, False])
def test_two_token_chain_sampling_is_lossless(pq, with_q):
    """Chains of two drafts (with q: Leviathan; without: deterministic candidates), a third
    of the rows with only the first draft valid: the first emitted token follows p_a, and
    the second, in rows that accepted the first draft, follows p_b (the target at node 1)."""
    p_logits, q_logits = pq
    g0 = torch.Generator().manual_seed(3)
    pb_logits = torch.randn(V, generator=g0) * 1.5
    n = 12000
    g = torch.Generator().manual_seed(11)
    q = torch.softmax(q_logits, -1)
    if with_q:
        x = torch.multinomial(q.expand(n, V), 2, replacement=True, generator=g)
        d = Draft.chain(x, q=q.expand(n, 2, V).clone())
    else:  # the target's two likeliest tokens: accepted often, rejected often enough
        top = torch.topk(p_logits, 2).indices
        x = top[torch.randint(0, 2, (n, 2), generator=g)]
        d = Draft.chain(x)
    d.valid = torch.ones(n, 2, dtype=torch.bool)
    d.valid[: n // 3, 1] = False
    logits = torch.stack([p_logits, pb_logits, p_logits])[None].expand(n, 3, V).clone()
    v = verify(logits, d, S, g)
    ex = v.extra.tolist()
    first = torch.tensor([a[0] if a else e for a, e in zip(v.accepted, ex)])
    assert chi2_pvalue(torch.bincount(first, minlength=V), torch.softmax(p_logits, -1)) > 1e-3
    second = torch.tensor([a[1] if len(a) > 1 else e for a, e in zip(v.accepted, ex) if a])
    assert len(second) > 2000
    assert chi2_pvalue(torch.bincount(second, minlength=V), torch.softmax(pb_logits, -1)) > 1e-3
    assert all(len(a) <= (1 if b < n // 3 else 2) for b, a in enumerate(v.accepted))


def test_statistic_detects_a_lossy_rule(pq):
    """The test has power: the draft's own distribution (what 'accept everything' emits)
    is rejected at the same sample size."""
    p_logits, q_logits = pq
    g = torch.Generator().manual_seed(1)
    x = torch.multinomial(torch.softmax(q_logits, -1), 6000, replacement=True, generator=g)
    assert chi2_pvalue(torch.bincount(x, minlength=V), torch.softmax(p_logits, -1)) < 1e-6


def test_tree_deterministic_candidates_lossless(pq):
    p_logits, _ = pq
    top = torch.topk(p_logits, 3).indices.tolist()
    cands = [top[1], 3 if 3 not in top else 4, top[0]]  # three children of the root, no q

    def fn(n, g):
        return Draft(tokens=torch.tensor([cands] * n), parents=torch.zeros(n, 3, dtype=torch.long))

    counts = first_token_counts(p_logits[None, None], fn)
    assert chi2_pvalue(counts, torch.softmax(p_logits, -1)) > 1e-3


def test_two_level_tree_of_candidates_is_lossless_with_one_host_sync(pq, monkeypatch):
    """Root children [a, c, a(again), b] (a repeated sibling can never pass twice), a's children
    [a2, d] one level down, one row in four with b invalid: the first token follows p at the
    root and, where a was accepted, the second follows p at a. The walk reads the device once."""
    p_logits, q_logits = pq
    g0 = torch.Generator().manual_seed(5)
    pa_logits = torch.randn(V, generator=g0) * 1.5
    top = torch.topk(p_logits, 3).indices.tolist()
    a, b, c = top[0], top[1], 3 if 3 not in top else 4
    ta = torch.topk(pa_logits, 2).indices.tolist()
    n = 12000
    toks = torch.tensor([[a, c, a, b, ta[0], ta[1]]] * n)
    parents = torch.tensor([[0, 0, 0, 0, 1, 1]] * n)
    valid = torch.ones(n, 6, dtype=torch.bool)
    valid[: n // 4, 3] = False
    d = Draft(tokens=toks, parents=parents, valid=valid)
    logits = torch.stack([p_logits, pa_logits, p_logits, p_logits, p_logits, p_logits, p_logits])
    logits = logits[None].expand(n, 7, V).clone()
    g = torch.Generator().manual_seed(2)
    p_all = __import__("specbench.decode.verify", fromlist=["warp"]).warp(logits, S)
    syncs = []
    for name in ("tolist", "item", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *x, _r=real, _n=name: syncs.append(_n) or _r(self, *x))
    from specbench.decode.verify import _sampled_tree

    v = _sampled_tree(p_all, d, g)
    assert syncs == ["tolist"]
    monkeypatch.undo()
    ex = v.extra.tolist()
    first = torch.tensor([x[0] if x else e for x, e in zip(v.accepted, ex)])
    assert chi2_pvalue(torch.bincount(first, minlength=V), torch.softmax(p_logits, -1)) > 1e-3
    second = torch.tensor([x[1] if len(x) > 1 else e for x, e in zip(v.accepted, ex) if x and x[0] == a])
    assert len(second) > 2000
    assert chi2_pvalue(torch.bincount(second, minlength=V), torch.softmax(pa_logits, -1)) > 1e-3
    assert all(x[:1] != [b] for x in v.accepted[: n // 4])  # an invalid node is never accepted


def test_tree_sampled_siblings_without_replacement_lossless(pq):
    p_logits, q_logits = pq
    q = torch.softmax(q_logits, -1)

    def fn(n, g):
        toks, qs = [], []
        for _ in range(n):
            qq = q.clone()
            row_t, row_q = [], []
            for _ in range(3):
                row_q.append(qq.clone())
                x = int(torch.multinomial(qq, 1, generator=g))
                row_t.append(x)
                qq[x] = 0
                qq = qq / qq.sum()
            toks.append(row_t)
            qs.append(torch.stack(row_q))
        return Draft(tokens=torch.tensor(toks), parents=torch.zeros(n, 3, dtype=torch.long), q=torch.stack(qs))

    counts = first_token_counts(p_logits[None, None], fn, n=4000)
    assert chi2_pvalue(counts, torch.softmax(p_logits, -1)) > 1e-3


def test_warp_chunks_top_p_rows_and_gives_the_same_probabilities(monkeypatch):
    """top-p over many rows goes through in chunks (bounded temporaries), with the result of
    one pass over all rows."""
    import specbench.decode.verify as V

    logits = torch.randn(3, 7, 50, generator=torch.Generator().manual_seed(0)) * 3
    s = Sampling(0.8, top_k=0, top_p=0.6)
    whole = V.warp(logits, s)
    calls = []
    real = V._warp
    monkeypatch.setattr(V, "_warp", lambda x, s_: calls.append(x.shape[0]) or real(x, s_))
    monkeypatch.setattr(V, "WARP_CHUNK_BYTES", 24 * 50 * 4)  # 4 rows a chunk
    chunked = V.warp(logits, s)
    assert calls == [4, 4, 4, 4, 4, 1] and chunked.shape == whole.shape
    assert torch.equal(chunked, whole)


def test_warp_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    p = warp(logits, Sampling(1.0, top_k=2))
    assert p[2] == 0 and p[3] == 0 and torch.isclose(p.sum(), torch.tensor(1.0))
    p = warp(logits, Sampling(1.0, top_p=0.7))
    full = torch.softmax(logits, -1)
    assert p[0] > 0 and (p[1] > 0) == (full[0] < 0.7) and p[3] == 0


@torch.no_grad()
def exact_marginals(model, prompt, s: Sampling, steps=3):
    """Exact distributions of the 2nd and 3rd generated tokens by enumeration (over the model's
    whole vocabulary)."""
    V = model.config.vocab_size
    p1 = warp(model(torch.tensor([prompt])).logits[0, -1], s)
    seqs2 = torch.tensor([prompt + [a] for a in range(V)])
    p2c = warp(model(seqs2).logits[:, -1], s)  # [V, V] p(t2 | t1)
    m2 = p1 @ p2c
    pairs = list(itertools.product(range(V), range(V)))
    p3c = warp(model(torch.tensor([prompt + [a, b] for a, b in pairs])).logits[:, -1], s)
    w = torch.tensor([p1[a] * p2c[a, b] for a, b in pairs])
    m3 = w @ p3c
    return m2, m3


@pytest.mark.parametrize("s", [Sampling(1.0), Sampling(0.7, top_k=8, top_p=0.9)])
def test_leviathan_sampling_follows_target(s):
    """Many seeded rows of one prompt through the engine: the 2nd and 3rd tokens (drafted
    and verified) follow the target's exact marginals."""
    target = tiny_llama(seed=0, vocab=V, scale=3.0)
    draft = self_layers_draft(target, 1)
    prompt = [3, 5, 7, 9]
    n = 3000
    lev = Leviathan(cfg_for(K=2), target, None, DEVICE, torch.float32, draft_model=draft)
    res = run_engine(target, lev, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(11))
    m2, m3 = exact_marginals(target, prompt, s)
    c2 = torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V)
    c3 = torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V)
    assert sum(sum(r.accept_lens) for r in res) > n // 4  # drafts were accepted, not just resampled
    assert chi2_pvalue(c2, m2) > 1e-3
    assert chi2_pvalue(c3, m3) > 1e-3


def test_a_draft_with_a_narrower_output_layer():
    """Same tokenizer, fewer output rows (e.g. Qwen2.5-0.5B's 151936 vs a 7B's 152064):
    the missing ids get draft probability 0; greedy stays identical, sampling lossless."""
    from helpers import reference_greedy

    target = tiny_llama(seed=0, vocab=V, scale=3.0)
    draft = tiny_llama(seed=1, vocab=V, scale=3.0)
    narrow = torch.nn.Linear(draft.lm_head.in_features, V - 3, bias=False)
    with torch.no_grad():
        narrow.weight.copy_(draft.lm_head.weight[: V - 3])
    draft.lm_head = narrow
    prompt = [3, 5, 7, 9]
    lev = Leviathan(cfg_for(K=3), target, None, DEVICE, torch.float32, draft_model=draft)
    assert run_engine(target, lev, [prompt, prompt[:2]], 10)[0].tokens == reference_greedy(target, prompt, 10)
    n = 3000
    s = Sampling(1.0)
    res = run_engine(target, lev, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(3))
    m2, m3 = exact_marginals(target, prompt, s)
    assert sum(sum(r.accept_lens) for r in res) > n // 10
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


def test_sliding_window_read_from_a_multimodal_text_config():
    """Gemma 3 checkpoints with a vision tower keep layer_types in text_config: the ragged
    cache must still build the sliding-window mask."""
    from types import SimpleNamespace

    text = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=7)
    outer = SimpleNamespace(get_text_config=lambda: text)
    assert RaggedCache(SimpleNamespace(config=outer), DEVICE, torch.float32).window == 7
    assert RaggedCache(SimpleNamespace(config=text), DEVICE, torch.float32).window == 7
    plain = SimpleNamespace(get_text_config=lambda: SimpleNamespace(sliding_window=7))
    assert RaggedCache(SimpleNamespace(config=plain), DEVICE, torch.float32).window is None


def test_greedy_pick_is_torch_argmax():
    """The numpy path picks what torch.argmax picks: the first index on ties, any leading shape,
    strided views; other dtypes, devices and autograd keep torch's own argmax."""
    from specbench.decode.verify import greedy_pick

    g = torch.Generator().manual_seed(0)
    for shape in ((7,), (3, 50), (2, 5, 49152), (4, 9, 33)):
        x = torch.randint(0, 4, shape, generator=g).float()  # many ties
        assert torch.equal(greedy_pick(x), x.argmax(-1)), shape
        y = torch.randn(shape, generator=g)
        assert torch.equal(greedy_pick(y), y.argmax(-1)), shape
    z = torch.randn(3, 8, 40, generator=g)[:, 1:6:2]  # a strided view, as a verify's window slice
    assert torch.equal(greedy_pick(z), z.argmax(-1))
    with torch.inference_mode():
        w = torch.randn(2, 5, 30)
        assert torch.equal(greedy_pick(w), w.argmax(-1))
    b = torch.randint(0, 3, (4, 30), generator=g).to(torch.bfloat16)
    assert torch.equal(greedy_pick(b), b.argmax(-1))
    r = torch.randn(2, 30, requires_grad=True)
    assert torch.equal(greedy_pick(r), r.argmax(-1))
    assert greedy_pick(y).dtype == torch.long
