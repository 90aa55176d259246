"""Trained drafters: small models that reuse parts of their target (its token embedding,
its output layer restricted to a draft vocabulary, its rotary tables) and carry only their
own weights. One module per architecture:

- ``draft_lm``: a small causal LM (``method=leviathan``);
- ``medusa``: extra decoding heads on the target's last hidden state (``method=medusa``);
- ``eagle``: a feature-level autoregressive head (``method=eagle``);
- ``specdec``: a non-autoregressive drafter of k [MASK] queries (``method=specdec``);
- ``eagle3``, ``dflash`` (and ``dspark``), ``mtp``, ``peagle``: drafters their authors publish,
  trained here and written in the authors' layouts (``drafters.formats`` reads them).

``KINDS`` is the one table of drafter kinds: each kind's architecture, the published format its
checkpoints are written in, and its trainer (``python -m specbench.train drafter=<kind>`` looks the
kind up there). A checkpoint folder of specbench's own format holds ``drafter.json`` (``kind``,
shape, target, vocabulary size, the training summary), ``model.safetensors`` (the drafter's own
weights, bf16) and a ``README.md`` card. ``load`` builds the drafter its ``kind`` names on top of a
loaded target. docs/adding-a-drafter-method.md walks through adding a kind.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specbench import kernels
from specbench.hf import text_config



@dataclass(frozen=True)
class Kind:
    """A drafter kind: ``architecture``, the module that defines it (with ``build(meta, state,
    target)`` when its checkpoints are specbench's own); ``format``, the published format its
    trainer writes (a ``drafters.formats`` name: that module reads it back), None for specbench's
    own (``save`` / ``load``); ``trainer``, the module that trains it (the interface:
    ``specbench/train/__init__.py``)."""

    architecture: str
    format: str | None
    trainer: str


KINDS = {
    "draft_lm": Kind("specbench.drafters.draft_lm", None, "specbench.train.loop"),
    "specdec": Kind("specbench.drafters.specdec", None, "specbench.train.specdec"),
    "medusa": Kind("specbench.drafters.medusa", None, "specbench.train.heads"),
    "eagle": Kind("specbench.drafters.eagle", None, "specbench.train.heads"),
    "eagle3": Kind("specbench.drafters.eagle3", "eagle3", "specbench.train.heads"),  # SafeAILab's layout
    "dflash": Kind("specbench.drafters.dflash", "dflash", "specbench.train.dflash"),  # Z Lab's
    "dspark": Kind("specbench.drafters.dspark", "deepspec", "specbench.train.dflash"),  # DeepSpec's
    "mtp": Kind("specbench.drafters.mtp", "speculators-mtp", "specbench.train.mtp"),  # vLLM's speculators
    "peagle": Kind("specbench.drafters.peagle", "speculators-peagle", "specbench.train.peagle"),
}


def kind(name: str) -> Kind:
    """The table's row for drafter kind ``name``; a ``ConfigError`` naming the kinds otherwise."""
    from specbench.errors import ConfigError

    if name not in KINDS:
        raise ConfigError(f"unknown drafter kind '{name}'; choices: {', '.join(KINDS)}")
    return KINDS[name]


def is_draft_checkpoint(path) -> bool:
    p = Path(str(path)).expanduser()
    return (p / "drafter.json").exists() and (p / "model.safetensors").exists()


def read_meta(folder) -> dict:
    return json.loads((Path(folder).expanduser() / "drafter.json").read_text())


def check_fits(folder, cfg, target_config, kind: str, key: str) -> None:
    """``folder`` (named by ``<key>=`` on the command line) holds a ``kind`` drafter trained
    for this job's target; otherwise one ``ConfigError`` line saying how to get one."""
    from specbench.errors import ConfigError

    label = f"{key} '{folder}'"
    if not is_draft_checkpoint(folder):
        raise ConfigError(f"{label} is not a drafter checkpoint (train one: python -m specbench.train "
                          f"drafter={kind} target=<model>)")
    meta = read_meta(folder)
    model_id = str(cfg.model.path or cfg.model.name)
    if meta.get("kind") != kind:
        raise ConfigError(f"{label} holds a {meta.get('kind')} drafter, not a {kind} drafter "
                          f"(python -m specbench.train drafter={kind} target={model_id})")
    tv = getattr(text_config(target_config), "vocab_size", None)
    if meta.get("target") not in (model_id, cfg.model.name) or meta.get("target_vocab_size") != tv:
        raise ConfigError(f"{label} was trained for {meta.get('target')}, not {model_id}; train one for this model "
                          f"(python -m specbench.train drafter={kind} target={model_id})")


def save(drafter: torch.nn.Module, folder: Path, meta: dict, dtype=torch.bfloat16) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in drafter.own_state().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.rename(folder / "model.safetensors")
    (folder / "drafter.json").write_text(json.dumps(meta, indent=1, default=str))


def save_random(drafter: torch.nn.Module, folder: Path, kind: str, std: float | None, target, /, **meta) -> str:
    """``drafter`` untrained, its own weights drawn from N(0, std^2) (seeded; None: as built),
    saved in fp32 as a ``kind`` checkpoint for ``target``, named ``tiny``: what a method's
    ``tiny`` settings point at (``Proposer.tiny``). Returns the folder."""
    if std is not None:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if not name.startswith(drafter.shared_prefixes()):
                    p.copy_(torch.randn(p.shape, generator=g) * std)
    save(drafter.eval(), Path(folder), {"kind": kind, "name": f"random-{kind}", "target": "tiny",
                                        "target_vocab_size": int(text_config(target.config).vocab_size), **meta},
         dtype=torch.float32)
    return str(folder)


def load(folder, target, device, dtype, kind: str | None = None):
    """The drafter stored in ``folder``, on top of ``target``. ``kind`` (if given) must match."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    meta = read_meta(folder)
    own = [k for k, v in KINDS.items() if v.format is None]
    if meta.get("kind") not in own:
        fmt = KINDS[meta["kind"]].format if meta.get("kind") in KINDS else None
        raise ValueError(f"{folder}: " + (f"a {meta['kind']} drafter is written in the {fmt} format (drafters.formats "
                                          f"reads it)" if fmt else f"unknown drafter kind {meta.get('kind')!r}")
                         + f"; this reads {', '.join(own)}")
    if kind is not None and meta["kind"] != kind:
        raise ValueError(f"{folder} holds a '{meta['kind']}' drafter, not '{kind}'")
    tv = int(text_config(target.config).vocab_size)
    if int(meta["target_vocab_size"]) != tv:
        raise ValueError(f"{folder} was trained for a target with {meta['target_vocab_size']} tokens, "
                         f"this target has {tv}")
    state = load_file(str(folder / "model.safetensors"))
    drafter = importlib.import_module(KINDS[meta["kind"]].architecture).build(meta, state, target)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    shared = drafter.shared_prefixes()
    bad = [k for k in missing if not k.startswith(shared)]
    if bad or unexpected:
        raise ValueError(f"{folder}: checkpoint does not fit the drafter (missing {bad[:3]}, unexpected {unexpected[:3]})")
    return ready(drafter, target, device, dtype)


def ready(drafter: torch.nn.Module, target, device, dtype, tables: tuple = ()) -> torch.nn.Module:
    """A loaded drafter made ready to draft: frozen, on ``device`` in ``dtype``, in eval mode, its
    layers on the target's kernel path; ``tables``: modules it built for itself but holds outside
    its module tree (its own RoPE tables, kept fp32), moved beside it so no step copies them."""
    for p in drafter.parameters():
        p.requires_grad_(False)
    drafter = drafter.to(device=device, dtype=dtype).eval()
    for module in tables:
        module.to(device)
    kernels.apply(drafter, kernels.kernel_of(target))  # the drafter's own layers on the target's path
    return drafter


def layer_shape(cfg) -> tuple[int, int, int, int, bool, float]:
    """A decoder layer's shape from its HF config: (hidden size, query heads, key/value heads,
    head dim, attention bias, RMSNorm eps), with HF's defaults where a field is absent."""
    d, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
    return (d, heads, int(getattr(cfg, "num_key_value_heads", None) or heads),
            int(getattr(cfg, "head_dim", None) or d // heads), bool(getattr(cfg, "attention_bias", False)),
            float(getattr(cfg, "rms_norm_eps", 1e-6)))


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights that make a difference, for the tiny drafters of tests and ``Proposer.tiny``:
    vectors (norms, biases) N(1, 0.3^2), matrices N(0, 0.3^2), in parameter order from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


class Drafter(torch.nn.Module):
    """Base of every drafter: a checkpoint stores its own weights, i.e. its state minus the
    parts it shares with the target (``shared_prefixes``)."""

    @staticmethod
    def shared_prefixes() -> tuple:
        return ()

    def own_state(self) -> dict:
        return {k: v for k, v in self.state_dict().items() if not k.startswith(self.shared_prefixes())}


class Borrowed:
    """A module of the target that a drafter calls without owning it (its embedding, its rotary
    tables): callable, its attributes read through, but no ``nn.Module``, so the drafter's
    ``.to()``, ``parameters()``, ``state_dict()`` and training never reach it. A bf16 drafter
    whose module tree held the target's rotary module turned the shared target's RoPE tables
    bf16 for every later job of the sweep. (No ``__slots__``: torch.compile guards on its ``__dict__``.)"""

    def __init__(self, module: torch.nn.Module):
        object.__setattr__(self, "module", module)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"Borrowed({type(self.module).__name__})"


def borrow(owner: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """``owner.<name>`` calls the target's ``module`` without making it a submodule of ``owner``."""
    owner._modules.pop(name, None)
    owner._parameters.pop(name, None)
    owner._buffers.pop(name, None)
    owner.__dict__[name] = Borrowed(module)


class TargetParts:
    """What a drafter borrows from its target without owning it: token embedding, output
    layer rows of the draft vocabulary, rotary tables. Held outside the module tree, so
    never saved and never trained."""

    def __init__(self, target, vocab_ids: torch.Tensor):
        self.target = target
        self.vocab_ids = vocab_ids

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(tokens)

    def head_weight(self) -> torch.Tensor:
        """[V', d]: the target's output rows of the draft vocabulary (cached per weight)."""
        w = self.target.get_output_embeddings().weight
        c = getattr(self, "_head", None)
        if c is None or c[0] is not w or c[1].device != w.device or c[1].dtype != w.dtype or \
                (torch.is_inference(c[1]) and not torch.is_inference_mode_enabled()):
            self._head = (w, w.detach()[self.vocab_ids.to(w.device)])
        return self._head[1]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h`` [..., d] -> logits over the draft vocabulary, on the target head's kernel path."""
        return kernels.linear_like(h, self.head_weight().to(h.dtype), self.target.get_output_embeddings(), self)

    def rope(self, x: torch.Tensor, pos: torch.Tensor):
        return self.target.model.rotary_emb(x, pos)


def vocab_by_frequency(token_lists, size: int | None, vocab_size: int, always: set[int]) -> torch.Tensor:
    """The ``size`` most frequent tokens (always keeping ``always``, e.g. EOS), sorted; the
    lowest ids fill up a vocabulary larger than what the data show. None = every token."""
    if not size or size >= vocab_size:
        return torch.arange(vocab_size)
    cnt = torch.zeros(vocab_size, dtype=torch.long)
    for t in token_lists:
        cnt += torch.bincount(t.long().flatten(), minlength=vocab_size)[:vocab_size]
    for t in always:
        cnt[t] = cnt.max() + 1
    order = torch.argsort(-cnt, stable=True)  # ties: lowest id first
    return order[:size].sort().values
