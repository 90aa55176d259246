"""``kernel=native``: specbench's own CPU kernels (``csrc/``, built by ``extension``). Every fp32
weight is packed once into panels of output columns and streamed once per forward for all rows
(register tiles of up to 4 rows x 24 columns with AVX2, 9 x 48 with AVX-512: the record's
``kernel_isa`` says which ran), on all of torch's threads (MKL's one-row sgemv runs on one core).
Made for decode and verify forwards, it also beats oneDNN's and MKL's GEMMs on prefill-sized
forwards here (``make bench NAME=cpu``), so every row count takes it. A row's outputs do not depend on
how many rows share the forward (bit for bit). fp32 layers on a CPU with AVX2 and FMA; one extra
copy of the linear weights in memory. (Called ``avx2`` before it gained AVX-512 tiles: records
with that name read as ``native``, ``run.records.RENAMED``.)

A Llama decoder layer also runs fused (below), and a drafter's pieces (its rows of the target's
head, Medusa's heads, an EAGLE layer's attention and blocks) take the same kernels through the
``*_like`` and ``fused_*`` helpers.
"""

from __future__ import annotations

import types
import weakref

import torch

from specbench.kernels import gqa
from specbench.kernels.extension import few_rows_linear, load, pack
from specbench.kernels.packing import PACKED, as_loaded, cached_packing, route
from specbench.hf import cache_kwarg, output_cache_field
from specbench.decode.slab import SlabLayer

NAME = "native"


def packed_weight(mod: torch.nn.Linear) -> torch.Tensor:
    """The packed copy of ``mod.weight`` (the kernel's layout)."""
    w = mod.weight
    return cached_packing("native", mod, (w,), lambda: pack(w))


def _linear_forward(self, x):
    # the decode hot path (~200 calls per forward): no reshapes here, the kernel takes any
    # leading shape
    if as_loaded(self.weight, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = few_rows_linear(x, packed_weight(self), self.out_features)
    if self.bias is not None:
        y += self.bias.detach()
    return y


def apply(model: torch.nn.Module) -> int:
    """``model``'s fp32 linears on the native kernel; Llama decoder layers that can run fused take
    the fused layer forward (the projections it fuses are packed only there), and a Llama whose
    layers all run fused its model loop and final norm too. Returns how many linears changed."""
    from transformers.models.llama.modeling_llama import LlamaModel, LlamaRMSNorm

    fused = set()
    for mod in model.modules():
        if _fusable(mod):
            mod.forward = types.MethodType(_fused_llama_forward, mod)
            _fused_weights(mod)
            a, m = mod.self_attn, mod.mlp
            fused |= {id(a.q_proj), id(a.k_proj), id(a.v_proj), id(m.gate_proj), id(m.up_proj)}
    for mod in model.modules():  # a Llama whose layers all run fused: their loop too
        if type(mod) is LlamaModel and len(mod.layers) == mod.config.num_hidden_layers \
                and all(getattr(layer.forward, "__func__", None) is _fused_llama_forward for layer in mod.layers):
            mod.forward = types.MethodType(_fused_model_forward, mod)
            if type(mod.norm) is LlamaRMSNorm:  # and its final norm, on any path (the same bits on each)
                mod.norm.forward = types.MethodType(_fused_rms_forward, mod.norm)
    n = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and mod.weight.dtype == torch.float32 \
                and getattr(mod, "_specbench_kernel", None) != NAME:
            if id(mod) not in fused:  # else packed on its first call, if it ever runs on its own
                packed_weight(mod)
            route(mod, NAME, _linear_forward)
            n += 1
    return n


def linear_like(x: torch.Tensor, w: torch.Tensor, like: torch.nn.Module, owner) -> torch.Tensor:
    """``x @ w.T`` on the kernel path of the layer ``like``: a drafter's rows of its target's
    output layer take the target head's path (native: ``w`` packed once for ``owner``, the object
    that keeps the rows)."""
    if getattr(like, "_specbench_kernel", None) != NAME or as_loaded(w, x):
        return x @ w.T
    return few_rows_linear(x, cached_packing("rows", owner, (w,), lambda: pack(w)), w.shape[0])


def heads_like(x: torch.Tensor, w: torch.Tensor, like: torch.nn.Module, owner) -> torch.Tensor:
    """``x`` [n, I] through each of ``w``'s H matrices [H, O, I]: [H, n, O], as
    ``torch.einsum("ni,hoi->hno", x, w)``, on the kernel path of the layer ``like`` (native: the H
    matrices packed once, as one [H*O, I], for ``owner``; one kernel call where torch's batched
    matmul streams the heads slowly: docs/cpu-backend.md)."""
    H, O, I = w.shape
    if getattr(like, "_specbench_kernel", None) != NAME or as_loaded(w, x):
        return torch.einsum("ni,hoi->hno", x, w)
    packed = cached_packing("heads", owner, (w,), lambda: pack(w.detach().reshape(H * O, I)))
    return few_rows_linear(x, packed, H * O).view(-1, H, O).transpose(0, 1)


def attention_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                   like: torch.nn.Linear) -> torch.Tensor:
    """A drafter layer's attention on the kernel path of its layer ``like``: q [B, H, n, Dh]
    over k, v [B, Hk, S, Dh] (H a multiple of Hk) where ``visible`` [B, n, S] is True; returns
    [B, n, H, Dh]. native: the extension's attention (each KV head read once for its query
    heads, the mask additive); else torch's SDPA: on the CPU with grouped-query attention
    (``enable_gqa``: no copy of the keys per query head), on a GPU with each KV head's query heads
    folded into its query rows (``grouped``: with a mask, its memory-efficient kernel takes no
    grouped heads, ``enable_gqa`` would fall back to the math kernel, which writes the whole score
    matrix, and repeating the keys per query head copies the whole context every forward)."""
    if getattr(like, "_specbench_kernel", None) == NAME and not as_loaded(like.weight, q) \
            and q.shape[2] <= _ATTENTION_ROWS:
        add = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]
        return load().attention(q, k, v, add, q.shape[-1] ** -0.5)
    rep = q.shape[1] // k.shape[1]
    if rep > 1 and q.device.type == "cuda":
        return grouped(q, k, v, visible)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None],
                                                            enable_gqa=k.shape[1] != q.shape[1]).transpose(1, 2)


def grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention as plain attention over the KV heads: query head h reads KV head
    h // rep, so KV head j's rep query heads become rep x n query rows of one head (the mask
    tiled to them). Nothing the size of the context is copied. Returns [B, n, H, Dh]."""
    B, H, n, Dh = q.shape
    Hk = k.shape[1]
    rep = H // Hk
    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(B, Hk, rep * n, Dh), k, v, attn_mask=visible.repeat(1, rep, 1)[:, None])
    return out.reshape(B, H, n, Dh).transpose(1, 2)


# ---------------------------------------------------------------- fused Llama decoder layers
#
# A decode forward through Hugging Face's Llama layer runs ~100 small torch ops per layer (the
# RMSNorm alone is eight), each a few microseconds: on a 135M model a third of a decode step.
# On the native path, each Llama layer instead runs: RMSNorm (one extension call), one kernel
# call for q|k|v (their weights packed side by side), RoPE on q and k in place (one call), the
# cache update, attention (one call for up to 64 queries per row: GQA without repeating the
# cache, the mask applied as given; longer forwards, prefills, take the model's own attention
# function), o_proj, RMSNorm, one call for gate|up,
# silu(gate) * up (one call), down_proj. The linears and RoPE compute exactly what the
# layer-by-layer path computes (the kernel's outputs do not depend on which other columns share
# a call; RoPE is the same products and sums); RMSNorm, attention and SiLU round differently
# (last-bit differences).
# Where the cache's layer is a ``SlabLayer`` with its buffers made (every decode and verify
# forward after the prefill), those steps run as two extension calls, ``attn_block`` (it writes
# the new keys and values into the buffers itself) and ``mlp_block``: the same kernel calls in
# the same order, so the same bits, without the ~20 torch ops and Python calls between them.
# And when every layer of a Llama runs fused, its model runs them from one loop of its own
# (``_fused_model_forward``), Hugging Face's steps around them unchanged (what each saves:
# docs/cpu-backend.md).

def _fusable(mod: torch.nn.Module) -> bool:
    from transformers.activations import SiLUActivation
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    if type(mod) is not LlamaDecoderLayer:
        return False
    a, m = mod.self_attn, mod.mlp
    return type(mod.input_layernorm) is LlamaRMSNorm and type(mod.post_attention_layernorm) is LlamaRMSNorm \
        and isinstance(m.act_fn, (torch.nn.SiLU, SiLUActivation)) and a.q_proj.weight.dtype == torch.float32 \
        and all(p.bias is None for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj,
                                          m.down_proj))


def _fused_weights(layer) -> tuple:
    """(packed q|k|v, packed gate|up, query heads, KV heads, head size, MLP width, packed o_proj,
    packed down_proj) of ``layer`` (weights read through the modules' own dicts: the per-layer
    path runs this once per layer per forward; o_proj's and down_proj's packings are their modules' own, so the
    fused forward calls the kernel without two module calls and their cache lookups)."""
    a, m = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    ws = [a[k]._parameters["weight"] for k in ("q_proj", "k_proj", "v_proj")] \
        + [m[k]._parameters["weight"] for k in ("gate_proj", "up_proj")] \
        + [a["o_proj"]._parameters["weight"], m["down_proj"]._parameters["weight"]]

    def build():
        d = layer.self_attn.head_dim
        return (pack(torch.cat(ws[:3])), pack(torch.cat(ws[3:5])), ws[0].shape[0] // d, ws[1].shape[0] // d, d,
                ws[3].shape[0], packed_weight(a["o_proj"]), packed_weight(m["down_proj"]))

    return cached_packing("fused", layer, ws, build)


# queries per row up to which the extension's attention runs (a task takes several queries of
# one KV head and walks the cache in 64-key blocks, each block through all of them); beyond,
# the model's own attention function (faster than torch's flash attention at every point tried:
# docs/cpu-backend.md)
_ATTENTION_ROWS = 64
_NO_MASK = torch.empty(0)


def _additive(mask: torch.Tensor | None) -> torch.Tensor:
    """The layer's attention mask as the extension takes it: additive fp32 (built once per
    forward), or empty for causal."""
    return _NO_MASK if mask is None else gqa.folded_mask(mask, 1, torch.float32)


def _fused_llama_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                         use_cache=False, position_embeddings=None, **kwargs):
    x = hidden_states
    cache = past_key_values if past_key_values is not None else kwargs.pop("cache", None)  # its name from 5.24
    attn = self._modules["self_attn"]
    if as_loaded(attn.q_proj.weight, x) or position_embeddings is None:
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  use_cache=use_cache, position_embeddings=position_embeddings,
                                  **{cache_kwarg(type(self)): cache}, **kwargs)
    ext = load()
    qkv_w, gate_up_w, nq, nkv, d, width, o_w, down_w = _fused_weights(self)
    B, n, _ = x.shape
    norm = self._modules["input_layernorm"]
    impl = attn.config._attn_implementation
    ours = n <= _ATTENTION_ROWS and impl in ("sdpa", gqa.NAME) \
        and (attention_mask is None or isinstance(attention_mask, torch.Tensor))
    layers = getattr(cache, "layers", None)
    slab = layers[attn.layer_idx] if ours and layers is not None and attn.layer_idx < len(layers) else None
    room = slab.append(n) if isinstance(slab, SlabLayer) else None
    if room is not None:  # the decode and verify hot path: two extension calls, no torch ops between
        return _blocks(self, (qkv_w, gate_up_w, nq, nkv, d, width, o_w, down_w), x, *position_embeddings, room,
                       _additive(attention_mask))
    q, k, v = fused_qkv(x, norm.weight, norm.variance_epsilon, qkv_w, nq, nkv, d, *position_embeddings)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)
    if ours:
        o = ext.attention(q, k, v, _additive(attention_mask), attn.scaling)
    else:  # prefill and anything unusual: the model's own attention function
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        o, _ = attend(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, position_ids=position_ids,
                      **kwargs)
    x = x + few_rows_linear(o.reshape(B, n, nq * d), o_w, x.shape[-1])
    norm = self._modules["post_attention_layernorm"]
    return fused_mlp(x, norm.weight, norm.variance_epsilon, gate_up_w, width, down_w)


def _fused_rms_forward(self, x):
    """A fused Llama's final RMSNorm through the extension (one call where Hugging Face's five torch
    ops each meet caches the weight stream left cold)."""
    if as_loaded(self.weight, x) or x.device.type != "cpu":
        return type(self).forward(self, x)
    return load().rms_norm(x, self.weight, self.variance_epsilon)


def _blocks(layer, w: tuple, x, cos, sin, room: tuple, add: torch.Tensor) -> torch.Tensor:
    """A fused layer as its two extension calls: ``w`` its ``_fused_weights``, ``room`` its slab
    layer's ``append``, ``add`` the additive mask (``_additive``)."""
    ext = load()
    ln1, ln2 = layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"]
    x = ext.attn_block(x, ln1.weight, ln1.variance_epsilon, w[0], w[2], w[3], w[4], cos, sin, *room, add,
                       layer._modules["self_attn"].scaling, w[6])
    return ext.mlp_block(x, ln2.weight, ln2.variance_epsilon, w[1], w[5], w[7])


def _fused_model_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                         use_cache=None, **kwargs):
    """``LlamaModel.forward`` when every decoder layer runs fused (``apply``). A decode or verify
    forward over the engine's slab cache takes Hugging Face's own steps around the layers (the
    embedding, ``create_causal_mask``, the rotary tables, the final norm, called as its forward
    calls them) and runs every layer's two extension calls in one call (``_stack``): Hugging
    Face's module call per layer and the fused layer's own checks cost more than a Python loop
    over the layers' calls, which costs more than one call (docs/cpu-backend.md).
    Anything else (a prefill, another cache, hooks on a layer, hidden
    states or attentions asked for, autograd) takes its forward."""
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    slabs = _lean_slabs(self, input_ids, inputs_embeds, position_ids, attention_mask, cache, kwargs)
    stack = _stack(self) if slabs is not None else None
    if stack is None:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.llama import modeling_llama

    x = self.embed_tokens(input_ids)
    mask = modeling_llama.create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask,
                                             position_ids=position_ids,
                                             **{cache_kwarg(modeling_llama.create_causal_mask): cache})
    if mask is not None and not isinstance(mask, torch.Tensor):  # a mask per layer type: the layers sort it out
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    cos, sin = self.rotary_emb(x, position_ids=position_ids)
    n = x.shape[1]
    kbufs, vbufs, offs, lens = zip(*[slab.append(n) for slab in slabs])
    x = stack.forward(x, cos, sin, kbufs, vbufs, offs, lens, _additive(mask))
    return BaseModelOutputWithPast(last_hidden_state=self.norm(x), **{output_cache_field(): cache})


def _lean_slabs(model, input_ids, inputs_embeds, position_ids, attention_mask, cache, kwargs) -> list | None:
    """The cache's slab layers, one per decoder layer, when ``_fused_model_forward`` may run its
    loop over them; else None."""
    from torch.nn.modules import module as nn_module

    cfg = model.config
    if input_ids is None or inputs_embeds is not None or position_ids is None or torch.is_grad_enabled() \
            or input_ids.shape[-1] > _ATTENTION_ROWS or model.embed_tokens.weight.dtype != torch.float32 \
            or kwargs.get("output_hidden_states") or kwargs.get("output_attentions") \
            or cfg.output_hidden_states or cfg.output_attentions or cfg._attn_implementation not in ("sdpa", gqa.NAME) \
            or not (attention_mask is None or isinstance(attention_mask, torch.Tensor)) \
            or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return None
    slabs = getattr(cache, "layers", None)
    if slabs is None or len(slabs) != len(model.layers):
        return None
    for slab in slabs:  # the layers themselves: _stack
        if type(slab) is not SlabLayer or not slab.ready():
            return None
    return slabs


# model -> its FusedStack (kept only while every layer runs fused): outside the model, as _PACKED
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stack(model):
    """The extension's loop over ``model``'s fused layers (``FusedStack``), rebuilt whenever a
    weight it was packed from changed (its ``state``: the same cases as ``_cached_packing``'s
    key, and a layer or submodule replaced); None when a layer has a hook or cannot run fused
    (Hugging Face's loop then)."""
    stack = _STACKS.get(model)
    if stack is None or stack.state() == 1:
        stack = _build_stack(model)
        if stack is None:
            _STACKS.pop(model, None)
            return None
        _STACKS[model] = stack
    return stack if stack.state() == 0 else None


def _build_stack(model):
    """A ``FusedStack`` over ``model``'s decoder layers (the packings of ``_fused_weights`` and the
    links through which the modules reach their weights), None if a layer cannot run fused."""
    links, empties, weights, floats, ints = [], [], [], [], []

    def link(d: dict, key: str, tensor: bool = False):
        links.append((d, key, d[key], tensor))
        return d[key]

    layers = link(model._modules, "layers")
    if len(layers) != model.config.num_hidden_layers:
        return None
    for name in list(layers._modules):
        layer = link(layers._modules, name)
        if not _fusable(layer) or getattr(layer.__dict__.get("forward"), "__func__", None) is not _fused_llama_forward:
            return None
        link(layer.__dict__, "forward")
        empties += [layer._forward_hooks, layer._forward_pre_hooks]
        mods = {k: link(layer._modules, k) for k in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
        for owner, names in ((mods["self_attn"], ("q_proj", "k_proj", "v_proj", "o_proj")),
                             (mods["mlp"], ("gate_proj", "up_proj", "down_proj"))):
            for k in names:
                lin = link(owner._modules, k)
                link(lin._parameters, "weight", True)
                link(lin._parameters, "bias")
        ln1, ln2 = mods["input_layernorm"], mods["post_attention_layernorm"]
        link(ln1._parameters, "weight", True)
        link(ln2._parameters, "weight", True)
        qkv_w, gate_up_w, nq, nkv, d, width, o_w, down_w = _fused_weights(layer)
        weights += [ln1.weight, qkv_w, o_w, ln2.weight, gate_up_w, down_w]
        floats += [ln1.variance_epsilon, ln2.variance_epsilon, mods["self_attn"].scaling]
        ints += [nq, nkv, d, width]
    _into_one_stream(model, weights)
    return load().FusedStack(links, empties, weights, floats, ints)


def _into_one_stream(model, weights: list) -> None:
    """The packings of ``weights`` (``_build_stack``'s list, six per layer) moved into one buffer
    in the order a forward reads them (q|k|v, o_proj, gate|up, down_proj, layer after layer), in
    place in the list and in the packing caches (``_fused_weights``, o_proj's and down_proj's own),
    so the separate copies go. Whole forwards read one stream instead of 120 tensors wherever the
    allocator put them (docs/cpu-backend.md)."""
    slots = [i for i in range(len(weights)) if i % 6 in (1, 2, 4, 5)]
    sizes = [-(-weights[i].numel() // 16) * 16 for i in slots]  # 64-byte aligned
    arena, off = torch.empty(sum(sizes), dtype=torch.float32), 0
    for i, size in zip(slots, sizes):
        t = weights[i]
        weights[i] = arena[off:off + t.numel()].view(t.shape).copy_(t)
        off += size
    for j, layer in enumerate(model.layers):
        qkv, o, gu, down = (weights[6 * j + k] for k in (1, 2, 4, 5))
        key, w = PACKED["fused"][layer]
        PACKED["fused"][layer] = (key, (qkv, gu, *w[2:6], o, down))
        for mod, t in ((layer.self_attn.o_proj, o), (layer.mlp.down_proj, down)):
            PACKED["native"][mod] = (PACKED["native"][mod][0], t)


def fused_qkv(x, norm_w, eps: float, qkv_w, nq: int, nkv: int, d: int, cos, sin) -> tuple:
    """A fused layer's first half before attention: RMSNorm, q|k|v in one kernel call, RoPE on q
    and k in place. Returns q [B, nq, n, d], k and v [B, nkv, n, d] (views of one buffer)."""
    ext = load()
    B, n, _ = x.shape
    qkv = few_rows_linear(ext.rms_norm(x, norm_w, eps), qkv_w, (nq + 2 * nkv) * d).view(B, n, nq + 2 * nkv, d)
    ext.rope_(qkv, cos, sin, nq + nkv)  # q and k, in place
    return tuple(t.transpose(1, 2) for t in qkv.split((nq, nkv, nkv), dim=2))


def fused_mlp(x, norm_w, eps: float, gate_up_w, width: int, down) -> torch.Tensor:
    """x + the gated SiLU MLP of RMSNorm(x): gate|up in one kernel call, silu(gate) * up in one;
    ``down``: the down projection's module, or its native packing (no bias, out = x's width)."""
    ext = load()
    h = ext.rms_norm(x, norm_w, eps)
    a = ext.silu_mul(few_rows_linear(h, gate_up_w, 2 * width))
    return x + (few_rows_linear(a, down, x.shape[-1]) if isinstance(down, torch.Tensor) else down(a))


def fused_block_weights(owner, x: torch.Tensor, q, k, v, gate, up):
    """(packed q|k|v, packed gate|up) of a drafter's decoder layer when it runs on the native path
    (its linears put there by ``apply``, fp32, no autograd, no biases), else None."""
    if getattr(q, "_specbench_kernel", None) != NAME or as_loaded(q.weight, x) \
            or any(m.bias is not None for m in (q, k, v, gate, up)):
        return None
    ws = [m._parameters["weight"] for m in (q, k, v, gate, up)]
    return cached_packing("fused", owner, ws, lambda: (pack(torch.cat(ws[:3])), pack(torch.cat(ws[3:]))))
