"""Verification rules (docs/design.md section 3): walk each row's draft tree against the
target's outputs and return the accepted path plus one extra token.

One rule covers every lossless sampling case. At a node whose target distribution is p,
children are tried in order; child c with token x and draft distribution q_c is accepted
with probability min(1, p(x) / q_c(x)); on rejection p <- norm(max(0, p - q_c)). If no
child is accepted the extra token is drawn from what is left of p (the bonus from the
untouched p when the node has no children).
- a chain with q is Leviathan / Chen speculative sampling;
- a deterministic candidate (no q) is q_c = one-hot(x): accept with p(x), then zero p(x)
  and renormalise;
- siblings sampled without replacement carry, each, the q they were drawn from (the
  draft's q with earlier siblings removed): recursive rejection sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specbench import accel
from specbench.decode.tree import Draft
from specbench.decode.walk import Verdict, chain_keep, path_tensors, verdict, walk


def greedy_pick(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first index on ties, as torch's). For fp32 CPU logits: through
    the native extension where this process has loaded it (each thread scans the share of the
    columns its core's output layer wrote, while they are in its cache), else numpy's (torch's CPU
    argmax is several times slower; docs/cpu-backend.md). A decode step takes one
    argmax per row per forward."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(-1)
    argmax_rows = accel.argmax_rows
    if argmax_rows is not None and logits.dim() >= 1 and logits.shape[-1] > 0 and logits.stride(-1) == 1 \
            and (logits.dim() <= 2 or logits.is_contiguous()):
        return argmax_rows(logits.reshape(-1, logits.shape[-1])).view(logits.shape[:-1])
    return torch.from_numpy(np.asarray(np.argmax(logits.numpy(), axis=-1)))


# Published profile of lower-ranked siblings (``accept.sibling_rates``' default): Medusa's first head
# (Vicuna-7B v1.3, 5 heads, 1 layer; FasterDecoding/Medusa, assets/medusa_acc.csv, run
# test_medusa_mlp_vicuna-7b-v1.3_medusa_5_lr_0.001_layers_1, the authors' training log of Aug 2023)
# predicts the token one past the next with top-1..top-5 accuracy 0.5604, 0.6717, 0.7271, 0.7599, 0.7799.
# The rank-k candidate is the right one given ranks < k were not: (top_k - top_{k-1}) / (1 - top_{k-1}).
SIBLING_RATES = (0.253, 0.169, 0.120, 0.083)  # ranks 2, 3, 4, 5 (and lower: the last repeats)


def _probabilities(x, what: str) -> list[float]:
    xs = [float(r) for r in (x if isinstance(x, (list, tuple)) else [x])]
    if not xs or any(not 0.0 <= r <= 1.0 for r in xs):
        raise ValueError(f"{what} must be a probability or a non-empty list of them, got {xs}")
    return xs


class Synthetic:
    """Synthetic acceptance (``accept=synthetic``; vLLM has it for performance modelling): whatever
    the target says, a seeded draw decides each step how far the draft is accepted; the extra token
    is the target's own (argmax, or sampled) after the last accepted node. Drafting, the verify
    forward over every node, the KV commit and the timers run as usual, so a random-weight model
    costs what a trained one does at the acceptance a published profile gives. Lossy by
    construction: the output is not the target's.

    The rule, for chains and trees alike (Sequoia's positional acceptance assumption, arXiv
    2402.12374, tree construction: whether the k-th ranked child of an accepted node is accepted
    depends only on k; here also on its depth): from the root, at each accepted node its candidate
    children are tried in rank order (node index: methods list children best first) and the first
    to pass is accepted, the walk going on from it. The child of rank 1 at depth d passes with
    ``rates[d-1]`` (the last rate deeper); a child of rank k >= 2, its earlier siblings having
    failed, with ``sibling_rates[k-2]`` (the last one for lower ranks). A chain (one child a
    node) is accepted exactly as before siblings were priced: ``rates`` is the chain's conditional
    rate per depth, the rate at which a tree's first child, its drafter's top-1, is the target's
    token. The default ``sibling_rates`` is the published profile ``SIBLING_RATES`` (Medusa's
    first head, Vicuna-7B); ``sibling_rates=0`` prices a tree as its first-child chain.

    So a node v at depth d whose path takes ranks k_1..k_d is accepted with probability
    prod_j P(k_j at depth j) where P(k at depth j) = c_{j,k} prod_{i<k} (1 - c_{j,i}) (Sequoia's
    acceptance vector; c_{j,1} = rates[j-1], c_{j,k} = sibling_rates[k-2]), and the expected tokens
    a step are 1 + the sum of that over the tree's candidate nodes (``expected_tau``)."""

    def __init__(self, rates, seed: int = 0, sibling_rates=SIBLING_RATES):
        self.rates = _probabilities(rates, "accept.rates")
        self.sibling_rates = _probabilities(sibling_rates, "accept.sibling_rates")
        self.seed = int(seed)
        self._gen: torch.Generator | None = None
        self._rates: torch.Tensor | None = None
        self._sib: torch.Tensor | None = None

    def _stream(self, device) -> torch.Generator:
        if self._gen is None:  # one engine, one device: the stream is made once and runs on
            self._gen = torch.Generator(device).manual_seed(self.seed)
            self._rates = torch.tensor(self.rates, dtype=torch.float32, device=device)
            self._sib = torch.tensor(self.sibling_rates, dtype=torch.float32, device=device)
        return self._gen

    def draws(self, B: int, depth: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(uniforms [B, depth], the rate at each depth [depth]) on ``device``; one seeded stream."""
        gen = self._stream(device)
        idx = torch.arange(depth, device=device).clamp(max=len(self.rates) - 1)
        return torch.rand(B, depth, generator=gen, device=device), self._rates[idx]

    def node_rates(self, depth: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
        """The rate at which a node passes once its parent is accepted and its earlier-ranked
        siblings failed: depth [..] >= 1, rank [..] >= 1 among its parent's candidate children."""
        first = self._rates[(depth - 1).clamp(min=0, max=len(self.rates) - 1)]
        other = self._sib[(rank - 2).clamp(min=0, max=len(self.sibling_rates) - 1)]
        return torch.where(rank <= 1, first, other)

    def expected_tau(self, tree, candidate=None) -> float:
        """The mean accepted length (drafts accepted + 1) this rule gives a draft: ``tree`` an int
        K (a chain K deep: 1 + sum_i prod_{j<=i} a_j) or one tree's parents (node i's parent at
        ``tree[i-1]``, 0 the root, parents first; ``candidate``: False for nodes never accepted):
        1 + sum over the candidate nodes of the probability of their whole path (class doc)."""
        if isinstance(tree, int):
            tree = list(range(tree))
        parents = [int(p) for p in tree]
        cand = [True] * len(parents) if candidate is None else [bool(c) for c in candidate]
        reach, depth, kids = [1.0] + [0.0] * len(parents), [0] * (len(parents) + 1), {}
        for i, p in enumerate(parents, start=1):
            depth[i] = depth[p] + 1
            if not cand[i - 1]:
                continue
            k = kids.get(p, 0) + 1  # its rank among its parent's candidate children
            kids[p] = k
            rates = [self.rates[min(depth[i] - 1, len(self.rates) - 1)]] + \
                [self.sibling_rates[min(j, len(self.sibling_rates) - 1)] for j in range(k - 1)]
            miss = 1.0
            for c in rates[:-1]:
                miss *= 1.0 - c
            reach[i] = reach[p] * miss * rates[-1]
        return 1.0 + sum(reach[1:])


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    synthetic: Synthetic | None = None  # accept=synthetic: acceptance drawn at given rates (lossy)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def of(cls, cfg, synthetic: Synthetic | None = None) -> "Sampling":
        """A run config's ``sampling`` node (temperature, top_k, top_p), read whole; missing: greedy."""
        s = cfg.get("sampling") or {}
        return cls(float(s.get("temperature", 0.0) or 0.0), int(s.get("top_k", 0) or 0),
                   float(s.get("top_p", 1.0)), synthetic)


# top-p sorts each row (values in fp32, indices in int64, the cumulative sum, the scatter back):
# about 24 bytes a logit in temporaries. Rows are warped in chunks that keep those under this
# budget, so a [128, 65, 152k] verify needs the output's 5 GB, not 15 GB more.
WARP_CHUNK_BYTES = 1 << 28


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Temperature, top-k, top-p applied to logits [..., V] -> probabilities (float32). With
    top-p, rows go through in chunks (``WARP_CHUNK_BYTES`` of temporaries at most)."""
    V = logits.shape[-1]
    rows = max(1, WARP_CHUNK_BYTES // (24 * V))
    if s.top_p < 1.0 and logits.numel() // V > rows:
        flat = logits.reshape(-1, V)
        out = torch.empty(flat.shape, dtype=torch.float32, device=logits.device)
        for i in range(0, flat.shape[0], rows):
            out[i:i + rows] = _warp(flat[i:i + rows], s)
        return out.view(logits.shape)
    return _warp(logits, s)


def _warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    x = logits.float() / s.temperature
    if s.top_k and s.top_k > 0 and s.top_k < x.shape[-1]:
        kth = torch.topk(x, s.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        sx, si = torch.sort(x, dim=-1, descending=True)
        cp = torch.softmax(sx, dim=-1).cumsum(-1)
        drop = (cp - torch.softmax(sx, dim=-1)) >= s.top_p  # keep the smallest set reaching top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, si, sx)
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def verify(logits: torch.Tensor, draft: Draft | None, s: Sampling, gen: torch.Generator | None) -> Verdict:
    """logits: [B, N, V] target logits at the N = n+1 forward nodes (root first)."""
    B, N, _ = logits.shape
    dev = logits.device
    if draft is None or draft.n == 0:
        last = logits[:, 0]
        extra = greedy_pick(last) if s.greedy else sample(warp(last, s), gen)
        return Verdict(torch.zeros(B, 1, dtype=torch.long, device=dev), torch.ones(B, dtype=torch.long, device=dev),
                       extra, accepted=[[] for _ in range(B)])
    if s.synthetic is not None:  # it pays the real rule's work (warping, sorting, picking over every
        # node, its host reads) and overrides only the decision, so it costs what a real verify does
        _rule(logits, draft, s, gen)
        return _synthetic(logits, draft, s, gen)
    return _rule(logits, draft, s, gen)


def _rule(logits: torch.Tensor, draft: Draft, s: Sampling, gen: torch.Generator | None) -> Verdict:
    """The job's acceptance rule over a non-empty draft."""
    if s.greedy:
        if draft.relaxed is not None and draft.relaxed[0] > 1:
            return _relaxed(logits, draft, *draft.relaxed)
        return _greedy(logits, draft)
    if draft.typical is not None:
        return _typical(logits, draft, s, gen)
    return _sampled(logits, draft, s, gen)


def _greedy(logits: torch.Tensor, draft: Draft) -> Verdict:
    B, N, _ = logits.shape
    dev = logits.device
    amax = greedy_pick(logits)  # [B, N]
    rows = torch.arange(B, device=dev)
    if draft.is_chain:
        match = (draft.tokens == amax[:, :-1]) & draft.accept_mask()
        best = match.long().cumprod(dim=1).sum(dim=1)  # accepted drafts per row
        keep, counts = chain_keep(best, draft.n)
    else:
        ok = (draft.tokens == amax.gather(1, draft.parents)) & draft.accept_mask()
        keep, counts, best = walk(ok, draft)
    return verdict(draft, keep, counts, amax[rows, best])


def _relaxed(logits: torch.Tensor, draft: Draft, beta: int, tol: float) -> Verdict:
    """SpecDec's Spec-Verification (lossy, greedy): a node passes when its token is among
    the target's top-``beta`` at its parent and its log-probability is within ``tol`` of the
    top-1's; the longest passing path is kept and the extra token is the target's argmax at
    its end. beta = 1 is exact greedy."""
    B = logits.shape[0]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, N, V]
    top = logp.topk(beta, dim=-1)  # values/indices [B, N, beta]
    par = draft.parents
    rows = torch.arange(B, device=logits.device)
    at_par = top.indices.gather(1, par[..., None].expand(-1, -1, beta))  # [B, n, beta]
    in_top = (at_par == draft.tokens[..., None]).any(-1)
    lp = logp[rows[:, None], par, draft.tokens]
    close = lp >= top.values[..., 0].gather(1, par) - tol
    keep, counts, best = walk(in_top & close & draft.accept_mask(), draft)
    return verdict(draft, keep, counts, top.indices[rows, best, 0])


def _synthetic(logits: torch.Tensor, draft: Draft, s: Sampling, gen: torch.Generator | None) -> Verdict:
    """``Synthetic``: from the root, the candidate children of the node reached so far are tried in
    rank order (node index), rank 1 passing with its depth's rate and rank k >= 2 with the k-th
    sibling rate; the first to pass is accepted and the walk goes on from it. It stops where every
    child fails (or at a node without candidate children) and the target picks the extra token
    there. One uniform per node, all on the device: no host read beyond the walk's own."""
    B, N, _ = logits.shape
    n = N - 1
    dev = logits.device
    rows = torch.arange(B, device=dev)
    ok = draft.accept_mask()  # [B, n]
    if draft.is_chain:
        u, rate = s.synthetic.draws(B, n, dev)
        n_acc = ((u < rate[None]) & ok).long().cumprod(1).sum(1)  # [B]
        keep, counts = chain_keep(n_acc, n)
        best = n_acc
    else:
        depth, _ = draft.geometry()  # [B, N]
        par = draft.parents
        idx = torch.arange(n, device=dev)
        # earlier[b, i, j]: node j+1 is a candidate sibling of node i+1 listed before it
        earlier = (par[:, :, None] == par[:, None, :]) & (idx[None, :, None] > idx[None, None, :]) & ok[:, None, :]
        rank = earlier.sum(-1) + 1  # [B, n] among its parent's candidate children
        u, _ = s.synthetic.draws(B, n, dev)  # one uniform per node
        passes = ok & (u < s.synthetic.node_rates(depth[:, 1:], rank))
        chosen = passes & ~(earlier & passes[:, None, :]).any(-1)  # the first sibling to pass
        keep, counts, best = walk(chosen, draft)  # at most one chosen child a node: the path
    last = logits[rows, best]  # [B, V] the target at the last accepted node
    extra = greedy_pick(last) if s.greedy else sample(warp(last, s), gen)
    return verdict(draft, keep, counts, extra)


def _typical(logits: torch.Tensor, draft: Draft, s: Sampling, gen: torch.Generator | None) -> Verdict:
    """Medusa's typical acceptance (lossy): a node passes when the target's (warped)
    probability of its token at its parent exceeds min(eps, delta * exp(-H)); the longest
    passing path is kept and the extra token is sampled at its end."""
    eps, delta = draft.typical
    p = warp(logits, s)  # [B, N, V]
    ent = -(p * torch.log(p.clamp(min=1e-30))).sum(-1)  # [B, N]
    thr = torch.clamp(delta * torch.exp(-ent), max=eps)
    par = draft.parents
    rows = torch.arange(p.shape[0], device=p.device)
    px = p[rows[:, None], par, draft.tokens]
    ok = (px > thr.gather(1, par)) & draft.accept_mask()
    keep, counts, best = walk(ok, draft)
    return verdict(draft, keep, counts, sample(p[rows, best], gen))


def _sampled_chain(p_all: torch.Tensor, draft: Draft, gen: torch.Generator | None) -> Verdict:
    """The lossless rule on chains, all rows at once (Leviathan / Chen speculative
    sampling): draft j passes with probability min(1, p_j(x_j) / q_j(x_j)) (q one-hot for a
    deterministic candidate); the first failure's residual norm(max(0, p - q)) draws the
    extra token, or p after the last valid draft when every draft passed."""
    B, N, _ = p_all.shape
    n = N - 1
    dev = p_all.device
    rows = torch.arange(B, device=dev)
    x = draft.tokens
    amask = draft.accept_mask()
    px = p_all[:, :n].gather(2, x[..., None]).squeeze(-1)  # [B, n]
    q = None if draft.q is None else draft.q.float()
    qx = torch.ones_like(px) if q is None else q.gather(2, x[..., None]).squeeze(-1)
    u = torch.rand(B, n, generator=gen, device=dev)
    ok = (qx > 0) & (u < px / qx.clamp(min=1e-30)) & amask
    n_acc = ok.long().cumprod(1).sum(1)  # [B]
    rejected = n_acc < amask.long().sum(1)  # a valid draft failed (else: the bonus)
    p_end = p_all[rows, n_acc]  # [B, V] the target's distribution after the accepted drafts
    at = n_acc.clamp(max=n - 1)
    if q is None:
        resid = p_end.scatter(1, x[rows, at][:, None], 0.0)
    else:
        resid = (p_end - q[rows, at]).clamp(min=0.0)
    tot = resid.sum(1, keepdim=True)
    resid = torch.where(rejected[:, None] & (tot > 0), resid / tot.clamp(min=1e-30), p_end)
    keep, counts = chain_keep(n_acc, n)
    return verdict(draft, keep, counts, sample(resid, gen))


def _sampled_tree(p_all: torch.Tensor, draft: Draft, gen: torch.Generator | None) -> Verdict:
    """The lossless rule on trees of deterministic candidates, with one host sync a step: at a
    node with residual r (first the target's p there), children are tried in order, child x
    passing with probability r(x); a rejected x leaves r with x removed and renormalised, so
    r(x) = p(x) / (1 - mass of the distinct tokens rejected before it). Only p at each node's
    token under its parent and one uniform per node are needed to walk: they come to the host
    in one transfer (with the tree), and the extra token is drawn on the device from p at the
    node the walk stopped at, less what was rejected there."""
    B, N, V = p_all.shape
    n = N - 1
    dev = p_all.device
    rows = torch.arange(B, device=dev)
    px = p_all[rows[:, None], draft.parents, draft.tokens]  # [B, n] p(token | parent)
    u = torch.rand(B, n, generator=gen, device=dev)
    host = torch.stack([px.double(), u.double(), draft.tokens.double(), draft.parents.double(),
                        draft.accept_mask().double()]).tolist()  # the one sync
    pxs, us, toks, pars, oks = host
    keeps, accepted, stops, zero_r, zero_t = [], [], [], [], []
    for b in range(B):
        children: dict[int, list[int]] = {}
        for i in range(n):
            if oks[b][i]:
                children.setdefault(int(pars[b][i]), []).append(i + 1)
        cur, path, acc = 0, [0], []
        while True:
            removed, rejected, chosen = 0.0, set(), None
            for c in children.get(cur, []):
                x = int(toks[b][c - 1])
                if x in rejected:  # already removed from the residual: probability 0
                    continue
                r = pxs[b][c - 1] / (1.0 - removed) if removed < 1.0 else 0.0
                if us[b][c - 1] < r:
                    chosen = c
                    break
                rejected.add(x)
                removed += pxs[b][c - 1]
            if chosen is None:
                break
            path.append(chosen)
            acc.append(int(toks[b][chosen - 1]))
            cur = chosen
        keeps.append(path)
        accepted.append(acc)
        stops.append(cur)
        zero_r += [b] * len(rejected)
        zero_t += sorted(rejected)
    p_end = p_all[rows, torch.tensor(stops, dtype=torch.long, device=dev)]  # [B, V]
    resid = p_end
    if zero_r:
        resid = p_end.clone()
        resid[torch.tensor(zero_r, device=dev), torch.tensor(zero_t, device=dev)] = 0.0
        tot = resid.sum(1, keepdim=True)
        resid = torch.where(tot > 0, resid / tot.clamp(min=1e-30), p_end)  # p == rejected mass: cannot happen
    keep, counts = path_tensors(keeps, dev)
    return Verdict(keep, counts, sample(resid, gen), accepted=accepted)


def _sampled(logits: torch.Tensor, draft: Draft, s: Sampling, gen: torch.Generator | None) -> Verdict:
    B, N, _ = logits.shape
    dev = logits.device
    p_all = warp(logits, s)  # [B, N, V]
    if draft.is_chain:
        return _sampled_chain(p_all, draft, gen)
    if draft.q is None:
        return _sampled_tree(p_all, draft, gen)
    # sampled siblings with q (SpecInfer's recursive rule; no shipped method drafts such trees):
    # node by node on the host
    tokens = draft.tokens.tolist()
    parents = draft.parents.tolist()
    amask = draft.accept_mask().tolist()
    keeps, accepted, extras = [], [], []
    for b in range(B):
        children: dict[int, list[int]] = {}
        for i in range(N - 1):
            if amask[b][i]:
                children.setdefault(parents[b][i], []).append(i + 1)
        cur, path, acc = 0, [0], []
        while True:
            kids = children.get(cur, [])
            if not kids:
                extra = sample(p_all[b, cur], gen)
                break
            resid = p_all[b, cur]
            chosen = None
            for c in kids:
                x = tokens[b][c - 1]
                q = None if draft.q is None else draft.q[b, c - 1].float()
                qx = 1.0 if q is None else float(q[x])
                px = float(resid[x])
                u = float(torch.rand((), generator=gen, device=gen.device if gen is not None else dev))
                if qx > 0 and u < min(1.0, px / qx):
                    chosen = c
                    break
                if q is None:
                    resid = resid.clone()
                    resid[x] = 0.0
                else:
                    resid = (resid - q).clamp(min=0.0)
                tot = resid.sum()
                if float(tot) <= 0.0:  # p == q: rejection had probability 0; cannot happen
                    resid = p_all[b, cur]
                else:
                    resid = resid / tot
            if chosen is None:
                extra = sample(resid, gen)
                break
            path.append(chosen)
            acc.append(tokens[b][chosen - 1])
            cur = chosen
        keeps.append(path)
        accepted.append(acc)
        extras.append(extra)
    keep, counts = path_tensors(keeps, dev)
    return Verdict(keep, counts, torch.stack(extras).to(dev), accepted=accepted)
