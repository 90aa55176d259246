"""The roofline cost model (analysis.costmodel, h100-sxm:llama-3.1-8b) against measurements
published by others: SpecDecode-Bench's fitted H100 curve, vLLM's Llama-3.1-8B runs at bs 1 (vLLM
issue 20780) and SGLang's EAGLE-3 batch sweep. Prints the Markdown tables of
docs/benchmarks/roofline-vs-published.md.

    python scripts/roofline_check.py [--ctx 1024]
"""

from __future__ import annotations

import argparse

from specbench.analysis.costmodel import SPECDECODE_BENCH_H100 as SDB, resolve, step

# vLLM issue 20780: Llama-3.1-8B-Instruct, H100, bs 1, EAGLE-3: K -> (acceptance length, TPOT ms); AR TPOT
VLLM_AR_TPOT_MS = 7.07
VLLM_EAGLE3 = {2: (2.36, 4.32), 3: (2.79, 4.09), 4: (3.08, 4.05), 5: (3.32, 4.13), 6: (3.46, 4.20), 7: (3.54, 4.29)}
# SGLang's EAGLE-3 batch sweep on Llama-3.1-8B: bs -> speedup over AR
SGLANG = {2: 1.81, 4: 1.82, 8: 1.62, 16: 1.48, 32: 1.32, 64: 1.38}


def err(pred: float, pub: float) -> str:
    return f"{100 * (pred / pub - 1):+.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=1024, help="cached tokens a row")
    ap.add_argument("--sglang-k", type=int, default=5, help="EAGLE-3 chain length assumed for SGLang's sweep")
    a = ap.parse_args()
    roof = resolve("h100-sxm:llama-3.1-8b")
    ctx = a.ctx
    print(f"## T(q)/T(1): roofline against SpecDecode-Bench's fitted H100 curve ({ctx} cached tokens a row)\n")
    print("| bs | q | fitted T ms | roofline T ms | fitted T(q)/T(1) | roofline T(q)/T(1) | error of the ratio |")
    print("|---|---|---|---|---|---|---|")
    for b in (1, 32, 128):
        f1, r1 = step(SDB, b, 1, b * ctx), step(roof, b, 1, b * ctx)
        for q in (1, 2, 4, 6, 8):
            f, r = step(SDB, b, q, b * ctx), step(roof, b, q, b * ctx)
            print(f"| {b} | {q} | {1e3 * f:.2f} | {1e3 * r:.2f} | {f / f1:.2f} | {r / r1:.2f} | {err(r / r1, f / f1)} |")
    print(f"\n## vLLM, Llama-3.1-8B-Instruct, H100, bs 1 (issue 20780), {ctx} cached tokens\n")
    ar = step(roof, 1, 1, ctx)
    print("| run | published TPOT ms | roofline TPOT ms | error | + measured drafting: TPOT ms | error | "
          "published speedup | roofline speedup | + measured drafting |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| AR | {VLLM_AR_TPOT_MS:.2f} | {1e3 * ar:.2f} | {err(ar * 1e3, VLLM_AR_TPOT_MS)} | {1e3 * ar:.2f} | "
          f"{err(ar * 1e3, VLLM_AR_TPOT_MS)} | 1.00 | 1.00 | 1.00 |")
    for K, (tau, tpot) in VLLM_EAGLE3.items():
        v = roof.target(1, K + 1, ctx)
        t = (v + roof.draft("eagle3", 1, K + 1, ctx, v) + roof.overhead_s) / tau
        h = (v + SDB.draft("eagle3", 1, K + 1, ctx, v) + roof.overhead_s) / tau  # SpecDecode-Bench's fitted drafting
        print(f"| EAGLE-3 K={K} (tau {tau}) | {tpot:.2f} | {1e3 * t:.2f} | {err(t * 1e3, tpot)} | {1e3 * h:.2f} | "
              f"{err(h * 1e3, tpot)} | {VLLM_AR_TPOT_MS / tpot:.2f} | {ar / t:.2f} | {ar / h:.2f} |")
    K = a.sglang_k
    tau = VLLM_EAGLE3[K][0]
    print(f"\n## SGLang's EAGLE-3 batch sweep (assumed: a chain of K={K} at vLLM's tau {tau}, {ctx} cached tokens)\n")
    print("| bs | published speedup | roofline | error | + measured drafting | error | fitted H100 (SpecDecode-Bench) | error |")
    print("|---|---|---|---|---|---|---|---|")
    for b, pub in SGLANG.items():
        kv = b * ctx
        v = roof.target(b, K + 1, kv)
        pred = step(roof, b, 1, kv) / ((v + roof.draft("eagle3", b, K + 1, kv, v) + roof.overhead_s) / tau)
        hyb = step(roof, b, 1, kv) / ((v + SDB.draft("eagle3", b, K + 1, kv, v) + roof.overhead_s) / tau)
        fv = SDB.target(b, K + 1, kv)
        fit = step(SDB, b, 1, kv) / ((fv + SDB.draft("eagle3", b, K + 1, kv, fv) + SDB.overhead_s) / tau)
        print(f"| {b} | {pub:.2f} | {pred:.2f} | {err(pred, pub)} | {hyb:.2f} | {err(hyb, pub)} | {fit:.2f} | "
              f"{err(fit, pub)} |")


if __name__ == "__main__":
    main()
