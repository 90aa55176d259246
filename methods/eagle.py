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

import torch

from methods.base import BatchState, Proposer
from specbench import drafters
from specbench.drafters import published
from specbench.draft import Draft, pad_rows
from specbench.errors import ConfigError
from specbench.paths import resolve_path

# The tree shape by device (`auto`): on a GPU a 60-node verify costs about what one token does
# (EAGLE-2's defaults); on a CPU every node and every drafter level costs, so the tree stays small
# and shallow there (the measurements: docs/tuning.md).
EAGLE3_FORMATS = ("eagle3", "speculators-eagle3")  # SafeAILab's layout, vLLM's speculators format
AUTO = {"cuda": {"top_k": 10, "depth": 5, "total_tokens": 60}, "cpu": {"top_k": 4, "depth": 2, "total_tokens": 6}}
# the (depth, total_tokens) trees K=auto chooses among, around each device's AUTO
TUNE = {"cuda": [(3, 16), (4, 32), (5, 60), (6, 80), (7, 100)],
        "cpu": [(1, 2), (1, 4), (2, 4), (2, 6), (3, 8), (3, 12), (4, 16)]}


class Eagle(Proposer):
    name = "eagle"
    hidden_layers = ("final",)

    @classmethod
    def check(cls, cfg, target_config) -> None:
        m = cfg.method
        version = m.get("version", 2)
        if version not in (2, 3):
            raise ConfigError(f"eagle.version must be 2 (EAGLE-1/2's drafter) or 3 (EAGLE-3's), got {version!r}; "
                              "both draft EAGLE-2's dynamic tree")
        tree = m.get("tree")
        if tree is not None and tree not in published.named_trees("eagle"):
            raise ConfigError(f"eagle.tree must be null (EAGLE-2's dynamic tree) or an EAGLE-1 static tree "
                              f"({', '.join(published.named_trees('eagle'))}), got {tree!r}")
        for key in ("top_k", "depth", "total_tokens"):
            v = m[key]
            if v != "auto" and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"eagle.{key} must be 'auto' or an integer >= 1, got {v!r}")
        folder = resolve_path(m.checkpoint)
        fmt = published.detect(folder)
        try:
            if fmt is not None and fmt.startswith("speculators-"):  # vLLM's format: only its eagle3 is read
                published.check_eagle3(folder, target_config)
            three = fmt in EAGLE3_FORMATS
            if three != (version == 3):
                what = "an EAGLE-3 drafter" if three else "an EAGLE-1/2 drafter"
                raise ConfigError(f"eagle.checkpoint '{m.checkpoint}' holds {what}; set eagle.version="
                                  f"{3 if three else 2}, or name an EAGLE-{3 if version == 3 else 2} checkpoint "
                                  f"(python -m specbench.train drafter={'eagle3' if version == 3 else 'eagle'})")
            if fmt in ("eagle1", "eagle3"):  # SafeAILab's published layouts
                (published.check_eagle3 if fmt == "eagle3" else published.check_eagle1)(folder, target_config)
            elif fmt is None:
                drafters.check_fits(folder, cfg, target_config, "eagle", "eagle.checkpoint")
        except published.FormatError as e:
            raise ConfigError(f"eagle.checkpoint {e}") from None

    @classmethod
    def tree_shape(cls, m, device) -> tuple[int, int, int]:
        """(top_k, depth, total_tokens) of a method config on ``device`` (``auto`` resolved; a
        static tree: its widest rank, its depth and its nodes)."""
        if m.get("tree") is not None:
            paths = published.named_trees("eagle")[m.tree]
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
        if m.get("version", 2) != 3 or published.detect(folder) not in EAGLE3_FORMATS:
            raise ConfigError("backend=vllm runs EAGLE-3 drafters in SafeAILab's or vLLM's speculators layout (eagle.version=3 "
                              "eagle.checkpoint=<folder>; ours: python -m specbench.train drafter=eagle3); "
                              "the shipped EAGLE-1/2 head normalises its input, which vLLM's EAGLE-1 layout cannot hold")
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
            fmt = published.detect(folder)
            if fmt in ("eagle1", *EAGLE3_FORMATS):
                load = published.load_eagle3 if fmt in EAGLE3_FORMATS else published.load_eagle1
                drafter, self.format = load(folder, target, device, dtype), fmt
            else:
                drafter = drafters.load(folder, target, device, dtype, kind="eagle")
        self.d = drafter
        self.tree = m.get("tree")
        if self.tree is not None:  # EAGLE-1's static tree: nodes by depth, parents first
            paths = sorted({tuple(p) for p in published.named_trees("eagle")[self.tree]}, key=lambda p: (len(p), p))
            index = {(): 0, **{p: i + 1 for i, p in enumerate(paths)}}
            self.static = [(torch.tensor([index[p] for p in paths if len(p) == dd], device=device),
                            torch.tensor([index[p[:-1]] for p in paths if len(p) == dd], device=device),
                            torch.tensor([p[-1] for p in paths if len(p) == dd], device=device))
                           for dd in range(1, self.depth + 1)]  # per depth: nodes, parents, ranks
            self.parents = torch.tensor([index[p[:-1]] for p in paths], device=device)
            anc = torch.eye(len(paths) + 1, dtype=torch.bool)
            for p in paths:
                for j in range(len(p)):
                    anc[index[p], index[p[:j]]] = True
            self.anc = anc.to(device)
        self.hidden_layers = tuple(drafter.taps)  # EAGLE-1/2: the final state; EAGLE-3: three layers' inputs
        self.h_last = None  # [B, d] the drafter's prediction of the root's feature

    def modules(self):
        return [self.d]

    # ------------------------------------------------------------------ drafter cache
    def start(self, state: BatchState, hidden=None) -> None:
        B = len(state.seqs)
        blk = self.d.block
        dt = next(self.d.parameters()).dtype
        self.Kc = torch.zeros(B, blk.Hk, 0, blk.Dh, device=self.device, dtype=dt)
        self.Vc = torch.zeros_like(self.Kc)
        self.len = torch.zeros(B, dtype=torch.long, device=self.device)
        self._append(state, hidden)

    def update(self, state: BatchState, accepted, hidden=None) -> None:
        self._append(state, hidden)

    def _append(self, state: BatchState, hidden) -> None:
        """Append pairs (f_i, x_{i+1}) for the newly committed tokens: their features and
        the tokens that followed them (the last ``counts[b]`` tokens of each sequence)."""
        feats = self.d.features(hidden)
        counts = hidden.counts
        B, m = feats.shape[:2]
        dev = self.device
        toks = pad_rows([seq[len(seq) - c:] for seq, c in zip(state.seqs, counts.tolist())], dev, width=m)
        feats = feats.to(self.Kc.dtype)
        C = self.Kc.shape[2]
        j = torch.arange(m, device=dev)
        pos = self.len[:, None] + j[None]
        ctx = (torch.arange(C, device=dev)[None] < self.len[:, None])[:, None].expand(B, m, C)
        own = (j[None, :] <= j[:, None])[None] & (j[None, None, :] < counts[:, None, None])
        own = own | torch.eye(m, dtype=torch.bool, device=dev)[None]  # padded pairs see themselves
        h, k, v = self.d.step(feats, toks, pos, self.Kc, self.Vc, torch.cat([ctx, own], dim=2))
        new_C = int((self.len + counts).max())
        if new_C > C:
            pad = self.Kc.new_zeros(B, self.Kc.shape[1], new_C - C, self.Kc.shape[3])
            self.Kc = torch.cat([self.Kc, pad], dim=2)
            self.Vc = torch.cat([self.Vc, pad], dim=2)
        sel = j[None] < counts[:, None]
        rows = torch.arange(B, device=dev)[:, None].expand(B, m)[sel]
        src = j[None].expand(B, m)[sel]
        dst = (self.len[:, None] + j[None])[sel]
        self.Kc[rows, :, dst] = k[rows, :, src]
        self.Vc[rows, :, dst] = v[rows, :, src]
        self.len = self.len + counts
        self.h_last = h[torch.arange(B, device=dev), counts - 1]

    def add_rows(self, state: BatchState, hidden=None) -> None:
        """The new rows' drafter caches are built from their prompts alone, then appended (the
        caches are right-padded to the wider one: a row sees only its first ``len`` slots)."""
        old = (self.Kc, self.Vc, self.len, self.h_last)
        self.start(state, hidden)
        Ka, Va, la, ha = old
        C = max(Ka.shape[2], self.Kc.shape[2])

        def pad(t):
            return torch.nn.functional.pad(t, (0, 0, 0, C - t.shape[2]))

        self.Kc, self.Vc = torch.cat([pad(Ka), pad(self.Kc)]), torch.cat([pad(Va), pad(self.Vc)])
        self.len, self.h_last = torch.cat([la, self.len]), torch.cat([ha, self.h_last])

    def select_rows(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.len = self.len[idx]
        C = int(self.len.max()) if len(keep) else 0
        self.Kc = self.Kc[idx, :, :C]
        self.Vc = self.Vc[idx, :, :C]
        self.h_last = self.h_last[idx]

    # ------------------------------------------------------------------ the static tree
    def _propose_static(self) -> Draft:
        """EAGLE-1: every node of the named tree is the rank-th likeliest token of the drafter's
        step at its parent; the nodes of a depth that have children run one step together."""
        d, dev, R = self.d, self.device, self.top_k
        vid = d.vocab_ids.to(dev)
        h0 = self.h_last
        B, D = h0.shape
        N = self.anc.shape[0]
        tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        out = h0.new_zeros(B, N, D)  # the drafter's output at each node that ran (root: h_last)
        out[:, 0] = h0
        top = d.logits(h0).topk(R, dim=-1).indices[:, None]  # [B, 1, R] ranked candidates of the root
        ran = torch.zeros(1, dtype=torch.long, device=dev)  # the nodes whose step produced `top`
        Kp = self.Kc.new_zeros(B, self.Kc.shape[1], 0, self.Kc.shape[3])
        Vp = Kp
        pend = torch.zeros(0, dtype=torch.long, device=dev)
        C = self.Kc.shape[2]
        for dd, (nodes, parents, ranks) in enumerate(self.static, start=1):
            slot = (ran[:, None] == parents[None]).float().argmax(0)  # each node's parent among `ran`
            tok[:, nodes] = vid[top[:, slot, ranks]]
            if dd == self.depth:
                break
            nxt = self.static[dd][1].unique()  # this depth's nodes that have children
            F = nxt.numel()
            ctx = (torch.arange(C, device=dev)[None] < self.len[:, None])[:, None].expand(B, F, C)
            seen = self.anc[nxt][:, pend][None].expand(B, F, pend.numel())
            mask = torch.cat([ctx, seen, torch.eye(F, dtype=torch.bool, device=dev)[None].expand(B, F, F)], dim=2)
            pos = (self.len + dd - 1)[:, None].expand(B, F)
            h, kk, vv = d.step(out[:, self.parents[nxt - 1]], tok[:, nxt], pos, torch.cat([self.Kc, Kp], 2),
                               torch.cat([self.Vc, Vp], 2), mask)
            Kp, Vp, pend = torch.cat([Kp, kk], 2), torch.cat([Vp, vv], 2), torch.cat([pend, nxt])
            out[:, nxt] = h
            top, ran = d.logits(h).topk(R, dim=-1).indices, nxt
        return Draft(tokens=tok[:, 1:], parents=self.parents[None].expand(B, -1))

    # ------------------------------------------------------------------ the dynamic tree
    def propose(self, state: BatchState) -> Draft:
        if self.tree is not None:
            return self._propose_static()
        d, k, dev = self.d, self.top_k, self.device
        vid = d.vocab_ids.to(dev)
        h0 = self.h_last
        B, D = h0.shape
        N = 1 + k + (self.depth - 1) * k * k
        tok = torch.zeros(B, N, dtype=torch.long, device=dev)
        par = torch.zeros(B, N, dtype=torch.long, device=dev)
        score = torch.full((B, N), float("-inf"), device=dev)
        anc = torch.zeros(B, N, N, dtype=torch.bool, device=dev)
        anc[:, 0, 0] = True
        lp = torch.log_softmax(d.logits(h0).float(), dim=-1)
        s1, i1 = lp.topk(k, dim=-1)
        first = torch.arange(1, k + 1, device=dev)
        tok[:, first] = vid[i1]
        score[:, first] = s1
        anc[:, first, 0] = True
        anc[:, first, first] = True
        n = k + 1
        frontier = first[None].expand(B, k)
        feat = h0[:, None].expand(B, k, D)
        Kp = self.Kc.new_zeros(B, self.Kc.shape[1], 0, self.Kc.shape[3])
        Vp = Kp
        pend = torch.zeros(B, 0, dtype=torch.long, device=dev)  # tree node of each pending pair
        C = self.Kc.shape[2]
        ctx = (torch.arange(C, device=dev)[None] < self.len[:, None])[:, None].expand(B, k, C)
        eye = torch.eye(k, dtype=torch.bool, device=dev)[None].expand(B, k, k)
        rows = torch.arange(B, device=dev)[:, None]
        for dd in range(2, self.depth + 1):
            a = anc.gather(1, frontier[..., None].expand(B, k, N))  # ancestors of each frontier node
            seen = a.gather(2, pend[:, None, :].expand(B, k, pend.shape[1]))
            mask = torch.cat([ctx, seen, eye], dim=2)
            pos = (self.len + dd - 2)[:, None].expand(B, k)
            h, kk, vv = d.step(feat, tok.gather(1, frontier), pos, torch.cat([self.Kc, Kp], 2),
                               torch.cat([self.Vc, Vp], 2), mask)
            Kp, Vp = torch.cat([Kp, kk], 2), torch.cat([Vp, vv], 2)
            pend = torch.cat([pend, frontier], 1)
            lp = torch.log_softmax(d.logits(h).float(), dim=-1)
            cs, ci = lp.topk(k, dim=-1)  # [B, k, k]
            kids = torch.arange(n, n + k * k, device=dev)
            cscore = (score.gather(1, frontier)[..., None] + cs).reshape(B, k * k)
            tok[:, kids] = vid[ci].reshape(B, k * k)
            par[:, kids] = frontier.repeat_interleave(k, dim=1)
            score[:, kids] = cscore
            anc[:, kids] = a.repeat_interleave(k, dim=1)
            anc[:, kids, kids] = True
            best = cscore.topk(k, dim=-1).indices
            frontier = kids[best]
            feat = h.repeat_interleave(k, dim=1).gather(1, best[..., None].expand(B, k, D))
            n += k * k
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
                "version": 3 if self.format in EAGLE3_FORMATS else 2,
                "drafter_params": sum(p.numel() for p in self.d.parameters()),
                "draft_vocab": int(self.d.vocab_ids.numel())}
