"""Cost-curve profiler: the target's forward time over (batch size, tokens per row) on top of
a ctx-token prefix, and the draft's single-token step time, through the engine's own cache.
Appends one JSON line to ``<results_dir>/cost_curves.jsonl`` (beside the records), which
feeds the batch-aware bound and the trace-driven simulator.

Beside each point it prints the roofline: the bytes one forward must read (the weights once,
the KV cache of every row) over the machine's measured read bandwidth, and the ratio of the
measured time to it. ``--repeats R`` measures the whole curve R times, interleaved, and
reports the median with its spread (min-max over repeats): on a shared host the spread says
how far a single number can be trusted. T(n)/T(1) is taken within each repeat, where its
two points are seconds apart, and reported as the median of those ratios with their spread.

    python -m specbench.analysis.profile --bs 1,2,4,8 --n 1,2,4,8,16 --ctx 256 --draft-layers 4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specbench import kernels
from specbench.run import records as R
from specbench.costs import forward_time, forward_times
from specbench.errors import ConfigError
from specbench.models import (check_compile, compile_forward, load_model, resolve_device, resolve_dtype, self_layers_draft)
from specbench.paths import CONF_DIR
from specbench.decode.timing import sync


def _median_seconds(f, device, reps: int) -> float:
    """Median time of ``reps`` calls of ``f`` after one untimed call."""
    ts = []
    for i in range(reps + 1):
        sync(device)
        t = time.perf_counter()
        f()
        sync(device)
        if i:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def memory_bandwidth(device, mb: int = 256, reps: int = 9) -> float:
    """Read bandwidth in bytes/s, median over ``reps`` passes of ``sum`` over an ``mb`` MiB
    fp32 tensor, larger than any cache (the spread is taken over the profile's repeats)."""
    x = torch.ones(mb * 2**20 // 4, device=device)
    return x.numel() * 4 / _median_seconds(x.sum, device, reps)


def compute_rate(device, dtype, reps: int = 9) -> float:
    """The arithmetic rate in FLOP/s that a forward can reach at best here: the faster of a
    1024^3 matrix product through torch (MKL, cuBLAS) and, for fp32 on a CPU with the native kernel,
    that kernel over 16 rows of an in-cache weight (its decode tile; faster than MKL here)."""
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    best = 2 * 1024 ** 3 / _median_seconds(lambda: a @ a, device, reps)
    if device.type == "cpu" and dtype == torch.float32 and not kernels.extension.unavailable():
        w, x = kernels.extension.pack(torch.randn(3072, 576)), torch.randn(16, 576)  # 7 MB: in L2/L3
        best = max(best, 2 * 16 * 3072 * 576 / _median_seconds(lambda: kernels.extension.few_rows_linear(x, w, 3072), device,
                                                                 reps))
    return best


def forward_flops(model, bs: int, n: int, ctx: int) -> int:
    """Arithmetic of one forward over ``n`` new tokens per row on a ``ctx``-token prefix: every
    linear layer (the output layer included) once per row, and attention's two products of
    each new token with the whole prefix (an upper bound: the new tokens see only part of each
    other)."""
    from specbench.hf import text_config

    lin = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = text_config(model.config)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn = 2 * 2 * c.num_hidden_layers * c.num_attention_heads * head_dim * (ctx + n)
    return int(bs * n * (2 * lin + attn))


def forward_bytes(model, bs: int, ctx: int, dtype) -> int:
    """Bytes one forward must read at least: every weight once (tied weights once) and the
    KV cache of every row (``ctx`` positions)."""
    from specbench.hf import text_config

    w = sum(p.numel() * p.element_size() for p in model.parameters())
    c = text_config(model.config)
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    kv = 2 * c.num_hidden_layers * kv_heads * head_dim * ctx * bs * torch.finfo(dtype).bits // 8
    return int(w + kv)


def profile(model, draft, bs_list, n_list, ctx, device, dtype, reps, repeats: int = 1, **shape) -> dict:
    return profile_many({"": model}, draft, bs_list, n_list, ctx, device, dtype, reps, repeats, **shape)[""]


def profile_many(models: dict, draft, bs_list, n_list, ctx, device, dtype, reps, repeats: int = 1,
                 ragged: bool = False, tree: bool = False) -> dict:
    """Cost curves of several variants of one model (e.g. kernel paths), measured
    interleaved: each repeat runs every variant's whole curve in turn, so the host's drift
    hits them alike and their ratios compare."""
    from tqdm.auto import tqdm

    first = next(iter(models.values()))
    vocab = int(first.config.vocab_size)
    points = [(b, n) for b in bs_list for n in n_list]
    runs: dict[tuple, list[float]] = {(k, p): [] for k in models for p in points}
    bw_runs, fl_runs = [], []
    with tqdm(total=repeats * len(points) * len(models), desc="cost curve", file=sys.stderr) as bar:
        for _ in range(repeats):
            bw_runs.append(memory_bandwidth(device))
            fl_runs.append(compute_rate(device, dtype))
            for k, model in models.items():
                for b in bs_list:  # one prefill a batch size, every n on it
                    for n, t in forward_times(model, b, n_list, ctx, device, dtype, reps, vocab, ragged=ragged,
                                              tree=tree).items():
                        runs[(k, (b, n))].append(t)
                        bar.update(1)
    bw, fl = statistics.median(bw_runs), statistics.median(fl_runs)
    draft_t = {}
    if draft is not None:
        for b in bs_list:
            draft_t[str(b)] = forward_time(draft, b, 1, ctx, device, dtype, reps, vocab)
    out = {}
    for k, model in models.items():
        target, spread, roof, floor, ratio = {}, {}, {}, {}, {}
        for b, n in points:
            ts = runs[(k, (b, n))]
            target.setdefault(str(b), {})[str(n)] = statistics.median(ts)
            spread.setdefault(str(b), {})[str(n)] = [min(ts), max(ts)]
            roof.setdefault(str(b), {})[str(n)] = forward_bytes(model, b, ctx + n, dtype) / bw
            floor.setdefault(str(b), {})[str(n)] = forward_flops(model, b, n, ctx) / fl
            # T(n)/T(n0) within each repeat (seconds apart), so a drift between repeats cancels
            rs = [t / t0 for t, t0 in zip(ts, runs[(k, (b, n_list[0]))])]
            ratio.setdefault(str(b), {})[str(n)] = [statistics.median(rs), min(rs), max(rs)]
        out[k] = {"target": target, "target_spread": spread, "roofline": roof, "compute_floor": floor,
                  "ratio_in_repeat": ratio, "draft_step": draft_t,
                  "compute_gflops": fl / 1e9, "compute_spread_gflops": [min(fl_runs) / 1e9, max(fl_runs) / 1e9],
                  "bandwidth_gbs": bw / 1e9, "bandwidth_spread_gbs": [min(bw_runs) / 1e9, max(bw_runs) / 1e9],
                  "repeats": repeats}
    return out


def print_curves(curves: dict, bs_list, n_list) -> None:
    """Per batch size: T(n) median [spread], T(n)/T(1), the roofline and the ratio to it."""
    print(f"read bandwidth {curves['bandwidth_gbs']:.1f} GB/s (spread {curves['bandwidth_spread_gbs'][0]:.1f}-"
          f"{curves['bandwidth_spread_gbs'][1]:.1f}); {curves['repeats']} repeat(s), medians [min-max]")
    fl = curves.get("compute_gflops")
    if fl:
        print(f"compute {fl:.0f} GFLOP/s (spread {curves['compute_spread_gflops'][0]:.0f}-"
              f"{curves['compute_spread_gflops'][1]:.0f}): the compute floor is a forward's FLOPs at that rate; "
              "x floors = T / max(roofline, compute floor)")
    n0 = n_list[0]
    print(f"T(n)/T({n0}): the ratio within each repeat (its two points seconds apart), median [min-max]")
    for b in bs_list:
        T, sp, rf = curves["target"][str(b)], curves["target_spread"][str(b)], curves["roofline"][str(b)]
        ratio = curves["ratio_in_repeat"][str(b)]
        cf = (curves.get("compute_floor") or {}).get(str(b))
        print(f"bs={b:<4} {'n':>4} {'ms':>8} {'spread ms':>15} {f'T(n)/T({n0})':>18} {'roofline ms':>12} "
              f"{'x roofline':>10}" + (f" {'compute ms':>10} {'x floors':>8}" if cf else ""))
        for n in n_list:
            t, (lo, hi), r, (rm, rlo, rhi) = T[str(n)], sp[str(n)], rf[str(n)], ratio[str(n)]
            print(f"{'':9} {n:>4} {1000 * t:>8.1f} {f'{1000 * lo:.1f}-{1000 * hi:.1f}':>15} "
                  f"{f'{rm:.2f} [{rlo:.2f}-{rhi:.2f}]':>18} {1000 * r:>12.1f} {t / r:>10.2f}"
                  + (f" {1000 * cf[str(n)]:>10.1f} {t / max(r, cf[str(n)]):>8.2f}" if cf else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a conf/model name")
    ap.add_argument("--model-path", default=None, help="any HF id or folder instead")
    ap.add_argument("--shape", default=None, help="with --model random: a shape of specbench/shapes (random weights)")
    ap.add_argument("--bs", default="1,2,4,8")
    ap.add_argument("--n", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--draft-layers", type=int, default=4, help="self_layers draft to time (0 = none)")
    ap.add_argument("--reps", type=int, default=5, help="forwards per point (median)")
    ap.add_argument("--repeats", type=int, default=1, help="whole curves, interleaved (median and spread)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kernel", default="auto", help="linear-layer path(s): auto, torch, onednn; a comma list "
                    "profiles each (interleaved) and prints their ratios")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true", help="the target's forward through torch.compile, as a job "
                    "with compile=true runs it (kernel=torch; each point's untimed first forward compiles)")
    ap.add_argument("--ragged", action="store_true", help="rows of different lengths (ctx +- 25%%, left-padded): "
                    "the masked path every verify at bs > 1 takes")
    ap.add_argument("--tree", action="store_true", help="the n nodes as a binary tree (a 4D ancestor mask), as a tree "
                    "method's verify passes them, instead of a chain")
    ap.add_argument("--results-dir", default="results")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.repeats < 1 or a.ctx < 1:
        ap.error("--reps, --repeats and --ctx must be >= 1")
    device = resolve_device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    try:
        kerns = [kernels.resolve(k, device) for k in a.kernel.split(",")]
        for k in kerns if a.compile else ():
            check_compile(True, k)
    except ConfigError as e:
        ap.error(str(e))
    mcfg = OmegaConf.load(CONF_DIR / "model" / f"{a.model}.yaml")
    if a.model_path:
        mcfg.path = a.model_path
    if a.shape:
        mcfg.shape = a.shape
    models = {}
    for k in dict.fromkeys(kerns):  # one copy of the model per kernel path
        models[k] = load_model(mcfg, device, dtype)
        kernels.apply(models[k], k)
        if a.compile:
            compile_forward(models[k])
    draft = self_layers_draft(next(iter(models.values())), a.draft_layers) if a.draft_layers else None
    bs_list = [int(x) for x in a.bs.split(",")]
    n_list = [int(x) for x in a.n.split(",")]
    all_curves = profile_many(models, draft, bs_list, n_list, a.ctx, device, dtype, a.reps, a.repeats, ragged=a.ragged,
                              tree=a.tree)
    out = Path(a.results_dir) / "cost_curves.jsonl"
    for k, curves in all_curves.items():
        rec = {"kind": "cost_curve", "model": a.model_path or str(mcfg.name), "device": device.type,
               "dtype": str(dtype).replace("torch.", ""), "kernel": k, "kernel_isa": kernels.kernel_isa(k), "ctx": a.ctx,
               **({"compile": True} if a.compile else {}),
               **({"ragged": True} if a.ragged else {}), **({"tree": True} if a.tree else {}),
               "draft": f"self_layers:{a.draft_layers}" if a.draft_layers else None, **curves,
               "env": R.env_info(device), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        R.append(out, rec)
        print(f"kernel={k}" + (f" ({kernels.kernel_isa(k)} tiles)" if kernels.kernel_isa(k) else ""))
        print_curves(curves, bs_list, n_list)
    if len(all_curves) > 1:
        ks = list(all_curves)
        base = all_curves[ks[0]]["target"]
        for k in ks[1:]:
            print(f"kernel={k} / kernel={ks[0]} (same run): " + ", ".join(
                f"bs={b} n={n}: {all_curves[k]['target'][str(b)][str(n)] / base[str(b)][str(n)]:.2f}"
                for b in bs_list for n in n_list))
    print(f"cost curve appended to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
