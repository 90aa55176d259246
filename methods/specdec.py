"""SpecDec (Xia et al. 2023, arXiv 2203.16487) on a decoder-only target.

Spec-Drafting: a non-autoregressive Spec-Drafter (``specbench.drafters.specdec``) reads
the context and K [MASK] queries and proposes K tokens in ONE forward of its own (catching
up on the tokens committed since the last step in the same forward). Spec-Verification:
greedy, a draft token passes when it is among the target's top-``beta`` and its
log-probability is within ``tol`` of the top-1's (lossy when beta > 1, recorded
``lossless: false``; beta = 1 is exact greedy). Under sampling the draft tokens are drawn
from the queries' distributions and verified by the lossless rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.methods.base import BatchState, Proposer
from specbench import drafters
from specbench.decode.tree import Draft, pad_rows
from specbench.decode.kv import RaggedCache
from specbench.drafters.cache import draft_cache
from specbench.errors import ConfigError
from specbench.paths import resolve_path
from specbench.decode.verify import Sampling, greedy_pick, sample, warp


class SpecDec(Proposer):
    name = "specdec"

    @dataclass
    class Settings:  # `specdec.<key>=...` is short for `method.<key>=...`
        name: str = "specdec"
        checkpoint: str = "checkpoints/smollm2-135m/specdec"  # python -m specbench.train drafter=specdec target=<model>
        beta: int = 1  # greedy: accept a draft token among the target's top-beta (1 = exact; > 1 is lossy)
        tol: float = 1.0  # ... whose log-probability is within tol of the top-1's

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        if m.beta < 1:
            raise ConfigError(f"specdec.beta must be an integer >= 1 (1 = exact greedy), got {m.beta!r}")
        if m.tol <= 0:
            raise ConfigError(f"specdec.tol must be a number > 0 (log-probability gap to the top-1), got {m.tol!r}")
        folder = resolve_path(m.checkpoint)
        drafters.check_fits(folder, cfg, target_config, "specdec", "specdec.checkpoint")
        k = int(drafters.read_meta(folder)["k"])
        if not isinstance(cfg.K, int) or not 1 <= cfg.K <= k:
            raise ConfigError(f"K={cfg.K!r}: the Spec-Drafter in '{m.checkpoint}' has {k} queries; use K in 1..{k}")

    @classmethod
    def draft_label(cls, cfg) -> str:
        return str(cfg.method.checkpoint)

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.specdec import SpecDrafter

        d = SpecDrafter(target, 1, torch.arange(target.config.vocab_size), 3)  # the target's first layer, random queries
        return {"K": 3, "method": {"checkpoint": drafters.save_random(d, folder / "specdec", "specdec", None, target,
                                                                      layers=1, k=3)}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        if drafter is None:
            drafter = drafters.load(resolve_path(m.checkpoint), target, device, dtype, kind="specdec")
        self.drafter = drafter
        self.K = min(int(cfg.K), drafter.k)
        self.beta, self.tol = int(m.beta), float(m.tol)
        self.relaxed = (self.beta, self.tol) if self.beta > 1 else None
        self.lossless = self.relaxed is None or not Sampling.of(cfg).greedy
        self.queries = drafter.query_ids(device)[: self.K]
        self.dcache: RaggedCache | None = None
        self.fed: list[int] = []

    def modules(self):
        return [self.drafter]

    # the drafter's cache of each row (a DraftRaggedCache; compile=graphs: drafters.cache.draft_cache)
    # and how many of its tokens it holds (fed);
    # the base keeps both as rows leave and join
    per_row = ("dcache", "fed")

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        room = state.max_new_tokens + 2 * self.K + 2  # every token the batch may add, a step's queries after them
        dcache = draft_cache(self.drafter, state, self.device, self.dtype, room=room, rows=state.rows, wider=True)
        dcache.prefill([s[:-1] for s in state.seqs], room=room)
        return {"dcache": dcache, "fed": [len(s) - 1 for s in state.seqs]}

    def propose(self, state: BatchState) -> Draft:
        B, K, dev = len(state.seqs), self.K, self.device
        news = [s[f:] for s, f in zip(state.seqs, self.fed)]  # committed, not yet seen: 1..K+1 per row
        m = max(len(x) for x in news)
        toks = pad_rows(news, dev, width=m + K)
        toks[:, m:] = self.queries
        counts = torch.tensor([len(x) for x in news], dtype=torch.long, device=dev)
        i = torch.arange(m + K, device=dev)
        is_q = i >= m
        # new tokens: causal among themselves; queries: the row's real new tokens and every query
        anc = (i[:, None] >= i[None, :]) & ~is_q[None, :]
        anc = anc[None].expand(B, -1, -1).clone()
        anc[:, m:, :m] = (i[None, :m] < counts[:, None])[:, None, :]
        anc[:, m:, m:] = True
        depth = torch.where(is_q[None], counts[:, None] + (i - m)[None], i[None].expand(B, -1))
        out = self.dcache.forward(toks, depth, anc)
        self.dcache.commit([list(range(m))] * B, [len(x) for x in news])  # the queries are never kept
        self.fed = [f + len(x) for f, x in zip(self.fed, news)]
        logits = out.logits[:, m:]
        if state.sampling.greedy:
            return Draft.chain(greedy_pick(logits), relaxed=self.relaxed)
        q = warp(logits, state.sampling)  # each query's own distribution: the exact q its token is drawn from
        return Draft.chain(sample(q.flatten(0, 1), state.gen).view(B, K), q=q)

    def describe(self) -> dict:
        return {"beta": self.beta, "tol": self.tol, "queries": self.K, "draft_layers": len(self.drafter.body.layers),
                "draft_vocab": int(self.drafter.vocab_ids.numel())}
