"""Regression check of a new records file against a baseline.

    python -m specbench.analysis.compare NEW BASELINE [--speed-tol 0.25] [--fail-on-speed] [--bench-json out.json]

Jobs are matched by what defines them (method, model, draft, K, bs, ctx, dataset, limit,
sampling, max_new_tokens, dtype, device, seed). Deterministic quantities of greedy jobs —
accepted-length counts, tau, acceptance per position, new tokens, token identity with AR —
must equal the baseline: any difference fails (exit 1). Speed (tokens/s, speedup) is
compared with a relative tolerance and reported; it fails only with --fail-on-speed (CPU
runners are too noisy for it). --bench-json writes the list github-action-benchmark reads
with `tool: customBiggerIsBetter`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from specbench.run import records as R

IDENTITY = ("method", "model", "draft", "K", "bs", "ctx", "dataset", "limit", "temperature", "top_k", "top_p",
            "max_new_tokens", "dtype", "device", "seed")
EXACT = ("accept_len_hist", "tau", "accept_rate_per_pos", "new_tokens", "match_ar")
SPEED = ("tokens_per_s", "speedup")


def ident(rec: dict) -> str:
    return json.dumps({k: rec.get(k) for k in IDENTITY}, sort_keys=True, default=str)


def name(rec: dict) -> str:
    parts = [rec["method"]]
    if rec.get("draft"):
        parts.append(str(rec["draft"]))
    if rec.get("K"):
        parts.append(f"K={rec['K']}")
    parts.append(f"bs={rec['bs']}")
    if rec.get("ctx"):
        parts.append(f"ctx={rec['ctx']}")
    parts.append(str(rec.get("dataset")))
    if rec.get("temperature"):
        parts.append(f"T={rec['temperature']}")
    return " ".join(parts)


def _equal(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def latest_ok(recs: list[dict]) -> dict[str, dict]:
    out = {}
    for r in recs:
        if r.get("status") == "ok" and r.get("metrics"):
            out[ident(r)] = r
    return out


def compare(new: list[dict], base: list[dict], speed_tol: float = 0.25) -> dict:
    n, b = latest_ok(new), latest_ok(base)
    failures, speed_notes, rows = [], [], []
    failed_new = [r for r in new if r.get("status") != "ok"]
    for r in failed_new:
        failures.append(f"{name(r)}: job {r.get('status')}: {r.get('error')}")
    for key, br in b.items():
        label = name(br)
        nr = n.get(key)
        if nr is None:
            if not any(ident(r) == key for r in failed_new):
                failures.append(f"{label}: missing from the new records")
            continue
        bm, nm = br["metrics"], nr["metrics"]
        if br.get("temperature", 0) == 0:
            for f in EXACT:
                if not _equal(nm.get(f), bm.get(f)):
                    failures.append(f"{label}: {f} changed: {bm.get(f)} -> {nm.get(f)}")
        row = {"job": label}
        for f in SPEED:
            old, cur = bm.get(f), nm.get(f)
            row[f] = (old, cur)
            if old and cur:
                rel = cur / old - 1
                if rel < -speed_tol:
                    speed_notes.append(f"{label}: {f} {old:.3g} -> {cur:.3g} ({rel:+.0%}, tolerance -{speed_tol:.0%})")
        rows.append(row)
    extra = [name(r) for k, r in n.items() if k not in b]
    return {"failures": failures, "speed": speed_notes, "rows": rows, "new_only": extra}


def bench_json(new: list[dict]) -> list[dict]:
    """github-action-benchmark 'customBiggerIsBetter' entries."""
    out = []
    for r in latest_ok(new).values():
        m = r["metrics"]
        label = name(r)
        if m.get("tokens_per_s") is not None:
            out.append({"name": f"{label} tokens/s", "unit": "tokens/s", "value": round(m["tokens_per_s"], 4),
                        "extra": f"device={r.get('device')} sha={r.get('env', {}).get('git_sha')}"})
        if r["method"] != "ar" and m.get("speedup") is not None:
            out.append({"name": f"{label} speedup", "unit": "x", "value": round(m["speedup"], 4)})
        if r["method"] != "ar" and m.get("tau") is not None:
            out.append({"name": f"{label} tau", "unit": "tokens/step", "value": round(m["tau"], 4)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new")
    ap.add_argument("baseline")
    ap.add_argument("--speed-tol", type=float, default=0.25, help="allowed relative slow-down (default 0.25)")
    ap.add_argument("--fail-on-speed", action="store_true", help="a slow-down past the tolerance fails too")
    ap.add_argument("--bench-json", default=None, help="write github-action-benchmark JSON here")
    a = ap.parse_args(argv)
    for p in (a.new, a.baseline):
        if not Path(p).exists():
            print(f"compare: error: {p} does not exist", file=sys.stderr)
            return 2
    new, base = R.read(a.new), R.read(a.baseline)
    if not base:
        print(f"compare: error: no records in baseline {a.baseline}", file=sys.stderr)
        return 2
    res = compare(new, base, a.speed_tol)
    print(f"{'job':<44}{'tok/s base':>12}{'tok/s new':>11}{'speedup base':>14}{'speedup new':>13}")
    for row in res["rows"]:
        t0, t1 = row["tokens_per_s"]
        s0, s1 = row["speedup"]

        def f(x):
            return "-" if x is None else f"{x:.3g}"

        print(f"{row['job'][:43]:<44}{f(t0):>12}{f(t1):>11}{f(s0):>14}{f(s1):>13}")
    if res["new_only"]:
        print(f"\nnot in the baseline (not compared): {', '.join(res['new_only'])}")
    if res["speed"]:
        print("\nslower than the baseline:" + "".join(f"\n  {s}" for s in res["speed"]))
    if a.bench_json:
        Path(a.bench_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.bench_json).write_text(json.dumps(bench_json(new), indent=1))
        print(f"\nbenchmark JSON: {a.bench_json}")
    if res["failures"]:
        print("\nREGRESSION:" + "".join(f"\n  {s}" for s in res["failures"]))
        return 1
    if res["speed"] and a.fail_on_speed:
        return 1
    print(f"\nOK: {len(res['rows'])} jobs match the baseline's deterministic quantities")
    return 0


if __name__ == "__main__":
    sys.exit(main())
