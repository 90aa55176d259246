"""Trace-driven simulator (after SpecDecode-Bench, arXiv 2601.11580).

From the per-step accepted lengths a job logged (``requests[*].accepts``) and a cost model
(the target's cost curve T(b, n) and the method's measured draft time per drafted token),
it replays decoding under three policies and returns each one's speedup over AR, T(b, 1)
per token:

- fixed-K: what the method did — K drafts every step: cost K d + T(b, K+1), gain a+1;
- oracle-K: propose exactly as many tokens as will be accepted (no wasted verification):
  cost a d + T(b, a+1);
- combined oracle: under greedy decoding every method emits the same tokens, so steps
  line up by output position; at each position take the best method that logged a step
  starting there (or one AR step), by dynamic programming over positions. Steps are only
  observed where a method's own trajectory put them, so this is a lower bound on the
  true per-step oracle.

At batch size b > 1 every row is charged T(b, n) for its own n, an approximation (the real
batch pays for its widest row).
"""

from __future__ import annotations

from collections.abc import Callable

DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def decode_accepts(s: str) -> list[int]:
    return [DIGITS.index(ch) for ch in s]


def fixed_k(steps: list[int], K: int, d: float, T: Callable[[int], float]) -> tuple[int, float]:
    tokens = sum(a + 1 for a in steps)
    return tokens, len(steps) * (K * d + T(K + 1))


def oracle_k(steps: list[int], d: float, T: Callable[[int], float]) -> tuple[int, float]:
    tokens = sum(a + 1 for a in steps)
    return tokens, sum(a * d + T(a + 1) for a in steps)


def combined_oracle(traces: dict[str, list[int]], costs: dict[str, float], T: Callable[[int], float]) -> tuple[int, float]:
    """traces: method -> accepted counts per step of one request (same greedy output);
    costs: method -> draft seconds per drafted token. Returns (tokens, seconds)."""
    at: dict[int, list[tuple[str, int]]] = {}
    end = 0
    for m, steps in traces.items():
        pos = 0
        for a in steps:
            at.setdefault(pos, []).append((m, a))
            pos += a + 1
        end = max(end, pos)
    best = [0.0] * (end + 1)
    for t in range(end - 1, -1, -1):
        cand = [T(1) + best[t + 1]]  # one AR step
        for m, a in at.get(t, []):
            nxt = min(end, t + a + 1)
            cand.append(a * costs[m] + T(a + 1) + best[nxt])
        best[t] = min(cand)
    return end, best[0]


def speedup(tokens: int, seconds: float, T: Callable[[int], float]) -> float:
    return tokens * T(1) / seconds if seconds > 0 else float("nan")


def simulate_job(requests: list[dict], K: int, d: float, T: Callable[[int], float]) -> dict:
    """Fixed-K and oracle-K speedups of one job from its requests' accepted lengths."""
    steps = [a for r in requests for a in decode_accepts(r.get("accepts", ""))]
    if not steps:
        return {"fixed_k": float("nan"), "oracle_k": float("nan")}
    return {"fixed_k": speedup(*fixed_k(steps, K, d, T), T), "oracle_k": speedup(*oracle_k(steps, d, T), T)}


def simulate_combined(jobs: dict[str, tuple[list[dict], float]], T: Callable[[int], float]) -> float:
    """jobs: label -> (requests, draft seconds per token), all greedy on the same prompts."""
    by_req: dict[tuple, dict[str, list[int]]] = {}
    for label, (reqs, _) in jobs.items():
        for r in reqs:
            by_req.setdefault((r["id"], r["turn"]), {})[label] = decode_accepts(r.get("accepts", ""))
    costs = {label: d for label, (_, d) in jobs.items()}
    tok = sec = 0.0
    for traces in by_req.values():
        t, s = combined_oracle(traces, costs, T)
        tok += t
        sec += s
    return speedup(tok, sec, T) if sec else float("nan")
