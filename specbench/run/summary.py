"""The table printed when a sweep ends (a Hydra callback), from the sweep's records."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

from specbench.run import records as R


# settings a record keeps that no column shows: the summary names those its sweep varied (a
# method's draft and keys: between that method's records)
SWEPT = ("kernel", "dtype", "device", "temperature", "top_k", "top_p", "max_new_tokens", "seed")


def swept(recs: list[dict]) -> list[str]:
    """Per record, the settings the sweep varied that no column shows (``compile=graphs``, a method
    key such as ``pld.max_ngram=3``), as ``key=value`` words."""
    def own(r):  # the method's draft and keys, as given
        return {"draft": r.get("draft"), **{f"{r.get('method')}.{k}": v for k, v in (r.get("method_opts") or {}).items()
                                            if k != "name"}}
    keys = [k for k in SWEPT if len({str(r.get(k)) for r in recs}) > 1]
    by_method: dict = {}
    for r in recs:
        by_method.setdefault(r.get("method"), []).append(own(r))
    varied = {m: [k for k in dict.fromkeys(k for o in os_ for k in o) if len({str(o.get(k)) for o in os_}) > 1]
              for m, os_ in by_method.items()}
    return [" ".join([f"{k}={r.get(k)}" for k in keys] + [f"{k}={own(r).get(k)}" for k in varied[r.get("method")]])
            for r in recs]


def summary_table(recs: list[dict]) -> str:
    serving = any(r.get("serving") for r in recs)  # a serving sweep: its load and latency too
    settings = swept(recs)
    cols = ["method", "model", "dataset", "bs", *(["batching", "rate", "TPOT p50", "TTFT p99"] if serving else []),
            "K", "ctx", *(["settings"] if any(settings) else []), "tok/s", "speedup", "tau", "verify", "match_ar",
            "score", "status"]
    rows = []
    by_id = {r.get("job_id"): r for r in recs}
    for r, setting in zip(recs, settings):
        m = r.get("metrics") or {}

        def f(x, fmt):  # a refused job's record keeps a bad value as given (ctx=abc): shown as it is
            if x is None:
                return "-"
            return format(x, fmt) if fmt != "d" or (isinstance(x, int) and not isinstance(x, bool)) else str(x)

        lat = m.get("latency") or {}
        srv = r.get("serving") or {}
        def ms(x):
            return "-" if x is None else f"{x * 1e3:.0f} ms"

        load = [srv.get("batching", "static"), str(srv.get("rate", "-")), ms((lat.get("tpot_s") or {}).get("p50")),
                ms((lat.get("ttft_s") or {}).get("p99"))] if serving else []
        name = str(r.get("method"))
        if r.get("method") == "ar" and r.get("paired_with"):  # a paired job's own AR, named by its method
            name += f" (for {by_id[r['paired_with']].get('method')})" if r["paired_with"] in by_id else " (paired)"
        name += f" [{r['backend']}]" if r.get("backend") else ""  # vLLM's jobs say so
        name += " [synthetic accept]" if r.get("accept") else ""  # drawn acceptance, lossy by construction
        name += {True: " [compiled]", "graphs": " [graphs]"}.get(r.get("compile"), "")  # timed compiled or captured
        rows.append([name, str(r.get("model")).split("/")[-1], r.get("dataset"), str(r.get("bs")), *load,
                     ("auto:" if r.get("K_auto") else "") + f(r.get("K"), "d"), f(r.get("ctx"), "d"),
                     *([setting or "-"] if any(settings) else []), f(m.get("tokens_per_s"), ".1f"),
                     f(m.get("speedup"), ".2f") + ("x" if m.get("speedup") is not None else "")
                     + (" unpaired" if R.ar_paired(r) is False else "") + (" !" if R.above_bound(r) else ""),
                     f(m.get("tau"), ".2f"), f(m.get("verify_share"), ".0%"), f(m.get("match_ar"), ".0%"),
                     f((m.get("quality") or {}).get("value"), ".0%"),
                     r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {r.get('error')}"[:60]])
    widths = [max(len(c), *(len(str(row[i])) for row in rows)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)) for row in rows]
    if any(R.ar_paired(r) is False for r in recs):
        out += ["", "unpaired: against an AR job run apart (ar_baseline=sweep or any), so host drift between the two "
                "moves it; ar_baseline=paired runs each job's own AR beside it"]
    flags = [(r, R.above_bound(r)) for r in recs]
    flags = [f"  ! {r.get('method')} bs={r.get('bs')}" + (f" K={r['K']}" if r.get("K") else "") + f": {why}"
             for r, why in flags if why]
    if flags:
        out += ["", "Speedups that cannot be right:", *flags]
    errors = list(dict.fromkeys(str(r["error"]) for r in recs if r.get("status") != "ok" and r.get("error")))
    long = [e for e in errors if len(f"error: {e}") > 60]  # cut in the table: whole here, once each
    if long:
        out += ["", "Errors:", *(f"  ! {e}" for e in long)]
    return "\n".join(out)


try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object


class SummaryCallback(Callback):
    """Prints the sweep's table when a sweep (or single run) ends."""

    def _print(self, config) -> None:
        records = OmegaConf.select(config, "records") or "results/records.jsonl"
        sid = Path(str(config.hydra.sweep.dir)).name
        recs = [R.load(records, e) for e in R.index(records) if e.get("sweep_id") == sid]
        if not recs:
            print("\n[specbench] no records written by this sweep", file=sys.stderr)
            return
        print(f"\nspecbench sweep {sid}: {len(recs)} records in {records}\n")
        print(summary_table(recs), flush=True)
        # jobs that ran in other processes (a parallel launcher's workers) set the exit code too
        from specbench.run.runner import FAILED

        FAILED.extend(r.get("error") or r.get("status") for r in recs
                      if r.get("status") != "ok" and (r.get("error") or r.get("status")) not in FAILED)

    def on_multirun_end(self, config, **kwargs) -> None:
        self._print(config)

    def on_run_end(self, config, **kwargs) -> None:
        self._print(config)
