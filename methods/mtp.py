"""Native MTP (DeepSeek-V3 report, arXiv 2412.19437; FastMTP, arXiv 2509.18362): the target's own
multi-token-prediction module drafts K tokens with K sequential forwards; the engine verifies them
as a chain.

The module keeps its own keys and values, of one entry per verified position i: (the target's state
h_i, the token after it x_{i+1}), in a ``RaggedCache`` (``specbench/drafters/mtp.py``). After each
verify the target hands over its states of the tokens just committed; their entries join the cache,
and the last one's output drafts the first token. A step then feeds each draft back with the
module's own output as its state, K-1 times, and the cache is rolled back to the verified entries.
Drafts are each forward's argmax (deterministic candidates), so sampling uses the lossless rule.

``mtp.checkpoint`` null reads the module out of the target's own checkpoint (``model.path``:
DeepSeek-V3/R1, GLM-4.5, MiMo; transformers drops it on load); a folder names a speculators ``mtp``
drafter (or another model folder carrying one). ``K`` drafts a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from specbench.decode.tree import Draft, pad_rows
from specbench.decode.kv import RaggedCache
from specbench.drafters import formats, randomize
from specbench.drafters.cache import draft_cache
from specbench.errors import ConfigError
from specbench.methods.base import BatchState, Proposer
from specbench.paths import resolve_path

TRAIN = "python -m specbench.train drafter=mtp target=<model>"


def checkpoint_folder(cfg) -> str:
    """The folder the module is read from: ``mtp.checkpoint``, or the target's own (its local
    folder, or the hub snapshot the target's weights came from)."""
    if cfg.method.get("checkpoint"):
        return resolve_path(cfg.method.checkpoint)
    from specbench.models import model_dir

    folder = model_dir(cfg.model)
    if Path(folder).exists():
        return folder
    from huggingface_hub import snapshot_download

    return snapshot_download(folder, allow_patterns=["*.json", "*.safetensors"])


class MTP(Proposer):
    name = "mtp"

    @dataclass
    class Settings:  # `mtp.<key>=...` is short for `method.<key>=...`
        name: str = "mtp"
        checkpoint: Optional[str] = None  # null: the module inside the target's own checkpoint (DeepSeek-V3/R1, GLM-4.5, MiMo); or a speculators mtp folder (python -m specbench.train drafter=mtp target=<model>)
    hidden_layers = ("final",)

    @classmethod
    def check(cls, cfg, target_config) -> None:
        own = not cfg.method.get("checkpoint")
        where = "the target's checkpoint" if own else f"mtp.checkpoint '{cfg.method.checkpoint}'"
        folder = checkpoint_folder(cfg)
        if not Path(folder).exists():
            raise ConfigError(f"{where} does not exist: train an MTP module ({TRAIN}) or name a speculators mtp folder")
        if formats.detect(folder) not in formats.mtp.NAMES:
            hint = (f"this target ships no MTP module: train one ({TRAIN}) and pass mtp.checkpoint=<folder>" if own
                    else "name a speculators mtp folder or a DeepSeek-V3/GLM-4.5/MiMo checkpoint")
            raise ConfigError(f"{where} holds no MTP module; {hint}")
        try:
            formats.mtp.check(folder, target_config)
        except formats.FormatError as e:
            raise ConfigError(f"{'the target checkpoint' if own else 'mtp.checkpoint'} {e}") from None

    @classmethod
    def draft_label(cls, cfg) -> str:
        return str(cfg.method.checkpoint) if cfg.method.get("checkpoint") else "native"

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``mtp`` reads the target's own module; a speculators folder is its ``model``."""
        c = {"method": "mtp", "num_speculative_tokens": int(cfg.K)}
        if cfg.method.get("checkpoint"):
            c["model"] = resolve_path(cfg.method.checkpoint)
        return c

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.mtp import MTPDrafter

        d = MTPDrafter(target, "speculators")
        randomize(d)
        formats.mtp.save(folder / "mtp", d, dtype=torch.float32)
        return {"K": 3, "method": {"checkpoint": str(folder / "mtp")}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.drafter = drafter if drafter is not None else formats.mtp.load(checkpoint_folder(cfg), target, device, dtype)
        self.K = int(cfg.K)
        self.kv: RaggedCache | None = None
        self.first: torch.Tensor | None = None  # [B] each row's first draft
        self.state: torch.Tensor | None = None  # [B, d] what its entry feeds the next draft's

    def modules(self):
        return [self.drafter]

    # the module's cache (a DraftRaggedCache: rows join it as the target's cache; with compile=graphs
    # its forwards replayed: drafters.cache.draft_cache), first and state:
    # the base keeps them as rows leave and join, from what new_rows makes
    per_row = ("kv", "first", "state")

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        """A cache of the rows' prompt entries (x_1.., h_0..), left-padded; their first drafts."""
        d = self.drafter
        dt = next(d.parameters()).dtype
        h = hidden.layers["final"].to(dt)  # [B, m, d]: row b's first counts[b] are its prompt's
        lens = hidden.lens
        P = max(lens)
        toks = [s[len(s) - c:] for s, c in zip(state.seqs, lens)]
        shift = (P - hidden.counts)[:, None]  # left-padded as prefill pads: slot j of row b holds its entry j - shift
        src = (torch.arange(P, device=h.device)[None] - shift).clamp(min=0)
        h = h.gather(1, src[..., None].expand(-1, -1, h.shape[-1]))
        room = state.max_new_tokens + self.K + 2
        kv = draft_cache(d, state, self.device, dt, room=room, rows=state.rows, wider=True)
        first, feed = self._draft(kv.prefill(toks, room=room, hidden=h).out[:, -1])
        return {"kv": kv, "first": first, "state": feed}

    def _draft(self, y: torch.Tensor) -> tuple:
        d = self.drafter
        return d.logits(y).argmax(-1), d.fed_back(y)

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        """The committed tokens' entries (h_i, x_{i+1}) join the cache; the last drafts anew."""
        d, dev = self.drafter, self.device
        counts = hidden.counts
        lens = hidden.lens
        h = hidden.layers["final"].to(next(d.parameters()).dtype)
        B, m = h.shape[:2]
        toks = pad_rows([s[len(s) - c:] for s, c in zip(state.seqs, lens)], dev, width=m)
        depth = torch.arange(m, device=dev)[None].expand(B, m)
        y = self.kv.forward(toks, depth, None, hidden=h).out
        self.kv.commit([list(range(m))] * B, lens)
        self.first, self.state = self._draft(y[torch.arange(B, device=dev), counts - 1])

    def propose(self, state: BatchState) -> Draft:
        drafts, h = [self.first], self.state
        if self.K > 1:
            kv, B = self.kv, len(state.seqs)
            verified = list(kv._length)
            zero = torch.zeros(B, 1, dtype=torch.long, device=self.device)
            for _ in range(self.K - 1):
                y = kv.forward(drafts[-1][:, None], zero, None, hidden=h[:, None]).out[:, -1]
                kv.commit_all()
                tok, h = self._draft(y)
                drafts.append(tok)
            kv.rollback(verified)
        return Draft.chain(torch.stack(drafts, dim=1))

    def describe(self) -> dict:
        d = self.drafter
        return {"family": d.family, "decoder_layer": type(d.layer).__name__,
                "own_head": d.head is not None, "drafter_params": sum(p.numel() for p in d.parameters())}
