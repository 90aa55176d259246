"""Lookahead decoding (Fu et al. 2024, arXiv 2402.02057).

No draft model: one target forward per step carries two branches.

- Lookahead branch: a 2D window of ``N - 1`` levels x ``W`` columns of guessed tokens
  (Jacobi iteration). Token (level l, column c) sits at position root + 1 + c + l and sees
  the level-0 tokens of columns 0..c and the tokens of column c on levels 1..l (the
  paper's mask). That visibility is exactly "ancestors in a tree": (0, c)'s parent is
  (0, c - 1) (the root for c = 0) and (l, c)'s parent is (l - 1, c); so the window goes to
  the engine as ordinary tree nodes marked ``candidate = False`` (never accepted), and
  the engine hands back the target's outputs at them (``state.logits``).
  After the step the target's argmax at the last level becomes a new level; with the
  window full, column c yields the N-gram (level 0..N-2 of column c, new token), which
  goes to the pool, and level 0 is dropped.
- Verification branch: up to ``G`` N-grams from the row's pool whose first token is the
  root (the last emitted token), merged into a trie of their N - 1 continuation tokens,
  verified as deterministic candidates (greedy, or the lossless rule when sampling).

The pool is per row and also holds the N-grams of the prompt and of the committed output.
Levels start as tokens drawn from the prompt (seeded by the prompt itself, so a row's
output never depends on its batch) and fill one level per step.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from specbench.methods.base import BatchState, Proposer
from specbench.decode.tree import Draft, prefix_tree
from specbench.errors import ConfigError
from specbench.decode.verify import greedy_pick


# W, N and G by device (`auto`). On a GPU a verify of W*(N-1) + G*(N-1) = 42 nodes costs about
# what one token does (the paper's smaller settings); on a CPU every node costs, so the window and
# the guesses stay small there: 7 rows, within two passes of the native kernel (docs/tuning.md).
AUTO = {"cuda": {"W": 7, "N": 4, "G": 7}, "cpu": {"W": 1, "N": 3, "G": 2}}
# the (W, N, G) K=auto chooses among, around each device's AUTO
TUNE = {"cuda": [(3, 3, 3), (5, 4, 5), (7, 4, 7), (10, 5, 10), (15, 5, 15)],
        "cpu": [(1, 2, 1), (1, 3, 1), (1, 3, 2), (2, 3, 2), (2, 4, 2), (3, 4, 3)]}


def _positive_int(name, v, lo):
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ConfigError(f"lookahead.{name} must be 'auto' or an integer >= {lo}, got {v!r}")


def settings(m, device_type: str) -> tuple[int, int, int]:
    """(W, N, G) of a method config on a device: `auto` keys take that device's AUTO entry."""
    auto = AUTO.get(device_type, AUTO["cpu"])
    return tuple(auto[k] if m[k] == "auto" else m[k] for k in ("W", "N", "G"))


class Pool:
    """N-grams of one row: first token -> up to ``cap`` continuations (tuples of N - 1
    tokens), most recently seen last."""

    def __init__(self, cap: int):
        self.cap = cap
        self.map: dict[int, OrderedDict] = {}

    def add(self, gram) -> None:
        key, rest = int(gram[0]), tuple(int(t) for t in gram[1:])
        d = self.map.setdefault(key, OrderedDict())
        d.pop(rest, None)
        d[rest] = None
        if len(d) > self.cap:
            d.popitem(last=False)

    def add_all(self, seq, n: int) -> None:
        for i in range(len(seq) - n + 1):
            self.add(seq[i:i + n])

    def get(self, key: int) -> list[tuple]:
        d = self.map.get(int(key))
        return list(reversed(d)) if d else []


class Lookahead(Proposer):
    name = "lookahead"

    @dataclass
    class Settings:  # `lookahead.<key>=...` is short for `method.<key>=...`
        name: str = "lookahead"
        W: Any = "auto"  # window columns (lookahead tokens per level; auto: 7 CUDA, 1 CPU)
        N: Any = "auto"  # N-gram size: N-1 window levels, N-1 draft tokens per guess (auto: 4 CUDA, 3 CPU)
        G: Any = "auto"  # N-grams verified per step (the paper sets G = W; auto: 7 CUDA, 2 CPU)
        pool_cap: Optional[int] = None  # continuations kept per first token (null = G)
        prompt_ngrams: bool = True  # seed the pool with the prompt's N-grams
    cost_kind = "ngram"
    per_row = ("levels", "pools", "n_window")  # the window, n-gram pool and window size per row

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        for key, lo in (("W", 1), ("N", 2), ("G", 0)):
            if m[key] != "auto":
                _positive_int(key, m[key], lo)
        for dev in AUTO:  # the device is not known yet: every device's `auto` must fit
            W, N, G = settings(m, dev)
            if W * (N - 1) + G * (N - 1) > 512:
                raise ConfigError(f"lookahead: W*(N-1) + G*(N-1) = {W * (N - 1) + G * (N - 1)} nodes per step "
                                  "is more than 512; lower W, N or G")

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the window and the guesses: (W, N, G) triples."""
        return [{"method.W": w, "method.N": n, "method.G": g} for w, n, g in TUNE.get(device.type, TUNE["cpu"])]

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        return settings(cfg.method, device.type)[1] - 1  # candidates of N-1 tokens; cfg.K plays no part

    @classmethod
    def reach(cls, cfg, device) -> int:
        W, N, _ = settings(cfg.method, device.type)
        return max(W + N - 2, N - 1)  # window node (level l, column c) sits at depth c + 1 + l

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.W, self.N, self.G = settings(m, device.type)
        self.pool_cap = int(m.get("pool_cap") or max(self.G, 1))
        self.from_prompt = bool(m.get("prompt_ngrams", True))
        self.levels: list[list[list[int]]] = []
        self.pools: list[Pool] = []
        self.n_window: list[int] = []  # window nodes each row had in the last draft

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        new = {"levels": [], "pools": [], "n_window": []}
        for s, plen in zip(state.seqs, state.prompt_lens):
            new["n_window"].append(0)
            prompt = s[:plen]
            rng = random.Random(len(prompt) * 1000003 + sum(prompt[-64:]))
            new["levels"].append([[rng.choice(prompt) for _ in range(self.W)]])
            pool = Pool(self.pool_cap)
            if self.from_prompt:
                pool.add_all(s, self.N)
            new["pools"].append(pool)
        return new

    def propose(self, state: BatchState) -> Draft | None:
        rows_tok, rows_par, rows_cand = [], [], []
        W = self.W
        for b, s in enumerate(state.seqs):
            toks, pars = [], []
            for li, level in enumerate(self.levels[b]):
                for c, t in enumerate(level):
                    toks.append(t)
                    # 1-based node index of the parent: (l-1, c), or (0, c-1), or the root
                    pars.append((li - 1) * W + c + 1 if li else c)
            nw = len(toks)
            grams = self.pools[b].get(s[-1])[: self.G] if self.G else []
            ct, cp = prefix_tree(grams, nw)
            rows_tok.append(toks + ct)
            rows_par.append(pars + cp)
            rows_cand.append([False] * nw + [True] * len(ct))
        self.n_window = [sum(1 for c in r if not c) for r in rows_cand]
        return Draft.from_trees(rows_tok, rows_par, state.device, candidate=rows_cand)

    def host(self, state: BatchState):
        """The target's guess at each window node (read with the step's verdict)."""
        if state.logits is not None and max(self.n_window, default=0) > 0:
            return greedy_pick(state.logits[:, 1:1 + max(self.n_window)])
        return None

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        W = self.W
        out = self.host_rows(state)
        for b, s in enumerate(state.seqs):
            pool = self.pools[b]
            k = len(accepted[b]) + 1  # tokens committed this step: their N-grams join the pool
            for i in range(max(0, len(s) - k - self.N + 1), len(s) - self.N + 1):
                pool.add(s[i:i + self.N])
            levels = self.levels[b]
            if out is None or self.n_window[b] == 0:
                continue
            last = len(levels) - 1
            new = out[b][last * W:(last + 1) * W]
            if len(levels) == self.N - 1:
                for c in range(W):
                    pool.add([lv[c] for lv in levels] + [new[c]])
                levels.pop(0)
            levels.append(new)


    def describe(self) -> dict:
        return {"W": self.W, "N": self.N, "G": self.G, "pool_cap": self.pool_cap, "prompt_ngrams": self.from_prompt}
