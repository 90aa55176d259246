"""The records file: one JSON line per job, appended and flushed when the job ends."""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from specbench.paths import REPO

SCHEMA = 1

# Fields an AR job must share with a method's job to be its speedup baseline: everything
# that changes the prompts (the whole dataset config: language, turns, path), the model
# (the whole model config: chat template, attention kernel) or the numerics and their speed (dtype,
# the linear-layer kernel path and the vector instructions it runs, a compiled forward).
BASELINE_KEYS = ("model", "dataset", "limit", "bs", "ctx", "dtype", "device", "temperature", "top_k", "top_p",
                 "max_new_tokens", "seed", "dataset_cfg", "model_cfg", "repeats", "kernel",
                 "kernel_isa", "compile", "serving", "backend", "backend_version", "vllm_cfg")
# repeats: only when > 1; compile: only when true or "graphs"; serving: only for serving.batching=continuous or a chunked
# prefill (prefill_chunk); backend, its version
# and vllm_cfg: only for backend=vllm (a record without them is our engine's)
# Values renamed since a record was written, read as today's so that old records still pair
# (the native kernel path was called avx2 before it gained AVX-512 tiles).
RENAMED = {"kernel": {"avx2": "native"}}
# ... and, for an AR record of another sweep (ar_baseline=any), the same machine and code.
ENV_KEYS = ("device_name", "host", "git_sha", "torch", "transformers")


# What a job's decisions read (pairing with AR, resume): a record without its metrics and requests.
# The records file embeds every output token, so a long sweep whose every job parsed the whole file
# grew quadratically; an index beside it (``<records>.idx``: one line a record, its byte span and
# these fields) is read instead, and the one record a job pairs with is read at its offset.
HEAVY = ("metrics", "requests")


def _index_path(p: Path) -> Path:
    return p.with_name(p.name + ".idx")


def _light(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in HEAVY}


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
        off = f.seek(0, os.SEEK_END) + (1 if line.startswith("\n") else 0)
        data = (line + "\n").encode()
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        light = json.loads(json.dumps(_light(record), default=str))  # as a reader would parse it back
        try:  # under the same lock: the index covers the file up to here (else the next reader mends it)
            if _index_end(p) == max(0, off - 1):  # the index reaches this line: one entry more
                _write_index(p, [_entry(off, data.strip(b"\n"), light)])
            else:  # lines it lacks before this one (a torn line, a crash between record and entry)
                _index_locked(p, f, report=False)
        except OSError:
            pass


def _index_end(p: Path) -> int | None:
    """Where the index's last entry ends in the records file (0: an empty index), read from the
    index's tail; None where it cannot tell."""
    ip = _index_path(p)
    try:
        with ip.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            if end == 0:
                return 0
            chunk = 4096
            while True:
                f.seek(max(0, end - chunk))
                tail = f.read().rstrip(b"\n")
                if b"\n" in tail or chunk >= end:
                    e = json.loads(tail.rsplit(b"\n", 1)[-1])
                    return e["off"] + e["len"]
                chunk *= 4
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, KeyError, TypeError):
        return None


HEAD = 256  # bytes of a record line an index entry fingerprints (read back to check the entry)


def _fingerprint(head: bytes) -> str:
    return hashlib.sha1(head[:HEAD]).hexdigest()[:12]


def _entry(off: int, line: bytes, rec) -> dict:
    """An index line: where the record is, a fingerprint of its start, and its light fields."""
    return {"off": off, "len": len(line), "head": _fingerprint(line),
            **({"rec": _light(rec)} if isinstance(rec, dict) else {})}


def _write_index(p: Path, entries: list[dict]) -> None:
    with _index_path(p).open("ab+") as f:
        f.seek(0, os.SEEK_END)
        lead = b""
        if f.tell() > 0:  # a line cut by a crash must not swallow the next entry
            f.seek(-1, os.SEEK_END)
            lead = b"" if f.read(1) == b"\n" else b"\n"
        f.write(lead + "".join(json.dumps(e) + "\n" for e in entries).encode())


class Skipped(list):
    """Lines of a records file that could not be read, as (file, where: "line N" or "byte N", reason)."""

    def report(self, what: str = "records") -> None:
        if not self:
            return
        by_file: dict = {}
        for f, n, why in self:
            by_file.setdefault(f, []).append((n, why))
        for f, lines in by_file.items():
            where = ", ".join(str(n) for n, _ in lines[:5]) + (", ..." if len(lines) > 5 else "")
            print(f"specbench: warning: {f}: {len(lines)} {what} line(s) could not be read and were skipped "
                  f"({where}: {lines[0][1]})", file=sys.stderr, flush=True)


def parse_line(line: bytes | str, skipped: Skipped, f, where: str) -> dict | None:
    """The JSON object on ``line``; None (and an entry in ``skipped``) for anything else: a line
    cut by a crash, ``null``, a list."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        skipped.append((str(f), where, f"not JSON ({str(e).split(':')[0]})"))
        return None
    if not isinstance(obj, dict):
        what = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}.get(type(obj), "a number")
        skipped.append((str(f), where, f"{what}, not a record"))
        return None
    return obj


def parse_lines(f: Path, skipped: Skipped) -> list[dict]:
    """The JSON objects of a JSON-lines file (``.jsonl``, or gzipped ``.jsonl.gz``), one per line (``parse_line``)."""
    out = []
    with (gzip.open(f, "rb") if f.suffix == ".gz" else f.open("rb")) as fh:  # a kept baseline may be gzipped
        for n, raw in enumerate(fh, 1):
            line = raw.strip()
            if line:
                obj = parse_line(line, skipped, f, f"line {n}")
                if obj is not None:
                    out.append(obj)
    return out


def _files(p: Path) -> list[Path]:
    return sorted([*p.rglob("records*.jsonl"), *p.rglob("records*.jsonl.gz")]) if p.is_dir() else [p]


def read(path: str | Path, report: bool = True) -> list[dict]:
    """Every record of a file (or of every records*.jsonl under a folder). A line that is not a
    record (cut by a crash, hand-edited) is skipped, and how many and where is printed."""
    skipped, out = Skipped(), []
    for f in _files(Path(path)):
        if f.exists():
            out += parse_lines(f, skipped)
    if report:
        skipped.report()
    return out


def index(path: str | Path) -> list[dict]:
    """Every record of the file without its metrics and requests (``HEAVY``), each with ``_at``
    (its byte span, for ``load``), from the index beside the file. The index is checked against
    the file (its first and last entry point at those records) and mended from the file where it
    falls short: written by another version, cut by a crash, or the file replaced."""
    p = Path(path)
    if not p.exists():
        return []
    with p.open("rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # no append half done while reading, and one reader mending the index
        try:
            return _index_locked(p, f)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _index_locked(p: Path, f, report: bool = True) -> list[dict]:
    size = os.fstat(f.fileno()).st_size
    ip = _index_path(p)
    torn = Skipped()
    entries = parse_lines(ip, torn) if ip.exists() else []
    ok = not torn and all(isinstance(e.get("off"), int) and isinstance(e.get("len"), int) and isinstance(e.get("head"), str)
             and (isinstance(e.get("rec"), dict) or "skip" in e) for e in entries)
    # each entry must be where it says: the first and last are checked against the file's bytes
    # (cheap: their first HEAD bytes), so a replaced or rewritten file is indexed anew
    if ok and entries:
        ok = entries[-1]["off"] + entries[-1]["len"] <= size and \
            all(_head_at(f, e["off"], e["len"]) == e["head"] for e in (entries[0], entries[-1]))
    if not ok:
        entries = []
    covered = entries[-1]["off"] + entries[-1]["len"] if entries else 0
    if covered < size:  # lines the index lacks: parse them once, and keep them
        f.seek(covered)
        new, off = [], covered
        skipped = Skipped()
        for raw in f.read().split(b"\n"):
            line = raw.strip()
            if line:
                at = off + raw.index(line[:1])
                got = parse_line(line, skipped, p, f"byte {at}")
                new.append({**_entry(at, line, got), **({} if got is not None else {"skip": skipped[-1][2]})})
            off += len(raw) + 1
        try:
            if not ok and ip.exists():
                ip.unlink()
            _write_index(p, new)
        except OSError:
            pass
        entries += new
    # damaged lines stay in the index as such: reported at every read, never parsed again
    if report:
        Skipped((str(p), f"byte {e['off']}", e["skip"]) for e in entries if "skip" in e).report()
    return [{**e["rec"], "_at": [e["off"], e["len"]]} for e in entries if "rec" in e]


def _head_at(f, off: int, n: int) -> str:
    f.seek(off)
    return _fingerprint(f.read(min(n, HEAD)))


def _at(f, off: int, n: int) -> dict:
    f.seek(off)
    try:
        obj = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def load(path: str | Path, entry: dict) -> dict:
    """The whole record an ``index`` entry stands for."""
    if "_at" not in entry:  # a whole record already
        return entry
    with Path(path).open("rb") as f:
        rec = _at(f, *entry["_at"])
    if rec.get("job_id") != entry.get("job_id"):
        raise RuntimeError(f"{path} changed while it was read (record {entry.get('job_id')} moved); rerun")
    return rec


def current(rec: dict, k: str):
    """Field ``k`` of ``rec`` under today's name for its value (``RENAMED``)."""
    v = rec.get(k)
    return RENAMED[k].get(v, v) if k in RENAMED and isinstance(v, str) else v


def nodes(metrics: dict) -> tuple:
    """(``forward_nodes``, ``valid_nodes``): the verify width per row per step (padding included) and
    each row's own nodes. Records before ``valid_nodes`` kept the latter as ``forward_nodes``: (None, it)."""
    if "valid_nodes" in metrics:
        return metrics.get("forward_nodes"), metrics["valid_nodes"]
    return None, metrics.get("forward_nodes")


def baseline_key(rec: dict) -> tuple:
    return tuple(json.dumps(current(rec, k), sort_keys=True) for k in BASELINE_KEYS)


def env_key(rec: dict) -> tuple:
    env = rec.get("env") or {}
    return tuple(env.get(k) for k in ENV_KEYS)


# A job is the same job when these match too (with the same machine and code).
JOB_KEYS = BASELINE_KEYS + ("method", "K", "draft", "method_opts", "K_auto",  # K_auto: only when K=auto (true, or tune.cost)
                             "accept")  # accept: only for accept=synthetic


def job_key(rec: dict) -> tuple:
    return tuple(json.dumps(current(rec, k), sort_keys=True) for k in JOB_KEYS)


# A speedup above the mean accepted length tau is not a result: each step emits tau tokens on
# average and costs at least one target forward (free drafts, a verify no dearer than an AR step:
# docs/design.md section 5), so it reads tau at most. Beyond this margin its AR baseline ran slow.
ABOVE_BOUND = 1.02


def above_bound(rec: dict) -> str | None:
    """Why ``rec``'s speedup cannot be trusted, in words, when it exceeds its bound (tau); None
    otherwise."""
    m = rec.get("metrics") or {}
    s, tau = m.get("speedup"), m.get("tau")
    if rec.get("method") == "ar" or s is None or tau is None or s <= tau * ABOVE_BOUND:
        return None
    how = ("the AR run beside it was slowed (rerun it on a quiet host)" if rec.get("paired_with") else
           "AR baseline slowed? rerun paired (ar_baseline=paired)")
    return f"speedup {s:.2f}x is above its bound tau={tau:.2f}: {how}"


def ar_paired(rec: dict) -> bool | None:
    """Whether a method's speedup stands on an AR run beside it, batch by batch (``ar_baseline=paired``);
    False for one taken from an AR job run apart (``sweep``, ``any``: host drift between the two moves
    it); None where there is no speedup against AR (AR itself, a failed job). Records written before
    the field (``ar_paired``) say it through ``paired_with``."""
    if rec.get("method") == "ar" or (rec.get("metrics") or {}).get("speedup") is None:
        return None
    return bool(rec.get("ar_paired", rec.get("paired_with")))


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
    """The code of this checkout (``code_state`` of the repository), once per process; an install
    run from a checkout elsewhere (the GPU check's) is told it in ``SPECBENCH_CODE_STATE``."""
    return os.environ.get("SPECBENCH_CODE_STATE") or code_state(REPO)


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
