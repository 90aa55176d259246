"""What ``Engine.serve`` takes: requests (a key, a prompt, an arrival time), FIFO by arrival."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass


@dataclass
class Request:
    key: object  # the caller's name for it
    prompt: list[int]
    arrival: float = 0.0  # seconds after the engine's start


class Requests:
    """The requests ``Engine.serve`` takes from, FIFO by arrival. ``add`` may be called while it
    serves (a follow-up turn once its first turn is answered)."""

    def __init__(self, requests=()):
        self.q = deque(sorted(requests, key=lambda r: r.arrival))

    def add(self, request: Request) -> None:
        """Queue ``request`` in arrival order (after those due at the same time)."""
        bisect.insort_right(self.q, request, key=lambda r: r.arrival)

    def take(self, k: int, now: float) -> list[Request]:
        out = []
        while self.q and len(out) < k and self.q[0].arrival <= now:
            out.append(self.q.popleft())
        return out

    def next_arrival(self) -> float | None:
        return self.q[0].arrival if self.q else None
