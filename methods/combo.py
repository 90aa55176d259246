"""A combination that picks per step and per row: every member method (``combo.of``, e.g.
``[pld, sam, recycle]``) proposes, and each row verifies the draft whose expected accepted length
is the highest by that member's running acceptance statistics. SpecDecode-Bench's oracle picks
with hindsight; this one only from the past, so it is a real method, lossless as its members
are (the engine verifies whatever it sends).

Statistics, per member and depth j: how often a draft of that member that reached depth j had
its depth-j token right, counted over every step and row for every member, drafted or not: after
a step the committed tokens (the accepted drafts and the step's own token) are known, and a
member's draft matched them to some depth whether or not it was the one verified (under
sampling a match is a proxy for acceptance). A draft's expected accepted length is the sum over
its depths of the product of those rates (Laplace-smoothed from ``combo.prior``). Every member
also learns every step (``update``), whichever draft was verified.

Every draft is cut to ``combo.max_nodes`` nodes before it is scored (``auto``: one pass of the
native kernel's row tiles less the root, 3 with AVX2, where a fourth node would make the verify
forward a second, ~20% dearer, pass for a few hundredths of a token; no cut on other kernels).

Members run with their own settings (their defaults) and ``combo.opts.<member>.<key>=...`` over them;
they draft deterministic candidates (no sampled drafts, no window nodes: Leviathan and SpecDec
under sampling, Lookahead are refused at their first draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specbench import methods
from specbench import kernels
from specbench.methods.base import BatchState, Proposer
from specbench.methods import member_cfg
from specbench.decode.tree import Draft
from specbench.errors import ConfigError


def matched_depth(tokens: list[int], parents: list[int], committed: list[int]) -> int:
    """How deep a draft tree (nodes 1.., parents) follows ``committed`` from its root."""
    node, depth = 0, 0
    for c in committed:
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents), start=1) if p == node and t == c), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def cut(tokens: list[int], parents: list[int], n: int) -> tuple[list[int], list[int]]:
    """A draft tree's first ``n`` nodes whose parents are kept (renumbered 1..)."""
    if len(tokens) <= n:
        return tokens, parents
    new, toks, pars = {0: 0}, [], []
    for i, (t, p) in enumerate(zip(tokens, parents), start=1):
        if len(toks) == n:
            break
        if p in new:
            new[i] = len(toks) + 1
            toks.append(t)
            pars.append(new[p])
    return toks, pars


def depth_of(parents: list[int]) -> int:
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return max(d)


class Combo(Proposer):
    name = "combo"

    @dataclass
    class Settings:  # `combo.<key>=...` is short for `method.<key>=...`
        name: str = "combo"
        of: list[str] = field(default_factory=lambda: ["pld", "suffix"])  # the members (each with its own settings); Token Recycling is the costliest to run beside them
        opts: dict[str, Any] = field(default_factory=dict)  # per member, settings over its own: combo.opts.recycle.tree_size=4
        max_nodes: Any = "auto"  # a draft's most nodes; auto: one pass of the native kernel's tile less the root (3 with AVX2), null: no cut
        prior: float = 0.5  # the acceptance rate a member starts from at every depth (one pseudo-observation)
    learned = ("right", "tried", "wins", "steps")  # each member's acceptance so far (and its members')

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        of = list(m.of or [])
        if len(of) < 2 or len(set(of)) != len(of):
            raise ConfigError(f"combo.of must list two or more different methods, got {of}")
        for name in of:
            if name in ("combo", "ar", "reject", "lookahead"):
                why = {"lookahead": "its window nodes are not candidates another draft can stand in for"}.get(
                    name, "it drafts nothing to choose")
                raise ConfigError(f"combo.of: {name} cannot be a member ({why})")
            try:
                member = methods.get(name)
            except KeyError as e:
                raise ConfigError(f"combo.of: {e.args[0]}") from None
            member.check(member_cfg(cfg, name, (m.get("opts") or {}).get(name), f"combo.opts.{name}."), target_config)
        unknown = set(m.get("opts") or {}) - set(of)
        if unknown:
            raise ConfigError(f"combo.opts names {sorted(unknown)}, not in combo.of {of}")
        mx = m.get("max_nodes", "auto")
        if mx not in ("auto", None) and (isinstance(mx, bool) or not isinstance(mx, int) or mx < 1):
            raise ConfigError(f"combo.max_nodes must be auto, null or a positive integer, got {mx!r}")
        if not 0 < float(m.prior) < 1:
            raise ConfigError(f"combo.prior must be in (0, 1), got {m.prior}")

    @classmethod
    def _members(cls, cfg):
        m = cfg.method
        return [(name, member_cfg(cfg, name, (m.get("opts") or {}).get(name))) for name in m.of]

    @classmethod
    def spec_len(cls, cfg, device) -> int | None:
        lens = [methods.get(n).spec_len(c, device) for n, c in cls._members(cfg)]
        return max((k for k in lens if k is not None), default=None)

    @classmethod
    def reach(cls, cfg, device) -> int:
        return max(methods.get(n).reach(c, device) for n, c in cls._members(cfg))

    @classmethod
    def positions(cls, cfg, target_config) -> int:
        return min(methods.get(n).positions(c, target_config) for n, c in cls._members(cfg))

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        return []  # its members keep their own sizes (tune them alone)

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        self.names = list(cfg.method.of)
        self.members = [methods.get(n)(c, target, tokenizer, device, dtype) for n, c in self._members(cfg)]
        self.lossless = all(p.lossless for p in self.members)
        self.hidden_layers = tuple(dict.fromkeys(h for p in self.members for h in p.hidden_layers))
        prior = float(cfg.method.prior)
        self.prior = (prior, 1.0)  # pseudo-counts (right, tried) at every depth
        self.right: list[list[float]] = [[] for _ in self.members]
        self.tried: list[list[float]] = [[] for _ in self.members]
        self.wins = [0] * len(self.members)
        self.steps = 0
        self._drafts: list | None = None  # the last step's rows of every member
        mx = cfg.method.get("max_nodes", "auto")
        if mx == "auto":
            tile = kernels.rows_per_pass(target)
            mx = tile - 1 if tile else None
        self.max_nodes = mx  # the most nodes a row's draft keeps (None: no cut)

    def modules(self):
        return [mod for p in self.members for mod in p.modules()]

    def inner(self):
        return self.members

    # start, select_rows and add_rows are the base's: they pass the rows on to the members (inner)

    @classmethod
    def joins_rows(cls) -> bool:
        return True  # a member that cannot take joining rows says so, in one line, when one joins

    def rate(self, i: int, j: int) -> float:
        r = self.right[i][j] if j < len(self.right[i]) else 0.0
        t = self.tried[i][j] if j < len(self.tried[i]) else 0.0
        return (r + self.prior[0]) / (t + self.prior[1])

    def expected(self, i: int, depth: int) -> float:
        """Expected accepted drafts of member i's draft ``depth`` deep."""
        e, reach = 0.0, 1.0
        for j in range(depth):
            reach *= self.rate(i, j)
            e += reach
        return e

    def propose(self, state: BatchState) -> Draft | None:
        B = len(state.seqs)
        rows = []
        for name, p in zip(self.names, self.members):
            d = p.propose(state)
            try:
                rows.append(d.rows() if d is not None else [([], [])] * B)
            except ValueError:
                raise ConfigError(f"combo: member {name} drafts sampled or non-candidate nodes, which combo cannot "
                                  "mix; leave it out of combo.of (or run greedy)") from None
        self._drafts = rows  # each member learns from its whole draft
        if self.max_nodes is not None:
            rows = [[cut(t, p, self.max_nodes) for t, p in r] for r in rows]
        self.steps += 1
        toks, pars = [], []
        for b in range(B):
            score = [self.expected(i, depth_of(rows[i][b][1])) if rows[i][b][0] else -1.0
                     for i in range(len(self.members))]
            best = max(range(len(score)), key=lambda i: (score[i], -i))
            if score[best] < 0:
                toks.append([])
                pars.append([])
                continue
            self.wins[best] += 1
            toks.append(rows[best][b][0])
            pars.append(rows[best][b][1])
        return Draft.from_rows(toks, pars, state.device)

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        if self._drafts is not None:  # every member's draft against what was committed
            for b, acc in enumerate(accepted):
                committed = state.seqs[b][len(state.seqs[b]) - len(acc) - 1:]
                for i, rows in enumerate(self._drafts):
                    t, p = rows[b]
                    if not t:
                        continue
                    m = matched_depth(t, p, committed)
                    # depths tried: up to one past the match, while the tree goes that deep and the
                    # committed tokens still say (a match of all of them leaves the next unknown)
                    upto = min(m + 1, depth_of(p)) if m < len(committed) else m
                    while len(self.tried[i]) < upto:
                        self.tried[i].append(0.0)
                        self.right[i].append(0.0)
                    for j in range(upto):
                        self.tried[i][j] += 1
                        self.right[i][j] += j < m
            self._drafts = None
        for p in self.members:
            p.update(state, accepted, hidden)

    def describe(self) -> dict:
        total = sum(self.wins) or 1
        return {"of": self.names, "max_nodes": self.max_nodes, "won": {n: w / total for n, w in zip(self.names, self.wins)},
                "rates": {n: [round(self.rate(i, j), 4) for j in range(len(self.tried[i]))]
                          for i, n in enumerate(self.names)},
                "members": {n: p.describe() for n, p in zip(self.names, self.members)}}
