"""Lookahead, REST and SpecDec: token identity with plain greedy decoding (fp32, tiny random
models, bs 1 and 4, ragged prompts), losslessness under sampling, the Lookahead window's
mask and n-gram harvest, REST's datastore, SpecDec's top-beta rule and its trainer."""

import json
import random

import pytest
import torch
from helpers import (
    DEVICE,
    chi2_pvalue,
    greedy_cases,
    prompts_of,
    reference_greedy,
    run_engine,
    tiny_llama,
)
from omegaconf import OmegaConf

from specbench.methods.base import BatchState
from specbench.methods import lookahead as LA
from specbench.methods import rest as R
from specbench.methods.lookahead import Lookahead, Pool
from specbench.methods.rest import Rest, build_datastore
from specbench.methods.specdec import SpecDec
from specbench.decode.tree import Draft, prefix_tree, tree_geometry
from specbench.drafters.specdec import SpecDrafter
from specbench.decode.verify import Sampling, verify

N_NEW = 24
V = 12  # vocabulary of the sampling tests


def la_cfg(W=3, N=3, G=3, **kw):
    return OmegaConf.create({"K": 4, "method": {"name": "lookahead", "W": W, "N": N, "G": G, **kw}})


def rest_cfg(path, **kw):
    m = {"name": "rest", "datastore": str(path), "num_draft": 16, "max_suffix": 6, "min_suffix": 2}
    m.update(kw)
    return OmegaConf.create({"K": 4, "progress": False, "method": m})


def sd_cfg(K=3, beta=1, tol=1.0, temperature=0.0):
    return OmegaConf.create({"K": K, "sampling": {"temperature": temperature},
                             "method": {"name": "specdec", "checkpoint": None, "beta": beta, "tol": tol}})


def random_spec(target, k=3, seed=0):
    torch.manual_seed(seed)
    d = SpecDrafter(target, 1, torch.arange(target.config.vocab_size), k)
    with torch.no_grad():
        d.queries.normal_(0, 1.0)
    return d.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def cases(model):
    return greedy_cases(model, N_NEW)


@pytest.fixture(scope="module")
def datastore(model, cases, tmp_path_factory):
    """A .jsonl corpus of the target's own greedy continuations, so retrieval finds real
    matches; indexed through a word-level tokenizer."""
    from conftest import save_tiny_hf
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rest")
    tok = AutoTokenizer.from_pretrained(save_tiny_hf(root / "tok"))
    rows = []
    for ps, refs in cases.values():
        for p, r in zip(ps, refs):
            rows.append({"text": tok.decode(p + r[: N_NEW // 2])})
    for p in prompts_of([6, 9, 4], seed=7):
        rows.append({"text": tok.decode(p + reference_greedy(model, p, 30))})
    path = root / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path, tok


def make(name, model, datastore=None):
    if name == "lookahead":
        return Lookahead(la_cfg(), model, None, DEVICE, torch.float32)
    if name == "lookahead_n2":
        return Lookahead(la_cfg(W=2, N=2, G=2), model, None, DEVICE, torch.float32)
    if name == "rest":
        path, tok = datastore
        return Rest(rest_cfg(path), model, tok, DEVICE, torch.float32)
    if name == "specdec":
        return SpecDec(sd_cfg(), model, None, DEVICE, torch.float32, drafter=random_spec(model))
    raise KeyError(name)


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("name", ["lookahead", "lookahead_n2", "rest", "specdec"])
def test_greedy_identity(model, cases, datastore, name, bs):
    prompts, refs = cases[bs]
    res = run_engine(model, make(name, model, datastore), prompts, N_NEW)
    for r, ref in zip(res, refs):
        assert r.tokens == ref
        assert len(r.accept_lens) == r.steps
    if name in ("rest", "lookahead"):  # the drafts are real: some get accepted
        assert sum(sum(r.accept_lens) for r in res) > 0


@pytest.mark.parametrize("name", ["lookahead", "rest", "specdec"])
def test_rows_finish_alone(model, cases, datastore, name):
    prompts, refs = cases[4]
    eos = refs[1][4]
    res = run_engine(model, make(name, model, datastore), prompts, N_NEW, eos={eos})
    for r, ref in zip(res, refs):
        assert r.tokens == (ref[:ref.index(eos) + 1] if eos in ref else ref)


# ----------------------------------------------------------------------- lookahead
def test_lookahead_window_mask_is_the_papers():
    """Node (level l, column c) sees the root, level-0 columns 0..c and column c's levels
    below it, nothing else; and its depth is c + l + 1."""
    W, N = 4, 4
    la = Lookahead(la_cfg(W=W, N=N, G=0), None, None, DEVICE, torch.float32)
    st = BatchState(seqs=[[5, 6, 7, 8]], prompt_lens=[3], sampling=Sampling(), gen=None, device=DEVICE)
    la.start(st)
    la.levels[0] = [[10 + i for i in range(W)], [20 + i for i in range(W)], [30 + i for i in range(W)]]
    d = la.propose(st)
    assert d.candidate is not None and not bool(d.accept_mask().any())
    depth, anc = tree_geometry(d.parents)
    for l in range(N - 1):
        for c in range(W):
            i = 1 + l * W + c
            want = {0} | {1 + cc for cc in range(c + 1)} | {1 + ll * W + c for ll in range(l + 1)}
            assert set(torch.nonzero(anc[0, i]).flatten().tolist()) == want, (l, c)
            assert int(depth[0, i]) == c + l + 1


def test_lookahead_harvests_ngrams_from_the_window(model):
    """After the window fills, the pool holds N-grams whose continuation is the target's own
    Jacobi output: with the window seeded with the true continuation, the harvested gram is
    that continuation."""
    prompt = prompts_of([8], seed=3)[0]
    ref = reference_greedy(model, prompt, 8)
    W, N = 3, 2
    la = Lookahead(la_cfg(W=W, N=N, G=2, prompt_ngrams=False), model, None, DEVICE, torch.float32)
    seqs = [prompt + ref[:1]]
    st = BatchState(seqs=[list(seqs[0])], prompt_lens=[len(prompt)], sampling=Sampling(), gen=None, device=DEVICE)
    la.start(st)
    la.levels[0] = [ref[1:1 + W]]  # the exact next W tokens: Jacobi is already at its fixed point
    d = la.propose(st)
    tokens = torch.cat([torch.tensor([[st.seqs[0][-1]]]), d.tokens], 1)
    st.logits = model(torch.tensor([st.seqs[0][:-1] + tokens[0].tolist()])).logits[:, -tokens.shape[1]:]
    la.update(st, [[]])
    for c in range(W - 1):  # column c's gram: (its token, the target's next token) = ref[c+1], ref[c+2]
        assert (ref[c + 2],) in la.pools[0].get(ref[c + 1])


def test_pool_keeps_the_latest_grams():
    p = Pool(cap=2)
    for g in ([1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 4, 5]):
        p.add(g)
    assert p.get(1) == [(4, 5), (6, 7)]
    assert prefix_tree([(4, 5), (4, 6), (7,)]) == ([4, 5, 6, 7], [0, 1, 1, 0])


def test_lookahead_auto_takes_the_devices_settings(model):
    """`auto` keys resolve per device; a key given explicitly stays; bad values are refused
    with the key's name, and the node cap holds for every device's `auto`."""
    from transformers import LlamaConfig

    from specbench.errors import ConfigError

    for dev in ("cpu", "cuda"):
        la = Lookahead(la_cfg(W="auto", N="auto", G="auto"), model, None, torch.device(dev), torch.float32)
        assert (la.W, la.N, la.G) == tuple(LA.AUTO[dev][k] for k in "WNG")
    assert LA.AUTO["cpu"] != LA.AUTO["cuda"]
    la = Lookahead(la_cfg(W=5, N="auto", G=2), model, None, DEVICE, torch.float32)
    assert (la.W, la.N, la.G) == (5, LA.AUTO["cpu"]["N"], 2) and la.describe()["W"] == 5
    Lookahead.check(la_cfg(W="auto", N="auto", G="auto"), LlamaConfig())
    with pytest.raises(ConfigError, match="lookahead.G must be 'auto' or an integer >= 0, got 'many'"):
        Lookahead.check(la_cfg(W="auto", N="auto", G="many"), LlamaConfig())
    with pytest.raises(ConfigError, match="nodes per step is more than 512"):
        Lookahead.check(la_cfg(W=200, N="auto", G="auto"), LlamaConfig())


# ----------------------------------------------------------------------- REST
def test_rest_num_draft_auto_takes_the_devices_count(model):
    from transformers import LlamaConfig

    from specbench.errors import ConfigError

    for dev in ("cpu", "cuda"):
        r = Rest(rest_cfg("python_code", num_draft="auto"), model, None, torch.device(dev), torch.float32,
                 index=object())
        assert r.num_draft == R.AUTO_NUM_DRAFT[dev] and r.describe()["num_draft"] == r.num_draft
    assert R.AUTO_NUM_DRAFT["cpu"] < R.AUTO_NUM_DRAFT["cuda"]
    Rest.check(rest_cfg("python_code", num_draft="auto"), LlamaConfig(vocab_size=96))
    with pytest.raises(ConfigError, match="rest.num_draft must be 'auto' or an integer >= 2, got 'lots'"):
        Rest.check(rest_cfg("python_code", num_draft="lots"), LlamaConfig(vocab_size=96))


def test_rest_datastore_is_cached_and_retrieves_the_longest_suffix(model, datastore, tmp_path):
    path, tok = datastore
    idx = build_datastore(str(path), tok, 96, progress=False)
    again = build_datastore(str(path), tok, 96, progress=False)
    assert idx == again and idx.exists()
    r = Rest(rest_cfg(path), model, tok, DEVICE, torch.float32)
    prompt = prompts_of([6], seed=7)[0]
    cont = reference_greedy(model, prompt, 30)
    tokens, parents = r.retrieve(prompt + cont[:5])
    assert 0 < len(tokens) <= 16 and all(p < i + 1 for i, p in enumerate(parents))  # a trie, parents first
    node = 0  # the continuation that follows in the corpus is a path of the trie
    for t in cont[5:8]:
        node = next((i + 1 for i, (u, p) in enumerate(zip(tokens, parents)) if p == node and u == t), None)
        assert node is not None
    assert r.index.longest(prompt + cont[:5], 6) == 6


def test_rest_gives_the_same_drafts_every_time(model, datastore):
    """The same REST job twice gives the same acceptance sequence: equally frequent trie nodes
    are not chosen by a hash map's order, whatever ran before (item 18 of issue 44)."""
    path, tok = datastore
    prompts = prompts_of([5, 7, 6, 8], seed=3)
    runs = []
    for _ in range(4):
        prop = Rest(rest_cfg(path, num_draft=3, max_suffix=4), model, tok, DEVICE, torch.float32)
        runs.append([r.accept_lens for r in run_engine(model, prop, prompts, N_NEW)])
    assert sum(map(sum, runs[0])) > 0  # drafts were accepted
    assert all(r == runs[0] for r in runs[1:])


def test_rest_refuses_a_wide_vocabulary(tmp_path):
    from transformers import LlamaConfig

    from specbench.errors import ConfigError

    cfg = rest_cfg("python_code")
    with pytest.raises(ConfigError, match="too large for the datastore's 32-bit tokens"):
        Rest.check(cfg, LlamaConfig(vocab_size=2**31))
    Rest.check(cfg, LlamaConfig(vocab_size=262144))  # Gemma 3's vocabulary fits
    with pytest.raises(ConfigError, match="neither sharegpt nor python_code"):
        Rest.check(rest_cfg(tmp_path / "nope.jsonl"), LlamaConfig(vocab_size=96))
    with pytest.raises(ConfigError, match="min_suffix"):
        Rest.check(rest_cfg("sharegpt", min_suffix=5, max_suffix=3), LlamaConfig(vocab_size=96))
    with pytest.raises(ConfigError, match="min_suffix must be an integer >= 2"):
        Rest.check(rest_cfg("sharegpt", min_suffix=1), LlamaConfig(vocab_size=96))


def test_datastore_keeps_wide_token_ids(tmp_path):
    """Ids above 16 bits are stored whole (a 16-bit store would alias 70000 with 4464)."""
    from specbench.suffix_index import SuffixIndex, build

    build([[70000, 1, 2, 3, 9, 70000, 1, 2, 3, 8]], tmp_path / "w")
    r = SuffixIndex(tmp_path / "w")
    assert r.tree([70000, 1], 4)[0] == [2, 3, 8, 9] and r.tree([4464, 1], 4) == ([], [])


def test_datastore_search_is_rests_ranking(tmp_path):
    """Against brute force on random corpora: the longest suffix found, and the most frequent
    prefixes of the first k continuations (sorted), ties to the shallower then smaller node;
    no continuation runs from one entry into the next."""
    from collections import Counter

    from specbench.suffix_index import SuffixIndex, build

    rng = random.Random(0)
    for trial in range(12):
        vocab = rng.choice([3, 5, 20])
        entries = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 8))]
        build(entries, tmp_path / f"i{trial}")
        ix = SuffixIndex(tmp_path / f"i{trial}")
        suffixes = [e[i:] for e in entries for i in range(len(e))]
        for _ in range(10):
            ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
            best = 0
            while best < min(6, len(ctx)) and any(s[:best + 1] == ctx[-best - 1:] for s in suffixes):
                best += 1
            assert ix.longest(ctx, 6) == best
            q, k, long = ctx[-2:], rng.choice([2, 5, 5000]), 4
            follow = sorted(s[len(q):] for s in suffixes if s[:len(q)] == q)[:k]
            count = Counter(tuple(f[:j]) for f in follow[:k] for j in range(1, min(len(f), long) + 1))
            want = sorted(count, key=lambda p: (-count[p], len(p), p))[:6]
            tokens, parents = ix.tree(q, 6, k=k, long=long)
            got = []
            for t, p in zip(tokens, parents):
                assert p <= len(got)
                got.append((got[p - 1] if p else ()) + (t,))
            assert sorted(got) == sorted(want)


def test_python_code_datastore_is_the_stdlib():
    from specbench.methods.rest import python_sources

    files = python_sources()
    assert len(files) > 100 and any(f.name == "json" or f.parent.name == "json" for f in files)
    assert not any("test" in f.parts for f in files)


# ----------------------------------------------------------------------- SpecDec
def test_top_beta_rule():
    """beta=3, tol=1: a token in the top-3 within 1 nat of the top-1 passes; a top-3 token
    further away does not; the extra token is the argmax where the path ends."""
    logits = torch.full((1, 4, V), -5.0)
    logits[0, 0, [4, 5, 6]] = torch.tensor([2.0, 1.5, 0.2])  # 5 is 0.5 nat off, 6 is 1.8
    logits[0, 1, [7, 8]] = torch.tensor([2.0, 1.2])
    logits[0, 2, 9] = 3.0
    d = Draft.chain(torch.tensor([[5, 8, 6]]), relaxed=(3, 1.0))
    v = verify(logits, d, Sampling(), None)
    assert v.accepted == [[5, 8]] and int(v.extra[0]) == 9
    d = Draft.chain(torch.tensor([[6, 8, 6]]), relaxed=(3, 1.0))
    assert verify(logits, d, Sampling(), None).accepted == [[]]
    d = Draft.chain(torch.tensor([[5, 8, 6]]), relaxed=None)  # exact greedy: 5 is not the argmax
    v = verify(logits, d, Sampling(), None)
    assert v.accepted == [[]] and int(v.extra[0]) == 4


def test_specdec_lossy_flag_and_beta_above_one(model, cases):
    prompts, refs = cases[4]
    exact = SpecDec(sd_cfg(beta=1), model, None, DEVICE, torch.float32, drafter=random_spec(model))
    relaxed = SpecDec(sd_cfg(beta=4, tol=5.0), model, None, DEVICE, torch.float32, drafter=random_spec(model))
    assert exact.lossless and not relaxed.lossless
    sampled = SpecDec(sd_cfg(beta=4, temperature=0.7), model, None, DEVICE, torch.float32, drafter=random_spec(model))
    assert sampled.lossless  # under sampling the lossless rule runs whatever beta is
    a = run_engine(model, exact, prompts, N_NEW)
    b = run_engine(model, relaxed, prompts, N_NEW)
    assert sum(sum(r.accept_lens) for r in b) > sum(sum(r.accept_lens) for r in a)  # it accepts more


def test_specdec_drafts_in_one_forward(model):
    """The drafter's queries see the context and each other; the proposal equals a plain
    full-context forward of the drafter over context + queries."""
    d = random_spec(model, k=3, seed=5)
    sd = SpecDec(sd_cfg(K=3), model, None, DEVICE, torch.float32, drafter=d)
    seq = prompts_of([7], seed=2)[0]
    st = BatchState(seqs=[list(seq)], prompt_lens=[6], sampling=Sampling(), gen=None, device=DEVICE)
    sd.start(st)
    got = sd.propose(st).tokens[0].tolist()
    ids = torch.tensor([seq + d.query_ids().tolist()])
    L = len(seq)
    ok = torch.ones(L + 3, L + 3, dtype=torch.bool).tril()
    ok[L:, L:] = True
    mask = torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]
    want = d(ids, attention_mask=mask, position_ids=torch.arange(L + 3)[None]).logits[0, L:].argmax(-1).tolist()
    assert got == want


# ----------------------------------------------------------------------- sampling
@pytest.mark.parametrize("name", ["lookahead", "rest", "specdec"])
def test_sampling_follows_target(name, tmp_path):
    """Seeded rows of one prompt: the 2nd and 3rd generated tokens (drafted, verified by the
    lossless rule) follow the target's exact marginals."""
    from test_verify import exact_marginals

    target = tiny_llama(seed=0, vocab=V, scale=3.0)
    prompt = [3, 5, 7, 9, 3, 5]
    if name == "lookahead":
        prop = Lookahead(la_cfg(W=2, N=3, G=4), target, None, DEVICE, torch.float32)
    elif name == "specdec":
        prop = SpecDec(sd_cfg(K=2, temperature=1.0), target, None, DEVICE, torch.float32,
                       drafter=random_spec(target, k=2, seed=3))
    else:
        class Index:  # every pair of tokens: a dense trie, so the rule meets many siblings
            def drafts(self, context, max_suffix, min_suffix, choices):
                return prefix_tree([[a, b] for a in range(3, 9) for b in (4, 5)])

        prop = Rest(rest_cfg("python_code", num_draft=20), target, None, DEVICE, torch.float32, index=Index())
    n = 3000
    s = Sampling(1.0)
    res = run_engine(target, prop, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(5))
    m2, m3 = exact_marginals(target, prompt, s)
    assert sum(sum(r.accept_lens) for r in res) > n // 20  # drafts were really accepted from
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


# ----------------------------------------------------------------------- SpecDec trainer
def test_specdec_trainer_end_to_end(tmp_path):
    from conftest import save_tiny_hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specbench.drafters import is_draft_checkpoint, load
    from specbench.train import distill, specdec

    folder = save_tiny_hf(tmp_path / "target", seed=0)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [" ".join(f"w{(i * 13 + j * 7) % 90}" for j in range(5 + i % 7)) for i in range(30)]
    cfg = OmegaConf.create({
        "seed": 0, "resume": True,
        "drafter": {"kind": "specdec", "name": "tiny_sd", "layers": 1, "k": 3, "draft_vocab": None, "init": "target",
                    "groups": 4},
        "data": {"prompts": 30, "respond": 30, "max_prompt_tokens": 32, "max_new_tokens": 14, "temperature": 0.0,
                 "gen_bs": 10, "teacher_bs": 10, "topk": 1, "shard_size": 15, "seed": 0, "store_hidden": False,
                 "dir": str(tmp_path / "distill")},
        "train": {"steps": 60, "batch_size": 4, "seq_len": 64, "lr": 3e-3, "weight_decay": 0.0, "warmup": 3,
                  "grad_clip": 1.0, "save_every": 20, "eval_frac": 0.2},
    })
    items = distill.load(distill.build(target, tok, "tiny", cfg.data, DEVICE, torch.float32, progress=False,
                                       prompts=prompts))
    out = tmp_path / "ckpt"
    out.mkdir()
    its = specdec.answered(items)
    V96 = target.config.vocab_size
    lookup = torch.arange(V96)
    before = SpecDrafter(target, 1, torch.arange(V96), 3)
    batch = specdec.collate(its[6:14], 64, 3, 4, V96, lookup, random.Random(0))
    with torch.no_grad():
        l0 = specdec.loss_fn(before, *batch, batch[0].shape[1] - 12)[0].item()
    res = specdec.train(cfg, target, None, items, out, {2}, torch.device("cpu"), progress=False)
    with torch.no_grad():
        l1 = specdec.loss_fn(res["draft"], *batch, batch[0].shape[1] - 12)[0].item()
    assert l1 < l0 - 0.3  # it learned the target's answers
    specdec.finish(cfg, res, out, "tiny", {**distill.stats(items), "dropped_for_benchmark_overlap": 0, "key": "k"},
                   "python -m specbench.train drafter=specdec")
    assert is_draft_checkpoint(out) and "Spec-Drafter" in (out / "README.md").read_text()
    d = load(out, target, DEVICE, torch.float32, kind="specdec")
    assert d.k == 3 and torch.allclose(d.queries, res["draft"].queries.to(torch.bfloat16).float())
    ps = prompts_of([6, 9], vocab=96)
    refs = [reference_greedy(target, p, 16) for p in ps]
    out2 = run_engine(target, SpecDec(sd_cfg(K=3), target, None, DEVICE, torch.float32, drafter=d), ps, 16)
    assert [r.tokens for r in out2] == refs
