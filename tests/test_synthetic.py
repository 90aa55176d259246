"""accept=synthetic: acceptance drawn at given per-depth rates instead of the target's verdict
(performance modelling on random-weight models). Measured acceptance per position matches the
rates (binomial bounds), tau matches the closed form, the walk follows each depth's first
candidate, every method runs under it, and the record says it is lossy."""

import math

import pytest
import torch

import test_serving
from helpers import serve_engine
from specbench.decode.tree import Draft
from specbench.decode.verify import Sampling, Synthetic, verify
from test_config import tiny_cfg

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


def test_tree_walk_follows_the_first_candidate_child_at_each_depth():
    # root -> 1 (invalid), 2, 3;  2 -> 4, 5;  4 -> 6;  3 -> 7.  First-candidate path: 2, 4, 6
    B, V = 20000, 11
    parents = torch.tensor([[0, 0, 0, 2, 2, 4, 3]]).expand(B, -1).clone()
    valid = torch.tensor([[False, True, True, True, True, True, True]]).expand(B, -1).clone()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (B, 7), generator=g)
    logits = torch.randn(B, 8, V, generator=g)
    rates = [0.8, 0.5, 0.9]
    v = verify(logits, Draft(tokens=tokens, parents=parents, valid=valid), Sampling(synthetic=Synthetic(rates, 2)),
               None)
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
    ar, rec = runner.job(cfg, sweep_id="synth")
    assert ar["method"] == "ar" and "accept" not in ar and ar["lossless"] is True
    assert rec["accept"] == {"name": "synthetic", "rates": [0.9, 0.5]} and rec["lossless"] is False
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

    assert label({"method": "pld", "accept": "synthetic", "accept_rates": [0.9, 0.5]}) == "pld (synthetic 0.9/0.5)"


@pytest.mark.parametrize("over,msg", [
    ({"accept": {"name": "synthetic", "rates": 1.2}}, "accept.rates must be a probability"),
    ({"accept": {"name": "synthetic", "rates": []}}, "accept.rates must be a probability"),
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
