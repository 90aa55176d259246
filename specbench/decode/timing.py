"""Phase timers: CUDA events on a GPU (read once, at the end), perf_counter on the CPU."""

from __future__ import annotations

import functools
import inspect
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
        self._depth = 0  # calls into watched models now running (one within another: > 1)
        self._start = None  # when the outermost one began
        self._handles: list = []  # hooks on watched modules
        self._wrapped: list = []  # (object, method name) wrapped on watched modules
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

    # Model forward time (``time_s.forward``, for the engine-overhead figure): every outermost call
    # into a watched model, whatever its entry, is timed once.
    @property
    def charging(self) -> bool:
        """Whether a model forward is being timed now (a call into a watched model is running)."""
        return self._depth > 0

    @contextmanager
    def watching(self, modules):
        """Time the calls into these models for the block; hooks and wrappers removed however it ends."""
        try:
            for m in modules:
                self.watch(m)
            yield self
        finally:
            self.unwatch()

    def watch(self, module: torch.nn.Module) -> None:
        """Time every call into ``module`` as model forward time, whatever its entry: its ``forward``
        (a hook), and the methods of its own classes and its submodules' (wrapped: a drafter entered
        through ``block``, ``logits``, ``step`` or ``run``, the target's modules it borrows called from
        there). Library classes (torch's, transformers') are entered through ``forward`` and get no
        wrappers, so a target costs one hook and nothing inside its (maybe compiled) forward changes.
        Only the outermost call is timed: calls within it are not counted again. A module watched
        twice (a draft that is the target itself) is timed once."""
        if any(m is module for m in self._watched):
            return
        self._watched.append(module)
        self._handles.append(module.register_forward_pre_hook(lambda _m, _a: self._enter()))
        self._handles.append(module.register_forward_hook(lambda _m, _a, _o: self._leave(), always_call=True))
        for m in module.modules():
            for name in _own_methods(type(m)):
                if name not in vars(m):  # not wrapped already (a submodule of two watched models)
                    self._wrap(m, name)

    @contextmanager
    def charge(self):
        """Time the block as model forward time (a forward entered other than through the model: a
        replayed graph)."""
        self._enter()
        try:
            yield
        finally:
            self._leave()

    @contextmanager
    def bare(self):
        """The watched models' own methods unwrapped for the block: a graph traced or captured from
        them (``decode.captured``) holds no timer call, and is timed whole by ``charge``."""
        saved = [(obj, name, vars(obj).pop(name)) for obj, name in self._wrapped if name in vars(obj)]
        try:
            yield
        finally:
            for obj, name, fn in saved:
                vars(obj)[name] = fn

    def _enter(self) -> None:
        if self._depth == 0:
            if self.cuda:
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            else:
                self._start = time.perf_counter()
        self._depth += 1

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            if self.cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self._events.append(("forward", self._start, e))
            else:
                self._cpu["forward"] += time.perf_counter() - self._start

    def _wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._enter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._leave()

        vars(obj)[name] = timed
        self._wrapped.append((obj, name))

    def unwatch(self) -> None:
        for h in self._handles:
            h.remove()
        for obj, name in self._wrapped:
            vars(obj).pop(name, None)
        self._handles.clear()
        self._wrapped.clear()
        self._watched.clear()

    def totals(self) -> dict[str, float]:
        """Seconds per phase (plus 'forward'); synchronises the GPU once."""
        out = defaultdict(float, self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for name, s, e in self._events:
                out[name] += s.elapsed_time(e) / 1000.0
        return dict(out)


@functools.cache
def _own_methods(cls) -> tuple[str, ...]:
    """The public methods a class of ours defines (on it or a base of ours below ``nn.Module``):
    the entries a drafter is called through besides ``forward``."""
    names = set()
    for c in cls.__mro__:
        if c is torch.nn.Module or not issubclass(c, torch.nn.Module) or c.__module__.startswith(_LIBRARIES):
            continue
        names |= {n for n, v in vars(c).items() if inspect.isfunction(v) and not n.startswith("_")
                  and not hasattr(torch.nn.Module, n)}
    return tuple(sorted(names))


_LIBRARIES = ("torch.", "transformers.")  # their modules are entered through forward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
