"""The report's figures (vector PDF + PNG): speedup against batch size, K, context length and
concurrency; acceptance per position; time by phase; the measured speedup beside its bounds;
acceptance-length histograms; serving latency; K=auto; the two engines; the simulator's policies.
Every per-method figure shows every row (more panels when many) with distinct colour and marker."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from specbench.analysis.load import ctx_suffix, k_label, method_rows, setting_of, untuned  # noqa: E402
from specbench.analysis.tables import engines_table  # noqa: E402

# The look of every figure. Legends and labels sit outside the axes, so a saved figure is cut to
# its drawn extent (``bbox_inches="tight"``); a paper wants 200-dpi PNGs and PDFs whose fonts are
# embedded TrueType (type 42), not type 3. `save` applies the three output settings itself.
STYLE = {
    "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8, "xtick.labelsize": 8,
    "ytick.labelsize": 8, "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
    "grid.alpha": 0.3, "figure.dpi": 100,
}
SAVE = {"savefig.dpi": 200, "savefig.bbox": "tight", "savefig.pad_inches": 0.05, "pdf.fonttype": 42, "ps.fonttype": 42}
plt.rcParams.update(STYLE)
AR_LINE = "AR (1.0x)"  # the label of the speedup-1 line

PHASES = ["prefill", "draft", "verify", "accept", "other"]
PHASE_COLORS = {"prefill": "#9e9e9e", "draft": "#4c72b0", "verify": "#dd8452", "accept": "#55a868", "other": "#c4c4c4"}
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974"]
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


def caption(fig, text: str) -> None:
    """Lines under the figure: what it leaves out and why (saved with it: the cut is tight), wrapped
    to the figure's width (about 19 characters an inch at 7 points) so they never widen it."""
    text = textwrap.fill(text, width=max(40, int(fig.get_figwidth() * 19)), break_long_words=False,
                         break_on_hyphens=False)
    fig.text(0.01, 0.0, text, ha="left", va="top", fontsize=7, style="italic", color="#444444", wrap=False)


def save(fig, out: Path, name: str, written: list) -> None:
    with plt.rc_context(SAVE):
        for ext in ("pdf", "png"):
            p = out / f"{name}.{ext}"
            fig.savefig(p)
            written.append(p)
    plt.close(fig)


# ---------------------------------------------------------------------------- figures
def fig_speedup_vs(df, out, written, xcol, xlabel, name, log2=False, ycol="speedup"):
    """``ycol`` (the speedup over AR, or ``tau``) against a setting ``xcol``, a line per series."""
    sd = method_rows(df).dropna(subset=[ycol])
    sd = sd[sd[xcol].notna()].copy()
    for c in ("bs", "K", "ctx"):  # a series that varies in another setting too: one line per value, never a mean
        many = (sd.groupby("series")[c].transform("nunique") > 1) & ~(sd["K_auto"] & (c == "K"))  # K=auto: one policy
        if c != xcol and many.any():
            sd.loc[many, "series"] = sd.loc[many].apply(
                lambda r: r["series"] + (k_label(r, ", ") if c == "K" else f", {c}={int(r[c])}" if r[c] == r[c] else ""),
                axis=1)
    sd = sd[sd.groupby("series")[xcol].transform("nunique") >= 2]  # a series with one point is no curve
    if sd.empty:
        return
    cmap, mk = colors(sd["series"]), markers(sd["series"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    drew_ci = False
    for lab, g in sd.groupby("series"):
        g = g.groupby(xcol, as_index=False)[["speedup", "speedup_lo", "speedup_hi", "tau"]].mean().sort_values(xcol)
        ax.plot(g[xcol], g[ycol], marker=mk[lab], ms=4, lw=1.5, color=cmap[lab], label=lab)
        ci = g.dropna(subset=["speedup_lo", "speedup_hi"]) if ycol == "speedup" else g.iloc[:0]
        if not ci.empty:  # 95% bootstrap interval over batches
            drew_ci = True
            # a percentile interval of a ratio of ratios can miss its own point estimate (two batches
            # resampled): the bar then starts at the point
            ax.errorbar(ci[xcol], ci["speedup"], yerr=[(ci["speedup"] - ci["speedup_lo"]).clip(lower=0),
                                                       (ci["speedup_hi"] - ci["speedup"]).clip(lower=0)],
                        fmt="none", ecolor=cmap[lab], elinewidth=0.9, capsize=2.5)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE if ycol == "speedup" else "AR (tau 1)")
    if log2:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sd[xcol].unique()))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    else:  # K and the like are whole numbers
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup over AR (tokens/s ratio)" if ycol == "speedup" else "mean accepted length tau (tokens/step)")
    ax.set_title(("Speedup" if ycol == "speedup" else "Acceptance (tau)") + f" vs {xlabel.split(' (')[0]}"
                 + (" (bars: 95% bootstrap CI)" if drew_ci else "")
                 + f"\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside: never over a line
    save(fig, out, name, written)


def fig_quality(df, out, written):
    """Speedup against task score lost (method's score - AR's on the same prompts), one
    panel per scored data set: where a lossy rule buys its speed."""
    sd = method_rows(df).dropna(subset=["speedup", "quality", "quality_ar"])
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
    sd = method_rows(df)
    sd = sd[sd["alphas"].map(len) > 0]
    if sd.empty:
        return
    # one line per job name (a series, and its input length where the jobs differ in it): the
    # largest K of each shows every position; smaller K repeat its prefix
    cmap, mk = colors(sd["job"]), markers(sd["job"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    seen = set()
    for lab, g in sd.groupby("job"):
        r = g.sort_values("K").iloc[-1]
        a = r["alphas"]
        ax.plot(range(1, len(a) + 1), a, marker=mk[lab], ms=3.5, lw=1.3, color=cmap[lab], label=f"{lab}{k_label(r, ', ')}")
        seen.add(lab)
    ax.set_xlabel("draft position i")
    ax.set_ylabel(r"acceptance rate $\alpha_i$ (share of steps)")
    ax.set_ylim(0, 1.02)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title(f"Acceptance per position\n{subtitle(df)}")
    if len(seen) > 5:  # many lines: the legend beside the axes, never over them
        ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), ncol=1 if len(seen) <= 16 else 2)
    else:
        ax.legend(frameon=False, fontsize=7)
    save(fig, out, "acceptance_per_position", written)


def fig_time_split(df, out, written):
    rows = df.dropna(subset=["wall_s"]).copy()
    if rows.empty:
        return
    rows["name"] = rows.apply(lambda r: r["label"] + k_label(r) + f" bs={int(r['bs'])}", axis=1) \
        + ctx_suffix(rows["ctx"], " ")  # each input length its own bar
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

    # each concurrency named once, at its highest point (every series' points at one load would overlap)
    pts = d.groupby(["label", "bs"], as_index=False)[["tpot_p50", "tokens_per_s"]].mean()
    for _, p in pts.loc[pts.groupby("bs")["tokens_per_s"].idxmax()].iterrows():
        ax.annotate(f"{int(p['bs'])}", (p["tpot_p50"] * 1e3, p["tokens_per_s"]), fontsize=6,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("TPOT p50 (ms per output token)")
    ax.set_ylabel("output tokens/s")
    dashed = "; dashed: continuous" if d["label"].str.contains(r"\[continuous").any() else ""
    ax.set_title(f"Throughput against latency (points: concurrency{dashed})\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, out, "throughput_vs_tpot", written)


def fig_speedup_vs_concurrency(df, out, written):
    """Speedup of each serving job against its concurrency, with the batch-aware bound read at the
    batch its steps really ran at (the measured rows in flight)."""
    d = method_rows(df[df["batching"] == "continuous"]).dropna(subset=["speedup"]) if "batching" in df else pd.DataFrame()
    d = d[d.groupby("series")["bs"].transform("nunique") >= 2] if not d.empty else d
    if d.empty:
        return
    many = (d.groupby("series")["K"].transform("nunique") > 1) & ~d["K_auto"]  # one line per fixed K, never a mean
    d = d.assign(series=[r["series"] + (k_label(r, ", ") if m else "") for (_, r), m in zip(d.iterrows(), many)])
    cmap, mk = colors(d["series"]), markers(d["series"])
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    for lab, g in d.groupby("series"):
        g = g.groupby("bs", as_index=False)[["speedup", "bound_batch"]].mean().sort_values("bs")
        ax.plot(g["bs"], g["speedup"], marker=mk[lab], ms=4, lw=1.5, color=cmap[lab], label=lab)
        if g["bound_batch"].notna().any():
            ax.plot(g["bs"], g["bound_batch"], ls=":", lw=1.2, color=cmap[lab])
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(d["bs"].unique()))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests in flight, log2)")
    ax.set_ylabel("speedup over AR at the same load")
    dotted = " (dotted: batch-aware bound at the measured rows in flight)" if d["bound_batch"].notna().any() else ""
    ax.set_title(f"Serving speedup{dotted}\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7, loc="best")
    save(fig, out, "speedup_vs_concurrency", written)


def fig_tuned(df, out, written):
    """K=auto against fixed settings: per tuned method, speedup against batch size for every fixed
    setting measured (thin) and for K=auto (bold, its choice written at each point)."""
    sd = method_rows(df).dropna(subset=["speedup"])
    if sd.empty or not sd["K_auto"].any():
        return
    tuned = sorted(sd[sd["K_auto"]]["series"].unique())
    fig, axes = plt.subplots(1, len(tuned), figsize=(4.4 * len(tuned), 3.3), squeeze=False, layout="constrained")
    for ax, series in zip(axes[0], tuned):
        a = sd[sd["series"] == series]
        keys = list(a.iloc[-1]["tuned_chosen"] or {})
        fixed = sd[(~sd["K_auto"]) & (sd["series"] == untuned(series))].copy()
        fixed["setting"] = fixed.apply(lambda r: setting_of(r, keys), axis=1)
        shades = plt.cm.viridis(np.linspace(0.1, 0.85, max(1, fixed["setting"].nunique())))
        for shade, (st, g) in zip(shades, fixed.groupby("setting")):
            g = g.groupby("bs", as_index=False)["speedup"].mean().sort_values("bs")
            ax.plot(g["bs"], g["speedup"], marker=".", lw=1.0, color=shade, label=st)
        g = a.groupby("bs", as_index=False).agg(speedup=("speedup", "mean")).sort_values("bs")
        ax.plot(g["bs"], g["speedup"], marker="o", ms=5, lw=2.2, color="#222222", label="K=auto")
        last = a["bs"].max()
        for _, r in a.drop_duplicates("bs", keep="last").iterrows():  # the last point's label leans left, inside
            ax.annotate(setting_of(r, keys), (r["bs"], r["speedup"]), fontsize=6, xytext=(-3 if r["bs"] == last else 3, 4),
                        textcoords="offset points", ha="right" if r["bs"] == last else "left")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE)
        if sd["bs"].nunique() > 1:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(a["bs"].unique()))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("batch size / concurrency (log2)")
        ax.set_ylabel("speedup over AR")
        ax.set_title(untuned(series), fontsize=9)
        ax.legend(frameon=False, fontsize=6, loc="best")
    fig.suptitle(f"K=auto (bold) against each fixed setting\n{subtitle(df)}", fontsize=9)
    save(fig, out, "tuned_vs_fixed", written)


def fig_engines(df, out, written):
    """Speedup over each engine's own AR, our engine beside vLLM, per method and batch size."""
    t = engines_table(df)
    if t.empty:
        return
    other = [c[:-len(" speedup")] for c in t.columns if c.endswith(" speedup") and not c.startswith("specbench")][0]
    t = t.assign(name=t["method"].str.replace(" (", "\n(", regex=False) + "\nbs=" + t["bs"].astype(str) + ", " + t["dataset"])
    group = max(0.8, 0.048 * max(len(ln) for nm in t["name"] for ln in nm.split("\n")) + 0.15)  # inches: a name fits
    fig, axes = plt.subplots(2, 1, figsize=(max(5.0, group * len(t) + 1.5), 5.6), layout="constrained")
    x = np.arange(len(t))
    for ax, col, ylab in ((axes[0], "speedup", "speedup over its own AR"), (axes[1], "tau", "tau (every step)")):
        ax.bar(x - 0.2, t[f"specbench {col}"], 0.4, label="specbench", color="#4477aa")
        ax.bar(x + 0.2, t[f"{other} {col}"], 0.4, label=other, color="#ee6677")
        ax.set_xticks(x)
        ax.set_xticklabels(t["name"], fontsize=6)
        ax.set_ylabel(ylab)
        top = np.nanmax(t[[f"specbench {col}", f"{other} {col}"]].to_numpy(dtype=float))
        ax.set_ylim(0, max(1.3, top * 1.2))  # room above the bars for the legend
        if col == "speedup":
            ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE)
            ax.legend(frameon=False, fontsize=7, ncol=3, loc="upper left")
    fig.suptitle(f"The same jobs on two engines\n{subtitle(df)}", fontsize=9)
    save(fig, out, "engines", written)


HIST_BARS = 6  # past this many series, the histogram is one stacked bar per series


def fig_hist(df, out, written):
    sd = method_rows(df)
    sd = sd[sd["hist"].map(lambda h: sum(h) > 0)]
    if sd.empty:
        return
    sd = sd.sort_values("K").drop_duplicates("job", keep="last")
    names = [f"{r['job']}{k_label(r, ', ')} (tau {r['tau']:.2f})" for _, r in sd.iterrows()]
    shares = [np.array(r["hist"], dtype=float) / sum(r["hist"]) for _, r in sd.iterrows()]
    if len(sd) > HIST_BARS:  # grouped bars would be slivers: a row per series, its steps split by length
        n = max(len(h) for h in shares)
        fig, ax = plt.subplots(figsize=(5.2, 0.3 * len(sd) + 1.4))
        shades = plt.cm.viridis(np.linspace(0.05, 0.95, n))
        y, left = np.arange(len(sd)), np.zeros(len(sd))
        for k in range(n):
            part = np.array([h[k] if k < len(h) else 0.0 for h in shares])
            ax.barh(y, part, left=left, color=shades[k], height=0.7, label=str(k + 1))
            left += part
        ax.set_yticks(y, names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of steps")
        ax.grid(axis="y", visible=False)
        ax.legend(frameon=False, fontsize=7, ncol=n, title="tokens emitted per step (accepted drafts + 1)",
                  title_fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.3 * len(sd) + 1.4) - 0.08))
    else:
        fig, ax = plt.subplots(figsize=(4.6, 3.2))
        cmap, hat = colors(sd["series"]), hatches(sd["series"])
        w = 0.8 / len(sd)
        for i, ((_, r), h, name) in enumerate(zip(sd.iterrows(), shares, names)):
            xs = np.arange(len(h)) + 1 + (i - (len(sd) - 1) / 2) * w
            ax.bar(xs, h, width=w, color=cmap[r["series"]], hatch=hat[r["series"]], edgecolor="white", lw=0.3, label=name)
        ax.set_xlabel("tokens emitted per step (accepted drafts + 1)")
        ax.set_ylabel("share of steps")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"Acceptance-length histogram\n{subtitle(df)}")
    save(fig, out, "accept_length_hist", written)


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
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE)
    ax.set_xticks(x, sim["name"], rotation=15, ha="right")
    ax.set_ylabel("speedup over AR")
    ax.grid(axis="x", visible=False)
    ax.set_title(f"Trace-driven simulation, bs={int(sim['bs'].iloc[0])}, {sim['dataset'].iloc[0]}\n{subtitle(df)}")
    ax.legend(frameon=False, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, out, "simulator", written)
