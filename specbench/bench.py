"""`python -m specbench.bench NAME [key=value ...]`: a benchmark preset end to end.

A preset is ``conf/experiment/NAME.yaml`` (``# @package _global_``): its settings and its sweep
(``hydra.sweeper.params``), so ``python -m specbench experiment=NAME`` runs its main sweep. Its
``bench`` node says what else the benchmark runs, in order:

    bench:
      about: one line for `make help` and the log
      needs: {VAR: what it names}          # environment variables the steps use as $VAR
      steps:
        - sweep: ""                        # the preset itself (the default when there are no steps)
        - sweep: method=rest bs=1,8            # the preset with these overrides (hydra.sweeper.params=null: without its sweep)
        - profile: --bs 1,8 --n 1,2,5      # analysis.profile into the preset's results_dir
        - show: identity.md                # print a file of the report
      report: true                         # specbench.analysis.report over results_dir (the default)

``key=value`` arguments go to every sweep (``results_dir=...`` moves the whole benchmark).
``--plan`` runs nothing: it prints each step and checks every job of every sweep as a job does
before its weights load (the schema, the method's checks, its data set's file, ctx and prompts
against the model's positions), so a long benchmark fails now, not an hour in.
"""

from __future__ import annotations

import os
import shlex
import string
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from specbench.paths import CONF_DIR

EXPERIMENTS = CONF_DIR / "experiment"


def names() -> list[str]:
    return sorted(p.stem for p in EXPERIMENTS.glob("*.yaml"))


def load(name: str):
    path = EXPERIMENTS / f"{name}.yaml"
    if not path.exists():
        from specbench.errors import did_you_mean

        raise SystemExit(f"specbench.bench: no preset '{name}';{did_you_mean(name, names())} choices: "
                         f"{', '.join(names())}")
    return OmegaConf.load(path)


def steps(name: str, args: list[str]) -> list[list[str]]:
    """The commands the benchmark ``name`` runs, with ``args`` (key=value) for each sweep."""
    preset = load(name)
    bench = preset.get("bench") or {}
    results = next((a.partition("=")[2] for a in reversed(args) if a.startswith("results_dir=")),
                   str(preset.get("results_dir", "results")))
    env = dict(os.environ)
    for var, what in (bench.get("needs") or {}).items():
        if not env.get(var):
            raise SystemExit(f"specbench.bench {name}: set {var}=<{what}>")
    py = sys.executable
    out = []
    for step in bench.get("steps") or [{"sweep": ""}]:
        (kind, text), = step.items()
        words = shlex.split(string.Template(str(text)).substitute(env))
        if kind == "sweep":
            out.append([py, "-m", "specbench", f"experiment={name}", *words, *args])
        elif kind == "profile":
            out.append([py, "-m", "specbench.analysis.profile", *words, "--results-dir", results])
        elif kind == "show":
            out.append(["cat", str(Path(results) / "report" / text)])
        else:
            raise SystemExit(f"specbench.bench {name}: unknown step '{kind}' (sweep, profile or show)")
    if bench.get("report", True):
        report = [py, "-m", "specbench.analysis.report", results, "--out", str(Path(results) / "report")]
        shows = [i for i, s in enumerate(out) if s[0] == "cat"]
        out.insert(shows[0] if shows else len(out), report)
    return out


def jobs(name: str, overrides: list[str]) -> list[list[str]]:
    """The overrides of each job ``python -m specbench experiment=NAME *overrides`` would run
    (the preset's sweep, then the command line's, as Hydra's basic sweeper expands them), without
    running any: the preset tests compose each of them."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from specbench.run import schema

    own = [o for o in overrides if o.startswith("hydra.")]
    task = [o for o in overrides if not o.startswith("hydra.")]
    schema.store()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"experiment={name}", *own], return_hydra_config=True)
    params = [f"{k}={v}" for k, v in (cfg.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + task)
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return batch


def plan(name: str, args: list[str]) -> list[str]:
    """Each step of the benchmark as a line, a sweep's with its jobs (each method job runs its AR
    beside it under ar_baseline=paired), every job checked as ``runner.run`` checks it before any
    weights load (``validation.validate``); nothing runs. A job that would fail raises its ConfigError."""
    from hydra import compose, initialize_config_dir

    from specbench.errors import ConfigError
    from specbench.run.validation import validate

    lines, marker = [], f"experiment={name}"
    for i, cmd in enumerate(steps(name, args), 1):
        text = shlex.join(cmd[1:] if cmd[0] == sys.executable else cmd)
        if marker in cmd:
            overrides = cmd[cmd.index(marker) + 1:]
            own = [o for o in overrides if o.startswith("hydra.")]
            todo = jobs(name, overrides)
            for job in todo:
                with initialize_config_dir(str(CONF_DIR), version_base=None):
                    cfg = compose("config", overrides=[marker, *own, *job])
                try:
                    validate(cfg)
                except ConfigError as e:
                    raise ConfigError(f"step {i}, job {' '.join(job)}: {e}") from None
            text += f"  [{len(todo)} jobs: " + "; ".join(" ".join(j) for j in todo) + "]"
        lines.append(f"step {i}: {text}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        for n in names():
            print(f"  {n:<18} {(load(n).get('bench') or {}).get('about', '')}")
        return 0
    rest = [a for a in argv if a != "--plan"]  # --plan before or after the name
    if not rest:
        raise SystemExit("specbench.bench: name a preset (python -m specbench.bench --help lists them)")
    name, args = rest[0], rest[1:]
    if "--plan" in argv:
        from specbench.errors import ConfigError

        try:
            from specbench.__main__ import preprocess

            preprocess(list(args))  # a misspelt key or value: the one line `python -m specbench` gives
            print("\n".join(f"[bench {name}] {line}" for line in plan(name, args)))
        except ConfigError as e:
            print(f"[bench {name}] {e}", file=sys.stderr)
            return 2
        return 0
    todo = steps(name, args)
    for i, cmd in enumerate(todo, 1):
        print(f"[bench {name}] step {i}/{len(todo)}: {shlex.join(cmd[1:] if cmd[0] == sys.executable else cmd)}",
              flush=True)
        rc = subprocess.call(cmd)
        if rc:
            print(f"[bench {name}] step {i} failed (exit {rc}); what it wrote stays in place: rerun with resume=true",
                  file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
