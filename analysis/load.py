"""Records -> pandas, with the derived quantities the figures and tables need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from specbench.analysis import theory
from specbench.decode.verify import SIBLING_RATES
from specbench.run import metrics as M
from specbench.run import records as R

KEY = list(R.BASELINE_KEYS)


def load(path: str | Path, method=None, model=None, dataset=None, sweep=None, ok_only=True) -> pd.DataFrame:
    """One row per job. ``method``/``model``/``dataset``/``sweep`` filter (a value or a list)."""
    recs = R.read(path)
    if ok_only:
        recs = [r for r in recs if r.get("status") == "ok" and r.get("metrics")]
    rows = []
    for r in recs:
        m = r["metrics"]
        row = {k: r.get(k) for k in ("sweep_id", "job_id", "ar_job_id", "method", "model", "draft", "K", "bs", "ctx", "dataset", "limit",
                                     "temperature", "top_k", "top_p", "max_new_tokens", "dtype", "device", "seed",
                                     "status", "error", "lossless")}
        row["kernel"] = R.current(r, "kernel") or "torch"  # records before kernels ran torch's path
        row["kernel_isa"] = r.get("kernel_isa")  # native tiles: AVX2 or AVX-512 (None: records before it was kept)
        row["compile"] = r.get("compile") or False  # true: torch.compile; "graphs": captured forwards
        row["backend"] = r.get("backend") or "specbench"  # the engine that decoded (backend=vllm)
        row["backend_version"] = r.get("backend_version")
        vm = m.get("vllm") or {}
        row["tau_drafted"] = vm.get("tau_drafted")  # vLLM's own acceptance length: drafted steps only
        row["alphas_drafted"] = vm.get("accept_rate_per_pos_drafted") or []
        serving = r.get("serving") or {}
        row["batching"] = serving.get("batching", "static")
        row["rate"] = serving.get("rate")
        row["prefill_chunk"] = serving.get("prefill_chunk")  # None: joining prompts prefilled together, left-padded
        lat = m.get("latency") or {}
        for name, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s"), ("e2e", "e2e_s")):
            for p in ("p50", "p90", "p99"):
                row[f"{name}_{p}"] = (lat.get(key) or {}).get(p)
        row["requests_per_s"] = m.get("requests_per_s")
        row["goodput_rps"] = (m.get("goodput") or {}).get("requests_per_s")
        row["in_flight_mean"] = (m.get("in_flight") or {}).get("mean")
        row["steady_tokens_per_s"] = (m.get("in_flight") or {}).get("steady_tokens_per_s")
        row.update({k: m.get(k) for k in ("new_tokens", "wall_s", "tokens_per_s", "steps", "iterations", "tau",
                                          "draft_nodes",
                                          "speedup", "match_ar", "verify_share", "engine_overhead", "ttft_s",
                                          "tpot_s", "peak_mem_bytes", "energy_j")})
        row["forward_nodes"], row["valid_nodes"] = R.nodes(m)  # older records: no width, their count is valid_nodes
        for ph, v in (m.get("time_s") or {}).items():
            row[f"t_{ph}"] = v
        q = m.get("quality") or {}
        row["quality"], row["quality_ar"], row["quality_metric"] = q.get("value"), q.get("ar_value"), q.get("metric")
        row["method_cfg"] = r.get("method_cfg") or {}
        row["method_opts"] = r.get("method_opts") or {}
        row["above_bound"] = R.above_bound(r)  # a speedup above tau, in words: its AR baseline ran slow
        row["ar_paired"] = R.ar_paired(r)  # False: its speedup stands on an AR job run apart (sweep, any)
        row["accept"] = (r.get("accept") or {}).get("name")  # synthetic: acceptance drawn at given rates
        row["accept_rates"] = (r.get("accept") or {}).get("rates")
        row["accept_sibling_rates"] = (r.get("accept") or {}).get("sibling_rates")
        row["K_auto"] = bool(r.get("K_auto"))  # K=auto: the setting was chosen per job (tuned.chosen)
        row["K_auto_cost"] = r["K_auto"] if isinstance(r.get("K_auto"), str) else None  # priced on this cost model
        row["tuned_chosen"] = (r.get("tuned") or {}).get("chosen")
        row["alphas"] = m.get("accept_rate_per_pos") or []
        row["hist"] = m.get("accept_len_hist") or []
        row["requests"] = r.get("requests") or []
        # tau and alpha_i by category, turn and thinking span; records before the field: from their requests
        row["acceptance_by"] = m.get("acceptance_by") or M.acceptance_by(row["requests"], r.get("K") or 0)
        row["_key"] = json.dumps([R.current(r, k) for k in KEY], default=str, sort_keys=True)
        rows.append(row)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    for col, val in (("method", method), ("model", model), ("dataset", dataset), ("sweep_id", sweep)):
        if val is not None:
            vals = val if isinstance(val, (list, tuple)) else [val]
            df = df[df[col].isin(vals)]
    df = df.copy()
    df["label"] = df.apply(label, axis=1)
    return add_theory(df)


def spec_len(row) -> int | None:
    """A job's K as an int, None where it has none (AR; a method without a fixed draft length:
    a DataFrame holds those as NaN)."""
    k = row.get("K")
    return None if k is None or k != k else int(k)


def k_label(row, sep: str = " ") -> str:
    """``" K=4"`` for a job with a K, else ``""``."""
    k = spec_len(row)
    return "" if k is None else f"{sep}K={k}"


def ctx_suffix(ctx: pd.Series, sep: str = ", ") -> pd.Series:
    """Each row's input length (``<sep>ctx=N``) where the rows differ in it; "" otherwise, and for a
    row with none (the prompt as asked)."""
    multi = ctx.nunique(dropna=False) > 1
    return ctx.map(lambda c: f"{sep}ctx={int(c)}" if multi and c == c and c is not None else "")


def untuned(series: str) -> str:
    """A K=auto series' name without its K=auto part: the series of its fixed settings."""
    return re.sub(r" \(K=auto(?: on [^)]*)?\)", "", series, count=1)


def label(row) -> str:
    cost = row.get("K_auto_cost")
    base = _label(row) + ((f" (K=auto on {cost})" if isinstance(cost, str) else " (K=auto)") if row.get("K_auto") else "")
    if row.get("accept") == "synthetic":  # drawn acceptance, not the target's: never mixed with real runs
        rates = row.get("accept_rates") or []
        sib = row.get("accept_sibling_rates")  # a tree's lower-ranked children; records before it: first child only
        sib = (", first-child rule" if sib is None else "" if list(sib) == list(SIBLING_RATES)
               else ", siblings " + "/".join(f"{r:g}" for r in sib))
        base += " (synthetic " + (f"{rates[0]:g}" if len(set(rates)) == 1 else "/".join(f"{r:g}" for r in rates)) + sib + ")"
    if row.get("backend") not in (None, "specbench"):  # another engine's job is its own series
        base += f" [{row['backend']}]"
    chunk = row.get("prefill_chunk")
    chunk = "" if chunk is None or chunk != chunk else f", prefill {int(chunk)}"  # chunked prefill: its own series
    if row.get("batching") == "continuous":  # a serving job is its own series
        rate = row.get("rate")
        return base + (f" [continuous{chunk}]" if rate in (None, "inf") else f" [continuous, {rate:g} req/s{chunk}]")
    return base + (f" [{chunk[2:]}]" if chunk else "")


def _label(row) -> str:
    if row["method"] == "ar":
        return "ar"
    if row["method"] == "leviathan" and row.get("draft"):
        return f"leviathan ({row['draft']})"
    mc = row.get("method_cfg") or {}
    if row["method"] == "specdec" and int(mc.get("beta") or 1) > 1:  # each relaxation is its own method
        return f"specdec (beta={mc['beta']}, tol={mc['tol']:g})"
    if row["method"] == "medusa" and mc.get("accept") == "typical":
        return "medusa (typical)"
    if row["method"] == "sam" and mc.get("fallback") not in (None, "none"):  # the paper's SAM[Token Recycling]
        return f"sam[{mc['fallback']}]"
    if row["method"] == "dspark" and float(row.get("temperature") or 0) > 0 and not mc.get("sample_drafts"):
        return "dspark (argmax drafts)"  # at a temperature: drafts not drawn from q (records before sample_drafts)
    if row["method"] == "combo" and mc.get("of"):
        return "combo (" + "+".join(mc["of"]) + ")"
    if row["method"] == "eagle":  # EAGLE-3's drafter, and EAGLE-1's static tree, are their own series
        name = "eagle-3" if mc.get("version") == 3 else "eagle"
        tree = mc.get("tree")
        return name + (f" ({tree})" if tree not in (None, "dynamic") else "")
    return str(row["method"])


def setting_of(row, keys) -> str:
    """A job's values of a tuned setting's keys (``K``, ``method.<key>``), as K=auto writes them."""
    def value(k):
        return row.get("K") if k == "K" else (row.get("method_opts") or {}).get(k.removeprefix("method."))

    out = []
    for k in keys:
        v = value(k)
        out.append(f"{k.removeprefix('method.')}={int(v) if isinstance(v, float) and v == v and v.is_integer() else v}")
    return " ".join(out)


def ar_baselines(df: pd.DataFrame):
    """A function giving each job's AR row: the exact record it was paired with when that is
    loaded (``ar_job_id``: a paired job's own AR run), else the latest AR job with the same
    baseline settings; None for AR jobs and jobs without one."""
    ars = df[df["method"] == "ar"]
    by_key = {k: row for k, row in ars.drop_duplicates("_key", keep="last").set_index("_key").iterrows()}
    by_id = {row["job_id"]: row for _, row in ars.iterrows() if row.get("job_id")} if "job_id" in ars else {}

    def of(r):
        if r["method"] == "ar":
            return None
        jid = r.get("ar_job_id")
        if isinstance(jid, str) and jid in by_id:
            return by_id[jid]
        return by_key.get(r["_key"])

    return of


def add_theory(df: pd.DataFrame) -> pd.DataFrame:
    """Per job: the measured cost ratio c, the i.i.d. alpha and the two closed-form bounds."""
    ar_of = ar_baselines(df)
    cs, alphas, lev, pos = [], [], [], []
    for _, r in df.iterrows():
        c = a = s_lev = s_pos = float("nan")
        base = ar_of(r)
        K = spec_len(r)
        if K and base is not None and r.get("iterations"):
            t_target = base["t_verify"] / base["iterations"] if base.get("iterations") else float("nan")
            t_draft_tok = r["t_draft"] / r["iterations"] / K
            c = t_draft_tok / t_target if t_target and t_target > 0 else float("nan")
            a = theory.alpha_from_positions(r["alphas"][:K])
            s_lev = theory.leviathan_speedup(a, K, c)
            s_pos = theory.per_position_tokens(r["alphas"]) / (K * c + 1.0)
        cs.append(c)
        alphas.append(a)
        lev.append(s_lev)
        pos.append(s_pos)
    df["c"] = cs
    df["alpha"] = alphas
    lo, hi = [], []
    for _, r in df.iterrows():  # 95% bootstrap interval of the speedup, over batches, paired with AR
        ci = None
        base = ar_of(r)
        # a serving job's requests share one stream (their latencies overlap): no independent
        # units to resample within it, so no interval (its repeats would be the units)
        if base is not None and r["requests"] and r.get("batching") != "continuous":
            ci = theory.bootstrap_speedup(r["requests"], base["requests"], int(r["bs"]))
        lo.append(ci[0] if ci else float("nan"))
        hi.append(ci[1] if ci else float("nan"))
    df["speedup_lo"] = lo
    df["speedup_hi"] = hi
    df["bound_leviathan"] = lev
    df["bound_per_position"] = pos
    return df


def load_cost_curves(path: str | Path) -> list[dict]:
    p = Path(path)
    files = sorted(p.rglob("cost_curves*.jsonl")) if p.is_dir() else [p.parent / "cost_curves.jsonl"]
    out, skipped = [], R.Skipped()
    for f in files:
        if f.exists():  # a line cut by a crash, or null, is skipped and reported, never fatal
            out += R.parse_lines(f, skipped)
    skipped.report("cost-curve")
    for c in out:  # curves profiled under an old kernel name pair with today's records
        if "kernel" in c:
            c["kernel"] = R.current(c, "kernel")
    return out


def method_rows(df):
    """The method rows (not AR) with a ``series`` label: the method, and the dataset, model,
    temperature, dtype, kernel, compile mode and length where the rows differ in them (never one
    point of an fp32 and a bf16 job, or of an eager and a graphed one), and
    "(unpaired)" where its speedup stands on an AR job run apart (``ar_paired`` false)."""
    sd = df[df["method"] != "ar"].copy()
    if sd.empty:
        return sd
    multi_ds = sd["dataset"].nunique() > 1
    multi_t = sd["temperature"].nunique() > 1
    multi_dt = sd["dtype"].nunique() > 1  # never average an fp32 and a bf16 job into one point
    multi_n = sd["max_new_tokens"].nunique() > 1
    multi_m, multi_k = sd["model"].nunique() > 1, sd["kernel"].nunique() > 1
    multi_c = sd["compile"].astype(str).nunique() > 1  # eager beside compiled or graphed: never one point
    # what differs between the rows beside the method and the data set (per_category names the data set its own way)
    sd["settings"] = sd.apply(lambda r: (f", {r['model']}" if multi_m else "")
                              + (f", T={r['temperature']:g}" if multi_t else "")
                              + (f", {r['dtype']}" if multi_dt else "")
                              + (f", {r['kernel']}" if multi_k else "")
                              + (f", compile={r['compile']}" if multi_c else "")
                              + (f", {int(r['max_new_tokens'])} tok" if multi_n else ""), axis=1)
    sd["series"] = sd.apply(lambda r: r["label"] + (f", {r['dataset']}" if multi_ds else "") + r["settings"]
                            + (" (unpaired)" if r.get("ar_paired") is False else ""), axis=1)  # AR run apart
    sd["ctx_label"] = ctx_suffix(sd["ctx"])  # a figure of one mark per job names its input length
    sd["job"] = sd["series"] + sd["ctx_label"]
    return sd
