"""``compile=graphs``: the target's decode and verify forwards (and a drafter's) at static shapes,
captured once as CUDA graphs and replayed (on the CPU: the same function through
``torch.compile(fullgraph=True)``, which proves it capturable, without graphs; its ``eager``
backend by default).

A production engine keeps the host out of its decode step: launching a small model's ~400 kernels
one by one costs more than running them, and speculative decoding hides that overhead where plain
decoding pays it, so an eager harness reads small-batch speedups high. Here, as vLLM does:

- the KV cache lives in fixed buffers [rows, Hk, C_cap, Dh] per layer (``GraphPool``, one per
  target, kept across batches so graphs are captured once a job); a forward writes its new slots at
  ``slots`` (a static tensor) and attends over the whole width through the row's mask, so its shapes
  do not change with the context;
- a forward's rows and nodes are padded up to buckets (powers of two; padding nodes attend to
  themselves only, their outputs are never read), and one graph is captured per (rows, nodes)
  bucket it meets: the warm-up meets those a job needs, and ``GraphPool.made`` counts any made
  later;
- everything else (the prefill, the commit's slot moves, rows leaving) runs eagerly on the same
  buffers (``GraphCache``: a ``RaggedCache`` whose forward is replayed);
- a drafter's own forwards over its cache (EAGLE's steps, DFlash's and DSpark's block and context,
  P-EAGLE's step) are captured too, over buffers the pool keeps for the job (``decode.captured``),
  and a draft model's (Leviathan's, SpecDec's, MTP's module) through a ``GraphCache`` of its own
  pool, a ``child`` of the target's (``drafters.cache.draft_cache``).

Static batches only: rows leave (compacted in place, the bucket shrinks), none join
(``serving.batching=continuous`` and ``serving.prefill_chunk`` are refused with compile=graphs). Models with
sliding-window layers are refused too (their masks are per layer type)."""

from __future__ import annotations

import contextlib
import types

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specbench.decode.captured import Captured, DraftGraphs, bucket, capture, compiled, forget
from specbench.decode.hidden import Tap
from specbench.decode.kv import RaggedCache
from specbench.errors import ConfigError
from specbench.hf import cache_kwarg


class FixedLayer(DynamicLayer):
    """One layer's keys and values in the pool's buffers: a forward writes its new slots at the
    pool's ``slots`` and gets the buffers' first rows back, whole width (shapes that do not move)."""

    def __init__(self, pool: "GraphPool", i: int):
        super().__init__()
        self.pool, self.i, self.is_initialized = pool, i, True

    @property
    def keys(self):
        return self.pool.k[self.i]

    @keys.setter
    def keys(self, t):  # DynamicLayer's own initialisation sets it; the buffers are the pool's
        pass

    @property
    def values(self):
        return self.pool.v[self.i]

    @values.setter
    def values(self, t):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        B = key_states.shape[0]
        K, V = self.pool.k[self.i][:B], self.pool.v[self.i][:B]
        K.index_copy_(2, self.pool.slots, key_states)
        V.index_copy_(2, self.pool.slots, value_states)
        return K, V

    def get_seq_length(self) -> int:
        return self.pool.width

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.pool.width, 0


class GraphPool:
    """A target's fixed KV buffers and the forwards captured over them, by (rows, nodes) bucket."""

    def __init__(self, model, device, dtype, backend: str = "eager"):
        self.model, self.device, self.dtype, self.backend = model, device, dtype, backend
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = self.width = 0
        self.want = (0, 0)  # the least rows and width buffers are made with (``reserve``)
        self.slots: torch.Tensor | None = None  # where the running forward writes (the bucket's static tensor)
        self.graphs: dict = {}
        self.made = 0  # graphs captured (or compiled) so far
        self.cache = DynamicCache()
        self.kw = cache_kwarg(model)  # the keyword its forward takes the cache under
        self.tap = None  # the engine's hidden-state tap (``Tap``): its names, and its states filled after a run
        self.own_taps: dict = {}  # names -> the pool's own Tap, hooked before any graph is made with it
        self.timer = None  # the engine's PhaseTimer: a replay is model forward time
        self.drafts = DraftGraphs(self)  # the drafters' buffers and graphs (drafters.cache.DrafterCache)
        self.children: dict = {}  # id(draft model) -> its own pool (``child``)
        self.parent: GraphPool | None = None  # a draft model's pool: the target's

    def child(self, model) -> "GraphPool":
        """The pool of a draft model the method runs beside the target (Leviathan's): its forwards
        captured as the target's are, counted as the drafter's graphs, warmed and closed with this one."""
        c = self.children.get(id(model))
        if c is None:
            c = self.children[id(model)] = GraphPool(model, self.device, self.dtype, self.backend)
            c.parent, c.want = self, self.want
        c.timer = self.timer
        return c

    def _made_one(self) -> None:
        self.made += 1
        if self.parent is not None:
            self.parent.made += 1
            self.parent.drafts.made += 1

    def reserve(self, rows: int, width: int) -> None:
        """Room for ``rows`` rows and ``width`` slots from now on (a job's longest prompts and answers),
        so that no batch of the timed job makes the buffers, and every graph, anew. Before the first
        prefill: the size the first buffers get (the drafters' are sized from them)."""
        self.want = (max(rows, self.want[0]), max(width, self.want[1]))
        if self.k:
            self.claim(rows, width, [types.SimpleNamespace(keys=k, values=v) for k, v in zip(self.k, self.v)])

    def close(self) -> None:
        """Drop the buffers, the graphs and the pool's own hooks (the job is over)."""
        for t in self.own_taps.values():
            t.close()
        self.drafts.close()
        for c in self.children.values():
            c.close()
        self.children = {}
        if self.device.type != "cuda":  # the traces of this job's graphs (CUDA graphs are dropped with them)
            forget(_Graph._forward, Captured._forward)
        self.own_taps, self.graphs, self.k, self.v, self.rows, self.width, self.want = {}, {}, [], [], 0, 0, (0, 0)
        if getattr(self.model, "_specbench_graphs", None) is self:
            self.model._specbench_graphs = None

    def claim(self, rows: int, width: int, like: list) -> None:
        """Buffers for ``rows`` rows and ``width`` slots, shaped as the layers ``like`` (a prefill's);
        made anew (and every graph with them) only when these are too small."""
        if self.k and rows <= self.rows and width <= self.width:
            return
        rows = max(rows, self.rows, self.want[0])
        width = -(-max(width, self.width, self.want[1]) // 256) * 256  # whole 256s: a draft's pool as its target's
        self.k = [torch.zeros(rows, a.keys.shape[1], width, a.keys.shape[3], dtype=a.keys.dtype, device=self.device)
                  for a in like]
        self.v = [torch.zeros(rows, a.values.shape[1], width, a.values.shape[3], dtype=a.values.dtype,
                              device=self.device) for a in like]
        self.rows, self.width, self.graphs = rows, width, {}
        self.cache = DynamicCache()
        self.cache.layers[:] = [FixedLayer(self, i) for i in range(len(like))]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def held_tensors(self) -> list:
        """What a method holding this pool holds of it (``decode.memory.held_bytes``): a draft
        model's pool, its KV buffers; the target's, nothing (the engine counts the target's cache,
        and a drafter's buffers are counted through its own ``DrafterCache``)."""
        return [*self.k, *self.v] if self.parent is not None else []

    def owned_nbytes(self, proposer) -> int:
        """Bytes of this job's buffers that ``proposer`` (and the methods it wraps) keep here: its
        drafters' and its draft models' (a GPU run's peak: they are made before the timing)."""
        props, total = [proposer], 0
        while props:
            p = props.pop()
            props.extend(p.inner())
            total += sum(t.numel() * t.element_size() for t in self.drafts.held(p))
            total += sum(c.nbytes() for m in p.modules() for c in [self.children.get(id(m))] if c is not None)
        return total

    def run(self, tokens, pos, mask, slots, extras: dict | None = None) -> torch.Tensor:
        """The model's output [B, n, ..] (an LM's logits) over padded inputs (B, n buckets; ``extras``:
        more inputs of the forward, [B, n, ..] each: MTP's states), through the graph of their shape
        (captured at its first use)."""
        names = self.tap.names if self.tap is not None else ()
        extras = extras or {}
        key = (*tokens.shape, names, tuple((k, tuple(v.shape[2:]), v.dtype) for k, v in sorted(extras.items())))
        g = self.graphs.get(key)
        if g is None:
            if names and names not in self.own_taps:  # hooks a graph is traced (captured) with: they stay
                self.own_taps[names] = Tap(self.model, names)
            g = self.graphs[key] = _Graph(self, *tokens.shape, self.own_taps.get(names), extras)
            self._made_one()
        for t in self.own_taps.values():  # empty (eager forwards, a prefill, fill them too): a traced graph guards on it
            t.take()
        timer = self.timer
        bare = timer is not None and (not g.cuda or g.graph is None)  # traced or captured now: no timer inside
        with self.tap.paused() if self.tap is not None else contextlib.nullcontext(), \
                timer.charge() if timer is not None else contextlib.nullcontext(), \
                timer.bare() if bare else contextlib.nullcontext():  # (a draft model of ours has its methods wrapped)
            out = g(tokens, pos, mask, slots, extras)
        got = g.states()
        if names:  # the states the graph's own hooks saw (replayed: its static outputs)
            self.tap.out.update(got)
        return out

    @torch.inference_mode()
    def warm(self, rows: int, nodes: int) -> None:
        """Capture (compile) now, outside any timing, the graph of every bucket a job of ``rows`` rows
        can meet (rows leave: every smaller bucket too) at the node counts met so far (a tree's width)
        and every count up to ``nodes`` (a chain's drafts, however many a step has)."""
        dev = self.device
        met = {k[1] for k in self.graphs}
        names = self.tap.names if self.tap is not None else ()
        for more in {k[3] for k in self.graphs} or {()}:  # the extra inputs' shapes met (MTP's states)
            for B in sorted({bucket(b, self.rows) for b in range(1, rows + 1)}):
                for n in sorted(met | {bucket(m) for m in range(1, nodes + 1)}):
                    if (B, n, names, more) in self.graphs or n > self.width:
                        continue
                    ok = torch.zeros(B, n, self.width, dtype=torch.bool, device=dev)
                    ok[:, :, :n] = torch.eye(n, dtype=torch.bool, device=dev)
                    mask = torch.where(ok, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[:, None]
                    z = torch.zeros(B, n, dtype=torch.long, device=dev)
                    self.run(z, z, mask, torch.arange(n, device=dev),
                             {k: torch.zeros(B, n, *shape, dtype=dt, device=dev) for k, shape, dt in more})
        self.drafts.warm(rows)
        for c in self.children.values():  # a draft model's forwards, as many nodes as the target's
            c.warm(rows, nodes)


class _Graph:
    """One bucket's forward: static inputs, and on a GPU its CUDA graph (captured after two warm
    runs on a side stream, as torch's ``make_graphed_callables`` does); on the CPU the forward
    compiled whole (``fullgraph``: a break is an error) for these shapes."""

    def __init__(self, pool: GraphPool, B: int, n: int, tap=None, extras: dict | None = None):
        dev = pool.device
        self.pool, self.tap = pool, tap
        self.extras = {k: torch.zeros_like(v) for k, v in (extras or {}).items()}
        self.tokens = torch.zeros(B, n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, n, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, 1, n, pool.width, dtype=pool.dtype, device=dev)
        self.slots = torch.arange(n, device=dev)
        self.tapped: dict = {}
        self.graph = None
        self.cuda = dev.type == "cuda"  # captured at its first call, over that call's inputs
        if not self.cuda:
            self.fn = compiled(self._forward, pool.backend)

    def _forward(self, tokens, pos, mask, extras):
        # the model's forward, not its __call__: the engine's timer hooks on the target stay outside
        # (the pool times the call itself); its layers' hooks (the hidden-state tap) are inside
        out = self.pool.model.forward(input_ids=tokens, attention_mask=mask, position_ids=pos, **extras,
                                      **{self.pool.kw: self.pool.cache}, use_cache=True, logits_to_keep=0)
        return out.logits if hasattr(out, "logits") else out.out  # an LM's logits; MTP's layer states

    def _capture(self) -> None:
        """Two warm runs on a side stream, then the capture, all over the first call's inputs: what
        they write goes to that call's own slots (scratch until committed), never to a row's prefix."""
        self.graph, self.out = capture(lambda: self._forward(self.tokens, self.pos, self.mask, self.extras))
        if self.tap is not None:
            self.tapped = dict(self.tap.take())  # the states its hooks saw: each replay rewrites them in place

    def __call__(self, tokens, pos, mask, slots, extras: dict) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.pos.copy_(pos)
        self.mask.copy_(mask)
        self.slots.copy_(slots)
        for k, v in extras.items():
            self.extras[k].copy_(v)
        self.pool.slots = self.slots
        if not self.cuda:
            return self.fn(self.tokens, self.pos, self.mask, self.extras)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.out

    def states(self) -> dict:
        """The tapped states of its last run."""
        if self.tap is None:
            return {}
        return self.tapped if self.graph is not None else self.tap.take()


def pool_of(model, device, dtype, backend: str | None = None) -> GraphPool:
    """The target's pool (one a model: the warm-up's graphs serve the timed job). ``backend``: the
    CPU's ``torch.compile`` backend, ``eager`` by default (the trace proves the forward capturable
    and runs it as traced; compile=true is the CPU's compiled mode); a GPU captures the eager
    forward's kernels."""
    pool = getattr(model, "_specbench_graphs", None)
    if pool is None or pool.dtype != dtype:
        pool = GraphPool(model, device, dtype, backend or "eager")
        model._specbench_graphs = pool
    return pool


class GraphCache(RaggedCache):
    """``RaggedCache`` whose decode and verify forwards run as the pool's graphs (module doc)."""

    def __init__(self, model, device, dtype, pool: GraphPool):
        super().__init__(model, device, dtype)
        if self.window is not None:
            raise ConfigError("compile=graphs: models with sliding-window layers (Gemma 3) are not captured yet; "
                              "run them with compile=false or compile=true")
        self.pool, self.fresh = pool, 0

    def prefill(self, prompts, room: int = 0, **model_kwargs):
        out = super().prefill(prompts, 0, **model_kwargs)  # eagerly, into a slab (no room: it is copied)
        layers = self.cache.layers
        need = self.C + room + bucket(room)  # the widest forward, padded, still fits after the longest row
        self.pool.claim(len(prompts), -(-need // 256) * 256, layers)  # whole 256s: later batches fit more often
        for i, layer in enumerate(layers):
            self.pool.k[i][:len(prompts), :, :self.C] = layer.keys
            self.pool.v[i][:len(prompts), :, :self.C] = layer.values
        self.cache = self.pool.cache
        return out

    def cache_len(self) -> int:
        return self.C

    def _crop(self, new_C: int, unpad: bool = False) -> None:
        self.C, self.fresh = new_C, 0  # the buffers stay whole; left padding stays where it is

    def forward(self, tokens, depth, anc, logits_to_keep: int = 0, **model_kwargs):
        """``RaggedCache.forward`` through the pool's graph; ``model_kwargs``: more inputs [B, n, ..]
        of the forward (MTP's states), padded as the tokens are. Returns its one output as
        ``logits`` (and as ``out``, the name MTP's module gives its layer's states)."""
        pool, dev = self.pool, self.device
        B, n = tokens.shape
        Bb, nb = bucket(B, pool.rows), bucket(n)
        if self.C + nb > pool.width:
            raise ConfigError(f"compile=graphs: a forward of {n} nodes at slot {self.C} passes the cache's "
                              f"{pool.width} slots; raise max_new_tokens' room or use compile=false")
        if anc is None:
            anc = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None].expand(B, n, n)
        node = torch.arange(nb, device=dev)
        own = torch.eye(nb, dtype=torch.bool, device=dev)[None].expand(Bb, nb, nb).clone()  # padding: itself only
        own[:B, :n, :n] = anc
        slot = torch.arange(pool.width, device=dev)
        start, length = self.start, self.length
        prefix = (slot[None] >= start[:, None]) & (slot[None] < (start + length)[:, None])  # [B, W]
        ok = torch.zeros(Bb, nb, pool.width, dtype=torch.bool, device=dev)
        ok[:B, :n] = prefix[:, None, :]
        ok[:, :, self.C:self.C + nb] = own
        mask = torch.where(ok, 0.0, torch.finfo(self.dtype).min).to(self.dtype)[:, None]
        pos = torch.zeros(Bb, nb, dtype=torch.long, device=dev)
        pos[:B, :n] = length[:, None] + depth
        tok = torch.zeros(Bb, nb, dtype=torch.long, device=dev)
        tok[:B, :n] = tokens
        extras = {}
        for k, v in model_kwargs.items():
            if not isinstance(v, torch.Tensor) or tuple(v.shape[:2]) != (B, n):
                raise ConfigError(f"compile=graphs: the forward's input {k} is no [rows, nodes, ...] tensor; "
                                  "use compile=false or compile=true")
            extras[k] = v.new_zeros(Bb, nb, *v.shape[2:])
            extras[k][:B, :n] = v
        logits = pool.run(tok, pos, mask, self.C + node, extras)[:B, :n]
        self.fresh = n  # the new nodes' slots, until a commit keeps some
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return types.SimpleNamespace(logits=logits, out=logits)

    def commit_all(self) -> None:
        """Keep every new node of the last forward (a draft model's chain step; its slots sit at
        [C, C + n), the buffers do not grow)."""
        n, self.fresh = self.fresh, 0
        if n:
            self.commit([list(range(n))] * self.batch_size, [n] * self.batch_size)

    def select_rows(self, keep) -> None:
        rows = keep.tolist() if isinstance(keep, torch.Tensor) else list(keep)
        if rows != list(range(len(rows))):  # the kept rows to the front of the buffers, in place
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            for buf in (*self.pool.k, *self.pool.v):
                buf[:len(rows), :, :self.C] = buf[idx, :, :self.C]
        self.start = [self._start[r] for r in rows]
        self.length = [self._length[r] for r in rows]
        self.fresh = 0
        if self.batch_size:
            self.C = max(self._ends())

    def add_rows(self, *others, **kwargs) -> None:
        raise ConfigError("compile=graphs runs static batches (rows leave, none join): use serving.batching=static, "
                          "or compile=true for continuous batching")

    def nbytes(self) -> int:
        return self.pool.nbytes()
