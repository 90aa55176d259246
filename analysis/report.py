"""Figures (vector PDF + PNG) and tables (Markdown + LaTeX) from records.

    python -m analysis.report results/ [--method pld leviathan] [--model ...] [--dataset ...]
                              [--sweep ID] [--out reports/NAME]

Figures: speedup vs batch size; acceptance per position; time split by phase; measured
speedup against the theoretical bounds; speedup vs K and vs context length; acceptance-
length histogram; the trace-driven simulator's policies beside the measurement.
Tables: per category (Spec-Bench style) and the sweep table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from analysis import simulate, theory  # noqa: E402
from analysis.load import _label, ar_baselines, k_label, load, load_cost_curves, setting_of, spec_len  # noqa: E402
from specbench.costs import interp  # noqa: E402
from specbench import records as R  # noqa: E402

PHASES = ["prefill", "draft", "verify", "accept", "other"]
PHASE_COLORS = {"prefill": "#9e9e9e", "draft": "#4c72b0", "verify": "#dd8452", "accept": "#55a868", "other": "#c4c4c4"}
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974"]

plt.rcParams.update({
    "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8, "xtick.labelsize": 8,
    "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
    "grid.alpha": 0.3, "figure.dpi": 150, "savefig.bbox": "tight", "pdf.fonttype": 42,
})


MARKERS = ["o", "s", "^", "D", "v", "P"]
HATCHES = ["", "////", "....", "xxxx", "\\\\", "++"]


def colors(labels) -> dict:
    return {lab: PALETTE[i % len(PALETTE)] for i, lab in enumerate(sorted(set(labels)))}


def markers(labels) -> dict:
    """Each label's marker: the palette's colours repeat past its length, the marker (and, for
    bars, the hatch: ``hatches``) changes with each round, so no two series look alike."""
    return {lab: MARKERS[(i // len(PALETTE)) % len(MARKERS)] for i, lab in enumerate(sorted(set(labels)))}


def hatches(labels) -> dict:
    return {lab: HATCHES[(i // len(PALETTE)) % len(HATCHES)] for i, lab in enumerate(sorted(set(labels)))}


def subtitle(df: pd.DataFrame) -> str:
    parts = []
    for col in ("model", "dataset", "device", "dtype"):
        vals = sorted({str(v).split("/")[-1] for v in df[col].dropna()})
        if vals:
            parts.append(", ".join(vals))
    temps = sorted(set(df["temperature"]))
    parts.append("greedy" if temps == [0.0] else "T=" + ",".join(f"{t:g}" for t in temps))
    return " · ".join(parts)


def save(fig, out: Path, name: str, written: list) -> None:
    for ext in ("pdf", "png"):
        p = out / f"{name}.{ext}"
        fig.savefig(p)
        written.append(p)
    plt.close(fig)


def _sd(df):
    sd = df[df["method"] != "ar"].copy()
    if sd.empty:
        return sd
    multi_ds = sd["dataset"].nunique() > 1
    multi_t = sd["temperature"].nunique() > 1
    multi_dt = sd["dtype"].nunique() > 1  # never average an fp32 and a bf16 job into one point
    multi_n = sd["max_new_tokens"].nunique() > 1
    sd["series"] = sd.apply(lambda r: r["label"] + (f", {r['dataset']}" if multi_ds else "")
                            + (f", T={r['temperature']:g}" if multi_t else "")
                            + (f", {r['dtype']}" if multi_dt else "")
                            + (f", {int(r['max_new_tokens'])} tok" if multi_n else ""), axis=1)
    return sd


# ---------------------------------------------------------------------------- figures
def fig_speedup_vs(df, out, written, xcol, xlabel, name, log2=False):
    sd = _sd(df).dropna(subset=["speedup"])
    sd = sd[sd[xcol].notna()]
    sd = sd[sd.groupby("series")[xcol].transform("nunique") >= 2]  # a series with one point is no curve
    if sd.empty:
        return
    cmap, mk = colors(sd["series"]), markers(sd["series"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for lab, g in sd.groupby("series"):
        g = g.groupby(xcol, as_index=False)[["speedup", "speedup_lo", "speedup_hi"]].mean().sort_values(xcol)
        ax.plot(g[xcol], g["speedup"], marker=mk[lab], ms=4, lw=1.5, color=cmap[lab], label=lab)
        ci = g.dropna(subset=["speedup_lo", "speedup_hi"])
        if not ci.empty:  # 95% bootstrap interval over batches
            # a percentile interval of a ratio of ratios can miss its own point estimate (two batches
            # resampled): the bar then starts at the point
            ax.errorbar(ci[xcol], ci["speedup"], yerr=[(ci["speedup"] - ci["speedup_lo"]).clip(lower=0),
                                                       (ci["speedup_hi"] - ci["speedup"]).clip(lower=0)],
                        fmt="none", ecolor=cmap[lab], elinewidth=0.9, capsize=2.5)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="AR (1.0x)")
    if log2:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sd[xcol].unique()))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over AR (tokens/s ratio)")
    ax.set_title(f"Speedup vs {xlabel.split(' (')[0]} (bars: 95% bootstrap CI)\n{subtitle(df)}")
    if sd["series"].nunique() > 5:
        ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    else:
        ax.legend(frameon=False, fontsize=7, loc="best")
    save(fig, out, name, written)


def fig_quality(df, out, written):
    """Speedup against task score lost (method's score - AR's on the same prompts), one
    panel per scored data set: where a lossy rule buys its speed."""
    sd = _sd(df).dropna(subset=["speedup", "quality", "quality_ar"])
    if sd.empty:
        return
    sets = sorted(sd["dataset"].unique())
    fig, axes = plt.subplots(1, len(sets), figsize=(4.8 * len(sets), 3.6), squeeze=False)
    fig.subplots_adjust(wspace=0.35)
    cmap = colors(sd["label"])
    for ax, ds in zip(axes[0], sets):
        g = sd[sd["dataset"] == ds]
        for lab, h in g.groupby("label"):
            lossy = not bool(h["lossless"].iloc[0])
            ax.scatter(h["speedup"], 100 * (h["quality"] - h["quality_ar"]), color=cmap[lab], label=lab,
                       marker="x" if lossy else "o", s=28)
        ax.axhline(0.0, color="k", lw=0.8, ls="--")
        ax.axvline(1.0, color="k", lw=0.8, ls=":")
        ax.set_xlabel("speedup over AR")
        ax.set_ylabel(f"{g['quality_metric'].iloc[0]} - AR's (points)")
        ax.set_title(f"{ds}: speed vs quality (x = lossy rule)")
        ax.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    save(fig, out, "speedup_vs_quality", written)


def fig_acceptance(df, out, written):
    sd = _sd(df)
    sd = sd[sd["alphas"].map(len) > 0]
    if sd.empty:
        return
    # one line per (label, K): the largest batch size only would hide nothing for greedy
    # the largest K of each series shows every position; smaller K repeat its prefix
    cmap, mk = colors(sd["series"]), markers(sd["series"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    seen = set()
    for lab, g in sd.groupby("series"):
        r = g.sort_values("K").iloc[-1]
        a = r["alphas"]
        ax.plot(range(1, len(a) + 1), a, marker=mk[lab], ms=3.5, lw=1.3, color=cmap[lab], label=f"{lab}{k_label(r, ', ')}")
        seen.add(lab)
    ax.set_xlabel("draft position i")
    ax.set_ylabel(r"acceptance rate $\alpha_i$ (share of steps)")
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(f"Acceptance per position\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7, ncol=1 if len(seen) < 5 else 2)
    save(fig, out, "acceptance_per_position", written)


def fig_time_split(df, out, written):
    rows = df.dropna(subset=["wall_s"]).copy()
    if rows.empty:
        return
    rows["name"] = rows.apply(lambda r: r["label"] + k_label(r)
                              + f" bs={int(r['bs'])}", axis=1)
    rows = rows.drop_duplicates("name", keep="last").sort_values(["bs", "method", "K"], na_position="first")
    if len(rows) > 14:
        rows = rows[rows["bs"] == rows["bs"].min()]
    fig, ax = plt.subplots(figsize=(5.2, 0.42 * len(rows) + 1.2))
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for ph in PHASES:
        share = (rows[f"t_{ph}"].fillna(0) / rows["wall_s"]).to_numpy()
        ax.barh(y, share, left=left, color=PHASE_COLORS[ph], label=ph, height=0.65)
        left += share
    for i, (_, r) in enumerate(rows.iterrows()):
        ax.text(1.01, i, f"verify {r['verify_share']:.0%}", va="center", fontsize=7.5)
    ax.set_yticks(y, rows["name"])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("share of generation time")
    ax.grid(axis="y", visible=False)
    ax.set_title(f"Where the time goes\n{subtitle(df)}")
    ax.legend(frameon=False, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(rows)))
    save(fig, out, "time_split", written)


def curves_for(curves, model, device, dtype, kernel=None, isa=None, compiled=False) -> list[dict]:
    """The profiled cost curves of this model, device, dtype and linear-layer kernel path
    (curves and records from before kernels existed ran torch's), of the same vector
    instructions where both say which (native tiles are AVX2 or AVX-512 by CPU), and compiled
    (``analysis.profile --compile``) exactly when the job was."""
    return [c for c in curves if str(c.get("model")) == str(model) and c.get("device") == device
            and c.get("dtype") == dtype and (c.get("kernel") or "torch") == (kernel or "torch")
            and (isa is None or c.get("kernel_isa") is None or c.get("kernel_isa") == isa)
            and bool(c.get("compile", False)) == bool(compiled)]


def same_shape(cand: list[dict], r) -> list[dict]:
    """Of a job's curves, those profiled in the shape its verifies have (``analysis.profile
    --ragged --tree``): ragged rows at bs > 1, a tree's mask where its drafts are wider than deep;
    else the plain (dense chain) ones; else all."""
    want = (int(r["bs"]) > 1, (r.get("forward_nodes") or 0) > (spec_len(r) or 0) + 1e-9)
    match = [c for c in cand if (bool(c.get("ragged")), bool(c.get("tree"))) == want]
    return match or [c for c in cand if not c.get("ragged") and not c.get("tree")] or cand


def nearest_state(cand: list[dict], bs: int, base) -> dict:
    """Of several profiled curves, the one taken in the host state nearest the job's: its
    T(bs, 1) closest, as a ratio, to the AR record's own decode step (its verify time per
    iteration). A shared host's memory bandwidth drifts by 2x within an hour, and a starved
    host inflates T(1) (a weight stream) more than T(32) (FMA-bound): a curve from another
    state misprices the wide verifies. Without an in-run step, the newest curve."""
    step = _ar_step(base)
    if not step > 0 or len(cand) == 1:
        return cand[-1]
    return min(reversed(cand), key=lambda c: abs(math.log(interp(c["target"], bs, 1) / step)))


def _ar_step(base) -> float:
    """The AR record's own decode step (its verify time per iteration), NaN without one."""
    try:
        return float(base["t_verify"]) / float(base["iterations"])
    except (TypeError, KeyError, ValueError, ZeroDivisionError):
        return math.nan


# a bound read from a curve whose T(bs, 1) is further than this from the job's own AR step
# (as a ratio either way) was priced in another host state: the report says so
STATE_GAP = 1.15


def batch_of(r) -> int:
    """The batch a job's steps ran at: ``bs``, or for a serving job (``batching=continuous``) its
    measured time-weighted rows in flight (requests that have not yet arrived leave rows empty)."""
    m = r.get("in_flight_mean")
    if r.get("batching") == "continuous" and m is not None and m == m:
        return max(1, int(round(m)))
    return int(r["bs"])


def _priced(df, curves):
    """Per job: (its row, the curve its batch-aware bound reads, the AR record it is read
    against), the curve and record None where no bound applies (AR itself, no curve for its
    model/device/dtype/kernel, no AR record)."""
    ar_of = ar_baselines(df)
    for _, r in df.iterrows():
        isa = r.get("kernel_isa")
        cand = curves_for(curves, r["model"], r["device"], r["dtype"], r.get("kernel"), None if pd.isna(isa) else isa,
                          bool(r.get("compile", False)))
        base = ar_of(r)
        ours = r.get("backend", "specbench") == "specbench"  # our cost curves price our engine's steps only
        if ours and r["method"] != "ar" and cand and r.get("iterations") and base is not None:
            yield r, nearest_state(same_shape(cand, r), batch_of(r), base), base
        else:
            yield r, None, None


def curve_state_gap(df, curves) -> pd.Series:
    """Per job with a batch-aware bound: the chosen curve's T(bs, 1) over the paired AR record's
    own decode step (1.0: the curve was taken in the job's host state); NaN where the job has
    no bound or its AR record no step."""
    vals = []
    for r, c, base in _priced(df, curves):
        step = _ar_step(base) if c is not None else math.nan
        vals.append(interp(c["target"], batch_of(r), 1) / step if step > 0 else math.nan)
    return pd.Series(vals, index=df.index)


def batch_aware(df, curves) -> pd.Series:
    """The batch-aware bound of each job over the whole job (theory.batch_aware_job): the
    decode steps at the cost curve's T for its model/device/dtype/kernel (nearest batch size,
    interpolated in width; of several curves, the one nearest the job's host state,
    `nearest_state`), the prefill as each side measured it (the method's and the AR record
    it is read against); NaN without a curve or an AR record."""
    vals = []
    for r, c, base in _priced(df, curves):
        s = math.nan
        if c is not None:
            T = c["target"]
            B = batch_of(r)
            t_ar = interp(T, B, 1)
            nodes = r.get("forward_nodes")  # a tree verifies its nodes (and Lookahead's window), a chain K
            if nodes is None or nodes != nodes or nodes <= 0:
                nodes = r.get("draft_nodes")  # records written before forward_nodes
            width = nodes + 1 if nodes is not None and nodes == nodes and nodes > 0 else (spec_len(r) or 0) + 1
            t_ver = interp(T, B, width)
            t_draft = r["t_draft"] / r["iterations"]
            first, first_ar = len(r["requests"]), len(base["requests"])  # the prefill gives each turn its first token
            s = theory.batch_aware_job(r["tau"], t_ar, t_draft, t_ver, B,
                                       r["new_tokens"], r["new_tokens"] - first, r.get("t_prefill") or 0.0,
                                       base["new_tokens"], base["new_tokens"] - first_ar,
                                       base.get("t_prefill") or 0.0)
        vals.append(s)
    return pd.Series(vals, index=df.index)


def fig_serving(df, out, written):
    """The serving plot: output tokens/s against median TPOT, one line per method (and batching
    mode), points at each concurrency (labelled); up and left is better."""
    d = df.dropna(subset=["tpot_p50", "tokens_per_s"])
    d = d[d.groupby("label")["bs"].transform("nunique") >= 2]
    if d.empty:
        return
    cmap, mk = colors(d["label"]), markers(d["label"])
    fig, ax = plt.subplots(figsize=(4.8, 3.4))
    for lab, g in d.groupby("label"):
        g = g.groupby("bs", as_index=False)[["tpot_p50", "tokens_per_s"]].mean().sort_values("bs")
        ls = "--" if "[continuous" in lab else "-"
        ax.plot(g["tpot_p50"] * 1e3, g["tokens_per_s"], marker=mk[lab], ms=4, lw=1.4, ls=ls, color=cmap[lab], label=lab)
        for _, p in g.iterrows():
            ax.annotate(f"{int(p['bs'])}", (p["tpot_p50"] * 1e3, p["tokens_per_s"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("TPOT p50 (ms per output token)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Throughput against latency (points: concurrency; dashed: continuous)\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, out, "throughput_vs_tpot", written)


def fig_speedup_vs_concurrency(df, out, written):
    """Speedup of each serving job against its concurrency, with the batch-aware bound read at the
    batch its steps really ran at (the measured rows in flight)."""
    d = _sd(df[df["batching"] == "continuous"]).dropna(subset=["speedup"]) if "batching" in df else pd.DataFrame()
    d = d[d.groupby("series")["bs"].transform("nunique") >= 2] if not d.empty else d
    if d.empty:
        return
    cmap, mk = colors(d["series"]), markers(d["series"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for lab, g in d.groupby("series"):
        g = g.groupby("bs", as_index=False)[["speedup", "bound_batch"]].mean().sort_values("bs")
        ax.plot(g["bs"], g["speedup"], marker=mk[lab], ms=4, lw=1.5, color=cmap[lab], label=lab)
        if g["bound_batch"].notna().any():
            ax.plot(g["bs"], g["bound_batch"], ls=":", lw=1.2, color=cmap[lab])
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(d["bs"].unique()))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests in flight, log2)")
    ax.set_ylabel("speedup over AR at the same load")
    ax.set_title(f"Serving speedup (dotted: batch-aware bound at the measured rows in flight)\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7, loc="best")
    save(fig, out, "speedup_vs_concurrency", written)


def tuned_table(df) -> pd.DataFrame:
    """K=auto against fixed settings: per tuned series and batch size, the tuned job's speedup and
    chosen setting beside the best fixed setting measured (same series otherwise) and their ratio."""
    sd = _sd(df).dropna(subset=["speedup"])
    if sd.empty or not sd["K_auto"].any():
        return pd.DataFrame()
    rows = []
    for (series, bs), a in sd[sd["K_auto"]].groupby(["series", "bs"]):
        keys = list(a.iloc[-1]["tuned_chosen"] or {})
        fixed = sd[(~sd["K_auto"]) & (sd["series"] == series.replace(" (K=auto)", "", 1)) & (sd["bs"] == bs)]
        best = fixed.loc[fixed["speedup"].idxmax()] if not fixed.empty else None
        t = a["speedup"].mean()
        rows.append({"method": series, "bs": int(bs), "chosen": setting_of(a.iloc[-1], keys),
                     "tuned speedup": t, "best fixed": setting_of(best, keys) if best is not None else "-",
                     "best fixed speedup": best["speedup"] if best is not None else math.nan,
                     "fixed settings": len(fixed.groupby(fixed.apply(lambda r: setting_of(r, keys), axis=1))),
                     "tuned / best": t / best["speedup"] if best is not None else math.nan})
    return pd.DataFrame(rows)


def fig_tuned(df, out, written):
    """K=auto against fixed settings: per tuned method, speedup against batch size for every fixed
    setting measured (thin) and for K=auto (bold, its choice written at each point)."""
    sd = _sd(df).dropna(subset=["speedup"])
    if sd.empty or not sd["K_auto"].any():
        return
    tuned = sorted(sd[sd["K_auto"]]["series"].unique())
    fig, axes = plt.subplots(1, len(tuned), figsize=(4.4 * len(tuned), 3.3), squeeze=False)
    for ax, series in zip(axes[0], tuned):
        a = sd[sd["series"] == series]
        keys = list(a.iloc[-1]["tuned_chosen"] or {})
        fixed = sd[(~sd["K_auto"]) & (sd["series"] == series.replace(" (K=auto)", "", 1))].copy()
        fixed["setting"] = fixed.apply(lambda r: setting_of(r, keys), axis=1)
        shades = plt.cm.viridis(np.linspace(0.1, 0.85, max(1, fixed["setting"].nunique())))
        for shade, (st, g) in zip(shades, fixed.groupby("setting")):
            g = g.groupby("bs", as_index=False)["speedup"].mean().sort_values("bs")
            ax.plot(g["bs"], g["speedup"], marker=".", lw=1.0, color=shade, label=st)
        g = a.groupby("bs", as_index=False).agg(speedup=("speedup", "mean")).sort_values("bs")
        ax.plot(g["bs"], g["speedup"], marker="o", ms=5, lw=2.2, color="#222222", label="K=auto")
        for _, r in a.drop_duplicates("bs", keep="last").iterrows():
            ax.annotate(setting_of(r, keys), (r["bs"], r["speedup"]), fontsize=6, xytext=(3, 4),
                        textcoords="offset points")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        if sd["bs"].nunique() > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(a["bs"].unique()))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch size / concurrency (log2)")
        ax.set_ylabel("speedup over AR")
        ax.set_title(series.replace(" (K=auto)", ""), fontsize=9)
        ax.legend(frameon=False, fontsize=6, loc="best")
    fig.suptitle(f"K=auto (bold) against each fixed setting\n{subtitle(df)}", fontsize=9)
    save(fig, out, "tuned_vs_fixed", written)


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


def fig_engines(df, out, written):
    """Speedup over each engine's own AR, our engine beside vLLM, per method and batch size."""
    t = engines_table(df)
    if t.empty:
        return
    other = [c[:-len(" speedup")] for c in t.columns if c.endswith(" speedup") and not c.startswith("specbench")][0]
    t = t.assign(name=t["method"] + ", bs=" + t["bs"].astype(str) + ", " + t["dataset"])
    fig, axes = plt.subplots(1, 2, figsize=(max(5.5, 1.1 * len(t) + 2.5), 3.3))
    x = np.arange(len(t))
    for ax, col, ylab in ((axes[0], "speedup", "speedup over its own AR"), (axes[1], "tau", "tau (every step)")):
        ax.bar(x - 0.2, t[f"specbench {col}"], 0.4, label="specbench", color="#4477aa")
        ax.bar(x + 0.2, t[f"{other} {col}"], 0.4, label=other, color="#ee6677")
        ax.set_xticks(x)
        ax.set_xticklabels(t["name"], rotation=30, ha="right", fontsize=6)
        ax.set_ylabel(ylab)
        if col == "speedup":
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.legend(frameon=False, fontsize=7)
    fig.suptitle(f"The same jobs on two engines\n{subtitle(df)}", fontsize=9)
    save(fig, out, "engines", written)


BARS_PER_PANEL = 10  # a bound figure holds every job: past this many bars, one more panel below


def fig_bounds(df, out, written):
    sd = _sd(df).dropna(subset=["speedup"]).copy()
    if sd.empty:
        return
    one = sd["label"].nunique() == 1  # a single method: name it once, in the title

    def short(r):
        lab = r["series"][len(r["label"]):].lstrip(", ") if one else r["series"]
        lab = lab.replace(" (", "\n(").replace(", ", "\n")
        return (lab + "\n" if lab else "") + f"{k_label(r, '')} bs={int(r['bs'])}".lstrip()

    sd["name"] = sd.apply(short, axis=1)
    sd = sd.drop_duplicates("name", keep="last")
    series = [("measured", "speedup", "#222222"), ("Leviathan closed form", "bound_leviathan", "#4c72b0"),
              ("per-position form", "bound_per_position", "#55a868"), ("batch-aware (cost curve)", "bound_batch", "#dd8452")]
    series = [s for s in series if sd[s[1]].notna().any()]
    panels = [sd.iloc[i:i + BARS_PER_PANEL] for i in range(0, len(sd), BARS_PER_PANEL)]
    width = min(len(sd), BARS_PER_PANEL)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(4.6, 1.35 * width + 1.5), 3.4 * len(panels)), squeeze=False)
    ymax = np.nanmax(sd[[s[1] for s in series]].to_numpy(dtype=float))
    for ax, part in zip(axes[:, 0], panels):
        x = np.arange(len(part))
        w = 0.8 / len(series)
        for i, (lab, col, colr) in enumerate(series):
            ax.bar(x + (i - (len(series) - 1) / 2) * w, part[col].fillna(0), width=w, color=colr, label=lab,
                   edgecolor="white", lw=0.5)
        for j, (_, r) in enumerate(part.iterrows()):
            if isinstance(r.get("above_bound"), str):  # not a result: its AR baseline ran slow
                ax.text(x[j], r["speedup"] * 1.02, "above tau:\nAR slowed?", ha="center", va="bottom", fontsize=6.5,
                        color="#c44e52", fontweight="bold")
                continue
            # the gap: measured as a share of the Leviathan closed form
            b = r.get("bound_leviathan")
            if b is not None and np.isfinite(b) and b > 0:
                top = np.nanmax([r["speedup"], b, r.get("bound_per_position", np.nan), r.get("bound_batch", np.nan)])
                ax.text(x[j], top + 0.03 * max(1.0, top), f"{r['speedup'] / b:.0%}", ha="center", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(x, part["name"], fontsize=7)
        ax.set_ylabel("speedup over AR")
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, max(1.3, ymax * 1.25))
    what = f"{sd['label'].iloc[0]}: measured" if one else "Measured"
    axes[0, 0].set_title(f"{what} speedup against the theoretical bounds (% = measured / closed form)\n{subtitle(df)}")
    axes[0, 0].legend(frameon=False, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, out, "speedup_vs_bound", written)


def fig_hist(df, out, written):
    sd = _sd(df)
    sd = sd[sd["hist"].map(lambda h: sum(h) > 0)]
    if sd.empty:
        return
    sd = sd.sort_values("K").drop_duplicates("series", keep="last")
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    cmap, hat = colors(sd["series"]), hatches(sd["series"])
    n = len(sd)
    w = 0.8 / n
    for i, (_, r) in enumerate(sd.iterrows()):
        h = np.array(r["hist"], dtype=float)
        h = h / h.sum()
        xs = np.arange(len(h)) + 1 + (i - (n - 1) / 2) * w
        ax.bar(xs, h, width=w, color=cmap[r["series"]], hatch=hat[r["series"]], edgecolor="white", lw=0.3, label=f"{r['series']}{k_label(r, ', ')} (tau {r['tau']:.2f})")
    ax.set_xlabel("tokens emitted per step (accepted drafts + 1)")
    ax.set_ylabel("share of steps")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(f"Acceptance-length histogram\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, out, "accept_length_hist", written)


def simulated(df, curves) -> pd.DataFrame:
    """Fixed-K and oracle-K replays of each job's acceptance trace on the cost curve (one curve
    per group, so the combined oracle compares its jobs alike: the one nearest the host state
    of the group's first AR record, `nearest_state`)."""
    rows = []
    sd = _sd(df)
    ar_of = ar_baselines(df)
    for (model, bs, dev, dt, kern, ds, temp), g in sd.groupby(["model", "bs", "device", "dtype", "kernel", "dataset",
                                                              "temperature"]):
        cand = curves_for(curves, model, dev, dt, kern)
        cand = [c for c in cand if not c.get("ragged") and not c.get("tree")] or cand  # the group's plain curve
        if not cand:
            continue
        base = next((b for b in (ar_of(r) for _, r in g.iterrows()) if b is not None), None)
        curve = (cand[-1] if base is None else nearest_state(cand, int(bs), base))["target"]

        def T(n, _b=int(bs)):
            return interp(curve, _b, n)

        jobs = {}
        for _, r in g.iterrows():
            K = spec_len(r)
            if not r.get("iterations") or not K:
                continue
            d = r["t_draft"] / r["iterations"] / K
            sim = simulate.simulate_job(r["requests"], K, d, T)
            name = f"{r['label']} K={K}" + (f" T={r['temperature']:g}" if r["temperature"] else "")
            rows.append({"name": name, "bs": bs, "dataset": ds, "measured": r["speedup"], **sim})
            if r["temperature"] == 0:
                jobs[name] = (r["requests"], d)
        if len(jobs) > 1:
            rows.append({"name": "combined oracle", "bs": bs, "dataset": ds, "measured": math.nan,
                         "fixed_k": math.nan, "oracle_k": simulate.simulate_combined(jobs, lambda n, _b=int(bs): interp(curve, _b, n))})
    return pd.DataFrame(rows)


def fig_simulator(sim: pd.DataFrame, df, out, written):
    if sim.empty:
        return
    sim = sim[(sim["bs"] == sim["bs"].min()) & (sim["dataset"] == sim["dataset"].iloc[0])].drop_duplicates("name",
                                                                                                          keep="last")
    fig, ax = plt.subplots(figsize=(max(4.2, 0.9 * len(sim) + 1.5), 3.0))
    x = np.arange(len(sim))
    w = 0.27
    ax.bar(x - w, sim["measured"].fillna(0), w, color="#222222", label="measured")
    ax.bar(x, sim["fixed_k"].fillna(0), w, color="#4c72b0", label="simulated fixed K")
    ax.bar(x + w, sim["oracle_k"].fillna(0), w, color="#dd8452", label="oracle K (upper bound)")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, sim["name"], rotation=15, ha="right")
    ax.set_ylabel("speedup over AR")
    ax.grid(axis="x", visible=False)
    ax.set_title(f"Trace-driven simulation, bs={int(sim['bs'].iloc[0])}, {sim['dataset'].iloc[0]}\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, out, "simulator", written)


# ---------------------------------------------------------------------------- tables
def per_category(df: pd.DataFrame) -> pd.DataFrame:
    """Spec-Bench style: speedup and tau per category (and overall) for each method, at each
    batch size; speedup from per-request tokens and wall time against the AR job."""
    rows = []
    ar_of = ar_baselines(df)
    multi_ds = df["dataset"].nunique() > 1  # each data set's categories (and overall) on rows of their own
    for _, r in _sd(df).iterrows():
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
            rows.append({"method": r["label"] + (f" ({r['dataset']})" if multi_ds else ""), "T": float(r["temperature"]),
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
    cats = [c for c in sorted(t["category"].unique()) if c != "overall"] + ["overall"]
    wide = wide.reindex(columns=pd.MultiIndex.from_product([["speedup", "tau"], cats]))
    return wide


def sweep_table(df: pd.DataFrame) -> pd.DataFrame:
    df = df.assign(speedup_ci=[f"{lo:.2f}-{hi:.2f}" if lo == lo and hi == hi else None
                               for lo, hi in zip(df["speedup_lo"], df["speedup_hi"])])
    for col in ("bound_batch", "of_bound", "curve_gap"):
        if col not in df:
            df[col] = float("nan")
    cols = ["label", "model", "dataset", "dtype", "kernel", "temperature", "bs", "K", "ctx", "tokens_per_s", "speedup",
            "speedup_ci", "tau",
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
                          "speedup_ci": "95% CI",
                          "verify_share": "verify %", "match_ar": "match AR %", "peak_mem_bytes": "peak MiB"})
    return t.sort_values(["model", "dataset", "dtype", "T", "bs", "method", "K"],
                         na_position="first").reset_index(drop=True)


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
    t["speedup (95% CI)"] = [("-" if not (s == s) else f"{s:.2f}x" + (f" ({ci})" if isinstance(ci, str) else "")
                              + (" (above tau: AR slowed?)" if isinstance(flag, str) else ""))
                             for s, ci, flag in zip(full["speedup"], full["95% CI"],
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


# ---------------------------------------------------------------------------- main
def build(records, out: Path, **filters) -> list[Path]:
    df = load(records, **filters)
    if df.empty:
        raise SystemExit(f"no ok records in {records} (after filters {filters})")
    out.mkdir(parents=True, exist_ok=True)
    curves = load_cost_curves(records)
    written: list[Path] = []
    fig_speedup_vs(df, out, written, "bs", "batch size (log2)", "speedup_vs_batch", log2=True)
    fig_speedup_vs(df, out, written, "K", "speculation length K", "speedup_vs_k")
    fig_speedup_vs(df, out, written, "ctx", "context length (tokens)", "speedup_vs_ctx", log2=True)
    fig_acceptance(df, out, written)
    fig_time_split(df, out, written)
    df["bound_batch"] = batch_aware(df, curves)  # from the profiled cost curve (NaN without one)
    df["of_bound"] = df["speedup"] / df["bound_batch"]
    df["curve_gap"] = curve_state_gap(df, curves)
    off = df[(df["curve_gap"] > STATE_GAP) | (df["curve_gap"] < 1 / STATE_GAP)]
    for _, r in off.iterrows():
        print(f"[report] {r['label']} (bs={r['bs']}): its batch bound reads a cost curve {r['curve_gap']:.2f}x its "
              f"paired AR's own step (another host state); profile the curve again beside the job "
              f"(make bench-cpu does, after its jobs)", file=sys.stderr)
    for _, r in df[df["above_bound"].map(lambda x: isinstance(x, str))].iterrows():
        print(f"[report] {r['label']} (bs={r['bs']}{k_label(r)}): {r['above_bound']}", file=sys.stderr)
    fig_bounds(df, out, written)
    fig_serving(df, out, written)
    fig_speedup_vs_concurrency(df, out, written)
    fig_tuned(df, out, written)
    fig_engines(df, out, written)
    fig_hist(df, out, written)
    fig_quality(df, out, written)
    sim = simulated(df, curves)
    fig_simulator(sim, df, out, written)
    full = sweep_table(df)
    full.to_csv(out / "sweep.csv", index=False)  # every column; the Markdown/LaTeX table is the paper's
    sweep, fixed = paper_sweep(full)
    tables = {"sweep": (sweep, "Speedup over AR (95% CI over batches) and mean accepted length tau"
                        + (f"; {fixed}" if fixed else ""))}
    cat = per_category(df)
    if not cat.empty:
        flat = cat.copy()
        flat.columns = [f"{a} {b}" for a, b in flat.columns]
        flat.reset_index().to_csv(out / "per_category.csv", index=False)
        compact, fixed_c = paper_per_category(cat)
        tables["per_category"] = (compact, "Speedup over AR per category, overall, and overall tau"
                                  + (f"; {fixed_c}" if fixed_c else ""))
    written += [out / "sweep.csv"] + ([out / "per_category.csv"] if not cat.empty else [])
    ident = identity_table(df)
    if not ident.empty:
        tables["identity"] = (ident, "Greedy outputs identical to AR's, and the first divergence (floor: AR at "
                                     "another batch size, AR through the verify path)")
    tuned = tuned_table(df)
    if not tuned.empty:
        tables["tuned"] = (tuned, "K=auto against the best fixed setting measured at each batch size")
    engines = engines_table(df)
    if not engines.empty:
        tables["engines"] = (engines, "The same jobs on our engine and vLLM: speedup over each engine's own AR, "
                                      "tau over every decoding step (and vLLM's, over drafted steps only)")
    if not sim.empty:
        tables["simulator"] = (sim, "Trace-driven simulation: measured, fixed-K and oracle-K speedups")
    for name, (t, cap) in tables.items():
        if t.empty:
            continue
        (out / f"{name}.md").write_text(f"{cap}\n\n" + to_markdown(t))
        (out / f"{name}.tex").write_text(to_latex(t, cap, f"tab:{name}"))
        written += [out / f"{name}.md", out / f"{name}.tex"]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="?", default="results", help="a records file or a folder of them")
    ap.add_argument("--method", nargs="*")
    ap.add_argument("--model", nargs="*")
    ap.add_argument("--dataset", nargs="*")
    ap.add_argument("--sweep", nargs="*")
    ap.add_argument("--out", default=None, help="report folder (default results/reports/<time>)")
    a = ap.parse_args(argv)
    out = Path(a.out) if a.out else Path("results") / "reports" / time.strftime("%Y-%m-%d_%H-%M-%S")
    filters = {"method": a.method, "model": a.model, "dataset": a.dataset, "sweep": a.sweep}
    if a.method and "ar" not in a.method:
        filters["method"] = list(a.method) + ["ar"]  # speedups and bounds need the AR jobs
    written = build(a.records, out, **filters)
    print(f"report: {len(written)} files in {out}")
    for p in written:
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
