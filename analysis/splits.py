"""Acceptance where it differs: tau and alpha_i of each job by turn, by category and, for a model
that thinks, inside and outside its thinking span (``metrics.acceptance_by``; records written
before it have it computed from their requests' ``accepts``, the span excepted), as a table and a
figure per split (``acceptance_by_turn``, ``acceptance_by_thinking``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from specbench.analysis.figures import caption, plt, save, subtitle
from specbench.analysis.load import k_label, method_rows
from specbench.run.data import category_order

SPLITS = ("turn", "thinking", "category")
POSITIONS = 4  # alpha_1..alpha_4 in the table (the CSV keeps every position)
PART_COLORS = {"turn": ["#4c72b0", "#dd8452", "#55a868", "#c44e52"], "thinking": ["#8172b3", "#ccb974"]}


def part_name(split: str, part: str) -> str:
    return f"turn {part}" if split == "turn" else f"{part} thinking" if split == "thinking" else part


def parts_of(split: str, parts: dict) -> list[str]:
    """A split's parts in reading order: turns by number, inside before outside, categories as Spec-Bench."""
    if split == "turn":
        return sorted(parts, key=lambda t: (not t.isdigit(), int(t) if t.isdigit() else 0, t))
    if split == "thinking":
        return [p for p in ("inside", "outside") if p in parts]
    return category_order(parts)


def split_rows(df: pd.DataFrame, splits=SPLITS) -> pd.DataFrame:
    """One row per job and part of each split it has in two parts or more (the thinking split whenever
    it was recorded): the job's name, batch size, the split, the part, its share of the job's steps,
    its tau and alpha_i at every position."""
    sd = method_rows(df)
    if sd.empty or "acceptance_by" not in sd:
        return pd.DataFrame()
    multi_bs = sd["bs"].nunique() > 1
    rows = []
    for _, r in sd.iterrows():
        by = r["acceptance_by"] if isinstance(r["acceptance_by"], dict) else {}
        name = r["series"] + k_label(r, ", ") + (f", bs={int(r['bs'])}" if multi_bs else "") + r["ctx_label"]
        for split in splits:
            parts = by.get(split) or {}
            if not parts or (len(parts) < 2 and split != "thinking"):
                continue
            total = sum(p["steps"] for p in parts.values()) or 1
            for part in parts_of(split, parts):
                p = parts[part]
                rows.append({"job": name, "bs": int(r["bs"]), "dataset": r["dataset"], "split": split,
                             "part": part_name(split, part),
                             "steps %": 100.0 * p["steps"] / total, "tau": p["tau"] if p["tau"] is not None else np.nan,
                             "alphas": list(p["accept_rate_per_pos"])})
    t = pd.DataFrame(rows)
    return t.drop_duplicates(["job", "split", "part"], keep="last").reset_index(drop=True) if not t.empty else t


def split_table(rows: pd.DataFrame, splits=("turn", "thinking"), positions: int | None = POSITIONS,
                full: bool = False) -> pd.DataFrame:
    """The table of ``split_rows`` for ``splits``: job, part, share of steps, tau, alpha_1.. (the first
    ``positions``; None: every one); ``full``: with the batch size and the split (the CSV)."""
    t = rows[rows["split"].isin(splits)] if not rows.empty else rows
    if t.empty:
        return pd.DataFrame()
    n = max(len(a) for a in t["alphas"]) if positions is None else positions
    keep = ["job", "bs", "split"] if full else ["job"]
    out = t[[*keep, "part", "steps %", "tau"]].rename(columns={"job": "method"}).copy()
    for i in range(n):
        out[f"alpha_{i + 1}"] = [a[i] if i < len(a) else np.nan for a in t["alphas"]]
    return out.reset_index(drop=True)


def fig_split(df: pd.DataFrame, rows: pd.DataFrame, out, written, split: str) -> None:
    """Per job, tau and alpha_1 of each part of ``split`` side by side (horizontal bars); drawn when a
    job has steps in two parts of it."""
    t = rows[rows["split"] == split] if not rows.empty else rows
    if t.empty:
        return
    both = t[t["tau"].notna()].groupby("job")["part"].nunique()
    jobs = [j for j in dict.fromkeys(t["job"]) if both.get(j, 0) >= 2]
    if not jobs:
        return
    parts = list(dict.fromkeys(t["part"]))
    shades = PART_COLORS.get(split, PART_COLORS["turn"])
    h = 0.8 / len(parts)
    fig, axes = plt.subplots(1, 2, figsize=(7.4, 0.2 * len(jobs) * len(parts) + 1.5), sharey=True, layout="constrained")
    y = np.arange(len(jobs))
    for ax, what, xlabel in ((axes[0], "tau", "tau (tokens per step)"),
                             (axes[1], "alpha_1", r"$\alpha_1$ (share of steps)")):
        for k, part in enumerate(parts):
            g = t[t["part"] == part].set_index("job")
            vals = [(g.at[j, "tau"] if what == "tau" else (g.at[j, "alphas"] or [np.nan])[0]) if j in g.index
                    else np.nan for j in jobs]
            ax.barh(y - 0.4 + h * (k + 0.5), vals, height=h, color=shades[k % len(shades)], label=part)
        ax.set_xlabel(xlabel)
        ax.grid(axis="y", visible=False)
        if what == "tau":
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
        else:
            ax.set_xlim(0, 1.0)
    axes[0].set_yticks(y, jobs, fontsize=7)
    axes[0].invert_yaxis()
    axes[1].legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    what = {"turn": "by turn", "thinking": "inside and outside the thinking span"}.get(split, f"by {split}")
    fig.suptitle(f"Acceptance {what}: tau and the first position's rate\n"
                 f"{subtitle(df[df['dataset'].isin(set(t['dataset']))])}", fontsize=9)
    if split == "thinking":
        caption(fig, "a step counts where it began: inside from the opening tag (prompt or output) to the closing tag")
    save(fig, out, f"acceptance_by_{split}", written)
