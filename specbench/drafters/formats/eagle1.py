"""EAGLE-1 / EAGLE-2 as SafeAILab publishes them (``eagle1``), and HASS's (Zhang et al. 2024;
HArmonizedSS/HASS@38922e4 ``model/cnets_hass.py`` is EAGLE-1's drafter: ``fc`` with a bias, layer 0
without an input norm, no head of its own; HASS changes the training, not the layout).

``config.json`` (a LlamaConfig of one decoder layer, an optional ``bias`` for ``fc``) and
``pytorch_model.bin`` or ``model.safetensors``: ``fc`` over cat(token embedding, target feature
after its final norm), embedding first; layer 0 without ``input_layernorm``; the reference loads
the file strictly into a module that also holds ``embed_tokens`` (a copy of the target's), so that
key is allowed. No output layer of its own: the target's scores the drafter's features. EAGLE-2
ships the same layout (its dynamic tree is the method's)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specbench.drafters import ready
from specbench.drafters.formats.common import FormatError, eagle_file, eagle_keys, eagle_state, speculators_raw
from specbench.hf import text_config

NAMES = ("eagle1",)

EAGLE_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "post_attention_layernorm.weight")

def detect(folder) -> str | None:
    p = Path(str(folder)).expanduser()
    if not (p / "config.json").exists() or eagle_file(p) is None or speculators_raw(p) is not None:
        return None
    keys = eagle_keys(p)
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) and \
            not any(k.startswith("midlayer.") for k in keys):
        return "eagle1"
    return None


def config(folder):
    """The drafter layer's LlamaConfig (its own rope_theta, heads, MLP width) and ``fc``'s bias."""
    from transformers import LlamaConfig

    raw = json.loads((Path(folder).expanduser() / "config.json").read_text())
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise FormatError(f"{folder}: config.json declares {raw.get('num_hidden_layers')} layers; an EAGLE drafter has 1")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "bias", "torch_dtype", "dtype")}
    return LlamaConfig(**fields), bool(raw.get("bias", True))


def check(folder, target_config, state: dict | None = None):
    """(drafter config, fc bias) when the checkpoint matches EAGLE-1's layout and fits
    ``target_config``; else FormatError in one line. ``state``: the weights when the caller has
    read them (read once)."""
    cfg, bias = config(folder)
    state = state if state is not None else eagle_state(folder)
    want = {"fc.weight"} | ({"fc.bias"} if bias else set()) | {f"layers.0.{k}" for k in EAGLE_LAYER}
    have = set(state) - {"embed_tokens.weight"}
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        raise FormatError(f"{folder}: not EAGLE-1's layout (bias={bias} in config.json): missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]}")
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    if tuple(state["fc.weight"].shape) != (d, 2 * d) or cfg.hidden_size != d:
        raise FormatError(f"{folder}: fc is {tuple(state['fc.weight'].shape)} for hidden size {cfg.hidden_size}; the "
                          f"target's hidden size is {d}: a drafter for another target")
    emb = state.get("embed_tokens.weight")
    if emb is not None and tuple(emb.shape) != (V, d):
        raise FormatError(f"{folder}: its embedding is {tuple(emb.shape)}, the target has {V} tokens x {d}: "
                          "a drafter for another target")
    return cfg, bias


EAGLE1_NAMES = {"self_attn.q_proj": "q", "self_attn.k_proj": "k", "self_attn.v_proj": "v", "self_attn.o_proj": "o",
                "mlp.gate_proj": "gate", "mlp.up_proj": "up", "mlp.down_proj": "down",
                "post_attention_layernorm": "ln2"}


def save(folder, drafter, dtype=torch.float16) -> None:
    """Write an ``EagleDrafter`` without an input norm in SafeAILab's EAGLE-1/2 layout
    (config.json + pytorch_model.bin, as the authors ship it): ``fc`` and layer 0; the
    embedding and output layer stay the target's."""
    if drafter.block.ln1 is not None:
        raise FormatError("the drafter normalises its fused input (an RMSNorm that EAGLE-1's layer 0 does not have, "
                          "and no key of the layout holds): train it with drafter.input_norm=false to export it")
    own = drafter.state_dict()
    state = {"fc.weight": own["fc.weight"], **({"fc.bias": own["fc.bias"]} if "fc.bias" in own else {})}
    state |= {f"layers.0.{theirs}.weight": own[f"block.{ours}.weight"] for theirs, ours in EAGLE1_NAMES.items()}
    if drafter.block.q.bias is not None:
        raise FormatError("the drafter's attention has biases, which EAGLE-1's layout has no keys for")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().to(dtype).cpu().contiguous() for k, v in state.items()}, out / "pytorch_model.bin.tmp")
    (out / "pytorch_model.bin.tmp").rename(out / "pytorch_model.bin")
    raw = drafter.config.to_dict()
    raw.update({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "bias": "fc.bias" in own})
    raw.pop("layer_types", None)  # one layer now
    (out / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")


def load(folder, target, device, dtype):
    """An ``EagleDrafter`` holding a published EAGLE-1/2 checkpoint: the layer and ``fc`` as
    shipped, no input norm, RoPE from its own config, the target's embedding and output layer
    over the whole vocabulary."""
    from specbench.drafters.eagle import EagleDrafter

    state = eagle_state(folder)
    cfg, bias = check(folder, target.config, state)
    d = EagleDrafter(target, torch.arange(int(text_config(target.config).vocab_size)), config=cfg, fc_bias=bias,
                     input_norm=False)
    mine = {"fc.weight": state["fc.weight"], **({"fc.bias": state["fc.bias"]} if bias else {})}
    mine |= {f"block.{ours}.weight": state[f"layers.0.{theirs}.weight"] for theirs, ours in EAGLE1_NAMES.items()}
    mine["vocab_ids"] = d.vocab_ids
    missing, unexpected = d.load_state_dict(mine, strict=False)
    bad = [k for k in missing if not k.startswith(("block.q.bias", "block.k.bias", "block.v.bias"))]
    if bad or unexpected:  # the config asked for attention biases the layout has no key for
        raise FormatError(f"{folder}: config.json's layer does not fit the weights (missing {bad[:3]}, "
                          f"unexpected {unexpected[:3]})")
    return ready(d, target, device, dtype)
