"""Speculative sampling with a draft model (Leviathan et al. 2023; Chen et al. 2023).

The draft runs K autoregressive steps per engine step on its own per-row cache and hands
the engine a chain with the distributions it sampled from; the engine verifies it
(greedy match, or min(1, p/q) acceptance with residual resampling).
"""

from __future__ import annotations

import torch

from methods.base import BatchState, Proposer
from specbench.draft import Draft
from specbench.kv import RaggedCache
from specbench.models import text_config
from specbench.verify import sample, warp


class Leviathan(Proposer):
    name = "leviathan"

    def __init__(self, cfg, target, tokenizer, device, dtype, draft_model=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.K = int(cfg.K)
        if draft_model is None:
            from specbench.runner import load_draft_model

            draft_model = load_draft_model(cfg, target, device, dtype)
        self.draft = draft_model
        self.V = int(text_config(target.config).vocab_size)
        self.dcache: RaggedCache | None = None
        self.fed: list[list[int]] = []

    def modules(self):
        return [self.draft]

    def start(self, state: BatchState) -> None:
        self.dcache = RaggedCache(self.draft, self.device, self.dtype)
        prompts = [s[:-1] for s in state.seqs]
        self.dcache.prefill(prompts)
        self.fed = [list(p) for p in prompts]

    def _pick(self, logits: torch.Tensor, state: BatchState):
        logits = logits[..., : self.V]
        if state.sampling.greedy:
            return logits.argmax(-1), None
        q = warp(logits, state.sampling)
        return sample(q, state.gen), q

    def propose(self, state: BatchState) -> Draft:
        B = len(state.seqs)
        # 1. roll the draft cache back to what still agrees with the committed sequence
        keep_len = []
        for b in range(B):
            fed, seq = self.fed[b], state.seqs[b]
            n = min(len(fed), len(seq) - 1)
            # the fed tokens differ from seq only in the last K positions
            j = max(0, n - self.K - 1)
            while j < n and fed[j] == seq[j]:
                j += 1
            del fed[j:]
            keep_len.append(j)
        self.dcache.rollback(torch.tensor(keep_len, dtype=torch.long, device=self.device))
        # 2. catch up on the tokens it has not seen (1 or 2 per row) and draft token 1
        news = [state.seqs[b][keep_len[b]:] for b in range(B)]
        m = max(len(x) for x in news)
        toks = torch.zeros(B, m, dtype=torch.long)
        for b, x in enumerate(news):
            toks[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        toks = toks.to(self.device)
        counts = torch.tensor([len(x) for x in news], dtype=torch.long, device=self.device)
        depth = torch.arange(m, device=self.device)[None].expand(B, m)
        out = self.dcache.forward(toks, depth, None)
        self.dcache.commit(depth, counts)
        last = out.logits[torch.arange(B, device=self.device), counts - 1]
        for b, x in enumerate(news):
            self.fed[b].extend(x)
        tok, q = self._pick(last, state)
        drafts, qs = [tok], [q]
        ones = torch.ones(B, dtype=torch.long, device=self.device)
        zero = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        # 3. K-1 more single-token steps
        for _ in range(self.K - 1):
            out = self.dcache.forward(tok[:, None], zero, None)
            self.dcache.commit(zero, ones)
            for b, t in enumerate(tok.tolist()):
                self.fed[b].append(t)
            tok, q = self._pick(out.logits[:, -1], state)
            drafts.append(tok)
            qs.append(q)
        tokens = torch.stack(drafts, dim=1)
        qt = None if state.sampling.greedy else torch.stack(qs, dim=1)
        return Draft.chain(tokens, q=qt)

    def select_rows(self, keep: list[int]) -> None:
        self.fed = [self.fed[i] for i in keep]
        self.dcache.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))

    def describe(self) -> dict:
        return {"draft_params": sum(p.numel() for p in self.draft.parameters())}
