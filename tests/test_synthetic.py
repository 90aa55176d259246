"""accept=synthetic: acceptance drawn at given per-depth rates instead of the target's verdict
(performance modelling on random-weight models). Measured acceptance per position matches the
rates (binomial bounds), tau matches the closed form for chains and for trees (whose lower-ranked
children pass at the published sibling profile), a wider tree gains over a chain exactly what the
rule implies, every method runs under it, and the record says it is lossy and with which rates."""

import math

import pytest
import torch

import test_serving
from helpers import serve_engine
from specbench.decode.tree import Draft
from specbench.decode.verify import Sampling, Synthetic, verify
from helpers import tiny_cfg

datastore = test_serving.datastore
cases = test_serving.cases
model = test_serving.model
refs = test_serving.refs


def close(hits: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """``hits`` successes in ``n`` Bernoulli(p) trials lie within ``sigmas`` standard deviations."""
    return abs(hits - n * p) <= sigmas * math.sqrt(max(n * p * (1 - p), 1e-9)) + 1e-9


def test_chain_acceptance_per_position_and_tau_match_the_rates():
    B, n, V = 20000, 4, 13
    rates = [0.9, 0.6, 0.5, 0.2]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, n + 1, V, generator=g)
    tokens = torch.randint(0, V, (B, n), generator=g)
    v = verify(logits, Draft.chain(tokens), Sampling(synthetic=Synthetic(rates, seed=3)), None)
    n_acc = torch.tensor([len(a) for a in v.accepted])
    run = 1.0
    for i in range(1, n + 1):
        run *= rates[i - 1]
        assert close(int((n_acc >= i).sum()), B, run)  # marginal alpha_i = prod of the rates up to i
        reached = int((n_acc >= i - 1).sum())
        assert close(int((n_acc >= i).sum()), reached, rates[i - 1])  # conditional: the rate itself
    tau = 1 + n_acc.double().mean().item()
    want = Synthetic(rates).expected_tau(n)
    assert want == pytest.approx(1 + 0.9 + 0.54 + 0.27 + 0.054)
    assert abs(tau - want) < 5 * n_acc.double().std().item() / math.sqrt(B)
    for b in range(50):  # accepted: the drafts' prefix; extra: the target's argmax after it
        k = len(v.accepted[b])
        assert v.accepted[b] == tokens[b, :k].tolist()
        assert int(v.extra[b]) == int(logits[b, k].argmax())
    assert v.counts.tolist() == (n_acc + 1).tolist()


def test_a_scalar_rate_holds_at_every_depth_and_rates_past_the_list_repeat_the_last():
    B, n, V = 20000, 3, 7
    logits = torch.zeros(B, n + 1, V)
    tokens = torch.zeros(B, n, dtype=torch.long)
    for rates, want in ((0.5, [0.5, 0.25, 0.125]), ([0.8, 0.5], [0.8, 0.4, 0.2])):
        v = verify(logits, Draft.chain(tokens), Sampling(synthetic=Synthetic(rates, seed=1)), None)
        n_acc = torch.tensor([len(a) for a in v.accepted])
        for i, p in enumerate(want, start=1):
            assert close(int((n_acc >= i).sum()), B, p)


def test_with_sibling_rates_0_a_tree_walks_its_first_candidate_children():
    # root -> 1 (invalid), 2, 3;  2 -> 4, 5;  4 -> 6;  3 -> 7.  First-candidate path: 2, 4, 6
    B, V = 20000, 11
    parents = torch.tensor([[0, 0, 0, 2, 2, 4, 3]]).expand(B, -1).clone()
    valid = torch.tensor([[False, True, True, True, True, True, True]]).expand(B, -1).clone()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (B, 7), generator=g)
    logits = torch.randn(B, 8, V, generator=g)
    rates = [0.8, 0.5, 0.9]
    v = verify(logits, Draft(tokens=tokens, parents=parents, valid=valid),
               Sampling(synthetic=Synthetic(rates, 2, sibling_rates=0.0)), None)
    path = [2, 4, 6]
    n_acc = torch.tensor([len(a) for a in v.accepted])
    for b in range(B):
        k = len(v.accepted[b])
        assert v.accepted[b] == [int(tokens[b, i - 1]) for i in path[:k]]
        if b < 50:
            assert v.keep[b, :k + 1].tolist() == [0] + path[:k]
            assert int(v.extra[b]) == int(logits[b, ([0] + path)[k]].argmax())
    for i, p in enumerate([0.8, 0.4, 0.36], start=1):
        assert close(int((n_acc >= i).sum()), B, p)


# Published sibling profile (the default): Medusa's first head on Vicuna-7B v1.3, top-1..top-5
# accuracy (FasterDecoding/Medusa, assets/medusa_acc.csv,
# run test_medusa_mlp_vicuna-7b-v1.3_medusa_5_lr_0.001_layers_1).
MEDUSA_7B_HEAD0_TOPK = [0.5603876709938049, 0.6717196702957153, 0.7271371483802795, 0.7599403262138367,
                        0.7799453139305115]
PUBLISHED = [0.253, 0.169, 0.120, 0.083]  # rank k's conditional: (top_k - top_{k-1}) / (1 - top_{k-1})

# A fixed tree three deep, 1-3 candidate children a node; node 1 is padding (never a candidate,
# so it takes no rank). Nodes 1..16, node i's parent at TREE[i-1].
#   root -> 2 (rank 1), 3 (2), 4 (3);  2 -> 5, 6;  3 -> 7, 8;  4 -> 9;
#   5 -> 10, 11, 12;  6 -> 13;  7 -> 14, 15;  9 -> 16
TREE = [0, 0, 0, 0, 2, 2, 3, 3, 4, 5, 5, 5, 6, 7, 7, 9]
TREE_VALID = [False] + [True] * 15
RANK = {2: 1, 3: 2, 4: 3, 5: 1, 6: 2, 7: 1, 8: 2, 9: 1, 10: 1, 11: 2, 12: 3, 13: 1, 14: 1, 15: 2, 16: 1}


def implied(parents, valid, rates, sib):
    """The rule's probability that each node (1..n) is on the accepted path, by hand: the parent's,
    times its earlier-ranked siblings all failing, times its own rate (rank 1: its depth's rate;
    rank k: sib[k-2]; the last entry of each list repeats)."""
    reach, depth, kids = {0: 1.0}, {0: 0}, {}
    for i, p in enumerate(parents, start=1):
        depth[i] = depth[p] + 1
        if not valid[i - 1]:
            reach[i] = 0.0
            continue
        kids[p] = kids.get(p, 0) + 1
        k = kids[p]
        rs = [rates[min(depth[i] - 1, len(rates) - 1)]] + [sib[min(j, len(sib) - 1)] for j in range(k - 1)]
        reach[i] = reach[p] * math.prod(1 - r for r in rs[:-1]) * rs[-1]
    return [reach[i] for i in range(1, len(parents) + 1)]


def _run_tree(parents, valid, syn, B=20000, V=11, seed=7):
    g = torch.Generator().manual_seed(seed)
    n = len(parents)
    tokens = torch.randint(0, V, (B, n), generator=g)
    logits = torch.randn(B, n + 1, V, generator=g)
    d = Draft(tokens=tokens, parents=torch.tensor([parents]).expand(B, -1).clone(),
              valid=torch.tensor([valid]).expand(B, -1).clone())
    return verify(logits, d, Sampling(synthetic=syn), None), tokens, logits


def test_sibling_rates_default_to_the_published_profile():
    prev, want = MEDUSA_7B_HEAD0_TOPK[0], []
    for t in MEDUSA_7B_HEAD0_TOPK[1:]:
        want.append(round((t - prev) / (1 - prev), 3))
        prev = t
    assert want == PUBLISHED
    assert Synthetic(0.5).sibling_rates == PUBLISHED
    from omegaconf import OmegaConf

    from specbench.paths import CONF_DIR

    assert list(OmegaConf.load(CONF_DIR / "accept" / "synthetic.yaml").sibling_rates) == PUBLISHED


def test_tree_acceptance_at_every_node_and_tau_match_what_the_rates_imply():
    """The rule at every node of a fixed tree (three deep, 1-3 children a node), default sibling
    profile: each node is on the accepted path as often as the product along its path says
    (within 5 sigma over 20000 rows), tau matches 1 + their sum, and so does ``expected_tau``."""
    B, rates = 20000, [0.6, 0.5, 0.4]
    v, tokens, logits = _run_tree(TREE, TREE_VALID, Synthetic(rates, seed=11), B)
    p = implied(TREE, TREE_VALID, rates, PUBLISHED)
    # by hand: node 3 (rank 2 at depth 1), node 12 (rank 3 under 5, rank 1 under 2), node 16
    assert p[2] == pytest.approx(0.4 * 0.253)
    assert p[11] == pytest.approx(0.6 * 0.5 * (0.6 * 0.747 * 0.169))
    assert p[15] == pytest.approx(0.4 * 0.747 * 0.169 * 0.5 * 0.4)
    kept = torch.arange(v.keep.shape[1])[None] < v.counts[:, None]  # keep's entries past counts: padding
    on = torch.zeros(B, len(TREE) + 1, dtype=torch.long).scatter_(1, torch.where(kept, v.keep, 0), 1)
    for i in range(1, len(TREE) + 1):
        assert close(int(on[:, i].sum()), B, p[i - 1]), (i, int(on[:, i].sum()) / B, p[i - 1])
    n_acc = torch.tensor([len(a) for a in v.accepted], dtype=torch.double)
    want = 1 + sum(p)
    assert abs(1 + n_acc.mean().item() - want) < 5 * n_acc.std().item() / math.sqrt(B)
    assert Synthetic(rates).expected_tau(TREE, candidate=TREE_VALID) == pytest.approx(want)
    for b in range(50):  # accepted: the path's tokens; extra: the target's argmax at its end
        path = v.keep[b, 1:int(v.counts[b])].tolist()
        assert v.accepted[b] == [int(tokens[b, i - 1]) for i in path]
        assert all(TREE[c - 1] == a for a, c in zip([0] + path, path))  # a path from the root
        assert int(v.extra[b]) == int(logits[b, ([0] + path)[-1]].argmax())


def test_a_wider_tree_gains_over_a_chain_at_the_same_rates_exactly_what_the_rule_implies():
    """At the same per-depth rates a chain three deep and the tree above (the chain is its
    first-child path) differ in tau by the sibling nodes' summed probabilities; with sibling rates
    0 the tree is priced as the chain (the rule before siblings counted)."""
    B, rates = 20000, [0.7, 0.6, 0.5]
    chain = Synthetic(rates).expected_tau(3)
    assert chain == pytest.approx(1 + 0.7 + 0.42 + 0.21)
    p = implied(TREE, TREE_VALID, rates, PUBLISHED)
    gain = sum(p) - (0.7 + 0.42 + 0.21)
    assert gain == pytest.approx(sum(p[i - 1] for i in RANK if i not in (2, 5, 10)))  # the first-child path: 2, 5, 10
    assert gain > 0.25
    g = torch.Generator().manual_seed(3)
    tc = verify(torch.randn(B, 4, 7, generator=g), Draft.chain(torch.randint(0, 7, (B, 3), generator=g)),
                Sampling(synthetic=Synthetic(rates, seed=4)), None)
    tt, _, _ = _run_tree(TREE, TREE_VALID, Synthetic(rates, seed=5), B)
    lc, lt = (torch.tensor([len(a) for a in v.accepted], dtype=torch.double) for v in (tc, tt))
    assert abs((lt.mean() - lc.mean()).item() - gain) < 5 * math.sqrt(lc.var().item() / B + lt.var().item() / B), \
        ((lt.mean() - lc.mean()).item(), gain)
    tz, _, _ = _run_tree(TREE, TREE_VALID, Synthetic(rates, seed=6, sibling_rates=0.0), B)
    lz = torch.tensor([len(a) for a in tz.accepted], dtype=torch.double)
    assert abs((lz.mean() - lc.mean()).item()) < 5 * math.sqrt(lc.var().item() / B + lz.var().item() / B)
    assert Synthetic(rates, sibling_rates=0.0).expected_tau(TREE, candidate=TREE_VALID) == pytest.approx(chain)
    assert Synthetic(rates).expected_tau(TREE, candidate=TREE_VALID) == pytest.approx(chain + gain)


def test_a_tree_of_single_children_is_accepted_as_the_same_chain():
    """A tree whose nodes have one child each is the chain: the same seed accepts the same
    lengths whichever way the draft is written."""
    B, n, V = 4000, 5, 9
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (B, n), generator=g)
    logits = torch.randn(B, n + 1, V, generator=g)
    rates = [0.9, 0.7, 0.5]
    chain = verify(logits, Draft.chain(tokens), Sampling(synthetic=Synthetic(rates, seed=8)), None)
    tree = verify(logits, Draft(tokens=tokens, parents=torch.arange(n)[None].expand(B, n).clone()),
                  Sampling(synthetic=Synthetic(rates, seed=8)), None)
    assert tree.accepted == chain.accepted and tree.extra.tolist() == chain.extra.tolist()


def test_non_candidate_nodes_are_never_accepted():
    B, V = 4000, 9
    parents = torch.tensor([[0, 0, 2]]).expand(B, -1).clone()
    cand = torch.tensor([[False, True, True]]).expand(B, -1).clone()  # node 1: a Jacobi-window node
    tokens = torch.randint(0, V, (B, 3))
    d = Draft(tokens=tokens, parents=parents, candidate=cand)
    v = verify(torch.randn(B, 4, V), d, Sampling(synthetic=Synthetic(1.0)), None)
    assert all(a == [int(tokens[b, 1]), int(tokens[b, 2])] for b, a in enumerate(v.accepted))


def test_rates_are_checked():
    for bad in ([], [1.5], -0.1):
        with pytest.raises(ValueError, match="accept.rates"):
            Synthetic(bad)
        with pytest.raises(ValueError, match="accept.sibling_rates"):
            Synthetic(0.5, sibling_rates=bad)


@pytest.mark.parametrize("name", ["pld", "leviathan_self", "eagle", "medusa", "lookahead", "rest", "specdec",
                                  "sam", "suffix", "recycle", "combo"])
def test_every_method_runs_under_synthetic_acceptance_with_rows_joining(model, refs, datastore, name):
    prompts, want = refs
    truth = {tuple(p): r + [0] * 8 for p, r in zip(prompts, want)}
    prop = test_serving.make(name, model, truth, datastore)
    res, eng = serve_engine(model, prop, prompts, test_serving.N_NEW, concurrency=3,
                            sampling=Sampling(synthetic=Synthetic(1.0, seed=0)))
    for r in res:
        assert len(r.tokens) == test_serving.N_NEW
        assert all(a <= d for a, d in zip(r.accept_lens, r.drafted))
    # rate 1: every first-candidate path is taken whole: at least one draft per drafted step
    steps = [(a, d) for r in res for a, d in zip(r.accept_lens[:-1], r.drafted[:-1]) if d > 0]
    assert steps and all(a >= 1 for a, _ in steps)


def test_a_synthetic_job_is_recorded_lossy_and_pairs_with_plain_ar(tiny_dirs, tmp_path):
    from specbench.run import runner

    cfg = tiny_cfg(tiny_dirs, tmp_path, **{"method": {"name": "pld", "max_ngram": 3, "min_ngram": 1},
                                         "accept": {"name": "synthetic", "rates": [0.9, 0.5]},
                                         "ar_baseline": "paired", "K": 3})
    ar, rec = runner.run(cfg, sweep_id="synth")
    assert ar["method"] == "ar" and "accept" not in ar and ar["lossless"] is True
    assert rec["accept"] == {"name": "synthetic", "rates": [0.9, 0.5], "sibling_rates": PUBLISHED}
    assert rec["lossless"] is False
    assert rec["ar_job_id"] == ar["job_id"] and rec["metrics"]["speedup"] > 0
    m = rec["metrics"]  # per position: the marginal rate and the conditional one; tau per step and per request
    a = m["accept_rate_per_pos"]
    assert m["accept_rate_per_pos_cond"][0] == a[0]
    assert all(c == pytest.approx(x / p) for c, x, p in zip(m["accept_rate_per_pos_cond"][1:], a[1:], a) if p)
    per = [1 + rq["accepted"] / rq["steps"] for rq in rec["requests"] if rq["steps"]]
    assert m["tau_per_request"] == pytest.approx(sum(per) / len(per))
    from specbench.run import records as R

    assert R.baseline_key(rec) == R.baseline_key(ar)  # AR decodes the same under it: it pairs
    plain = dict(rec)
    plain.pop("accept")
    assert R.job_key(plain) != R.job_key(rec)  # ... but a synthetic job is its own job (resume)
    from specbench.analysis.load import label

    assert label({"method": "pld", "accept": "synthetic", "accept_rates": [0.9, 0.5],
                  "accept_sibling_rates": PUBLISHED}) == "pld (synthetic 0.9/0.5)"


@pytest.mark.parametrize("over,msg", [
    ({"accept": {"name": "synthetic", "rates": 1.2}}, "accept.rates must be a probability"),
    ({"accept": {"name": "synthetic", "rates": []}}, "accept.rates must be a probability"),
    ({"accept": {"name": "synthetic", "rates": 0.8, "sibling_rates": [0.3, 1.5]}},
     "accept.sibling_rates must be a probability"),
    ({"accept": {"name": "synthetic", "rates": 0.8, "sibling_rates": []}},
     "accept.sibling_rates must be a probability"),
    ({"accept": {"name": "sometimes", "rates": None}}, "unknown accept.name 'sometimes'"),
])
def test_bad_synthetic_settings_are_refused_in_one_line(tiny_dirs, tmp_path, over, msg):
    from specbench.errors import ConfigError
    from specbench.run.validation import validate

    with pytest.raises(ConfigError, match=msg):
        validate(tiny_cfg(tiny_dirs, tmp_path, **over))


def _big_ops(logits, draft, s):
    """The torch ops of one verify that touch a tensor as large as the logits [B, N, V] (the
    accept phase's real cost: warping, sorting, picking over every node), by name and count."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    big = logits.numel()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
            if any(a.numel() >= big for a in flat):
                self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        verify(logits, draft, s, torch.Generator().manual_seed(0))
    return c.ops


@pytest.mark.parametrize("warp", [dict(), dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=5)])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_synthetic_verify_pays_the_real_rules_work(warp, shape):
    """Synthetic acceptance only overrides the decision: every op the real rule runs over the
    [B, N, V] logits (argmax, temperature, top-k/top-p sort, softmax) runs under it too, and it
    adds none but the selection of the rows it decided on."""
    B, n, V = 6, 4, 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, n + 1, V, generator=g)
    tokens = torch.randint(0, V, (B, n), generator=g)
    draft = Draft.chain(tokens) if shape == "chain" else \
        Draft(tokens=tokens, parents=torch.tensor([[0, 0, 1, 1]] * B))
    real = _big_ops(logits, draft, Sampling(**warp))
    synth = _big_ops(logits, draft, Sampling(**warp, synthetic=Synthetic([0.7], seed=1)))
    assert real and not real - synth, (real, synth)
    assert set(synth - real) <= {"aten.index", "aten.select", "aten.slice", "aten.view"}, synth - real
