"""Native MTP modules, read out of their target's own checkpoint (``native-mtp``), and vLLM's
speculators ``mtp`` drafter (``speculators-mtp``). ``specbench/drafters/mtp.py`` says what the
families compute; here is where each keeps its weights:

    family      where (L: the target's num_hidden_layers)  fusion / final norm / head
    deepseek    model.layers.L.*  (DeepSeek-V3/R1, GLM-4.5) enorm, hnorm, eh_proj / shared_head.norm / shared_head.head
    qwen3_next  mtp.*, its layer under mtp.layers.0.       pre_fc_norm_embedding, pre_fc_norm_hidden, fc / norm / lm_head
    mimo        model.mtp_layers.0.*                       token_layernorm, hidden_layernorm, input_proj / final_layernorm / lm_head
    speculators mtp_layers.0.* (config: speculators_model_type mtp; no embedding or head saved)

Everything else under the prefix is the decoder layer, named as the target's own layers are; MoE
experts stored one by one (``experts.{i}.gate_proj``...) are stacked as transformers holds them.
Native checkpoints count their modules in ``num_nextn_predict_layers`` (DeepSeek, GLM, MiMo) or
``mtp_num_hidden_layers`` (Qwen3-Next/3.5); one module is implemented, more are refused. DeepSeek's
copies of the embedding and the head are used only where they differ from the target's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specbench.drafters import ready
from specbench.drafters.formats.common import FormatError, model_keys, weight_files, write_folder
from specbench.hf import text_config

NAMES = ("native-mtp", "speculators-mtp")
FUSE = {  # family -> (prefix of its block, {its name: ours} for the parts outside the decoder layer)
    "deepseek": ("model.layers.{L}.", {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "proj", "shared_head.norm": "norm",
                                       "shared_head.head": "head", "embed_tokens": "embedding"}),
    "qwen3_next": ("mtp.", {"pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "fc": "proj", "norm": "norm"}),
    "mimo": ("model.mtp_layers.0.", {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "proj",
                                     "final_layernorm": "norm"}),
    "speculators": ("mtp_layers.0.", {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "proj",
                                      "final_layernorm": "norm"}),
}
LAYER_PREFIX = {"qwen3_next": "mtp.layers.0."}  # where the decoder layer sits, where not under the block's prefix
# Model types whose RMSNorm scales by 1 + w (Gemma's convention; transformers' Qwen3NextRMSNorm): the
# fusion's and the final norm's weights are read as 1 + w into our plain RMSNorms
OFFSET_NORMS = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
SPECULATORS_EXTRA = {"verifier_lm_head.weight"}  # the verifier's head, saved beside the module: not the module's
EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _raw(folder) -> dict:
    p = Path(str(folder)).expanduser() / "config.json"
    return json.loads(p.read_text()) if p.exists() else {}


def modules_declared(raw: dict) -> int:
    """The MTP modules a native checkpoint's config declares (0: none)."""
    raw = raw.get("text_config", raw)
    return int(raw.get("num_nextn_predict_layers") or raw.get("mtp_num_hidden_layers") or 0)


def family(folder, keys: set[str] | None = None) -> str | None:
    """Which family's layout the folder's weights hold (None: no MTP module)."""
    raw = _raw(folder)
    if raw.get("speculators_model_type") == "mtp":
        return "speculators"
    keys = model_keys(Path(str(folder)).expanduser()) if keys is None else keys
    L = int(raw.get("text_config", raw).get("num_hidden_layers") or -1)
    if f"model.layers.{L}.eh_proj.weight" in keys:
        return "deepseek"
    if "mtp.fc.weight" in keys:
        return "qwen3_next"
    if "model.mtp_layers.0.input_proj.weight" in keys:
        return "mimo"
    return None


def detect(folder) -> str | None:
    p = Path(str(folder)).expanduser()
    if not (p / "config.json").exists() or not weight_files(p):
        return None
    raw = _raw(p)
    if raw.get("speculators_model_type") == "mtp":
        return "speculators-mtp"
    return "native-mtp" if modules_declared(raw) and family(p) else None


def _prefixes(fam: str, raw: dict) -> tuple[str, str]:
    L = int(raw.get("text_config", raw).get("num_hidden_layers") or 0)
    block = FUSE[fam][0].format(L=L)
    return block, LAYER_PREFIX.get(fam, block)


def _settings(folder, target_config) -> dict:
    """The family and where its parts sit, when the config declares one module for this target."""
    p = Path(str(folder)).expanduser()
    raw = _raw(p)
    keys = model_keys(p)
    fam = family(p, keys)
    if fam is None:
        n = modules_declared(raw)
        raise FormatError(f"{folder}: no MTP module in its weights" + (f" (config.json declares {n})" if n else "")
                          + "; native MTP is read from DeepSeek-V3/R1, GLM-4.5, MiMo and Qwen3-Next/3.5 checkpoints "
                          "or a speculators 'mtp' folder")
    n = int(raw.get("num_nextn_predict_layers") or 1) if fam == "speculators" else modules_declared(raw)
    if n != 1:
        raise FormatError(f"{folder}: {n} MTP modules declared; specbench drafts with one (every published checkpoint has one)")
    if raw.get("quantization_config") and fam != "speculators":
        q = raw["quantization_config"].get("quant_method", "quantized")
        raise FormatError(f"{folder}: a {q} checkpoint; specbench reads MTP weights in bf16/fp16/fp32 only")
    tl = (raw.get("transformer_layer_config") or {}) if fam == "speculators" else raw.get("text_config", raw)
    tc = text_config(target_config)
    for f in ("hidden_size", "vocab_size"):
        if tl.get(f) is not None and int(tl[f]) != int(getattr(tc, f)):
            raise FormatError(f"{folder}: made for a target of {f} {tl[f]}; the target has {getattr(tc, f)}: "
                              "an MTP module for another target")
    block, layer = _prefixes(fam, raw)
    want = {f"{block}{theirs}.weight" for theirs, ours in FUSE[fam][1].items() if ours not in ("head", "embedding")}
    if not want <= keys:
        raise FormatError(f"{folder}: not the {fam} MTP layout: missing {sorted(want - keys)[:4]}")
    if fam == "speculators":
        other = sorted(k for k in keys if not k.startswith(block) and k not in SPECULATORS_EXTRA | {"lm_head.weight", "embed_tokens.weight"})
        if other:
            raise FormatError(f"{folder}: keys outside the speculators MTP layout: {other[:4]}")
        block_keys = {k for k in keys if k.startswith(block)} | ({"lm_head.weight", "embed_tokens.weight"} & keys)
    else:
        block_keys = {k for k in keys if k.startswith((block, layer))}
    mtype = str(tl.get("model_type") or getattr(tc, "model_type", ""))
    return {"family": fam, "prefixes": (block, layer), "keys": block_keys, "offset_norms": mtype in OFFSET_NORMS}


def _ours(folder, fam: str, prefixes: tuple, items: dict, stack) -> dict:
    """The checkpoint's MTP entries (key -> tensor or shape) under our names, experts stored one by
    one stacked by ``stack(gates, ups, downs)`` as transformers holds them."""
    block, layer = prefixes
    outside = {f"{block}{theirs}.weight": f"{ours}.weight" for theirs, ours in FUSE[fam][1].items()}
    if fam == "speculators":  # copies of the verifier's head and embedding, where a folder keeps them
        outside |= {"lm_head.weight": "head.weight", "embed_tokens.weight": "embedding.weight"}
    mine, experts = {}, {}
    for k, v in items.items():
        m = EXPERT.match(k)
        if k in outside:
            mine[outside[k]] = v
        elif not k.startswith(layer):
            raise FormatError(f"{folder}: unexpected MTP key {k} (the {fam} layout has no such part)")
        elif m:
            experts.setdefault("layer." + m.group(1)[len(layer):], {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            mine["layer." + k[len(layer):]] = v
    for prefix, each in experts.items():
        n = len(each)
        if sorted(each) != list(range(n)) or any(len(e) != 3 for e in each.values()):
            raise FormatError(f"{folder}: {prefix} are not experts 0..{n - 1}, each with gate_proj, up_proj and down_proj")
        mine[f"{prefix}.gate_up_proj"], mine[f"{prefix}.down_proj"] = stack(
            *([each[i][w] for i in range(n)] for w in ("gate_proj", "up_proj", "down_proj")))
    return mine


def _shape_stack(gates, ups, downs) -> tuple:
    return (len(gates), gates[0][0] + ups[0][0], gates[0][1]), (len(downs), *downs[0])


def _tensor_stack(gates, ups, downs) -> tuple:
    return torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups)]), torch.stack(downs)


def _read(folder, keys: set, shapes: bool) -> dict:
    """The entries of ``keys`` only, as shapes (headers) or tensors (a sharded 600 GB checkpoint is
    read for its MTP keys alone)."""
    from safetensors import safe_open

    out = {}
    for f in weight_files(Path(str(folder)).expanduser()):
        if f.suffix != ".safetensors":
            state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            out |= {k: tuple(state[k].shape) if shapes else state[k] for k in keys & set(state)}
            continue
        with safe_open(str(f), framework="pt") as h:
            out |= {k: tuple(h.get_slice(k).get_shape()) if shapes else h.get_tensor(k) for k in keys & set(h.keys())}
    return out


def check(folder, target_config) -> str:
    """The family, when ``folder`` holds one MTP module whose every key and shape fit a block of
    ``target_config``'s decoder layer; else FormatError in one line. Reads the headers only."""
    from specbench.drafters.mtp import expected_state, layer_class

    s = _settings(folder, target_config)
    fam = s["family"]
    mine = _ours(folder, fam, s["prefixes"], _read(folder, s["keys"], shapes=True), _shape_stack)
    try:
        expected = expected_state(target_config)
    except (KeyError, ValueError) as e:
        raise FormatError(f"{folder}: no MTP block can be built of this target's layers ({e}); transformers must "
                          "know its architecture") from None
    want, have = set(expected), set(mine) - {"head.weight", "embedding.weight"}
    if want != have:
        name = layer_class(text_config(target_config)).__name__
        raise FormatError(f"{folder}: the {fam} MTP module does not fit a {name}: "
                          f"missing {sorted(want - have)[:4]}, unexpected {sorted(have - want)[:4]}")
    tc = text_config(target_config)
    expected |= {k: (int(tc.vocab_size), int(tc.hidden_size)) for k in ("head.weight", "embedding.weight")}
    for k in sorted(mine):
        if tuple(mine[k]) != tuple(expected[k]):
            raise FormatError(f"{folder}: {k} is {tuple(mine[k])}, the target's layer needs {tuple(expected[k])}: "
                              "an MTP module for another target")
    return fam


def load(folder, target, device, dtype):
    """The module, built without weights and given the checkpoint's tensors (a DeepSeek-V3 module is
    ~11B parameters: no second copy of it), on ``device`` in ``dtype``; the parameters transformers
    keeps in fp32 (the MoE router's) stay fp32."""
    from specbench.drafters.mtp import MTPDrafter

    fam = check(folder, target.config)
    s = _settings(folder, target.config)
    mine = _ours(folder, fam, s["prefixes"], _read(folder, s["keys"], shapes=False), _tensor_stack)
    if s["offset_norms"]:
        mine |= {k: mine[k].float() + 1.0 for k in ("enorm.weight", "hnorm.weight", "norm.weight")}
    own = {}
    for part, theirs in (("head", target.get_output_embeddings()), ("embedding", target.get_input_embeddings())):
        w = mine.pop(f"{part}.weight", None)
        if w is not None and not torch.equal(w.to(theirs.weight), theirs.weight.detach()):
            own[f"{part}.weight"] = w
    with torch.device("meta"):
        d = MTPDrafter(target, fam, own_head="head.weight" in own, own_embedding="embedding.weight" in own)
    state = mine | own
    d.load_state_dict(state, strict=True, assign=True)
    left = [n for n, t in [*d.named_parameters(), *d.named_buffers()] if t.is_meta]
    if left:  # a buffer the layer makes for itself and does not save: nothing to assign it from
        raise FormatError(f"{folder}: the {fam} MTP block holds unsaved buffers specbench cannot fill: {left[:3]}")
    d = ready(d, target, device, dtype)
    keep = tuple(getattr(type(target), "_keep_in_fp32_modules_strict", None) or ())
    for name, t in [*d.named_parameters(), *d.named_buffers()]:
        if keep and any(k in name for k in keep):
            t.data = state[name].to(device=device, dtype=torch.float32)
    return d


def save(folder, drafter, steps: int = 3, dtype=torch.bfloat16) -> None:
    """Write an ``MTPDrafter`` in speculators' ``mtp`` layout (its ``model.safetensors`` and
    ``config.json``: the decoder layer's config and the steps it was trained for)."""
    if drafter.hidden_first or not drafter.feed_normed or drafter.head is not None or drafter.embedding is not None:
        raise FormatError(f"a {drafter.family} MTP module has no speculators layout (it fuses, feeds back or "
                          "predicts otherwise)")
    prefix, names = FUSE["speculators"]
    ours = {v: k for k, v in names.items()}
    state = {}
    for k, v in drafter.state_dict().items():
        head, _, rest = k.partition(".")
        state[prefix + (rest if head == "layer" else f"{ours[head]}.{rest}")] = v
    gate_up = [k for k in state if k.endswith(".experts.gate_up_proj")]
    if gate_up:
        raise FormatError("an MoE MTP module has no speculators layout specbench writes")
    state = {k: v.detach().to(dtype if v.is_floating_point() else v.dtype).contiguous().cpu() for k, v in state.items()}
    layer = drafter.config.to_dict()
    raw = {"architectures": ["MTPDraftModel"], "speculators_model_type": "mtp", "transformer_layer_config": layer,
           "num_nextn_predict_layers": 1,
           "speculators_config": {"algorithm": "mtp", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(steps)}]}}
    write_folder(folder, state, raw)


def steps(folder) -> int | None:
    """The drafts a step a speculators folder was trained for (None: a native checkpoint)."""
    methods = (_raw(folder).get("speculators_config") or {}).get("proposal_methods") or [{}]
    s = methods[0].get("speculative_tokens")
    return int(s) if s else None
