"""Kernels: the path a model's layers run on (``kernel=`` in the config; ``backend=`` picks the
engine instead, ``specbench.engines``).

A decode forward is a handful of rows through every weight matrix. On CPU torch's default path
(``F.linear`` -> MKL sgemm) handles 1 row as a matrix-vector product that streams the weight
once, but 2..16 rows as a general GEMM that packs the weight into blocks on every call: a verify
forward over K+1 tokens then reads and writes the weights more than once, and costs far more than
one decode step although it does the same memory traffic in principle. The paths:

- ``torch`` (``gqa``): the layers as loaded; only a GQA model's attention is folded, on every
  path (AR and SD attend alike). The GPU default.
- ``onednn`` (``onednn``): fp32 linears on weights prepacked once into oneDNN's layout.
- ``native`` (``native``, ``extension``, ``csrc/``): specbench's own kernels, AVX2 or AVX-512
  tiles; fused Llama layers.
- ``auto``: ``native`` on a CPU that has AVX2 (and where the kernel builds), else ``onednn`` where
  this torch has oneDNN, else ``torch``; ``torch`` off the CPU.

Each keeps the exact model (every layer, the full output layer, the same dtype); only the
summation order inside a dot product changes. The loader calls ``resolve`` and ``apply``; the
drafters call the ``*_like`` and ``fused_*`` helpers, which take the path of the layer they are
given. ``analysis.profile --kernel torch,onednn,native`` measures the cost curves in one run.

Imports form a tree: ``specbench.decode.kv`` (the cache) <- the kernels <- ``specbench.models`` (the
loader) <- the engine. The cache and the verifier reach the extension's host operations only
through ``specbench.accel``.
"""

from __future__ import annotations

import sys

import torch

from specbench.kernels import extension, gqa, native, onednn
from specbench.kernels.native import (attention_like, fused_block_weights, fused_mlp, fused_qkv,  # noqa: F401
                                       heads_like, linear_like)
from specbench.errors import ConfigError, did_you_mean

KERNELS = ("auto", "torch", "onednn", "native")


def resolve(name: str, device: torch.device) -> str:
    """The path a ``kernel=`` setting runs on ``device``: ``auto`` decided, a path this machine
    cannot run refused in one line."""
    if name not in KERNELS:
        raise ConfigError(f"unknown kernel '{name}';{did_you_mean(name, KERNELS)} choices: {', '.join(KERNELS)}")
    if name == "auto":
        if device.type != "cpu":
            return "torch"
        why = extension.unavailable()
        if not why:
            return "native"
        fallback = "onednn" if onednn.available() else "torch"
        if why != extension.NO_AVX2:
            print(f"[specbench] kernel=auto: using {fallback} ({why})", file=sys.stderr)
        return fallback
    if name in ("onednn", "native") and device.type != "cpu":
        raise ConfigError(f"kernel={name} is a CPU path (device is {device.type}); use kernel=torch or auto")
    if name == "onednn" and not onednn.available():
        raise ConfigError("kernel=onednn: this torch build has no oneDNN (torch.backends.mkldnn); use kernel=torch")
    if name == "native" and (why := extension.unavailable()):
        raise ConfigError(f"kernel=native unavailable: {why}; use kernel=onednn or torch")
    return name


def kernel_isa(kernel: str) -> str | None:
    """The vector instructions a resolved path runs its linears with (for the records):
    ``avx512f`` or ``avx2`` for native, None for torch's and oneDNN's own choice."""
    return extension.isa() if kernel == "native" else None


def apply(model: torch.nn.Module, kernel: str) -> int:
    """Put ``model`` on the resolved path ``kernel``; returns how many linear layers changed.
    Idempotent. Every path folds a GQA model's attention (``gqa``)."""
    gqa.fold(model)
    if kernel == "onednn":
        return onednn.apply(model)
    if kernel == "native":
        return native.apply(model)
    return 0


def rows_per_pass(model: torch.nn.Module) -> int | None:
    """How many rows (batch rows x tokens) one pass of ``model``'s linear kernel takes at once, where
    its cost steps up with each further pass (the native tiles: 4 rows with AVX2, 9 with AVX-512);
    None where the cost grows smoothly (torch's and oneDNN's GEMMs)."""
    if kernel_of(model) != "native":
        return None
    return 9 if extension.isa() == "avx512f" else 4


def kernel_of(model: torch.nn.Module) -> str:
    """The path ``apply`` put ``model``'s linear layers on ("torch" if none)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            return getattr(mod, "_specbench_kernel", "torch")
    return "torch"
