"""Packed copies of weights, kept per owner and redone when the weights change: what the onednn
and native kernel paths share."""

from __future__ import annotations

import types
import weakref

import torch

# owner -> (key of the weights it was packed from, packing), one store per kind of packing: a
# Linear's oneDNN or native weight, a fused layer's q|k|v and gate|up, a drafter's rows of its
# target's output layer. Kept outside the modules: an opaque oneDNN tensor cannot be deep-copied,
# and a copy must not inherit another layer's numbers.
PACKED: dict[str, weakref.WeakKeyDictionary] = {k: weakref.WeakKeyDictionary()
                                                 for k in ("onednn", "native", "fused", "rows", "heads")}


def cached_packing(store: str, owner, weights, build):
    """``build()``, cached for ``owner`` and redone whenever one of ``weights`` is another tensor
    (a deep copy of the layer, e.g. a draft built from the target's layers) or was changed in
    place (``load_state_dict`` into it; an inference tensor, such as a drafter's slice of its
    target's head, has no version counter and counts as unchanged): a stale packing would
    silently compute with someone else's numbers."""
    key = [(id(w), w.data_ptr(), 0 if w.is_inference() else w._version) for w in weights]  # no counter there
    hit = PACKED[store].get(owner)
    if hit is None or hit[0] != key:
        hit = (key, build())
        PACKED[store][owner] = hit
    return hit[1]


def as_loaded(w: torch.Tensor, x: torch.Tensor) -> bool:
    """Training and non-fp32 layers keep torch's path (cheapest tests first: a hot path)."""
    return x.dtype != torch.float32 or w.dtype != torch.float32 \
        or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))


def route(mod: torch.nn.Linear, kernel: str, forward) -> None:
    """``mod``'s forward replaced by ``forward`` (a deep copy rebinds the method to the copy), and
    the path it is on recorded on it."""
    mod.forward = types.MethodType(forward, mod)
    mod._specbench_kernel = kernel

