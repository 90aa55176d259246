"""SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975): model-free drafts from suffix trees of
earlier text, grown into a tree by frequency.

Two trees of every substring up to ``suffix.max_depth`` tokens, each node counting how often its
substring occurred: a per-request tree over the row's prompt and its own output, and a global
tree over the outputs (responses) of every request of the job, earlier and in flight. Each step
and row, in each tree: the longest suffix of the row's text that is a path of the tree (the
pattern, m tokens), then from its node a draft grown best-first by the estimated probability of
each path (the product, along it, of count(child) / count(parent)), nodes under
``suffix.min_prob`` left out, at most ``spec_factor * m + spec_offset`` nodes and at most K
(``tree: false`` follows the likeliest child only: a chain). The tree whose draft scores higher
(the sum of its nodes' probabilities) drafts the row.

Implemented from the paper: the authors' library (``arctic-inference`` 0.3.0 on PyPI) is an sdist
whose build needs nanobind, CMake, grpcio-tools and protobuf 5.29 (our environment has 7), and,
with build isolation, a second torch; it is not installed by the project (docs/methods.md).
"""

from __future__ import annotations

from dataclasses import dataclass
import heapq

from specbench.methods.base import BatchState, Proposer
from specbench.decode.tree import Draft
from specbench.errors import ConfigError


class Node:
    __slots__ = ("children", "count", "depth")

    def __init__(self, depth: int):
        self.children: dict[int, Node] = {}
        self.count = 0
        self.depth = depth


class SuffixTree:
    """Every substring (up to ``max_depth`` tokens) of the sequences fed to it, as a trie whose
    nodes count their substring's occurrences. A sequence is fed token by token through a
    cursor: the nodes of its suffixes shorter than max_depth."""

    def __init__(self, max_depth: int):
        self.root = Node(0)
        self.max_depth = max_depth

    def feed(self, cursor: list, tokens) -> list:
        """Append ``tokens`` to the sequence whose suffixes ``cursor`` holds; the new cursor."""
        D, root = self.max_depth, self.root
        for t in tokens:
            t = int(t)
            nxt = []
            for node in [root] + cursor:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node(node.depth + 1)
                child.count += 1
                if child.depth < D:
                    nxt.append(child)
            cursor = nxt
        return cursor

    def match(self, seq: list[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``seq`` that is a path of the tree (shorter than
        max_depth, so it can continue), and its length."""
        for m in range(min(len(seq), self.max_depth - 1), 0, -1):
            node = self.root
            for t in seq[len(seq) - m:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, m
        return None, 0


def grow(node: Node, budget: int, min_prob: float, tree: bool) -> tuple[list[int], list[int], float]:
    """A draft from ``node``: tokens, parents (0 = the root) and score (the sum of the nodes'
    path probabilities), best-first by path probability; ``tree=False``: the likeliest chain."""
    toks, pars, score = [], [], 0.0
    if not tree:
        p = 1.0
        while len(toks) < budget and node.children:
            t, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))
            p *= child.count / node.count
            if p < min_prob:
                break
            toks.append(t)
            pars.append(len(toks) - 1)
            score += p
            node = child
        return toks, pars, score
    order = iter(range(1 << 62))  # ties in probability: the token first seen first, no Node compared
    heap = [(-c.count / node.count, next(order), t, 0, c) for t, c in node.children.items()]
    heapq.heapify(heap)
    while heap and len(toks) < budget:
        neg, _, t, parent, child = heapq.heappop(heap)
        if -neg < min_prob:
            break
        toks.append(t)
        pars.append(parent)
        score -= neg
        me = len(toks)
        for u, g in child.children.items():
            heapq.heappush(heap, (neg * g.count / child.count, next(order), u, me, g))
    return toks, pars, score


class SuffixDecoding(Proposer):
    name = "suffix"

    @dataclass
    class Settings:  # `suffix.<key>=...` is short for `method.<key>=...`; K caps the draft's nodes
        name: str = "suffix"
        max_depth: int = 24  # longest substring the trees hold (vLLM's suffix_decoding_max_tree_depth default)
        spec_factor: float = 1.0  # at most spec_factor * (pattern length) + spec_offset draft nodes (and at most K)
        spec_offset: float = 0.0
        min_prob: float = 0.1  # nodes whose estimated path probability is under this are left out
        tree: bool = True  # false: the likeliest chain only
        global_tree: bool = True  # the tree of every response of the job beside the request's own (false: its own text only)
    cost_kind = "ngram"
    per_row = ("rows",)  # each row's own suffix tree and match state
    learned = ("glob", "used")  # the global tree holds every earlier response of the job

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        if m.max_depth < 2:
            raise ConfigError(f"suffix.max_depth must be an integer >= 2, got {m.max_depth!r}")
        if not m.spec_factor > 0 or m.spec_offset < 0:
            raise ConfigError(f"suffix.spec_factor must be > 0 and suffix.spec_offset >= 0, got {m.spec_factor}, "
                              f"{m.spec_offset}")
        if not 0 <= m.min_prob < 1:
            raise ConfigError(f"suffix.min_prob must be in [0, 1), got {m.min_prob}")

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.K = int(cfg.K)
        self.D = int(m.max_depth)
        self.factor, self.offset, self.min_prob = float(m.spec_factor), float(m.spec_offset), float(m.min_prob)
        self.tree = bool(m.tree)
        self.use_global = bool(m.global_tree)
        self.glob = SuffixTree(self.D)  # every response of the job (kept across its batches)
        self.rows: list[dict] = []
        self.used = {"request": 0, "global": 0, "none": 0}

    def _row(self, seq: list[int], prompt_len: int) -> dict:
        local = SuffixTree(self.D)
        cur = local.feed([], seq)
        gcur = self.glob.feed([], seq[prompt_len:]) if self.use_global else []  # the response so far
        return {"local": local, "cur": cur, "gcur": gcur, "seen": len(seq)}

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"rows": [self._row(s, n) for s, n in zip(state.seqs, state.prompt_lens)]}

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        for r, seq in zip(self.rows, state.seqs):
            new = seq[r["seen"]:]
            r["cur"] = r["local"].feed(r["cur"], new)
            if self.use_global:
                r["gcur"] = self.glob.feed(r["gcur"], new)
            r["seen"] = len(seq)

    def draft(self, r: dict, seq: list[int], eos) -> tuple[str, list[int], list[int]]:
        best = ("none", [], [], 0.0)
        trees = [("request", r["local"])] + ([("global", self.glob)] if self.use_global else [])
        for name, t in trees:
            if name == "request" and r["seen"] == len(seq):  # its cursor holds every suffix node of seq
                node = next((c for c in reversed(r["cur"]) if c.children), None)  # deepest first
                m = node.depth if node is not None else 0
            else:
                node, m = t.match(seq)
            if node is None:
                continue
            budget = min(self.K, int(self.factor * m + self.offset))
            toks, pars, score = grow(node, budget, self.min_prob, self.tree)
            if toks and score > best[3]:
                best = (name, toks, pars, score)
        name, toks, pars, _ = best
        if eos and toks:  # nothing past an end of sequence: its descendants are dropped
            keep, new = [], {0: 0}
            for i, (t, p) in enumerate(zip(toks, pars), start=1):
                if p in new and t not in eos:
                    new[i] = len(keep) + 1
                    keep.append((t, new[p]))
            toks, pars = [t for t, _ in keep], [p for _, p in keep]
        return (name if toks else "none"), toks, pars

    def propose(self, state: BatchState) -> Draft | None:
        toks, pars = [], []
        for r, seq in zip(self.rows, state.seqs):
            name, t, p = self.draft(r, seq, state.eos)
            self.used[name] += 1
            toks.append(t)
            pars.append(p)
        return Draft.from_rows(toks, pars, state.device)

    def describe(self) -> dict:
        total = sum(self.used.values()) or 1
        return {"max_depth": self.D, "spec_factor": self.factor, "spec_offset": self.offset, "min_prob": self.min_prob,
                "tree": self.tree, "global_tree": self.use_global, "drafted_by": {k: v / total for k, v in self.used.items()}}
