"""DFlash (Z Lab, arXiv 2602.06036): a block-diffusion drafter proposes a whole block in one
forward; the engine verifies it as a chain.

Per step and row: the drafter reads the block ``[x_p, MASK, ..., MASK]`` at positions p..p+B-1
(x_p the last emitted token, not yet in the target's cache) over the keys and values of the
verified tokens' context features, non-causally, and its slots' argmax are the drafts: B-1 of them
(slot k drafts x_{p+k}) for Z Lab's checkpoints, B (slot k drafts x_{p+k+1}) for those trained with
``sample_from_anchor`` (``specbench/drafters/dflash.py``). After the verify the target hands over its
states of the tokens just committed (the step's root and its accepted drafts); their fused features'
keys and values join the drafter's cache, the block's are never kept. Drafts are deterministic
candidates (the argmax, as the reference drafts), so sampling uses the lossless rule.

``dflash.checkpoint`` names Z Lab's layout, vLLM's speculators ``dflash`` or ours
(``python -m specbench.train drafter=dflash``); ``dflash.block_size`` drafts with a block of
another size than the one it was trained with (null: the checkpoint's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specbench.decode.tree import Draft, pad_rows
from specbench.drafters import formats, randomize
from specbench.drafters.cache import DrafterCache
from specbench.drafters.dflash import context_cache
from specbench.errors import ConfigError
from specbench.methods.base import BatchState, Proposer
from specbench.paths import resolve_path

class DFlash(Proposer):
    name, title = "dflash", "DFlash"

    @dataclass
    class Settings:  # `dflash.<key>=...` is short for `method.<key>=...`
        name: str = "dflash"
        checkpoint: str = "checkpoints/smollm2-135m/dflash"  # ours (python -m specbench.train drafter=dflash target=<model>), or a downloaded folder: Z Lab's layout or vLLM's speculators dflash
        block_size: Optional[int] = None  # slots per block (the anchor + masks; B-1 drafts, or B for sample_from_anchor checkpoints); null: the checkpoint's
    dspark_heads = False  # drafts with DSpark's Markov and confidence heads (methods/dspark.py)
    published = "Z Lab's, DeepSpec's or vLLM's speculators format"
    per_row = ("cache",)  # the drafter's keys and values of each row's verified context (a DrafterCache)

    @classmethod
    def train_command(cls) -> str:
        return f"python -m specbench.train drafter={cls.name} target=<model>"

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m, n = cfg.method, cls.name
        b = m.get("block_size")
        if b is not None and b < 2:
            raise ConfigError(f"{n}.block_size must be null (the checkpoint's) or an integer >= 2 (the anchor and "
                              f"at least one mask slot), got {b!r}")
        folder = resolve_path(m.checkpoint)
        if not Path(folder).exists():
            raise ConfigError(f"{n}.checkpoint '{m.checkpoint}' does not exist: train one ({cls.train_command()}) or "
                              f"name a downloaded {cls.title} folder ({cls.published})")
        fmt = formats.detect(folder)
        if fmt not in formats.dflash.NAMES:
            raise ConfigError(f"{n}.checkpoint '{m.checkpoint}' holds no {cls.title} drafter "
                              f"({fmt or 'no published format'}); train one: {cls.train_command()}")
        try:
            s = formats.dflash.check(folder, target_config)
        except formats.FormatError as e:
            raise ConfigError(f"{n}.checkpoint {e}") from None
        h = s["heads"]
        has = bool(h["markov_rank"] or h["confidence"])
        if has != cls.dspark_heads:
            other = "dspark" if has else "dflash"
            raise ConfigError(f"{n}.checkpoint '{m.checkpoint}' is a {other} drafter "
                              f"({formats.dflash.describe_heads(h)}): run it with method={other}")

    @classmethod
    def block(cls, cfg) -> tuple[int, str]:
        """(block size, anchor) of a job: ``<method>.block_size`` or the checkpoint's."""
        d = formats.dflash.declared(resolve_path(cfg.method.checkpoint))
        return int(cfg.method.get("block_size") or d["block_size"]), d["anchor"]

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        b, anchor = cls.block(cfg)
        return b - (anchor == "bonus")

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the block (the drafts are B-1 or B long)."""
        return [{"method.block_size": b} for b in (2, 3, 4, 6, 8, 12, 16)]

    @classmethod
    def draft_label(cls, cfg) -> str:
        return str(cfg.method.checkpoint)

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``dflash`` reads Z Lab's and speculators' layouts, drafting the block it was trained with."""
        b, anchor = cls.block(cfg)
        declared = formats.dflash.declared(resolve_path(cfg.method.checkpoint))["block_size"]
        if anchor != "bonus":
            raise ConfigError("backend=vllm: vLLM's dflash drafts from mask slots only; this checkpoint drafts from its anchor "
                              "slot too (sample_from_anchor: true): run it with backend=specbench")
        if b != int(declared):
            raise ConfigError(f"vLLM's dflash drafts the checkpoint's block ({declared}); with backend=vllm leave "
                              "dflash.block_size=null")
        return {"method": "dflash", "model": resolve_path(cfg.method.checkpoint), "num_speculative_tokens": b - 1}

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.dflash import DFlashDrafter, default_layer_ids, layer_config
        from specbench.hf import text_config

        tc = text_config(target.config)
        ids = default_layer_ids(int(tc.num_hidden_layers), 1)
        d = DFlashDrafter(target, layer_config(tc, 1, int(tc.vocab_size) - 1, 4, ids), ids, 4, int(tc.vocab_size) - 1)
        randomize(d)
        formats.dflash.save(folder / "dflash", d, dtype=torch.float32)
        return {"method": {"checkpoint": str(folder / "dflash")}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        folder = resolve_path(cfg.method.checkpoint)
        self.format = formats.detect(folder)
        self.drafter = drafter if drafter is not None else formats.dflash.load(folder, target, device, dtype)
        self.block_size = int(cfg.method.get("block_size") or self.drafter.block_size)
        self.hidden_layers = tuple(self.drafter.taps)
        # target ids of its own head's outputs (speculators' draft vocabulary); the target's head needs none
        self.vocab_ids = self.drafter.vocab_ids.to(device) if self.drafter.lm_head is not None else None
        self.cache: DrafterCache | None = None

    def modules(self):
        return [self.drafter]

    def _cache(self, state: BatchState, hidden) -> DrafterCache:
        """A cache for the rows of ``state`` holding their prompts' context (room for the answers)."""
        dt = next(self.drafter.parameters()).dtype
        longest = max(len(s) for s in state.seqs)
        # room for every token the batch may add, and a step's widest append or block after them
        cache = context_cache(self.drafter, len(state.seqs), self.device, dt, longest + state.max_new_tokens,
                              2 * self.block_size + 2, state.graphs, self)
        self._append(cache, hidden, prompt=True)
        return cache

    def _context(self, feats, pos, scratch):
        return self.drafter.context(feats, pos)

    def _block(self, tokens, pos, visible, scratch):
        return self.drafter.block(tokens, pos, scratch, visible)

    def _append(self, cache: DrafterCache, hidden, prompt: bool = False) -> None:
        """The newly committed tokens' context keys and values, kept. A step's (not the prompt's)
        run as a graph with compile=graphs, padded to a step's most (the block's drafts and one)."""
        feats = self.drafter.features(hidden)
        m = feats.shape[1]
        if cache.graphs is not None and not prompt and m < self.block_size + 1:
            feats = torch.nn.functional.pad(feats, (0, 0, 0, self.block_size + 1 - m))
        pos = cache.length[:, None] + torch.arange(feats.shape[1], device=self.device)[None]
        kv = self._context(feats, pos, []) if prompt else cache.run("context", self._context, feats, pos, scratch=[])
        cache.append(kv, hidden.counts, hidden.lens)

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"cache": self._cache(state, hidden)}

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        self._append(self.cache, hidden)

    def propose(self, state: BatchState) -> Draft:
        cache, n, dev = self.cache, self.block_size, self.device
        B = len(state.seqs)
        tokens = torch.full((B, n), self.drafter.mask_token_id, dtype=torch.long, device=dev)
        tokens[:, :1] = pad_rows([s[-1:] for s in state.seqs], dev)
        pos = cache.length[:, None] + torch.arange(n, device=dev)[None]  # x_p sits at p = the cached length
        visible = torch.cat([cache.visible(n), torch.ones(B, n, n, dtype=torch.bool, device=dev)], dim=2)
        h = cache.run("block", self._block, tokens, pos, visible, scratch=cache.scratch(n))
        return self.drafts(h, tokens[:, 0], state)

    def drafts(self, h, first, state: BatchState | None = None) -> Draft:
        """The chain of the block's states ``h`` [B, B_slots, d]: each drafting slot's argmax."""
        ids = self.drafter.logits(h[:, 1:] if self.drafter.anchor == "bonus" else h).argmax(-1)
        return Draft.chain(ids if self.vocab_ids is None else self.vocab_ids[ids])

    def describe(self) -> dict:
        d = self.drafter
        return {"block_size": self.block_size, "trained_block_size": d.block_size, "anchor": d.anchor,
                "checkpoint_format": self.format, "target_layer_ids": list(d.layer_ids),
                "draft_layers": len(d.layers), "drafter_params": sum(p.numel() for p in d.parameters()),
                "draft_vocab": int(d.vocab_ids.numel())}
