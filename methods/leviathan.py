"""Speculative sampling with a draft model (Leviathan et al. 2023; Chen et al. 2023).

The draft runs K autoregressive steps per engine step on its own per-row cache and hands
the engine a chain with the distributions it sampled from; the engine verifies it
(greedy match, or min(1, p/q) acceptance with residual resampling).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict

from specbench.methods.base import BatchState, Proposer
from specbench import kernels, drafters
from specbench.devices import to_device
from specbench.decode.tree import Draft, pad_rows
from specbench.decode.kv import RaggedCache
from specbench.drafters.cache import draft_cache
from specbench.errors import ConfigError
from specbench.hf import max_positions, text_config
from specbench.models import cached_model, load_config, load_tokenizer, model_cfg, self_layers_draft
from specbench.paths import CONF_DIR, resolve_path
from specbench.decode.verify import greedy_pick, sample, warp


# The drafts shipped for packaged targets (conf/draft_model/<name>.yaml), which draft_model=auto chooses.
SHIPPED = {"smollm2-135m": "smollm2-135m-draft"}
SELF_LAYERS = 4  # draft_model=auto on any other target: its first 4 layers (at most all but one)


def resolved(cfg):
    """``cfg`` with ``draft_model=auto`` replaced by the draft it stands for: the shipped draft of a packaged
    target, else the target's first layers. A draft setting the chosen draft does not take is refused
    in one line."""
    d = cfg.draft_model
    if d.name == "auto":
        shipped = None if cfg.model.get("path") or cfg.model.get("shape") else SHIPPED.get(str(cfg.model.name))
        if shipped is not None:
            if d.get("layers") is not None:
                raise ConfigError(f"draft_model.layers={d.layers}: draft_model=auto runs the shipped draft {shipped} on "
                                  f"{cfg.model.name}, which has its own layers; add draft_model=self_layers to draft with the "
                                  f"target's first {d.layers} layers")
            new = OmegaConf.load(CONF_DIR / "draft_model" / f"{shipped}.yaml")
        else:
            n = d.get("layers")
            if n is None:
                total = getattr(text_config(load_config(cfg.model)), "num_hidden_layers", None) or SELF_LAYERS + 1
                n = max(1, min(SELF_LAYERS, total - 1))
            new = OmegaConf.create({"name": "self_layers", "layers": n, "path": None})
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.draft_model = new
    elif d.name in ("trained", "hf") and d.get("layers") is not None:
        raise ConfigError(f"draft_model.layers={d.layers} applies to draft_model=self_layers (the target's first layers); draft "
                          f"{d.get('label') or d.path} has its own: drop draft_model.layers, or add draft_model=self_layers")
    return cfg


def trained_draft(cfg) -> str | None:
    """The folder of a trained ``draft_lm`` checkpoint named by ``cfg.draft_model`` (or None)."""
    if cfg.draft_model.name == "self_layers":
        return None
    path = resolve_path(cfg.draft_model.path)
    return path if drafters.is_draft_checkpoint(path) else None


def hf_draft_cfg(cfg):
    """The model config of the draft when it is a separate model (None for self_layers and
    trained drafter checkpoints)."""
    if cfg.draft_model.name == "self_layers" or trained_draft(cfg):
        return None
    return model_cfg(str(cfg.draft_model.path), cfg.model.get("attn_implementation"))


class Leviathan(Proposer):
    name = "leviathan"

    @dataclass
    class Settings:  # the draft comes from the draft_model group: draft_model=self_layers (draft_model.layers=n) or draft_model=<hub id / folder>
        name: str = "leviathan"

    @classmethod
    def check(cls, cfg, target_config) -> None:
        cfg = resolved(cfg)
        tc = text_config(target_config)
        folder, dm = trained_draft(cfg), hf_draft_cfg(cfg)
        if folder:
            drafters.check_fits(folder, cfg, target_config, "draft_lm", "draft_model")
        elif dm is None:
            n_layers = getattr(tc, "num_hidden_layers", None)
            layers = cfg.draft_model.layers
            if not isinstance(layers, int) or n_layers is not None and not 1 <= layers < n_layers:
                raise ConfigError(f"draft_model.layers must be an integer in 1..{(n_layers or 2) - 1}, got {layers!r}")
        else:
            t_vocab = load_tokenizer(cfg.model).get_vocab()
            d_vocab = load_tokenizer(dm).get_vocab()
            if t_vocab != d_vocab:
                diff = len(set(t_vocab.items()) ^ set(d_vocab.items()))
                raise ConfigError(f"draft_model '{cfg.draft_model.path}' has another vocabulary than the target "
                                  f"({len(d_vocab)} vs {len(t_vocab)} tokens, {diff} entries differ)")

    @classmethod
    def positions(cls, cfg, target_config) -> int:
        cfg = resolved(cfg)
        dm = hf_draft_cfg(cfg)  # a separate draft LM has positions of its own; the others share the target's
        own = max_positions(target_config)
        return own if dm is None else min(own, max_positions(load_config(dm)))

    @classmethod
    def draft_label(cls, cfg) -> str:
        cfg = resolved(cfg)
        if cfg.draft_model.name == "self_layers":
            return f"self_layers:{cfg.draft_model.layers}"
        return str(cfg.draft_model.get("label") or cfg.draft_model.path)

    @staticmethod
    def load_draft(cfg, target, device, dtype):
        cfg = resolved(cfg)
        folder = trained_draft(cfg)
        if folder:
            return drafters.load(folder, target, device, dtype, kind="draft_lm")
        dm = hf_draft_cfg(cfg)
        if dm is None:
            return self_layers_draft(target, int(cfg.draft_model.layers))
        return cached_model(dm, device, dtype, kernels.kernel_of(target))[0]  # on the target's kernel path

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``draft_model`` with the job's draft as a plain HF folder (ours exported once into the
        cache: ``drafters.draft_lm.hf_folder``)."""
        return {"method": "draft_model", "model": cls.hf_draft_folder(cfg), "num_speculative_tokens": int(cfg.K)}

    @staticmethod
    def hf_draft_folder(cfg) -> str:
        import hashlib

        from specbench.drafters.draft_lm import hf_folder
        from specbench.models import model_dir
        from specbench.paths import cache_dir, file_lock

        cfg = resolved(cfg)

        dm = hf_draft_cfg(cfg)
        if dm is not None:
            return model_dir(dm)
        target = model_dir(cfg.model)
        folder = trained_draft(cfg)
        src = folder or f"self_layers:{cfg.draft_model.layers}"
        stamp = [str(p.stat().st_mtime_ns) for p in sorted(Path(folder or target).glob("*.safetensors"))]
        tag = hashlib.sha1(repr((target, src, stamp)).encode()).hexdigest()[:12]
        out = cache_dir() / "hf-drafts" / f"{Path(target).name}-{Path(src).name.replace(':', '')}-{tag}"
        with file_lock(out.with_name(out.name + ".lock")):
            if folder:
                from safetensors.torch import load_file

                own = load_file(str(Path(folder) / "model.safetensors"))
                return hf_folder(target, out, int(drafters.read_meta(folder)["layers"]), own)
            return hf_folder(target, out, int(cfg.draft_model.layers))

    def __init__(self, cfg, target, tokenizer, device, dtype, draft_model=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.K = int(cfg.K)
        if draft_model is None:
            draft_model = self.load_draft(cfg, target, device, dtype)
        self.draft = draft_model
        self.V = int(text_config(target.config).vocab_size)
        self.dcache: RaggedCache | None = None
        self.fed: list[list[int]] = []  # per row, the tokens in its draft cache (those known on the host)
        self.unread = None  # [B, K-1] drafts fed to the draft cache since, whose values the host has not read

    def modules(self):
        return [self.draft]

    # the draft's cache of each row (a DraftRaggedCache: room for the answers, rows join as the
    # target's do; with compile=graphs its forwards replayed: drafters.cache.draft_cache) and the
    # tokens in it (fed); the base keeps both as rows leave and join
    per_row = ("dcache", "fed")

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        room = state.max_new_tokens + self.K + 2
        dcache = draft_cache(self.draft, state, self.device, self.dtype, room=room, rows=state.rows, wider=True)
        prompts = [s[:-1] for s in state.seqs]
        dcache.prefill(prompts, room=room)
        return {"dcache": dcache, "fed": [list(p) for p in prompts]}

    def _pick(self, logits: torch.Tensor, state: BatchState):
        """The draft's next token (and the distribution q it was drawn from), over the
        target's vocabulary: a wider draft output layer is cut, a narrower one (same
        tokenizer, fewer padded rows) gets probability 0 on the missing ids."""
        logits = logits[..., : self.V]
        if logits.shape[-1] < self.V:
            logits = torch.nn.functional.pad(logits, (0, self.V - logits.shape[-1]), value=float("-inf"))
        if state.sampling.greedy:
            return greedy_pick(logits), None
        q = warp(logits, state.sampling)
        return sample(q, state.gen), q

    def propose(self, state: BatchState) -> Draft:
        B = len(state.seqs)
        # 1. roll the draft cache back to what still agrees with the committed sequence
        keep_len = []
        for b in range(B):
            fed, seq = self.fed[b], state.seqs[b]
            n = min(len(fed), len(seq) - 1)
            # the fed tokens differ from seq only in the last K positions
            j = max(0, n - self.K - 1)
            while j < n and fed[j] == seq[j]:
                j += 1
            del fed[j:]
            keep_len.append(j)
        self.dcache.rollback(keep_len)  # host ints: no copy to the device and back
        # 2. catch up on the tokens it has not seen (1 or 2 per row) and draft token 1
        news = [state.seqs[b][keep_len[b]:] for b in range(B)]
        m = max(len(x) for x in news)
        toks = pad_rows(news, self.device)
        counts = to_device([len(x) for x in news], torch.long, self.device)
        depth = torch.arange(m, device=self.device)[None].expand(B, m)
        out = self.dcache.forward(toks, depth, None)
        self.dcache.commit([list(range(m))] * B, [len(x) for x in news])  # host lists: nothing read back
        last = out.logits[torch.arange(B, device=self.device), counts - 1]
        for b, x in enumerate(news):
            self.fed[b].extend(x)
        tok, q = self._pick(last, state)
        drafts, qs = [tok], [q]
        zero = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        # 3. K-1 more single-token steps
        for _ in range(self.K - 1):
            out = self.dcache.forward(tok[:, None], zero, None)
            self.dcache.commit_all()
            tok, q = self._pick(out.logits[:, -1], state)
            drafts.append(tok)
            qs.append(q)
        # the drafts fed to the draft cache: their values come with the verdict (host, then update)
        self.unread = torch.stack(drafts[:-1], dim=1) if self.K > 1 else None
        tokens = torch.stack(drafts, dim=1)
        qt = None if state.sampling.greedy else torch.stack(qs, dim=1)
        return Draft.chain(tokens, q=qt)

    def host(self, state: BatchState):
        """The drafts this step fed to the draft cache (read with the verdict, in the step's one read)."""
        return self.unread

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        """``fed`` learns the values of the drafts fed to the draft cache (the next ``propose`` rolls
        back those the committed sequence does not hold: whoever drafted what was verified, as a
        member of combo or SAM's fallback too)."""
        rows = self.host_rows(state) if self.unread is not None else None
        for fed, row in zip(self.fed, rows or ()):
            fed.extend(row)
        self.unread = None

    def describe(self) -> dict:
        return {"draft_params": sum(p.numel() for p in self.draft.parameters())}
