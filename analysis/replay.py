"""Replay per-position acceptance traces on a cost model, batch by batch, as SpecDecode-Bench's
simulator does (arXiv 2601.11580): what an acceptance profile buys on a given GPU at a given
batch size, before renting one.

Its experiment: each request is decoded as a batch of ``bs`` copies of itself, once plainly and
once speculatively, with the KV cache of every row priced as it grows (T(b, n, kv) of
``analysis.costmodel``). A step costs the verify forward, each row's drafting and the step's
overhead; a row's latency is the prefill, and then its steps. Its speedup is the mean over
requests of the speculative batch's tokens/s over the mean of the plain batch's.

Policies: ``fixed-K`` verifies K drafts a row every step; ``oracle`` exactly as many as will be
accepted (a step's width is its accepted length + 1). n-gram drafting at a fixed K has no match
(width 1, no draft cost) at a step that would accept nothing with probability 1 - p (``--ngram-match``,
by default SpecDecode-Bench's assumption per data set), drawn at random, as its simulator does.

Combined oracle (EAGLE-3 with n-gram): ``--combine theirs`` is SpecDecode-Bench's rule (each step
the longer of the two proposals, drafting charged at n-gram's cost); ``ours`` chooses per step,
by dynamic programming over positions, EAGLE-3, n-gram or a plain step, each method charged its
own drafting (never slower than theirs at n-gram's cost, and honest about EAGLE's).

Rows are charged their own widths in the verify (``--width own``: vLLM packs each row's tokens,
as SpecDecode-Bench models it), or every row the batch's widest (``widest``: our engine pads).
Copies of one request are alike except where n-gram matching is drawn, so the two differ there only.

    python -m specbench.analysis.ingest combined_gsm8k.jsonl --format specdecode-bench --K 1 --out traces.jsonl
    python -m specbench.analysis.replay traces.jsonl --cost specdecode-bench-h100 --bs 1,8,32,128
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from specbench.analysis.costmodel import resolve
from specbench.analysis.ingest import DIGITS
from specbench.errors import ConfigError, did_you_mean
from specbench.run import records as R

# SpecDecode-Bench's assumed chance that n-gram lookup finds a match at a step that accepts nothing
NGRAM_MATCH = {"sharegpt": 0.2, "cnn": 0.4, "gsm8k": 0.2, "instructcoder": 0.8}
SAMPLE, SEED = 300, 42  # its sample of requests, and its seed


def trace(r: dict) -> list[int]:
    """A request's per-position trace: tokens a step from each output position would emit."""
    return [DIGITS.index(c) + 1 for c in r["reach"]]


def _ar(cost, bs: int, P: int, L: int) -> float:
    """A plain row's latency: its prefill, then one step per token after the prefill's."""
    t = cost.target(bs, P, 0) + cost.overhead_s
    kv = bs * (P + 1)
    for _ in range(L - 1):
        t += cost.target(bs, 1, kv) + cost.overhead_s
        kv += bs
    return t


def _sd(cost, bs: int, P: int, acc: list[int], K: int | None, kind: str, width: str, p_match: float,
        rng: random.Random) -> float:
    """Mean latency of ``bs`` speculative copies of one request (K None: the oracle). Only n-gram at
    a fixed K draws (whether each row's lookup matched); otherwise the copies step alike."""
    L = len(acc)
    if kind != "ngram" or K is None:
        return _alike(cost, bs, P, acc, K, kind)
    lat = [cost.target(bs, P, 0) + cost.overhead_s] * bs
    cur = [1] * bs
    live = list(range(bs))
    kv = bs * (P + 1)
    while live:
        w = {}
        for i in live:
            if acc[cur[i] - 1] == 1 and not rng.random() < p_match:
                w[i] = 1  # no n-gram matched: nothing drafted
            else:
                w[i] = K + 1
        n = sum(w.values()) / len(live) if width == "own" else max(w.values())
        v = cost.target(len(live), n, kv)
        nxt = []
        for i in live:
            d = 0.0 if w[i] == 1 else cost.draft(kind, len(live), w[i], kv, v)
            lat[i] += v + d + cost.overhead_s
            got = min(acc[cur[i] - 1], w[i])
            cur[i] += got
            kv += got
            if cur[i] >= L:
                kv -= cur[i] + P
            else:
                nxt.append(i)
        live = nxt
    return sum(lat) / bs


def _alike(cost, bs: int, P: int, acc: list[int], K: int | None, kind: str) -> float:
    """``_sd`` for copies that step alike: each step's verify at bs rows of one width, each row's
    drafting read at the KV it saw (the rows before it in the step already committed: the mean)."""
    lat = cost.target(bs, P, 0) + cost.overhead_s
    cur, kv, L = 1, bs * (P + 1), len(acc)
    while cur < L:
        a = acc[cur - 1]
        w = a if K is None else K + 1
        v = cost.target(bs, w, kv)
        got = min(a, w)
        # combined (SpecDecode-Bench's rule): every step drafts at n-gram's cost, a width-1 step too
        d = cost.draft("ngram" if kind == "combined" else kind, bs, w, kv + got * (bs - 1) / 2, v)
        lat += v + (0.0 if kind == "ngram" and w == 1 else d) + cost.overhead_s
        cur += got
        kv += bs * got
    return lat


def _combined_ours(cost, bs: int, P: int, traces: dict[str, list[int]]) -> float:
    """The fastest path through the positions (rows alike): each step EAGLE-3's or n-gram's proposal
    at its oracle width, each with its own drafting, or a plain step."""
    L = min(len(t) for t in traces.values())
    best = [0.0] * (L + 1)
    for c in range(L - 1, 0, -1):
        kv = bs * (P + c)
        t1 = cost.target(bs, 1, kv) + cost.overhead_s
        cand = [t1 + best[c + 1]]
        for kind, acc in traces.items():
            a = acc[c - 1]
            v = cost.target(bs, a, kv)
            d = 0.0 if kind == "ngram" and a == 1 else cost.draft(kind, bs, a, kv, v)
            cand.append(v + d + cost.overhead_s + best[min(L, c + a)])
        best[c] = min(cand)
    return cost.target(bs, P, 0) + cost.overhead_s + best[1]


def replay(reqs: list[dict], cost, bs: int, policy: str, kind: str, dataset: str = "", width: str = "own",
           ngram_match: float | None = None, combine: str = "theirs", seed: int = SEED) -> float:
    """SpecDecode-Bench's speedup of one policy at one batch size. ``reqs``: (prompt tokens,
    {proposer: trace}) per request, in the source's order (its sample of 300 is drawn as it draws
    it). policy: ``fixed-K`` or ``oracle``; kind: eagle3, ngram or combined."""
    rng = random.Random(seed)
    pool = rng.sample(reqs, min(SAMPLE, len(reqs)))
    p = next((v for k, v in NGRAM_MATCH.items() if k in dataset), 1.0) if ngram_match is None else ngram_match
    K = None if policy == "oracle" else int(policy.removeprefix("fixed-"))
    sd_tpt = ar_tpt = 0.0
    for P, traces in pool:
        if kind == "combined":
            L = min(len(t) for t in traces.values())
            if combine == "ours":
                sd = _combined_ours(cost, bs, P, traces)
            else:
                acc = [max(x) for x in zip(*traces.values())]
                sd = _sd(cost, bs, P, acc, None, "combined", width, p, rng)
        else:
            acc = traces[kind]
            L = len(acc)
            sd = _sd(cost, bs, P, acc, K, kind, width, p, rng)
        ar = _ar(cost, bs, P, L)
        sd_tpt += bs * L / sd
        ar_tpt += bs * L / ar
    return sd_tpt / ar_tpt


def requests_of(recs: list[dict], dataset: str | None = None) -> tuple[list, str]:
    """(prompt tokens, {proposer: trace}) per request from ingested records of one data set with
    per-position traces (``reach``): one record per proposer suffices (its K does not matter),
    matched by request id."""
    sets = sorted({str(r.get("dataset")) for r in recs if dataset is None or r.get("dataset") == dataset})
    if len(sets) > 1:
        raise ConfigError(f"records of {len(sets)} data sets ({', '.join(sets)}): pick one with --dataset")
    by: dict = {}
    order: list = []
    ds = None
    for rec in (r for r in recs if str(r.get("dataset")) in sets):
        prop = (rec.get("source") or {}).get("proposer") or rec.get("method")
        if prop == "combined":
            continue
        ds = ds or rec.get("dataset")
        for r in rec.get("requests") or []:
            if "reach" not in r:
                raise ConfigError(f"{rec.get('method')} ({rec.get('backend')}) has no per-position traces (reach): "
                                  "the replay needs SpecDecode-Bench-style traces (analysis.ingest --format "
                                  "specdecode-bench)")
            if r["id"] not in by:
                order.append(r["id"])
            by.setdefault(r["id"], (int(r.get("prompt_tokens") or 0), {}))[1][prop] = trace(r)
    if not by:
        there = sorted({str(r.get("dataset")) for r in recs})
        raise ConfigError("no records with traces to replay" + (f" in data set {dataset}; the records' data sets: "
                                                                 f"{', '.join(there)}" if dataset else ""))
    return [by[i] for i in order], ds or ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.analysis.replay", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="records from analysis.ingest --format specdecode-bench (one data set)")
    ap.add_argument("--cost", default="specdecode-bench-h100", help="a cost model (analysis.costmodel list)")
    ap.add_argument("--bs", default="1,8,16,32,64,128")
    ap.add_argument("--policy", default="fixed-1,fixed-3,fixed-5,oracle")
    ap.add_argument("--proposer", default="eagle3,ngram,combined")
    ap.add_argument("--width", choices=("own", "widest"), default="own")
    ap.add_argument("--combine", choices=("theirs", "ours"), default="theirs")
    ap.add_argument("--ngram-match", type=float, default=None, help="chance an n-gram matches at a step accepting "
                    "nothing (default SpecDecode-Bench's per data set, else 1)")
    ap.add_argument("--dataset", default=None, help="the records' data set to replay (also picks the n-gram match "
                    "chance)")
    ap.add_argument("--json", default=None, help="write the speedups here too")
    a = ap.parse_args(argv)
    try:
        cost = resolve(a.cost)
        if not Path(a.records).exists():
            raise ConfigError(f"{a.records}: no such file")
        reqs, ds = requests_of(R.read(a.records), a.dataset)
        bs_list = [int(x) for x in a.bs.split(",")]
        if any(b < 1 for b in bs_list):
            raise ConfigError(f"--bs {a.bs}: batch sizes are positive integers")
        have = set(reqs[0][1])
        kinds = sorted(have) + (["combined"] if len(have) > 1 else [])
        for prop in a.proposer.split(","):
            if prop not in kinds:
                raise ConfigError(f"--proposer {prop}:{did_you_mean(prop, kinds)} the records' proposers are "
                                  f"{', '.join(kinds)}")
        for pol in a.policy.split(","):
            if pol != "oracle" and not (pol.startswith("fixed-") and pol[6:].isdigit() and int(pol[6:]) > 0):
                raise ConfigError(f"--policy {pol}: a policy is fixed-K (K a positive integer) or oracle")
    except (ConfigError, ValueError) as e:
        ap.error(str(e))
    rows = []
    for prop in a.proposer.split(","):
        if prop != "combined" and prop not in have or prop == "combined" and len(have) < 2:
            continue
        for pol in (["oracle"] if prop == "combined" else a.policy.split(",")):
            sp = [replay(reqs, cost, b, pol, prop, ds, a.width, a.ngram_match, a.combine) for b in bs_list]
            rows.append({"proposer": prop, "policy": pol, "speedups": dict(zip(bs_list, sp))})
            print(f"{prop:<9} {pol:<8} " + " ".join(f"bs={b}: {s:.3f}" for b, s in zip(bs_list, sp)))
    if a.json:
        Path(a.json).write_text(json.dumps({"cost": cost.name, "dataset": ds, "width": a.width,
                                            "combine": a.combine, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
