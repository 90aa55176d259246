"""Peak memory of top-p warping over a verify's logits [B, N, V], in chunks (the default) or in
one pass over every row (``--one-pass``: the behaviour before chunking).

    MALLOC_PERTURB_=7 MALLOC_MMAP_THRESHOLD_=65536 python scripts/warp_memory.py --bs 32 --nodes 65 --vocab 49152

The peak is the process's RSS above what it held with the logits made (see scripts/kv_memory.py
for the two glibc settings). Prints one line and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specbench.run.monitor import PeakMemory


def main(argv=None) -> int:
    from specbench.decode import verify
    from specbench.decode.verify import Sampling, warp

    ap = argparse.ArgumentParser(prog="python scripts/warp_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--nodes", type=int, default=65)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--one-pass", action="store_true", help="no chunks (as before chunking)")
    a = ap.parse_args(argv)
    if a.one_pass:
        verify.WARP_CHUNK_BYTES = 1 << 62
    logits = torch.randn(a.bs, a.nodes, a.vocab)
    base = PeakMemory.rss()
    t = time.perf_counter()
    with PeakMemory(torch.device("cpu"), interval=0.005) as mem:
        p = warp(logits, Sampling(1.0, top_p=a.top_p))
    dt = time.perf_counter() - t
    peak = mem.peak - base
    out = p.numel() * 4
    row = {"bs": a.bs, "nodes": a.nodes, "vocab": a.vocab, "one_pass": a.one_pass, "peak_bytes": peak,
           "output_bytes": out, "seconds": round(dt, 2)}
    print(f"warp top_p={a.top_p} [{a.bs}, {a.nodes}, {a.vocab}] {'one pass' if a.one_pass else 'chunked'}: peak "
          f"{peak / 2**30:.2f} GiB above the logits (output {out / 2**30:.2f} GiB), {dt:.1f} s")
    print(json.dumps({"bench": "warp_memory", **row}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
