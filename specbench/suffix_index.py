"""A token datastore searched the way REST searches it, and the same way every time.

REST (He et al. 2023) finds the longest suffix of the context that occurs in a datastore,
takes the continuations that follow its occurrences (at most ``MAX_MATCHES`` of them, each
``CONTINUATION`` tokens long, in suffix-array order), counts every prefix of them as a trie
node, and verifies the ``choices`` most frequent nodes. The reference library breaks ties
between equally frequent nodes by a hash map's order, which changes from call to call; here a
tie goes to the shallower node, then to the lexicographically smaller one, so the chosen nodes
always form a trie and the same query always gives the same drafts.

The index is the token stream (each token stored as id + 1, entries separated by 0, so no
continuation runs into the next entry) and two suffix arrays built by ``pydivsufsort``: one of
the stream, whose order is REST's order of the matches, and one of the stream reversed, in
which the longest matching suffix of a context is found token by token in one pass.
"""

from __future__ import annotations

import os
import shutil
from bisect import bisect_left, bisect_right
from pathlib import Path
from typing import Iterable

import numpy as np

MAX_MATCHES = 5000  # REST's `k`: occurrences whose continuations are counted
CONTINUATION = 10  # REST's `long`: tokens taken after each occurrence
MAX_TOKENS = 2**31 - 1  # int32 suffix arrays and ids (+1)


def build(entries: Iterable[list[int]], out: Path) -> int:
    """Writes the index of ``entries`` (token id lists) into the folder ``out`` (atomically:
    a folder named ``out`` is complete); returns the number of tokens indexed."""
    from pydivsufsort import divsufsort

    parts, n = [], 0
    for ids in entries:
        a = np.asarray(ids, dtype=np.int64)
        if a.size == 0:
            continue
        if a.min() < 0 or a.max() >= MAX_TOKENS - 1:
            raise ValueError(f"token ids must lie in [0, {MAX_TOKENS - 2}]")
        parts.append((a + 1).astype(np.int32))
        parts.append(np.zeros(1, dtype=np.int32))
        n += a.size
        if n + len(parts) // 2 >= MAX_TOKENS:
            raise ValueError(f"the datastore holds more than {MAX_TOKENS} tokens")
    if n == 0:
        return 0
    text = np.concatenate(parts)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.save(tmp / "text.npy", text)
    np.save(tmp / "sa.npy", divsufsort(text).astype(np.int32))
    np.save(tmp / "rsa.npy", divsufsort(np.ascontiguousarray(text[::-1])).astype(np.int32))
    tmp.rename(out)
    return n


class SuffixIndex:
    """A built index, memory-mapped; ``drafts`` is REST's retrieval."""

    def __init__(self, folder: Path | str):
        folder = Path(folder)
        self.text = np.load(folder / "text.npy", mmap_mode="r")
        self.sa = np.load(folder / "sa.npy", mmap_mode="r")
        self.rsa = np.load(folder / "rsa.npy", mmap_mode="r")
        # plain-int indexing for the binary searches (a memoryview reads a Python int directly)
        self._t, self._sa, self._rsa = memoryview(self.text), memoryview(self.sa), memoryview(self.rsa)
        self.n = len(self.text)

    def longest(self, context: list[int], most: int) -> int:
        """The length (at most ``most``) of the longest suffix of ``context`` found."""
        t, n, rsa = self._t, self.n, self._rsa
        lo, hi = 0, n
        got = 0
        for j in range(min(most, len(context))):
            tok = int(context[-1 - j]) + 1  # the reversed stream reads the context backwards
            key = lambda s, j=j: t[n - 1 - s - j] if s + j < n else -1  # noqa: E731
            lo = bisect_left(rsa, tok, lo, hi, key=key)
            hi = bisect_right(rsa, tok, lo, hi, key=key)
            if lo == hi:
                break
            got = j + 1
        return got

    def _range(self, query: list[int]) -> tuple[int, int]:
        t, n, sa = self._t, self.n, self._sa
        lo, hi = 0, n
        for j, q in enumerate(query):
            key = lambda s, j=j: t[s + j] if s + j < n else -1  # noqa: E731
            lo = bisect_left(sa, int(q) + 1, lo, hi, key=key)
            hi = bisect_right(sa, int(q) + 1, lo, hi, key=key)
            if lo == hi:
                break
        return lo, hi

    def continuations(self, query: list[int], k: int = MAX_MATCHES, long: int = CONTINUATION) -> np.ndarray:
        """[m, long] ids + 1 that follow the first ``k`` occurrences of ``query`` in suffix-array
        order (sorted rows), 0 past an entry's end."""
        lo, hi = self._range(query)
        if lo == hi:
            return np.zeros((0, long), dtype=np.int64)
        at = np.asarray(self.sa[lo:min(hi, lo + k)], dtype=np.int64) + len(query)
        idx = at[:, None] + np.arange(long)
        vals = np.where(idx < self.n, np.asarray(self.text)[np.minimum(idx, self.n - 1)], 0).astype(np.int64)
        return vals * np.cumprod(vals > 0, axis=1)  # nothing after an entry's end

    def tree(self, query: list[int], choices: int, k: int = MAX_MATCHES,
             long: int = CONTINUATION) -> tuple[list[int], list[int]]:
        """The ``choices`` most frequent trie nodes of ``query``'s continuations as tokens and
        parents (nodes numbered from 1 in breadth-first order, parent 0 = the root)."""
        c = self.continuations(query, k, long)
        m = len(c)
        if m == 0:
            return [], []
        neq = c[1:] != c[:-1]
        first_diff = np.where(neq.any(1), neq.argmax(1), long)  # where row i leaves row i-1
        nodes, starts = [], {}
        for d in range(1, long + 1):
            s = np.flatnonzero(np.concatenate([[True], first_diff < d]))  # rows opening a depth-d prefix
            starts[d] = s
            count = np.diff(np.append(s, m))
            tok = c[s, d - 1]
            ok = tok > 0
            nodes.append(np.stack([count[ok], np.full(ok.sum(), d), s[ok], tok[ok]], 1))
        nodes = np.concatenate(nodes)
        order = np.lexsort((nodes[:, 2], nodes[:, 1], -nodes[:, 0]))[:choices]  # ties: shallower, then smaller
        kept = nodes[order]
        kept = kept[np.lexsort((kept[:, 2], kept[:, 1]))]  # breadth-first: parents before children
        number = {(int(d), int(r)): i + 1 for i, (_, d, r, _) in enumerate(kept)}
        tokens, parents = [], []
        for _, d, r, tok in kept:
            d, r = int(d), int(r)
            tokens.append(int(tok) - 1)
            if d == 1:
                parents.append(0)
            else:
                s = starts[d - 1]
                parents.append(number[(d - 1, int(s[np.searchsorted(s, r, "right") - 1]))])
        return tokens, parents

    def drafts(self, context: list[int], max_suffix: int, min_suffix: int,
               choices: int) -> tuple[list[int], list[int]]:
        """REST's draft tree for ``context``: from the longest suffix found (at most
        ``max_suffix`` tokens) down to ``min_suffix``, the first with a continuation."""
        for n in range(self.longest(context, max_suffix), min_suffix - 1, -1):
            tokens, parents = self.tree(context[-n:], choices)
            if tokens:
                return tokens, parents
        return [], []
