"""SpecDec's Spec-Drafter (Xia et al. 2023, arXiv 2203.16487), adapted to a decoder-only target.

The paper's drafter is a non-autoregressive model: after the context it reads ``k`` [MASK]
queries and predicts all ``k`` draft tokens in one forward pass. Here it is a ``DraftLM``
(the target's token embedding, shared and frozen; a few transformer layers of its own,
initialised from the target's first layers; the target's output layer restricted to a
draft vocabulary) plus ``k`` learned query embeddings. Query ``j`` sits at position
``L + j`` (``L`` = context length), sees the whole context and every query (the queries
attend to each other both ways, as the paper's NAR decoder does), and predicts the token at
``L + j``.

Query ``j`` is fed as the token id ``vocab_size + j``: the engine's ragged cache and every
other piece of the drafter see plain token ids.
"""

from __future__ import annotations

import torch
from torch import nn

from specbench.drafters.draft_lm import DraftLM


class SpecDrafter(DraftLM):
    kind = "specdec"

    def __init__(self, target, n_layers: int, vocab_ids: torch.Tensor, k: int, init_from_target: bool = True):
        super().__init__(target, n_layers, vocab_ids, init_from_target=init_from_target)
        if k < 1:
            raise ValueError(f"a Spec-Drafter needs k >= 1 queries, got {k}")
        self.k = int(k)
        emb = target.get_input_embeddings()
        with torch.no_grad():
            probe = emb(torch.arange(min(4096, self.vocab_size), device=emb.weight.device)).float()
            g = torch.Generator().manual_seed(0)
            noise = torch.randn(self.k, probe.shape[-1], generator=g) * probe.std(0).cpu()
        # each query starts as the mean token embedding plus noise of the embeddings' own scale
        self.queries = nn.Parameter((probe.mean(0).cpu()[None] + noise).to(emb.weight.dtype))

    def query_ids(self, device=None) -> torch.Tensor:
        return torch.arange(self.vocab_size, self.vocab_size + self.k, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_q = input_ids >= self.vocab_size
        e = self.body.embed_tokens(input_ids.clamp(max=self.vocab_size - 1))
        q = self.queries.to(e.dtype)[(input_ids - self.vocab_size).clamp(0, self.k - 1)]
        return torch.where(is_q[..., None], q, e)  # no test of is_q on the host: nothing waits


def build(meta: dict, state: dict, target) -> SpecDrafter:
    return SpecDrafter(target, int(meta["layers"]), state["vocab_ids"], int(meta["k"]), init_from_target=True)
