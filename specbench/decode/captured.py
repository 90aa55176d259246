"""``compile=graphs``' building blocks: a function of tensors at static shapes run as one CUDA graph
(on the CPU: through ``torch.compile(fullgraph=True)``, which proves it capturable), and a drafter's
forwards run that way over buffers that stay put (``DraftGraphs``).

A drafter forward (EAGLE's step, DFlash's block, P-EAGLE's step) attends over its own cache
(``drafters.cache.DrafterCache``). Made with a pool, that cache keeps its keys and values in the
pool's buffers for the whole job, attends over its whole context width (the row's mask hides what
it does not hold) and writes a propose's own keys at fixed slots after it, so a forward's shapes
depend on the batch and the method's settings only. ``DraftGraphs.run`` pads the rows up to a
bucket (power of two) and replays the graph of those shapes, made at its first use: the untimed
warm-up meets the full batch's, ``GraphPool.warm`` makes the smaller buckets rows leaving meet, and
the pool's ``made`` counts any made later."""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils._pytree import tree_map


def bucket(n: int, cap: int | None = None) -> int:
    """The padded size of ``n``: the next power of two (at most ``cap``, where given)."""
    b = 1 << max(0, n - 1).bit_length()
    return b if cap is None else min(b, cap)


def compiled(fn, backend: str):
    """``fn`` compiled whole for the shapes it meets (a graph break is an error).

    Every graph of every pool is a specialisation of one code object (``_Graph._forward``,
    ``Captured._forward``), and dynamo by default does not guard on a module's hooks: a graph traced
    without the hidden-state tap's hooks (AR's) was replayed for a method that needs them (DFlash's,
    same shapes), which then found no states. Its calls guard on hooks (the pool's own taps stay
    put for a job; the engine's are paused), and ``forget`` drops every trace when a pool closes."""
    import torch._dynamo.config as dynamo_config

    # every bucket is a specialisation of one function: past dynamo's limit of 8 it would run the
    # rest eagerly without a word
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, 1024)
    traced = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

    def call(*args):
        with dynamo_config.patch(skip_nnmodule_hook_guards=False):
            return traced(*args)
    return call


def forget(*fns) -> None:
    """Drop every graph dynamo traced from these functions (a pool's job is over: the next job's
    pool traces its own, never one of an earlier job's)."""
    from torch._dynamo.eval_frame import reset_code

    for fn in fns:
        reset_code(fn.__code__)


def capture(run):
    """(a CUDA graph of ``run()``, its outputs): two warm runs on a side stream, then the capture
    (as torch's ``make_graphed_callables`` does). The outputs are rewritten by each replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with rows added up to ``rows`` (masks: all visible, so no padding row attends to nothing)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), t.dtype == torch.bool)])


class Captured:
    """One drafter forward at one set of shapes: ``fn(*inputs, scratch)`` over static copies of
    its inputs, with a fresh scratch per layer (``kind``: ``drafters.cache.Scratch``) at the slots
    ``spots`` [(w, at)] of the buffers ``K``, ``V`` (views of the pool's, the bucket's rows)."""

    def __init__(self, fn, inputs, K, V, spots, kind, backend: str):
        self.fn, self.spots = fn, spots
        self.scratch = lambda: [kind(k, v, w, at) for k, v, (w, at) in zip(K, V, spots)]
        self.inputs = [t.clone() for t in inputs]
        self.graph = self.out = None
        self.cuda = self.inputs[0].device.type == "cuda"
        sc = self.scratch()
        self.fn(*self.inputs, sc)  # once as written: what each layer's scratch advances by
        self.advance = [s.at - at for s, (_, at) in zip(sc, spots)]
        if not self.cuda:
            self.compiled = compiled(self._forward, backend)

    def _forward(self, *inputs):
        return self.fn(*inputs, self.scratch())

    def __call__(self, inputs):
        for s, t in zip(self.inputs, inputs):
            s.copy_(t)
        if not self.cuda:
            return self.compiled(*self.inputs)
        if self.graph is None:
            self.graph, self.out = capture(lambda: self._forward(*self.inputs))
        self.graph.replay()
        return self.out


class DraftGraphs:
    """The drafters' buffers and graphs of one ``GraphPool`` (its rows, its counter, its timer)."""

    def __init__(self, pool):
        self.pool = pool
        self.buffers: dict = {}  # id(owner) -> (keys, values): per layer [rows, Hk, width, Dh]
        self.graphs: dict = {}  # key -> Captured (``made_from``: what the smaller buckets are made from)
        self.made = 0  # of the pool's ``made``, the drafters'

    def claim(self, owner, layers: int, heads: int, width: int, head_dim: int, dtype, device):
        """Per layer (keys, values) buffers of ``owner`` (a method) for this batch: the job's, made
        anew (and every graph over them) only when these are too small."""
        rows = self.pool.rows
        have = self.buffers.get(id(owner))
        if have is not None:
            k = have[0][0]
            if (len(have[0]), k.shape[0], k.shape[1], k.shape[3], k.dtype) == (layers, rows, heads, head_dim, dtype) \
                    and k.shape[2] >= width:
                return have
            width = max(width, k.shape[2])
            self.graphs = {key: g for key, g in self.graphs.items() if key[0] != id(owner)}  # over the old ones
        shape = (rows, heads, width, head_dim)
        have = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])
        self.buffers[id(owner)] = have
        return have

    def held(self, owner) -> list:
        """``owner``'s buffers (keys and values, per layer), or none."""
        have = self.buffers.get(id(owner))
        return [] if have is None else [*have[0], *have[1]]

    def run(self, cache, name: str, fn, inputs, scratch):
        """``fn(*inputs, scratch)`` for the cache's rows (``DrafterCache.run``), from its graph."""
        B = len(cache.lens)
        Bb = bucket(B, cache.full[0][0].shape[0])
        spots = tuple((s.w, s.at) for s in scratch)
        key = self._key(cache, name, Bb, inputs, spots)
        padded = [_padded(t, Bb) for t in inputs]
        g = self.graphs.get(key)
        if g is None:
            kind = type(scratch[0]) if scratch else None  # drafters.cache.Scratch
            g = self._make(key, cache, fn, Bb, padded, spots, kind)
        out = self._call(g, padded)
        for s, a in zip(scratch, g.advance):
            s.at += a
        return out if Bb == B else tree_map(lambda t: t[:B] if isinstance(t, torch.Tensor) and t.dim() else t, out)

    def _key(self, cache, name, Bb, inputs, spots) -> tuple:
        return (id(cache.owner), name, Bb, tuple((tuple(t.shape[1:]), t.dtype) for t in inputs), spots,
                cache.full[0][0].data_ptr(), tuple(cache.full[0][0].shape))

    def _make(self, key, cache, fn, Bb, inputs, spots, kind) -> Captured:
        K = [k[:Bb] for k in cache.full[0]][:len(spots)]
        V = [v[:Bb] for v in cache.full[1]][:len(spots)]
        with self._bare():
            g = Captured(fn, inputs, K, V, spots, kind, self.pool.backend)
        self.graphs[key] = g
        g.made_from = (types.SimpleNamespace(owner=cache.owner, full=cache.full), fn,
                       [(tuple(t.shape[1:]), t.dtype) for t in inputs], kind)
        self.pool.made += 1
        self.made += 1
        return g

    def _bare(self, g: Captured | None = None):
        """The timer's wrappers off while a graph is traced or captured (not around a CUDA replay)."""
        if self.pool.timer is None or (g is not None and g.cuda and g.graph is not None):
            return contextlib.nullcontext()
        return self.pool.timer.bare()

    def _call(self, g: Captured, inputs):
        timer = self.pool.timer
        with timer.charge() if timer is not None else contextlib.nullcontext(), self._bare(g):
            return g(inputs)

    @torch.inference_mode()
    def warm(self, rows: int) -> None:
        """Make now, outside any timing, every graph met so far at each smaller rows bucket (rows leave)."""
        for key, g in list(self.graphs.items()):
            cache, fn, specs, kind = g.made_from
            for Bb in sorted({bucket(b, cache.full[0][0].shape[0]) for b in range(1, rows + 1)}):
                k = (*key[:2], Bb, *key[3:])
                if k not in self.graphs:
                    dev = cache.full[0][0].device
                    inputs = [torch.ones((Bb, *s), dtype=dt, device=dev) if dt == torch.bool else
                              torch.zeros((Bb, *s), dtype=dt, device=dev) for s, dt in specs]
                    self._call(self._make(k, cache, fn, Bb, inputs, key[4], kind), inputs)

    def close(self) -> None:
        self.buffers, self.graphs = {}, {}
