"""Peak memory of the engine's KV cache over one batch, against the KV it must hold.

Replays what the engine does to its ``RaggedCache`` for a method's draft shape: a prefill of
``bs`` prompts of ``ctx`` tokens, then steps that append ``nodes`` slots a row, keep a few,
and let rows finish one after another (``select_rows``) until ``max_new_tokens``. The model is a
stand-in that writes random K/V of the target's geometry into the cache (no weights, no
compute), so bs=128 at 2k tokens runs on a CPU in seconds; the peak is the process's RSS
(sampled every 5 ms) above what it held before the batch. Run it with
MALLOC_PERTURB_=7 MALLOC_MMAP_THRESHOLD_=65536: the first makes glibc write every block it
hands out, so memory allocated counts even where nothing was written yet (as a GPU's
allocator counts it); the second returns every freed tensor to the system (else freed
mid-size blocks stay in glibc's heap and count as held).

    MALLOC_PERTURB_=7 MALLOC_MMAP_THRESHOLD_=65536 python scripts/kv_memory.py --bs 1,32,128 --ctx 2048 --new 128 --dtype bf16 \
        [--kv-module FILE]   # another kv.py (an older commit's) to compare against

Prints a table and one JSON line. Geometry: SmolLM2-135M (30 layers, 3 KV heads of 64) unless
--layers/--kv-heads/--head-dim say otherwise.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import random
import time
from types import SimpleNamespace

import torch

from specbench.run.monitor import PeakMemory

# (label, verify nodes a step incl. the root, most drafts a step keeps): AR, PLD K=4, EAGLE's
# CPU tree (6 nodes) and its GPU tree (60)
METHODS = {"ar": (1, 0), "pld": (5, 4), "eagle-cpu": (7, 2), "eagle-gpu": (61, 5)}


class StandIn(torch.nn.Module):
    """Writes random keys/values for every layer into the cache it is given; returns no logits."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=layers)
        self.layers, self.kv_heads, self.head_dim, self.dtype_ = layers, kv_heads, head_dim, dtype

    def forward(self, input_ids=None, cache=None, **kw):
        B, n = input_ids.shape
        for i in range(self.layers):
            kv = torch.empty(B, self.kv_heads, n, self.head_dim, dtype=self.dtype_).normal_()
            cache.update(kv, kv.clone(), i)
        return SimpleNamespace(logits=None)


def run(kv, bs: int, ctx: int, new: int, nodes: int, keep: int, geom, dtype, seed=0) -> dict:
    model = StandIn(*geom, dtype)
    per_token = 2 * geom[0] * geom[1] * geom[2] * torch.finfo(dtype).bits // 8
    rng = random.Random(seed)
    t0 = time.perf_counter()
    gc.collect()
    base = PeakMemory.rss()
    with PeakMemory(torch.device("cpu"), interval=0.005) as mem, torch.inference_mode():
        c = kv.RaggedCache(model, torch.device("cpu"), dtype)
        c._kw = "cache"
        try:
            c.prefill([[1] * ctx] * bs, room=new + nodes + 1)
        except TypeError:  # a kv.py from before the room argument
            c.prefill([[1] * ctx] * bs)
        emitted = [1] * bs
        finish = [rng.randint(new // 2, new) for _ in range(bs)]  # rows finish at different steps
        live = list(range(bs))
        while live:
            B = len(live)
            toks = torch.ones(B, nodes, dtype=torch.long)
            c.forward(toks, torch.arange(nodes)[None].expand(B, nodes), None)
            counts = [1 + rng.randint(0, keep) for _ in live]
            c.commit(torch.arange(nodes)[None].expand(B, nodes), torch.tensor(counts))
            for i, r in enumerate(live):
                emitted[r] += counts[i]
            stay = [i for i, r in enumerate(live) if emitted[r] < finish[r]]
            if len(stay) < B:
                if stay:
                    c.select_rows(torch.tensor(stay))
                live = [live[i] for i in stay]
        del c
    live_kv = bs * (ctx + new) * per_token  # what the batch must hold at most
    return {"bs": bs, "ctx": ctx, "nodes": nodes, "peak_bytes": mem.peak - base, "kv_bytes": live_kv,
            "peak_over_kv": round((mem.peak - base) / live_kv, 2), "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/kv_memory.py", description=__doc__.splitlines()[0])
    ap.add_argument("--bs", default="1,32,128")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128, help="max_new_tokens")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-module", help="a kv.py to load RaggedCache from (default: specbench.decode.kv)")
    ap.add_argument("--label", default=None)
    a = ap.parse_args(argv)
    if a.kv_module:
        spec = importlib.util.spec_from_file_location("kv_under_test", a.kv_module)
        kv = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kv)
    else:
        from specbench.decode import kv
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    rows = []
    for m in a.methods.split(","):
        nodes, keep = METHODS[m]
        for bs in [int(x) for x in a.bs.split(",")]:
            r = {"method": m, **run(kv, bs, a.ctx, a.new, nodes, keep, (a.layers, a.kv_heads, a.head_dim), dtype)}
            rows.append(r)
            print(f"{a.label or a.kv_module or 'specbench.decode.kv'}: {m:<9} bs={bs:<4} ctx={a.ctx} peak "
                  f"{r['peak_bytes'] / 2**30:6.2f} GiB, KV {r['kv_bytes'] / 2**30:6.2f} GiB: "
                  f"{r['peak_over_kv']:.2f}x ({r['seconds']} s)", flush=True)
    print(json.dumps({"bench": "kv_memory", "label": a.label, "dtype": a.dtype, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
