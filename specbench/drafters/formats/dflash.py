"""DFlash as Z Lab publishes it (``dflash``) and in vLLM's speculators format (``speculators-dflash``).

Z Lab (``z-lab/*-DFlash*`` on the Hub; ``dflash/model.py::DFlashDraftModel``): ``config.json`` is a
Qwen3Config of the draft layers plus ``block_size``, ``num_target_layers`` and ``dflash_config:
{mask_token_id, target_layer_ids}`` (either may sit at the top level too); ``model.safetensors``
holds ``layers.i.{input_layernorm, post_attention_layernorm}``, ``layers.i.self_attn.{q,k,v,o}_proj``
and ``{q,k}_norm``, ``layers.i.mlp.{gate,up,down}_proj``, ``fc``, ``hidden_norm`` and ``norm``. The
embedding and ``lm_head`` are the target's. ``target_layer_ids`` name decoder-layer OUTPUTS
(HF's ``hidden_states[l + 1]``); the anchor slot holds the bonus token (B-1 drafts).

speculators (``speculators_model_type: dflash``): the draft layers' config under
``transformer_layer_config``, ``block_size``, ``mask_token_id``, ``draft_vocab_size``,
``aux_hidden_state_layer_ids`` (HF ``hidden_states`` indices: Z Lab's ids + 1) and
``sample_from_anchor`` (true: slot k drafts x_{p+k+1}, B drafts); the weights add a head of its
own over the draft vocabulary (``lm_head``, with ``d2t``/``t2d`` where it is smaller than the
target's) and may carry ``embed_tokens``.

Variants that compute something else are refused in one line naming them: fused q|k|v, sliding
window layers, attention sinks, a ``mask_embedding.pt`` sidecar, a drafter wider than its target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specbench.drafters import layer_shape, ready
from specbench.drafters.formats.common import FormatError, weight_files, write_folder
from specbench.hf import text_config

NAMES = ("dflash", "speculators-dflash")
LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")
# theirs (under layers.i.) -> ours (DFlashLayer's attribute names)
OURS = {k.rsplit(".", 1)[0]: k.rsplit(".", 1)[0].split(".")[-1] for k in LAYER}


def _raw(folder) -> dict | None:
    p = Path(str(folder)).expanduser() / "config.json"
    return json.loads(p.read_text()) if p.exists() else None


def detect(folder) -> str | None:
    """``dflash`` (Z Lab's config: ``dflash_config`` or the ``DFlashDraftModel`` architecture),
    ``speculators-dflash``; else None."""
    raw = _raw(folder)
    if raw is None or not weight_files(Path(str(folder)).expanduser()):
        return None
    if raw.get("speculators_model_type") == "dflash":
        return "speculators-dflash"
    if "speculators_model_type" not in raw and ("dflash_config" in raw or "DFlashDraftModel" in raw.get("architectures", [])):
        return "dflash"
    return None


def read_state(folder) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in weight_files(Path(str(folder)).expanduser()):
        state |= load_file(str(f)) if f.suffix == ".safetensors" else torch.load(f, map_location="cpu",
                                                                                weights_only=True, mmap=True)
    return state


def settings(folder, target_config) -> dict:
    """What the checkpoint declares, read from either layout: the draft layers' config, Z Lab's
    target layer ids, block size, mask token, anchor, draft vocabulary (None: the target's head)."""
    from transformers import Qwen3Config

    raw = _raw(folder)
    n_target = int(text_config(target_config).num_hidden_layers)
    if raw.get("speculators_model_type") == "dflash":
        tl = dict(raw.get("transformer_layer_config") or {})
        cfg = Qwen3Config(**{k: v for k, v in tl.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
        aux = raw.get("aux_hidden_state_layer_ids")
        if not aux:
            raise FormatError(f"{folder}: a speculators dflash config without aux_hidden_state_layer_ids")
        if min(aux) < 1:
            raise FormatError(f"{folder}: aux_hidden_state_layer_ids {aux} read the embeddings (id 0); "
                              "specbench taps decoder-layer outputs")
        s = {"cfg": cfg, "layer_ids": [int(i) - 1 for i in aux], "block_size": raw.get("block_size"),
             "mask_token_id": raw.get("mask_token_id"), "anchor": "next" if raw.get("sample_from_anchor") else "bonus",
             "draft_vocab": int(raw.get("draft_vocab_size") or 0) or None, "num_target_layers": None,
             "sliding": bool(raw.get("sliding_window_non_causal")) or "sliding_attention" in (tl.get("layer_types") or []),
             "target_hidden": raw.get("target_hidden_size")}
    else:
        dc = dict(raw.get("dflash_config") or {})
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype",
                                                             "dtype", "dflash_config")}
        cfg = Qwen3Config(**fields)
        nd = int(cfg.num_hidden_layers)
        ids = dc.get("target_layer_ids", raw.get("target_layer_ids"))
        nt = raw.get("num_target_layers")
        if ids is None:
            from specbench.drafters.dflash import default_layer_ids

            ids = default_layer_ids(int(nt or n_target), nd)
        s = {"cfg": cfg, "layer_ids": [int(i) for i in ids], "block_size": raw.get("block_size", dc.get("block_size")),
             "mask_token_id": dc.get("mask_token_id", raw.get("mask_token_id")), "anchor": "bonus",
             "draft_vocab": None, "num_target_layers": nt,
             "sliding": bool(raw.get("use_sliding_window")) or "sliding_attention" in (raw.get("layer_types") or []),
             "target_hidden": None}
    act = getattr(s["cfg"], "hidden_act", "silu")
    if act != "silu":
        raise FormatError(f"{folder}: draft layers with hidden_act={act}; specbench's DFlash layer is Qwen3's (silu)")
    if s["sliding"]:
        raise FormatError(f"{folder}: a DFlash drafter with sliding-window layers; specbench drafts with full "
                          "(non-causal) attention in every draft layer")
    if s["block_size"] is None or int(s["block_size"]) < 2:
        raise FormatError(f"{folder}: block_size {s['block_size']!r}: a DFlash block has the anchor and at least one mask slot")
    if s["mask_token_id"] is None:
        raise FormatError(f"{folder}: no mask_token_id in config.json (dflash_config.mask_token_id)")
    return s


def check(folder, target_config, state: dict | None = None) -> dict:
    """``settings`` when the checkpoint matches its declared layout and fits ``target_config``;
    else FormatError in one line. ``state``: the weights when the caller has read them."""
    p = Path(str(folder)).expanduser()
    if (p / "mask_embedding.pt").exists():
        raise FormatError(f"{folder}: a mask_embedding.pt sidecar (a learned mask embedding); specbench embeds the "
                          "mask token with the drafter's embedding")
    s = settings(folder, target_config)
    state = state if state is not None else read_state(folder)
    tc = text_config(target_config)
    d, V, L = int(tc.hidden_size), int(tc.vocab_size), int(tc.num_hidden_layers)
    cfg = s["cfg"]
    nd = int(cfg.num_hidden_layers)
    for bad, what in (("qkv_proj", "fused q|k|v projections"), ("sinks", "attention sinks")):
        if any(bad in k for k in state):
            raise FormatError(f"{folder}: {what} ({next(k for k in state if bad in k)}); specbench reads separate "
                              "q/k/v projections without sinks")
    bias = [f"layers.{i}.{b}" for i in range(nd) for b in BIASES] if getattr(cfg, "attention_bias", False) else []
    want = {f"layers.{i}.{k}" for i in range(nd) for k in LAYER} | set(bias) | {"fc.weight", "hidden_norm.weight",
                                                                                 "norm.weight"}
    optional = set()
    if s["draft_vocab"] is not None:  # speculators: a head of its own; an embedding and vocabulary maps maybe
        want.add("lm_head.weight")
        optional = {"embed_tokens.weight", "d2t", "t2d", "verifier_norm.weight"}
        if s["draft_vocab"] != V:
            want |= {"d2t", "t2d"}
    have = set(state) - (optional - want)
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise FormatError(f"{folder}: not DFlash's layout ({nd} draft layers): missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    if s["num_target_layers"] is not None and int(s["num_target_layers"]) != L:
        raise FormatError(f"{folder}: made for a target of {s['num_target_layers']} layers; the target has {L}: "
                          "a drafter for another target")
    try:
        from specbench.drafters.dflash import taps_of

        taps_of(s["layer_ids"], L)
    except ValueError as e:
        raise FormatError(f"{folder}: {e}") from None
    if int(cfg.hidden_size) != d or (s["target_hidden"] is not None and int(s["target_hidden"]) != d):
        raise FormatError(f"{folder}: a drafter of hidden size {cfg.hidden_size} for a target of "
                          f"{s['target_hidden'] or cfg.hidden_size}; the target's is {d}: a drafter for another target")
    _, H, Hk, Dh, _, _ = layer_shape(cfg)
    inter = int(cfg.intermediate_size)
    shapes = {"self_attn.q_proj.weight": (H * Dh, d), "self_attn.k_proj.weight": (Hk * Dh, d),
              "self_attn.v_proj.weight": (Hk * Dh, d), "self_attn.o_proj.weight": (d, H * Dh),
              "self_attn.q_norm.weight": (Dh,), "self_attn.k_norm.weight": (Dh,), "mlp.gate_proj.weight": (inter, d),
              "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter)}
    for i in range(nd):
        for k, shape in shapes.items():
            if tuple(state[f"layers.{i}.{k}"].shape) != shape:
                raise FormatError(f"{folder}: layers.{i}.{k} is {tuple(state[f'layers.{i}.{k}'].shape)}, config.json makes "
                                  f"it {shape} (heads, head_dim or MLP width disagree with the weights)")
    if tuple(state["fc.weight"].shape) != (d, len(s["layer_ids"]) * d):
        raise FormatError(f"{folder}: fc is {tuple(state['fc.weight'].shape)}; {len(s['layer_ids'])} target layers "
                          f"of hidden size {d} need ({d}, {len(s['layer_ids']) * d}): a drafter for another target")
    if not 0 <= int(s["mask_token_id"]) < V:
        raise FormatError(f"{folder}: mask_token_id {s['mask_token_id']} is outside the target's {V} tokens")
    if s["draft_vocab"] is not None:
        dv = s["draft_vocab"]
        if tuple(state["lm_head.weight"].shape) != (dv, d):
            raise FormatError(f"{folder}: lm_head is {tuple(state['lm_head.weight'].shape)}, config.json says {dv} "
                              f"draft tokens x {d}")
        if "d2t" in state:
            ids = torch.arange(dv) + state["d2t"].long()
            if state["d2t"].numel() != dv or int(ids.min()) < 0 or int(ids.max()) >= V:
                raise FormatError(f"{folder}: d2t maps draft ids outside the target's {V} tokens: a drafter for another target")
        emb = state.get("embed_tokens.weight")
        if emb is not None and tuple(emb.shape) != (V, d):
            raise FormatError(f"{folder}: embed_tokens is {tuple(emb.shape)}; the target's vocabulary and width are ({V}, {d})")
    return s


def load(folder, target, device, dtype):
    from specbench.drafters.dflash import DFlashDrafter

    state = read_state(folder)
    s = check(folder, target.config, state)
    own_emb = "embed_tokens.weight" in state and s["draft_vocab"] is not None
    d = DFlashDrafter(target, s["cfg"], s["layer_ids"], int(s["block_size"]), int(s["mask_token_id"]), s["anchor"],
                      draft_vocab=s["draft_vocab"], own_embedding=own_emb)
    mine = {}
    for k, v in state.items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            mod, leaf = rest.rsplit(".", 1)
            mine[f"layers.{i}.{OURS[mod]}.{leaf}"] = v
        elif k in ("fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"):
            if k != "embed_tokens.weight" or own_emb:
                mine[k] = v
    mine["d2t"] = state["d2t"].long() if "d2t" in state else torch.zeros(s["draft_vocab"] or 0, dtype=torch.long)
    d.load_state_dict(mine, strict=True)
    return ready(d, target, device, dtype, tables=(d.rope.module,))


def save(folder, drafter, dtype=torch.bfloat16) -> None:
    """Write a ``DFlashDrafter`` that uses its target's head and embedding in Z Lab's layout
    (config.json + model.safetensors): what the trainer writes, so Z Lab's code runs it too."""
    if drafter.lm_head is not None or drafter.embed_tokens is not None or drafter.anchor != "bonus":
        raise ValueError("Z Lab's layout holds a drafter that uses its target's head and embedding, bonus anchor")
    theirs = {ours: t for t, ours in OURS.items()}
    state = {}
    for k, v in drafter.state_dict().items():
        if k.startswith("layers."):
            _, i, mod, leaf = k.split(".", 3)
            state[f"layers.{i}.{theirs[mod]}.{leaf}"] = v
        elif k != "d2t":
            state[k] = v
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    raw = drafter.config.to_dict()
    raw.update({"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": drafter.block_size,
                "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": drafter.layer_ids}})
    write_folder(folder, state, raw)
