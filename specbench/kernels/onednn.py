"""``kernel=onednn``: every fp32 linear on a weight packed once, at load time, into oneDNN's blocked
layout, through ``torch.ops.mkldnn._linear_pointwise``: no per-call packing, whatever the row
count. bf16 packing needs a CPU with AVX512 or AVX-NE-CONVERT, so bf16 layers keep torch's path.
Costs one extra copy of the linear weights in memory."""

from __future__ import annotations

import torch

from specbench.kernels.packing import as_loaded, cached_packing, route


def available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_weight(mod: torch.nn.Linear) -> torch.Tensor:
    w = mod.weight
    # the batch-size hint sizes oneDNN's blocks; 8 rows is what a verify forward brings
    return cached_packing("onednn", mod, (w,), lambda: torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8))


def _forward(self, x):
    if as_loaded(self.weight, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    b = None if self.bias is None else self.bias.detach()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed_weight(self), b, "none", [], "")
    return y.reshape(*x.shape[:-1], y.shape[-1])


def apply(model: torch.nn.Module) -> int:
    """``model``'s fp32 linears on the packed oneDNN path; how many changed."""
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.float32 \
                and getattr(mod, "_specbench_kernel", None) != "onednn":
            packed_weight(mod)
            route(mod, "onednn", _forward)
            n += 1
    return n
