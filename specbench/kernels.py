"""Kernel paths for the target's linear layers on CPU (``kernel=`` in the config).

A decode forward is a handful of rows through every weight matrix. On CPU the default path
(``F.linear`` -> MKL sgemm) handles 1 row as a matrix-vector product that streams the weight
once, but 2..16 rows as a general GEMM that packs the weight into blocks on every call: a
verify forward over K+1 tokens then reads and writes the weights more than once, and costs
far more than one decode step although it does the same memory traffic in principle.

``onednn`` packs each weight once, at load time, into oneDNN's blocked layout and runs every
linear through ``torch.ops.mkldnn._linear_pointwise`` on the packed weight: no per-call
packing, whatever the row count. The model stays the exact model (every layer, the full
output layer, the same dtype); only the summation order inside a dot product changes.

- ``torch``: the layers as loaded (the reference path).
- ``onednn``: prepacked oneDNN weights (CPU, fp32 layers; bf16 packing needs a CPU with
  AVX512 or AVX-NE-CONVERT, so bf16 layers keep torch's path). Costs one extra copy of the
  linear weights in memory.
- ``auto``: ``onednn`` on CPU where this torch has oneDNN, else ``torch``.

``analysis.profile --kernel torch,onednn`` measures both cost curves in one run.
"""

from __future__ import annotations

import types
import weakref

import torch

KERNELS = ("auto", "torch", "onednn")


def resolve(name: str, device: torch.device) -> str:
    from specbench.models import ConfigError

    if name not in KERNELS:
        raise ConfigError(f"unknown kernel '{name}'; choices: {', '.join(KERNELS)}")
    if name == "auto":
        return "onednn" if device.type == "cpu" and onednn_available() else "torch"
    if name == "onednn" and device.type != "cpu":
        raise ConfigError(f"kernel=onednn is a CPU path (device is {device.type}); use kernel=torch or auto")
    if name == "onednn" and not onednn_available():
        raise ConfigError("kernel=onednn: this torch build has no oneDNN (torch.backends.mkldnn); use kernel=torch")
    return name


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def apply(model: torch.nn.Module, kernel: str) -> int:
    """Switch ``model``'s linear layers to ``kernel`` (a resolved name); returns how many
    layers changed. Idempotent."""
    if kernel == "torch":
        return 0
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.float32 \
                and not getattr(mod, "_specbench_kernel", None):
            _pack(mod)
            n += 1
    return n


# layer -> (the weight it was packed from, packed weight). Kept outside the module: an opaque
# oneDNN tensor cannot be deep-copied, and a copy must not inherit another layer's numbers.
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _packed_weight(mod: torch.nn.Linear) -> torch.Tensor:
    """The oneDNN-packed copy of ``mod.weight``, repacked whenever the weight is another
    tensor (a deep copy of the layer, e.g. a draft built from the target's layers) or was
    changed in place (``load_state_dict`` into it): a stale packed weight would silently
    compute with someone else's numbers."""
    w = mod.weight
    key = (id(w), w.data_ptr(), w._version)
    hit = _PACKED.get(mod)
    if hit is None or hit[0] != key:
        # the batch-size hint sizes oneDNN's blocks; 8 rows is what a verify forward brings
        hit = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8))
        _PACKED[mod] = hit
    return hit[1]


def _onednn_forward(self, x):
    if (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)) \
            or self.weight.dtype != torch.float32 or x.dtype != torch.float32:
        return torch.nn.functional.linear(x, self.weight, self.bias)  # training, other dtypes: as loaded
    shape = x.shape
    b = None if self.bias is None else self.bias.detach()
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), _packed_weight(self), b, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def _pack(mod: torch.nn.Linear) -> None:
    _packed_weight(mod)
    mod.forward = types.MethodType(_onednn_forward, mod)  # a deep copy rebinds it to the copy
    mod._specbench_kernel = "onednn"
