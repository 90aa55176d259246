"""The proposer interface. A method only proposes: the engine verifies, accepts, commits
the KV cache and measures. A method never times itself nor writes metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbench.draft import Draft
from specbench.verify import Sampling


@dataclass
class BatchState:
    """What the engine shows a method. Rows are the batch's unfinished rows, in order."""

    seqs: list[list[int]]  # prompt + emitted tokens per row; the last one is not in the target cache yet
    prompt_lens: list[int]
    sampling: Sampling
    gen: torch.Generator | None
    device: torch.device
    eos: set[int] = field(default_factory=set)
    extra: dict = field(default_factory=dict)


class Proposer:
    name = "base"
    lossless = True  # False for relaxed acceptance rules; recorded with every job
    needs_hidden = False  # True: the engine passes target hidden states of kept nodes to update()

    def __init__(self, cfg, target, tokenizer, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.target = target
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype

    def modules(self) -> list[torch.nn.Module]:
        """Extra models the method runs (their forward time counts as model time)."""
        return []

    def start(self, state: BatchState) -> None:
        """A new batch was prefilled; ``state.seqs`` hold prompt + first token."""

    def propose(self, state: BatchState) -> Draft | None:
        """Return a draft tree per row, or None to take a plain decoding step."""
        return None

    def update(self, state: BatchState, accepted: list[list[int]], hidden=None) -> None:
        """After a step: ``accepted[b]`` are row b's accepted draft tokens; ``state.seqs``
        already hold them plus the extra token."""

    def select_rows(self, keep: list[int]) -> None:
        """Finished rows left the batch: keep only the rows at these indices."""

    def describe(self) -> dict:
        """Method-specific fields recorded with the job."""
        return {}
