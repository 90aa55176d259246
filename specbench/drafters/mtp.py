"""A native multi-token-prediction (MTP) module: the block that DeepSeek-V3/R1, GLM-4.5, MiMo and
Qwen3-Next ship inside their checkpoints (DeepSeek-V3 report, arXiv 2412.19437, section 2.2;
FastMTP, arXiv 2509.18362), and speculators' ``mtp`` drafter.

An entry at position i fuses the state h_i the block is given with the embedding of the token
after it, x_{i+1}, runs one decoder layer of the target's own kind (attention over the block's
own keys and values of earlier entries, at position i) and predicts x_{i+2}:

    x = proj([enorm(embed(x_{i+1})) ; hnorm(h_i)])     (MiMo: [hnorm(h_i) ; enorm(embed(x_{i+1}))])
    y = DecoderLayer(x);   logits = head(norm(y))

For a verified position, h_i is the target's last hidden state (after its final norm, as vLLM
hands it over); for a draft, the block's own output at the entry before it, ``y`` for the
DeepSeek family (vLLM's ``DeepSeekMultiTokenPredictorLayer`` returns the state before
``shared_head.norm``), ``norm(y)`` for Qwen3-Next, MiMo and speculators (their modules end with
that norm). Families and their names:

    family       fuse (ours: enorm, hnorm, proj)                      norm, head
    deepseek     enorm, hnorm, eh_proj                                shared_head.norm, shared_head.head
    qwen3_next   pre_fc_norm_embedding, pre_fc_norm_hidden, fc       mtp.norm, the target's lm_head
    mimo         token_layernorm, hidden_layernorm, input_proj       final_layernorm, the target's lm_head
    speculators  as mimo, embedding first                            as mimo

DeepSeek's and MiMo's entry at position 0 reads a zero embedding, as vLLM's ``deepseek_mtp``,
``glm4_moe_mtp`` and ``mimo_mtp`` run them ("not needed by MTP"); the others read their token there.

The decoder layer is the target's own class (``layer_class``), so its
attention (MLA for DeepSeek), its MoE and its norms are transformers' code; it keeps its keys
and values in a ``RaggedCache`` (cache layer 0), which this module's ``forward`` serves as a
model. ``specbench/drafters/formats/mtp.py`` maps each family's checkpoint onto it.
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from specbench.drafters import Drafter, borrow
from specbench.hf import cache_kwarg, text_config

FAMILIES = ("deepseek", "qwen3_next", "mimo", "speculators")


class Output(NamedTuple):
    """The module's forward: its decoder layer's states (a tuple: torch.compile traces it)."""

    out: torch.Tensor


def layer_index(cfg) -> int:
    """The index a decoder layer of the MTP block is built with: past the target's layers (so a
    DeepSeek/GLM block is MoE, as their MTP layers are), or the last full-attention one where the
    config lists layer types (a layer's type is read at its index)."""
    types = list(getattr(cfg, "layer_types", None) or [])
    if not types:
        return int(cfg.num_hidden_layers)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if not full:
        raise ValueError("an MTP block attends to all its entries; this target has no full-attention layer to copy")
    return full[-1]


def layer_class(config):
    """The decoder-layer class of the target's architecture (its ``_no_split_modules``), from its
    config alone: what the MTP block is built of, and what its keys are checked against."""
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    names = [n for n in getattr(model_cls, "_no_split_modules", None) or [] if n.endswith("DecoderLayer")]
    if not names:
        raise ValueError(f"{model_cls.__name__} names no decoder layer class to build an MTP block of")
    return getattr(sys.modules[model_cls.__module__], names[0])


def expected_state(config) -> dict:
    """Every key of an ``MTPDrafter`` for a target of ``config`` (none of its optional own head and
    embedding) -> its shape, without allocating a weight."""
    cfg = text_config(config)
    d = int(cfg.hidden_size)
    with torch.device("meta"):
        layer = layer_class(cfg)(cfg, layer_index(cfg))
    return {"enorm.weight": (d,), "hnorm.weight": (d,), "proj.weight": (d, 2 * d), "norm.weight": (d,)} | {
        f"layer.{k}": tuple(v.shape) for k, v in layer.state_dict().items()}


class MTPDrafter(Drafter):
    kind = "mtp"

    def __init__(self, target, family: str, own_head: bool = False, own_embedding: bool = False):
        """``family`` (``FAMILIES``) fixes the fusion order and what is fed back; ``own_head`` /
        ``own_embedding``: the checkpoint carries its own output layer / embedding (DeepSeek's
        ``shared_head.head`` and ``embed_tokens`` when they differ from the target's)."""
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"unknown MTP family {family!r}; one of {', '.join(FAMILIES)}")
        cfg = copy.copy(text_config(target.config))  # its own: a kernel path set on it must not reach the target's
        d, V, eps = int(cfg.hidden_size), int(cfg.vocab_size), float(getattr(cfg, "rms_norm_eps", 1e-6))
        self.family, self.config = family, cfg
        self.hidden_first = family == "mimo"
        self.feed_normed = family != "deepseek"
        self.blank_first = family in ("deepseek", "mimo")
        self.enorm, self.hnorm = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = layer_class(cfg)(cfg, layer_index(cfg))
        self.layer.self_attn.layer_idx = 0  # its own cache, one layer
        self.norm = nn.RMSNorm(d, eps=eps)
        self.head = nn.Linear(d, V, bias=False) if own_head else None
        self.embedding = nn.Embedding(V, d) if own_embedding else None
        borrow(self, "target_head", target.get_output_embeddings())
        borrow(self, "target_embedding", target.get_input_embeddings())
        borrow(self, "rope", target.model.rotary_emb)
        self._cache_kw = cache_kwarg(self.layer)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return (self.embedding if self.embedding is not None else self.target_embedding)(tokens)

    def fuse(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """[B, n] tokens x_{i+1} and [B, n, d] states h_i at ``positions`` i [B, n] -> the decoder
        layer's input [B, n, d]."""
        e = self.embed(tokens).to(h.dtype)
        if self.blank_first and positions is not None:  # the entry at position 0 reads no token
            e = e.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        e = self.enorm(e)
        g = self.hnorm(h)
        return self.proj(torch.cat([g, e] if self.hidden_first else [e, g], dim=-1))

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output ``y`` -> logits over the target's vocabulary."""
        head = self.head if self.head is not None else self.target_head
        return head(self.norm(y).to(head.weight.dtype))

    def fed_back(self, y: torch.Tensor) -> torch.Tensor:
        """What the next draft's entry reads as its state (``y`` or ``norm(y)``, by family)."""
        return self.norm(y) if self.feed_normed else y

    def forward(self, input_ids, hidden, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep=0, **_):
        """A ``RaggedCache``'s model: entries (``input_ids`` [B, n], ``hidden`` [B, n, d]) at
        ``position_ids`` over the block's cached entries (``attention_mask``: the cache's additive
        mask [B, 1, n, W + n], or None for a plain causal one). Returns ``out`` [B, n', d], the
        decoder layer's outputs (the last ``logits_to_keep`` entries, or all)."""
        x = self.fuse(input_ids, hidden, position_ids)
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask["full_attention"]
        n = x.shape[1]
        if attention_mask is None and n > 1:  # the layer gets its mask made, never a causal flag
            past = cache.get_seq_length(0) if cache is not None and len(cache.layers) else 0
            ok = torch.arange(past + n, device=x.device)[None] <= (past + torch.arange(n, device=x.device))[:, None]
            attention_mask = torch.zeros(ok.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~ok, torch.finfo(x.dtype).min)[None, None].expand(x.shape[0], 1, n, past + n)
        y = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                       position_embeddings=self.rope(x, position_ids), **{self._cache_kw: cache})
        y = y[0] if isinstance(y, tuple) else y
        return Output(y[:, -logits_to_keep:] if logits_to_keep else y)

    def train_logits(self, tokens: torch.Tensor, h: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Teacher-forced recursion over one batch of sequences (FastMTP's and speculators'
        training forward): step k's entry i reads x_{i+k+1} and, as its state, the target's h_i
        (k = 0) or step k-1's fed-back output at i; it predicts x_{i+k+2}. ``tokens`` [B, T],
        ``h`` [B, T, d]; returns per step the logits [B, T - k - 2 + 1 ..] of the entries whose
        inputs exist (entry i for i + k + 1 < T), causal, entry i of step k at position i + k."""
        B, T = tokens.shape
        n = T - steps - 1
        pos = torch.arange(n, device=h.device)[None].expand(B, n)
        state, out = h[:, :n], []
        for k in range(steps):  # step k's entry i stands where its draft would: at position i + k
            y = self(tokens[:, k + 1:k + 1 + n], state, position_ids=pos + k, cache=None, use_cache=False).out
            out.append(self.logits(y))
            state = self.fed_back(y)
        return out
