"""The report's tables (Markdown and LaTeX, full ones as CSV): the sweep, per category
(Spec-Bench style), token identity with AR, K=auto against fixed settings, the two engines."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from specbench.analysis.load import _label, ar_baselines, method_rows, setting_of, spec_len, untuned
from specbench.run import records as R
from specbench.run.data import category_order


def tuned_table(df) -> pd.DataFrame:
    """K=auto against fixed settings: per tuned series and batch size, the tuned job's speedup and
    chosen setting beside the best fixed setting measured (same series otherwise) and their ratio."""
    sd = method_rows(df).dropna(subset=["speedup"])
    if sd.empty or not sd["K_auto"].any():
        return pd.DataFrame()
    rows = []
    for (series, bs), a in sd[sd["K_auto"]].groupby(["series", "bs"]):
        keys = list(a.iloc[-1]["tuned_chosen"] or {})
        fixed = sd[(~sd["K_auto"]) & (sd["series"] == untuned(series)) & (sd["bs"] == bs)]
        best = fixed.loc[fixed["speedup"].idxmax()] if not fixed.empty else None
        t = a["speedup"].mean()
        rows.append({"method": series, "bs": int(bs), "chosen": setting_of(a.iloc[-1], keys),
                     "tuned speedup": t, "best fixed": setting_of(best, keys) if best is not None else "-",
                     "best fixed speedup": best["speedup"] if best is not None else math.nan,
                     "fixed settings": len(fixed.groupby(fixed.apply(lambda r: setting_of(r, keys), axis=1))),
                     "tuned / best": t / best["speedup"] if best is not None else math.nan})
    return pd.DataFrame(rows)


ENGINE_KEYS = ["method", "draft", "K", "bs", "dataset", "temperature", "max_new_tokens", "dtype"]


def engines_table(df) -> pd.DataFrame:
    """The same job on each engine (``backend=vllm`` beside ours): per method, K, batch size and data,
    each engine's tokens/s, speedup over its own AR and tau over every decoding step, vLLM's own tau
    (drafted steps only) and acceptance per position on both."""
    if "backend" not in df or df["backend"].nunique() < 2:
        return pd.DataFrame()
    sd = df[df["method"] != "ar"].copy()
    sd["K"] = sd["K"].fillna(-1)
    sd["draft"] = sd["draft"].fillna("-")
    rows = []
    for key, g in sd.groupby(ENGINE_KEYS):
        eng = {b: e for b, e in g.groupby("backend")}
        if len(eng) < 2 or "specbench" not in eng:
            continue
        ours = eng.pop("specbench")
        for b, other in eng.items():
            o, t = ours.iloc[-1], other.iloc[-1]
            k = dict(zip(ENGINE_KEYS, key))
            a1 = "/".join(f"{x:.2f}" for x in (o["alphas"] or [])[:4])
            a2 = "/".join(f"{x:.2f}" for x in (t["alphas"] or [])[:4])
            # greedy outputs the two engines agree on, prompt by prompt (fp32 kernels differ: a near-tie can flip)
            mine = {(q["id"], q["turn"]): q.get("out_sha") for q in o["requests"]}
            theirs = {(q["id"], q["turn"]): q.get("out_sha") for q in t["requests"] if (q["id"], q["turn"]) in mine}
            same = sum(mine[x] == y for x, y in theirs.items())
            rows.append({"method": _label(o) + ("" if k["K"] < 0 else f" K={int(k['K'])}"), "bs": int(k["bs"]),
                         "dataset": k["dataset"], "specbench tok/s": o["tokens_per_s"], f"{b} tok/s": t["tokens_per_s"],
                         "specbench speedup": o["speedup"], f"{b} speedup": t["speedup"],
                         "specbench tau": o["tau"], f"{b} tau": t["tau"],
                         f"tau {b}/specbench": t["tau"] / o["tau"] if o["tau"] else math.nan,
                         f"{b} tau (drafted steps)": t.get("tau_drafted"),
                         "alpha 1-4 specbench": a1, f"alpha 1-4 {b}": a2,
                         "same outputs": same / len(theirs) if theirs else math.nan})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------- tables
def per_category(df: pd.DataFrame) -> pd.DataFrame:
    """Spec-Bench style: speedup and tau per category (and overall) for each method, at each
    batch size; speedup from per-request tokens and wall time against the AR job."""
    rows = []
    ar_of = ar_baselines(df)
    sd = method_rows(df)  # a row per method and whatever else differs between the jobs (their settings)
    multi_ds = df["dataset"].nunique() > 1  # each data set's categories (and overall) on rows of their own
    for _, r in sd.iterrows():
        if (ar := ar_of(r)) is None:
            continue
        base = pd.DataFrame(ar["requests"])
        mine = pd.DataFrame(r["requests"])
        if base.empty or mine.empty:
            continue
        for cat, g in list(mine.groupby("category")) + [("overall", mine)]:
            b = base[base["category"] == cat] if cat != "overall" else base
            tps = g["new_tokens"].sum() / g["wall_s"].sum()
            tps_ar = b["new_tokens"].sum() / b["wall_s"].sum()
            steps = g["steps"].sum()
            tau = 1 + g["accepted"].sum() / steps if steps else float("nan")
            rows.append({"method": r["label"] + (f" ({r['dataset']})" if multi_ds else "") + r["settings"]
                         + r["ctx_label"] + (" (unpaired)" if r.get("ar_paired") is False else ""), "T": float(r["temperature"]),
                         "K": spec_len(r), "bs": int(r["bs"]),
                         "category": cat,
                         "speedup": tps / tps_ar, "tau": tau})
    if not rows:
        return pd.DataFrame()
    t = pd.DataFrame(rows).drop_duplicates(["method", "T", "K", "bs", "category"], keep="last")
    t["K"] = t["K"].astype("Int64")
    # dropna=False keeps the jobs without a K (REST); it also pairs every index value with every
    # other, so the empty combinations go after
    wide = t.pivot_table(index=["method", "T", "K", "bs"], columns="category", values=["speedup", "tau"],
                         dropna=False).dropna(how="all")
    cats = category_order(c for c in t["category"].unique() if c != "overall") + ["overall"]  # Spec-Bench's order
    wide = wide.reindex(columns=pd.MultiIndex.from_product([["speedup", "tau"], cats]))
    return wide


def sweep_table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(speedup_ci=[f"{lo:.2f}-{hi:.2f}" if lo == lo and hi == hi else None
                               for lo, hi in zip(df["speedup_lo"], df["speedup_hi"])])
    for col in ("bound_batch", "of_bound", "curve_gap"):
        if col not in df:
            df[col] = float("nan")
    # the AR each speedup stands on: run beside it (paired), or an AR job run apart (unpaired)
    df["ar_paired"] = [{True: "paired", False: "unpaired"}.get(p, "-") for p in df.get("ar_paired", [None] * len(df))]
    cols = ["label", "model", "dataset", "dtype", "kernel", "temperature", "bs", "K", "ctx", "tokens_per_s", "speedup",
            "speedup_ci", "ar_paired", "tau",
            "alpha", "c",
            "bound_leviathan", "bound_batch", "of_bound", "curve_gap", "verify_share", "match_ar", "above_bound",
            "peak_mem_bytes"]
    scored = df["quality"].notna().any() if "quality" in df else False
    if scored:  # task score of the job and of its AR baseline (GSM8K accuracy, HumanEval pass@1)
        cols = cols[:-1] + ["quality", "quality_ar", "peak_mem_bytes"]
    t = df[cols].copy()
    if scored:
        t["quality"] = 100 * t["quality"].astype(float)
        t["quality_ar"] = 100 * t["quality_ar"].astype(float)
        t = t.rename(columns={"quality": "score %", "quality_ar": "AR score %"})
    t["model"] = t["model"].map(lambda s: str(s).split("/")[-1])
    t["peak_mem_bytes"] = t["peak_mem_bytes"] / 2**20
    for col in ("bs", "K", "ctx"):
        t[col] = t[col].astype("Int64")
    t["verify_share"] = 100 * t["verify_share"]
    t["match_ar"] = 100 * t["match_ar"]
    t["of_bound"] = 100 * t["of_bound"]
    t = t.rename(columns={"label": "method", "temperature": "T", "tokens_per_s": "tok/s", "bound_leviathan": "bound",
                          "bound_batch": "batch bound", "of_bound": "% of batch bound",
                          "curve_gap": "curve / AR step", "above_bound": "above bound",
                          "speedup_ci": "95% CI", "ar_paired": "AR",
                          "verify_share": "verify %", "match_ar": "match AR %", "peak_mem_bytes": "peak MiB"})
    return t.sort_values(["model", "dataset", "dtype", "T", "bs", "method", "K"],
                         na_position="first").reset_index(drop=True)


SETTINGS = ("model", "dataset", "dtype", "kernel", "T", "bs", "K", "ctx")


SETTINGS = ("model", "dataset", "dtype", "kernel", "T", "bs", "K", "ctx")
PAPER_COLUMNS = 8  # a sweep table a paper can use as it is; the full table goes to CSV beside it


def _fixed(t: pd.DataFrame, cols) -> tuple[list[str], str]:
    """(the settings that vary between rows, 'key=value' of those that do not)."""
    varying = [c for c in cols if c in t and t[c].astype(str).nunique() > 1]
    fixed = ", ".join(f"{c}={fmt(t[c].iloc[0])}" for c in cols if c in t and c not in varying and len(t))
    return varying, fixed


def paper_sweep(full: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The sweep table in at most ``PAPER_COLUMNS`` columns: the method, the settings that vary,
    tau, the speedup with its 95% CI, and (room permitting) the share of the batch-aware bound,
    the task score and token identity with AR; plus the settings every row shares."""
    varying, fixed = _fixed(full, SETTINGS)
    t = full[["method", *varying]].copy()
    t["tau"] = full["tau"]
    t["speedup (95% CI)"] = [("-" if s is None or not (s == s) else f"{s:.2f}x" + (f" ({ci})" if isinstance(ci, str) else "")
                              + (" (unpaired)" if ar == "unpaired" else "")
                              + (" (above tau: AR slowed?)" if isinstance(flag, str) else ""))
                             for s, ci, ar, flag in zip(full["speedup"], full["95% CI"],
                                                        full.get("AR", pd.Series(None, index=full.index)),
                                                        full.get("above bound", pd.Series(None, index=full.index)))]
    for col in ("% of batch bound", "score %", "match AR %"):
        if len(t.columns) < PAPER_COLUMNS and col in full and full[col].notna().any():
            t[col] = full[col]
    # rows that read the same (the AR baselines of a paired sweep, one per job) are shown once
    return t.drop_duplicates(ignore_index=True), fixed


def paper_per_category(wide: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """Per category: the speedup in each, overall, and the overall tau (Spec-Bench's layout); the
    index keeps only the settings that vary."""
    sp = wide["speedup"].copy()
    sp["tau"] = wide[("tau", "overall")]
    sp = sp.reset_index()
    varying, fixed = _fixed(sp, ("T", "K", "bs"))
    return sp[["method", *varying, *[c for c in sp.columns if c not in ("method", "T", "K", "bs")]]], fixed


def identity_table(df: pd.DataFrame) -> pd.DataFrame:
    """Greedy jobs against AR at the smallest batch size of the same model, data, dtype and
    length (from the recorded tokens): the share of outputs identical to AR's and where the
    others first diverge. The floor rows (AR itself at a larger batch, and ``reject``, AR
    through the verify path) differ from AR only by the kernels' shapes: in fp32 every row
    should read 100%; in bf16 a method whose divergence is no worse than the floor's
    diverges by rounding, not by a bug."""
    g = df[(df["temperature"] == 0) & (df.get("accept", pd.Series(None, index=df.index)) != "synthetic")]
    g = g[g["requests"].map(lambda rq: bool(rq) and "tokens" in rq[0])]
    rows = []
    # the reference AR is the same engine's, on the same kernels, compiled or not: vLLM's AR (or a
    # compiled one) is another row's floor, never ours
    for key, grp in g.groupby(["model", "dataset", "dtype", "max_new_tokens", "limit", "ctx", "backend", "kernel",
                               "compile"], dropna=False):
        ars = grp[grp["method"] == "ar"]
        if ars.empty:
            continue
        ref_row = ars.sort_values("bs").iloc[0]
        ref = {(r["id"], r["turn"], r.get("repeat", 0)): r for r in ref_row["requests"]}
        for _, r in grp.iterrows():
            if r["method"] == "ar" and r["bs"] == ref_row["bs"]:
                continue
            d = R.divergence(r["requests"], ref, mark=False)
            if not d:
                continue
            pos, n = d["positions"], d["compared"]
            floor = r["method"] in ("ar", "reject")
            rows.append({"method": r["label"] + (" (floor)" if floor else ""), "model": str(key[0]).split("/")[-1],
                         "dataset": key[1], "dtype": key[2], "bs": int(r["bs"]),
                         "K": None if r["method"] == "ar" else r["K"], "vs AR bs": int(ref_row["bs"]),
                         "compared": n, "identical %": 100.0 * (n - len(pos)) / n, "diverged": len(pos),
                         "median first divergence": float(np.median(pos)) if pos else None,
                         "earliest": min(pos) if pos else None})
    t = pd.DataFrame(rows)
    if t.empty:
        return t
    t["K"] = t["K"].astype("Int64")
    return t.sort_values(["model", "dataset", "dtype", "method", "bs"]).reset_index(drop=True)


def fmt(x, spec=".2f"):
    if x is None or x is pd.NA or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, (int, np.integer)):
        return str(x)
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def to_markdown(t: pd.DataFrame) -> str:
    if isinstance(t.columns, pd.MultiIndex):
        t = t.copy()
        t.columns = [f"{a} {b}" for a, b in t.columns]
        t = t.reset_index()
    head = "| " + " | ".join(map(str, t.columns)) + " |"
    sep = "|" + "|".join("---" for _ in t.columns) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in t.itertuples(index=False)]
    return "\n".join([head, sep, *body]) + "\n"


def to_latex(t: pd.DataFrame, caption: str, label: str) -> str:
    if isinstance(t.columns, pd.MultiIndex):
        t = t.copy()
        t.columns = [f"{a} {b}" for a, b in t.columns]
        t = t.reset_index()

    def esc(s):
        return str(s).replace("_", r"\_").replace("%", r"\%").replace("&", r"\&")

    lines = [r"\begin{table}[t]", r"\centering", r"\small", r"\begin{tabular}{" + "l" * 1 + "r" * (len(t.columns) - 1) + "}",
             r"\toprule", " & ".join(esc(c) for c in t.columns) + r" \\", r"\midrule"]
    for row in t.itertuples(index=False):
        lines.append(" & ".join(esc(fmt(v)) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", rf"\caption{{{esc(caption)}}}", rf"\label{{{label}}}", r"\end{table}"]
    return "\n".join(lines) + "\n"
