"""A batched KV cache whose rows have their own lengths.

Layout: one transformers ``DynamicCache`` shared by the batch, ``C`` slots wide. Row ``b``
keeps its committed tokens in the contiguous slots ``[start[b], start[b] + length[b])``;
slots before ``start[b]`` (left padding) and after its end (room another, longer row uses)
are hidden from it by the attention mask. Each forward appends ``n`` new slots for every
row at ``[C, C + n)``; ``commit`` then moves the slots a row keeps right behind its prefix
and crops the cache to the longest row. No row ever gives up tokens it accepted.

Token position ids are per row: the i-th committed token of a row has position i, a tree
node has position ``length[b] + depth``.

Each layer appends into a buffer with room to spare (``specbench.decode.slab.SlabLayer``)
instead of concatenating.
"""

from __future__ import annotations

import torch

from specbench.decode.slab import SlabLayer, keep_rows, narrow, release, slab_cache, slot_mover
from specbench.devices import to_device
from specbench.hf import cache_kwarg, text_config


class _RowInts:
    """A per-row quantity of ``RaggedCache`` kept as Python ints (``obj._<name>``): the bookkeeping
    of a step (a commit, a rollback, is the cache dense) is a few integer operations per row,
    where torch ops cost ~5-10 us apiece on caches the weight stream left cold (a Leviathan step
    made ~40 of them). Reads as a tensor on the cache's device (made once per change); may be set
    from a tensor or a list."""

    def __set_name__(self, owner, name: str) -> None:
        self.ints, self.tensor = "_" + name, "_" + name + "_t"

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        t = obj.__dict__.get(self.tensor)
        if t is None:
            t = obj.__dict__[self.tensor] = to_device(obj.__dict__[self.ints], torch.long, obj.device)
        return t

    def __set__(self, obj, v) -> None:
        obj.__dict__[self.ints] = v.tolist() if isinstance(v, torch.Tensor) else list(v)
        obj.__dict__[self.tensor] = None


class RaggedCache:
    def __init__(self, model, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.dtype = dtype
        cfg = getattr(model, "config", None)
        cfg = text_config(cfg) if cfg is not None else None  # multimodal Gemma 3 keeps it in text_config
        # Models with interleaved sliding-window layers (Gemma 3) take a mask per layer type.
        layer_types = getattr(cfg, "layer_types", None) or []
        self.window = getattr(cfg, "sliding_window", None) if "sliding_attention" in layer_types else None
        self.cache = slab_cache()
        self._kw = None  # the keyword the model's forward takes the cache under (cache_kwarg), once known
        self.start = []
        self.length = []
        self.C = 0

    # ------------------------------------------------------------------ geometry
    start = _RowInts()  # each row's left padding
    length = _RowInts()  # each row's committed length

    @property
    def batch_size(self) -> int:
        return len(self._length)

    def _ends(self) -> list[int]:
        return [s + n for s, n in zip(self._start, self._length)]

    def is_dense(self) -> bool:
        """True when every row fills the whole cache (no padding, no gaps): a plain causal
        mask is then exact and the model can take its own fast path."""
        return all(s == 0 for s in self._start) and all(n == self.C for n in self._length)

    def _neg(self) -> float:
        return torch.finfo(self.dtype).min

    def _to_model_mask(self, ok: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor):
        """ok: [B, q, kv] bool. Returns the additive 4D mask (a dict per layer type when the
        model has sliding-window layers)."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        neg = torch.full((), self._neg(), dtype=self.dtype, device=self.device)
        full = torch.where(ok, zero, neg)[:, None]
        if self.window is None:
            return full
        near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.window
        sliding = torch.where(ok & near, zero, neg)[:, None]
        return {"full_attention": full, "sliding_attention": sliding}

    # ------------------------------------------------------------------ forwards
    def _cache_kw(self) -> str:
        """The keyword the model's forward takes the cache under (``cache_kwarg``), looked up once."""
        if self._kw is None:
            self._kw = cache_kwarg(self.model)
        return self._kw

    def prefill(self, prompts: list[list[int]], room: int = 0, **model_kwargs):
        """Left-padded forward over whole prompts. Returns the model output (logits of the
        last position only). ``room``: slots the batch will add past the longest prompt at
        most (new tokens and the widest draft); the cache's buffers are made that large at once,
        so they never grow (and copy) mid-batch."""
        B = len(prompts)
        P = max(len(p) for p in prompts)
        pad = 0
        ids = to_device([[pad] * (P - len(p)) + list(p) for p in prompts], torch.long, self.device)
        lens = to_device([len(p) for p in prompts], torch.long, self.device)
        self.cache = slab_cache(P + room if room else 0)
        self.start = P - lens
        self.length = torch.zeros_like(lens)
        self.C = 0
        slot = torch.arange(P, device=self.device)
        pos = (slot[None, :] - self.start[:, None]).clamp(min=0)
        if bool((self.start == 0).all()):
            mask = None
        else:
            valid = slot[None, :] >= self.start[:, None]  # [B, P]
            causal = slot[None, :, None] >= slot[None, None, :]  # [1, q, kv]
            ok = causal & valid[:, None, :]
            # padded query rows attend to themselves only (keeps softmax finite)
            ok = ok | (~valid[:, :, None] & torch.eye(P, dtype=torch.bool, device=self.device)[None])
            mask = self._to_model_mask(ok, pos, pos)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, **{self._cache_kw(): self.cache},
            use_cache=True, logits_to_keep=1, **model_kwargs,
        )
        self.C = P
        self.length = lens.clone()
        return out

    def forward(self, tokens: torch.Tensor, depth: torch.Tensor, anc: torch.Tensor | None,
                logits_to_keep: int = 0, **model_kwargs):
        """One forward over ``n`` new nodes per row on top of the committed prefix.

        tokens, depth: [B, n]; anc: [B, n, n] bool, ``anc[b, i, j]`` iff node j is an
        ancestor of node i or i itself (None = a causal chain). The new slots are appended
        at ``[C, C + n)``; call ``commit`` afterwards to keep some of them.
        """
        B, n = tokens.shape
        pos = depth + self._length[0] if B == 1 else self.length[:, None] + depth
        if anc is None and self.is_dense():
            mask = None  # plain causal: let the model use its own path
        else:
            if anc is None:
                anc = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()[None].expand(B, n, n)
            slot = torch.arange(self.C, device=self.device)
            prefix = (slot[None, :] >= self.start[:, None]) & (slot[None, :] < (self.start + self.length)[:, None])
            ok = torch.cat([prefix[:, None, :].expand(B, n, self.C), anc], dim=2)
            k_pos = torch.cat([(slot[None, :] - self.start[:, None]).expand(B, self.C), pos], dim=1)
            mask = self._to_model_mask(ok, pos, k_pos)
        out = self.model(
            input_ids=tokens, attention_mask=mask, position_ids=pos, **{self._cache_kw(): self.cache},
            use_cache=True, logits_to_keep=logits_to_keep, **model_kwargs,
        )
        return out

    # ------------------------------------------------------------------ bookkeeping
    def commit(self, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep, for row b, the new nodes ``keep[b, :counts[b]]`` (indices into the last
        forward's nodes, in order) right after its prefix; drop every other new slot.

        keep: [B, m] long (entries past counts[b] are ignored); counts: [B] long (either may be host lists).
        """
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        if any(counts):
            keep, ends = keep.tolist() if isinstance(keep, torch.Tensor) else keep, self._ends()
            rows, src, dst = [], [], []
            for b, (k, c) in enumerate(zip(keep, counts)):
                rows += [b] * c
                src += [self.C + i for i in k[:c]]
                dst += range(ends[b], ends[b] + c)
            if src != dst:  # else every kept slot is in place already
                rows, src, dst = (to_device(x, torch.long, self.device) for x in (rows, src, dst))
                tensors = [t for layer in self.cache.layers for t in (layer.keys, layer.values)]
                move = slot_mover(tensors)
                if move is not None:
                    move(tensors, rows, src, dst)
                else:
                    for layer in self.cache.layers:
                        layer.keys[rows, :, dst] = layer.keys[rows, :, src]
                        layer.values[rows, :, dst] = layer.values[rows, :, src]
        self.length = [n + c for n, c in zip(self._length, counts)]
        self._crop(max(self._ends(), default=0))

    def commit_all(self) -> None:
        """Keep every new slot of the last forward, in order, for every row (a chain each row
        takes whole: a draft model's own decode step). When every row ends at the cache's end
        the new slots already sit right behind each prefix: nothing moves."""
        n_new = self.cache_len() - self.C
        if n_new == 0:
            return
        if all(e == self.C for e in self._ends()):
            self.length = [n + n_new for n in self._length]
            self.C += n_new
            return
        B = self.batch_size
        self.commit([list(range(n_new))] * B, [n_new] * B)  # host lists: nothing read back from the device

    def rollback(self, new_length) -> None:
        """Shorten rows to ``new_length`` (a tensor or a list; never longer than now); the freed
        slots become unreachable and the cache is cropped to the longest row."""
        new_length = new_length.tolist() if isinstance(new_length, torch.Tensor) else new_length
        self.length = [min(n, m) for n, m in zip(self._length, new_length)]
        self._crop(max(self._ends(), default=0))

    def _crop(self, new_C: int, unpad: bool = False) -> None:
        total = self.cache_len()
        if new_C < total:
            for layer in self.cache.layers:
                narrow(layer, 0, new_C)
        self.C = new_C
        # drop left padding every row has outgrown (only rows leaving the batch change that)
        shift = min(self._start) if unpad and self.batch_size else 0
        if shift > 0:
            for layer in self.cache.layers:
                narrow(layer, shift, None)
            self.start = [s - shift for s in self._start]
            self.C -= shift

    def cache_len(self) -> int:
        layers = self.cache.layers
        if not layers:
            return 0
        if type(layers[0]) is SlabLayer:
            return layers[0].get_seq_length()
        if getattr(layers[0], "keys", None) is None or layers[0].keys.numel() == 0:
            return 0
        return int(layers[0].keys.shape[2])

    def add_rows(self, *others: "RaggedCache", room: int = 0, rows: int = 0, wider: bool = False) -> None:
        """Rows join the batch (``serving.batching=continuous``): the rows of ``others`` (prefills of their
        prompts alone) are appended after this cache's, in order. All are aligned at their ends: the
        shorter are left-padded to the widest's slots (each row's own start moves, its positions do
        not). Where the buffers have rows to spare (rows that left, or ``rows`` made room for) and
        slots enough left of the batch's (the window grows leftwards into them), the joining rows
        are written into them in place: only they move, and the rows in flight get zeros in the
        slots they gain. Else the buffers are made anew, ``room`` slots past the merged width and
        room for ``rows`` rows in all, so the batch's next forwards and joins need no copy; with
        ``wider`` (more rows will join) on the CPU also as many slots left of it as it is wide, so
        a joiner up to twice the width still joins in place (CPU memory costs nothing until
        written; a GPU commits it at once, and copies a cache so fast that a rebuild costs little
        there). Only the slots a row can attend to (its own and its left padding, zeros) are
        written; the rest are written before anything reads them."""
        parts = [self, *others]
        Cs = [c.C for c in parts]
        W = max(Cs)
        B = sum(c.batch_size for c in parts)
        grow = W - self.C  # slots the window gains on its left
        layers = self.cache.layers
        in_place = layers and all(
            type(a) is SlabLayer and a._span is not None and a._base is not None and a._base[0].shape[0] >= B
            and a._span[0] >= grow for a in layers)
        slack = W if wider and self.device.type == "cpu" else 0
        merged = None if in_place else slab_cache(slack + W + room)
        for layer_set in zip(*(c.cache.layers for c in parts)):
            ks = [a.keys[:, :, :C] for a, C in zip(layer_set, Cs)]
            vs = [a.values[:, :, :C] for a, C in zip(layer_set, Cs)]
            if in_place:  # self's rows stay where they are; the joining rows go into the spare ones
                layer = layer_set[0]
                k, v = layer._base[0][:B], layer._base[1][:B]
                off, first = layer._span[0] - grow, self.batch_size
                ks, vs, Cs_j = ks[1:], vs[1:], Cs[1:]
                if grow:  # the rows in flight: the slots they gain are left padding
                    k[:first, :, off:off + grow] = 0
                    v[:first, :, off:off + grow] = 0
            else:
                cap = max(B, rows)
                k = ks[0].new_empty(cap, ks[0].shape[1], slack + W + room, ks[0].shape[3])
                v = vs[0].new_empty(cap, vs[0].shape[1], slack + W + room, vs[0].shape[3])
                base, (k, v) = (k, v), (k[:B], v[:B])
                off, first, Cs_j = slack, 0, Cs
            b = first
            for ka, va, C in zip(ks, vs, Cs_j):
                n = ka.shape[0]
                k[b:b + n, :, off + W - C:off + W], v[b:b + n, :, off + W - C:off + W] = ka, va
                if C < W:  # a row's slots before it hold whatever the buffer held
                    k[b:b + n, :, off:off + W - C] = 0
                    v[b:b + n, :, off:off + W - C] = 0
                b += n
            if in_place:
                layer._k, layer._v, layer._span, layer._views = k, v, (off, W), None
            else:
                layer = merged.layer_class_to_replicate()
                layer.lazy_initialization(k[:, :, :0], v[:, :, :0])
                layer._k, layer._v, layer._span, layer._base = k, v, (off, W), base
                merged.layers.append(layer)
                # the old buffers of this layer go now, before the next layer's are made: a rebuild
                # holds one layer twice at most, not the whole cache (2x the KV at its peak on a GPU)
                del ks, vs, ka, va
                for old in layer_set:
                    release(old)
        if merged is not None:
            self.cache = merged
        self.start = [s + W - C for c, C in zip(parts, Cs) for s in c._start]
        self.length = [n for c in parts for n in c._length]
        self.C = W

    def nbytes(self) -> int:
        """Bytes of the cache's buffers (room for rows and slots to come included)."""
        total = 0
        for layer in self.cache.layers:
            base = getattr(layer, "_base", None)
            ts = base if base is not None else (getattr(layer, "keys", None), getattr(layer, "values", None))
            total += sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))
        return total

    def select_rows(self, keep) -> None:
        """Keep only the rows ``keep`` (row indices as a list or a tensor, or a boolean mask; finished
        rows leave the batch), compacted in place."""
        if isinstance(keep, torch.Tensor):
            rows = (keep.nonzero().flatten() if keep.dtype == torch.bool else keep).tolist()
        else:
            rows = list(keep)
        index = None  # the rows as a device tensor, for layers set from outside (made once, if any)
        moved = [(i, r) for i, r in enumerate(rows) if i != r]
        moves = None if not moved else tuple(to_device(x, torch.long, self.device) for x in zip(*moved))
        for layer in self.cache.layers:
            if keep_rows(layer, rows, moves):
                continue
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                index = to_device(rows, torch.long, self.device) if index is None else index
                layer.keys = layer.keys[index]
                layer.values = layer.values[index]
        self.start = [self._start[r] for r in rows]
        self.length = [self._length[r] for r in rows]
        if self.batch_size:
            self._crop(max(self._ends()), unpad=True)
