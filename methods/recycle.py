"""Token Recycling (Luo et al. 2024, arXiv 2408.08696): the target's own candidate tokens,
thrown away by plain decoding, become the draft. An adjacency matrix keeps, for each token, the
top-k tokens the target ranked after it the last time that token sat at a verify node; every
step refreshes the rows of the tokens it verified (the root and every draft node, from the
logits the verify forward computed anyway). The draft is a static tree of rank paths, filled
breadth-first from the row's last token: a node of rank r is the r-th candidate the matrix holds
for its parent's token. No model, no training: the matrix is the whole drafter.

The matrix is shared by every row and kept for the whole job (each batch and repeat warms it
further, as the paper keeps it across queries); ``recycle.warm`` saves it after the job and
loads it before the next (a warm start). The tree: ``recycle.tree_size`` rank paths chosen
best-first by a prior score (``rank_tree``), or a list of rank paths.
"""

from __future__ import annotations

from dataclasses import dataclass
import heapq
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from specbench.methods.base import BatchState, Proposer
from specbench.decode.tree import Draft
from specbench.errors import ConfigError

# nodes of the default tree: on the CPU's native kernel a verify takes its rows in passes of 4, so
# the root and 3 nodes cost one pass (docs/tuning.md); the paper's tree is 80 nodes on a GPU
AUTO_TREE = {"cuda": 64, "cpu": 3}
TUNE_TREE = {"cuda": [16, 32, 64, 96], "cpu": [2, 4, 6, 8, 12, 16]}  # what K=auto chooses among
RANK_KEEP = 0.6  # the prior: a rank-0 candidate is kept with probability ~RANK_KEEP, each later rank
RANK_DECAY = 0.3  # ... RANK_DECAY times as often (the best-first order of rank_tree)


def rank_tree(n: int, topk: int) -> list[tuple[int, ...]]:
    """``n`` rank paths, best-first by the prior score prod over the path of
    RANK_KEEP * RANK_DECAY**rank: deep along rank 0, branching where the prior says a sibling
    is worth more than another level. Every path's parent comes before it."""
    out: list[tuple[int, ...]] = []
    heap = [(-RANK_KEEP, (0,))]
    while heap and len(out) < n:
        neg, path = heapq.heappop(heap)
        out.append(path)
        heapq.heappush(heap, (neg * RANK_KEEP, path + (0,)))  # its first child
        if path[-1] + 1 < topk:  # its next sibling
            heapq.heappush(heap, (neg * RANK_DECAY, path[:-1] + (path[-1] + 1,)))
    return out


def tree_of(m, device) -> list[tuple[int, ...]]:
    """The rank paths of a method config (``tree_size`` auto resolved on ``device``)."""
    if m.get("tree") is not None:
        return [tuple(int(r) for r in p) for p in m.tree]
    n = AUTO_TREE.get(device.type, AUTO_TREE["cpu"]) if m.tree_size == "auto" else int(m.tree_size)
    return rank_tree(n, int(m.topk))


class TokenRecycling(Proposer):
    name = "recycle"

    @dataclass
    class Settings:  # `recycle.<key>=...` is short for `method.<key>=...`
        name: str = "recycle"
        topk: int = 8  # candidates kept per token (the paper's 8)
        tree_size: Any = "auto"  # nodes of the default tree, rank paths best-first (auto: 3 CPU, 64 CUDA)
        tree: Any = None  # or the tree itself: a list of rank paths, e.g. [[0], [1], [0, 0]] (a parent before its children)
        warm: Optional[str] = None  # a file: the matrix is loaded from it before the job (when it exists) and saved to it after
    cost_kind = "ngram"
    learned = ("next", "known", "steps_with_draft")  # the matrix: the target's candidates seen so far

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        if m.topk < 1:
            raise ConfigError(f"recycle.topk must be an integer >= 1, got {m.topk!r}")
        if m.tree_size != "auto" and (not isinstance(m.tree_size, int) or isinstance(m.tree_size, bool)
                                      or m.tree_size < 1):
            raise ConfigError(f"recycle.tree_size must be 'auto' or an integer >= 1, got {m.tree_size!r}")
        if m.get("tree") is not None:
            paths = [tuple(p) for p in m.tree]
            for p in paths:
                if not p or any(not isinstance(r, int) or not 0 <= r < m.topk for r in p):
                    raise ConfigError(f"recycle.tree: each path is a list of ranks in 0..topk-1 ({m.topk}), "
                                      f"got {list(p)}")
                if len(p) > 1 and p[:-1] not in paths[:paths.index(p)]:
                    raise ConfigError(f"recycle.tree: path {list(p)} comes before (or without) its parent {list(p[:-1])}")
            if len(set(paths)) != len(paths):
                raise ConfigError("recycle.tree lists a path twice")

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        return max(len(p) for p in tree_of(cfg.method, device))  # the tree's depth; cfg.K plays no part

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes the default tree (tree_size); a tree given as paths has nothing to size."""
        if cfg.method.get("tree") is not None:
            return []
        return [{"method.tree_size": n} for n in TUNE_TREE.get(device.type, TUNE_TREE["cpu"])]

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.topk = int(m.topk)
        paths = tree_of(m, device)
        index = {p: i + 1 for i, p in enumerate(paths)}  # node 0 is the root
        self.parent = [index.get(p[:-1], 0) for p in paths]
        self.rank = [p[-1] for p in paths]
        V = int(getattr(target.config, "vocab_size", 0) or target.get_output_embeddings().weight.shape[0])
        self.next = torch.zeros(V, self.topk, dtype=torch.long)  # token -> its candidates, best first
        self.known = torch.zeros(V, dtype=torch.bool)  # tokens the matrix has a row for
        self.warm = Path(m.warm).expanduser() if m.get("warm") else None
        if self.warm is not None and self.warm.exists():
            saved = torch.load(self.warm, map_location="cpu", weights_only=True)
            if saved["next"].shape != self.next.shape:
                raise ConfigError(f"recycle.warm '{self.warm}' holds a {tuple(saved['next'].shape)} matrix; this "
                                  f"target and topk need {tuple(self.next.shape)}: delete it or point elsewhere")
            self.next, self.known = saved["next"], saved["known"]
        self.steps_with_draft = 0

    def propose(self, state: BatchState) -> Draft | None:
        # numpy views of the matrix (no copy): a handful of tiny gathers a step, where torch's per-op
        # cost was most of this method's time (the same tree, the same tokens)
        nxt, known = self.next.numpy(), self.known.numpy()
        B, n = len(state.seqs), len(self.parent)
        tok = np.zeros((B, n + 1), dtype=np.int64)
        ok = np.zeros((B, n + 1), dtype=bool)
        tok[:, 0] = [s[-1] for s in state.seqs]
        ok[:, 0] = True
        eos = np.fromiter(state.eos, dtype=np.int64) if state.eos else None
        for i, (p, r) in enumerate(zip(self.parent, self.rank), start=1):
            parent = tok[:, p]
            tok[:, i] = nxt[parent, r]
            ok[:, i] = ok[:, p] & known[parent]
            if eos is not None and p != 0:  # nothing is drafted past an end of sequence
                ok[:, i] &= ~np.isin(parent, eos)
        if not ok[:, 1:].any():
            return None
        self.steps_with_draft += 1
        parents = torch.tensor(self.parent, dtype=torch.long, device=state.device)[None].expand(B, n)
        return Draft(tokens=torch.from_numpy(tok[:, 1:].copy()).to(state.device), parents=parents.clone(),
                     valid=torch.from_numpy(ok[:, 1:].copy()).to(state.device))

    def host(self, state: BatchState):
        """Per node of the step: the target's top-k there, its token, whether it is real."""
        if state.logits is None or state.nodes is None:
            return None
        top = state.logits.topk(self.topk, dim=-1).indices  # [B, n+1, topk]
        real = torch.ones_like(state.nodes) if state.node_valid is None else state.node_valid.long()
        return torch.cat([top, state.nodes[..., None], real[..., None]], dim=2)

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        """Refresh the matrix rows of every token the step verified from the target's logits at
        its node (whoever drafted them: a method that wraps this one verifies its own drafts too);
        where a token sits at several nodes, one of them wins."""
        got = self.host_rows(state)
        if got is None:
            return
        B, N = len(got), state.nodes.shape[1]
        host = np.asarray(got, dtype=np.int64).reshape(B, N, self.topk + 2)
        top, tok = host[..., :self.topk], host[..., self.topk]  # [B, n+1, topk], [B, n+1]
        if state.node_valid is not None:  # the real nodes only
            ok = host[..., self.topk + 1].astype(bool)
            tok, top = tok[ok], top[ok]
        self.next.numpy()[tok.reshape(-1)] = top.reshape(-1, self.topk)
        self.known.numpy()[tok.reshape(-1)] = True

    def describe(self) -> dict:
        if self.warm is not None:  # the warm start of the next job
            self.warm.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"next": self.next, "known": self.known}, self.warm)
        return {"topk": self.topk, "tree_nodes": len(self.parent), "tree_depth": max(map(len, self._paths())),
                "matrix_rows": int(self.known.sum()), "warm": str(self.warm) if self.warm else None}

    def _paths(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for p, r in zip(self.parent, self.rank):
            out.append((out[p - 1] if p else ()) + (r,))
        return out
