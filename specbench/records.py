"""The records file: one JSON line per job, appended and flushed when the job ends."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import subprocess
from functools import lru_cache
from pathlib import Path

SCHEMA = 1

# Fields an AR job must share with a method's job to be its speedup baseline: everything
# that changes the prompts (the whole dataset config: language, turns, path), the model
# (the whole model config: chat template, attention kernel) or the numerics and their speed (dtype,
# the linear-layer kernel path and the vector instructions it runs, a compiled forward).
BASELINE_KEYS = ("model", "dataset", "limit", "bs", "ctx", "dtype", "device", "temperature", "top_k", "top_p",
                 "max_new_tokens", "seed", "dataset_cfg", "model_cfg", "repeats", "kernel",
                 "kernel_isa", "compile")  # repeats: only when > 1; compile: only when true
# ... and, for an AR record of another sweep (ar_baseline=any), the same machine and code.
ENV_KEYS = ("device_name", "host", "git_sha", "torch", "transformers")


def append(path: str | Path, record: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, default=str)
    with p.open("ab+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # one writer at a time (parallel launcher workers share the file)
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:  # a line cut by a crash must not swallow this record
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                line = "\n" + line
        f.write((line + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def read(path: str | Path) -> list[dict]:
    """Every record of a file (or of every records*.jsonl under a folder); a line cut by a
    crash is skipped."""
    p = Path(path)
    files = sorted(p.rglob("records*.jsonl")) if p.is_dir() else [p]
    out = []
    for f in files:
        if not f.exists():
            continue
        with f.open() as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def baseline_key(rec: dict) -> tuple:
    return tuple(json.dumps(rec.get(k), sort_keys=True) for k in BASELINE_KEYS)


def env_key(rec: dict) -> tuple:
    env = rec.get("env") or {}
    return tuple(env.get(k) for k in ENV_KEYS)


# A job is the same job when these match too (with the same machine and code).
JOB_KEYS = BASELINE_KEYS + ("method", "K", "draft", "method_opts")


def job_key(rec: dict) -> tuple:
    return tuple(json.dumps(rec.get(k), sort_keys=True) for k in JOB_KEYS)


def find_done(records: list[dict], probe: dict) -> dict | None:
    """The latest ok record of the job ``probe`` describes, on the same machine and code."""
    key, env = job_key(probe), env_key(probe)
    for rec in reversed(records):
        if rec.get("status") == "ok" and env_key(rec) == env and job_key(rec) == key:
            return rec
    return None


def find_ar(records: list[dict], probe: dict, sweep_id: str | None) -> dict | None:
    """The latest ok AR record that pairs with ``probe`` (a record of this job): of this
    sweep when ``sweep_id`` is given, else of any sweep on the same machine and code."""
    key = baseline_key(probe)
    for rec in reversed(records):
        if rec.get("method") != "ar" or rec.get("status") != "ok":
            continue
        if sweep_id is not None and rec.get("sweep_id") != sweep_id:
            continue
        if sweep_id is None and env_key(rec) != env_key(probe):
            continue
        if baseline_key(rec) == key:
            return rec
    return None


# Untracked files that count as code (``git_sha``'s hash): a new method module or config is code.
SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".cpp", ".h", ".toml", ".cfg", ".json", ".txt", ".jsonl")


@lru_cache(maxsize=1)
def git_sha() -> str | None:
    """The code of this checkout (``code_state`` of the repository), once per process."""
    return code_state(Path(__file__).resolve().parent.parent)


def code_state(root: Path) -> str | None:
    """The code a record was measured with: the commit, and where the work tree differs from it
    ``<sha>-dirty-<12 hex>``, a hash of the diff against the commit (tracked files) and of every
    untracked source file (path and bytes; ignored files such as results do not count). Two
    different uncommitted states never share a label, so ``resume=true`` and ``ar_baseline=any``
    never pair records measured with different code. None outside a git work tree."""
    def git(*args) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=10)

    try:
        sha = git("rev-parse", "HEAD")
        if sha.returncode != 0:
            return None
        head = sha.stdout.decode().strip()
        diff = git("diff", "HEAD", "--binary", "--no-color", "--no-ext-diff")
        untracked = git("ls-files", "--others", "--exclude-standard", "-z").stdout.decode().split("\0")
    except (OSError, subprocess.SubprocessError):
        return None
    h = hashlib.sha256(diff.stdout)
    dirty = bool(diff.stdout.strip())
    for rel in sorted(f for f in untracked if f.endswith(SOURCE_SUFFIXES)):
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        h.update(b"\0untracked\0" + rel.encode() + b"\0" + data)
        dirty = True
    return head + (f"-dirty-{h.hexdigest()[:12]}" if dirty else "")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def env_info(device) -> dict:
    import torch
    import transformers

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "git_sha": git_sha(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device_name": dev_name,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ar_request(ref: dict, r: dict) -> dict:
    """AR's request for the same question and turn (the same repeat where AR has it)."""
    return ref.get((r["id"], r["turn"], r.get("repeat", 0))) or ref.get((r["id"], r["turn"], 0)) or {}


def divergence(requests: list[dict], ref: dict, mark: bool = True) -> dict | None:
    """Where greedy outputs first differ from AR's for the same prompt (``ref``: AR's
    requests by (id, turn, repeat)) and the summary; ``mark`` also sets each request's
    ``diverge_at`` (None when identical). Requests whose prompt already differs (a second
    turn after a diverged first) are left out: they compare different inputs."""
    pos, n = [], 0
    for r in requests:
        a = ar_request(ref, r)
        if not a or "tokens" not in a or "tokens" not in r or a.get("prompt_sha") != r.get("prompt_sha"):
            continue
        n += 1
        d = first_divergence(r["tokens"], a["tokens"])
        if mark:
            r["diverge_at"] = d
        if d is not None:
            pos.append(d)
    if not n:
        return None
    pos.sort()
    return {"compared": n, "diverged": len(pos), "median_at": pos[len(pos) // 2] if pos else None,
            "first_at": pos[0] if pos else None, "positions": pos}
