"""Prompt lookup decoding (Saxena, 2023): match the last n tokens (n = max_ngram down to
min_ngram) earlier in prompt + output and propose the K tokens that followed the earliest
match. Costs no model: drafts are deterministic candidates.

``lookup`` is the definition (a scan of the whole context); the proposer keeps, per row, an
index of every n-gram's first position, extended by the tokens each step adds, so a step
costs O(new tokens x n-gram sizes) whatever the context length and batch size."""

from __future__ import annotations

from dataclasses import dataclass

from specbench.errors import ConfigError
from specbench.methods.base import BatchState, Proposer
from specbench.settings import setting
from specbench.decode.tree import Draft


def lookup(seq: list[int], K: int, max_ngram: int, min_ngram: int = 1, eos: set[int] = frozenset()) -> list[int]:
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        tail = seq[L - n:]
        first = tail[0]
        for i in range(0, L - n):  # earliest match whose continuation is not empty
            if seq[i] == first and seq[i:i + n] == tail:
                return continuation(seq, i + n, K, eos)
    return []


def continuation(seq: list[int], start: int, K: int, eos: set[int]) -> list[int]:
    """Up to K tokens of ``seq`` from ``start``, cut before an EOS (proposing past one is
    wasted work)."""
    out = seq[start:start + K]
    for j, t in enumerate(out):
        if t in eos:
            return out[:j]
    return out


class NgramIndex:
    """First start position of every n-gram (min_ngram <= n <= max_ngram) of one growing
    sequence; ``lookup`` answers exactly as the module-level ``lookup`` does."""

    def __init__(self, max_ngram: int, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.first: dict[tuple, int] = {}
        self.upto = 0  # positions < upto have had every n-gram that starts there indexed where complete

    def extend(self, seq: list[int]) -> None:
        L = len(seq)
        first = self.first
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(max(0, self.upto - n + 1), L - n + 1):  # the n-grams ending in the new tokens
                first.setdefault(tuple(seq[i:i + n]), i)
        self.upto = L

    def lookup(self, seq: list[int], K: int, eos: set[int] = frozenset()) -> list[int]:
        self.extend(seq)
        L = len(seq)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            i = self.first.get(tuple(seq[L - n:]))
            if i is not None and i < L - n:  # an earlier occurrence, so its continuation is not empty
                return continuation(seq, i + n, K, eos)
        return []


class PromptLookup(Proposer):
    name = "pld"

    @dataclass
    class Settings:  # `pld.<key>=...` is short for `method.<key>=...`
        name: str = "pld"
        max_ngram: int = setting(3, lo=1)  # the longest n-gram looked up first ...
        min_ngram: int = setting(1, lo=1)  # ... down to this one

    cost_kind = "ngram"

    @classmethod
    def check(cls, cfg, target_config) -> None:
        if cfg.method.min_ngram > cfg.method.max_ngram:
            raise ConfigError(f"pld.min_ngram ({cfg.method.min_ngram}) must not exceed pld.max_ngram "
                              f"({cfg.method.max_ngram})")
    per_row = ("index",)  # an n-gram index per row

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.K = int(cfg.K)
        self.max_ngram = int(cfg.method.max_ngram)
        self.min_ngram = int(cfg.method.get("min_ngram", 1))
        self.index: list[NgramIndex] = []

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"index": [NgramIndex(self.max_ngram, self.min_ngram) for _ in state.seqs]}

    def propose(self, state: BatchState) -> Draft | None:
        rows = [ix.lookup(s, self.K, state.eos) for ix, s in zip(self.index, state.seqs)]
        if not any(rows):
            return None
        return Draft.from_lists(rows, state.device)

    def describe(self) -> dict:
        return {"max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``ngram``: the same rule (the longest suffix of max_ngram..min_ngram tokens, its
        earliest earlier match, the K tokens after it); vLLM does not cut a draft at an EOS."""
        return {"method": "ngram", "num_speculative_tokens": int(cfg.K),
                "prompt_lookup_max": int(cfg.method.max_ngram), "prompt_lookup_min": int(cfg.method.get("min_ngram", 1))}
