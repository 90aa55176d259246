"""The vLLM side of ``backend=vllm``: one vLLM engine in vLLM's own environment (``make setup-vllm``),
driven by ``specbench.engines.vllm.engine`` over JSON lines. It imports only the standard library and vLLM,
so it runs under that environment's Python without specbench installed:

    .venv-vllm/bin/python specbench/engines/vllm/worker.py

Messages in (one JSON object a line on stdin):
    {"op": "start", "engine": {LLM keyword arguments}}                  -> {"ok": true, "version", "load_s", "resolved"}
    {"op": "begin", "sampling": {SamplingParams arguments}, "requests": [{"id": str, "prompt": [token ids], "at": s}],
     "more": bool}                                                      a stream starts (its clock too): requests
                                                                        arriving ``at`` s after it; more: others follow
    {"op": "add", "id", "prompt", "at"}                                 one more (a next turn); only while more
    {"op": "none"}                                                      no next turn for the request just done
    {"op": "end"}                                                       no more will be added to this stream
    {"op": "quit"}
Messages out (stdout): a "done" object per finished request as it finishes (its tokens, the new tokens
of every engine step that gave it any, its arrival, admission, first-token and finish times), then at
the stream's end {"op": "stream", "wall_s", "trace", "counters"}: the steps' durations, rows and tokens,
and vLLM's speculative-decoding counters over the stream. An error is {"op": "error", "error": line}.

Times are the client's (this process's ``perf_counter``, from ``begin``), as our engine's are. While
``more``, the host answers every "done" with "add", "none" or "end", and the worker waits for that
answer. With no other request in flight the wait is off the clock: the host's work between turns
(decoding, rendering the next prompt) counts in no wall, queue or TTFT, as our engine leaves its
caller's ``on_done`` out of its clock. With others in flight it stays on it: vLLM's engine core
(a process of its own by default) goes on decoding them meanwhile. One rule for every engine (the
harness's time is off the clock wherever the engine stops for it): ``specbench/run/workload.py``.
vLLM's own log goes to stderr: stdout carries only these messages.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters (summed over label sets): a number, or a list per position."""
    out: dict = {}
    for m in llm.get_metrics():
        if m.name not in COUNTERS:
            continue
        if hasattr(m, "values"):
            prev = out.get(m.name) or []
            vals = list(m.values)
            out[m.name] = [a + b for a, b in zip(vals + [0] * (len(prev) - len(vals)),
                                                 prev + [0] * (len(vals) - len(prev)))]
        else:
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        b = before.get(k)
        if isinstance(v, list):
            b = b or []
            out[k] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(v)]
        else:
            out[k] = v - (b or 0)
    return out


class Worker:
    def __init__(self, send):
        self.send = send
        self.llm = None
        self.rows = 1  # requests in flight at most (the scheduler's max_num_seqs: the job's bs)

    def start(self, engine: dict) -> None:
        import vllm
        from vllm import LLM

        t = time.perf_counter()
        self.llm = LLM(**engine)
        load_s = time.perf_counter() - t
        c = self.llm.llm_engine.vllm_config
        sched, cache, spec = c.scheduler_config, c.cache_config, c.speculative_config
        self.rows = int(sched.max_num_seqs)
        resolved = {
            "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "chunked_prefill": bool(getattr(sched, "enable_chunked_prefill", False)),
            "async_scheduling": bool(getattr(sched, "async_scheduling", False)),
            "block_size": cache.block_size, "max_model_len": c.model_config.max_model_len,
            "dtype": str(c.model_config.dtype).replace("torch.", ""),
            "enforce_eager": bool(c.model_config.enforce_eager),
            "compilation_mode": str(getattr(c.compilation_config, "mode", getattr(c.compilation_config, "level", None))),
            "prefix_caching": bool(getattr(cache, "enable_prefix_caching", False)),
        }
        if spec is not None:
            resolved["speculative"] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
                                       **({"prompt_lookup_min": spec.prompt_lookup_min,
                                           "prompt_lookup_max": spec.prompt_lookup_max} if spec.method == "ngram"
                                          else {"draft_model": getattr(spec, "model", None)})}
        self.send({"op": "started", "ok": True, "version": vllm.__version__, "load_s": load_s, "resolved": resolved})

    def stream(self, sampling: dict, requests: list[dict], more: bool, read) -> None:
        """Serve one stream: requests join as they arrive, at most ``max_num_seqs`` in flight, until
        ``end`` is read and every request has finished. A request is handed to vLLM when it has
        arrived and a row is free, as our engine admits one: its ``admit_s`` is when it stopped
        waiting for a row (vLLM's scheduler would queue it unseen, after a hand-off at arrival)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**sampling, output_kind=RequestOutputKind.DELTA, detokenize=False)
        eng = self.llm.llm_engine
        before = counters(self.llm)
        t0 = time.perf_counter()
        paused = 0.0  # seconds spent waiting for the host's answer to a "done" (off the clock)

        def clock() -> float:
            return time.perf_counter() - t0 - paused
        pending = sorted(requests, key=lambda m: m["at"])  # added, not yet arrived
        live: dict[str, dict] = {}
        ended = not more
        trace = []  # (step seconds, requests that got tokens, tokens)
        last = 0.0  # on the clock

        def take(msg) -> None:
            nonlocal ended
            if msg["op"] == "add":
                pending.append(msg)
                pending.sort(key=lambda m: m["at"])
            elif msg["op"] == "end":
                ended = True
            elif msg["op"] != "none":
                raise ValueError(f"unexpected message {msg['op']!r} inside a stream")

        while True:
            now = clock()
            while pending and pending[0]["at"] <= now and len(live) < self.rows:  # arrived, and a row is free
                m = pending.pop(0)
                params_i = params.clone() if hasattr(params, "clone") else params
                eng.add_request(m["id"], {"prompt_token_ids": m["prompt"]}, params_i)
                live[m["id"]] = {"id": m["id"], "arrival_s": m["at"], "admit_s": now, "steps": [], "tokens": [],
                                 "first_s": None, "chunks": []}
            if not live:
                if ended and not pending:
                    break
                # idle: wait for the next arrival or message
                wait = None if not pending else max(0.0, pending[0]["at"] - now)
                msg = read(wait)
                if msg is not None:
                    take(msg)
                last = clock()
                continue
            outs = eng.step()
            t = clock()
            rows = toks = 0
            for o in outs:
                new = list(o.outputs[0].token_ids) if o.outputs else []
                r = live.get(o.request_id)
                if r is None:
                    continue
                if new:
                    rows += 1
                    toks += len(new)
                    r["tokens"].extend(new)
                    r["steps"].append(len(new))
                    r["chunks"].append(t)
                    if r["first_s"] is None:
                        r["first_s"] = t
                if o.finished:
                    r["done_s"] = t
                    r["finish_reason"] = o.outputs[0].finish_reason if o.outputs else None
                    self.send({"op": "done", **live.pop(o.request_id)})
                    if more and not ended:  # the host's answer (its next turn, or none)
                        p0 = time.perf_counter()
                        take(read(None))
                        if not live:  # nothing else to decode meanwhile: off the clock, as on our engine
                            paused += time.perf_counter() - p0
            if rows:
                trace.append((t - last, rows, toks))
            last = t
        wall = clock()
        self.send({"op": "stream", "wall_s": wall, "trace": trace, "counters": delta(counters(self.llm), before)})


def main() -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # our messages; everything else printed goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    fd = inp.fileno()
    buf = b""

    def send(obj) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    def read(timeout):
        """The next message, waiting up to ``timeout`` s (None: until one comes); None when none came."""
        nonlocal buf
        while b"\n" not in buf:
            r, _, _ = select.select([fd], [], [], timeout)
            if not r:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise EOFError("the host closed the pipe")
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        return json.loads(line)

    w = Worker(send)
    while True:
        try:
            msg = read(None)
        except EOFError:
            return 0
        try:
            if msg["op"] == "start":
                w.start(msg["engine"])
            elif msg["op"] == "begin":
                w.stream(msg["sampling"], msg["requests"], bool(msg.get("more")), read)
            elif msg["op"] == "quit":
                return 0
            else:
                raise ValueError(f"unknown message {msg['op']!r}")
        except EOFError:
            return 0
        except Exception as e:  # noqa: BLE001 - reported to the host in one line, with the traceback on stderr
            traceback.print_exc(file=sys.stderr)
            lines = str(e).strip().splitlines()
            send({"op": "error", "error": f"{type(e).__name__}: {lines[-1] if lines else ''}"[:800]})


if __name__ == "__main__":
    sys.exit(main())
