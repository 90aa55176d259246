"""Attention for GQA models on every backend (the torch path, the GPU default, included): the
queries of the heads that share a key/value head are folded into one longer query, so a verify
forward over several new tokens attends without ``repeat_kv`` copying the whole KV cache per
layer, and AR and SD take the same attention function. Registered with transformers'
``AttentionInterface`` under ``NAME``; a model's ``sdpa`` is routed to it by ``fold``."""

from __future__ import annotations

import weakref

import torch

NAME = "specbench_sdpa"


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """``sdpa`` with the query heads of each key/value group folded into one query: q queries of
    g heads become g*q queries of one head against that group's keys, the mask repeated g times
    along the queries. Same attention, no copy of the cache; anything else goes to HF's sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = getattr(module, "num_key_value_groups", 1)
    B, H, q, d = query.shape
    if g == 1 or q == 1 or dropout or attention_mask is None or attention_mask.dim() != 4 \
            or attention_mask.shape[1] != 1 \
            or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    kv_heads = key.shape[1]
    folded = query.reshape(B, kv_heads, g * q, d)  # head h = group h // g: rows (h % g) * q + i
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=folded_mask(attention_mask, g, query.dtype), scale=scaling)
    return out.reshape(B, H, q, d).transpose(1, 2).contiguous(), None


_last_mask: list = [None, None, None]  # (weakref to the mask, groups, folded mask): one per forward


def folded_mask(mask: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """The mask repeated g times along the queries, additive (flash attention on CPU is faster
    with a float mask); every layer of a forward gets the same mask object, so it is built once."""
    compiling = torch.compiler.is_compiling()
    ref, groups, folded = _last_mask
    if not compiling and ref is not None and ref() is mask and groups == g and folded.dtype == dtype:
        return folded
    add = mask
    if mask.dtype == torch.bool:
        add = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device),
                          torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device))
    folded = add if g == 1 else add.repeat(1, 1, g, 1)
    if not compiling:
        _last_mask[:] = [weakref.ref(mask), g, folded]
    return folded


def fold(model: torch.nn.Module) -> None:
    """Route a GQA model's ``sdpa`` attention through ``attention`` (per model: its config)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    configs = [getattr(model, "config", None)]
    configs.append(getattr(configs[0], "text_config", None))
    for c in configs:
        if c is not None and getattr(c, "_attn_implementation", None) == "sdpa":
            c._attn_implementation = NAME
