"""Figures (vector PDF + PNG) and tables (Markdown + LaTeX) from records.

    python -m specbench.analysis.report results/ [--method pld leviathan] [--model ...] [--dataset ...]
                              [--sweep ID] [--out reports/NAME]

Figures (``analysis.figures``): speedup vs batch size; acceptance per position; time split by
phase; measured speedup against the theoretical bounds (``analysis.theory``); speedup vs K, and
speedup and tau vs context length; acceptance-length histogram; acceptance by turn and inside or
outside a thinking span (``analysis.splits``); the trace-driven simulator's policies beside the
measurement. Tables (``analysis.tables``): per category (Spec-Bench style), the sweep table, and
acceptance by turn and thinking span (``acceptance_by``; its CSV per category too).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specbench.analysis.bound_figure import fig_bounds
from specbench.analysis.figures import (fig_acceptance, fig_engines, fig_hist, fig_quality, fig_serving,
                              fig_simulator, fig_speedup_vs, fig_speedup_vs_concurrency, fig_time_split, fig_tuned)
from specbench.analysis.load import k_label, load, load_cost_curves, method_rows, spec_len
from specbench.analysis.splits import SPLITS, fig_split, split_rows, split_table
from specbench.analysis.tables import (engines_table, identity_table, paper_per_category, paper_sweep, per_category,
                             sweep_table, to_latex, to_markdown, tuned_table)
from specbench.analysis.bounds import STATE_GAP, batch_aware, curve_state_gap, simulated, verify_nodes



def missing_batch_bound(df, records, where: str | None = None) -> str | None:
    """One line for the jobs whose batch-aware bound cannot be drawn (no profiled cost curve of
    their model, device, dtype and kernel beside the records): how many, and the command that
    profiles the curve (into ``where``: the records' folder unless named); None when every job has
    its bound."""
    sd = method_rows(df)
    sd = sd[(sd["backend"] == "specbench") & sd["speedup"].notna() & sd["bound_batch"].isna()]
    if sd.empty:
        return None
    r = sd.iloc[0]
    where = where or (Path(records) if Path(records).is_dir() else Path(records).parent)
    widest = max(max(spec_len(x) or 0, verify_nodes(x)) for _, x in sd.iterrows())  # a chain's K, a tree's nodes
    n = ",".join(str(i) for i in range(1, int(widest) + 2))
    bs = ",".join(str(int(b)) for b in sorted(sd["bs"].unique()))
    cmd = (f"python -m specbench.analysis.profile --model {r['model']} --device {r['device']} --dtype {r['dtype']} "
           f"--kernel {r['kernel']} --bs {bs} --n {n}" + (" --ragged" if sd["bs"].max() > 1 else "")
           + f" --results-dir {where}")
    what = "any job" if len(sd) == len(method_rows(df).dropna(subset=["speedup"])) else f"{len(sd)} jobs"
    return f"batch-aware bound not drawn for {what}: no cost curve profiled beside the records; `{cmd}` records one"


# ---------------------------------------------------------------------------- main
def build(records, out: Path, where: str | None = None, **filters) -> list[Path]:
    """The report of ``records`` into ``out``; ``where`` names the records' folder in the commands it
    prints (default: its path)."""
    df = load(records, **filters)
    if df.empty:
        raise SystemExit(f"no ok records in {records} (after filters {filters})")
    out.mkdir(parents=True, exist_ok=True)
    curves = load_cost_curves(records)
    written: list[Path] = []
    fig_speedup_vs(df, out, written, "bs", "batch size (log2)", "speedup_vs_batch", log2=True)
    fig_speedup_vs(df, out, written, "K", "speculation length K", "speedup_vs_k")
    fig_speedup_vs(df, out, written, "ctx", "context length (tokens)", "speedup_vs_ctx", log2=True)
    fig_speedup_vs(df, out, written, "ctx", "context length (tokens)", "tau_vs_ctx", log2=True, ycol="tau")
    fig_acceptance(df, out, written)
    fig_time_split(df, out, written)
    df["bound_batch"] = batch_aware(df, curves)  # from the profiled cost curve (NaN without one)
    df["of_bound"] = df["speedup"] / df["bound_batch"]
    df["curve_gap"] = curve_state_gap(df, curves)
    off = df[(df["curve_gap"] > STATE_GAP) | (df["curve_gap"] < 1 / STATE_GAP)]
    for _, r in off.iterrows():
        print(f"[report] {r['label']} (bs={r['bs']}): its batch bound reads a cost curve {r['curve_gap']:.2f}x its "
              f"paired AR's own step (another host state); profile the curve again beside the job "
              f"(make bench NAME=cpu does, after its jobs)", file=sys.stderr)
    for _, r in df[df["above_bound"].map(lambda x: isinstance(x, str))].iterrows():
        print(f"[report] {r['label']} (bs={r['bs']}{k_label(r)}): {r['above_bound']}", file=sys.stderr)
    note = missing_batch_bound(df, records, where)
    if note:
        print(f"[report] {note}", file=sys.stderr)
    fig_bounds(df, out, written, note=note)
    fig_serving(df, out, written)
    fig_speedup_vs_concurrency(df, out, written)
    fig_tuned(df, out, written)
    fig_engines(df, out, written)
    fig_hist(df, out, written)
    fig_quality(df, out, written)
    parts = split_rows(df)
    for split in ("turn", "thinking"):
        fig_split(df, parts, out, written, split)
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
    if not parts.empty:  # every split, every position; the Markdown/LaTeX table: turns and thinking span
        split_table(parts, SPLITS, None, full=True).to_csv(out / "acceptance_by.csv", index=False)
        written.append(out / "acceptance_by.csv")
        tables["acceptance_by"] = (split_table(parts), "Acceptance by turn and inside or outside the thinking span: "
                                   "share of the job's steps, tau and alpha_i (per category: acceptance_by.csv)")
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
