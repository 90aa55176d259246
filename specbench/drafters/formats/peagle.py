"""P-EAGLE in vLLM's speculators format (``speculators-peagle``; ``models/peagle``).

``config.json`` is speculators' eagle3 config (``transformer_layer_config`` with
``num_hidden_layers`` layers, ``draft_vocab_size``, ``target_hidden_size``,
``eagle_aux_hidden_state_layer_ids``, EAGLE 3.1's ``fc_norm`` / ``norm_output``) plus
``speculators_model_type: peagle``, ``mask_token_id`` and the drafts a step under
``speculators_config.proposal_methods[0].speculative_tokens``. ``model.safetensors`` holds
EAGLE-3's weights (the first layer under ``layers.0.``), the other layers as Llama layers
(``layers.i.self_attn.{q,k,v,o}_proj``, ``layers.i.mlp.*``, their norms) and ``mask_hidden``
[1, 1, taps x hidden]. No P-EAGLE checkpoint is published yet (speculators' docs); the fixture is
speculators' own model."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specbench.drafters import layer_shape, ready
from specbench.drafters.formats import eagle3
from specbench.drafters.formats.common import FormatError, eagle_file, eagle_state, write_folder
from specbench.hf import text_config

NAMES = ("speculators-peagle",)
LAYER = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
         "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
         "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
         "mlp.down_proj": "down_proj"}


def _raw(folder) -> dict:
    return json.loads((Path(str(folder)).expanduser() / "config.json").read_text())


def detect(folder) -> str | None:
    p = Path(str(folder)).expanduser()
    if not (p / "config.json").exists() or eagle_file(p) is None:
        return None
    return "speculators-peagle" if _raw(p).get("speculators_model_type") == "peagle" else None


def depths(folder) -> int:
    """The drafts a step it was trained for (speculators' ``speculative_tokens``; its default 8)."""
    methods = (_raw(folder).get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 8)


def settings(folder) -> dict:
    """The layers' config, draft vocabulary, target hidden size, tap layers, mask token, depths and
    EAGLE 3.1 flags the config declares."""
    from transformers import LlamaConfig

    raw = _raw(folder)
    on = [f for f in eagle3.SPECULATORS_FLAGS if raw.get(f)]
    if on:
        raise FormatError(f"{folder}: a P-EAGLE variant specbench does not draft with ({', '.join(f + '=true' for f in on)})")
    tl = dict(raw.get("transformer_layer_config") or {})
    if tl.get("model_type", "llama") != "llama":
        raise FormatError(f"{folder}: the drafter layers are {tl.get('model_type')} layers; specbench's P-EAGLE layers are Llama's")
    if raw.get("mask_token_id") is None:
        raise FormatError(f"{folder}: no mask_token_id in config.json")
    cfg = LlamaConfig(**{k: v for k, v in tl.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    return {"cfg": cfg, "draft_vocab": int(raw["draft_vocab_size"]), "target_hidden": raw.get("target_hidden_size"),
            "layers": tuple(layers) if layers else None, "mask_token_id": int(raw["mask_token_id"]), "depths": depths(folder),
            "flags": {f: bool(raw.get(f)) for f in eagle3.EAGLE31_FLAGS}}


def check(folder, target_config, state: dict | None = None) -> dict:
    """``settings`` when the weights are P-EAGLE's layout and fit ``target_config``; else
    FormatError in one line."""
    s = settings(folder)
    state = state if state is not None else eagle_state(folder)
    cfg, n = s["cfg"], int(s["cfg"].num_hidden_layers)
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    n_taps = len(s["layers"] or (0, 0, 0))
    first = {f"midlayer.{k}" for k in eagle3.EAGLE3_LAYER}
    rest = {f"layers.{i}.{k}.weight" for i in range(1, n) for k in LAYER}
    norms = {f"fc_norm.{i}.weight" for i in range(n_taps)} if s["flags"]["fc_norm"] else set()
    equal = s["draft_vocab"] == V
    want = {"fc.weight", "norm.weight", "lm_head.weight", "mask_hidden"} | first | rest | norms \
        | (set() if equal else {"d2t", "t2d"})
    have = set(state) - {"embed_tokens.weight"} - ({"d2t", "t2d"} if equal else set())
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise FormatError(f"{folder}: not P-EAGLE's layout ({n} layers, draft_vocab_size={s['draft_vocab']}): "
                          f"missing {missing[:4]}, unexpected {unexpected[:4]}")
    th = int(s["target_hidden"] or cfg.hidden_size)
    if th != d or cfg.hidden_size != d or tuple(state["fc.weight"].shape) != (d, n_taps * d):
        raise FormatError(f"{folder}: fc is {tuple(state['fc.weight'].shape)}, made for a target of hidden size {th}; "
                          f"the target's hidden size is {d}: a drafter for another target")
    if tuple(state["mask_hidden"].shape) != (1, 1, n_taps * d):
        raise FormatError(f"{folder}: mask_hidden is {tuple(state['mask_hidden'].shape)}; {n_taps} taps of {d} need "
                          f"(1, 1, {n_taps * d})")
    _, H, Hk, Dh, _, _ = layer_shape(cfg)
    for i in range(1, n):
        if tuple(state[f"layers.{i}.self_attn.q_proj.weight"].shape) != (H * Dh, d):
            raise FormatError(f"{folder}: layers.{i}.self_attn.q_proj is {tuple(state[f'layers.{i}.self_attn.q_proj.weight'].shape)}, "
                              f"config.json makes it {(H * Dh, d)}")
    if not 0 <= s["mask_token_id"] < V:
        raise FormatError(f"{folder}: mask_token_id {s['mask_token_id']} is outside the target's {V} tokens")
    if tuple(state["lm_head.weight"].shape) != (s["draft_vocab"], d):
        raise FormatError(f"{folder}: lm_head is {tuple(state['lm_head.weight'].shape)}, config.json says "
                          f"{s['draft_vocab']} draft tokens x {d}")
    if not equal:
        ids = torch.arange(s["draft_vocab"]) + state["d2t"].long()
        if tuple(state["t2d"].shape) != (V,) or int(ids.min()) < 0 or int(ids.max()) >= V:
            raise FormatError(f"{folder}: d2t/t2d map a vocabulary of {state['t2d'].numel()} tokens; the target has {V}: "
                              "a drafter for another target")
    eagle3.tap_layers(int(tc.num_hidden_layers), s["layers"])
    return s


def load(folder, target, device, dtype):
    from specbench.drafters.peagle import PEagleDrafter

    state = eagle_state(folder)
    s = check(folder, target.config, state)
    d = PEagleDrafter(target, s["cfg"], s["draft_vocab"], s["mask_token_id"], s["depths"], s["target_hidden"],
                      s["layers"], **s["flags"])
    mine = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"], "lm_head.weight": state["lm_head.weight"],
            "mask_hidden": state["mask_hidden"],
            "d2t": state["d2t"].long() if "d2t" in state else torch.zeros(s["draft_vocab"], dtype=torch.long)}
    mine |= {f"block.{ours}.weight": state[f"midlayer.{theirs}.weight"] for theirs, ours in eagle3.EAGLE3_NAMES.items()}
    mine |= {k: v for k, v in state.items() if k.startswith("fc_norm.")}
    for i in range(1, int(s["cfg"].num_hidden_layers)):
        mine |= {f"more.{i - 1}.{ours}.weight": state[f"layers.{i}.{theirs}.weight"] for theirs, ours in LAYER.items()}
    d.load_state_dict(mine, strict=True)
    return ready(d, target, device, dtype, tables=(d.own_rope.module,))


def save(folder, drafter, dtype=torch.bfloat16) -> None:
    """Write a ``PEagleDrafter`` in speculators' layout (what vLLM's parallel drafting reads)."""
    own = drafter.state_dict()
    state = {"fc.weight": own["fc.weight"], "norm.weight": own["norm.weight"], "lm_head.weight": own["lm_head.weight"],
             "mask_hidden": own["mask_hidden"]}
    state |= {f"layers.0.{theirs}.weight": own[f"block.{ours}.weight"] for theirs, ours in eagle3.EAGLE3_NAMES.items()}
    state |= {k: v for k, v in own.items() if k.startswith("fc_norm.")}
    for i, _ in enumerate(drafter.more, start=1):
        state |= {f"layers.{i}.{theirs}.weight": own[f"more.{i - 1}.{ours}.weight"] for theirs, ours in LAYER.items()}
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    state |= eagle3.vocab_maps(drafter)
    dv = drafter.d2t.numel()
    layer = drafter.config.to_dict()
    layer.update({"model_type": "llama", "num_hidden_layers": 1 + len(drafter.more)})
    raw = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle", "transformer_layer_config": layer,
           "draft_vocab_size": int(dv), "target_hidden_size": int(drafter.fc.in_features // len(drafter.taps)),
           "eagle_aux_hidden_state_layer_ids": [t + 1 for t in drafter.taps], "mask_token_id": drafter.mask_token_id,
           "norm_before_residual": False, "fc_norm": drafter.fc_norm is not None, "norm_output": drafter.norm_output,
           "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafter.depths}]}}
    write_folder(folder, state, raw)
