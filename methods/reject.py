"""A draft that is always rejected: every step verifies K copies of one fixed token (a
chain) that the target almost never predicts, so nearly every step accepts nothing and
emits the target's own next token. Output equals AR's; what changes is the kernel shape
(K+1 tokens per forward instead of 1) and the verification bookkeeping. Two uses:

- the identity floor: in bf16 (or any low precision) AR and AR-through-the-verify-path can
  disagree on near-ties only because a forward over K+1 tokens rounds differently from one
  over 1 token. ``match_ar`` of ``reject`` with K=1 is that floor; a method's own divergence
  should sit at it (``make bench NAME=floor``);
- the price of verification with nothing to gain: its slowdown against AR is T(K+1)/T(1)
  plus the engine's per-step overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specbench.methods.base import BatchState, Proposer
from specbench.decode.tree import Draft
from specbench.errors import ConfigError


class Reject(Proposer):
    name = "reject"

    @dataclass
    class Settings:
        name: str = "reject"
        token: Optional[int] = None  # a token id, or null = the tokenizer's BOS

    @classmethod
    def check(cls, cfg, target_config) -> None:
        t = cfg.method.get("token")
        vocab = int(getattr(target_config, "vocab_size", 0) or 0)
        if t is not None and not 0 <= t < (vocab or t + 1):
            raise ConfigError(f"reject.token must be a token id in 0..{vocab - 1} or null (the tokenizer's BOS), "
                              f"got {t!r}")

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        t = cfg.method.get("token")
        if t is None:  # a control token: the target does not emit it in running text
            t = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
        self.token = int(t if t is not None else 0)
        self.K = int(cfg.K)

    def propose(self, state: BatchState) -> Draft:
        tokens = torch.full((len(state.seqs), self.K), self.token, dtype=torch.long, device=state.device)
        return Draft.chain(tokens)

    def describe(self) -> dict:
        return {"token": self.token}
