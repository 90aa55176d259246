"""A recorded job's bounds, priced: the batch-aware bound from the profiled cost curve of the
job's own shape (model, device, dtype, kernel) nearest the host state its paired AR ran in, the
gap between that curve and the AR's own step, and the trace-driven simulator's policies. The
formulas are ``analysis.theory``'s."""

from __future__ import annotations

import math

import pandas as pd

from specbench.analysis import simulate, theory
from specbench.analysis.load import ar_baselines, method_rows, spec_len
from specbench.costs import interp


def curves_for(curves, model, device, dtype, kernel=None, isa=None, compiled=False) -> list[dict]:
    """The profiled cost curves of this model, device, dtype and linear-layer kernel path
    (curves and records from before kernels existed ran torch's), of the same vector
    instructions where both say which (native tiles are AVX2 or AVX-512 by CPU), and compiled
    (``analysis.profile --compile``) exactly when the job was."""
    return [c for c in curves if str(c.get("model")) == str(model) and c.get("device") == device
            and c.get("dtype") == dtype and (c.get("kernel") or "torch") == (kernel or "torch")
            and (isa is None or c.get("kernel_isa") is None or c.get("kernel_isa") == isa)
            and (c.get("compile") or False) == (compiled or False)]


def same_shape(cand: list[dict], r) -> list[dict]:
    """Of a job's curves, those profiled in the shape its verifies have (``analysis.profile
    --ragged --tree``): ragged rows at bs > 1, a tree's mask where its drafts are wider than deep;
    else the plain (dense chain) ones; else all."""
    want = (int(r["bs"]) > 1, verify_nodes(r) > (spec_len(r) or 0) + 1e-9)
    match = [c for c in cand if (bool(c.get("ragged")), bool(c.get("tree"))) == want]
    return match or [c for c in cand if not c.get("ragged") and not c.get("tree")] or cand


def _known(v) -> bool:
    return v is not None and v == v and v > 0


def verify_nodes(r) -> float:
    """The draft nodes a job's verify forwards ran per row per step, what its verify is priced at
    (width = these + 1): ``forward_nodes``, the width run (every row runs the widest row's draft;
    a tree its nodes, Lookahead its window too). A record written before the width was kept has
    only each row's own nodes (``valid_nodes``): priced at those, a ragged batch's verify is priced
    below what it ran and its bound is looser (higher) than the width would make it. Before either,
    the candidates (``draft_nodes``); else K."""
    for k in ("forward_nodes", "valid_nodes", "draft_nodes"):
        if _known(r.get(k)):
            return float(r[k])
    return float(spec_len(r) or 0)


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
                          r.get("compile") or False)  # graphs: no profile of captured forwards (none matches)
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
            t_ver = interp(T, B, verify_nodes(r) + 1)
            t_draft = r["t_draft"] / r["iterations"]
            first, first_ar = len(r["requests"]), len(base["requests"])  # the prefill gives each turn its first token
            s = theory.batch_aware_job(r["tau"], t_ar, t_draft, t_ver, B,
                                       r["new_tokens"], r["new_tokens"] - first, r.get("t_prefill") or 0.0,
                                       base["new_tokens"], base["new_tokens"] - first_ar,
                                       base.get("t_prefill") or 0.0)
        vals.append(s)
    return pd.Series(vals, index=df.index)


def simulated(df, curves) -> pd.DataFrame:
    """Fixed-K and oracle-K replays of each job's acceptance trace on the cost curve (one curve
    per group, so the combined oracle compares its jobs alike: the one nearest the host state
    of the group's first AR record, `nearest_state`)."""
    rows = []
    sd = method_rows(df)
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
