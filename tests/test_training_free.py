"""SAM-Decoding, Token Recycling and combo: token identity with plain greedy decoding (fp32,
tiny random models, bs 1 and 4, ragged prompts), losslessness under sampling, the suffix
automaton against brute force, the recycled matrix and tree, and combo's choice."""

import json
import random

import pytest
import torch
import test_search_methods
from helpers import DEVICE, chi2_pvalue, prompts_of, reference_greedy, run_engine, tiny_llama
from omegaconf import OmegaConf

from specbench.methods import combo as C
from specbench.methods import recycle as TR
from specbench.methods import sam as S
from specbench.methods import suffix as SX
from specbench.decode.verify import Sampling

N_NEW = test_search_methods.N_NEW
V = 12


def cfg(name, K=4, temperature=0.0, **m):
    base = {"recycle": {"topk": 8, "tree_size": 6, "tree": None, "warm": None},
            "sam": {"min_match": 1, "corpus": None, "corpus_tokens": 100000, "static_bias": 4, "fallback": "none",
                    "fallback_opts": {}},
            "suffix": {"max_depth": 12, "spec_factor": 1.0, "spec_offset": 1.0, "min_prob": 0.1, "tree": True,
                       "global_tree": True},
            "combo": {"of": ["pld", "suffix", "recycle"], "opts": {}, "prior": 0.5}}[name]
    return OmegaConf.create({"K": K, "sampling": {"temperature": temperature}, "method": {"name": name, **base, **m}})


model = test_search_methods.model  # the same tiny target and greedy cases (N_NEW tokens)
cases = test_search_methods.cases


@pytest.fixture(scope="module")
def corpus(model, cases, tmp_path_factory):
    """A .jsonl corpus of the target's own greedy continuations (word-level tokenizer), so the
    static automaton finds real matches."""
    from conftest import save_tiny_hf
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sam")
    tok = AutoTokenizer.from_pretrained(save_tiny_hf(root / "tok"))
    rows = [{"text": tok.decode(p + reference_greedy(model, p, 30))} for p in prompts_of([6, 9, 4, 7], seed=7)]
    for ps, refs in cases.values():
        rows += [{"text": tok.decode(p[-3:] + r[: N_NEW // 2])} for p, r in zip(ps, refs)]
    path = root / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path, tok


def make(name, model, corpus=None, **kw):
    if name == "recycle":
        return TR.TokenRecycling(cfg("recycle", **kw), model, None, DEVICE, torch.float32)
    if name == "sam":
        return S.SamDecoding(cfg("sam", **kw), model, None, DEVICE, torch.float32)
    if name == "sam_corpus":
        path, tok = corpus
        return S.SamDecoding(cfg("sam", corpus=str(path), min_match=2, **kw), model, tok, DEVICE, torch.float32)
    if name == "sam_recycle":
        return S.SamDecoding(cfg("sam", min_match=3, fallback="recycle", fallback_opts={"tree_size": 4}, **kw),
                             model, None, DEVICE, torch.float32)
    if name == "suffix":
        return SX.SuffixDecoding(cfg("suffix", **kw), model, None, DEVICE, torch.float32)
    if name == "suffix_chain":
        return SX.SuffixDecoding(cfg("suffix", tree=False, **kw), model, None, DEVICE, torch.float32)
    if name == "combo":
        return C.Combo(cfg("combo", **kw), model, None, DEVICE, torch.float32)
    raise KeyError(name)


NAMES = ["recycle", "sam", "sam_corpus", "sam_recycle", "suffix", "suffix_chain", "combo"]


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_identity(model, cases, corpus, name, bs):
    prompts, refs = cases[bs]
    prop = make(name, model, corpus)
    res = run_engine(model, prop, prompts, N_NEW)
    for r, ref in zip(res, refs):
        assert r.tokens == ref
        assert len(r.accept_lens) == r.steps
    assert sum(sum(r.accept_lens) for r in res) > 0  # the drafts are real: some get accepted
    if name == "sam_corpus":
        assert prop.describe()["drafted_by"]["static"] > 0  # the corpus drafted some steps
    if name == "sam_recycle":
        assert prop.describe()["drafted_by"]["fallback"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_rows_finish_alone(model, cases, corpus, name):
    prompts, refs = cases[4]
    eos = refs[1][4]
    res = run_engine(model, make(name, model, corpus), prompts, N_NEW, eos={eos})
    for r, ref in zip(res, refs):
        assert r.tokens == (ref[:ref.index(eos) + 1] if eos in ref else ref)


@pytest.mark.parametrize("name", ["recycle", "sam_recycle", "suffix", "combo"])
def test_sampling_follows_target(name):
    """Seeded rows of one prompt: the 2nd and 3rd generated tokens (drafted, verified by the
    lossless rule) follow the target's exact marginals."""
    from test_verify import exact_marginals

    target = tiny_llama(seed=0, vocab=V, scale=3.0)
    prompt = [3, 5, 7, 9, 3, 5, 7, 9, 3, 5]  # repeats: SAM's own text matches
    prop = make(name, target, K=2, temperature=1.0)
    if name in ("recycle", "sam_recycle"):  # a warm matrix: every token has candidates
        rec = prop if name == "recycle" else prop.fallback
        rec.next[:] = torch.stack([torch.randperm(V)[:8] for _ in range(V)])
        rec.known[:] = True
    n = 3000
    s = Sampling(1.0)
    res = run_engine(target, prop, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(5))
    m2, m3 = exact_marginals(target, prompt, s)
    assert sum(sum(r.accept_lens) for r in res) > n // 40  # drafts were really accepted from
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


# ----------------------------------------------------------------------- suffix automaton
def brute_earlier(seq):
    """Longest suffix of seq that also ends earlier in it, and the end of its first occurrence."""
    L = len(seq)
    for n in range(L - 1, 0, -1):
        tail = seq[L - n:]
        for e in range(n - 1, L - 1):
            if seq[e - n + 1:e + 1] == tail:
                return n, e
    return 0, -1


def test_automaton_finds_the_longest_earlier_suffix_and_its_first_occurrence():
    rng = random.Random(0)
    for _ in range(60):
        seq = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        sam = S.SuffixAutomaton()
        for i, t in enumerate(seq):
            sam.extend(t)
            n, e = sam.earlier()
            assert (n, e) == brute_earlier(seq[:i + 1])


def test_corpus_match_is_the_longest_suffix_found_in_the_corpus():
    rng = random.Random(1)
    text = [rng.randrange(4) for _ in range(80)]
    sam = S.SuffixAutomaton()
    sam.extend_all(text)
    query, state, length = [], 0, 0
    for _ in range(60):
        c = rng.randrange(4)
        query.append(c)
        state, length = sam.step(state, length, c)
        want = max((n for n in range(len(query) + 1) if any(text[i:i + n] == query[len(query) - n:]
                                                             for i in range(len(text) - n + 1))), default=0)
        assert length == want
        if length:  # the state's first occurrence ends where the match first ends in the text
            e = sam.first[state]
            assert text[e - length + 1:e + 1] == query[len(query) - length:]
            assert all(text[i:i + length] != query[len(query) - length:] for i in range(e - length + 1))


def test_sam_prefers_its_own_text_by_the_bias(model, corpus):
    prop = make("sam_corpus", model, corpus)
    row = S.Row([5, 6, 7, 5, 6], prop.corpus)
    row.length = 3  # a corpus match 3 long counts 3 - 4 < the row's own 2
    assert prop.match(row, [5, 6, 7, 5, 6], set())[0] == "dynamic"


# ----------------------------------------------------------------------- token recycling
def test_rank_tree_is_best_first_and_closed_under_parents():
    t = TR.rank_tree(8, 8)
    assert t[:3] == [(0,), (0, 0), (0, 0, 0)] and (1,) in t
    assert all(len(p) == 1 or p[:-1] in t[:i] for i, p in enumerate(t))
    assert len(set(TR.rank_tree(40, 3))) == 40 and max(max(p) for p in TR.rank_tree(40, 3)) <= 2


def test_the_matrix_holds_the_targets_candidates_after_a_step(model):
    """After one plain step, the matrix row of that step's root (the prefill's token) is the
    target's top-k at it, and its first candidate is the step's own greedy token."""
    prop = make("recycle", model)
    p = prompts_of([7], seed=3)[0]
    res = run_engine(model, prop, [p], 2)
    root = res[0].tokens[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + [root]])).logits[0, -1]
    assert prop.known[root] and int(prop.known.sum()) == 1
    assert prop.next[root].tolist() == logits.topk(8).indices.tolist()
    assert res[0].tokens[1] == prop.next[root][0]


def test_recycle_refusals_and_warm_start(model, tmp_path):
    from specbench.errors import ConfigError

    with pytest.raises(ConfigError, match="comes before"):
        TR.TokenRecycling.check(cfg("recycle", tree=[[0, 1], [0]]), None)
    with pytest.raises(ConfigError, match="ranks in 0..topk-1"):
        TR.TokenRecycling.check(cfg("recycle", tree=[[9]]), None)
    warm = tmp_path / "m.pt"
    a = make("recycle", model, warm=str(warm))
    run_engine(model, a, prompts_of([6], seed=2), 8)
    a.describe()  # saves
    b = make("recycle", model, warm=str(warm))
    assert torch.equal(a.next, b.next) and int(b.known.sum()) > 0


# ----------------------------------------------------------------------- combo
def test_matched_depth_walks_the_tree():
    toks, pars = [5, 6, 7, 8], [0, 1, 0, 3]  # 5-6 and 7-8
    assert C.matched_depth(toks, pars, [7, 8, 9]) == 2
    assert C.matched_depth(toks, pars, [5, 9]) == 1 and C.matched_depth(toks, pars, [9]) == 0


def test_combo_learns_and_takes_the_better_member(model, cases):
    prompts, refs = cases[4]
    prop = make("combo", model)
    run_engine(model, prop, prompts, N_NEW)
    d = prop.describe()
    assert abs(sum(d["won"].values()) - 1) < 1e-9 and set(d["rates"]) == {"pld", "suffix", "recycle"}
    # the choice: a member with better rates wins the row
    prop.right = [[9.0], [0.0], [0.0]]
    prop.tried = [[10.0], [10.0], [10.0]]
    assert prop.expected(0, 1) > prop.expected(1, 1)


def test_combo_refusals():
    from specbench.errors import ConfigError

    for of, msg in ((["pld"], "two or more"), (["pld", "lookahead"], "cannot be a member"),
                    (["pld", "nope"], "nope")):
        with pytest.raises(ConfigError, match=msg):
            C.Combo.check(cfg("combo", of=of), None)
    for bad in (0, -1, "3", True):
        with pytest.raises(ConfigError, match="max_nodes"):
            C.Combo.check(cfg("combo", of=["pld", "suffix"], max_nodes=bad), None)


def test_cut_keeps_the_first_nodes_whose_parents_stay():
    toks, pars = [5, 6, 7, 8, 9], [0, 1, 0, 2, 3]  # 5-6-8, 7-9
    assert C.cut(toks, pars, 9) == (toks, pars)
    assert C.cut(toks, pars, 3) == ([5, 6, 7], [0, 1, 0])
    assert C.cut([5, 6, 7, 8], [0, 1, 2, 3], 2) == ([5, 6], [0, 1])


def test_combo_max_nodes_caps_every_draft_and_stays_lossless(model, cases):
    prompts, refs = cases[4]
    prop = make("combo", model, max_nodes=2)
    res = run_engine(model, prop, prompts, N_NEW)
    for r, ref in zip(res, refs):
        assert r.tokens == ref
        assert max(r.nodes) <= 2
    assert prop.describe()["max_nodes"] == 2
    wide = run_engine(model, make("combo", model, max_nodes=None), prompts, N_NEW)
    assert max(n for r in wide for n in r.nodes) > 2  # the cap is what kept them at 2


# ----------------------------------------------------------------------- suffix decoding
def test_suffix_tree_counts_every_substring_and_matches_the_longest_suffix():
    rng = random.Random(2)
    seq = [rng.randrange(3) for _ in range(50)]
    t = SX.SuffixTree(5)
    cur = []
    for x in seq:  # fed a token at a time, as a row grows
        cur = t.feed(cur, [x])

    def count(sub):
        return sum(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    for n in range(1, 5):
        for i in range(len(seq) - n + 1):
            node = t.root
            for x in seq[i:i + n]:
                node = node.children[x]
            assert node.count == count(seq[i:i + n])
    q = [rng.randrange(3) for _ in range(8)]
    node, m = t.match(q)
    # the longest suffix (under max_depth) that occurs and has something after it somewhere
    want = max(n for n in range(0, 5) if n == 0 or any(seq[i:i + n] == q[len(q) - n:] for i in range(len(seq) - n)))
    assert m == want


def test_suffix_draft_grows_best_first_by_frequency():
    t = SX.SuffixTree(6)
    for s in [[1, 2, 3]] * 3 + [[1, 2, 4]] * 2 + [[1, 5, 6]]:
        t.feed([], s)
    node = t.root.children[1]  # after 1: 2 (5 of 6), then 3 (3 of 5) or 4 (2 of 5); 5 (1 of 6)
    toks, pars, score = SX.grow(node, 3, 0.1, True)
    assert toks == [2, 3, 4] and pars == [0, 1, 1] and score == pytest.approx(5 / 6 + 1 / 2 + 1 / 3)
    assert SX.grow(node, 5, 0.4, True)[0] == [2, 3]  # 2-4 (1/3) and 5 (1/6) under min_prob
    assert SX.grow(node, 5, 0.1, False)[:2] == ([2, 3], [0, 1])


def test_suffix_global_tree_learns_from_earlier_responses(model):
    """A second request that repeats a first one's answer is drafted from the global tree."""
    prop = make("suffix", model)
    p = prompts_of([6], seed=4)[0]
    run_engine(model, prop, [p], 16)
    other = [9] + p[1:]  # another prompt: its own text does not hold the answer
    res = run_engine(model, prop, [other], 16)
    assert prop.describe()["drafted_by"]["global"] > 0 and sum(res[0].accept_lens) >= 0


def test_the_cursors_deepest_continuing_node_is_the_longest_match():
    """SuffixDecoding's request tree is matched through its cursor (the nodes of every suffix of the
    sequence fed so far): its deepest node with children is what match() finds by search."""
    import random

    from specbench.methods.suffix import SuffixTree

    rng = random.Random(0)
    for trial in range(200):
        t = SuffixTree(max_depth=rng.choice([3, 6, 24]))
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        cur = t.feed([], seq)
        node = next((c for c in reversed(cur) if c.children), None)
        want, m = t.match(seq)
        assert node is want and (node.depth if node else 0) == m, trial


@pytest.mark.parametrize("method", [{"name": "suffix"}, {"name": "recycle"}, {"name": "combo", "of": ["pld", "suffix"]},
                                    {"name": "sam", "fallback": "recycle"}])
def test_methods_that_learn_across_requests_are_not_timed_on_answers_they_memorised(tiny_dirs, tmp_path, method):
    """The warm-up (the job's first batch) and earlier repeats must not teach a method the answers
    it is then timed on: every repeat reads the acceptance of a fresh proposer without warm-up."""
    from specbench.run import runner
    from helpers import composed, tiny_cfg

    own = {k: v for k, v in composed([f"method={method['name']}"]).method.items()}
    own.update(method)
    cfg = tiny_cfg(tiny_dirs, tmp_path, method=own, repeats=2, ar_baseline="sweep", max_new_tokens=24)
    warm = next(r for r in runner.run(cfg, sweep_id="warm") if r["method"] == method["name"])
    cold = next(r for r in runner.run(tiny_cfg(tiny_dirs, tmp_path, method=own, warmup=False, ar_baseline="sweep",
                                               max_new_tokens=24), sweep_id="cold")
                if r["method"] == method["name"])
    by_rep = {}
    for rq in warm["requests"]:
        by_rep.setdefault(rq["repeat"], {})[(rq["id"], rq["turn"])] = rq["accepts"]
    fresh = {(rq["id"], rq["turn"]): rq["accepts"] for rq in cold["requests"]}
    assert by_rep[0] == fresh and by_rep[1] == fresh
