"""Host operations a backend may do faster than torch: the cache's slot moves and the engine's
argmax. Empty until a backend installs its own (``specbench.kernels.extension`` does when the
native extension loads); the cache and the verifier read them here, so they import no backend."""

from __future__ import annotations

from typing import Callable

# argmax_rows(logits [R, V] fp32, contiguous rows) -> [R] int64: the first index on ties
argmax_rows: Callable | None = None
# move_slots(views, rows, src, dst): the same slots moved within every cache tensor (fp32 CPU)
move_slots: Callable | None = None


def install(argmax=None, move=None) -> None:
    global argmax_rows, move_slots
    argmax_rows, move_slots = argmax, move
