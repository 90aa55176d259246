"""DFlash and DSpark as their authors publish them: Z Lab's layout (``dflash``), DeepSeek's
DeepSpec (``deepspec``: its DFlash and DSpark releases share one class) and vLLM's speculators format
(``speculators-dflash``, ``speculators-dspark``).

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

DSpark adds a Markov head (``markov_head.markov_w1`` [V, r] and ``markov_w2`` [V', r]; ``gate_proj``
for ``markov_head_type: gated``, ``joint_proj`` for ``rnn``) and a confidence head
(``confidence_head.proj``), declared by ``markov_rank`` (0: none), ``markov_head_type``,
``enable_confidence_head`` and ``confidence_head_with_markov``. speculators ``dspark`` is its
``dflash`` layout plus these (``sample_from_anchor`` defaulting to true). DeepSpec
(``deepseek-ai/*_block7`` on the Hub; ``deepspec/modeling/dspark/qwen3/modeling.py``) writes a Qwen3
config with ``architectures: [Qwen3DSparkModel]``, ``block_size``, ``mask_token_id`` and
``target_layer_ids`` (Z Lab's convention; -1 = the embeddings) at the top level, drafts from its
anchor slot (B drafts), and holds frozen copies of the target's ``embed_tokens`` and ``lm_head``;
specbench's trainer writes that layout without the two copies (the target's are used).

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

NAMES = ("dflash", "deepspec", "speculators-dflash", "speculators-dspark")
SPECULATORS = {"speculators-dflash": "dflash", "speculators-dspark": "dspark"}
LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
         "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.bias")
# theirs (under layers.i.) -> ours (DFlashLayer's attribute names)
OURS = {k.rsplit(".", 1)[0]: k.rsplit(".", 1)[0].split(".")[-1] for k in LAYER}
NO_HEADS = {"markov_rank": 0, "markov_type": "vanilla", "confidence": False, "confidence_with_markov": False}


def _raw(folder) -> dict | None:
    p = Path(str(folder)).expanduser() / "config.json"
    return json.loads(p.read_text()) if p.exists() else None


def detect(folder) -> str | None:
    """``dflash`` (Z Lab's config: ``dflash_config`` or the ``DFlashDraftModel`` architecture),
    ``deepspec`` (a ``*DSparkModel`` architecture), ``speculators-dflash``, ``speculators-dspark``;
    else None."""
    raw = _raw(folder)
    if raw is None or not weight_files(Path(str(folder)).expanduser()):
        return None
    kind = raw.get("speculators_model_type")
    if kind in SPECULATORS.values():
        return f"speculators-{kind}"
    if kind is None and any(str(a).endswith("DSparkModel") for a in raw.get("architectures") or []):
        return "deepspec"
    if kind is None and ("dflash_config" in raw or "DFlashDraftModel" in raw.get("architectures", [])):
        return "dflash"
    return None


def anchor_of(raw: dict) -> str:
    """The anchor convention a config declares: speculators' ``sample_from_anchor`` (default true for
    dspark), DeepSpec's always ``next``, Z Lab's always ``bonus``."""
    kind = raw.get("speculators_model_type")
    if kind is not None:
        return "next" if raw.get("sample_from_anchor", kind == "dspark") else "bonus"
    return "next" if any(str(a).endswith("DSparkModel") for a in raw.get("architectures") or []) else "bonus"


def declared(folder) -> dict:
    """The block size and anchor a checkpoint folder declares, read from its config.json alone."""
    raw = _raw(folder) or {}
    return {"block_size": raw.get("block_size", (raw.get("dflash_config") or {}).get("block_size")),
            "anchor": anchor_of(raw)}


def _heads(raw, folder, speculators: bool) -> dict:
    """DSpark's heads as the config declares them (speculators' defaults where it is silent)."""
    if speculators:  # pydantic defaults of DSparkSpeculatorConfig
        rank, kind = raw.get("markov_rank", 256), raw.get("markov_head_type", "vanilla")
        conf, with_markov = raw.get("enable_confidence_head", True), raw.get("confidence_head_with_markov", True)
    else:
        missing = [k for k in ("markov_rank", "enable_confidence_head") if k not in raw]
        if missing:
            raise FormatError(f"{folder}: a DeepSpec config without {', '.join(missing)}")
        rank, kind = raw["markov_rank"], raw.get("markov_head_type", "vanilla")
        conf, with_markov = raw["enable_confidence_head"], raw.get("confidence_head_with_markov", False)
    from specbench.drafters.dspark import MARKOV_TYPES

    if int(rank) < 0 or (int(rank) and kind not in MARKOV_TYPES):
        raise FormatError(f"{folder}: markov_rank {rank}, markov_head_type {kind!r}: specbench reads ranks >= 0 "
                          f"and the head types {', '.join(MARKOV_TYPES)}")
    if conf and with_markov and not int(rank):
        raise FormatError(f"{folder}: confidence_head_with_markov without a Markov head (markov_rank 0)")
    return {"markov_rank": int(rank), "markov_type": str(kind), "confidence": bool(conf),
            "confidence_with_markov": bool(conf and with_markov)}


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
    fmt = detect(folder)
    if fmt in SPECULATORS:
        tl = dict(raw.get("transformer_layer_config") or {})
        cfg = Qwen3Config(**{k: v for k, v in tl.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
        aux = raw.get("aux_hidden_state_layer_ids")
        if not aux:
            raise FormatError(f"{folder}: a speculators dflash config without aux_hidden_state_layer_ids")
        if min(aux) < 1:
            raise FormatError(f"{folder}: aux_hidden_state_layer_ids {aux} read the embeddings (id 0); "
                              "specbench taps decoder-layer outputs")
        s = {"cfg": cfg, "layer_ids": [int(i) - 1 for i in aux], "block_size": raw.get("block_size"),
             "mask_token_id": raw.get("mask_token_id"),
             "anchor": anchor_of(raw),
             "draft_vocab": int(raw.get("draft_vocab_size") or 0) or None, "num_target_layers": None,
             "heads": _heads(raw, folder, True) if fmt == "speculators-dspark" else dict(NO_HEADS),
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
        if fmt == "deepspec" and not any(str(a).startswith("Qwen3") for a in raw.get("architectures") or []):
            raise FormatError(f"{folder}: a DeepSpec drafter of architecture {raw.get('architectures')}; specbench "
                              "reads its Qwen3 layers (Qwen3DSparkModel)")
        if ids is not None and -1 in [int(i) for i in ids]:
            raise FormatError(f"{folder}: target_layer_ids {list(ids)} read the embeddings (-1); specbench taps "
                              "decoder-layer outputs")
        if ids is None:
            from specbench.drafters.dflash import default_layer_ids

            ids = default_layer_ids(int(nt or n_target), nd)
        s = {"cfg": cfg, "layer_ids": [int(i) for i in ids], "block_size": raw.get("block_size", dc.get("block_size")),
             "mask_token_id": dc.get("mask_token_id", raw.get("mask_token_id")),
             "anchor": anchor_of(raw), "draft_vocab": None, "num_target_layers": nt,
             "heads": _heads(raw, folder, False) if fmt == "deepspec" else dict(NO_HEADS),
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


def head_shapes(heads: dict, V: int, dv: int, d: int) -> dict:
    """DSpark's head weights and their shapes (V target tokens, dv the head's, width d)."""
    r, out = heads["markov_rank"], {}
    if r:
        out = {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (dv, r)}
        if heads["markov_type"] == "gated":
            out |= {"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)}
        elif heads["markov_type"] == "rnn":
            out |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + d), "markov_head.joint_proj.bias": (3 * r,)}
    if heads["confidence"]:
        out |= {"confidence_head.proj.weight": (1, d + (r if heads["confidence_with_markov"] else 0)),
                "confidence_head.proj.bias": (1,)}
    return out


def describe_heads(heads: dict) -> str:
    if not heads["markov_rank"] and not heads["confidence"]:
        return "no DSpark heads"
    markov = f"a {heads['markov_type']} Markov head of rank {heads['markov_rank']}" if heads["markov_rank"] else "no Markov head"
    conf = ("a confidence head" + (" over the Markov embedding" if heads["confidence_with_markov"] else "")
            if heads["confidence"] else "no confidence head")
    return f"{markov}, {conf}"


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
    if s["draft_vocab"] is None and detect(folder) == "deepspec" and {"embed_tokens.weight", "lm_head.weight"} & set(state):
        s["draft_vocab"] = V  # DeepSpec's frozen copies of the target's embedding and head: both, or neither (ours)
        want |= {"embed_tokens.weight", "lm_head.weight"}
    if s["draft_vocab"] is not None:  # speculators: a head of its own; an embedding and vocabulary maps maybe
        want.add("lm_head.weight")
        optional |= {"embed_tokens.weight", "d2t", "t2d", "verifier_norm.weight"}
        if s["draft_vocab"] != V:
            want |= {"d2t", "t2d"}
    heads = head_shapes(s["heads"], V, s["draft_vocab"] or V, d)
    want |= set(heads)
    have = set(state) - (optional - want)
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise FormatError(f"{folder}: not DFlash's layout ({nd} draft layers, "
                          f"{describe_heads(s['heads'])}): missing {missing[:4]}, unexpected {unexpected[:4]}")
    for k, shape in heads.items():
        if tuple(state[k].shape) != shape:
            raise FormatError(f"{folder}: {k} is {tuple(state[k].shape)}; config.json and the target make it {shape}")
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


def _the_targets(state: dict, target) -> bool:
    """Whether a checkpoint's ``embed_tokens`` and ``lm_head`` equal the target's (DeepSpec's
    frozen copies)."""
    pairs = ((state["embed_tokens.weight"], target.get_input_embeddings().weight),
             (state["lm_head.weight"], target.get_output_embeddings().weight))
    return all(a.shape == b.shape and torch.equal(a.to(b.dtype), b.detach().cpu()) for a, b in pairs)


def load(folder, target, device, dtype):
    """A ``DFlashDrafter``, or a ``DSparkDrafter`` where the checkpoint has DSpark's heads."""
    from specbench.drafters.dflash import DFlashDrafter
    from specbench.drafters.dspark import DSparkDrafter

    state = read_state(folder)
    s = check(folder, target.config, state)
    if detect(folder) == "deepspec" and "lm_head.weight" in state and _the_targets(state, target):
        state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
        s["draft_vocab"] = None  # its frozen copies are the target's: drafted with the target's (no second copy)
    own_emb = "embed_tokens.weight" in state and s["draft_vocab"] is not None
    args = (target, s["cfg"], s["layer_ids"], int(s["block_size"]), int(s["mask_token_id"]), s["anchor"])
    h = s["heads"]
    if h["markov_rank"] or h["confidence"]:
        d = DSparkDrafter(*args, draft_vocab=s["draft_vocab"], own_embedding=own_emb, markov_rank=h["markov_rank"],
                          markov_type=h["markov_type"], confidence=h["confidence"],
                          confidence_with_markov=h["confidence_with_markov"])
    else:
        d = DFlashDrafter(*args, draft_vocab=s["draft_vocab"], own_embedding=own_emb)
    mine = {}
    for k, v in state.items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            mod, leaf = rest.rsplit(".", 1)
            mine[f"layers.{i}.{OURS[mod]}.{leaf}"] = v
        elif k.startswith(("markov_head.", "confidence_head.")):
            mine[k] = v
        elif k in ("fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight"):
            if k != "embed_tokens.weight" or own_emb:
                mine[k] = v
    mine["d2t"] = state["d2t"].long() if "d2t" in state else torch.zeros(s["draft_vocab"] or 0, dtype=torch.long)
    d.load_state_dict(mine, strict=True)
    return ready(d, target, device, dtype, tables=(d.rope.module,))


def save(folder, drafter, dtype=torch.bfloat16, anchors: int = 16) -> None:
    """Write a drafter that uses its target's head and embedding (what the trainers write): a
    DFlash drafter of the bonus anchor in Z Lab's layout, so Z Lab's code runs it too; one that
    drafts from its anchor slot, or has DSpark's heads, in DeepSpec's layout without its copies of
    the target's embedding and head (``anchors``: the blocks a sequence it trained with, a field
    DeepSpec's config requires)."""
    from specbench.drafters.dspark import DSparkDrafter

    if drafter.lm_head is not None or drafter.embed_tokens is not None:
        raise ValueError("specbench writes drafters that use their target's head and embedding")
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
    raw.update({"model_type": "qwen3", "block_size": drafter.block_size})
    deepspec = isinstance(drafter, DSparkDrafter) or drafter.anchor != "bonus"
    if not deepspec:
        raw.update({"architectures": ["DFlashDraftModel"],
                    "dflash_config": {"mask_token_id": drafter.mask_token_id, "target_layer_ids": drafter.layer_ids}})
    else:
        markov, conf = getattr(drafter, "markov_head", None), getattr(drafter, "confidence_head", None)
        raw.pop("dflash_config", None)
        raw.update({"architectures": ["Qwen3DSparkModel"], "mask_token_id": drafter.mask_token_id,
                    "target_layer_ids": drafter.layer_ids, "num_anchors": int(anchors),
                    "markov_rank": markov.rank if markov is not None else 0,
                    "enable_confidence_head": conf is not None, "tie_word_embeddings": False})
        if markov is not None:
            raw["markov_head_type"] = markov.kind
        if conf is not None:
            raw["confidence_head_with_markov"] = drafter.confidence_with_markov
    write_folder(folder, state, raw)
