"""The report's bound figure (``speedup_vs_bound``): each job's measured speedup, with its 95%
bootstrap interval, beside the Leviathan closed form, the per-position form and the batch-aware
bound (``analysis.theory``, ``analysis.bounds``), in evenly split panels when there are many."""

from __future__ import annotations

import numpy as np

from specbench.analysis import figures
from specbench.analysis.figures import AR_LINE, caption, plt, subtitle
from specbench.analysis.load import k_label, method_rows, spec_len


BARS_PER_PANEL = 10  # a bound figure holds every job: past this many groups, more panels, split evenly


def panels_of(n: int, most: int = BARS_PER_PANEL) -> list[slice]:
    """``n`` items in the fewest panels of at most ``most`` each, split evenly (11 -> 6 + 5, never 10 + 1)."""
    k = max(1, -(-n // most))
    edges = [round(i * n / k) for i in range(k + 1)]
    return [slice(edges[i], edges[i + 1]) for i in range(k)]


def no_bound_why(r) -> str:
    """Why a job has no closed-form bound, in a few words for its empty bars."""
    if spec_len(r) is None:
        return "no bound:\nno fixed K\n(drafts vary)"
    if not len(r.get("alphas") or []):
        return "no bound:\nno acceptance\nrecorded"
    return "no bound:\nno AR step\nto price c"


def fig_bounds(df, out, written, note: str | None = None):
    """Measured speedup (with its 95% bootstrap interval) beside the closed-form, per-position and
    batch-aware bounds, one group of bars per job; ``note``: the caption saying which bound is not
    drawn and why."""
    sd = method_rows(df).dropna(subset=["speedup"]).copy()
    if sd.empty:
        return
    one = sd["label"].nunique() == 1  # a single method: name it once, in the title

    def short(r):
        lab = r["job"][len(r["label"]):].lstrip(", ") if one else r["job"]
        lab = lab.replace(" (", "\n(").replace(", ", "\n")
        return (lab + "\n" if lab else "") + f"{k_label(r, '')} bs={int(r['bs'])}".lstrip()

    sd["name"] = sd.apply(short, axis=1)
    sd = sd.drop_duplicates("name", keep="last")
    series = [("measured (95% CI)", "speedup", "#222222"), ("Leviathan closed form", "bound_leviathan", "#4c72b0"),
              ("per-position form", "bound_per_position", "#55a868"), ("batch-aware (cost curve)", "bound_batch", "#dd8452")]
    series = [s for s in series if s[1] in sd and sd[s[1]].notna().any()]
    panels = [sd.iloc[sl] for sl in panels_of(len(sd))]
    width = max(len(p) for p in panels)  # every panel as wide, so its bars are as wide
    group = max(1.35, 0.06 * max(len(ln) for nm in sd["name"] for ln in nm.split("\n")) + 0.25)  # inches: its name fits
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(4.6, group * width + 1.5), 3.4 * len(panels)), squeeze=False,
                             layout="constrained")  # room for each panel's multi-line job names
    ymax = np.nanmax(sd[[s[1] for s in series] + ["speedup_hi"]].to_numpy(dtype=float))
    w = 0.8 / len(series)
    for ax, part in zip(axes[:, 0], panels):
        x = np.arange(len(part))
        for i, (lab, col, colr) in enumerate(series):
            ax.bar(x + (i - (len(series) - 1) / 2) * w, part[col].fillna(0), width=w, color=colr, label=lab,
                   edgecolor="white", lw=0.5)
        ci = part["speedup_lo"].notna() & part["speedup_hi"].notna()
        if ci.any():  # the measured bar's 95% bootstrap interval over batches
            m = part[ci]
            ax.errorbar(x[ci.to_numpy()] - (len(series) - 1) / 2 * w, m["speedup"],
                        yerr=[(m["speedup"] - m["speedup_lo"]).clip(lower=0), (m["speedup_hi"] - m["speedup"]).clip(lower=0)],
                        fmt="none", ecolor="#888888", elinewidth=1.0, capsize=2.5)
        for j, (_, r) in enumerate(part.iterrows()):
            top = np.nanmax([r["speedup"], r.get("speedup_hi", np.nan), r.get("bound_leviathan", np.nan),
                             r.get("bound_per_position", np.nan), r.get("bound_batch", np.nan)])
            if isinstance(r.get("above_bound"), str):  # not a result: its AR baseline ran slow
                ax.text(x[j], top * 1.02, "above tau:\nAR slowed?", ha="center", va="bottom", fontsize=6.5,
                        color="#c44e52", fontweight="bold")
                continue
            b = r.get("bound_leviathan")
            if b is not None and np.isfinite(b) and b > 0:  # the gap: measured as a share of the closed form
                ax.text(x[j], top + 0.03 * max(1.0, top), f"{r['speedup'] / b:.0%}", ha="center", fontsize=7)
            elif len(series) > 1:
                ax.text(x[j] - (len(series) - 2) / 2 * w + 0.02, 0.05, no_bound_why(r), ha="left", va="bottom", fontsize=6, color="#666666")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label=AR_LINE)
        ax.set_xticks(x, part["name"], fontsize=7)
        ax.set_xlim(-0.6, width - 0.4)
        ax.set_ylabel("speedup over AR")
        ax.grid(axis="x", visible=False)
        ax.set_ylim(0, max(1.3, ymax * 1.25))
    what = f"{sd['label'].iloc[0]}: measured" if one else "Measured"
    axes[0, 0].set_title(f"{what} speedup against the theoretical bounds (% = measured / closed form)\n{subtitle(df)}")
    axes[0, 0].legend(frameon=False, fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if note:
        caption(fig, note)
    figures.save(fig, out, "speedup_vs_bound", written)  # through the module: tests watch it
