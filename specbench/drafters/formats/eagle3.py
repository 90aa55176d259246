"""EAGLE-3 as SafeAILab publishes it (``eagle3``) and in vLLM's speculators format
(``speculators-eagle3``).

SafeAILab: ``config.json`` (a LlamaConfig of the drafter layer plus ``draft_vocab_size`` and, for a
drafter narrower than its target, ``target_hidden_size``) and ``pytorch_model.bin`` or
``model.safetensors``: ``fc`` (3 x target hidden -> hidden, no bias), ``midlayer.*`` (with
``hidden_norm``; q/k/v over 2 x hidden), ``norm``, ``lm_head`` over the draft vocabulary, and the
buffers ``d2t`` / ``t2d`` (absent when the two vocabularies are equal). ``embed_tokens.weight``: the
drafter's own embedding where it is narrower than its target, else a copy of the target's (which is
used).

speculators: ``config.json`` with ``speculators_model_type`` (the algorithm), the drafter layer's
config under ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids`` (the target layers whose inputs are fused; null = 2, L//2,
L-3) and the variant flags below; ``model.safetensors`` with EAGLE-3's weights, the layer under
``layers.0.`` instead of ``midlayer.``. What ``speculators convert --eagle3`` writes from an
authors' checkpoint and what vLLM reads. Read by hand (the ``speculators`` package pulls CUDA
builds of torchvision/torchaudio and a pinned transformers; its converter made the fixture). The
variants whose drafter computes something else (extra norms, a fed-back normed output, more than
one layer) are refused, naming the setting."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specbench.drafters import ready
from specbench.drafters.formats.common import (FormatError, eagle_file, eagle_keys, eagle_state, speculators_raw,
                                                write_folder)
from specbench.hf import text_config

NAMES = ("eagle3", "speculators-eagle3")


def detect(folder) -> str | None:
    """``eagle3``, or ``speculators-<algorithm>`` for any speculators checkpoint (vLLM's format
    declares its algorithm; only eagle3 is read)."""
    p = Path(str(folder)).expanduser()
    if not (p / "config.json").exists() or eagle_file(p) is None:
        return None
    raw = speculators_raw(p)
    if raw is not None:
        return f"speculators-{raw['speculators_model_type']}"
    return "eagle3" if any(k.startswith("midlayer.") for k in eagle_keys(p)) else None


EAGLE3_LAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def config(folder):
    """(drafter layer's LlamaConfig, draft vocabulary size, target hidden size or None, the target
    layers whose inputs it reads or None for EAGLE-3's default 2, L//2, L-3)."""
    from transformers import LlamaConfig

    raw = speculators_raw(folder)
    if raw is not None:
        return speculators_config(folder, raw)
    raw = json.loads((Path(folder).expanduser() / "config.json").read_text())
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "bias", "torch_dtype", "dtype")}
    cfg = LlamaConfig(**fields)
    dv = int(raw.get("draft_vocab_size") or raw.get("vocab_size") or 0)
    return cfg, dv, raw.get("target_hidden_size"), None


SPECULATORS_FLAGS = ("norm_before_residual", "norm_before_fc")  # variants not drafted with
EAGLE31_FLAGS = ("fc_norm", "norm_output")  # EAGLE 3.1 (arXiv 2605.09992): drafted with


def variant(folder) -> dict:
    """EAGLE 3.1's flags as the checkpoint's config.json sets them (speculators' or SafeAILab's
    keys): ``fc_norm`` (an RMSNorm per tapped layer before fc) and ``norm_output`` (the post-norm
    state fed back). Neither: EAGLE-3."""
    raw = json.loads((Path(str(folder)).expanduser() / "config.json").read_text())
    return {f: bool(raw.get(f)) for f in EAGLE31_FLAGS}


def version(folder) -> float:
    """3.1 where either EAGLE 3.1 flag is set, else 3."""
    return 3.1 if any(variant(folder).values()) else 3


def speculators_config(folder, raw):
    from transformers import LlamaConfig

    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        other = {"dflash": " and dflash (method=dflash)", "dspark": " and dspark (method=dspark)",
                 "peagle": " and peagle (method=peagle)", "mtp": " and mtp (method=mtp)"}.get(kind, "")
        raise FormatError(f"{folder}: a speculators '{kind}' checkpoint; specbench reads speculators' eagle3 "
                          f"(method=eagle eagle.version=3){other}")
    on = [f for f in SPECULATORS_FLAGS if raw.get(f)]
    tl = dict(raw.get("transformer_layer_config") or {})
    if on or int(tl.get("num_hidden_layers", 1)) != 1:
        what = f"{', '.join(f + '=true' for f in on)}" if on else f"{tl.get('num_hidden_layers')} layers"
        raise FormatError(f"{folder}: a speculators eagle3 variant specbench does not draft with ({what}); "
                          "it reads EAGLE-3 and EAGLE 3.1 (fc_norm, norm_output): one layer, none of "
                          + ", ".join(SPECULATORS_FLAGS))
    if tl.get("model_type", "llama") != "llama":
        raise FormatError(f"{folder}: the drafter layer is a {tl.get('model_type')} layer; specbench's EAGLE-3 layer "
                          "is Llama's")
    cfg = LlamaConfig(**{k: v for k, v in tl.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    return cfg, int(raw["draft_vocab_size"]), raw.get("target_hidden_size"), (tuple(layers) if layers else None)


def check(folder, target_config, state: dict | None = None):
    """(drafter config, draft vocabulary size, target hidden size or None) when the checkpoint
    matches EAGLE-3's layout and fits ``target_config``; else FormatError in one line.
    ``state``: the weights when the caller has read them (read once)."""
    cfg, dv, th, layers = config(folder)
    state = state if state is not None else eagle_state(folder)
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    equal = dv == V
    n_taps = len(layers or (0, 0, 0))
    norms = {f"fc_norm.{i}.weight" for i in range(n_taps)} if variant(folder)["fc_norm"] else set()
    want = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"midlayer.{k}" for k in EAGLE3_LAYER} \
        | (set() if equal else {"d2t", "t2d"}) | norms
    have = set(state) - {"embed_tokens.weight"} - ({"d2t", "t2d"} if equal else set())
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise FormatError(f"{folder}: not EAGLE-3's layout (draft_vocab_size={dv}): missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    tin, n_in = int(th or cfg.hidden_size), len(layers or (0, 0, 0))
    if tin != d or tuple(state["fc.weight"].shape) != (cfg.hidden_size, n_in * d):
        raise FormatError(f"{folder}: fc is {tuple(state['fc.weight'].shape)}, made for a target of hidden size {tin}; "
                          f"the target's hidden size is {d}: a drafter for another target")
    if tuple(state["lm_head.weight"].shape) != (dv, cfg.hidden_size):
        raise FormatError(f"{folder}: lm_head is {tuple(state['lm_head.weight'].shape)}, config.json says "
                          f"{dv} draft tokens x {cfg.hidden_size}")
    if not equal:
        ids = torch.arange(dv) + state["d2t"].long()
        if tuple(state["t2d"].shape) != (V,) or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise FormatError(f"{folder}: d2t/t2d map a vocabulary of {state['t2d'].numel()} tokens; the target has {V}: "
                              "a drafter for another target")
    emb = state.get("embed_tokens.weight")
    if cfg.hidden_size != d and (emb is None or tuple(emb.shape) != (V, cfg.hidden_size)):
        raise FormatError(f"{folder}: a drafter narrower than its target needs its own embedding [{V}, {cfg.hidden_size}]")
    tap_layers(int(tc.num_hidden_layers), layers)  # a target with the tap layers it names
    return cfg, dv, th, layers


def tap_layers(n: int, layers=None):
    from specbench.drafters.eagle3 import tap_layers as taps

    try:
        return taps(n, layers)
    except ValueError as e:
        raise FormatError(str(e)) from None


EAGLE3_NAMES = {"input_layernorm": "input_layernorm", "hidden_norm": "hidden_norm",
                "post_attention_layernorm": "post_attention_layernorm", "self_attn.q_proj": "q",
                "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o", "mlp.gate_proj": "gate",
                "mlp.up_proj": "up", "mlp.down_proj": "down"}


def vocab_maps(drafter) -> dict:
    """``d2t`` (draft id -> target id offset) and ``t2d`` (target ids in the draft vocabulary) of a
    drafter whose head is narrower than its target's vocabulary; none where the two are equal."""
    dv, V = drafter.d2t.numel(), drafter.vocab_size
    if dv == V:
        return {}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[drafter.vocab_ids.cpu()] = True
    return {"d2t": drafter.d2t.detach().long().cpu().contiguous(), "t2d": t2d}


def save(folder, drafter, dtype=torch.bfloat16) -> None:
    """Write an ``Eagle3Drafter`` in SafeAILab's EAGLE-3 layout (config.json + model.safetensors):
    what the trainer writes, so the authors' code and engines reading that layout run it too."""
    own = drafter.state_dict()
    state = {"fc.weight": own["fc.weight"], "norm.weight": own["norm.weight"], "lm_head.weight": own["lm_head.weight"]}
    state |= {f"midlayer.{theirs}.weight": own[f"block.{ours}.weight"] for theirs, ours in EAGLE3_NAMES.items()}
    state |= {k: v for k, v in own.items() if k.startswith("fc_norm.")}
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    state |= vocab_maps(drafter)
    dv = drafter.d2t.numel()
    raw = drafter.config.to_dict()
    raw.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": int(dv), "num_hidden_layers": 1})
    raw.update({"fc_norm": True} if drafter.fc_norm is not None else {})
    raw.update({"norm_output": True} if drafter.norm_output else {})
    write_folder(folder, state, raw)


def load(folder, target, device, dtype):
    from specbench.drafters.eagle3 import Eagle3Drafter

    state = eagle_state(folder)
    cfg, dv, th, layers = check(folder, target.config, state)
    d = Eagle3Drafter(target, cfg, dv, target_hidden=th, layers=layers, **variant(folder))
    names = EAGLE3_NAMES
    mine = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
            "lm_head.weight": state["lm_head.weight"],
            "d2t": state["d2t"].long() if "d2t" in state else torch.zeros(dv, dtype=torch.long)}
    mine |= {f"block.{ours}.weight": state[f"midlayer.{theirs}.weight"] for theirs, ours in names.items()}
    mine |= {k: v for k, v in state.items() if k.startswith("fc_norm.")}
    if cfg.hidden_size != int(text_config(target.config).hidden_size):
        d.embedding = nn.Embedding.from_pretrained(state["embed_tokens.weight"].float(), freeze=True)
        mine["embedding.weight"] = state["embed_tokens.weight"]
    d.load_state_dict(mine, strict=True)
    return ready(d, target, device, dtype, tables=(d.own_rope.module,))
