"""Bigram chain drafting: each row's own context as a successor table. Every token points at the
token that followed it (its latest or its first occurrence); a draft starts at the row's last
token and follows the table for up to K tokens. No model, deterministic candidates, lossless
under the engine's verification. A training-free method in the spirit of prompt lookup, kept
small: it is here to show what a method from another package needs, not to win.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbench.api import BatchState, ConfigError, Draft, Proposer


@dataclass
class BigramSettings:
    """``bigram.<key>=...`` on the command line; Hydra checks the types."""

    name: str = "bigram"
    successor: str = "latest"  # which earlier successor a token proposes: latest or first
    max_draft: int = 0  # draft length cap below K (0: K)


class BigramChain(Proposer):
    name = "bigram"
    Settings = BigramSettings
    per_row = ("tables", "seen")  # the base keeps them as rows leave and join

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        if m.successor not in ("latest", "first"):
            raise ConfigError(f"bigram.successor must be latest or first, got {m.successor!r}")
        if m.max_draft < 0:
            raise ConfigError(f"bigram.max_draft must be >= 0, got {m.max_draft}")

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        cap = int(cfg.method.max_draft)
        return min(int(cfg.K), cap) if cap else int(cfg.K)

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.K = self.spec_len(cfg, device)
        self.latest = cfg.method.successor == "latest"
        self.tables: list[dict[int, int]] = []
        self.seen: list[int] = []  # per row: the positions whose successor is in the table

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"tables": [{} for _ in state.seqs], "seen": [0] * len(state.seqs)}

    def _extend(self, b: int, seq: list[int]) -> None:
        table = self.tables[b]
        for i in range(max(self.seen[b], 0), len(seq) - 1):
            if self.latest or seq[i] not in table:
                table[seq[i]] = seq[i + 1]
        self.seen[b] = max(len(seq) - 1, 0)

    def propose(self, state: BatchState) -> Draft | None:
        rows = []
        for b, seq in enumerate(state.seqs):
            self._extend(b, seq)
            table, out, t = self.tables[b], [], seq[-1]
            while len(out) < self.K and t in table and t not in state.eos:
                t = table[t]
                if t in state.eos:
                    break
                out.append(t)
            rows.append(out)
        if not any(rows):
            return None
        return Draft.from_lists(rows, state.device)

    def describe(self) -> dict:
        return {"successor": "latest" if self.latest else "first"}
