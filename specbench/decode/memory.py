"""What a method holds between steps, in bytes: its drafter's cache (DFlash's, P-EAGLE's and EAGLE's
``DrafterCache``, MTP's and Leviathan's ``RaggedCache``) and its per-row
state. On the CPU a run's own peak memory is its weights plus these and the target's KV cache
(``Engine.peak_cache_bytes``); on a GPU the allocator counts them itself."""

from __future__ import annotations

import torch
from transformers import Cache

from specbench.methods.base import Proposer

DEPTH = 8  # how far below the method tensors are looked for (a wrapped method's draft cache's layers' buffers)


def held_bytes(proposer: Proposer) -> int:
    """Bytes of the tensors ``proposer`` holds, each storage once: found through its attributes, the
    lists, tuples and dicts in them, the methods it wraps, and the objects of specbench, of the
    method's own module and transformers' caches (a draft model's KV cache). Not its models'
    weights (``run.monitor.weight_bytes`` counts them); a container of plain values (an n-gram
    index, a pool) is not walked."""
    ours = ("specbench.", type(proposer).__module__)
    storages, seen = set(), set()
    total = 0

    def walk(o, depth: int) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if (o.device, s.data_ptr()) not in storages:
                storages.add((o.device, s.data_ptr()))
                total += s.nbytes()
        elif depth == 0 or isinstance(o, torch.nn.Module) or id(o) in seen:
            return
        elif hasattr(o, "held_tensors"):  # compile=graphs' pool: a draft model's KV (the target's: the engine's)
            seen.add(id(o))
            for t in o.held_tensors():
                walk(t, depth - 1)
        elif isinstance(o, (list, tuple, dict)):
            items = list(o.values()) if isinstance(o, dict) else o
            if items and _may_hold(items[0]):  # a container of plain values ends here, however long
                for x in items:
                    walk(x, depth - 1)
        elif hasattr(o, "__dict__") and (isinstance(o, (Proposer, Cache)) or type(o).__module__.startswith(ours)):
            seen.add(id(o))
            for v in vars(o).values():
                walk(v, depth - 1)

    walk(proposer, DEPTH)
    return total


def _may_hold(x) -> bool:
    """Whether ``x`` may hold a tensor: a tensor, a container whose first item may, or an object."""
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return bool(x) and _may_hold(x[0])
    if isinstance(x, dict):
        return bool(x) and _may_hold(next(iter(x.values())))
    return not isinstance(x, (int, float, complex, str, bytes, type(None)))
