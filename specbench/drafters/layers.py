"""A Llama decoder layer over explicit keys and values: P-EAGLE's layers after the first, and the
base of DFlash's (Qwen3's: the same with per-head q/k norms)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from specbench import kernels
from specbench.drafters import layer_shape


class LlamaLayer(nn.Module):
    """A Llama decoder layer over explicit keys and values (P-EAGLE's layers after the first)."""

    def __init__(self, cfg):
        super().__init__()
        d, self.H, self.Hk, self.Dh, bias, eps = layer_shape(cfg)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.q_proj = nn.Linear(d, self.H * self.Dh, bias=bias)
        self.k_proj = nn.Linear(d, self.Hk * self.Dh, bias=bias)
        self.v_proj = nn.Linear(d, self.Hk * self.Dh, bias=bias)
        self.o_proj = nn.Linear(self.H * self.Dh, d, bias=bias)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, d, bias=False)

    def qkv(self, x, cos, sin):
        from specbench.drafters.eagle import rotate_half

        h = self.input_layernorm(x)
        B, n, _ = h.shape
        q = self.q_proj(h).view(B, n, self.H, self.Dh).transpose(1, 2)
        k = self.k_proj(h).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        v = self.v_proj(h).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, x, q, k, v, mask):
        a = kernels.attention_like(q, k, v, mask, self.q_proj)
        B, n = a.shape[:2]
        x = x + self.o_proj(a.reshape(B, n, self.H * self.Dh))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
