"""Acceptance traces recorded elsewhere, as specbench records: ``analysis.report`` draws every
acceptance figure for them, and ``analysis.replay`` prices them on a GPU cost model.

Formats (``--format``):

- ``specdecode-bench``: SpecDecode-Bench's ``combined_<dataset>.jsonl`` (arXiv 2601.11580), one
  request a line with ``acc_eagle.acc_len`` and ``acc_ngram.acc_len``: for every output position
  p, the tokens a decoding step would emit (accepted drafts + the bonus) had its last committed
  token been output token p. A run at draft length K is read from it by walking: the prefill
  emits token 0; a step from p emits a = min(acc_len[p], K + 1) tokens (a - 1 accepted drafts)
  and the next step starts from p + a; the last step is cut at the output's length. One record a
  proposer and K (``--proposer``, ``--K``); each request also keeps the whole per-position trace
  (``reach``: acc_len - 1 a position, base 36) for the replay, which walks it at any K.
- ``vllm``: responses from a vLLM server started with ``--per-request-spec-decode-metrics
  detailed`` (v0.32; one JSON response a line, or a JSON list): ``metrics.speculative_decoding``
  ``per_step_accepted`` in step order; K is ``num_spec_tokens``. vLLM omits steps that drafted
  nothing; with ``usage.completion_tokens`` they are counted back, as steps accepting 0 (after the
  others: their place is not known), so tau is over every decoding step as ours is. A ``summary``
  response (its histogram only) gives the steps in histogram order (``order: histogram``).
- ``speed-bench``: a ``speculation_profile.json`` (SPEED-Bench, NVIDIA's specdec_bench): one
  pooled ``acceptance_length_histogram`` (emitted tokens per step: count), so one request of
  steps in histogram order; ``per_category`` and the measurement conditions are kept as given.

    python -m specbench.analysis.ingest combined_gsm8k.jsonl --format specdecode-bench --K 3,5
    python -m specbench.analysis.ingest responses.jsonl --format vllm --model meta-llama/Llama-3.1-8B-Instruct
    python -m specbench.analysis.report results/ingested --out reports/ingested
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from specbench.errors import ConfigError
from specbench.run import records as R

FORMATS = ("specdecode-bench", "vllm", "speed-bench")
DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
MAX_ACCEPT = len(DIGITS) - 1


def encode(accepts) -> str:
    return "".join(DIGITS[min(int(a), MAX_ACCEPT)] for a in accepts)


def walk(acc_len: list[int], K: int | None) -> list[int]:
    """Accepted drafts per step of a run at draft length K (None: unbounded, the oracle) read from
    a per-position trace (tokens a step from output position p would emit)."""
    steps, p, end = [], 0, len(acc_len) - 1
    while p < end:
        a = max(1, int(acc_len[p]))
        a = min(a, K + 1) if K is not None else a
        a = min(a, end - p)  # the last step is cut at the output's length
        steps.append(a - 1)
        p += a
    return steps


def metrics_of(requests: list[dict], K: int) -> dict:
    """The acceptance metrics of a record (docs/records.md) from its requests' ``accepts``."""
    per = [[DIGITS.index(c) for c in r["accepts"]] for r in requests]
    steps = [a for s in per for a in s]
    n = len(steps)
    width = max([K] + steps)
    alphas = [sum(a >= i for a in steps) / n for i in range(1, width + 1)] if n else []
    cond = [a / p if p else 0.0 for a, p in zip(alphas, [1.0] + alphas[:-1])]
    taus = [1 + sum(s) / len(s) for s in per if s]
    return {"new_tokens": sum(int(r["new_tokens"]) for r in requests), "steps": n,
            "tau": 1 + sum(steps) / n if n else None,
            "tau_per_request": sum(taus) / len(taus) if taus else None,
            "accept_rate_per_pos": alphas, "accept_rate_per_pos_cond": cond,
            "accept_len_hist": [sum(a == i for a in steps) for i in range(width + 1)],
            "draft_nodes": float(K), "forward_nodes": float(K), "valid_nodes": float(K)}


def request(rid, accepts: list[int], new_tokens: int | None = None, **extra) -> dict:
    """A request row: its steps' accepted drafts; new tokens the prefill's one plus every step's."""
    new = new_tokens if new_tokens is not None else 1 + sum(a + 1 for a in accepts)
    return {"id": str(rid), "turn": 0, "category": extra.pop("category", None), "new_tokens": int(new),
            "steps": len(accepts), "accepted": int(sum(accepts)), "accepts": encode(accepts),
            "tau": 1 + sum(accepts) / len(accepts) if accepts else None, **extra}


def record(source: dict, method: str, K: int, requests: list[dict], model: str, dataset: str, lossless,
           method_cfg: dict | None = None, **extra) -> dict:
    """An ok record of traces recorded elsewhere (``backend``: the source's name: never paired with
    our engine's AR, never priced on our cost curves)."""
    if not requests or not any(r["steps"] for r in requests):
        raise ConfigError(f"{source['file']}: no decoding steps to make a record of")
    key = json.dumps([source, method, K, dataset, model], sort_keys=True, default=str)
    return {"schema": R.SCHEMA, "sweep_id": f"ingest-{source['format']}",
            "job_id": "ingest-" + hashlib.sha1(key.encode()).hexdigest()[:12], "status": "ok", "error": None,
            "method": method, "model": model, "draft": None, "K": K, "bs": 1, "ctx": None, "dataset": dataset,
            "limit": None, "temperature": 0.0, "top_k": None, "top_p": None, "max_new_tokens": None,
            "dtype": extra.pop("dtype", None), "device": extra.pop("device", None), "seed": None,
            "lossless": lossless, "method_cfg": method_cfg or {}, "backend": source["format"], "kernel": None,
            "source": source, "env": {}, "metrics": metrics_of(requests, K), "requests": requests,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra}


# ------------------------------------------------------------------ the formats
def _lines(path: Path) -> list[dict]:
    """JSON objects of a JSON-lines file, or of one JSON list or object; one error line for anything else."""
    text = path.read_text()
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, list) else [obj]
    except json.JSONDecodeError:
        pass
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{n}: not JSON ({e.msg})") from None
    return out


SDB_KEYS = {"eagle3": "acc_eagle", "ngram": "acc_ngram"}


def specdecode_bench(path: Path, Ks: list[int], proposers: list[str], model: str | None, dataset: str | None,
                     lossless) -> list[dict]:
    rows = _lines(path)
    ds = dataset or path.stem.removeprefix("combined_")
    out = []
    for prop in proposers:
        traces = []
        for n, d in enumerate(rows, 1):
            try:
                accs = {k: d[v]["acc_len"] for k, v in SDB_KEYS.items() if v in d}
                acc = [max(x) for x in zip(*accs.values())] if prop == "combined" else accs[prop]
                prompt = len(d.get("prompt_token_ids") or [])
                rid = d.get("id", n)
            except (KeyError, TypeError):
                raise ConfigError(f"{path}:{n}: no {SDB_KEYS.get(prop, 'acc_eagle and acc_ngram')}.acc_len: not "
                                  f"SpecDecode-Bench's layout (its data/<model>/combined_<dataset>.jsonl)") from None
            if not isinstance(acc, list) or not all(isinstance(x, int) and x >= 1 for x in acc):
                raise ConfigError(f"{path}:{n}: acc_len must be a list of whole numbers >= 1 (tokens a step emits)")
            traces.append((rid, prompt, acc))
        name, mcfg = {"eagle3": ("eagle", {"version": 3}), "ngram": ("ngram", {}),
                      "combined": ("combined", {"of": ["eagle3", "ngram"], "rule": "max per position"})}[prop]
        for K in Ks:
            reqs = [request(rid, walk(acc, K), new_tokens=len(acc), prompt_tokens=prompt, reach=encode(a - 1 for a in acc))
                    for rid, prompt, acc in traces]
            src = {"format": "specdecode-bench", "file": str(path), "proposer": prop,
                   "read": "a step from output position p emits min(acc_len[p], K + 1) tokens"}
            out.append(record(src, name, K, reqs, model or "meta-llama/Llama-3.1-8B-Instruct", ds, lossless, mcfg,
                              dtype="bfloat16", device="cuda"))
    return out


def vllm(path: Path, model: str | None, dataset: str | None, lossless) -> list[dict]:
    reqs, K, order = [], 0, "steps"
    for n, d in enumerate(_lines(path), 1):
        sd = ((d.get("metrics") or {}).get("speculative_decoding") if "metrics" in d else d) if isinstance(d, dict) else None
        if not isinstance(sd, dict) or "num_spec_tokens" not in sd:
            raise ConfigError(f"{path}:{n}: no metrics.speculative_decoding: start vLLM (v0.32+) with "
                              "--per-request-spec-decode-metrics detailed, one request a line (n=1)")
        K = max(K, int(sd["num_spec_tokens"]))
        acc = sd.get("per_step_accepted")
        if acc is None:  # summary level: the histogram, not the order
            order = "histogram"
            acc = [j for j, c in enumerate(sd.get("acceptance_histogram") or []) for _ in range(int(c))]
        acc = [int(a) for a in acc]
        usage = d.get("usage") or {}
        done = usage.get("completion_tokens")
        undrafted = max(0, int(done) - 1 - sum(a + 1 for a in acc)) if done is not None else 0
        reqs.append(request(d.get("id", n), acc + [0] * undrafted, prompt_tokens=usage.get("prompt_tokens"),
                            undrafted_steps=undrafted))
    src = {"format": "vllm", "file": str(path), "order": order,
           "read": "metrics.speculative_decoding.per_step_accepted; undrafted steps from usage.completion_tokens"}
    return [record(src, "vllm", K, reqs, model or "unknown", dataset or path.stem, lossless)]


def speed_bench(path: Path, model: str | None, dataset: str | None, lossless) -> list[dict]:
    [p] = _lines(path)[:1] or [None]
    if not isinstance(p, dict) or "num_speculative_tokens" not in p:
        raise ConfigError(f"{path}: not a speculation_profile.json (no num_speculative_tokens)")
    if p.get("measured") is False:
        raise ConfigError(f"{path}: an unmeasured stub profile (measured: false): nothing to ingest")
    hist = {int(k): v for k, v in (p.get("acceptance_length_histogram") or {}).items()}
    if not hist:
        raise ConfigError(f"{path}: no acceptance_length_histogram: the per-step counts are needed")
    scale = 1 if all(float(v).is_integer() for v in hist.values()) else 10000 / sum(hist.values())  # shares
    acc = [k - 1 for k in sorted(hist) for _ in range(round(hist[k] * scale))]
    K = int(p["num_speculative_tokens"])
    tm = p.get("target_model")
    name = model or (tm.get("name") or tm.get("path") if isinstance(tm, dict) else tm) or "unknown"
    mc = p.get("measurement_conditions") or {}
    src = {"format": "speed-bench", "file": str(path), "order": "histogram", "schema_version": p.get("schema_version"),
           "verification_method": p.get("verification_method"), "per_category": p.get("per_category"),
           "measurement_conditions": mc, "mean_accept_length": p.get("mean_accept_length"),
           "read": "acceptance_length_histogram: emitted tokens per step (accepted drafts + 1) -> steps",
           **({"scaled_from_shares": True} if scale != 1 else {})}
    return [record(src, str(p.get("method") or "unknown"), K, [request("all", acc)], str(name),
                   dataset or str(mc.get("dataset") or "speed_bench"), lossless)]


def ingest(path, fmt: str, K: str = "5", proposer: str = "eagle3,ngram", model=None, dataset=None,
           lossless: bool | None = None) -> list[dict]:
    """Records of the traces in ``path`` (one ConfigError line for input it cannot read)."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt}; known: {', '.join(FORMATS)}")
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    if fmt == "specdecode-bench":
        try:
            Ks = [int(k) for k in str(K).split(",")]
        except ValueError:
            raise ConfigError(f"--K takes draft lengths, e.g. 1,3,5; got {K}") from None
        if any(k < 1 or k > MAX_ACCEPT for k in Ks):
            raise ConfigError(f"--K must be 1..{MAX_ACCEPT}")
        props = proposer.split(",")
        bad = [p for p in props if p not in ("eagle3", "ngram", "combined")]
        if bad:
            raise ConfigError(f"unknown proposer {bad[0]}; SpecDecode-Bench's: eagle3, ngram, combined")
        # SpecDecode-Bench's traces: greedy decoding under vLLM, lossless
        return specdecode_bench(path, Ks, props, model, dataset, True if lossless is None else lossless)
    if fmt == "vllm":  # vLLM verifies with its rejection sampler: lossless
        return vllm(path, model, dataset, True if lossless is None else lossless)
    return speed_bench(path, model, dataset, lossless)  # the profile does not say


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specbench.analysis.ingest", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="the traces")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--K", default="5", help="specdecode-bench: draft lengths to read the traces at (a record each)")
    ap.add_argument("--proposer", default="eagle3,ngram", help="specdecode-bench: eagle3, ngram, combined (max of both)")
    ap.add_argument("--model", default=None, help="the target's name (default: what the source says)")
    ap.add_argument("--dataset", default=None, help="the data set's name (default: from the file)")
    ap.add_argument("--lossless", choices=("true", "false"), default=None,
                    help="override the source's verification (default: what it says; unknown for speed-bench)")
    ap.add_argument("--out", default="results/ingested/records.jsonl", help="records file to append to")
    a = ap.parse_args(argv)
    try:
        recs = ingest(a.file, a.format, a.K, a.proposer, a.model, a.dataset,
                      None if a.lossless is None else a.lossless == "true")
    except ConfigError as e:
        ap.error(str(e))
    for r in recs:
        R.append(a.out, r)
        m = r["metrics"]
        print(f"{r['method']} K={r['K']} on {r['dataset']}: {len(r['requests'])} requests, {m['steps']} steps, "
              f"tau {m['tau']:.2f} (per request {m['tau_per_request']:.2f}), alpha "
              + " ".join(f"{x:.2f}" for x in m["accept_rate_per_pos"][:r["K"]]))
    print(f"{len(recs)} record(s) appended to {a.out}; `python -m specbench.analysis.report {a.out} --out <folder>` "
          "draws them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
