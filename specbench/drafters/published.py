"""Drafters as their authors publish them, loaded strictly: a checkpoint whose keys do not match
its declared format, or whose shapes do not fit the target, is refused in one line naming what
is missing and what is unexpected (the reference loaders' ``strict=False`` hides partial loads).

Formats (``detect``):

- ``eagle1``: SafeAILab's EAGLE-1/EAGLE-2 drafters (below, with the code that reads them), and
  HASS's (Zhang et al. 2024; HArmonizedSS/HASS@38922e4 ``model/cnets_hass.py`` is EAGLE-1's
  drafter: ``fc`` with a bias, layer 0 without an input norm, no head of its own; HASS changes
  the training, not the layout. The extra norms speculators' converter offers are its own
  EAGLE variant's, not in HASS's release).
- ``medusa2``: Medusa-2, the heads inside the fine-tuned target's folder (below).
- ``speculators-eagle3``: vLLM's speculators format (below).
- ``eagle3``: SafeAILab's EAGLE-3 drafters (below).
- ``medusa1``: FasterDecoding's Medusa-1 heads (Cai et al. 2024), e.g.
  ``FasterDecoding/medusa-vicuna-7b-v1.3``: ``config.json`` with ``medusa_num_heads`` and
  ``medusa_num_layers``, and ``medusa_lm_head.pt``, the state of a list of heads, each
  ``num_layers`` residual blocks ``x + SiLU(W x + b)`` (keys ``{head}.{layer}.linear.weight``
  and ``.bias``) and a full-vocabulary output layer of its own (``{head}.{num_layers}.weight``),
  all reading the target's last hidden state after its final norm. The reference builds the
  blocks of a head as one module repeated, so their keys repeat the same tensors; each is read
  as its own here, which computes the same.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specbench import backends
from specbench.drafters.medusa import MedusaHeads
from specbench.hf import text_config

MEDUSA1_HEADS = "medusa_lm_head.pt"


def named_trees(method: str) -> dict[str, list[list[int]]]:
    """The candidate trees ``method``'s authors published, by name (``trees/<method>.json``, made by
    ``tests/fixtures/make_trees.py`` from their repository): each path a list of top-k ranks, one
    per depth. Medusa's and EAGLE-1's share a name (``mc_sim_7b_63``) but are different trees."""
    return json.loads((Path(__file__).parent / "trees" / f"{method}.json").read_text())["trees"]


class FormatError(ValueError):
    """A published checkpoint that does not match its format or its target (one line)."""


def detect(folder) -> str | None:
    """The published format of ``folder``: ``medusa1``, ``eagle1`` (EAGLE-1 and EAGLE-2 ship one
    layout), ``eagle3``, ``speculators-<algorithm>`` (vLLM's format; ``speculators-eagle3`` is
    read); None: not a published drafter."""
    p = Path(str(folder)).expanduser()
    if (p / MEDUSA1_HEADS).exists() and (p / "config.json").exists():
        return "medusa1"
    if (p / "config.json").exists() and "medusa_num_heads" in json.loads((p / "config.json").read_text()) \
            and any(k.startswith(MEDUSA2_PREFIX) for k in _model_keys(p)):
        return "medusa2"
    return _eagle_detect(p)


def medusa1_shape(folder) -> tuple[int, int]:
    """(heads, residual blocks per head) from the checkpoint's config.json."""
    cfg = json.loads((Path(folder).expanduser() / "config.json").read_text())
    try:
        return int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise FormatError(f"{folder}: config.json names no medusa_num_heads (not a Medusa-1 checkpoint)") from None


def medusa1_keys(heads: int, layers: int) -> set[str]:
    keys = {f"{h}.{layers}.weight" for h in range(heads)}
    for h in range(heads):
        for k in range(layers):
            keys |= {f"{h}.{k}.linear.weight", f"{h}.{k}.linear.bias"}
    return keys


# Medusa-2 (Cai et al. 2024, the heads trained jointly with the target, e.g.
# ``FasterDecoding/medusa-1.0-vicuna-7b-v1.5``): the fine-tuned target itself, an HF model folder
# whose config.json adds ``medusa_num_heads`` / ``medusa_num_layers`` and whose weights hold the
# heads beside the model's own, under ``medusa_head.`` with Medusa-1's key layout. The target must
# be that fine-tuned model (``model.path`` = the same folder): its heads read its states.

MEDUSA2_PREFIX = "medusa_head."


def _weight_files(p: Path) -> list[Path]:
    """An HF folder's weight files (one or sharded; safetensors preferred, as transformers does)."""
    st = sorted(p.glob("model*.safetensors"))
    return st or sorted(p.glob("pytorch_model*.bin"))


def _model_keys(p: Path) -> set[str]:
    keys = set()
    for f in _weight_files(p):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                keys |= set(h.keys())
        else:
            keys |= set(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
    return keys


def _medusa2_state(p: Path) -> dict:
    """The ``medusa_head.`` tensors of a Medusa-2 model folder, under Medusa-1's key names."""
    state = {}
    for f in _weight_files(p):
        if f.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as h:
                state |= {k[len(MEDUSA2_PREFIX):]: h.get_tensor(k) for k in h.keys() if k.startswith(MEDUSA2_PREFIX)}
        else:
            part = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            state |= {k[len(MEDUSA2_PREFIX):]: v for k, v in part.items() if k.startswith(MEDUSA2_PREFIX)}
    return state


def _read_medusa1(folder) -> tuple[dict, int, int]:
    """(heads' state under Medusa-1's key names, heads, blocks) of a Medusa-1 or Medusa-2 folder."""
    heads, layers = medusa1_shape(folder)
    p = Path(folder).expanduser()
    two = not (p / MEDUSA1_HEADS).exists()
    state = _medusa2_state(p) if two else torch.load(p / MEDUSA1_HEADS, map_location="cpu", weights_only=True)
    want, have = medusa1_keys(heads, layers), set(state)
    if want != have:
        missing, unexpected = sorted(want - have), sorted(have - want)
        if two:
            missing, unexpected = [MEDUSA2_PREFIX + k for k in missing], [MEDUSA2_PREFIX + k for k in unexpected]
        raise FormatError(f"{folder}: not the Medusa-{2 if two else 1} layout its config.json declares ({heads} heads x {layers} "
                          f"blocks): missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, unexpected "
                          f"{unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    return state, heads, layers


def check_medusa1(folder, target_config, read: tuple | None = None) -> tuple[int, int]:
    """The checkpoint's (heads, blocks) when it fits ``target_config``; else FormatError.
    ``read``: ``_read_medusa1(folder)`` when the caller has it (the file is read once)."""
    state, heads, layers = read or _read_medusa1(folder)
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    for h in range(heads):
        for k in range(layers):
            if tuple(state[f"{h}.{k}.linear.weight"].shape) != (d, d):
                raise FormatError(f"{folder}: head {h} block {k} is {tuple(state[f'{h}.{k}.linear.weight'].shape)}, "
                                  f"the target's hidden size is {d}: a drafter for another target")
        if tuple(state[f"{h}.{layers}.weight"].shape) != (V, d):
            raise FormatError(f"{folder}: head {h}'s output layer is {tuple(state[f'{h}.{layers}.weight'].shape)}, "
                              f"the target has {V} tokens x {d}: a drafter for another target")
    return heads, layers


class Medusa1Heads(MedusaHeads):
    """Medusa-1 heads with their own output layers: ``MedusaHeads``' first residual block per
    head, ``n_layers - 1`` more, then a full-vocabulary output layer per head; head k turns the
    target's last hidden state into logits for token t+1+k."""

    def __init__(self, target, heads: int, layers: int):
        V = int(text_config(target.config).vocab_size)
        super().__init__(target, torch.arange(V), heads)  # the whole vocabulary
        d = self.weight.shape[-1]
        self.n_layers = layers
        self.more_weight = nn.Parameter(torch.zeros(heads, layers - 1, d, d))
        self.more_bias = nn.Parameter(torch.zeros(heads, layers - 1, d))
        self.head = nn.Parameter(torch.zeros(heads, V, d))

    def output(self, h: torch.Tensor) -> torch.Tensor:
        for k in range(self.n_layers - 1):
            h = h + F.silu(torch.einsum("hni,hoi->hno", h, self.more_weight[:, k].to(h.dtype))
                           + self.more_bias[:, k, None].to(h.dtype))
        return torch.einsum("hni,hvi->hnv", h, self.head.to(h.dtype))


def load_medusa1(folder, target, device, dtype) -> Medusa1Heads:
    read = _read_medusa1(folder)
    heads, layers = check_medusa1(folder, target.config, read)
    state = read[0]
    m = Medusa1Heads(target, heads, layers)
    with torch.no_grad():
        for h in range(heads):
            m.weight[h].copy_(state[f"{h}.0.linear.weight"])
            m.bias[h].copy_(state[f"{h}.0.linear.bias"])
            for k in range(1, layers):
                m.more_weight[h, k - 1].copy_(state[f"{h}.{k}.linear.weight"])
                m.more_bias[h, k - 1].copy_(state[f"{h}.{k}.linear.bias"])
            m.head[h].copy_(state[f"{h}.{layers}.weight"])
    for p in m.parameters():
        p.requires_grad_(False)
    return m.to(device=device, dtype=dtype).eval()


def save_medusa1(folder, blocks_w: torch.Tensor, blocks_b: torch.Tensor, heads_w: torch.Tensor,
                 base_model: str) -> None:
    """Write Medusa-1's layout: ``blocks_w`` [H, L, d, d], ``blocks_b`` [H, L, d], ``heads_w`` [H, V, d]."""
    H, L = blocks_w.shape[:2]
    state = {}
    for h in range(H):
        for k in range(L):
            state[f"{h}.{k}.linear.weight"] = blocks_w[h, k].detach().clone().contiguous()
            state[f"{h}.{k}.linear.bias"] = blocks_b[h, k].detach().clone().contiguous()
        state[f"{h}.{L}.weight"] = heads_w[h].detach().clone().contiguous()
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / MEDUSA1_HEADS)
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": int(H), "medusa_num_layers": int(L),
                                                 "base_model_name_or_path": base_model}, indent=1) + "\n")


# ---------------------------------------------------------------- EAGLE-1 / EAGLE-2 (SafeAILab)
#
# ``config.json`` (a LlamaConfig of one decoder layer, an optional ``bias`` for ``fc``) and
# ``pytorch_model.bin`` or ``model.safetensors``: ``fc`` over cat(token embedding, target feature
# after its final norm), embedding first; layer 0 without ``input_layernorm``; the reference
# loads the file strictly into a module that also holds ``embed_tokens`` (a copy of the
# target's), so that key is allowed. No output layer of its own: the target's scores the
# drafter's features. EAGLE-2 ships the same layout (its dynamic tree is the method's).

EAGLE_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
               "post_attention_layernorm.weight")
EAGLE_WEIGHTS = ("pytorch_model.bin", "model.safetensors")


def _eagle_file(folder) -> Path | None:
    p = Path(str(folder)).expanduser()
    return next((p / f for f in EAGLE_WEIGHTS if (p / f).exists()), None)


def _eagle_state(folder) -> dict:
    """The weights, under SafeAILab's key names (a ``speculators`` checkpoint's ``layers.0.`` is
    EAGLE-3's ``midlayer.``)."""
    f = _eagle_file(folder)
    if f.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(f))
    else:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)  # mapped: read as used
    if _speculators_raw(folder) is not None:
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    return state


def _eagle_keys(folder) -> set[str]:
    """The weight file's keys, without reading its tensors (safetensors' header; a mapped .bin)."""
    f = _eagle_file(folder)
    if f.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as h:
            return set(h.keys())
    return set(_eagle_state(folder))


def _eagle_detect(folder) -> str | None:
    p = Path(str(folder)).expanduser()
    if not (p / "config.json").exists() or _eagle_file(p) is None:
        return None
    raw = _speculators_raw(p)
    if raw is not None:  # vLLM's speculators format declares its algorithm
        return f"speculators-{raw['speculators_model_type']}"
    keys = _eagle_keys(p)
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys):
        return "eagle1"
    return None


def eagle1_config(folder):
    """The drafter layer's LlamaConfig (its own rope_theta, heads, MLP width) and ``fc``'s bias."""
    from transformers import LlamaConfig

    raw = json.loads((Path(folder).expanduser() / "config.json").read_text())
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise FormatError(f"{folder}: config.json declares {raw.get('num_hidden_layers')} layers; an EAGLE drafter has 1")
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "bias", "torch_dtype", "dtype")}
    return LlamaConfig(**fields), bool(raw.get("bias", True))


def check_eagle1(folder, target_config, state: dict | None = None):
    """(drafter config, fc bias) when the checkpoint matches EAGLE-1's layout and fits
    ``target_config``; else FormatError in one line. ``state``: the weights when the caller has
    read them (read once)."""
    cfg, bias = eagle1_config(folder)
    state = state if state is not None else _eagle_state(folder)
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


def save_eagle1(folder, drafter, dtype=torch.float16) -> None:
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


def load_eagle1(folder, target, device, dtype):
    """An ``EagleDrafter`` holding a published EAGLE-1/2 checkpoint: the layer and ``fc`` as
    shipped, no input norm, RoPE from its own config, the target's embedding and output layer
    over the whole vocabulary."""
    from specbench.drafters.eagle import EagleDrafter

    state = _eagle_state(folder)
    cfg, bias = check_eagle1(folder, target.config, state)
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
    for p in d.parameters():
        p.requires_grad_(False)
    d = d.to(device=device, dtype=dtype).eval()
    backends.apply(d, backends.kernel_of(target))
    return d


# ---------------------------------------------------------------- EAGLE-3 (SafeAILab)
#
# ``config.json`` (a LlamaConfig of the drafter layer plus ``draft_vocab_size`` and, for a drafter
# narrower than its target, ``target_hidden_size``) and ``pytorch_model.bin`` or
# ``model.safetensors``: ``fc`` (3 x target hidden -> hidden, no bias), ``midlayer.*`` (with
# ``hidden_norm``; q/k/v over 2 x hidden), ``norm``, ``lm_head`` over the draft vocabulary, and the
# buffers ``d2t`` / ``t2d`` (absent when the two vocabularies are equal). ``embed_tokens.weight``:
# the drafter's own embedding where it is narrower than its target, else a copy of the target's
# (which is used).

EAGLE3_LAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def eagle3_config(folder):
    """(drafter layer's LlamaConfig, draft vocabulary size, target hidden size or None, the target
    layers whose inputs it reads or None for EAGLE-3's default 2, L//2, L-3)."""
    from transformers import LlamaConfig

    raw = _speculators_raw(folder)
    if raw is not None:
        return speculators_eagle3_config(folder, raw)
    raw = json.loads((Path(folder).expanduser() / "config.json").read_text())
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "bias", "torch_dtype", "dtype")}
    cfg = LlamaConfig(**fields)
    dv = int(raw.get("draft_vocab_size") or raw.get("vocab_size") or 0)
    return cfg, dv, raw.get("target_hidden_size"), None


# ---------------------------------------------------------------- vLLM's speculators format
#
# ``config.json`` with ``speculators_model_type`` (the algorithm), the drafter layer's config under
# ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
# ``eagle_aux_hidden_state_layer_ids`` (the target layers whose inputs are fused; null = 2, L//2,
# L-3) and the variant flags below; ``model.safetensors`` with EAGLE-3's weights, the layer under
# ``layers.0.`` instead of ``midlayer.``. What ``speculators convert --eagle3`` writes from an
# authors' checkpoint and what vLLM reads. Read by hand (the ``speculators`` package pulls CUDA
# builds of torchvision/torchaudio and a pinned transformers; its converter made the fixture).
# The variants whose drafter computes something else (extra norms, a fed-back normed output,
# more than one layer) are refused, naming the setting.

SPECULATORS_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _speculators_raw(folder) -> dict | None:
    p = Path(str(folder)).expanduser() / "config.json"
    if not p.exists():
        return None
    raw = json.loads(p.read_text())
    return raw if "speculators_model_type" in raw else None


def speculators_eagle3_config(folder, raw):
    from transformers import LlamaConfig

    kind = raw["speculators_model_type"]
    if kind != "eagle3":
        raise FormatError(f"{folder}: a speculators '{kind}' checkpoint; specbench reads speculators' eagle3 "
                          "(method=eagle eagle.version=3)")
    on = [f for f in SPECULATORS_FLAGS if raw.get(f)]
    tl = dict(raw.get("transformer_layer_config") or {})
    if on or int(tl.get("num_hidden_layers", 1)) != 1:
        what = f"{', '.join(f + '=true' for f in on)}" if on else f"{tl.get('num_hidden_layers')} layers"
        raise FormatError(f"{folder}: a speculators eagle3 variant specbench does not draft with ({what}); "
                          "it reads EAGLE-3 as published: one layer, none of " + ", ".join(SPECULATORS_FLAGS))
    if tl.get("model_type", "llama") != "llama":
        raise FormatError(f"{folder}: the drafter layer is a {tl.get('model_type')} layer; specbench's EAGLE-3 layer "
                          "is Llama's")
    cfg = LlamaConfig(**{k: v for k, v in tl.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")})
    layers = raw.get("eagle_aux_hidden_state_layer_ids")
    return cfg, int(raw["draft_vocab_size"]), raw.get("target_hidden_size"), (tuple(layers) if layers else None)


def check_eagle3(folder, target_config, state: dict | None = None):
    """(drafter config, draft vocabulary size, target hidden size or None) when the checkpoint
    matches EAGLE-3's layout and fits ``target_config``; else FormatError in one line.
    ``state``: the weights when the caller has read them (read once)."""
    cfg, dv, th, layers = eagle3_config(folder)
    state = state if state is not None else _eagle_state(folder)
    tc = text_config(target_config)
    d, V = int(tc.hidden_size), int(tc.vocab_size)
    equal = dv == V
    want = {"fc.weight", "norm.weight", "lm_head.weight"} | {f"midlayer.{k}" for k in EAGLE3_LAYER} \
        | (set() if equal else {"d2t", "t2d"})
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


def save_eagle3(folder, drafter, dtype=torch.bfloat16) -> None:
    """Write an ``Eagle3Drafter`` in SafeAILab's EAGLE-3 layout (config.json + model.safetensors):
    what the trainer writes, so the authors' code and engines reading that layout run it too."""
    from safetensors.torch import save_file

    own = drafter.state_dict()
    state = {"fc.weight": own["fc.weight"], "norm.weight": own["norm.weight"], "lm_head.weight": own["lm_head.weight"]}
    state |= {f"midlayer.{theirs}.weight": own[f"block.{ours}.weight"] for theirs, ours in EAGLE3_NAMES.items()}
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in state.items()}
    dv, V = drafter.d2t.numel(), drafter.vocab_size
    if dv != V:
        state["d2t"] = drafter.d2t.detach().long().cpu().contiguous()
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[drafter.vocab_ids.cpu()] = True
        state["t2d"] = t2d
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors.tmp"))
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    raw = drafter.config.to_dict()
    raw.update({"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": int(dv), "num_hidden_layers": 1})
    (out / "config.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")


def load_eagle3(folder, target, device, dtype):
    from specbench.drafters.eagle3 import Eagle3Drafter

    state = _eagle_state(folder)
    cfg, dv, th, layers = check_eagle3(folder, target.config, state)
    d = Eagle3Drafter(target, cfg, dv, target_hidden=th, layers=layers)
    names = EAGLE3_NAMES
    mine = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
            "lm_head.weight": state["lm_head.weight"],
            "d2t": state["d2t"].long() if "d2t" in state else torch.zeros(dv, dtype=torch.long)}
    mine |= {f"block.{ours}.weight": state[f"midlayer.{theirs}.weight"] for theirs, ours in names.items()}
    if cfg.hidden_size != int(text_config(target.config).hidden_size):
        d.embedding = nn.Embedding.from_pretrained(state["embed_tokens.weight"].float(), freeze=True)
        mine["embedding.weight"] = state["embed_tokens.weight"]
    d.load_state_dict(mine, strict=True)
    for p in d.parameters():
        p.requires_grad_(False)
    d = d.to(device=device, dtype=dtype).eval()
    backends.apply(d, backends.kernel_of(target))
    return d
