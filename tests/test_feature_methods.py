"""EAGLE and Medusa: token identity with plain greedy decoding (fp32, tiny random models,
bs 1 and 4, ragged prompts), the drafter's tree expansion against its training-time
unrolling, losslessness under sampling, typical acceptance, and the trainers end to end."""

import pytest
import torch
from omegaconf import OmegaConf

from helpers import DEVICE, greedy_cases, chi2_pvalue, prompts_of, reference_greedy, run_engine, tiny_llama
from specbench.methods.eagle import Eagle
from specbench.methods.medusa import Medusa
from specbench import kernels
from specbench.kernels import extension, packing
from specbench.decode.tree import Draft
from specbench.drafters.eagle import EagleDrafter
from specbench.drafters.medusa import MedusaHeads, sparse_tree
from specbench.decode.hidden import Tap
from specbench.decode.verify import Sampling, verify

N_NEW = 20


def cfg(method, K=4):
    return OmegaConf.create({"K": K, "method": method})


def eagle_cfg(**kw):
    m = {"name": "eagle", "version": 2, "checkpoint": None, "top_k": 3, "depth": 4, "total_tokens": 10}
    m.update(kw)
    return cfg(m)


def medusa_cfg(**kw):
    m = {"name": "medusa", "checkpoint": None, "tree": "default", "tree_size": 9, "accept": "exact",
         "eps": 0.09, "delta": 0.3}
    m.update(kw)
    return cfg(m, K=3)


def random_eagle(target, seed=0, vocab=None):
    torch.manual_seed(seed)
    V = target.config.vocab_size
    d = EagleDrafter(target, torch.arange(V) if vocab is None else vocab)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    return d.eval()


def random_medusa(target, seed=0, heads=3):
    torch.manual_seed(seed)
    m = MedusaHeads(target, torch.arange(target.config.vocab_size), heads)
    with torch.no_grad():
        m.weight.normal_(0, 0.2)
    return m.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0, scale=4.0)


@pytest.fixture(scope="module")
def cases(model):
    return greedy_cases(model, N_NEW)


def make(name, model):
    if name == "eagle":
        return Eagle(eagle_cfg(), model, None, DEVICE, torch.float32, drafter=random_eagle(model))
    if name == "eagle_small_vocab":  # a draft vocabulary that misses tokens the target emits
        return Eagle(eagle_cfg(top_k=2, depth=3, total_tokens=5), model, None, DEVICE, torch.float32,
                     drafter=random_eagle(model, vocab=torch.arange(0, 96, 2)))
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    if name == "medusa":
        return Medusa(medusa_cfg(), model, None, DEVICE, torch.float32, heads=random_medusa(model), acc=acc)
    if name == "medusa_chain":
        return Medusa(medusa_cfg(tree="chain"), model, None, DEVICE, torch.float32, heads=random_medusa(model), acc=acc)
    raise KeyError(name)


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("name", ["eagle", "eagle_small_vocab", "medusa", "medusa_chain"])
def test_greedy_identity(model, cases, name, bs):
    prompts, refs = cases[bs]
    res = run_engine(model, make(name, model), prompts, N_NEW)
    for r, ref in zip(res, refs):
        assert r.tokens == ref
        assert len(r.accept_lens) == r.steps


@pytest.mark.skipif(extension.unavailable() is not None, reason="no native kernels here")
@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_drafters_take_the_targets_kernel_path(name):
    """On a native-kernel target, a drafter's own linear layers and its rows of the target's output layer
    run through the native kernels too (as ``drafters.load`` sets them up), and decoding stays
    token-identical to greedy on that target."""
    target = tiny_llama(seed=0, scale=4.0)
    kernels.apply(target, "native")
    prop = make(name, target)
    (drafter,) = prop.modules()
    kernels.apply(drafter, kernels.kernel_of(target))
    assert kernels.kernel_of(drafter) == ("native" if name == "eagle" else "torch")  # Medusa's heads: no nn.Linear
    h = torch.randn(3, 64)
    with torch.inference_mode():
        w = drafter.parts.head_weight()
        assert torch.allclose(drafter.parts.logits(h), h @ w.T, atol=1e-5)
        assert packing.PACKED["rows"][drafter.parts][0] == [(id(w), w.data_ptr(), 0)]  # packed once for the slice
    prompts, refs = greedy_cases(target, N_NEW)[4]
    assert [r.tokens for r in run_engine(target, prop, prompts, N_NEW)] == refs


@pytest.mark.skipif(extension.unavailable() is not None, reason="no native kernels here")
def test_eagle_block_is_the_same_on_both_paths():
    """EAGLE's drafter layer on the native path runs the target's fused steps (RMSNorm, q|k|v and
    gate|up in one kernel call each, RoPE in place) and attends through the extension (GQA,
    additive mask, no repeated keys): the same q, k, v and layer output as torch's path within
    fp32 rounding, with a tree-like mask whose rows see different keys; under autograd it
    keeps torch's path."""
    import copy

    from specbench.drafters.eagle import Block

    target = tiny_llama(seed=0, scale=4.0)
    torch.manual_seed(0)
    ref = Block(target.config)
    fast = copy.deepcopy(ref)
    kernels.apply(fast, "native")
    B, n, S, d = 2, 5, 23, target.config.hidden_size
    x = torch.randn(B, n, d)
    cos, sin = target.model.rotary_emb(x, torch.arange(7, 7 + n)[None].expand(B, n))
    k, v = torch.randn(2, B, ref.Hk, S, ref.Dh)
    mask = torch.rand(B, n, S + n) < 0.5
    mask[..., 0] = True
    with torch.inference_mode():
        assert fast._fused(x) is not None and ref._fused(x) is None
        outs = []
        for blk in (ref, fast):
            q, kn, vn = blk.qkv(x, cos, sin)
            outs.append((q, kn, vn, blk.attend(x, q, torch.cat([k, kn], 2), torch.cat([v, vn], 2), mask)))
    assert ref.H > ref.Hk
    for want, got in zip(*outs):
        assert torch.allclose(got, want, atol=1e-5)
    xg = x.clone().requires_grad_()
    q, kn, vn = fast.qkv(xg, cos, sin)
    fast.attend(xg, q, torch.cat([k, kn], 2), torch.cat([v, vn], 2), mask).sum().backward()
    assert xg.grad is not None and fast.up.weight.grad is not None


@torch.no_grad()
def unrolled_chain(d, f, seq, depth: int, ranks=None) -> list[int]:
    """The chain a drafter's training-time unrolling predicts after ``seq`` (``f``: the target
    features of ``seq[:-1]``): step s's prediction at the last position, s = 0..depth-1; the
    likeliest token, or the ``ranks[s]``-th (0 = likeliest)."""
    toks = list(seq)
    for s in range(depth):
        T = len(toks) - 1
        feats = torch.zeros(1, T, f.shape[-1])
        feats[0, : f.shape[1]] = f[0]
        out = d.train_forward(feats, torch.tensor([toks[1:]]), torch.ones(1, T, dtype=torch.bool), steps=s + 1)
        r = 0 if ranks is None else ranks[s]
        toks.append(int(d.vocab_ids[d.logits(out[s, 0, T - 1]).topk(r + 1).indices[r]]))
    return toks[len(seq):]


def real_prefix(model):
    """A prompt, it plus the target's next greedy token, and the target's final states of all but
    that last token (what the drafter reads)."""
    prompt = prompts_of([9], seed=5)[0]
    seq = prompt + reference_greedy(model, prompt, 1)
    with Tap(model, ["final"]) as tap:
        model(torch.tensor([seq[:-1]]))
        return prompt, seq, tap.take()["final"]


def test_eagle_tree_expansion_matches_training_unroll(model):
    """With top_k=1 the dynamic tree is a chain; each drafted token must be what the
    training-time unrolling (the same drafter, the same real prefix) predicts."""
    d = random_eagle(model, seed=4)
    prompt, seq, f = real_prefix(model)
    depth = 4
    prop = Eagle(eagle_cfg(top_k=1, depth=depth, total_tokens=depth), model, None, DEVICE, torch.float32, drafter=d)
    res = run_engine(model, prop, [prompt], 2)
    assert res[0].tokens[0] == seq[-1]
    # the drafter's chain from this prefix, step by step through train_forward
    from specbench.methods.base import BatchState
    from specbench.decode.hidden import Hidden

    st = BatchState(seqs=[list(seq)], prompt_lens=[len(prompt)], sampling=Sampling(), gen=None, device=DEVICE)
    prop.start(st, Hidden({"final": f}, torch.tensor([f.shape[1]])))
    chain = prop.propose(st).tokens[0].tolist()
    assert unrolled_chain(d, f, seq, depth) == chain


def test_eagle1_static_tree_nodes_are_the_ranked_unroll(model):
    """eagle.tree=mc_sim_7b_63 (EAGLE-1's 25 nodes, depth 5): the node of path (r1, ..., rj) must
    be the rj-th likeliest token of the drafter unrolled along its ancestors; and decoding with
    the static tree stays token-identical to AR."""
    from specbench.methods.base import BatchState
    from specbench.drafters import formats
    from specbench.decode.hidden import Hidden

    paths = sorted(map(tuple, formats.named_trees("eagle")["mc_sim_7b_63"]), key=lambda p: (len(p), p))
    assert len(paths) == 25 and max(map(len, paths)) == 5
    d = random_eagle(model, seed=4)
    prompt, seq, f = real_prefix(model)
    c = eagle_cfg(tree="mc_sim_7b_63")
    prop = Eagle(c, model, None, DEVICE, torch.float32, drafter=d)
    assert (prop.top_k, prop.depth, prop.total) == (4, 5, 25) and Eagle.spec_len(c, DEVICE) == 5
    st = BatchState(seqs=[list(seq)], prompt_lens=[len(prompt)], sampling=Sampling(), gen=None, device=DEVICE)
    prop.start(st, Hidden({"final": f}, torch.tensor([f.shape[1]])))
    draft = prop.propose(st)
    toks, parents = draft.tokens[0].tolist(), draft.parents[0].tolist()
    for i, p in enumerate(paths):
        assert parents[i] == (paths.index(p[:-1]) + 1 if len(p) > 1 else 0)
        assert toks[i] == unrolled_chain(d, f, seq, len(p), ranks=p)[-1], p
    for bs in (1, 3):
        prompts = prompts_of([5, 9, 3][:bs], seed=1)
        res = run_engine(model, Eagle(c, model, None, DEVICE, torch.float32, drafter=d), prompts, 12)
        assert [r.tokens for r in res] == [reference_greedy(model, p, 12) for p in prompts]


def test_medusa_sparse_tree():
    acc = [[0.6, 0.2], [0.5, 0.3], [0.4, 0.1]]
    t = sparse_tree(acc, 5)
    assert t == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]  # products .6 .2 .3 .18 .12 beat .1 (1,0)
    assert all(p[:-1] in t for p in t if len(p) > 1)


# ----------------------------------------------------------------------- sampling
V = 12


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_sampling_follows_target(name):
    """Seeded rows of one prompt: the 2nd generated token (drafted by the tree, verified
    with the lossless rule) follows the target's exact marginal."""
    from test_verify import exact_marginals

    target = tiny_llama(seed=0, vocab=V, scale=3.0)
    if name == "eagle":
        prop = Eagle(eagle_cfg(top_k=3, depth=2, total_tokens=6), target, None, DEVICE, torch.float32,
                     drafter=random_eagle(target, seed=2))
    else:
        prop = Medusa(medusa_cfg(tree_size=6), target, None, DEVICE, torch.float32, heads=random_medusa(target, seed=2),
                      acc=[[0.5, 0.3, 0.2], [0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    prompt = [3, 5, 7, 9]
    n = 3000
    s = Sampling(1.0)
    res = run_engine(target, prop, [prompt] * n, 3, sampling=s, gen=torch.Generator().manual_seed(5))
    m2, m3 = exact_marginals(target, prompt, s)
    assert sum(sum(r.accept_lens) for r in res) > n // 4  # the tree was really accepted from
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[1] for r in res]), minlength=V), m2) > 1e-3
    assert chi2_pvalue(torch.bincount(torch.tensor([r.tokens[2] for r in res]), minlength=V), m3) > 1e-3


def test_typical_acceptance_rule():
    """A node passes when p(x) > min(eps, delta exp(-H)); the longest passing path is kept."""
    logits = torch.full((1, 3, V), -4.0)
    logits[0, 0, 5] = 3.0  # root: 5 is likely, 6 is not
    logits[0, 0, 6] = -1.0
    logits[0, 1, 7] = 3.0
    d = Draft(tokens=torch.tensor([[6, 5]]), parents=torch.tensor([[0, 0]]), typical=(0.09, 0.3))
    v = verify(logits, d, Sampling(1.0), torch.Generator().manual_seed(0))
    assert v.accepted == [[5]] and v.keep[0, :2].tolist() == [0, 2]
    d = Draft(tokens=torch.tensor([[5, 7]]), parents=torch.tensor([[0, 1]]), typical=(0.09, 0.3))
    v = verify(logits, d, Sampling(1.0), torch.Generator().manual_seed(0))
    assert v.accepted == [[5, 7]] and v.counts.tolist() == [3]


def test_typical_is_recorded_lossy(model):
    p = Medusa(medusa_cfg(accept="typical"), model, None, DEVICE, torch.float32, heads=random_medusa(model),
               acc=[[0.5]] * 3)
    assert p.lossless is False and p.describe()["accept"] == "typical"
    assert make("medusa", model).lossless is True


@pytest.mark.parametrize("name", ["eagle", "medusa"])
def test_rows_finish_alone(model, cases, name):
    """A row that hits EOS leaves the batch; the method's per-row state follows."""
    prompts, refs = cases[4]
    eos = refs[1][4]
    res = run_engine(model, make(name, model), prompts, N_NEW, eos={eos})
    for r, ref in zip(res, refs):
        want = ref[:ref.index(eos) + 1] if eos in ref else ref
        assert r.tokens == want


# ----------------------------------------------------------------------- feature set and trainers
@pytest.fixture(scope="module")
def feature_setup(tmp_path_factory):
    from conftest import save_tiny_hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("features")
    folder = save_tiny_hf(root / "target", seed=0)
    target = AutoModelForCausalLM.from_pretrained(folder).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(folder)

    def words(i, n):
        return " ".join(f"w{(i * 11 + j * 7) % 90}" for j in range(n))

    convs = [{"id": f"c{i}", "turns": [("user", words(i, 4 + i % 5)), ("assistant", words(i + 50, 6 + i % 7)),
                                       ("user", words(i + 3, 3))]} for i in range(40)]
    cfg = OmegaConf.create({
        "seed": 0, "resume": True,
        "drafter": {"kind": "eagle", "name": "tiny_eagle", "draft_vocab": 64, "init": "random", "ttt_steps": 2,
                    "cls_weight": 0.1, "noise": 0.0},
        "features": {"respond": 12, "conversations": 20, "max_prompt_tokens": 32, "max_tokens": 40,
                     "max_new_tokens": 10, "temperature": 0.0, "layers": ["final"], "gen_bs": 6, "teacher_bs": 8,
                     "shard_size": 12, "seed": 0, "sources": None, "dir": str(root / "features")},
        "train": {"steps": 40, "batch_size": 4, "seq_len": 48, "lr": 3e-3, "weight_decay": 0.0, "warmup": 3,
                  "grad_clip": 1.0, "save_every": 10, "eval_frac": 0.15, "train_on_prompt": True},
    })
    return target, tok, convs, cfg, root


def patch_eval_slice(monkeypatch, convs):
    """The feature set's overlap filters on the tiny data: the first conversation's opening turn
    stands for a prompt of the evaluation slice, no benchmark text."""
    from specbench.train import features

    monkeypatch.setattr(features, "eval_first_turns", lambda: {features._norm(convs[0]["turns"][0][1])[:160]})
    monkeypatch.setattr(features, "benchmark_texts", lambda: [])
    return features


def frozen_target8():
    """An 8-layer tiny target (three distinct EAGLE-3 tap layers), frozen for training drafters on it."""
    target = tiny_llama(seed=0, layers=8, scale=4.0)
    for p in target.parameters():
        p.requires_grad_(False)
    return target


def _features(feature_setup, monkeypatch):
    target, tok, convs, cfg, root = feature_setup
    features = patch_eval_slice(monkeypatch, convs)
    return features, features.build(target, tok, "tiny", cfg.features, DEVICE, torch.float32, progress=False, convs=convs)


def test_feature_set(feature_setup, monkeypatch):
    target, tok, convs, cfg, root = feature_setup
    features, fs = _features(feature_setup, monkeypatch)
    assert sorted(p.name for p in fs.glob("shard_*.pt")) == ["shard_0000.pt", "shard_0001.pt", "shard_0002.pt"]
    items = features.load(fs)
    st = features.stats(items)
    assert st["sequences"] == 32 and st["answered"] == 12
    assert "c0" not in {it["id"] for it in items}  # the evaluation-slice duplicate was dropped
    import json
    assert json.loads((fs / "meta.json").read_text())["dropped"]["eval_slice_duplicate"] == 1
    ans = next(it for it in items if it["answered"])
    plen = ans["prompt_len"]
    assert ans["tokens"][plen:].tolist() == reference_greedy(target, ans["tokens"][:plen].tolist(),
                                                             len(ans["tokens"]) - plen)
    conv = next(it for it in items if not it["answered"])
    assert len(conv["tokens"]) == conv["prompt_len"] <= 40  # whole conversation, cut at max_tokens
    # the stored features are the target's final hidden states (fp16)
    with Tap(target, ["final"]) as tap:
        target(conv["tokens"][None].long())
        want = tap.take()["final"][0]
    assert torch.allclose(conv["hidden"]["final"].float(), want, atol=2e-2)
    # a second build does no target work
    mtimes = {p: p.stat().st_mtime for p in fs.glob("shard_*.pt")}
    _features(feature_setup, monkeypatch)
    assert mtimes == {p: p.stat().st_mtime for p in fs.glob("shard_*.pt")}


def test_a_feature_set_of_other_layers_reuses_the_answers(feature_setup, monkeypatch):
    """Storing other layers of the same sequences costs a teacher pass only: the answered
    sequences come from the set already built, and no token is generated again."""
    import json

    target, tok, convs, cfg, root = feature_setup
    features, fs = _features(feature_setup, monkeypatch)
    from specbench.decode.engine import Engine

    def no_generation(*a, **k):
        raise AssertionError("answers generated again")

    monkeypatch.setattr(Engine, "generate", no_generation)
    other = OmegaConf.merge(cfg.features, {"layers": [1, "final"]})
    fs2 = features.build(target, tok, "tiny", other, DEVICE, torch.float32, progress=False, convs=convs)
    assert fs2 != fs
    a, b = features.load(fs), features.load(fs2)
    assert [x["tokens"].tolist() for x in a] == [x["tokens"].tolist() for x in b]
    assert [x["prompt_len"] for x in a] == [x["prompt_len"] for x in b]
    assert set(b[0]["hidden"]) == {"1", "final"}
    with Tap(target, [1]) as tap:
        target(b[0]["tokens"][None].long())
        want = tap.take()[1][0]
    assert torch.allclose(b[0]["hidden"]["1"].float(), want, atol=2e-2)
    assert json.loads((fs2 / "meta.json").read_text())["answers_from"] == {p.name: fs.name for p in fs.glob("shard_*")}
    # no donor: other sequences, another rendering, or the same ids with other prompt tokens
    for change, kw in (({"max_new_tokens": 9}, {}), ({"layers": [2, "final"]}, {"chat": False})):
        with pytest.raises(AssertionError, match="generated again"):
            features.build(target, tok, "tiny", OmegaConf.merge(other, change), DEVICE, torch.float32, progress=False,
                           convs=convs, **kw)
    src = torch.load(fs / "sources.pt", weights_only=False)
    j = next(i for i, it in enumerate(src["items"]) if it["answer"])
    src["items"][j]["tokens"] = src["items"][j]["tokens"].flip(0)
    torch.save(src, root / "other-sources.pt")
    with pytest.raises(AssertionError, match="generated again"):
        features.build(target, tok, "tiny", OmegaConf.merge(other, {"layers": [3, "final"],
                                                                    "sources": str(root / "other-sources.pt")}),
                       DEVICE, torch.float32, progress=False, convs=convs)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_trainer_end_to_end(feature_setup, monkeypatch, kind):
    from specbench import drafters
    from specbench.train import heads

    target, tok, convs, cfg, root = feature_setup
    features, fs = _features(feature_setup, monkeypatch)
    items = features.load(fs)
    dr = cfg.drafter if kind == "eagle" else {"kind": "medusa", "name": "tiny_medusa", "heads": 3, "draft_vocab": 64,
                                                "tree_size": 8}
    c = OmegaConf.merge(cfg, {"drafter": dr})
    if kind == "medusa":
        c.drafter = OmegaConf.create(dr)
    untrained = OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}})
    out0, out = root / f"{kind}0", root / kind
    out0.mkdir()
    out.mkdir()
    before = heads.train(untrained, target, None, items, out0, {2}, DEVICE, progress=False)["summary"]
    res = heads.train(c, target, None, items, out, {2}, DEVICE, progress=False)
    s = res["summary"]
    assert s["eval_loss"] < before["eval_loss"]  # it learned
    assert len(s["eval_top1_agreement"]) == (4 if kind == "eagle" else 3)  # per unrolled step / per head
    heads.finish(c, res, out, "tiny", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m specbench.train")
    assert drafters.is_draft_checkpoint(out) and (out / "README.md").read_text().startswith(f"# tiny_{kind}")
    d = drafters.load(out, target, DEVICE, torch.float32, kind=kind)
    with pytest.raises(ValueError, match="not 'draft_lm'"):
        drafters.load(out, target, DEVICE, torch.float32, kind="draft_lm")
    # decoding with the trained drafter: token-identical to plain greedy, drafts accepted
    ps = [features.load(fs)[i]["tokens"][:8].tolist() for i in (0, 5)]
    refs = [reference_greedy(target, p, 16) for p in ps]
    if kind == "eagle":
        prop = Eagle(eagle_cfg(), target, None, DEVICE, torch.float32, drafter=d)
    else:
        prop = Medusa(medusa_cfg(), target, None, DEVICE, torch.float32, heads=d,
                      acc=drafters.read_meta(out)["acc"])
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == refs
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_feature_trainer_resumes(feature_setup, monkeypatch):
    from specbench.train import heads

    target, tok, convs, cfg, root = feature_setup
    features, fs = _features(feature_setup, monkeypatch)
    items = features.load(fs)
    c = OmegaConf.merge(cfg, {"train": {"steps": 20}})
    full_dir, part_dir = root / "full", root / "part"
    full_dir.mkdir()
    part_dir.mkdir()
    full = heads.train(c, target, None, items, full_dir, {2}, DEVICE, progress=False)
    real, calls = heads.eagle_loss, {"n": 0}

    def crash_after_10(*a, **k):
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(heads, "eagle_loss", crash_after_10)
    with pytest.raises(KeyboardInterrupt):
        heads.train(c, target, None, items, part_dir, {2}, DEVICE, progress=False)
    monkeypatch.setattr(heads, "eagle_loss", real)
    assert (part_dir / "_train_state.pt").exists()
    resumed = heads.train(c, target, None, items, part_dir, {2}, DEVICE, progress=False)
    a, b = full["draft"].own_state(), resumed["draft"].own_state()
    for k in a:
        if a[k].is_floating_point():
            assert torch.allclose(a[k], b[k], atol=1e-5), k


@pytest.mark.parametrize("version", [3, 3.1])
def test_eagle3_trainer_end_to_end(feature_setup, monkeypatch, version):
    """`drafter=eagle3` on an 8-layer target: features at the inputs of layers 2, 4 and 5 (and the
    final state for the teacher), training lowers the held-out loss, the checkpoint is written in
    SafeAILab's EAGLE-3 layout with its card, loads through eagle.version=3, and decoding with it
    is token-identical to plain greedy with drafts accepted. ``drafter.version=3.1`` trains and
    writes EAGLE 3.1 (its fc norms and fed-back post-norm state), read by eagle.version=3.1."""
    from specbench.drafters import formats
    from specbench.drafters.eagle3 import tap_layers
    from specbench.train import features, heads

    _, tok, convs, cfg, root = feature_setup
    target = frozen_target8()
    patch_eval_slice(monkeypatch, convs)
    c = OmegaConf.merge(cfg, {"drafter": {"kind": "eagle3", "name": "tiny_eagle3", "draft_vocab": 64, "ttt_steps": 2,
                                          "version": version},
                              "features": {"layers": [*tap_layers(8), "final"], "dir": str(root / "features3")},
                              "train": {"steps": 60}})
    fs = features.build(target, tok, "tiny8", c.features, DEVICE, torch.float32, progress=False, convs=convs)
    items = features.load(fs)
    assert set(items[0]["hidden"]) == {"1", "3", "4", "final"}
    out0, out = root / f"eagle{version}_0", root / f"eagle{version}"
    out0.mkdir()
    out.mkdir()
    before = heads.train(OmegaConf.merge(c, {"train": {"steps": 1, "lr": 1e-9}}), target, None, items, out0, {2}, DEVICE,
                         progress=False)["summary"]
    res = heads.train(c, target, None, items, out, {2}, DEVICE, progress=False)
    assert res["summary"]["eval_loss"] < before["eval_loss"]  # it learned
    assert len(res["summary"]["eval_top1_agreement"]) == 4  # per unrolled step
    heads.finish(c, res, out, "tiny8", {**features.stats(items), "dropped": {}, "key": "k"}, "python -m specbench.train")
    assert formats.detect(out) == "eagle3" and (out / "README.md").read_text().startswith("# tiny_eagle3")
    assert formats.eagle3.version(out) == version and f"eagle.version={version} " in (out / "README.md").read_text()
    cfg3 = eagle_cfg(version=version, checkpoint=str(out))
    cfg3.model = {"name": "tiny8", "path": "tiny8"}
    Eagle.check(cfg3, target.config)
    prop = Eagle(cfg3, target, None, DEVICE, torch.float32)
    assert prop.describe()["draft_vocab"] == 64 and prop.hidden_layers == (1, 3, 4)
    ps = [items[i]["tokens"][:8].tolist() for i in (0, 5)]
    refs = [reference_greedy(target, p, 16) for p in ps]
    got = run_engine(target, prop, ps, 16)
    assert [r.tokens for r in got] == refs
    assert sum(sum(r.accept_lens) for r in got) > 0


def test_eagle3_tree_expansion_matches_training_unroll():
    """With top_k=1 EAGLE-3's tree is a chain; each drafted token is what its training-time
    unrolling predicts from the same real prefix (inference and training agree)."""
    from specbench.methods.base import BatchState
    from specbench.drafters.eagle3 import Eagle3Drafter, layer_config
    from specbench.decode.hidden import Hidden

    target = tiny_llama(seed=0, layers=8, scale=4.0)
    torch.manual_seed(3)
    d = Eagle3Drafter(target, layer_config(target.config, 96), 96)
    with torch.no_grad():
        for p in d.parameters():
            p.normal_(0, 0.3)
    d.eval()
    prompt = prompts_of([9], seed=5)[0]
    seq = prompt + reference_greedy(target, prompt, 1)
    with Tap(target, d.taps) as tap:
        target(torch.tensor([seq[:-1]]))
        got = tap.take()
    f = torch.cat([got[t] for t in d.taps], dim=-1)
    depth = 4
    prop = Eagle(eagle_cfg(top_k=1, depth=depth, total_tokens=depth), target, None, DEVICE, torch.float32, drafter=d)
    st = BatchState(seqs=[list(seq)], prompt_lens=[len(prompt)], sampling=Sampling(), gen=None, device=DEVICE)
    prop.start(st, Hidden({t: got[t] for t in d.taps}, torch.tensor([f.shape[1]])))
    chain = prop.propose(st).tokens[0].tolist()
    assert unrolled_chain(d, f, seq, depth) == chain
