"""specbench's C++ extension (``csrc/``): built once per machine and source version into
``$SPECBENCH_CACHE/kernels`` with the compiler torch's extensions use, then loaded. It holds the
native path's few-row linear kernel (weights packed into panels of output columns), its fused
layer pieces (RMSNorm, RoPE, attention, SiLU-and-multiply, whole blocks and a layer loop) and two
host operations the engine uses once it is loaded (``specbench.accel``)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

from specbench import accel
from specbench.paths import cache_dir, file_lock

SRC = Path(__file__).parent / "csrc" / "few_rows.cpp"
NO_AVX2 = "this CPU has no AVX2/FMA"


@functools.cache
def unavailable() -> str | None:
    """None when the extension can run here (building it on first use), else why not."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return NO_AVX2
    try:
        load()
    except Exception as e:  # no compiler, no Python headers, ...: one line, then the caller falls back
        msg = " ".join(str(e).split())
        return f"the kernel did not build ({type(e).__name__}: {msg[:200]})"
    return None


@functools.cache
def load():
    """Build (once per machine and source version) and load the extension."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]  # FMAs only where the code asks for them
    sources = b"".join(f.read_bytes() for f in sorted(SRC.parent.glob("*.[ch]*")))  # the .cpp and the header it includes
    key = hashlib.sha256(sources + " ".join(flags + [torch.__version__]).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    try:  # torch builds with ninja; the `ninja` package puts it beside the interpreter, maybe not on PATH
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    # torch's own lock (the file ``lock`` in the build directory) outlives a process killed while it
    # held it, and every later load then waits on it forever without a word. Our lock is released
    # by the system when its holder dies: whoever holds it is the only loader, so a ``lock`` found
    # then was left by a killed build and goes.
    with file_lock(build / "specbench.lock"):
        (build / "lock").unlink(missing_ok=True)
        if not any(build.glob("*.so")):
            print(f"[specbench] building the native kernels into {build} (once; ~40 s) ...", file=sys.stderr)
        ext = cpp_extension.load(name=f"specbench_few_rows_{key}", sources=[str(SRC)], build_directory=str(build),
                                 extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False)
    accel.install(argmax=ext.argmax_rows, move=ext.move_slots)
    return ext


def loaded():
    """The extension if this process has loaded it already, else None (nothing is built for it)."""
    return load() if load.cache_info().currsize else None


@functools.cache
def pack_cols() -> int:
    """Columns per panel of ``pack``: 48 where an AMD CPU has AVX-512F (the kernel's AVX-512 tiles:
    three 16-column vectors per k side by side, one pass for up to 9 rows; tuned on a Zen 4), else
    8 (AVX2; on an Intel Xeon with AVX-512 the AVX2 tiles took 0.79-0.92x their time:
    docs/benchmarks/2026-11-27-methods-2026-cpu.md). ``SPECBENCH_AVX512=1`` takes the AVX-512 tiles
    on any CPU that has them, ``0`` never, for an A/B. Either width gives the same bits."""
    want = os.environ.get("SPECBENCH_AVX512")
    if want == "0" or not load().has_avx512():
        return 8
    return 48 if want == "1" or not load().is_intel() else 8


def isa() -> str:
    """The vector instructions the kernel's tiles use here (for the records)."""
    return "avx512f" if pack_cols() == 48 else "avx2"


def pack(w: torch.Tensor, cols: int | None = None) -> torch.Tensor:
    """[O, I] -> [ceil(O/cols), I, cols]: blocks of ``cols`` output columns (``pack_cols()`` if
    None), each one contiguous stream (the kernel's layout)."""
    cols = cols or pack_cols()
    O, I = w.shape
    blocks = -(-O // cols)
    w = torch.nn.functional.pad(w.detach(), (0, 0, 0, blocks * cols - O))
    return w.view(blocks, cols, I).transpose(1, 2).contiguous()


def few_rows_linear(x: torch.Tensor, wp: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` for an fp32 ``x`` of any leading shape through the kernel (``wp = pack(W)``)."""
    return load().few_rows_linear(x, wp, out_features)
