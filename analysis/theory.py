"""The bounds measured speedups are compared against (docs/design.md section 5).

- Leviathan et al. 2023 (arXiv 2211.17192), i.i.d. acceptance alpha, draft length gamma,
  cost ratio c = draft step time / target step time:
      E[tokens per step] = (1 - alpha^(gamma+1)) / (1 - alpha)
      S = (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1))
- per-position form: E[tokens per step] = 1 + sum_i alpha_i
- batch-aware form: S(b) = tau T_ar(b) / (T_draft(b) + T_verify(b, n_nodes)), the T's from
  the target's measured cost curve; over a whole job, the measured prefill of each side is
  added to its decode time at those step costs (``batch_aware_job``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan's E[tokens per step] for i.i.d. acceptance alpha and gamma drafts."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError("gamma must be >= 0")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan's expected walltime improvement S."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def per_position_tokens(alphas: Sequence[float]) -> float:
    """E[tokens per step] = 1 + sum_i alpha_i from measured acceptance per position."""
    return 1.0 + float(sum(alphas))


def alpha_from_positions(alphas: Sequence[float]) -> float:
    """The i.i.d. alpha that best explains per-position rates: accepted / attempted drafts
    (position i is attempted exactly when position i-1 was accepted; alpha_0 = 1)."""
    if not alphas:
        return 0.0
    attempted = 1.0 + sum(alphas[:-1])
    return float(sum(alphas)) / attempted


def alpha_from_tau(tau: float, gamma: int, tol: float = 1e-10) -> float:
    """Invert E[tokens] = tau for alpha (bisection)."""
    if tau <= 1.0:
        return 0.0
    if tau >= gamma + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens(mid, gamma) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def batch_aware_speedup(tau: float, t_ar: float, t_draft: float, t_verify: float) -> float:
    """S(b) = tau T_ar(b) / (T_draft(b) + T_verify(b, n_nodes))."""
    denom = t_draft + t_verify
    if denom <= 0:
        return math.nan
    return tau * t_ar / denom


def batch_aware_job(tau: float, t_ar: float, t_draft: float, t_verify: float, bs: int,
                    tokens: float, decoded: float, prefill_s: float,
                    tokens_ar: float, decoded_ar: float, prefill_ar_s: float) -> float:
    """The batch-aware bound over a whole job, as its speedup is measured (tokens/s with the
    prefill inside the wall time): each side's measured prefill plus its decoded tokens (the
    ones after the prefill's first) at the bound's step costs, ``decoded / (tau bs)`` steps of
    ``T_draft + T_verify`` against ``decoded_ar / bs`` steps of ``T_ar``. Without prefill it
    is ``batch_aware_speedup``; a prefill share p of AR's time caps it at 1/p (Amdahl)."""
    method = prefill_s + decoded / (tau * bs) * (t_draft + t_verify)
    ar = prefill_ar_s + decoded_ar / bs * t_ar
    if method <= 0 or ar <= 0 or tokens_ar <= 0:
        return math.nan
    return (tokens / method) / (tokens_ar / ar)


def tree_expected_tokens(parents: Sequence[int], accept: Sequence[float]) -> float:
    """Sequoia's expected tokens for a tree: 1 + sum over nodes of the product of the
    conditional acceptance probabilities along the node's path. parents[i] is node i+1's
    parent (0 = root); accept[i] is node i+1's acceptance given its parent was accepted."""
    reach = [1.0]
    for p, a in zip(parents, accept):
        reach.append(reach[p] * a)
    return float(sum(reach))


def batch_units(requests: Sequence[dict], bs: int) -> dict:
    """Requests grouped by the batch that decoded them (``batch`` in the record; older
    records: runs of ``bs`` distinct question ids in record order). Per unit: tokens and
    wall time (per turn, the slowest row's, since a batch's rows share the clock)."""
    units: dict = {}
    order: list = []
    for r in requests:
        b = r.get("batch")
        if b is None:
            qid = r["id"]
            if qid not in order:
                order.append(qid)
            b = order.index(qid) // max(1, bs)
        b = (r.get("repeat", 0), b)  # repeats=N: every pass over the prompt set has its own batches
        u = units.setdefault(b, {"tokens": 0, "turn_s": {}})
        u["tokens"] += int(r["new_tokens"])
        u["turn_s"][r["turn"]] = max(u["turn_s"].get(r["turn"], 0.0), float(r["wall_s"]))
    return {b: (u["tokens"], sum(u["turn_s"].values())) for b, u in units.items()}


def bootstrap_speedup(reqs: Sequence[dict], ar_reqs: Sequence[dict], bs: int, n: int = 2000,
                      level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the speedup (tokens/s ratio against AR on the same
    prompts), resampling batches, the independent units of a job: at bs > 1 a request's
    wall time is its time inside a shared batch, not an independent draw. Each draw takes
    the same batches from the method and from AR (paired). ``repeats=N`` re-times the same
    prompts: a batch is drawn with all its repeats (they are not independent prompts, and more
    of them must not narrow the interval). None with fewer than 2 batches."""
    import random

    a, b = batch_units(reqs, bs), batch_units(ar_reqs, bs)
    units = sorted(set(a) & set(b))
    batches: dict = {}  # batch -> its (repeat, batch) units
    for k in units:
        batches.setdefault(k[1], []).append(k)
    clusters = [batches[k] for k in sorted(batches)]
    if len(clusters) < 2:
        return None
    rng = random.Random(seed)
    ratios = []
    for _ in range(n):
        pick = [k for _ in clusters for k in clusters[rng.randrange(len(clusters))]]
        tm, sm = sum(a[k][0] for k in pick), sum(a[k][1] for k in pick)
        ta, sa = sum(b[k][0] for k in pick), sum(b[k][1] for k in pick)
        if sm > 0 and sa > 0 and ta > 0:
            ratios.append((tm / sm) / (ta / sa))
    ratios.sort()
    lo = ratios[int((1 - level) / 2 * (len(ratios) - 1))]
    hi = ratios[int((1 + level) / 2 * (len(ratios) - 1))]
    return lo, hi
