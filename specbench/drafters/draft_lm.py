"""Trained drafters that reuse parts of their target.

``DraftLM``: a small causal LM with the target's tokenizer. Its token embedding is the
target's (borrowed: outside its module tree, so never cast, saved or trained); its transformer layers are its own (initialised from the
target's first layers); its output layer is the target's head restricted to the
``draft_vocab`` most frequent tokens of the distillation data. On a 49k vocabulary the
output layer dominates a small model's cost, so a frequency-ranked head cuts the draft's
cost severalfold; tokens outside it get probability 0 in the draft, which speculative
sampling handles exactly (q = 0 there; the verifier samples them from the residual).

The forward has the signature the engine's cache calls (input_ids, attention_mask,
position_ids, past_key_values, use_cache, logits_to_keep) and returns logits over the
full vocabulary (-inf outside the draft vocabulary).

A checkpoint folder (see ``specbench.drafters``) holds ``drafter.json`` (shape, target, vocabulary size), ``model.safetensors``
(the draft's own weights: layers, final norm, vocabulary map) and a ``README.md`` card.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from specbench import kernels
from specbench.drafters import Drafter, borrow
from specbench.hf import cache_kwarg, text_config


@dataclass
class DraftOutput:
    logits: torch.Tensor
    hidden_states: tuple | None = None


class DraftLM(Drafter):
    def __init__(self, target, n_layers: int, vocab_ids: torch.Tensor, init_from_target: bool = True):
        super().__init__()
        from transformers import AutoModel

        cfg = copy.deepcopy(text_config(target.config))
        cfg.num_hidden_layers = n_layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types[:n_layers])
        self.config = cfg
        with torch.device("meta"):
            body = AutoModel.from_config(cfg)
        tbody = target.model
        # own layers and norm (trainable); shared embedding and rotary tables (frozen)
        body.layers = nn.ModuleList([copy.deepcopy(tbody.layers[i]) for i in range(n_layers)]) if init_from_target \
            else nn.ModuleList([type(tbody.layers[0])(cfg, i) for i in range(n_layers)])
        body.norm = copy.deepcopy(tbody.norm)
        for name, child in tbody.named_children():  # the embedding, the rotary tables: the target's, not ours
            if name not in ("layers", "norm"):
                borrow(body, name, child)
        self.body = body
        self.vocab_size = int(cfg.vocab_size)
        self.register_buffer("vocab_ids", vocab_ids.clone().long(), persistent=True)
        self._target_head = [target.get_output_embeddings()]  # not a submodule: never saved, never trained
        for p in self.body.parameters():
            p.requires_grad_(False)
        for p in list(self.body.layers.parameters()) + list(self.body.norm.parameters()):
            p.requires_grad_(True)

    # the head is a slice of the target's head, gathered on use so it follows the target's device/dtype
    def head_weight(self) -> torch.Tensor:
        w = self._target_head[0].weight
        c = getattr(self, "_head_cache", None)
        if c is not None and torch.compiler.is_compiling():  # traced (compile=graphs): made by an eager call first
            return c[1]
        if c is None or c[0] is not w or c[1].device != w.device or \
                (torch.is_inference(c[1]) and not torch.is_inference_mode_enabled()):
            self._head_cache = (w, w.detach()[self.vocab_ids.to(w.device)])
        return self._head_cache[1]

    def reduced_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return kernels.linear_like(hidden, self.head_weight(), self._target_head[0], self)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.body.embed_tokens(input_ids)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True,
                logits_to_keep: int = 0, output_hidden_states: bool = False, **_):
        # where embed() is the body's own embedding, the body takes the token ids: the same numbers, and
        # on native its own loop over its fused layers (kernels.native._fused_model_forward) takes ids only
        own = type(self).embed is DraftLM.embed
        kw = self.__dict__.get("_body_kw") if torch.compiler.is_compiling() else None  # traced: the eager call's
        if kw is None:
            kw = self.__dict__["_body_kw"] = cache_kwarg(self.body)
        out = self.body(**({"input_ids": input_ids} if own else {"inputs_embeds": self.embed(input_ids)}),
                        attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
                        **{kw: past_key_values})
        h = out.last_hidden_state
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        small = self.reduced_logits(h)
        full = torch.full((*small.shape[:-1], self.vocab_size), float("-inf"), dtype=small.dtype, device=small.device)
        full[..., self.vocab_ids.to(small.device)] = small
        return DraftOutput(logits=full, hidden_states=(h,) if output_hidden_states else None)


def build(meta: dict, state: dict, target) -> DraftLM:
    """The drafter a checkpoint describes (weights loaded by ``drafters.load``)."""
    return DraftLM(target, int(meta["layers"]), state["vocab_ids"], init_from_target=True)


def hf_folder(target_dir: str, out, n_layers: int, own: dict | None = None) -> str:
    """A plain HF causal-LM folder of a draft that reuses its target, for engines that load a draft
    model by path (vLLM's ``draft_model``): the target's config with ``n_layers`` layers, its
    tokenizer and embedding; the layers and final norm from ``own`` (a ``DraftLM`` checkpoint's
    ``body.*`` weights) or else the target's first ``n_layers`` (``draft_model=self_layers``); the output
    layer the target's, untied. ``own``'s ``vocab_ids`` keep only those rows of it, the others
    zero: a plain head has no bias, so a token outside the draft vocabulary scores 0, not -inf
    (under greedy, drafted only when every draft-vocabulary logit is below 0). Written once (atomically)."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from safetensors.torch import save_file

    from specbench.hf import folder_weights

    out, src = Path(out), Path(target_dir)
    if (out / "config.json").exists():
        return str(out)
    weights, head = folder_weights(src)
    emb = weights["model.embed_tokens.weight"].float()
    keep = {"model.embed_tokens.weight": emb}
    if own is None:
        for k, v in weights.items():
            if k.startswith("model.layers.") and int(k.split(".")[2]) < n_layers or k.startswith("model.norm."):
                keep[k] = v.float()
    else:
        for k, v in own.items():
            if k.startswith("body."):
                keep["model." + k[len("body."):]] = v.float()
        ids = own["vocab_ids"].long()
        restricted = torch.zeros_like(head)
        restricted[ids] = head[ids]
        head = restricted
    keep["lm_head.weight"] = head.contiguous()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(num_hidden_layers=n_layers, tie_word_embeddings=False, dtype="float32")
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:n_layers]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    save_file({k: v.contiguous() for k, v in keep.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():  # tokenizer and generation config
        if f.suffix in (".json", ".jinja", ".txt", ".model") and f.name not in ("config.json",) and \
                not f.name.endswith(".safetensors.index.json"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return str(out)
