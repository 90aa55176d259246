"""Prompt lookup decoding (Saxena, 2023): match the last n tokens (n = max_ngram down to
min_ngram) earlier in prompt + output and propose the K tokens that followed the earliest
match. Costs no model: drafts are deterministic candidates."""

from __future__ import annotations

from methods.base import BatchState, Proposer
from specbench.draft import Draft


def lookup(seq: list[int], K: int, max_ngram: int, min_ngram: int = 1, eos: set[int] = frozenset()) -> list[int]:
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail = seq[L - n:]
        first = tail[0]
        for i in range(0, L - n):  # earliest match whose continuation is not empty
            if seq[i] == first and seq[i:i + n] == tail:
                out = seq[i + n:min(i + n + K, L)]
                for j, t in enumerate(out):  # proposing past an EOS is wasted work
                    if t in eos:
                        return out[:j]
                return out
    return []


class PromptLookup(Proposer):
    name = "pld"

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.K = int(cfg.K)
        self.max_ngram = int(cfg.method.max_ngram)
        self.min_ngram = int(cfg.method.get("min_ngram", 1))

    def propose(self, state: BatchState) -> Draft | None:
        rows = [lookup(s, self.K, self.max_ngram, self.min_ngram, state.eos) for s in state.seqs]
        if not any(rows):
            return None
        return Draft.from_lists(rows, state.device)

    def describe(self) -> dict:
        return {"max_ngram": self.max_ngram, "min_ngram": self.min_ngram}
