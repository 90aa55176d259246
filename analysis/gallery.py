"""Every figure the report draws, made from committed baselines (``results/baselines/``), so anyone
can look at them before running anything: one report per set of baselines, the PNGs of the figures
no earlier set drew kept under ``--out`` (``docs/figures/<set>/``, shown by docs/figures.md).

    python -m specbench.analysis.gallery [--out docs/figures]     # or: make figures
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

from specbench.analysis import report

BASELINES = Path(__file__).resolve().parents[1] / "results" / "baselines"

# set name -> the baselines it reads together, and what it shows
SETS = {
    "methods": (["bench-training-free-cpu-2026-11-26.jsonl.gz", "bench-headline-cpu-2026-11-25.jsonl.gz"],
                "twelve methods at bs 1 on MT-Bench, HumanEval and GSM8K"),
    "tune": (["bench-tune-cpu-2026-11-26.jsonl.gz"], "K=auto against fixed K, EAGLE and PLD served at concurrency 1, 4 and 16"),
    "engines": (["bench-vllm-cpu-2026-11-26.jsonl.gz"], "the same jobs on specbench and vLLM"),
}


def build_set(name: str, out: Path, baselines: Path = BASELINES) -> tuple[list[Path], str]:
    """The report of one set into ``out`` (every file it writes) and what it printed on stderr.
    The report reads a folder's ``records*.jsonl[.gz]``: the baselines are copied under that name."""
    files, _ = SETS[name]
    with tempfile.TemporaryDirectory() as tmp:
        for i, f in enumerate(files):
            shutil.copy(baselines / f, Path(tmp) / f"records-{i}.jsonl.gz")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            written = report.build(tmp, out, where=str(baselines.relative_to(baselines.parents[1])))
    return written, err.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/figures", help="one folder per set; only the PNGs are kept")
    a = ap.parse_args(argv)
    shown: set[str] = set()
    for name, (files, what) in SETS.items():
        d = Path(a.out) / name
        shutil.rmtree(d, ignore_errors=True)
        with tempfile.TemporaryDirectory() as tmp:
            written, _ = build_set(name, Path(tmp))
            new = [p for p in written if p.suffix == ".png" and p.name not in shown]  # each figure once
            d.mkdir(parents=True)
            for p in new:
                shutil.copy(p, d / p.name)
        shown |= {p.name for p in new}
        print(f"{name} ({what}): {', '.join(p.stem for p in new)} in {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
