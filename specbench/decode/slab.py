"""The KV cache's layer: keys and values appended into a buffer with room to spare
(``SlabLayer``), and the operations ``specbench.decode.kv.RaggedCache`` runs on it (narrow, move
rows, release). ``DynamicCache`` copies the whole cache on every forward (O(context) per step),
which at long contexts costs more than the step's attention; a slab appends in place."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specbench import accel


class SlabLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of a larger buffer: a forward writes its
    new slots in place, and the buffer doubles when full (amortised O(new tokens) per forward).
    While they are its own slice of the buffer the layer keeps only where it starts and how long
    it is (``_span``), and makes the two views when someone reads ``keys``/``values``: the engine's
    own steps (the fused loop's ``append``, a commit's ``narrow``) then create no tensors (two
    views a layer each cost ~5 us on caches the weight stream left cold). Whoever sets
    ``keys``/``values`` to another tensor (rows selected, say) makes the next update copy them
    into a fresh buffer; a slice of the buffer keeps appending in place."""

    _span: tuple[int, int] | None = None  # (offset in the buffer, length) while keys/values are that slice
    capacity = 0  # slots the first buffer gets when that covers what it must hold (RaggedCache.prefill's room)
    _kv: tuple = (None, None)  # keys and values set from outside (when _span is None)
    _views: tuple | None = None  # the views of _span, once read
    _base: tuple | None = None  # the whole buffers _k and _v are the first rows of (room for rows that join)

    @property
    def keys(self):
        return self._kv[0] if self._span is None else self._slice()[0]

    @keys.setter
    def keys(self, t):
        self._kv, self._span, self._views = (t, self.values), None, None

    @property
    def values(self):
        return self._kv[1] if self._span is None else self._slice()[1]

    @values.setter
    def values(self, t):
        self._kv, self._span, self._views = (self.keys, t), None, None

    def _slice(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._views is None:
            off, L = self._span
            self._views = (self._k.narrow(2, off, L), self._v.narrow(2, off, L))
        return self._views

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = self._base = None

    def get_seq_length(self) -> int:
        return self._span[1] if self._span is not None else super().get_seq_length()

    def _offset(self) -> int | None:
        """Slot where ``keys``/``values`` start inside the buffer, None if they are not a slice of it."""
        if self._span is not None:
            return self._span[0]
        for t, buf in ((self.keys, self._k), (self.values, self._v)):
            if buf is None or t.dim() != 4 or t.shape[:2] != buf.shape[:2] or t.stride() != buf.stride() \
                    or t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                return None
        off, rem = divmod(self.keys.storage_offset() - self._k.storage_offset(), self._k.stride(2))
        off_v = (self.values.storage_offset() - self._v.storage_offset()) // self._v.stride(2)
        return off if rem == 0 and off == off_v and off >= 0 else None

    def _grow(self, n: int, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        """(offset of the views in the buffer, their length L) once the buffer has room for ``n``
        more slots after them (a new buffer shaped like k and v, the views copied, if not); the
        views then take in the n slots, still to be written."""
        if self._span is not None:
            off, L = self._span
        else:
            L = self.keys.shape[-2] if self.keys.dim() == 4 else 0
            off = self._offset()
        if off is None or off + L + n > self._k.shape[2]:
            # the batch's known bound where it covers this (one buffer for the whole batch), else doubling
            cap = self.capacity if self.capacity >= L + n else max(64, 2 * (L + n))
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if L:
                new_k[:, :, :L] = self.keys
                new_v[:, :, :L] = self.values
            self._k, self._v, off = new_k, new_v, 0
            self._base = (new_k, new_v)
        self._span, self._views = (off, L + n), None
        return off, L

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        off, L = self._grow(n, key_states, value_states)
        self._k.narrow(2, off + L, n).copy_(key_states)
        self._v.narrow(2, off + L, n).copy_(value_states)
        return self.keys, self.values

    def ready(self) -> bool:
        """Whether ``append`` gives room (the buffers exist: a prefill made them)."""
        return self._span is not None or (self.is_initialized and self._k is not None and self.keys.dim() == 4)

    def append(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """Room for ``n`` new slots that the caller writes itself (the native fused layer writes
        them from its kernel, then attends; nobody reads them in between): (key buffer, value
        buffer, offset of the views in them, slots before the new ones). None before the first
        ``update`` (a prefill) made the buffers."""
        if not self.ready():
            return None
        own = self._span is not None  # else keys and values set from outside (rows selected): their shape
        off, L = self._grow(n, *((self._k, self._v) if own else (self.keys, self.values)))
        return self._k, self._v, off, L


def narrow(layer, lo: int, hi: int | None) -> None:
    """``layer``'s keys and values cut to slots ``[lo, hi)`` (``lo`` and ``hi`` within them). A
    ``SlabLayer`` holding its own slice of its buffer just moves the slice's ends (no views made,
    and the next update appends without re-deriving the offset from the storage)."""
    span = getattr(layer, "_span", None)
    if span is not None:
        off, L = span
        hi = L if hi is None else min(hi, L)
        layer._span, layer._views = (off + lo, max(hi - lo, 0)), None
        return
    layer.keys = layer.keys[:, :, lo:hi]
    layer.values = layer.values[:, :, lo:hi]


def slot_mover(tensors: list[torch.Tensor]):
    """The native extension's ``move_slots`` when it is loaded (``specbench.accel``) and the cache
    is fp32 on the CPU (one call for all layers; it checks every tensor), else None (torch's
    indexing, per layer)."""
    t = tensors[0]
    return accel.move_slots if t.dtype == torch.float32 and t.device.type == "cpu" else None


def release(layer) -> None:
    """Drop a layer's buffers (its cache is being rebuilt elsewhere)."""
    layer._k = layer._v = layer._base = layer._views = None
    layer._kv, layer._span = (None, None), None


def slab_cache(capacity: int = 0) -> DynamicCache:
    def layer() -> SlabLayer:
        new = SlabLayer()
        new.capacity = capacity
        return new

    cache = DynamicCache()
    cache.layer_class_to_replicate = layer
    return cache


def keep_rows(layer, rows: list[int], moves: tuple | None) -> bool:
    """Move the kept rows of a ``SlabLayer`` that holds its own slice to the front of its buffer,
    in place (only the rows that move, only the live slots: one gather and one scatter per tensor,
    not a copy per row), and narrow the buffer to them: no second copy of the cache while the first
    lives, and no regrowth after. ``moves``: (destination rows, source rows) on the device, or None
    when no row moves. False (nothing done) for a layer whose keys and values were set from outside."""
    span = getattr(layer, "_span", None)
    if span is None or any(b <= a for a, b in zip(rows, rows[1:])):
        return False
    off, L = span
    if moves is not None:  # the moved rows are gathered before any is written
        dst, src = moves
        for buf in (layer._k, layer._v):
            live = buf.narrow(2, off, L)
            live.index_copy_(0, dst, live.index_select(0, src))
    layer._k, layer._v, layer._views = layer._k[:len(rows)], layer._v[:len(rows)], None
    return True
