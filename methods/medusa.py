"""Medusa (Cai et al. 2024, arXiv 2401.10774) on the shared engine, at any batch size.

The heads (``specbench/drafters/medusa.py``) read the target's final hidden state at each
row's last committed token, which the engine hands over after every step; head k proposes
candidates for the token k places after the pending root. The candidates form a fixed
tree of (depth, rank) choices:

- ``tree=default``: the ``tree_size`` paths with the largest product of the heads'
  measured per-rank accuracies (stored in the checkpoint), as the paper builds its sparse
  tree, over the first K heads;
- ``tree=chain``: the top-1 candidate of each of the first K heads.

Verification: exact (greedy, or lossless sampling with the candidates as deterministic
nodes) or, with ``accept=typical`` under sampling, the paper's typical acceptance (a
candidate passes when p(x) > min(eps, delta * exp(-H(p)))), recorded ``lossless: false``.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
from pathlib import Path
import sys
from typing import Any, Literal

import torch

from specbench.methods.base import BatchState, Proposer
from specbench import kernels, drafters
from specbench.drafters import formats
from specbench.decode.tree import Draft
from specbench.drafters.medusa import sparse_tree
from specbench.errors import ConfigError
from specbench.paths import resolve_path


# tree_size=auto on a CPU: 7 nodes keep the verify at 8 rows, two passes of the native kernel
# (a ninth row costs a third; the measurements: docs/tuning.md).
AUTO_CPU_TREE = 7
TUNE_TREE = {"cuda": [8, 16, 32, 64], "cpu": [2, 4, 7, 12, 20]}  # default-tree sizes K=auto chooses among


@functools.cache
def named_trees() -> dict[str, list[list[int]]]:
    """Medusa's published candidate trees by name (rank i of path position k: the (i+1)-th
    likeliest token of head k)."""
    return formats.named_trees("medusa")


class Medusa(Proposer):
    name = "medusa"

    @dataclass
    class Settings:  # `medusa.<key>=...` is short for `method.<key>=...`
        name: str = "medusa"
        checkpoint: str = "checkpoints/smollm2-135m/medusa"  # ours (python -m specbench.train drafter=medusa target=<model>) or a published Medusa-1 folder
        tree: str = "default"  # default: sparse tree from the heads' measured accuracies; chain: top-1 per head; or a published tree (mc_sim_7b_63, ...)
        tree_size: Any = "auto"  # nodes of the default tree (auto: 7 on CPU, the checkpoint's 32 elsewhere; null: the checkpoint's)
        accept: Literal["exact", "typical"] = "exact"  # exact (lossless) | typical (Medusa's typical acceptance when sampling; lossy)
        eps: float = 0.09  # typical acceptance: p(x) > min(eps, delta * exp(-H(p)))
        delta: float = 0.3
    per_row = ("f",)  # [B, d] each row's last committed token's final state
    hidden_layers = ("final",)

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        if m.tree not in ("default", "chain") and m.tree not in named_trees():
            raise ConfigError(f"medusa.tree must be default, chain or a published tree ({', '.join(named_trees())}), "
                              f"got {m.tree!r}")
        if m.tree_size not in (None, "auto") and (not isinstance(m.tree_size, int) or m.tree_size < 1):
            raise ConfigError(f"medusa.tree_size must be 'auto', null or an integer >= 1, got {m.tree_size!r}")
        if not 0 < float(m.eps) < 1 or float(m.delta) <= 0:
            raise ConfigError(f"medusa.eps must be in (0, 1) and medusa.delta > 0, got {m.eps}, {m.delta}")
        folder = resolve_path(m.checkpoint)
        fmt = formats.detect(folder)
        if fmt == "medusa2" and Path(resolve_path(cfg.model.get("path") or "")).resolve() != Path(folder).resolve():
            raise ConfigError(f"medusa.checkpoint '{m.checkpoint}' is a Medusa-2 model (heads trained with a fine-tuned "
                              f"target, inside it): set model.path={m.checkpoint} too, so the heads read that target")
        if fmt in ("medusa1", "medusa2"):  # the authors' layouts (FasterDecoding's Medusa-1, Medusa-2)
            try:
                formats.check(fmt, folder, target_config)
            except formats.FormatError as e:
                raise ConfigError(f"medusa.checkpoint {e}") from None
        else:
            drafters.check_fits(folder, cfg, target_config, "medusa", "medusa.checkpoint")

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the default sparse tree (tree_size), or a chain's length (K, at most the
        heads); a published tree has nothing to size."""
        tree = cfg.method.tree
        if tree == "default":
            return [{"method.tree_size": n} for n in TUNE_TREE.get(device.type, TUNE_TREE["cpu"])]
        if tree == "chain":
            heads = cls.heads(cfg) or 10 ** 6
            return [{"K": int(k)} for k in (cfg.get("tune") or {}).get("K") or (1, 2, 3, 4, 6, 8) if k <= heads]
        return []

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``medusa``: each of the first K heads' top-1, a chain (vLLM drafts no tree), with our
        heads written in vLLM's layout (``drafters.medusa.vllm_folder``: the same scores)."""
        import hashlib

        from specbench.drafters.medusa import vllm_folder
        from specbench.models import model_dir
        from specbench.paths import cache_dir, file_lock

        m = cfg.method
        if m.tree != "chain":
            raise ConfigError(f"vLLM's medusa drafts a chain (each head's top-1), not medusa.tree={m.tree}: with "
                              "backend=vllm set medusa.tree=chain")
        if m.accept != "exact":
            raise ConfigError("medusa.accept=typical is our engine's: with backend=vllm use medusa.accept=exact")
        folder = resolve_path(m.checkpoint)
        if formats.detect(folder) is not None:
            raise ConfigError(f"medusa.checkpoint {m.checkpoint} is a published Medusa folder; backend=vllm takes our "
                              "medusa checkpoints (python -m specbench.train drafter=medusa) for now")
        k = cls.spec_len(cfg, None)
        target = model_dir(cfg.model)
        stamp = (Path(folder) / "model.safetensors").stat().st_mtime_ns
        tag = hashlib.sha1(repr((target, folder, stamp, k)).encode()).hexdigest()[:12]
        out = cache_dir() / "vllm-medusa" / f"{Path(folder).name}-k{k}-{tag}"
        with file_lock(out.with_name(out.name + ".lock")):
            return {"method": "medusa", "model": vllm_folder(folder, target, out, k), "num_speculative_tokens": k}

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        """K, or the checkpoint's head count where K asks for more (the drafts use min(K, heads))."""
        heads = cls.heads(cfg)
        return int(cfg.K) if heads is None else min(int(cfg.K), heads)

    @classmethod
    def heads(cls, cfg) -> int | None:
        """The checkpoint's head count (None: no readable checkpoint, which check() reports)."""
        folder = resolve_path(cfg.method.checkpoint)
        try:
            if formats.detect(folder) in ("medusa1", "medusa2"):
                return formats.medusa.medusa1_shape(folder)[0]
            return int(drafters.read_meta(folder)["drafter"]["heads"])
        except (OSError, KeyError, TypeError, ValueError):
            return None

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.medusa import MedusaHeads

        heads = MedusaHeads(target, torch.arange(target.config.vocab_size), 3)
        acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]  # as measured heads would report them
        path = drafters.save_random(heads, folder / "medusa", "medusa", 0.2, target, heads=3, acc=acc,
                                    drafter={"heads": 3, "tree_size": 9})
        return {"K": 3, "method": {"checkpoint": path, "tree_size": 9}}

    def __init__(self, cfg, target, tokenizer, device, dtype, heads=None, acc=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.format = "specbench"
        folder = resolve_path(m.checkpoint) if heads is None else None
        fmt = formats.detect(folder) if folder is not None else None
        if fmt in ("medusa1", "medusa2"):
            heads = formats.load(fmt, folder, target, device, dtype)
            kernels.apply(heads, kernels.kernel_of(target))  # on the target's kernel path
            self.format, size = fmt, None
            if m.tree == "default":  # no measured accuracies to build the sparse tree from
                print("[specbench] medusa: a published Medusa checkpoint carries no head accuracies; drafting a chain "
                      "of each head's top-1 (or name a published tree: medusa.tree=mc_sim_7b_63)", file=sys.stderr)
        elif heads is None:
            heads = drafters.load(folder, target, device, dtype, kind="medusa")
            meta = drafters.read_meta(folder)
            acc = meta["acc"]
            size = m.tree_size or meta["drafter"]["tree_size"]
            if size == "auto":  # a CPU pays for every verified node: a smaller tree (measured, see AUTO_CPU_TREE)
                size = AUTO_CPU_TREE if device.type == "cpu" else meta["drafter"]["tree_size"]
        else:
            size = AUTO_CPU_TREE if m.tree_size in (None, "auto") else m.tree_size
        self.heads = heads
        self.K = min(int(cfg.K), heads.n_heads)
        self.tree = "chain" if acc is None and m.tree == "default" else m.tree
        if self.tree == "chain":
            paths = [(0,) * d for d in range(1, self.K + 1)]
        elif self.tree in named_trees():  # as published; the paths deeper than the heads used dropped
            paths = sorted({tuple(p) for p in named_trees()[self.tree] if len(p) <= self.K}, key=lambda p: (len(p), p))
        else:
            paths = sparse_tree([list(a) for a in acc[: self.K]], int(size))
        self.paths = paths
        index = {p: i + 1 for i, p in enumerate(paths)}
        self.node_head = torch.tensor([len(p) - 1 for p in paths], device=device)
        self.node_rank = torch.tensor([p[-1] for p in paths], device=device)
        self.parents = torch.tensor([index.get(p[:-1], 0) for p in paths], device=device)
        self.ranks = int(self.node_rank.max()) + 1
        self.typical = (float(m.eps), float(m.delta)) if m.accept == "typical" else None
        self.lossless = self.typical is None
        self.f = None

    def modules(self):
        return [self.heads]

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"f": hidden.last("final")}  # [B, d] the last committed token's final state

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        self.f = hidden.last("final")

    def propose(self, state: BatchState) -> Draft:
        logits = self.heads(self.f.to(next(self.heads.parameters()).dtype))[: self.K]  # [K, B, V']
        top = logits.topk(self.ranks, dim=-1).indices  # [K, B, R]
        cand = self.heads.vocab_ids.to(self.device)[top[self.node_head, :, self.node_rank]].T  # [B, n]
        B = cand.shape[0]
        parents = self.parents[None].expand(B, -1)
        if self.tree == "chain":
            return Draft.chain(cand, typical=self.typical)
        return Draft(tokens=cand, parents=parents, typical=self.typical)

    def describe(self) -> dict:
        return {"tree": self.tree, "nodes": len(self.paths), "heads_used": self.K, "checkpoint_format": self.format,
                "accept": "typical" if self.typical else "exact",
                "typical_eps_delta": list(self.typical) if self.typical else None,
                "draft_vocab": int(self.heads.vocab_ids.numel())}
