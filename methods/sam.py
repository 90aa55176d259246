"""SAM-Decoding (Hu et al. 2024, arXiv 2411.10666): speculative decoding from suffix automata.

A suffix automaton (SAM) recognises every substring of its text; walking it token by token
keeps, in amortised O(1) a token, the longest suffix of the generated text that occurs in the
text and where it first ends. Two automata per row:

- dynamic: over the row's own prompt and output, grown as tokens are committed; the longest
  suffix of the sequence that occurred earlier in it (the suffix link of the whole sequence's
  state) and the tokens that followed its first occurrence;
- static (optional, ``sam.corpus``): over a corpus (the REST datastores: ``sharegpt``,
  ``python_code``, a .txt/.jsonl path; its first ``sam.corpus_tokens`` tokens), built once per
  process; each row keeps its match state in it as tokens are committed.

Each step a row drafts the K tokens that followed the longer match, the static one counting
``sam.static_bias`` tokens shorter (the paper's preference for the request's own text). When the
longer match is under ``sam.min_match`` tokens, the row takes the draft of ``sam.fallback``
(another method run beside it, e.g. ``recycle`` or ``eagle``: the paper's SAM[Token Recycling]
and SAM[EAGLE-2]), or drafts nothing (``none``). The fallback learns every step, whichever draft
was verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import functools
import sys
from typing import Any, Optional

from specbench import methods
from specbench.methods import member_cfg
from specbench.methods.base import BatchState, Proposer
from specbench.decode.tree import Draft
from specbench.errors import ConfigError

SEP = -1  # between corpus entries: no query holds it, so no match runs across two entries


class SuffixAutomaton:
    """The suffix automaton of a growing token sequence (Blumer et al. 1985): per state its
    transitions, suffix link, longest length and ``first``, the end index of the first
    occurrence of its strings."""

    def __init__(self):
        self.next: list[dict] = [{}]
        self.link = [-1]
        self.len = [0]
        self.first = [-1]
        self.last = 0
        self.n = 0

    def extend(self, c: int) -> None:
        nxt, link, ln, first = self.next, self.link, self.len, self.first
        cur = len(ln)
        nxt.append({})
        ln.append(ln[self.last] + 1)
        link.append(0)
        first.append(self.n)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if ln[p] + 1 == ln[q]:
                link[cur] = q
            else:
                clone = len(ln)
                nxt.append(dict(nxt[q]))
                ln.append(ln[p] + 1)
                link.append(link[q])
                first.append(first[q])
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = clone
                link[cur] = clone
        self.last = cur
        self.n += 1

    def extend_all(self, tokens) -> None:
        for t in tokens:
            self.extend(int(t))

    def earlier(self) -> tuple[int, int]:
        """(length, end index of its first occurrence) of the longest suffix of the whole
        sequence that also ends earlier in it; (0, -1) for none."""
        v = self.link[self.last]
        return (self.len[v], self.first[v]) if v > 0 else (0, -1)

    def step(self, state: int, length: int, c: int) -> tuple[int, int]:
        """The match (state, length) of a text's longest suffix found in this automaton, after
        the text grows by ``c``."""
        nxt, link = self.next, self.link
        while state and c not in nxt[state]:
            state = link[state]
            length = self.len[state]
        if c in nxt[state]:
            return nxt[state][c], length + 1
        return 0, 0


@functools.lru_cache(maxsize=2)
def corpus_automaton(spec: str, tokenizer, cap: int) -> tuple[SuffixAutomaton, list[int]]:
    """The automaton of a corpus's first ``cap`` tokens (entries joined by SEP), and those tokens."""
    from tqdm.auto import tqdm

    from specbench.methods.rest import corpus

    toks: list[int] = []
    for text in corpus(spec):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        toks += list(ids[:cap - len(toks)]) + [SEP]
        if len(toks) >= cap:
            break
    if len(toks) <= 1:
        raise ConfigError(f"sam.corpus '{spec}' has no text")
    sam = SuffixAutomaton()
    for t in tqdm(toks, desc=f"SAM corpus {spec}", unit="tok", unit_scale=True, file=sys.stderr, mininterval=2):
        sam.extend(t)
    return sam, toks


class Row:
    """One row's automata: its own (dynamic) and its match state in the corpus's (static)."""

    def __init__(self, seq: list[int], static: SuffixAutomaton | None):
        self.dyn = SuffixAutomaton()
        self.dyn.extend_all(seq)
        self.static, self.state, self.length = static, 0, 0
        if static is not None:
            for t in seq:
                self.state, self.length = static.step(self.state, self.length, int(t))
        self.seen = len(seq)

    def grow(self, seq: list[int]) -> None:
        for t in seq[self.seen:]:
            self.dyn.extend(int(t))
            if self.static is not None:
                self.state, self.length = self.static.step(self.state, self.length, int(t))
        self.seen = len(seq)


class SamDecoding(Proposer):
    name = "sam"

    @dataclass
    class Settings:  # `sam.<key>=...` is short for `method.<key>=...`
        name: str = "sam"
        min_match: int = 2  # a shorter match drafts from the fallback (or nothing)
        corpus: Optional[str] = None  # static automaton: null, sharegpt, python_code or a .txt/.jsonl path (REST's datastores)
        corpus_tokens: int = 300000  # ... its first N tokens (the automaton is built in memory once per process)
        static_bias: int = 4  # a corpus match counts this many tokens shorter than one in the row's own text (the paper's 4)
        fallback: Optional[str] = "none"  # none, or a method whose draft a row takes when its match is short (recycle, eagle, pld, ...)
        fallback_opts: dict[str, Any] = field(default_factory=dict)  # the fallback's own settings over its defaults, e.g. sam.fallback_opts.tree_size=4
    cost_kind = "ngram"
    per_row = ("rows",)  # each row's automaton state
    learned = ("used",)  # (and its fallback's)

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        for key, lo in (("min_match", 1), ("static_bias", 0), ("corpus_tokens", 1)):
            v = m[key]
            if v < lo:
                raise ConfigError(f"sam.{key} must be an integer >= {lo}, got {v!r}")
        fb = m.fallback
        if fb not in (None, "none"):
            if fb in ("sam", "combo"):
                raise ConfigError(f"sam.fallback={fb}: the fallback is another drafting method (e.g. recycle, eagle, "
                                  "pld) or none")
            try:
                member = methods.get(fb)
            except KeyError as e:
                raise ConfigError(f"sam.fallback: {e.args[0]}") from None
            member.check(member_cfg(cfg, fb, m.get("fallback_opts"), "sam.fallback_opts."), target_config)
        if m.corpus is not None:
            from specbench.methods.rest import BUILTIN, _datastore_path

            if m.corpus not in BUILTIN and not _datastore_path(m.corpus).exists():
                raise ConfigError(f"sam.corpus '{m.corpus}' is neither {' nor '.join(BUILTIN)} nor an existing file")

    @classmethod
    def reach(cls, cfg, device) -> int:
        m = cfg.method
        own = int(cfg.K)
        if m.fallback in (None, "none"):
            return own
        fb = member_cfg(cfg, m.fallback, m.get("fallback_opts"))
        return max(own, methods.get(m.fallback).reach(fb, device))

    def __init__(self, cfg, target, tokenizer, device, dtype):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.K = int(cfg.K)
        self.min_match, self.bias = int(m.min_match), int(m.static_bias)
        self.corpus, self.ctoks = (None, None) if m.corpus is None else \
            corpus_automaton(str(m.corpus), tokenizer, int(m.corpus_tokens))
        self.fallback = None
        if m.fallback not in (None, "none"):
            self.fallback = methods.get(m.fallback)(member_cfg(cfg, m.fallback, m.get("fallback_opts")),
                                                    target, tokenizer, device, dtype)
            self.hidden_layers = self.fallback.hidden_layers
        self.rows: list[Row] = []
        self.used = {"dynamic": 0, "static": 0, "fallback": 0, "none": 0}  # row-steps drafted by each

    def modules(self):
        return self.fallback.modules() if self.fallback is not None else []

    def inner(self):
        return [self.fallback] if self.fallback is not None else []

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        return {"rows": [Row(s, self.corpus) for s in state.seqs]}  # the fallback (inner) gets its rows from the base

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        if self.fallback is not None:
            self.fallback.update(state, accepted, hidden)

    def match(self, row: Row, seq: list[int], eos) -> tuple[str, list[int]]:
        """The row's draft from the longer of its two matches ("none" under min_match)."""
        row.grow(seq)
        n_dyn, end = row.dyn.earlier()
        n_st = row.length - self.bias if self.corpus is not None else -1
        if max(n_dyn, n_st) < self.min_match:
            return "none", []
        if n_dyn >= n_st:
            out, src = seq[end + 1:end + 1 + self.K], "dynamic"
        else:
            e = self.corpus.first[row.state]
            out, src = self.ctoks[e + 1:e + 1 + self.K], "static"
        for j, t in enumerate(out):  # cut at an entry's end, and before an end of sequence (as PLD)
            if t == SEP or t in eos:
                out = out[:j]
                break
        return src, out

    def propose(self, state: BatchState) -> Draft | None:
        found = [self.match(r, s, state.eos) for r, s in zip(self.rows, state.seqs)]
        fb = None
        if self.fallback is not None and any(src == "none" for src, _ in found):
            d = self.fallback.propose(state)
            fb = d.rows() if d is not None else None
        toks, pars = [], []
        for b, (src, out) in enumerate(found):
            if src == "none" and fb is not None and fb[b][0]:
                src = "fallback"
                t, p = fb[b]
            else:
                t, p = out, list(range(len(out)))
            self.used[src if t else "none"] += 1
            toks.append(t)
            pars.append(p)
        return Draft.from_rows(toks, pars, state.device)

    def describe(self) -> dict:
        m = self.cfg.method
        total = sum(self.used.values()) or 1
        return {"min_match": self.min_match, "static_bias": self.bias, "corpus": m.corpus,
                "corpus_tokens": len(self.ctoks) if self.ctoks else 0, "fallback": m.fallback,
                "drafted_by": {k: v / total for k, v in self.used.items()},
                **({"fallback_cfg": self.fallback.describe()} if self.fallback is not None else {})}
