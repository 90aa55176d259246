"""Cost-curve profiler: the target's forward time over (batch size, tokens per row) on top of
a ctx-token prefix, and the draft's single-token step time, through the engine's own cache.
Appends one JSON line to ``<results_dir>/cost_curves.jsonl`` (beside the records), which
feeds the batch-aware bound and the trace-driven simulator.

    python -m analysis.profile --bs 1,2,4,8 --n 1,2,4,8,16 --ctx 256 --draft-layers 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specbench import records as R
from specbench.kv import RaggedCache
from specbench.models import load_model, resolve_device, resolve_dtype, self_layers_draft
from specbench.models import CONF_DIR
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


def profile(model, draft, bs_list, n_list, ctx, device, dtype, reps) -> dict:
    from tqdm.auto import tqdm

    vocab = int(model.config.vocab_size)
    target = {}
    draft_t = {}
    points = [(b, n) for b in bs_list for n in n_list]
    for b, n in tqdm(points, desc="cost curve", file=sys.stderr):
        target.setdefault(str(b), {})[str(n)] = forward_time(model, b, n, ctx, device, dtype, reps, vocab)
    if draft is not None:
        for b in bs_list:
            draft_t[str(b)] = forward_time(draft, b, 1, ctx, device, dtype, reps, vocab)
    return {"target": target, "draft_step": draft_t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a conf/model name")
    ap.add_argument("--model-path", default=None, help="any HF id or folder instead")
    ap.add_argument("--bs", default="1,2,4,8")
    ap.add_argument("--n", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--draft-layers", type=int, default=4, help="self_layers draft to time (0 = none)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    mcfg = OmegaConf.load(CONF_DIR / "model" / f"{a.model}.yaml")
    if a.model_path:
        mcfg.path = a.model_path
    model = load_model(mcfg, device, dtype)
    draft = self_layers_draft(model, a.draft_layers) if a.draft_layers else None
    bs_list = [int(x) for x in a.bs.split(",")]
    n_list = [int(x) for x in a.n.split(",")]
    curves = profile(model, draft, bs_list, n_list, a.ctx, device, dtype, a.reps)
    rec = {"kind": "cost_curve", "model": a.model_path or a.model, "device": device.type,
           "dtype": str(dtype).replace("torch.", ""), "ctx": a.ctx,
           "draft": f"self_layers:{a.draft_layers}" if a.draft_layers else None, **curves,
           "env": R.env_info(device), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = Path(a.results_dir) / "cost_curves.jsonl"
    R.append(out, rec)
    print(f"{'bs':>4} " + " ".join(f"n={n:<6}" for n in n_list) + "  (ms per target forward)")
    for b in bs_list:
        print(f"{b:>4} " + " ".join(f"{1000 * curves['target'][str(b)][str(n)]:<8.1f}" for n in n_list))
    print(f"cost curve appended to {out}")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
