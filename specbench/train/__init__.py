"""Training drafters by self-distillation from the target: `python -m specbench.train`.

Each drafter kind names its trainer in ``specbench.drafters.KINDS``; ``trainer(kind)`` is that
module. Every trainer has the same interface, so the command line is a lookup:

- ``DATA``: what it trains on: ``"features"`` (the target's hidden states and top-k per token,
  ``train/features.py``), ``"distill"`` (the target's top-k per token, ``train/distill.py``) or
  ``"answers"`` (the distillation set, of which only the target's own answers count);
- ``layers(cfg, num_target_layers)`` (``"features"`` only): the states the feature set stores;
- ``min_seq_len(drafter_cfg)``: the shortest ``train.seq_len`` that holds a position it trains on;
- ``train(cfg, target, tokenizer, items, out, eos, device, progress=True) -> dict``: fits the
  drafter (resumable from ``out/_train_state.pt``); ``{"draft": model, "summary": {...}, ...}``;
- ``finish(cfg, result, out, target_name, data_meta, command)``: writes the checkpoint and its card;
- ``said(summary) -> str``: the held-out scores, in the line the command prints at the end;
- optional, its card's own sections (``specbench.train.card``; without them the card is plain):
  ``card_body(meta) -> list[str]`` (description, data, training) and ``card_use(meta, where) ->
  list[str]`` (the run that picks the checkpoint at ``where``).
"""

from __future__ import annotations

import importlib


def trainer(kind: str):
    """The module that trains drafter ``kind`` (a ``ConfigError`` naming the kinds otherwise)."""
    from specbench import drafters

    return importlib.import_module(drafters.kind(kind).trainer)
