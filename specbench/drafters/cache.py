"""A drafter's own cache of keys and values, per row, that grows in place (DFlash, P-EAGLE, EAGLE);
and a draft model's ``RaggedCache`` that rows join as a method's ``per_row`` attribute
(``DraftRaggedCache``: Leviathan, SpecDec, MTP; ``draft_cache`` picks it).

Per layer one buffer [B, Hk, width, Dh], made once a batch with room for the prompts, every token
the batch may add and a step's own scratch: row b's first ``lens[b]`` slots are its verified
tokens at positions 0..lens[b]-1 (right-padded). Lengths are kept on the host too (``lens``), so
appending and sizing what a forward attends over read nothing back from the device.

A drafter forward attends over ``context()`` (views of the slots some row holds, no copy) followed
by its own new keys and values: ``scratch(n)`` hands each layer a ``Scratch`` that writes those
into the free slots right after the context and returns one view of both, so the context is never
concatenated (copied) again. Keys are stored with their KV heads; attention repeats none
(``kernels.attention_like``: SDPA's grouped-query attention).

With ``compile=graphs`` (``graphs``: the target's ``GraphPool``) the buffers are the pool's, kept
for the job; the context is their first ``fixed`` slots, attended whole (the rows' masks hide what
they do not hold), the scratch the slots after it, and ``run`` replays a forward from its graph
(``decode.captured``): a forward's shapes no longer follow the context's length. Rows leave in
place; none join (static batches)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specbench.decode.graphs import GraphCache
from specbench.decode.kv import RaggedCache
from specbench.errors import ConfigError


class Scratch:
    """One layer's context (its first ``w`` slots) and, after it, the keys and values of this
    propose's forwards, each ``join`` adding its own after the earlier ones'."""

    def __init__(self, K: torch.Tensor, V: torch.Tensor, w: int, at: int = 0):
        self.K, self.V, self.w, self.at = K, V, w, at

    def join(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hk, n, Dh] after what is there; returns views of everything so far."""
        s, n = self.w + self.at, k.shape[2]
        self.K[:, :, s:s + n].copy_(k)
        self.V[:, :, s:s + n].copy_(v)
        self.at += n
        return self.K[:, :, :s + n], self.V[:, :, :s + n]


def join(ctx, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's context (a ``Scratch``, or plain (keys, values) as training passes) followed by a
    forward's own k, v [B, Hk, n, Dh]."""
    if isinstance(ctx, Scratch):
        return ctx.join(k, v)
    return torch.cat([ctx[0], k], 2), torch.cat([ctx[1], v], 2)


class DrafterCache:
    def __init__(self, layers: int, heads: int, head_dim: int, rows: int, device, dtype, width: int = 0,
                 scratch: int = 0, graphs=None, owner=None):
        """Room for ``width`` slots of context a row and ``scratch`` slots of a propose's own after
        them; ``graphs``: compile=graphs' pool, whose buffers ``owner`` (the method) keeps (module doc)."""
        self.graphs, self.owner, self.fixed = graphs, owner, None
        if graphs is None:
            self.keys = [torch.zeros(rows, heads, width + scratch, head_dim, device=device, dtype=dtype)
                         for _ in range(layers)]
            self.values = [torch.zeros_like(k) for k in self.keys]
        else:
            if owner is None or rows > graphs.rows:
                raise ValueError("a DrafterCache with graphs needs its method as owner (its buffers are the owner's "
                                 f"for the job), and at most the pool's {graphs.rows} rows, got {rows}")
            self.full = graphs.drafts.claim(owner, layers, heads, max(width, graphs.width) + scratch, head_dim, dtype,
                                            device)
            self.fixed = self.full[0][0].shape[2] - scratch
            self.keys, self.values = [k[:rows] for k in self.full[0]], [v[:rows] for v in self.full[1]]
        self.length = torch.zeros(rows, dtype=torch.long, device=device)  # [B] on the device
        self.lens = [0] * rows  # the same on the host

    def run(self, name: str, fn, *inputs, scratch: list):
        """``fn(*inputs, scratch)``: a drafter forward over this cache (``inputs``: tensors, a row each
        first; ``scratch``: the propose's, a ``Scratch`` per layer). With compile=graphs replayed from
        the graph of its name and shapes, its rows padded to a bucket: ``fn`` reads nothing that
        changes between batches but its inputs, and its tensor outputs are the graph's (rewritten by
        its next replay)."""
        if self.graphs is None:
            return fn(*inputs, scratch)
        return self.graphs.drafts.run(self, name, fn, inputs, scratch)

    @property
    def width(self) -> int:
        return self.keys[0].shape[2]

    def grow(self, width: int) -> None:
        """Room for ``width`` slots a row (doubling: a batch sized right never gets here)."""
        if width <= self.width:
            return
        if self.fixed is not None:
            raise ConfigError(f"compile=graphs: the drafter's cache needs {width} slots, it has {self.width}; "
                              "use compile=false or compile=true")
        width = max(width, 2 * self.width)
        pad = (0, 0, 0, width - self.width)
        self.keys = [F.pad(k, pad) for k in self.keys]
        self.values = [F.pad(v, pad) for v in self.values]

    def upto(self) -> int:
        """The slots some row holds: what a forward attends over (compile=graphs: the whole context,
        once it holds any: the prompts' forward, eager, attends over itself)."""
        held = max(self.lens, default=0)
        return self.fixed if self.fixed is not None and held else held

    def context(self) -> list:
        """Per layer (keys, values) [B, Hk, upto, Dh]: views, no copy."""
        w = self.upto()
        return [(k[:, :, :w], v[:, :, :w]) for k, v in zip(self.keys, self.values)]

    def scratch(self, n: int) -> list[Scratch]:
        """Per layer the context and room for ``n`` more slots of a propose's own (``Scratch``)."""
        w = self.upto()
        self.grow(w + n)
        return [Scratch(k, v, w) for k, v in zip(self.keys, self.values)]

    def visible(self, n: int) -> torch.Tensor:
        """[B, n, upto]: which context slots each of ``n`` queries of a row sees (its own)."""
        ok = torch.arange(self.upto(), device=self.length.device)[None] < self.length[:, None]
        return ok[:, None].expand(-1, n, -1)

    def append(self, kv, counts: torch.Tensor, lens: list[int]) -> None:
        """Per layer (k, v) [B, Hk, m, Dh] of new tokens, row b's first ``counts[b]`` real (``lens``:
        the same on the host). Every row's m slots are written in place after its own (those past
        its new length are unseen, and the next append writes over them)."""
        m = kv[0][0].shape[2]
        B = len(lens)
        if self.fixed is not None and max(self.lens, default=0) + m > self.fixed:
            raise ConfigError(f"compile=graphs: the drafter's context passes its {self.fixed} slots; "
                              "use compile=false or compile=true")
        self.grow(max((n + m for n in self.lens), default=0))
        idx = self.length[:, None] + torch.arange(m, device=self.length.device)[None]  # [B, m]
        for (k, v), K, V in zip(kv, self.keys, self.values):
            at = idx[:, None, :, None].expand(B, K.shape[1], m, K.shape[3])
            K.scatter_(2, at, k.to(K.dtype))
            V.scatter_(2, at, v.to(V.dtype))
        self.length = self.length + counts
        self.lens = [n + c for n, c in zip(self.lens, lens)]

    def select_rows(self, keep: list[int]) -> None:
        """Keep the rows ``keep`` (finished rows leave the batch)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.length.device)
        if self.fixed is None:
            self.keys = [k[idx] for k in self.keys]
            self.values = [v[idx] for v in self.values]
        else:  # to the front of the pool's buffers, in place (a graph holds their addresses)
            if keep != list(range(len(keep))):
                held = max(self.lens, default=0)  # the slots any row holds (the scratch is rewritten)
                for buf in (*self.full[0], *self.full[1]):
                    buf[:len(keep), :, :held] = buf[idx, :, :held]
            self.keys = [k[:len(keep)] for k in self.full[0]]
            self.values = [v[:len(keep)] for v in self.full[1]]
        self.length = self.length[idx]
        self.lens = [self.lens[i] for i in keep]

    def add_rows(self, other: "DrafterCache") -> None:
        """``other``'s rows after these (rows joining a running batch)."""
        if self.fixed is not None:
            raise ConfigError("compile=graphs runs static batches (rows leave, none join): use serving.batching=static, "
                              "or compile=true for continuous batching")
        width = max(self.width, other.width)
        self.grow(width)
        other.grow(width)
        self.keys = [torch.cat([a[:, :, :width], b[:, :, :width]]) for a, b in zip(self.keys, other.keys)]
        self.values = [torch.cat([a[:, :, :width], b[:, :, :width]]) for a, b in zip(self.values, other.values)]
        self.length = torch.cat([self.length, other.length])
        self.lens = self.lens + other.lens

    def nbytes(self) -> int:
        held = (*self.keys, *self.values) if self.fixed is None else (*self.full[0], *self.full[1])
        return sum(t.numel() * t.element_size() for t in held)


class DraftRaggedCache(RaggedCache):
    """A draft model's own ``RaggedCache`` (Leviathan's draft, SpecDec's Spec-Drafter, MTP's module)
    kept as a method's ``per_row`` attribute. It is made with the settings rows join it with
    (``RaggedCache.add_rows``'s ``room``, ``rows`` and ``wider``, as the engine's target cache takes
    them), so the ``add_rows(other)`` the base's bookkeeping calls needs nothing more."""

    def __init__(self, model, device, dtype, room: int = 0, rows: int = 0, wider: bool = False):
        super().__init__(model, device, dtype)
        self.joins = {"room": room, "rows": rows, "wider": wider}

    def add_rows(self, *others: RaggedCache, **settings) -> None:
        super().add_rows(*others, **{**self.joins, **settings})


def draft_cache(model, state, device, dtype, **joins) -> RaggedCache:
    """A draft model's cache for the rows of ``state``: with compile=graphs one whose forwards are
    replayed from graphs (``decode.graphs.GraphCache`` over the target pool's ``child`` for this
    model; static batches); else a ``DraftRaggedCache`` rows join with ``joins``. A draft that is
    the target itself runs eagerly (one model, one pool: the target's buffers are its own)."""
    pool = state.graphs
    if pool is None or pool.model is model:
        return DraftRaggedCache(model, device, dtype, **joins)
    return GraphCache(model, device, dtype, pool.child(model))
