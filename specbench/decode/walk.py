"""The walk a verification rule ends with (``specbench.decode.verify``): the path of a row's draft
tree (or chain) that passes, as the kept node indices the cache commits, and the ``Verdict``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specbench.decode.tree import Draft


@dataclass
class Verdict:
    keep: torch.Tensor  # [B, m] forward node indices to keep (root first), padded
    counts: torch.Tensor  # [B] number of kept nodes = accepted drafts + 1 (the root)
    accepted: list[list[int]]  # per row, accepted draft tokens
    extra: torch.Tensor  # [B] the correction / bonus token
    depth_of_kept: list[list[int]] | None = None


def chain_keep(n_acc: torch.Tensor):
    """A chain keeps its root and the first n_acc[b] drafts: keep [B, m] (padded), counts [B]."""
    m = int(n_acc.max()) + 1
    keep = torch.arange(m, device=n_acc.device)[None].expand(n_acc.shape[0], m).clone()
    return keep, n_acc + 1


# Trees of up to this many forward nodes in all (rows x nodes) on the CPU are walked on lists:
# the vectorised walk's ~25 small tensor ops cost more right after a forward (the weight stream
# leaves the caches cold) than a walk over a few dozen nodes in Python (docs/cpu-backend.md).
LIST_WALK = 256


def walk(ok: torch.Tensor, draft: Draft):
    """The deepest node (lowest index on ties) of ``draft``'s tree whose whole path passes ``ok``
    [B, n]. Returns keep [B, m] (the path, root first, padded), counts [B], best node [B]."""
    B, n = ok.shape
    if ok.device.type == "cpu" and B * (n + 1) <= LIST_WALK:
        return walk_lists(ok, draft)
    N = n + 1
    dev = ok.device
    rows = torch.arange(B, device=dev)
    depth, anc = draft.geometry()
    passed = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), ok], dim=1)
    acc = ~(anc & ~passed[:, None, :]).any(-1)  # every node on the path from the root passes
    idx = torch.arange(N, device=dev)
    score = torch.where(acc, depth * (N + 1) - idx[None], torch.full_like(depth, -1))
    best = score.argmax(1)
    on_path = anc[rows, best]  # [B, N]
    counts = on_path.sum(1)
    order = torch.where(on_path, idx[None], idx[None] + N).sort(dim=1).values
    keep = order[:, :int(counts.max())] % N  # entries past counts[b] are padding
    return keep, counts, best


def walk_lists(ok: torch.Tensor, draft: Draft):
    """``walk`` on Python lists (a parent comes before its children: Draft.check)."""
    B, n = ok.shape
    passes, par = ok.tolist(), draft.parents.tolist()
    paths = []
    for b in range(B):
        good, depth, best = [True] + [False] * n, [0] * (n + 1), 0
        for i in range(1, n + 1):
            p = par[b][i - 1]
            depth[i] = depth[p] + 1
            good[i] = good[p] and passes[b][i - 1]
            if good[i] and depth[i] > depth[best]:
                best = i
        path = [best]
        while path[-1]:
            path.append(par[b][path[-1] - 1])
        paths.append(path[::-1])
    keep, counts = path_tensors(paths, ok.device)
    return keep, counts, torch.tensor([x[-1] for x in paths], dtype=torch.long, device=ok.device)


def path_tensors(paths: list[list[int]], dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept paths (node indices, root first) as ``keep`` [B, m] padded with 0, and ``counts`` [B]."""
    m = max(len(x) for x in paths)
    keep = torch.tensor([x + [0] * (m - len(x)) for x in paths], dtype=torch.long, device=dev)
    return keep, torch.tensor([len(x) for x in paths], dtype=torch.long, device=dev)


def verdict(draft: Draft, keep, counts, n_acc, extra) -> Verdict:
    B = keep.shape[0]
    tok_all = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=keep.device), draft.tokens], dim=1)
    acc_lists = tok_all.gather(1, keep).tolist()
    n_list = n_acc.tolist()
    accepted = [acc_lists[b][1 : 1 + n_list[b]] for b in range(B)]
    return Verdict(keep=keep, counts=counts, accepted=accepted, extra=extra)
