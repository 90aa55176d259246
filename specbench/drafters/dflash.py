"""DFlash's drafter (Z Lab, arXiv 2602.06036): a block-diffusion drafter that proposes a whole
block of tokens in one forward, conditioned on the target's hidden states.

The context feature of a verified token is the target's states at a few layers
(``target_layer_ids``), concatenated and fused: ``c = hidden_norm(fc([h_l1; h_l2; ...]))`` (no bias).
A block is the target's embedding of ``[x_p, MASK, ..., MASK]`` (``block_size`` slots at the
positions p..p+B-1 of the last token x_p onwards). Every draft layer is a Qwen3 decoder layer whose
attention takes its queries from the block only and its keys/values from ``[context ; block]``:

    q = q_norm(q_proj(input_layernorm(x)))                            per head, RoPE at its position
    k = k_norm(k_proj([c ; input_layernorm(x)])),  v = v_proj([c ; input_layernorm(x)])
    x = x + o_proj(Attention(q, k, v))         non-causal: a slot sees every context token and slot
    x = x + MLP(post_attention_layernorm(x))

and the target's ``lm_head`` (or, in vLLM's speculators format, the drafter's own draft-vocabulary
head) reads ``norm(x)``. The context features are the same in every layer (only the block is a
residual stream), so a verified token's keys and values are computed once, when the target hands
over its states, and kept (``cache.DrafterCache``); the block's are written to its scratch slots.

Which slot drafts which token is the checkpoint's ``anchor``: ``bonus`` (Z Lab's, speculators'
``sample_from_anchor: false``) -- slot 0 holds x_p, slot k drafts x_{p+k}, B-1 drafts; ``next``
(``sample_from_anchor: true``, DeepSpec's and DSpark's) -- slot k drafts x_{p+k+1}, B drafts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specbench import kernels
from specbench.drafters import Drafter, borrow, layer_shape
from specbench.drafters.cache import DrafterCache, join
from specbench.drafters.eagle import rotate_half
from specbench.drafters.layers import LlamaLayer
from specbench.hf import text_config

ANCHORS = ("bonus", "next")


def default_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Z Lab's choice of target layers (outputs of decoder layers, 0-based) when a config names
    none: the middle one for one draft layer, else ``num_draft_layers`` spread evenly over
    1..L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    return [int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def taps_of(layer_ids, num_target_layers: int) -> tuple:
    """``specbench.decode.hidden`` tap names of Z Lab's ``target_layer_ids`` (the OUTPUT of decoder
    layer l, HF's ``hidden_states[l + 1]``; the last layer's is HF's normed final state)."""
    out = []
    for layer in layer_ids:
        layer = int(layer)
        if not 0 <= layer < num_target_layers:
            raise ValueError(f"target layer id {layer}: the target has decoder layers 0..{num_target_layers - 1}")
        out.append("final" if layer == num_target_layers - 1 else layer)
    if len(set(out)) != len(out):
        raise ValueError(f"target layer ids {list(layer_ids)} name a layer twice")
    return tuple(out)


class DFlashLayer(LlamaLayer):
    """One draft layer (Qwen3's: a Llama layer with q_norm/k_norm per head) over explicit context
    keys/values."""

    def __init__(self, cfg):
        super().__init__(cfg)
        eps = layer_shape(cfg)[5]
        self.q_norm = nn.RMSNorm(self.Dh, eps=eps)
        self.k_norm = nn.RMSNorm(self.Dh, eps=eps)

    def keys_values(self, x, cos, sin):
        """x [B, n, d] (context features, or the normed block) -> k, v [B, Hk, n, Dh], RoPE on k."""
        B, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, n, self.Hk, self.Dh)).transpose(1, 2)
        v = self.v_proj(x).view(B, n, self.Hk, self.Dh).transpose(1, 2)
        cos, sin = cos[:, None].to(k.dtype), sin[:, None].to(k.dtype)
        return k * cos + rotate_half(k) * sin, v

    def forward(self, x, ctx, cos, sin, visible):
        """The block x [B, n, d] at rotary (cos, sin) [B, n, Dh] over the context ``ctx`` (keys and
        values [B, Hk, W, Dh]: a ``cache.Scratch`` or a plain pair); ``visible`` [B, n, W + n]
        (True: attended). Returns [B, n, d]."""
        B, n, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_norm(self.q_proj(h).view(B, n, self.H, self.Dh)).transpose(1, 2)
        q = q * cos[:, None].to(q.dtype) + rotate_half(q) * sin[:, None].to(q.dtype)
        k, v = self.keys_values(h, cos, sin)
        a = kernels.attention_like(q, *join(ctx, k, v), visible, self.q_proj)
        x = x + self.o_proj(a.reshape(B, n, self.H * self.Dh))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DFlashDrafter(Drafter):
    kind = "dflash"

    def __init__(self, target, config, layer_ids, block_size: int, mask_token_id: int, anchor: str = "bonus",
                 draft_vocab: int | None = None, own_embedding: bool = False):
        """``config``: the draft layers' config (Qwen3-like); ``layer_ids``: Z Lab's target layer
        ids (decoder-layer outputs); ``draft_vocab``: a head of its own over that many tokens
        (speculators' format; None: the target's ``lm_head``); ``own_embedding``: an embedding of
        its own (speculators' ``embed_tokens``; else the target's)."""
        super().__init__()
        if anchor not in ANCHORS:
            raise ValueError(f"anchor must be one of {ANCHORS}, got {anchor!r}")
        cfg, tcfg = config, text_config(target.config)
        d, eps = cfg.hidden_size, float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.config = cfg
        self.layer_ids = [int(i) for i in layer_ids]
        self.taps = taps_of(self.layer_ids, int(tcfg.num_hidden_layers))
        self.block_size, self.mask_token_id, self.anchor = int(block_size), int(mask_token_id), anchor
        self.vocab_size = int(tcfg.vocab_size)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(int(cfg.num_hidden_layers)))
        self.fc = nn.Linear(len(self.taps) * int(tcfg.hidden_size), d, bias=False)
        self.hidden_norm = nn.RMSNorm(d, eps=eps)
        self.norm = nn.RMSNorm(d, eps=eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False) if draft_vocab else None
        self.embed_tokens = nn.Embedding(self.vocab_size, d) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(draft_vocab or 0, dtype=torch.long))
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        borrow(self, "rope", LlamaRotaryEmbedding(config=cfg))
        borrow(self, "target_embedding", target.get_input_embeddings())
        borrow(self, "target_head", target.get_output_embeddings())

    @staticmethod
    def shared_prefixes() -> tuple:
        return ()

    @property
    def drafts(self) -> int:
        """Draft tokens per block: B-1 (``bonus``) or B (``next``)."""
        return self.block_size - (self.anchor == "bonus")

    @property
    def vocab_ids(self) -> torch.Tensor:
        """Target ids of the head's outputs, in order (``i + d2t[i]``; every id for the target's head)."""
        if self.lm_head is None:
            return torch.arange(self.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def embed(self, tokens):
        return (self.embed_tokens if self.embed_tokens is not None else self.target_embedding)(tokens)

    def logits(self, h):
        """Logits of the normed block states ``h`` over the head's vocabulary (``vocab_ids``)."""
        return self.lm_head(h) if self.lm_head is not None else self.target_head(h.to(self.target_head.weight.dtype))

    def features(self, hidden) -> torch.Tensor:
        """The fused context features [B, m, d] of the target's states ``hidden`` (a ``Hidden``)."""
        return self.fuse(torch.cat([hidden.layers[t] for t in self.taps], dim=-1))

    def fuse(self, taps) -> torch.Tensor:
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context(self, feats, pos):
        """Per layer, the context keys and values [B, Hk, m, Dh] of features [B, m, d] at ``pos`` [B, m]."""
        cos, sin = self.rope(feats, pos)
        return [layer.keys_values(feats, cos, sin) for layer in self.layers]

    def block(self, tokens, pos, ctx, visible):
        """The block ``tokens`` [B, n] at ``pos`` [B, n] over the context ``ctx`` (per layer a
        ``cache.Scratch``, or (k, v) [B, Hk, W, Dh]) where ``visible`` [B, n, W + n]. Returns the
        normed states [B, n, d]."""
        x = self.embed(tokens).to(self.fc.weight.dtype)
        cos, sin = self.rope(x, pos)
        for layer, c in zip(self.layers, ctx):
            x = layer(x, c, cos, sin, visible)
        return self.norm(x)

    def train_forward(self, taps, tokens, valid, anchors):
        """Training: ``taps`` [B, T, n x H] the target's concatenated states at positions 0..T-1,
        ``tokens`` [B, T], ``valid`` [B, T], ``anchors`` [B, A] block starts (positions whose
        token is known). Block a is ``[tokens[anchor], MASK x (B-1)]`` at anchor..anchor+B-1,
        seeing the context before its anchor and its own slots. Returns normed states [B, A, Bk, d]."""
        Bt, T, _ = taps.shape
        A, Bk, dev = anchors.shape[1], self.block_size, taps.device
        feats = self.fuse(taps)
        idx = torch.arange(T, device=dev)
        ctx = self.context(feats, idx[None].expand(Bt, T))
        slots = torch.arange(Bk, device=dev)
        pos = (anchors[:, :, None] + slots).reshape(Bt, A * Bk)
        blk = torch.full((Bt, A, Bk), self.mask_token_id, dtype=torch.long, device=dev)
        blk[:, :, 0] = tokens.gather(1, anchors)
        see_ctx = (idx[None, None] < anchors[:, :, None]) & valid[:, None]  # [Bt, A, T]
        see_ctx = see_ctx[:, :, None].expand(Bt, A, Bk, T).reshape(Bt, A * Bk, T)
        own = torch.block_diag(*[torch.ones(Bk, Bk, dtype=torch.bool, device=dev)] * A)
        visible = torch.cat([see_ctx, own[None].expand(Bt, -1, -1)], dim=2)
        return self.block(blk.reshape(Bt, A * Bk), pos, ctx, visible).view(Bt, A, Bk, -1)


def context_cache(drafter: DFlashDrafter, rows: int, device, dtype, width: int, scratch: int = 0, graphs=None,
                  owner=None) -> DrafterCache:
    """A ``DrafterCache`` for ``drafter``'s layers (its settings: ``DrafterCache``'s)."""
    lay = drafter.layers[0]
    return DrafterCache(len(drafter.layers), lay.Hk, lay.Dh, rows, device, dtype, width, scratch, graphs, owner)


def layer_config(target_config, layers: int, mask_token_id: int, block_size: int, layer_ids):
    """The config of a DFlash drafter trained for ``target_config``: the target's layer shape
    (hidden size, heads, head_dim, MLP width, RoPE), ``layers`` draft layers, and Z Lab's
    ``block_size`` / ``dflash_config`` fields, as a Qwen3Config (what Z Lab's code reads)."""
    from transformers import Qwen3Config

    tc = text_config(target_config)
    heads = int(tc.num_attention_heads)
    raw = {k: getattr(tc, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps",
                                        "max_position_embeddings", "vocab_size") if hasattr(tc, k)}
    raw.update(num_hidden_layers=int(layers), num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads)),
               head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads), attention_bias=False,
               tie_word_embeddings=False)
    rope = getattr(tc, "rope_parameters", None) or {"rope_type": "default",
                                                    "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
    cfg = Qwen3Config(**raw, rope_parameters=dict(rope))
    cfg.block_size = int(block_size)
    cfg.num_target_layers = int(tc.num_hidden_layers)
    cfg.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in layer_ids]}
    cfg.layer_types = ["full_attention"] * int(layers)
    return cfg


def exp_decay(block: int, gamma: float, anchor: str) -> torch.Tensor:
    """DFlash's loss weight per slot: exp(-(k - 1) / gamma) for the k-th draft of the block
    (slot 0 of the ``bonus`` anchor drafts nothing: weight 0)."""
    k = torch.arange(block, dtype=torch.float32) + (anchor == "next")
    w = torch.exp(-(k - 1).clamp(min=0) / gamma)
    if anchor == "bonus":
        w[0] = 0.0
    return w
