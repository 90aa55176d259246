"""What a method hands the engine: a small token tree per row.

Nodes are numbered as the verify forward sees them: node 0 is the root (the row's last
emitted token, not yet in the cache); draft nodes are 1..n, each with a parent of smaller
index (a chain is parents = [0, 1, 2, ...]). Rows may have different numbers of nodes:
``valid`` marks the real ones, padding nodes are never accepted.

``q`` is optional: for a node, the exact distribution its token was drawn from (after the
same temperature/top-k/top-p warping the target gets). Nodes without ``q`` are
deterministic candidates (top-k children, n-grams, retrieval). ``typical`` asks for
Medusa's (lossy) typical acceptance instead of the lossless rule when sampling; ``relaxed``
= (beta, tol) asks for SpecDec's (lossy) top-beta rule when greedy. ``candidate`` False marks
extra nodes a method wants the target's outputs for (Lookahead's Jacobi window) that can
never be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specbench.devices import to_device


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, n] long, draft nodes only (root excluded)
    parents: torch.Tensor  # [B, n] long, parent node index in 0..i (0 = root)
    valid: torch.Tensor | None = None  # [B, n] bool
    q: torch.Tensor | None = None  # [B, n, V] float: distribution node i's token was drawn from
    candidate: torch.Tensor | None = None  # [B, n] bool
    is_chain: bool = False
    typical: tuple[float, float] | None = None  # (eps, delta): Medusa's lossy typical acceptance under sampling
    relaxed: tuple[int, float] | None = None  # (beta, tol): SpecDec's lossy top-beta acceptance when greedy
    _geometry: tuple | None = field(default=None, init=False, repr=False, compare=False)
    # (tokens, parents, valid) when the draft was made from host lists (``from_trees``,
    # ``from_lists``): ``rows()`` then reads nothing back from the device while ``valid`` is that one
    _lists: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def geometry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``tree_geometry(self.parents)``, computed once per draft: the verify forward's mask
        and the verification's walk both need it (a dozen small ops)."""
        if self._geometry is None:
            self._geometry = tree_geometry(self.parents)
        return self._geometry

    @staticmethod
    def chain(tokens: torch.Tensor, valid: torch.Tensor | None = None, q: torch.Tensor | None = None,
              typical: tuple[float, float] | None = None, relaxed: tuple[int, float] | None = None) -> "Draft":
        B, n = tokens.shape
        parents = torch.arange(n, device=tokens.device)[None].expand(B, n).clone()
        return Draft(tokens=tokens, parents=parents, valid=valid, q=q, is_chain=True, typical=typical,
                     relaxed=relaxed)

    @staticmethod
    def from_lists(rows: list[list[int]], device) -> "Draft":
        """A chain per row from plain token lists of different lengths."""
        d = Draft.chain(pad_rows(rows, device), pad_rows([[True] * len(r) for r in rows], device, False, torch.bool))
        d._lists = ([list(r) for r in rows], [list(range(len(r))) for r in rows], d.valid)
        return d

    @staticmethod
    def from_rows(tokens: list[list[int]], parents: list[list[int]], device) -> "Draft | None":
        """A tree per row from plain lists (parents: 0 = the root), as a chain Draft when every
        row is one; None when no row has a node."""
        if not any(tokens):
            return None
        if all(p == list(range(len(p))) for p in parents):
            return Draft.from_lists(tokens, device)
        return Draft.from_trees(tokens, parents, device)

    @staticmethod
    def from_trees(tokens: list[list[int]], parents: list[list[int]], device,
                   candidate: list[list[bool]] | None = None) -> "Draft | None":
        """A tree per row from plain lists of different lengths (padding nodes are invalid);
        None when no row has a node."""
        n = max((len(t) for t in tokens), default=0)
        if n == 0:
            return None
        d = Draft(tokens=pad_rows(tokens, device), parents=pad_rows(parents, device),
                  valid=pad_rows([[True] * len(t) for t in tokens], device, False, torch.bool),
                  candidate=None if candidate is None else pad_rows(candidate, device, False, torch.bool))
        d._lists = ([list(t) for t in tokens], [list(p) for p in parents], d.valid)
        return d

    def rows(self) -> list[tuple[list[int], list[int]]]:
        """Each row's valid nodes as plain (tokens, parents) lists, renumbered 1.. in order (a
        node's parent is valid where the node is): what a method that mixes the drafts of
        several proposers per row (``from_trees``) takes apart. Deterministic candidates only
        (no ``q``, every node a candidate)."""
        if self.q is not None or self.candidate is not None:
            raise ValueError("Draft.rows() takes apart deterministic candidates only")
        if self._lists is not None and self.valid is self._lists[2]:  # made from these lists (every node valid)
            return [(list(t), list(p)) for t, p in zip(*self._lists[:2])]
        toks, pars = self.tokens.tolist(), self.parents.tolist()
        valid = [[True] * self.n] * len(toks) if self.valid is None else self.valid.tolist()
        out = []
        for t, p, v in zip(toks, pars, valid):
            new = {0: 0}
            rt, rp = [], []
            for i, (tok, par, ok) in enumerate(zip(t, p, v), start=1):
                if ok and par in new:
                    new[i] = len(rt) + 1
                    rt.append(tok)
                    rp.append(new[par])
            out.append((rt, rp))
        return out

    @property
    def n(self) -> int:
        return int(self.tokens.shape[1])

    def accept_mask(self) -> torch.Tensor:
        m = torch.ones_like(self.tokens, dtype=torch.bool) if self.valid is None else self.valid
        if self.candidate is not None:
            m = m & self.candidate
        return m

    def check(self, batch_size: int, values: bool = True) -> None:
        """Refuse a draft of the wrong shape, and (``values``) one whose parents do not point to an
        earlier node: that reads the device, so the engine checks the values once a batch and
        then reads ``bad_parents()`` with the step's verdict (``check_parents``)."""
        B, n = self.tokens.shape
        if B != batch_size:
            raise ValueError(f"draft has {B} rows, batch has {batch_size}")
        if self.parents.shape != (B, n):
            raise ValueError("draft parents must have the shape of its tokens")
        if values:
            check_parents(bool(self.bad_parents().any()))

    def bad_parents(self) -> torch.Tensor:
        """[B] bool: the rows with a parent that is not an earlier node (on the device, unread)."""
        idx = torch.arange(1, self.n + 1, device=self.parents.device)
        return ((self.parents >= idx[None]) | (self.parents < 0)).any(1)


def check_parents(bad: bool) -> None:
    if bad:
        raise ValueError("draft parents must point to an earlier node (0 = root)")


def pad_rows(rows, device, fill=0, dtype=torch.long, width: int | None = None) -> torch.Tensor:
    """Lists of different lengths as one tensor [len(rows), width] on ``device`` (right-padded with
    ``fill``; width: the longest row by default), in one host-to-device copy that does not sync."""
    n = max((len(r) for r in rows), default=0) if width is None else width
    return to_device([list(r) + [fill] * (n - len(r)) for r in rows], dtype, device).view(len(rows), n)


def prefix_tree(paths, first: int = 0) -> tuple[list[int], list[int]]:
    """The prefix tree (trie) of token ``paths`` (each continuing the root) as node tokens
    and parents, for nodes numbered ``first + 1, first + 2, ...`` (parent 0 = the root):
    candidates that share a prefix share its nodes."""
    tokens, parents, node = [], [], {}
    for path in paths:
        par, key = 0, ()
        for t in path:
            key = key + (int(t),)
            if key not in node:
                tokens.append(int(t))
                parents.append(par)
                node[key] = first + len(tokens)
            par = node[key]
    return tokens, parents


def tree_geometry(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """From draft parents [B, n] build, over the n+1 forward nodes (root first), the depth
    [B, n+1] and ancestor-or-self matrix [B, n+1, n+1].

    The closure of "is the parent of, or is" by repeated squaring (path lengths up to 2^s after
    s products: a handful of small matrix products instead of a step per node); a node's depth
    is its number of ancestors."""
    B, n = parents.shape
    dev = parents.device
    N = n + 1
    par = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), parents], dim=1)
    # clamped: a draft whose parents are out of range is refused after its step (Draft.check), not
    # met first by an index out of range on the device
    a = torch.eye(N, device=dev).expand(B, N, N).clone().scatter_(2, par.clamp(0, n)[..., None], 1.0)
    for _ in range(max(1, (N - 1).bit_length())):  # 0/1 entries, sums below N: exact in fp32
        a = (torch.bmm(a, a) > 0).float()
    anc = a > 0
    return anc.sum(-1) - 1, anc
