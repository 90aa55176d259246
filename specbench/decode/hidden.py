"""Target hidden states for methods that draft from them (Medusa, EAGLE).

A method names the layers it needs in ``Proposer.hidden_layers``: ``"final"`` is the
last hidden state after the final norm (what the output layer reads), an integer ``i`` is
the output of decoder layer ``i`` (negative counts from the end). ``Tap`` catches those
tensors with forward hooks during the target's forwards, so no forward returns every
layer's states. ``Hidden`` is what the engine hands ``Proposer.start`` / ``update``: per
layer a ``[B, m, d]`` tensor whose first ``counts[b]`` rows are row b's newly committed
tokens, in order; ``lens`` is ``counts`` on the host (no read: the engine knows them).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class Hidden:
    layers: dict  # layer name -> [B, m, d] tensor
    counts: torch.Tensor  # [B] long
    lens: list[int] | None = None  # counts as host ints

    def __post_init__(self):
        if self.lens is None:  # made outside the engine (which knows them): read once
            self.lens = self.counts.tolist()

    def last(self, layer="final") -> torch.Tensor:
        """[B, d]: each row's hidden state at its last new token."""
        h = self.layers[layer]
        return h[torch.arange(h.shape[0], device=h.device), self.counts - 1]

    def gather(self, index: torch.Tensor, counts: torch.Tensor, lens: list[int] | None = None) -> "Hidden":
        """Rows of every layer at ``index`` [B, m] (node indices of the last forward); ``counts``
        of them are row b's (``lens`` on the host)."""
        idx = index[..., None]
        return Hidden({k: v.gather(1, idx.expand(-1, -1, v.shape[-1])) for k, v in self.layers.items()}, counts,
                      lens)


def decoder_layers(model):
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise ValueError(f"{type(model).__name__}: hidden states need a decoder with .model.layers and .model.norm")
    return base, layers, norm


class Tap:
    """Forward hooks that keep the outputs of the named layers of the last forward."""

    def __init__(self, model, names):
        self.model, self.names = model, tuple(names)
        self.out: dict = {}
        self._handles = []
        self._register()

    def _register(self) -> None:
        if not self.names:
            return
        _, layers, norm = decoder_layers(self.model)
        for name in self.names:
            mod = norm if name == "final" else layers[int(name)]
            self._handles.append(mod.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def fn(_m, _a, out):
            self.out[name] = out[0] if isinstance(out, tuple) else out
        return fn

    @contextmanager
    def paused(self):
        """Its hooks off for the block (a graph's forward taps with hooks of its own: the engine's,
        made anew each serve, must not be traced into it)."""
        handles, self._handles = self._handles, []
        for h in handles:
            h.remove()
        try:
            yield
        finally:
            self._handles = []
            if handles:
                self._register()

    def take(self) -> dict:
        out, self.out = self.out, {}
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
