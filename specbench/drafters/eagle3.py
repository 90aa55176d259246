"""EAGLE-3's drafter (Li et al. 2025, arXiv 2503.01840), as SafeAILab publishes it.

The target's hidden states at the INPUT of three decoder layers (2, L//2 and L-3: low, mid and
high; before any final norm) are concatenated and fused, ``g = fc([low; mid; high])`` (3H -> H,
no bias). One decoder layer then reads, per position, the token embedding and the feature:

    a = Attention(cat(input_layernorm(embed(x)), hidden_norm(g)))     q, k and v take 2H
    h = g + a;  h = h + MLP(post_attention_layernorm(h))
    logits = lm_head(norm(h))                                          over the draft vocabulary

and a draft id ``i`` is the target token ``i + d2t[i]``. From the second drafting step on, the
drafter's own ``h`` feeds back in place of the fused feature (it is H wide, so ``fc`` is
skipped, as the reference does by width). ``step``, ``logits`` and ``vocab_ids`` are
``EagleDrafter``'s, so ``methods/eagle.py`` drafts EAGLE-2's dynamic tree with either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbench import kernels
from specbench.drafters import Drafter, borrow, layer_shape
from specbench.drafters.cache import join
from specbench.hf import text_config


def tap_layers(num_layers: int, layers=None) -> tuple[int, ...]:
    """The decoder-layer OUTPUTS (``specbench.decode.hidden`` tap indices) that are the inputs of
    ``layers`` (default: EAGLE-3's 2, L//2 and L-3): layer i's input is layer i-1's output."""
    if layers is None:
        layers = (2, num_layers // 2, num_layers - 3)
        if len(set(layers)) < 3 or min(layers) < 1:
            raise ValueError(f"EAGLE-3 reads the inputs of layers 2, L//2 and L-3: a target of {num_layers} layers "
                             "has no three distinct ones")
    elif len(set(layers)) != len(layers) or min(layers) < 1 or max(layers) >= num_layers:
        raise ValueError(f"the drafter reads the inputs of layers {list(layers)}: a target of {num_layers} layers "
                         "has no such distinct layers above the first")
    return tuple(int(i) - 1 for i in layers)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, self.H, self.Hk, self.Dh, _, eps = layer_shape(cfg)
        self.input_layernorm = nn.RMSNorm(d, eps=eps)
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.q = nn.Linear(2 * d, self.H * self.Dh, bias=False)
        self.k = nn.Linear(2 * d, self.Hk * self.Dh, bias=False)
        self.v = nn.Linear(2 * d, self.Hk * self.Dh, bias=False)
        self.o = nn.Linear(self.H * self.Dh, d, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)
        self.gate = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(d, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)

    def qkv(self, e, g, cos, sin):
        """e, g [B, n, d] (embeddings, features) -> q [B, H, n, Dh], k, v [B, Hk, n, Dh], RoPE applied."""
        from specbench.drafters.eagle import rotate_half

        x = torch.cat([self.input_layernorm(e), self.hidden_norm(g)], dim=-1)
        B, n, _ = x.shape
        q = self.q(x).view(B, n, self.H, self.Dh).transpose(1, 2)
        k = self.k(x).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        v = self.v(x).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attend(self, g, q, k, v, mask):
        a = kernels.attention_like(q, k, v, mask, self.q)  # [B, n, H, Dh]
        B, n = a.shape[:2]
        h = g + self.o(a.reshape(B, n, self.H * self.Dh))
        x = self.post_attention_layernorm(h)
        return h + self.down(F.silu(self.gate(x)) * self.up(x))


class Eagle3Drafter(Drafter):
    kind = "eagle3"

    def __init__(self, target, config, draft_vocab: int, target_hidden: int | None = None, layers=None,
                 fc_norm: bool = False, norm_output: bool = False):
        """``layers``: the target layers whose inputs are fused (None: 2, L//2 and L-3). EAGLE 3.1
        (arXiv 2605.09992): ``fc_norm``, one RMSNorm per tapped layer before ``fc``;
        ``norm_output``, the drafter's post-norm state is what it feeds back (and what ``logits``
        reads)."""
        super().__init__()
        cfg = text_config(config)
        tcfg = text_config(target.config)
        d = cfg.hidden_size
        self.config = cfg
        self.taps = tap_layers(int(tcfg.num_hidden_layers), layers)
        self.fc = nn.Linear(len(self.taps) * (target_hidden or d), d, bias=False)
        eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.fc_norm = nn.ModuleList(nn.RMSNorm(target_hidden or d, eps=eps) for _ in self.taps) if fc_norm else None
        self.norm_output = bool(norm_output)
        self.block = Eagle3Layer(cfg)
        self.norm = nn.RMSNorm(d, eps=float(getattr(cfg, "rms_norm_eps", 1e-6)))
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.vocab_size = int(tcfg.vocab_size)
        self.embedding = None  # its own (a drafter narrower than its target) or the target's
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        borrow(self, "own_rope", LlamaRotaryEmbedding(config=cfg))
        borrow(self, "target_embedding", target.get_input_embeddings())

    @property
    def vocab_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, in draft order (``i + d2t[i]``)."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def features(self, hidden) -> torch.Tensor:
        """The target's taps, low -> mid -> high, concatenated: [B, m, 3 * H_target]."""
        return torch.cat([hidden.layers[t] for t in self.taps], dim=-1)

    def embed(self, tokens):
        return (self.embedding if self.embedding is not None else self.target_embedding)(tokens)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """The target's concatenated taps [.., n x H] -> the fused feature [.., H] (EAGLE 3.1: each
        tap normed first)."""
        if self.fc_norm is not None:
            taps = torch.cat([norm(t) for norm, t in zip(self.fc_norm, taps.chunk(len(self.fc_norm), dim=-1))], -1)
        return self.fc(taps)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """What a step returns and feeds back: the layer's output, or (EAGLE 3.1) its post-norm state."""
        return self.norm(h) if self.norm_output else h

    def step(self, feats, tokens, pos, ctx, mask):
        """As ``EagleDrafter.step``; ``feats`` either the target's concatenated taps (fused by
        ``fc``) or the drafter's own earlier output (H wide)."""
        g = self.fuse(feats) if feats.shape[-1] != self.fc.out_features else feats
        e = self.embed(tokens).to(g.dtype)
        cos, sin = self.own_rope(g, pos)
        q, k, v = self.block.qkv(e, g, cos, sin)
        return self.output(self.block.attend(g, q, *join(ctx, k, v), mask)), k, v

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [.., V'] of a step's output."""
        return self.lm_head(h if self.norm_output else self.norm(h))

    def train_forward(self, feats: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int = 1):
        """As ``EagleDrafter.train_forward`` (the training-time test): ``feats`` [B, T, 3H] the
        target's concatenated taps at positions 0..T-1, ``tokens`` [B, T] the token after each.
        Step 0 reads the fused real features; step s at position i reads its own step s-1 output
        at i-1 (the fused real feature at position 0). Returns the outputs [steps, B, T, H]."""
        from specbench.drafters.eagle import ttt_mask

        B, T, _ = feats.shape
        pos = torch.arange(T, device=feats.device)[None].expand(B, T)
        idx = torch.arange(T, device=feats.device)
        causal = (idx[None, :] <= idx[:, None])[None] & valid[:, None, :]
        g = self.fuse(feats)
        e = self.embed(tokens).to(g.dtype)
        cos, sin = self.own_rope(g, pos)
        q, k, v = self.block.qkv(e, g, cos, sin)
        keys, vals = [k], [v]
        outs = [self.output(self.block.attend(g, q, k, v, causal))]
        for s in range(1, steps):
            prev = torch.cat([g[:, :1], outs[-1][:, :-1]], dim=1)
            q, k, v = self.block.qkv(e, prev, cos, sin)
            keys.append(k)
            vals.append(v)
            outs.append(self.output(self.block.attend(prev, q, torch.cat(keys, 2), torch.cat(vals, 2), ttt_mask(valid, s))))
        return torch.stack(outs)


def layer_config(target_config, draft_vocab: int):
    """The drafter layer's config for training one on ``target_config``: the target's layer
    shape (hidden size, heads, MLP width, RoPE), one layer, the draft vocabulary's size."""
    import copy

    cfg = copy.deepcopy(text_config(target_config))
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:1])
    cfg.draft_vocab_size = int(draft_vocab)
    return cfg
