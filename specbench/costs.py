"""The target's step cost: one forward's time over (batch size, tokens per row) through the
engine's own cache (``forward_time``), and a profiled curve read between its points
(``interp``). ``analysis.profile`` measures whole curves with them; ``K=auto`` (``specbench.run.tune``)
the few points it prices its candidates at."""

from __future__ import annotations

import statistics
import time

import torch

from specbench.decode.kv import RaggedCache
from specbench.decode.timing import sync


def forward_time(model, bs: int, n: int, ctx: int, device, dtype, reps: int, vocab: int, ragged: bool = False,
                 tree: bool = False) -> float:
    """Median seconds of one forward over n tokens per row, bs rows, ctx-token prefix (``forward_times``)."""
    return forward_times(model, bs, [n], ctx, device, dtype, reps, vocab, ragged, tree)[n]


@torch.inference_mode()
def forward_times(model, bs: int, ns, ctx: int, device, dtype, reps: int, vocab: int, ragged: bool = False,
                  tree: bool = False) -> dict[int, float]:
    """{n: median seconds of one forward over n tokens per row}, bs rows on one ctx-token prefix
    (prefilled once for every n), in the shape a job's verify has: ``ragged`` rows of different
    lengths (ctx +- 25%, left-padded: the masked path, as any real batch of bs > 1), and a ``tree``
    of nodes (a binary tree under the root, passed as a 4D ancestor mask) rather than a chain (the
    causal path)."""
    g = torch.Generator().manual_seed(0)
    lens = [ctx] * bs if not ragged or bs == 1 else \
        [max(1, ctx + ctx // 4 - (i * (ctx // 2)) // (bs - 1)) for i in range(bs)]
    prompts = [torch.randint(10, vocab, (L,), generator=g).tolist() for L in lens]
    cache = RaggedCache(model, device, dtype)
    cache.prefill(prompts, room=max(ns) + 1)
    keep = torch.zeros(bs, 1, dtype=torch.long, device=device)
    none = torch.zeros(bs, dtype=torch.long, device=device)
    out = {}
    for n in ns:
        toks = torch.randint(10, vocab, (bs, n), generator=g).to(device)
        depth = torch.arange(n, device=device)[None].expand(bs, n)
        anc = None
        if tree and n > 2:  # node j's parent is (j - 1) // 2: two children a node
            from specbench.decode.tree import tree_geometry

            parents = torch.tensor([(j - 1) // 2 for j in range(1, n)], device=device)[None].expand(bs, n - 1)
            depth, anc = tree_geometry(parents)
        times = []
        for i in range(reps + 1):
            sync(device)
            t = time.perf_counter()
            cache.forward(toks, depth, anc)
            sync(device)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t)
            cache.commit(keep, none)  # keep nothing: the prefix stays ctx long
        out[n] = statistics.median(times)
    return out


def interp(curve: dict, b: int, n: int) -> float:
    """T(b, n) from a profiled curve: exact point, else linear in n between the nearest
    profiled n (clamped), at the nearest profiled batch size."""
    bs = sorted(int(x) for x in curve)
    bb = min(bs, key=lambda x: (abs(x - b), x))
    row = {int(k): v for k, v in curve[str(bb)].items()}
    ns = sorted(row)
    if n in row:
        return row[n]
    if n <= ns[0]:
        return row[ns[0]]
    if n >= ns[-1]:
        hi, lo = ns[-1], ns[-2] if len(ns) > 1 else ns[-1]
        slope = (row[hi] - row[lo]) / (hi - lo) if hi != lo else 0.0
        return row[hi] + slope * (n - hi)
    lo = max(x for x in ns if x < n)
    hi = min(x for x in ns if x > n)
    return row[lo] + (row[hi] - row[lo]) * (n - lo) / (hi - lo)
