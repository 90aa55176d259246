"""DSpark (DeepSeek, arXiv 2607.05147): DFlash's block drafter with a Markov head that makes a
block's drafts depend on each other and a confidence head that cuts the block; the engine verifies
the kept prefix as a chain.

Per step and row, as DFlash (``methods/dflash.py``): one forward of the draft layers over the block
``[x_p, MASK, ..., MASK]`` and the verified tokens' context. Then slot by slot: the head's logits
plus the Markov bias from the token before the slot (x_p, then the previous slot's draft), the
argmax, and the slot's confidence (``specbench/drafters/dspark.py``). A row keeps its drafts up to
the first slot whose confidence is below ``dspark.threshold`` (0: every draft, DeepSpec's
default), as DeepSpec's evaluator cuts them; the verify forward is as wide as the longest kept
chain of the batch. Greedy, a draft is the slot's argmax. At a temperature, as DeepSpec, each
slot's draft is drawn from the drafter's warped distribution q (the Markov bias from the draft
before it included) and accepted with min(1, p/q) (``dspark.sample_drafts``; false: the argmax,
accepted by the one-hot rule). Lossless either way; only the sampled drafts' tau compares with
DeepSpec's at T > 0.

``dspark.checkpoint`` names DeepSpec's layout (``deepseek-ai/dspark_*``), vLLM's speculators
``dspark`` or ours (``python -m specbench.train drafter=dspark``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specbench.decode.tree import Draft
from specbench.decode.verify import sample, warp
from specbench.drafters import formats, randomize
from specbench.errors import ConfigError
from specbench.hf import text_config
from specbench.methods.base import BatchState
from specbench.methods.dflash import DFlash
from specbench.paths import resolve_path


class DSpark(DFlash):
    name, title = "dspark", "DSpark"

    @dataclass
    class Settings:  # `dspark.<key>=...` is short for `method.<key>=...`
        name: str = "dspark"
        checkpoint: str = "checkpoints/smollm2-135m/dspark"  # ours (python -m specbench.train drafter=dspark target=<model>), or a downloaded folder: DeepSpec's layout or vLLM's speculators dspark
        block_size: Optional[int] = None  # slots per block (B drafts for DeepSpec's checkpoints, slot k drafting x_{p+k+1}); null: the checkpoint's
        threshold: float = 0.0  # verify a row's drafts up to the first slot whose confidence is below this; 0: all (DeepSpec's default)
        sample_drafts: bool = True  # at a temperature: draw each draft from the drafter's distribution, accepted with min(1, p/q) (DeepSpec); false: its argmax (the one-hot rule)
    dspark_heads = True
    published = "DeepSpec's or vLLM's speculators dspark format"

    @classmethod
    def check(cls, cfg, target_config) -> None:
        t = cfg.method.threshold
        if not 0.0 <= t <= 1.0:
            raise ConfigError(f"dspark.threshold must be a number in [0, 1] (0: verify every draft), got {t!r}")
        super().check(cfg, target_config)

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the block and the confidence cut."""
        return [{"method.block_size": b, "method.threshold": t} for b in (4, 8, 16) for t in (0.0, 0.3, 0.5)]

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``dspark`` drafts the checkpoint's block; its confidence cut is not mapped."""
        if float(cfg.method.get("threshold", 0.0)) > 0.0:
            raise ConfigError("backend=vllm: specbench does not map dspark.threshold to vLLM's dspark; run with "
                              "dspark.threshold=0 or backend=specbench")
        b, anchor = cls.block(cfg)
        folder = resolve_path(cfg.method.checkpoint)
        if b != int(formats.dflash.declared(folder)["block_size"]):
            raise ConfigError("vLLM's dspark drafts the checkpoint's block; with backend=vllm leave dspark.block_size=null")
        return {"method": "dspark", "model": folder, "num_speculative_tokens": b - (anchor == "bonus")}

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.dflash import default_layer_ids, layer_config
        from specbench.drafters.dspark import DSparkDrafter
        from specbench.hf import text_config

        tc = text_config(target.config)
        ids = default_layer_ids(int(tc.num_hidden_layers), 1)
        mask = int(tc.vocab_size) - 1
        d = DSparkDrafter(target, layer_config(tc, 1, mask, 4, ids), ids, 4, mask, "next", markov_rank=8,
                          markov_type="rnn")
        randomize(d)
        formats.dflash.save(folder / "dspark", d, dtype=torch.float32)
        return {"method": {"checkpoint": str(folder / "dspark"), "threshold": 0.3}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype, drafter)
        self.threshold = float(cfg.method.get("threshold", 0.0))
        # a member of combo or SAM drafts deterministic candidates (methods.member_cfg)
        self.sample_drafts = bool(cfg.method.get("sample_drafts", True)) and not cfg.get("deterministic_drafts", False)
        self.target_vocab = int(text_config(target.config).vocab_size)

    def _pick(self, state: BatchState):
        """At a temperature, with ``sample_drafts``: each slot's draft drawn from q, its logits warped
        as the target's are, q over the target's vocabulary (0 off the head's) for min(1, p/q); None:
        argmax drafts (greedy, no ``state``, or sample_drafts off)."""
        if state is None or state.sampling.greedy or not self.sample_drafts:
            return None

        def pick(logits):
            q = warp(logits, state.sampling)
            tok = sample(q, state.gen)
            if self.vocab_ids is not None:  # a narrower head: its ids are a subset of the target's
                q = q.new_zeros(q.shape[0], self.target_vocab).index_copy_(1, self.vocab_ids, q)
            return tok, q
        return pick

    def drafts(self, h, first, state: BatchState | None = None) -> Draft:
        ids, conf, q = self.drafter.draft(h, first, self._pick(state))
        if conf is None or self.threshold <= 0.0:
            return Draft.chain(ids, q=q)
        keep = (torch.sigmoid(conf) >= self.threshold).cumprod(1).bool()  # [B, n]: before the first doubt
        n = int(keep.sum(1).max())  # one read a step: the verify is as wide as the longest kept chain
        return Draft.chain(ids[:, :n], keep[:, :n], q=None if q is None else q[:, :n])

    def describe(self) -> dict:

        d = self.drafter
        heads = {"markov_rank": d.markov_head.rank if d.markov_head is not None else 0,
                 "markov_type": d.markov_head.kind if d.markov_head is not None else "vanilla",
                 "confidence": d.confidence_head is not None, "confidence_with_markov": d.confidence_with_markov}
        return super().describe() | {"threshold": self.threshold, "sample_drafts": self.sample_drafts,
                                     "heads": formats.dflash.describe_heads(heads)}
