"""EAGLE's feature-level drafter (Li et al. 2024, arXiv 2401.15077; the dynamic tree of
EAGLE-2, arXiv 2406.16858, is drafted by ``methods/eagle.py``).

Autoregression on the target's features instead of its tokens. Pair ``i`` is the target's
last hidden state ``f_i`` (after the final norm, what the output layer reads) and the
embedding of the token that followed it, ``x_{i+1}``:

    g_i = fc([embed(x_{i+1}); f_i])            2d -> d
    h_{i+1} = Block(g_0..g_i)                  one decoder layer, causal, RoPE position i
    logits(x_{i+2}) = head(h_{i+1})            the target's output layer (draft vocabulary rows)

``h_{i+1}`` is trained to be ``f_{i+1}`` (smooth L1) and its logits to match the target's
distribution (soft cross-entropy). While drafting, a predicted ``h`` stands in for the
feature the target has not computed yet, so the drafter runs ahead of the target for
several tokens. The embedding, the output layer and the rotary tables are the target's.

Training-time test (EAGLE-3, arXiv 2503.01840): ``train_forward(..., steps=s)`` also
unrolls s-1 further steps in which each position's input feature is the drafter's own
prediction from the step before, attending to the real pairs before it and to the chain
of its own earlier predictions, exactly as it will at tree depth 2..s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbench import kernels
from specbench.drafters import Drafter, TargetParts, borrow, layer_shape
from specbench.drafters.cache import join
from specbench.hf import text_config


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class Block(nn.Module):
    """A Llama-style decoder layer (RMSNorm, GQA attention with RoPE, gated SiLU MLP) whose
    attention takes explicit keys/values and a boolean mask, so the caller owns the cache."""

    def __init__(self, cfg, input_norm: bool = True):
        super().__init__()
        d, self.H, self.Hk, self.Dh, bias, eps = layer_shape(cfg)
        # EAGLE-1's published layer has no input norm (the fused pair goes into attention as is)
        self.ln1 = nn.RMSNorm(d, eps=eps) if input_norm else None
        self.q = nn.Linear(d, self.H * self.Dh, bias=bias)
        self.k = nn.Linear(d, self.Hk * self.Dh, bias=bias)
        self.v = nn.Linear(d, self.Hk * self.Dh, bias=bias)
        self.o = nn.Linear(self.H * self.Dh, d, bias=False)
        self.ln2 = nn.RMSNorm(d, eps=eps)
        inter = cfg.intermediate_size
        self.gate = nn.Linear(d, inter, bias=False)
        self.up = nn.Linear(d, inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    @torch.no_grad()
    def load_from(self, layer) -> None:
        """Copy a Llama-style decoder layer of the target (an initialisation)."""
        a, m = layer.self_attn, layer.mlp
        pairs = [(self.ln1, layer.input_layernorm), (self.q, a.q_proj), (self.k, a.k_proj), (self.v, a.v_proj),
                 (self.o, a.o_proj), (self.ln2, layer.post_attention_layernorm), (self.gate, m.gate_proj),
                 (self.up, m.up_proj), (self.down, m.down_proj)]
        for mine, theirs in pairs:
            mine.weight.copy_(theirs.weight)
            if getattr(mine, "bias", None) is not None and getattr(theirs, "bias", None) is not None:
                mine.bias.copy_(theirs.bias)

    def _fused(self, x):
        """The packed q|k|v and gate|up of this layer on the native path (None elsewhere, and for
        a layer without an input norm: the fused steps normalise)."""
        if self.ln1 is None:
            return None
        return kernels.fused_block_weights(self, x, self.q, self.k, self.v, self.gate, self.up)

    def qkv(self, x, cos, sin):
        """x [B, n, d] -> q [B, H, n, Dh], k, v [B, Hk, n, Dh] (RoPE applied)."""
        fused = self._fused(x)
        if fused is not None:  # the target's fused layer steps: one call each for norm, q|k|v, RoPE
            return kernels.fused_qkv(x, self.ln1.weight, self.ln1.eps, fused[0], self.H, self.Hk, self.Dh, cos, sin)
        B, n, _ = x.shape
        h = x if self.ln1 is None else self.ln1(x)
        q = self.q(h).view(B, n, self.H, self.Dh).transpose(1, 2)
        k = self.k(h).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        v = self.v(h).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, x, q, k, v, mask):
        """Attention of q over (k, v) [B, Hk, S, Dh] with mask [B, n, S] (True = visible),
        then the rest of the layer. Returns the layer output [B, n, d]."""
        a = kernels.attention_like(q, k, v, mask, self.q)  # [B, n, H, Dh], on the layer's kernel path
        B, n = a.shape[:2]
        x = x + self.o(a.reshape(B, n, self.H * self.Dh))
        fused = self._fused(x)
        if fused is not None:
            return kernels.fused_mlp(x, self.ln2.weight, self.ln2.eps, fused[1], self.gate.out_features, self.down)
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def ttt_mask(valid: torch.Tensor, s: int) -> torch.Tensor:
    """The attention mask [B, T, (s + 1) T] of unrolled step ``s`` of the training-time test: a
    position sees the real keys up to i - s, then the key of step t at position i - (s - t) for
    t = 1..s (its own chain of predictions, itself last); ``valid`` [B, T]."""
    B, T = valid.shape
    idx = torch.arange(T, device=valid.device)
    masks = [(idx[None, :] <= idx[:, None] - s)[None] & valid[:, None, :]]
    for t in range(1, s + 1):
        masks.append((idx[None, :] == idx[:, None] - (s - t))[None] & valid[:, None, :])
    mask = torch.cat(masks, dim=2)
    eye = torch.eye(T, dtype=torch.bool, device=valid.device)[None].expand(B, T, T)
    return mask | torch.cat([torch.zeros_like(masks[0])] * s + [eye], dim=2)


class EagleDrafter(Drafter):
    kind = "eagle"

    def __init__(self, target, vocab_ids: torch.Tensor, config=None, fc_bias: bool = True, input_norm: bool = True):
        """``config``: the drafter layer's own (a published checkpoint's config.json; its RoPE
        then comes from it too); None: the target's, and the target's rotary tables."""
        super().__init__()
        cfg = text_config(config if config is not None else target.config)
        d = cfg.hidden_size
        self.config = cfg
        self.fc = nn.Linear(2 * d, d, bias=fc_bias)
        self.block = Block(cfg, input_norm=input_norm)
        self.own_rope = None
        if config is not None:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            borrow(self, "own_rope", LlamaRotaryEmbedding(config=cfg))  # a buffer-only table, never saved
        self.vocab_size = int(cfg.vocab_size)
        self.register_buffer("vocab_ids", vocab_ids.clone().long(), persistent=True)
        self.parts = TargetParts(target, self.vocab_ids)

    taps = ("final",)  # the target state it drafts from: after the final norm

    def features(self, hidden) -> torch.Tensor:
        """The target features of the newly committed tokens [B, m, d] (``specbench.decode.hidden``)."""
        return hidden.layers["final"]

    # ---------------------------------------------------------------- pieces
    def pair(self, feats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[B, n, d] features and [B, n] next tokens -> the block's input [B, n, d]."""
        e = self.parts.embed(tokens).to(feats.dtype)
        return self.fc(torch.cat([e, feats], dim=-1))

    def rope(self, x, pos):
        if self.own_rope is not None:
            return self.own_rope(x, pos)
        return self.parts.rope(x, pos)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [.., V']."""
        return self.parts.logits(h)

    def step(self, feats, tokens, pos, ctx, mask):
        """Run pairs (feats, tokens) at positions ``pos`` [B, n] over the context ``ctx`` (keys and
        values [B, Hk, S, Dh]: a ``cache.Scratch`` or a plain pair) and themselves; ``mask``
        [B, n, S + n]. Returns (h [B, n, d], k_new, v_new)."""
        x = self.pair(feats, tokens)
        cos, sin = self.rope(x, pos)
        q, k, v = self.block.qkv(x, cos, sin)
        return self.block.attend(x, q, *join(ctx, k, v), mask), k, v

    # ---------------------------------------------------------------- training
    def train_forward(self, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int = 1):
        """feats [B, T, d] (f_0..f_{T-1}), tokens [B, T] (x_1..x_T, the token after each
        feature), valid [B, T] bool. Returns the predicted features [steps, B, T, d]: step
        s at position i predicts f_{i+1} having seen real pairs up to i-s+1 and its own
        predictions after that."""
        B, T, _ = feats.shape
        dev = feats.device
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        idx = torch.arange(T, device=dev)
        causal = (idx[None, :] <= idx[:, None])[None] & valid[:, None, :]  # [B, T, T]
        x = self.pair(feats, tokens)
        cos, sin = self.rope(x, pos)
        q, k, v = self.block.qkv(x, cos, sin)
        keys, vals = [k], [v]
        h = self.block.attend(x, q, k, v, causal)
        outs = [h]
        for s in range(1, steps):
            # position i now holds the drafter's own prediction of f_i (from position i-1)
            prev = torch.cat([feats[:, :1], outs[-1][:, :-1]], dim=1)
            x = self.pair(prev, tokens)
            q, k, v = self.block.qkv(x, cos, sin)
            keys.append(k)
            vals.append(v)
            h = self.block.attend(x, q, torch.cat(keys, 2), torch.cat(vals, 2), ttt_mask(valid, s))
            outs.append(h)
        return torch.stack(outs)


def build(meta: dict, state: dict, target) -> EagleDrafter:
    return EagleDrafter(target, state["vocab_ids"], input_norm="block.ln1.weight" in state)
