"""P-EAGLE's drafter (AWS, arXiv 2602.01469): EAGLE-3's drafter (``drafters/eagle3.py``) that drafts
all K tokens of a step in one forward, with mask slots.

An entry is (a token embedding, a fused feature) at a position: a verified position i reads the
target's fused taps h_i and the token after it, x_{i+1} (EAGLE-3's pairing); mask slot d of a step
reads the embedding of the mask token and ``fc(mask_hidden)``, a learned stand-in for the feature
it does not have. The first layer is EAGLE-3's (q/k/v over [embedding ; feature], the feature the
residual), the others are Llama decoder layers. Attention is causal over verified entries; mask
slot d also sees the slots 1..d of its own step:

    step at the last verified position p-1 (its entry (h_{p-1}, x_p)):
      entry p-1 drafts x_{p+1};  slot d (at position p-1+d) drafts x_{p+1+d},  d = 1..K-1

so the verified entries' keys and values are kept per layer (``cache.DrafterCache``) and a step
runs the K-1 mask slots over them. Trained with the speculators recipe: every position a depth-0
entry, and for sampled anchors a chain of mask slots (``train_forward``).
"""

from __future__ import annotations

import torch
from torch import nn

from specbench.drafters.cache import join
from specbench.drafters.eagle3 import Eagle3Drafter
from specbench.drafters.layers import LlamaLayer


class PEagleDrafter(Eagle3Drafter):
    kind = "peagle"

    def __init__(self, target, config, draft_vocab: int, mask_token_id: int, depths: int,
                 target_hidden: int | None = None, layers=None, fc_norm: bool = False, norm_output: bool = False):
        """EAGLE-3's arguments; ``config.num_hidden_layers`` layers (the first EAGLE-3's),
        ``mask_token_id`` the mask slots' token, ``depths`` the drafts a step it was trained for."""
        super().__init__(target, config, draft_vocab, target_hidden, layers, fc_norm, norm_output)
        self.more = nn.ModuleList(LlamaLayer(self.config) for _ in range(int(self.config.num_hidden_layers) - 1))
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, len(self.taps) * (target_hidden or self.config.hidden_size)))
        self.mask_token_id, self.depths = int(mask_token_id), int(depths)

    @property
    def layers(self) -> list[nn.Module]:
        """Every layer, first to last (what ``DrafterCache`` keeps keys and values for)."""
        return [self.block, *self.more]

    def run(self, g, e, pos, ctx, visible):
        """Entries with features ``g`` [B, n, d] and embeddings ``e`` at ``pos`` [B, n] over the
        kept keys/values ``ctx`` (per layer a ``cache.Scratch`` or (k, v) [B, Hk, W, Dh]) where ``visible`` [B, n, W + n].
        Returns the last layer's output [B, n, d] and the entries' own (k, v) per layer."""
        cos, sin = self.own_rope(g, pos)
        q, k, v = self.block.qkv(e, g, cos, sin)
        kv = [(k, v)]
        x = self.block.attend(g, q, *join(ctx[0], k, v), visible)
        for layer, c in zip(self.more, ctx[1:]):
            q, k, v = layer.qkv(x, cos, sin)
            kv.append((k, v))
            x = layer.attend(x, q, *join(c, k, v), visible)
        return self.output(x), kv

    def mask_entries(self, rows: int, n: int):
        """The features and embeddings [rows, n, d] of ``n`` mask slots."""
        g = self.fuse(self.mask_hidden).expand(rows, n, -1)
        tok = torch.full((rows, n), self.mask_token_id, dtype=torch.long, device=g.device)
        return g, self.embed(tok).to(g.dtype)

    def train_forward(self, taps, tokens, anchor, depth):
        """One sequence's entries as speculators trains them: ``taps`` [1, T, n x H] and ``tokens``
        [1, T] (the token after each position), entry j at position anchor[j] + depth[j] -- a
        verified entry where depth is 0, else a mask slot of anchor[j]'s chain. Entry q sees the
        verified entries up to its anchor and its chain's slots up to its depth. Returns the
        outputs [1, N, d]."""
        at = anchor + depth
        real = (depth == 0)[None, :, None]
        src = at.clamp(0, taps.shape[1] - 1)  # a mask slot may sit past the data: it reads neither
        g_real, e_real = self.fuse(taps[:, src]), self.embed(tokens[:, src])
        g_mask, e_mask = self.mask_entries(1, len(at))
        g = torch.where(real, g_real, g_mask)
        e = torch.where(real, e_real.to(g.dtype), e_mask)
        seen = ((depth[None, :] == 0) & (anchor[None, :] <= anchor[:, None])) | (
            (anchor[None, :] == anchor[:, None]) & (depth[None, :] <= depth[:, None]))
        empty = [(g.new_zeros(1, lay.Hk, 0, lay.Dh),) * 2 for lay in self.layers]
        return self.run(g, e, at[None], empty, seen[None])[0]
