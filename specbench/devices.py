"""Host data onto the device without waiting for it. A tensor made from a Python list directly on
a GPU (``torch.tensor(x, device="cuda")``) is copied from pageable memory, which blocks the host
until every kernel queued before it has run: an implicit sync, once per call. Staged in pinned
memory and copied asynchronously, the copy takes its place in the stream instead (torch's caching
host allocator keeps the staging buffer until the copy is done)."""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(data, dtype=dtype)`` on ``device``; on a GPU through pinned memory, without a sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, device="cpu").pin_memory().to(device, non_blocking=True)
