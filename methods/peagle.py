"""P-EAGLE (AWS, arXiv 2602.01469): EAGLE-3's drafter drafts a step's K tokens in one forward,
with mask slots; the engine verifies them as a chain.

When the target hands over the states of the tokens it committed, their entries (feature h_i,
the token after it x_{i+1}) run through the drafter's layers once, causally over the entries
before them; their keys and values are kept per layer, and the last entry's output drafts the
first token (``specbench/drafters/peagle.py``); K-1 mask slots run in the same forward, after
them: slot d sees the kept entries and slots 1..d, and drafts the token d after the first. One
drafter forward a step, as vLLM's parallel drafting. Drafts are
each slot's argmax, deterministic candidates, so sampling uses the lossless rule.

``peagle.checkpoint`` names vLLM's speculators ``peagle`` layout; ``peagle.K`` drafts that many
tokens a step (null: the depths the checkpoint was trained for).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specbench.decode.tree import Draft, pad_rows
from specbench.drafters import formats, randomize
from specbench.drafters.cache import DrafterCache
from specbench.errors import ConfigError
from specbench.methods.base import BatchState, Proposer
from specbench.paths import resolve_path


class PEagle(Proposer):
    name = "peagle"

    @dataclass
    class Settings:  # `peagle.<key>=...` is short for `method.<key>=...`
        name: str = "peagle"
        checkpoint: str = "checkpoints/smollm2-135m/peagle"  # a P-EAGLE folder in vLLM's speculators format (speculators_model_type: peagle)
        K: Optional[int] = None  # drafts a step (the first from the last verified entry, K-1 mask slots); null: the checkpoint's depths
    per_row = ("cache", "drafts")  # the drafter's keys and values of each row's entries (a DrafterCache); the next drafts [B, K]

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        k = m.get("K")
        if k is not None and k < 1:
            raise ConfigError(f"peagle.K must be null (the checkpoint's depths) or an integer >= 1, got {k!r}")
        folder = resolve_path(m.checkpoint)
        if not Path(folder).exists():
            raise ConfigError(f"peagle.checkpoint '{m.checkpoint}' does not exist: name a P-EAGLE folder in vLLM's "
                              "speculators format (speculators_model_type: peagle)")
        fmt = formats.detect(folder)
        if fmt != "speculators-peagle":
            raise ConfigError(f"peagle.checkpoint '{m.checkpoint}' holds no P-EAGLE drafter ({fmt or 'no published format'})")
        try:
            formats.peagle.check(folder, target_config)
        except formats.FormatError as e:
            raise ConfigError(f"peagle.checkpoint {e}") from None

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        return int(cfg.method.get("K") or formats.peagle.depths(resolve_path(cfg.method.checkpoint)))

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        return [{"method.K": k} for k in (2, 3, 4, 6, 8)]

    @classmethod
    def draft_label(cls, cfg) -> str:
        return str(cfg.method.checkpoint)

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.eagle3 import layer_config
        from specbench.drafters.peagle import PEagleDrafter
        from specbench.hf import text_config

        tc = text_config(target.config)
        V = int(tc.vocab_size)
        lc = layer_config(target.config, V)
        lc.num_hidden_layers = 2
        n = int(tc.num_hidden_layers)
        d = PEagleDrafter(target, lc, V, V - 1, 3, layers=tuple(range(1, min(n, 4))))
        randomize(d)
        formats.peagle.save(folder / "peagle", d, dtype=torch.float32)
        return {"method": {"checkpoint": str(folder / "peagle")}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        folder = resolve_path(cfg.method.checkpoint)
        self.drafter = drafter if drafter is not None else formats.peagle.load(folder, target, device, dtype)
        self.K = int(cfg.method.get("K") or self.drafter.depths)
        self.hidden_layers = tuple(self.drafter.taps)
        self.vocab_ids = self.drafter.vocab_ids.to(device)
        self.cache: DrafterCache | None = None
        self.drafts: torch.Tensor | None = None  # [B, K] the step's drafts, from its one forward

    def modules(self):
        return [self.drafter]

    def _run(self, g, e, pos, visible, scratch):
        return self.drafter.run(g, e, pos, scratch, visible)

    def _step(self, cache: DrafterCache, state: BatchState, hidden, prompt: bool = False) -> torch.Tensor:
        """One drafter forward a step (vLLM's parallel drafting): every row's newly verified entries
        (h_i, x_{i+1}), causal over its kept ones, then K-1 mask slots after the last of them. The
        entries' keys and values are kept; the last entry's argmax is the first draft and slot d's
        the token d after it. Returns the step's drafts [B, K]. A step's (not the prompt's) runs as a
        graph with compile=graphs, its entries padded to a step's most (K + 1)."""
        d, dev, n = self.drafter, self.device, self.K - 1
        counts = hidden.counts
        dt = cache.keys[0].dtype
        feats = d.fuse(d.features(hidden).to(dt))  # [B, m, d]
        B, m = feats.shape[:2]
        if cache.graphs is not None and not prompt and m < self.K + 1:  # one shape: a step's most entries
            feats = torch.nn.functional.pad(feats, (0, 0, 0, self.K + 1 - m))
            m = feats.shape[1]
        toks = pad_rows([s[len(s) - c:] for s, c in zip(state.seqs, hidden.lens)], dev, width=m)
        j = torch.arange(m, device=dev)
        own = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < counts[:, None, None])
        own = own | torch.eye(m, dtype=torch.bool, device=dev)[None]  # padded entries see themselves
        g, e = feats, d.embed(toks).to(dt)
        pos = cache.length[:, None] + j[None]
        visible = torch.cat([cache.visible(m), own, own.new_zeros(B, m, n)], dim=2)
        if n:  # slot d at p-1+d (p: the row's length once its entries are in) sees them and slots 1..d
            gm, em = d.mask_entries(B, n)
            slots = torch.arange(1, n + 1, device=dev)
            entries = (j[None, :] < counts[:, None])[:, None].expand(B, n, m)
            causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()[None].expand(B, n, n)
            g, e = torch.cat([g, gm.to(dt)], 1), torch.cat([e, em.to(dt)], 1)
            pos = torch.cat([pos, (cache.length + counts)[:, None] - 1 + slots[None]], 1)
            visible = torch.cat([visible, torch.cat([cache.visible(n), entries, causal], dim=2)], dim=1)
        scratch = cache.scratch(m + n)
        out, kv = self._run(g, e, pos, visible, scratch) if prompt else \
            cache.run("step", self._run, g, e, pos, visible, scratch=scratch)
        cache.append([(k[:, :, :m], v[:, :, :m]) for k, v in kv], counts, hidden.lens)  # the entries' only, not the slots'
        last = out[torch.arange(B, device=dev), (counts - 1).clamp(min=0)][:, None]
        return self.vocab_ids[d.logits(torch.cat([last, out[:, m:]], 1)).argmax(-1)]  # [B, K]

    def _start(self, state: BatchState, hidden):
        dt = next(self.drafter.parameters()).dtype
        longest = max(len(s) for s in state.seqs)
        lay = self.drafter.layers[0]  # room for every token the batch may add, and a step's entries and slots after them
        cache = DrafterCache(len(self.drafter.layers), lay.Hk, lay.Dh, len(state.seqs), self.device, dt,
                             longest + state.max_new_tokens, 2 * self.K + 2, state.graphs, self)
        return cache, self._step(cache, state, hidden, prompt=True)

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        cache, drafts = self._start(state, hidden)
        return {"cache": cache, "drafts": drafts}

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        self.drafts = self._step(self.cache, state, hidden)

    def propose(self, state: BatchState) -> Draft:
        return Draft.chain(self.drafts)  # drafted by the step's one forward (``_step``)

    def describe(self) -> dict:
        d = self.drafter
        return {"K": self.K, "trained_depths": d.depths, "draft_layers": len(d.layers), "checkpoint_format": "speculators-peagle",
                "version": 3.1 if (d.fc_norm is not None or d.norm_output) else 3,
                "drafter_params": sum(p.numel() for p in d.parameters()), "draft_vocab": int(d.d2t.numel())}
