"""Compatibility with the Hugging Face model API across transformers versions, and the facts
about a model's config the engine needs (its text part, its length limit, its end tokens,
whether its state can be rolled back)."""

from __future__ import annotations

import dataclasses
import functools
import inspect

from specbench.errors import ConfigError


@functools.lru_cache(maxsize=None)
def _cache_kwarg(forward) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def cache_kwarg(obj) -> str:
    """The keyword ``obj``'s forward (a model, a drafter, a decoder layer's class; or a function,
    such as ``create_causal_mask``) takes its KV cache under: transformers 5.24 renamed
    ``past_key_values`` to ``cache`` (the old name still maps onto the new one until 5.40, with
    a warning; a replaced forward gets only the new one)."""
    if inspect.isfunction(obj):
        return _cache_kwarg(obj)
    return _cache_kwarg(obj.forward if isinstance(obj, type) else type(obj).forward)


def text_config(config):
    """The language-model part of a config (the config itself for plain causal LMs)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


# Layer kinds whose state is a KV cache the engine can crop and gather; anything else in
# ``layer_types`` (linear attention, Mamba / SSM, conv) carries a recurrent state.
ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
RECURRENT_MODEL_TYPES = {"mamba", "mamba2", "rwkv", "jamba", "zamba", "zamba2", "bamba", "falcon_h1", "falcon_mamba",
                         "granitemoehybrid", "lfm2", "qwen3_next", "nemotron_h", "recurrent_gemma", "xlstm", "minimax"}


def check_rollback(config) -> None:
    """Speculative decoding discards rejected tokens from the target's state; a recurrent
    state (linear attention, Mamba) cannot be rolled back that way: refuse in one line."""
    tc = text_config(config)
    kinds = set(getattr(tc, "layer_types", None) or []) - ATTENTION_LAYERS
    mtype = getattr(tc, "model_type", "")
    if kinds or mtype in RECURRENT_MODEL_TYPES:
        what = ", ".join(sorted(kinds)) or mtype
        raise ConfigError(f"model type '{mtype}' has recurrent layers ({what}) whose state cannot be rolled back "
                          "after rejected drafts; specbench's engine supports attention-only models")


def max_positions(config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    text = getattr(config, "text_config", None)
    return max_positions(text) if text is not None else 1 << 30


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for src in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        if src is None:
            continue
        ids.update(src if isinstance(src, (list, tuple)) else [src])
    return ids


@functools.cache
def output_cache_field() -> str:
    """The name a model output gives its cache (``cache`` from transformers 5.24; the old name
    still maps onto it there, through a warning and a setattr shim on every forward)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in {f.name for f in dataclasses.fields(BaseModelOutputWithPast)} else "past_key_values"


def folder_weights(folder) -> tuple:
    """Every tensor of an HF model folder's safetensors (one file or its shards), by name, and its
    output layer in fp32 (``lm_head.weight``, or the embedding when the two are tied)."""
    from pathlib import Path

    from safetensors.torch import load_file

    weights = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        weights.update(load_file(f))
    return weights, weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()
