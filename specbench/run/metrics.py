"""The metrics of a record, each convention stated once (docs/records.md lists the fields).

- A **step** is one decoding step of one row (a row-step): a verify forward over a batch of B rows
  is B steps. The prefill's token is not a step.
- **tau** (mean accepted length, tokens a step) = 1 + accepted drafts / steps: every step emits its
  accepted drafts and one token of the target's own (AR: tau = 1). ``tau_per_request`` is each
  request's own tau averaged over requests, so short requests weigh as much as long ones.
- **alpha_i** (``accept_rate_per_pos``) is the share of steps whose accepted length reached draft
  position i (marginal: vLLM's per-position rate, accepted tokens at i over drafts, is this form
  over its drafted steps); ``accept_rate_per_pos_cond`` is alpha_i / alpha_{i-1}, accepted at i
  among the steps that accepted i-1 (the conditional rate of EAGLE's n-alpha). Both count over
  every step, also those whose draft did not reach depth i.
- **Phases** (``time_s``): prefill, draft, verify, accept as the timer measured them, ``other`` the
  rest of the wall; ``forward`` the time inside model forwards (it overlaps the phases).
  ``verify_share`` = verify / wall; ``engine_overhead`` = (wall - forward) / wall.
- **Latency** is counted from a request's arrival: TTFT to its first token, TPOT per output token
  after it, ITL between its successive steps' outputs (a step emits its accepted tokens at once),
  E2E to its last token; each as ``{mean, p50, p90, p99, n}`` (nearest rank).
- **Goodput**: requests per second whose TTFT and TPOT stay within the SLO.
- **In flight**: requests in flight, time-weighted (``in_flight``).
- **Acceptance by part** (``acceptance_by``): tau and alpha_i as above over the steps of one
  category, one turn, or (for a model that thinks) the steps that began inside or outside its
  thinking span. A step belongs to the span it began in: the state after the prompt and the tokens
  emitted before it (the prefill's token first), a span opening at ``thinking.open`` (in the
  output, or in the prompt where a chat template opens it for the model) and closing at
  ``thinking.close`` (the step that emits the close is inside).
"""

from __future__ import annotations

import math
from collections import Counter

from specbench.decode.timing import PHASES


def acceptance(lens: list[int], K: int, requests: list[dict], draft_nodes: int = 0, forward_nodes: int = 0,
               valid_nodes: int = 0) -> dict:
    """From every step's accepted draft count (``lens``) and the requests (``accepted``, ``steps``):
    steps, tau, the acceptance per position (marginal and conditional), tau per request, the
    histogram of accepted lengths (0..max(K, longest)), and per step the candidate nodes drafted,
    the nodes the verify forward ran and the row's own among them."""
    steps = len(lens)
    depth = max([K] + lens)
    hist = Counter(lens)
    alphas = [sum(1 for x in lens if x >= i) / steps for i in range(1, depth + 1)] if steps else []
    taus = [1.0 + rq["accepted"] / rq["steps"] for rq in requests if rq["steps"]]
    return {
        "steps": steps,
        "tau": 1.0 + sum(lens) / steps if steps else 1.0,
        "draft_nodes": draft_nodes / steps if steps else 0.0,  # candidates verified per row per step
        # the verify forward's width n of [B, n + 1] per row per step: every row runs the widest row's
        # draft (padding), and non-candidate nodes (Lookahead's window) too; what its cost is priced at
        "forward_nodes": forward_nodes / steps if steps else 0.0,
        "valid_nodes": valid_nodes / steps if steps else 0.0,  # of those, the row's own draft nodes
        "accept_rate_per_pos": alphas,
        "accept_rate_per_pos_cond": conditional(alphas),
        "tau_per_request": sum(taus) / len(taus) if taus else None,
        "accept_len_hist": [hist.get(i, 0) for i in range(depth + 1)],
    }


def conditional(alphas: list[float]) -> list[float | None]:
    """The conditional rates alpha_i / alpha_{i-1} of marginal ones (None past a position no step reached)."""
    return [a / p if p > 0 else None for a, p in zip(alphas, [1.0] + alphas[:-1])]


def phases(times: dict, wall: float) -> dict:
    """The time by phase (``other``: the wall the phases leave), the verify share and the share
    of the wall outside model forwards."""
    time_s = {p: times.get(p, 0.0) for p in PHASES}
    time_s["other"] = max(0.0, wall - sum(time_s.values()))
    time_s["forward"] = times.get("forward", 0.0)
    return {"time_s": time_s,
            "verify_share": time_s["verify"] / wall if wall > 0 else None,
            "engine_overhead": (wall - time_s["forward"]) / wall if wall > 0 else None}


def latency(requests: list[dict], itls: list[float], wall: float) -> dict:
    """Mean TTFT and TPOT over requests, their percentiles with ITL's and E2E's, requests per second."""
    ttfts = [rq["ttft_s"] for rq in requests]
    tpots = [rq["tpot_s"] for rq in requests if rq["tpot_s"] is not None]
    return {
        "ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "tpot_s": sum(tpots) / len(tpots) if tpots else None,
        "latency": {"ttft_s": percentiles(ttfts), "tpot_s": percentiles(tpots), "itl_s": percentiles(itls),
                    "e2e_s": percentiles([rq["wall_s"] for rq in requests])},
        "requests_per_s": len(requests) / wall if wall > 0 else None,
    }


DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def encode_accepts(lens: list[int]) -> str:
    """Per-step accepted draft counts, one base-36 digit a step."""
    return "".join(DIGITS[min(x, 35)] for x in lens)


def decode_accepts(s: str) -> list[int]:
    """``encode_accepts`` undone (a count over 35 reads 35)."""
    return [int(c, 36) for c in s or ""]


def thinking_tags(tokenizer, tcfg) -> tuple[set, set] | None:
    """``thinking.open`` / ``thinking.close`` as token ids: (open ids, close ids), each a token of the
    tokenizer's own vocabulary (an added token such as Qwen3's or DeepSeek-R1's ``<think>``); None,
    no split, when the tokenizer has neither as one token or both are null (a tag spelt over several
    tokens is not matched: its pieces merge differently in context)."""
    if not tcfg or tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    vocab = tokenizer.get_vocab()
    tags = tuple({vocab[t]} if isinstance(t, str) and t in vocab else set()
                 for t in (tcfg.get("open"), tcfg.get("close")))
    return tags if any(tags) else None


def thinking_steps(prompt: list[int], tokens: list[int], lens: list[int], tags: tuple[set, set]) -> list[list[int]]:
    """The decoding steps that began inside a thinking span, as [first, end) step ranges (module
    docstring). ``tokens``: the request's output (its first token is the prefill's, not a step's);
    ``lens``: accepted drafts per step (a step emits them and one token of its own)."""
    opens, closes = tags
    inside = False

    def scan(toks):
        nonlocal inside
        for t in toks:
            if t in opens:
                inside = True
            elif t in closes:
                inside = False

    scan(prompt)
    scan(tokens[:1])
    spans, pos = [], 1
    for s, n in enumerate(lens):
        if inside:
            if spans and spans[-1][1] == s:
                spans[-1][1] = s + 1
            else:
                spans.append([s, s + 1])
        scan(tokens[pos:pos + n + 1])
        pos += n + 1
    return spans


def acceptance_by(requests: list[dict], K: int) -> dict:
    """tau and alpha_i per category, per turn and, where the requests carry ``thinking_steps``,
    inside and outside the thinking span: ``{"category": {name: part}, "turn": {"1": part, ...},
    "thinking": {"inside": part, "outside": part}}``, each part ``{steps, tau, accept_rate_per_pos}``
    (positions up to the job's deepest, so parts line up), from each request's ``accepts``; {} when
    the requests lack them."""
    per = [(rq, decode_accepts(rq["accepts"])) for rq in requests if isinstance(rq.get("accepts"), str)]
    if not per:
        return {}
    depth = max([K or 0] + [x for _, ls in per for x in ls])

    def part(lens):
        n = len(lens)
        return {"steps": n, "tau": 1.0 + sum(lens) / n if n else None,
                "accept_rate_per_pos": [sum(1 for x in lens if x >= i) / n for i in range(1, depth + 1)] if n else []}

    out = {}
    for key in ("category", "turn"):
        groups: dict = {}
        for rq, ls in per:
            groups.setdefault(str(rq.get(key)), []).extend(ls)
        out[key] = {k: part(v) for k, v in groups.items()}
    if any("thinking_steps" in rq for rq, _ in per):
        inside, outside = [], []
        for rq, ls in per:
            mark = {s for a, b in rq.get("thinking_steps") or [] for s in range(a, b)}
            for s, x in enumerate(ls):
                (inside if s in mark else outside).append(x)
        out["thinking"] = {"inside": part(inside), "outside": part(outside)}
    return out


def percentiles(xs: list[float]) -> dict | None:
    """Mean and p50 / p90 / p99 (nearest rank) of ``xs``; None when empty."""
    if not xs:
        return None
    v = sorted(xs)

    def at(p):
        return v[min(len(v) - 1, max(0, math.ceil(p / 100 * len(v)) - 1))]

    return {"mean": sum(v) / len(v), "p50": at(50), "p90": at(90), "p99": at(99), "n": len(v)}


def goodput(ttft, tpot, requests: list[dict], wall: float) -> dict | None:
    """Requests per second that met the SLO (``ttft``, ``tpot``: serving.slo.ttft_ms, .tpot_ms;
    None = no bound), and their share; None when no bound is set."""
    if ttft is None and tpot is None:
        return None

    def ok(rq):
        return (ttft is None or rq["ttft_s"] * 1e3 <= ttft) and \
            (tpot is None or rq["tpot_s"] is None or rq["tpot_s"] * 1e3 <= tpot)

    good = sum(1 for rq in requests if ok(rq))
    return {"slo": {"ttft_ms": ttft, "tpot_ms": tpot}, "requests_per_s": good / wall if wall > 0 else None,
            "share": good / len(requests) if requests else None}


def in_flight(trace: list[tuple[float, int, int]], cap: int, streams=None) -> dict | None:
    """Requests in flight (docs/records.md): the time-weighted mean and the time share at each count
    (1..cap), and output tokens/s over the steps run at the cap (the steady part: a static batch's
    drain, a stream's ramp-up and tail left out). A serving job (``streams``: each stream's wall time
    and its requests' (admitted, done) seconds, as both backends record them) counts over the whole
    wall, idle time as 0 in flight; a static batch over its decoding steps."""
    total = sum(dt for dt, _, _ in trace)
    if not trace or total <= 0:
        return None
    share = [0.0] * (cap + 1)
    if streams:
        wall = sum(w for w, _ in streams)
        if wall <= 0:
            return None
        for w, spans in streams:  # a sweep over admissions (+1) and completions (-1)
            events = sorted([(a, 1) for a, _ in spans] + [(d, -1) for _, d in spans], key=lambda e: (e[0], e[1]))
            now, level = 0.0, 0
            for t, step in events:
                t = min(max(t, 0.0), w)
                share[min(level, cap)] += (t - now) / wall
                now, level = t, level + step
            share[min(max(level, 0), cap)] += (w - now) / wall
        mean = sum(k * s for k, s in enumerate(share))
    else:
        for dt, rows, _ in trace:
            share[min(rows, cap)] += dt / total
        mean = sum(dt * rows for dt, rows, _ in trace) / total
    full = [(dt, n) for dt, rows, n in trace if rows >= cap]
    t_full = sum(dt for dt, _ in full)
    return {"mean": mean, "time_share": share[1:],
            "steady_tokens_per_s": sum(n for _, n in full) / t_full if t_full > 0 else None,
            "steady_time_share": t_full / total}
