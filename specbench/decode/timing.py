"""Phase timers: CUDA events on a GPU (read once, at the end), perf_counter on the CPU."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

PHASES = ("prefill", "draft", "verify", "accept")


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cpu = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []
        self._hook_start: list = []
        self._handles: list = []
        self._watched: list = []

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            s.record()
            try:
                yield
            finally:
                e.record()
                self._events.append((name, s, e))
        else:
            t = time.perf_counter()
            try:
                yield
            finally:
                self._cpu[name] += time.perf_counter() - t

    # Model forward time (for the engine-overhead figure) through module hooks.
    @contextmanager
    def watching(self, modules):
        """Hooks on these modules for the block, removed however it ends."""
        try:
            for m in modules:
                self.watch(m)
            yield self
        finally:
            self.unwatch()

    def watch(self, module: torch.nn.Module) -> None:
        """Count ``module``'s forward time (once: a module watched twice, e.g. a draft that
        is the target itself, is not counted twice)."""
        if any(m is module for m in self._watched):
            return
        self._watched.append(module)
        def pre(_m, _a):
            if self.cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                self._hook_start.append(ev)
            else:
                self._hook_start.append(time.perf_counter())

        def post(_m, _a, _o):
            s = self._hook_start.pop()
            if self.cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self._events.append(("forward", s, e))
            else:
                self._cpu["forward"] += time.perf_counter() - s

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._watched.clear()

    def totals(self) -> dict[str, float]:
        """Seconds per phase (plus 'forward'); synchronises the GPU once."""
        out = defaultdict(float, self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for name, s, e in self._events:
                out[name] += s.elapsed_time(e) / 1000.0
        return dict(out)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
