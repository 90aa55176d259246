"""EAGLE (Li et al. 2024, arXiv 2401.15077) with EAGLE-2's dynamic draft tree (arXiv
2406.16858), on the shared engine at any batch size; ``eagle.version=3`` drafts with EAGLE-3's
drafter (arXiv 2503.01840, ``specbench/drafters/eagle3.py``: three target layers' features
fused, a draft vocabulary), the same tree.

The drafter (``specbench/drafters/eagle.py``) keeps its own per-row KV cache of pairs
(target feature f_i, next token x_{i+1}). After every step the engine hands over the
target's final hidden states of the tokens it just committed; the drafter appends those
pairs (the real features, never its own guesses) and its output at the last one predicts
the first draft token.

Dynamic tree, per row: the top_k tokens of that prediction are depth 1; then, ``depth - 1``
times, the top_k nodes of the newest depth by cumulative draft log-probability (the
frontier) run one drafter step each (attending to the committed pairs and to their own
ancestors' pairs) and each proposes top_k children; finally the ``total_tokens`` nodes with
the highest cumulative log-probability (closed under ancestors) go to the verifier. Nodes
are deterministic candidates (no q), so sampling uses the lossless tree rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from specbench.methods.base import BatchState, Proposer
from specbench import drafters
from specbench.drafters import formats
from specbench.drafters.cache import DrafterCache
from specbench.decode.tree import Draft, pad_rows
from specbench.errors import ConfigError
from specbench.paths import resolve_path

# The tree shape by device (`auto`): on a GPU a 60-node verify costs about what one token does
# (EAGLE-2's defaults); on a CPU every node and every drafter level costs, so the tree stays small
# and shallow there (the measurements: docs/tuning.md).
EAGLE3_FORMATS = formats.eagle3.NAMES  # SafeAILab's layout, vLLM's speculators format
AUTO = {"cuda": {"top_k": 10, "depth": 5, "total_tokens": 60}, "cpu": {"top_k": 4, "depth": 2, "total_tokens": 6}}
# the (depth, total_tokens) trees K=auto chooses among, around each device's AUTO
TUNE = {"cuda": [(3, 16), (4, 32), (5, 60), (6, 80), (7, 100)],
        "cpu": [(1, 2), (1, 4), (2, 4), (2, 6), (3, 8), (3, 12), (4, 16)]}


class Eagle(Proposer):
    name = "eagle"

    @dataclass
    class Settings:  # `eagle.<key>=...` is short for `method.<key>=...`
        name: str = "eagle"
        version: Any = 2  # 2: EAGLE-1/2's drafter; 3: EAGLE-3's (three layers' features fused); 3.1: EAGLE 3.1's (a norm per tapped layer, the post-norm state fed back). All draft EAGLE-2's dynamic tree
        checkpoint: str = "checkpoints/smollm2-135m/eagle"  # ours (python -m specbench.train drafter=eagle|eagle3 target=<model>), or a published folder: SafeAILab's EAGLE-1/2 or EAGLE-3 layout, or vLLM's speculators eagle3
        top_k: Any = "auto"  # children per expanded node, and the frontier kept per depth (auto: 4 CPU, 10 CUDA)
        depth: Any = "auto"  # draft tree depth, drafter steps per engine step (auto: 2 CPU, 5 CUDA)
        total_tokens: Any = "auto"  # nodes sent to the verifier (auto: 6 CPU, 60 CUDA)
        tree: Optional[str] = None  # null: EAGLE-2's dynamic tree; or EAGLE-1's static tree by name (mc_sim_7b_63: 25 nodes, depth 5; top_k/depth/total_tokens then unused)
    cost_kind = "eagle"
    hidden_layers = ("final",)

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        version = m.get("version", 2)
        if version not in (2, 3, 3.1):
            raise ConfigError(f"eagle.version must be 2 (EAGLE-1/2's drafter), 3 (EAGLE-3's) or 3.1 (EAGLE 3.1's), "
                              f"got {version!r}; all draft EAGLE-2's dynamic tree")
        tree = m.get("tree")
        if tree is not None and tree not in formats.named_trees("eagle"):
            raise ConfigError(f"eagle.tree must be null (EAGLE-2's dynamic tree) or an EAGLE-1 static tree "
                              f"({', '.join(formats.named_trees('eagle'))}), got {tree!r}")
        for key in ("top_k", "depth", "total_tokens"):
            v = m[key]
            if v != "auto" and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"eagle.{key} must be 'auto' or an integer >= 1, got {v!r}")
        folder = resolve_path(m.checkpoint)
        fmt = formats.detect(folder)
        try:
            if fmt is not None and fmt.startswith("speculators-"):  # vLLM's format: only its eagle3 is read
                formats.eagle3.check(folder, target_config)
            three = fmt in EAGLE3_FORMATS
            if three and version in (3, 3.1) and formats.eagle3.version(folder) != version:
                has = formats.eagle3.version(folder)
                raise ConfigError(f"eagle.checkpoint '{m.checkpoint}' holds an EAGLE-{has} drafter"
                                  + (" (fc_norm, norm_output)" if has == 3.1 else "") + f"; set eagle.version={has}")
            if three != (version in (3, 3.1)):
                what = "an EAGLE-3 drafter" if three else "an EAGLE-1/2 drafter"
                raise ConfigError(f"eagle.checkpoint '{m.checkpoint}' holds {what}; set eagle.version="
                                  f"{3 if three else 2}, or name an EAGLE-{3 if version in (3, 3.1) else 2} checkpoint "
                                  f"(python -m specbench.train drafter={'eagle3' if version in (3, 3.1) else 'eagle'})")
            if fmt in ("eagle1", "eagle3"):  # SafeAILab's published layouts
                formats.check(fmt, folder, target_config)
            elif fmt is None:
                drafters.check_fits(folder, cfg, target_config, "eagle", "eagle.checkpoint")
        except formats.FormatError as e:
            raise ConfigError(f"eagle.checkpoint {e}") from None

    @classmethod
    def tree_shape(cls, m, device) -> tuple[int, int, int]:
        """(top_k, depth, total_tokens) of a method config on ``device`` (``auto`` resolved; a
        static tree: its widest rank, its depth and its nodes)."""
        if m.get("tree") is not None:
            paths = formats.named_trees("eagle")[m.tree]
            return 1 + max(p[-1] for p in paths), max(map(len, paths)), len(paths)
        auto = AUTO.get(device.type, AUTO["cpu"])
        return tuple(auto[k] if m[k] == "auto" else int(m[k]) for k in ("top_k", "depth", "total_tokens"))

    @classmethod
    def tune_space(cls, cfg, device) -> list[dict]:
        """K=auto sizes EAGLE-2's dynamic tree: (depth, total_tokens) pairs, top_k as set; a
        static tree (eagle.tree) has nothing to size."""
        if cfg.method.get("tree") is not None:
            return []
        return [{"method.depth": d, "method.total_tokens": n} for d, n in TUNE.get(device.type, TUNE["cpu"])]

    @classmethod
    def spec_len(cls, cfg, device) -> int:
        return cls.tree_shape(cfg.method, device)[1]  # cfg.K plays no part: the tree is `depth` deep

    @classmethod
    def vllm_config(cls, cfg) -> dict:
        """vLLM's ``eagle3`` with an EAGLE-3 drafter in SafeAILab's layout or vLLM's speculators format
        (what vLLM reads), drafting a chain ``depth`` deep: vLLM's EAGLE on this path drafts each
        step's top-1, which is EAGLE-2's dynamic tree with top_k=1 and total_tokens=depth."""
        m = cfg.method
        folder = resolve_path(m.checkpoint)
        if m.get("version", 2) not in (3, 3.1) or formats.detect(folder) not in EAGLE3_FORMATS:
            raise ConfigError("backend=vllm runs EAGLE-3 drafters in SafeAILab's or vLLM's speculators layout (eagle.version=3 "
                              "eagle.checkpoint=<folder>; ours: python -m specbench.train drafter=eagle3); "
                              "the shipped EAGLE-1/2 head normalises its input, which vLLM's EAGLE-1 layout cannot hold")
        if formats.eagle3.version(folder) == 3.1:
            raise ConfigError("backend=vllm: an EAGLE 3.1 drafter (fc_norm, norm_output) is not known to vLLM's eagle3 path; "
                              "run it with backend=specbench")
        top_k, depth, total = cls.tree_shape(m, torch.device("cpu"))
        if m.get("tree") is not None or top_k != 1 or total != depth:
            raise ConfigError(f"vLLM's eagle3 drafts a chain (each step's top-1): with backend=vllm set eagle.top_k=1 "
                              f"eagle.total_tokens={depth} (eagle.depth={depth})")
        return {"method": "eagle3", "model": folder, "num_speculative_tokens": depth}

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        from specbench.drafters.eagle import EagleDrafter

        d = EagleDrafter(target, torch.arange(target.config.vocab_size))
        return {"method": {"checkpoint": drafters.save_random(d, folder / "eagle", "eagle", 0.3, target)}}

    def __init__(self, cfg, target, tokenizer, device, dtype, drafter=None):
        super().__init__(cfg, target, tokenizer, device, dtype)
        m = cfg.method
        self.top_k, self.depth, self.total = self.tree_shape(m, device)
        self.format = "specbench"
        if drafter is None:
            folder = resolve_path(m.checkpoint)
            fmt = formats.detect(folder)
            if fmt in ("eagle1", *EAGLE3_FORMATS):
                drafter, self.format = formats.load(fmt, folder, target, device, dtype), fmt
            else:
                drafter = drafters.load(folder, target, device, dtype, kind="eagle")
        self.drafter = drafter
        self.tree = m.get("tree")
        if self.tree is not None:  # EAGLE-1's static tree: nodes by depth, parents first
            paths = sorted({tuple(p) for p in formats.named_trees("eagle")[self.tree]}, key=lambda p: (len(p), p))
            index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
            self.static = [(torch.tensor([index[p] for p in paths if len(p) == dd], device=device),
                            torch.tensor([index[p[:-1]] for p in paths if len(p) == dd], device=device),
                            torch.tensor([p[-1] for p in paths if len(p) == dd], device=device))
                           for dd in range(1, self.depth + 1)]  # per depth: nodes, parents, ranks
            # per depth but the last, its nodes that have children (each runs a drafter step), known here
            # so the tree needs no data-dependent op (``unique``) a step
            self.expand = [torch.tensor(sorted({index[p[:-1]] for p in paths if len(p) == dd + 1}), device=device)
                           for dd in range(1, self.depth)]
            self.parents = torch.tensor([index[p[:-1]] for p in paths], device=device)
            anc = torch.eye(len(paths) + 1, dtype=torch.bool)
            for p in paths:
                for j in range(len(p)):
                    anc[index[p], index[p[:j]]] = True
            self.anc = anc.to(device)
        self.hidden_layers = tuple(drafter.taps)  # EAGLE-1/2: the final state; EAGLE-3: three layers' inputs
        self.h_last = None  # [B, d] the drafter's prediction of the root's feature

    def modules(self):
        return [self.drafter]

    # ------------------------------------------------------------------ drafter cache
    def _tree_room(self) -> int:
        """Drafter slots a propose's tree steps write after the context (``DrafterCache.scratch``)."""
        if self.tree is not None:
            return sum(int(x.numel()) for x in self.expand)
        return (self.depth - 1) * self.top_k

    # the drafter's cache of each row (a DrafterCache) and its prediction of the root's feature
    # (h_last): the base keeps both as rows leave and join, from what new_rows makes
    per_row = ("cache", "h_last")

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        blk = self.drafter.block
        dt = next(self.drafter.parameters()).dtype
        longest = max(len(s) for s in state.seqs)
        # the drafter's own cache, a pair (f_i, x_{i+1}) a verified token: room for every token the
        # batch may add, a step's widest append and a propose's tree after them
        cache = DrafterCache(1, blk.Hk, blk.Dh, len(state.seqs), self.device, dt, longest + state.max_new_tokens,
                             self.depth + 2 + self._tree_room(), graphs=state.graphs, owner=self)
        return {"cache": cache, "h_last": self._append(cache, state, hidden, prompt=True)}

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        self.h_last = self._append(self.cache, state, hidden)

    def _step(self, feats, toks, pos, mask, scratch):
        """One drafter step over the cache (``DrafterCache.run``: with compile=graphs, replayed)."""
        return self.drafter.step(feats, toks, pos, scratch[0], mask)

    def _append(self, cache: DrafterCache, state: BatchState, hidden, prompt: bool = False) -> torch.Tensor:
        """Append pairs (f_i, x_{i+1}) for the newly committed tokens: their features and
        the tokens that followed them (the last ``counts[b]`` tokens of each sequence).
        Returns the drafter's output at each row's last pair [B, d]. A step's (not the prompt's)
        runs as a graph with compile=graphs, its pairs padded to a step's most (``depth + 1``)."""
        feats = self.drafter.features(hidden)
        counts = hidden.counts
        B, new = feats.shape[:2]
        dev = self.device
        if cache.graphs is not None and not prompt and new < self.depth + 1:  # one shape: a step's most
            feats = torch.nn.functional.pad(feats, (0, 0, 0, self.depth + 1 - new))
            new = feats.shape[1]
        toks = pad_rows([seq[len(seq) - c:] for seq, c in zip(state.seqs, hidden.lens)], dev, width=new)
        feats = feats.to(cache.keys[0].dtype)
        j = torch.arange(new, device=dev)
        pos = cache.length[:, None] + j[None]
        own = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < counts[:, None, None])
        own = own | torch.eye(new, dtype=torch.bool, device=dev)[None]  # padded pairs see themselves
        mask = torch.cat([cache.visible(new), own], dim=2)
        if prompt:  # its shapes are the prompts': eager
            h, new_keys, new_values = self._step(feats, toks, pos, mask, cache.scratch(new))
        else:
            h, new_keys, new_values = cache.run("append", self._step, feats, toks, pos, mask, scratch=cache.scratch(new))
        cache.append([(new_keys, new_values)], counts, hidden.lens)
        return h[torch.arange(B, device=dev), counts - 1]

    # ------------------------------------------------------------------ the static tree
    def _propose_static(self) -> Draft:
        """EAGLE-1: every node of the named tree is the rank-th likeliest token of the drafter's
        step at its parent; the nodes of a depth that have children run one step together."""
        drafter, dev, top_k = self.drafter, self.device, self.top_k
        vocab_ids = drafter.vocab_ids.to(dev)
        h0 = self.h_last
        B, D = h0.shape
        N = self.anc.shape[0]
        tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        out = h0.new_zeros(B, N, D)  # the drafter's output at each node that ran (root: h_last)
        out[:, 0] = h0
        top = drafter.logits(h0).topk(top_k, dim=-1).indices[:, None]  # [B, 1, top_k] ranked candidates of the root
        ran = torch.zeros(1, dtype=torch.long, device=dev)  # the nodes whose step produced `top`
        scratch = self.cache.scratch(self._tree_room())  # the tree's pairs go after the context
        pending = torch.zeros(0, dtype=torch.long, device=dev)
        for depth, (nodes, parents, ranks) in enumerate(self.static, start=1):
            slot = (ran[:, None] == parents[None]).float().argmax(0)  # each node's parent among `ran`
            tok[:, nodes] = vocab_ids[top[:, slot, ranks]]
            if depth == self.depth:
                break
            nxt = self.expand[depth - 1]  # this depth's nodes that have children
            F = nxt.numel()
            seen = self.anc[nxt][:, pending][None].expand(B, F, pending.numel())
            mask = torch.cat([self.cache.visible(F), seen, torch.eye(F, dtype=torch.bool, device=dev)[None].expand(B, F, F)],
                             dim=2)
            pos = (self.cache.length + depth - 1)[:, None].expand(B, F)
            h, _, _ = self.cache.run("static", self._step, out[:, self.parents[nxt - 1]], tok[:, nxt], pos, mask,
                                     scratch=scratch)
            pending = torch.cat([pending, nxt])
            out[:, nxt] = h
            top, ran = drafter.logits(h).topk(top_k, dim=-1).indices, nxt
        return Draft(tokens=tok[:, 1:], parents=self.parents[None].expand(B, -1))

    # ------------------------------------------------------------------ the dynamic tree
    def propose(self, state: BatchState) -> Draft:
        if self.tree is not None:
            return self._propose_static()
        drafter, top_k, dev = self.drafter, self.top_k, self.device
        vocab_ids = drafter.vocab_ids.to(dev)
        h0 = self.h_last
        B, D = h0.shape
        N = 1 + top_k + (self.depth - 1) * top_k * top_k
        tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        par = torch.zeros(B, N, dtype=torch.long, device=dev)
        score = torch.full((B, N), float("-inf"), device=dev)
        anc = torch.zeros(B, N, N, dtype=torch.bool, device=dev)
        anc[:, 0, 0] = True
        logp = torch.log_softmax(drafter.logits(h0).float(), dim=-1)
        first_logp, first_ids = logp.topk(top_k, dim=-1)
        first = torch.arange(1, top_k + 1, device=dev)
        tok[:, first] = vocab_ids[first_ids]
        score[:, first] = first_logp
        anc[:, first, 0] = True
        anc[:, first, first] = True
        n = top_k + 1
        frontier = first[None].expand(B, top_k)
        feat = h0[:, None].expand(B, top_k, D)
        # the tree's own drafter keys and values go after the context (its pairs so far)
        scratch = self.cache.scratch(self._tree_room())
        pending = torch.zeros(B, 0, dtype=torch.long, device=dev)  # tree node of each pending pair
        ctx = self.cache.visible(top_k)
        eye = torch.eye(top_k, dtype=torch.bool, device=dev)[None].expand(B, top_k, top_k)
        rows = torch.arange(B, device=dev)[:, None]
        for depth in range(2, self.depth + 1):
            a = anc.gather(1, frontier[..., None].expand(B, top_k, N))  # ancestors of each frontier node
            seen = a.gather(2, pending[:, None, :].expand(B, top_k, pending.shape[1]))
            mask = torch.cat([ctx, seen, eye], dim=2)
            pos = (self.cache.length + depth - 2)[:, None].expand(B, top_k)
            h, _, _ = self.cache.run("tree", self._step, feat, tok.gather(1, frontier), pos, mask, scratch=scratch)
            pending = torch.cat([pending, frontier], 1)
            logp = torch.log_softmax(drafter.logits(h).float(), dim=-1)
            child_logp, child_ids = logp.topk(top_k, dim=-1)  # [B, top_k, top_k]
            kids = torch.arange(n, n + top_k * top_k, device=dev)
            cscore = (score.gather(1, frontier)[..., None] + child_logp).reshape(B, top_k * top_k)
            tok[:, kids] = vocab_ids[child_ids].reshape(B, top_k * top_k)
            par[:, kids] = frontier.repeat_interleave(top_k, dim=1)
            score[:, kids] = cscore
            anc[:, kids] = a.repeat_interleave(top_k, dim=1)
            anc[:, kids, kids] = True
            best = cscore.topk(top_k, dim=-1).indices
            frontier = kids[best]
            feat = h.repeat_interleave(top_k, dim=1).gather(1, best[..., None].expand(B, top_k, D))
            n += top_k * top_k
        return self._select(tok[:, :n], par[:, :n], score[:, :n], rows)

    def _select(self, tok, par, score, rows) -> Draft:
        """The ``total`` best nodes per row, closed under ancestors, renumbered in order."""
        B, n = tok.shape
        T = min(self.total, n - 1)
        sel = torch.zeros(B, n, dtype=torch.bool, device=tok.device)
        sel.scatter_(1, score[:, 1:].topk(T, dim=-1).indices + 1, True)
        sel[:, 0] = True
        for _ in range(self.depth):  # a node whose parent lost a tie is dropped
            sel = sel & sel.gather(1, par)
        sel[:, 0] = False
        idx = torch.arange(n, device=tok.device)
        order = torch.where(sel, idx[None], idx[None] + n).sort(dim=1).values[:, :T] % n
        valid = sel.gather(1, order)
        newpos = torch.zeros(B, n, dtype=torch.long, device=tok.device)
        newpos[rows, order] = torch.arange(1, T + 1, device=tok.device)[None].expand(B, T)
        newpos[:, 0] = 0
        parents = torch.where(valid, newpos.gather(1, par.gather(1, order)), torch.zeros_like(order))
        return Draft(tokens=tok.gather(1, order), parents=parents, valid=valid)

    def describe(self) -> dict:
        return {"tree": self.tree or "dynamic", "top_k": self.top_k, "depth": self.depth, "total_tokens": self.total,
                "checkpoint_format": self.format,
                "version": formats.eagle3.version(resolve_path(self.cfg.method.checkpoint)) if self.format in EAGLE3_FORMATS
                else 2,
                "drafter_params": sum(p.numel() for p in self.drafter.parameters()),
                "draft_vocab": int(self.drafter.vocab_ids.numel())}
