"""The walk a verification rule ends with (``specbench.decode.verify``): the path of a row's draft
tree (or chain) that passes, as the kept node indices the cache commits, and the ``Verdict``."""

from __future__ import annotations

import torch

from specbench.decode.tree import Draft


class Verdict:
    """A verification's outcome. On the device: ``keep`` [B, m] (forward node indices to keep, root
    first, padded past ``counts[b]``), ``counts`` [B] (kept nodes = accepted drafts + 1), ``extra``
    [B] (the correction / bonus token) and ``path`` [B, m] (the token at each kept node). ``read``
    brings them to the host in one transfer, the step's one wait for the device: ``accepted``
    (per row, its accepted draft tokens), ``keep_ids`` and ``count_ids`` (what the cache commits),
    ``extra_ids``. Reading ``accepted`` first reads them all."""

    def __init__(self, keep: torch.Tensor, counts: torch.Tensor, extra: torch.Tensor,
                 path: torch.Tensor | None = None, accepted: list[list[int]] | None = None):
        self.keep, self.counts, self.extra, self.path = keep, counts, extra, path
        self._accepted = accepted  # known on the host already where the rule walked there
        self.keep_ids: list[list[int]] | None = None
        self.count_ids: list[int] | None = None
        self.extra_ids: list[int] | None = None

    @property
    def accepted(self) -> list[list[int]]:
        if self.count_ids is None:
            self.read()
        return self._accepted

    def read(self, *more: torch.Tensor) -> list[list[int]]:
        """The one host read of a step: the verdict and ``more`` (tensors [B] or [B, k] of integers
        or booleans the caller needs on the host too) in one transfer. Returns ``more`` as one list
        a row (its columns side by side). ``keep`` is then narrowed (a view) to the longest kept
        path, as a walk that read the counts first would have made it."""
        B, m = self.keep.shape
        cols = [self.counts[:, None], self.extra[:, None], self.keep]
        if self._accepted is None:
            cols.append(self.path)
        cols += [t.reshape(B, -1) for t in more]
        rows = torch.cat([c.to(torch.long) for c in cols], dim=1).tolist()
        self.count_ids = [r[0] for r in rows]
        self.extra_ids = [r[1] for r in rows]
        self.keep_ids = [r[2:2 + c] for r, c in zip(rows, self.count_ids)]
        off = 2 + m
        if self._accepted is None:
            self._accepted = [r[off + 1:off + c] for r, c in zip(rows, self.count_ids)]
            off += m
        w = max(self.count_ids, default=1)
        if w < m:
            self.keep = self.keep[:, :w]
        return [r[off:] for r in rows]


def chain_keep(n_acc: torch.Tensor, n: int):
    """A chain of ``n`` drafts keeps its root and the first n_acc[b]: keep [B, n + 1] (entries past
    counts[b] are padding: no read of the longest), counts [B]."""
    keep = torch.arange(n + 1, device=n_acc.device)[None].expand(n_acc.shape[0], n + 1)
    return keep, n_acc + 1


# Trees of up to this many forward nodes in all (rows x nodes) on the CPU are walked on lists:
# the vectorised walk's ~25 small tensor ops cost more right after a forward (the weight stream
# leaves the caches cold) than a walk over a few dozen nodes in Python (docs/cpu-backend.md).
LIST_WALK = 256


def walk(ok: torch.Tensor, draft: Draft):
    """The deepest node (lowest index on ties) of ``draft``'s tree whose whole path passes ``ok``
    [B, n]. Returns keep [B, m] (the path, root first, padded), counts [B], best node [B]. On the
    device nothing is read (m = n + 1); small trees on the CPU are walked on host lists."""
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
    keep = order % N  # entries past counts[b] are padding (every node's width: no read of the longest)
    return keep, counts, best


def walk_lists(ok: torch.Tensor, draft: Draft):
    """``walk`` on Python lists (a parent comes before its children: Draft.check)."""
    B, n = ok.shape
    host = torch.cat([ok.long(), draft.parents], dim=1).tolist()  # one read
    passes, par = [r[:n] for r in host], [r[n:] for r in host]
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


def verdict(draft: Draft, keep, counts, extra) -> Verdict:
    """The verdict of a walk on the device: the tokens along each kept path stay there until
    ``Verdict.read``."""
    B = keep.shape[0]
    tok_all = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=keep.device), draft.tokens], dim=1)
    return Verdict(keep, counts, extra, path=tok_all.gather(1, keep))
