"""The target's step cost: one forward's time over (batch size, tokens per row) through the
engine's own cache (``forward_time``), and a profiled curve read between its points
(``interp``). ``analysis.profile`` measures whole curves with them; ``K=auto`` (``specbench.tune``)
the few points it prices its candidates at."""

from __future__ import annotations

import statistics
import time

import torch

from specbench.kv import RaggedCache
from specbench.timing import sync


@torch.inference_mode()
def forward_time(model, bs: int, n: int, ctx: int, device, dtype, reps: int, vocab: int) -> float:
    """Median seconds of one forward over n chain tokens per row, bs rows, ctx-token prefix."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (bs, ctx), generator=g).tolist()
    cache = RaggedCache(model, device, dtype)
    cache.prefill(prompts)
    toks = torch.randint(10, vocab, (bs, n), generator=g).to(device)
    depth = torch.arange(n, device=device)[None].expand(bs, n)
    keep = torch.zeros(bs, 1, dtype=torch.long, device=device)
    none = torch.zeros(bs, dtype=torch.long, device=device)
    times = []
    for i in range(reps + 1):
        sync(device)
        t = time.perf_counter()
        cache.forward(toks, depth, None)
        sync(device)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t)
        cache.commit(keep, none)  # keep nothing: the prefix stays ctx long
    return statistics.median(times)



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
