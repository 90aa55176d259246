"""The one engine every method runs through: prefill, then per step propose -> verify (one
target forward over all draft nodes, tree attention) -> accept -> commit -> update."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from methods.base import BatchState, Proposer
from specbench.draft import Draft
from specbench.hidden import Hidden, Tap
from specbench.kv import RaggedCache
from specbench.timing import PhaseTimer, sync
from specbench.verify import Sampling, greedy_pick, sample, verify, warp


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)  # generated tokens (EOS included if hit)
    steps: int = 0  # decoding steps (the prefill's first token is not a step)
    accept_lens: list[int] = field(default_factory=list)  # accepted draft tokens per step
    drafted: list[int] = field(default_factory=list)  # candidate nodes proposed per step
    nodes: list[int] = field(default_factory=list)  # draft nodes in the verify forward per step (+ non-candidates)
    t_first: float = 0.0  # seconds from batch start to first token
    t_done: float = 0.0  # seconds from batch start to the last token
    hit_eos: bool = False


class Engine:
    def __init__(self, target, proposer: Proposer, sampling: Sampling, device: torch.device,
                 dtype: torch.dtype, eos_ids: set[int], timer: PhaseTimer):
        self.target = target
        self.proposer = proposer
        self.sampling = sampling
        self.device = device
        self.dtype = dtype
        self.eos = set(eos_ids)
        self.timer = timer
        self.iterations = 0  # decoding steps of the batch (one target forward each), summed over calls
        self.widest = 64  # the most nodes a verify forward has had (at least 64): the cache's room per batch

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 gen: torch.Generator | None = None) -> list[RowResult]:
        with Tap(self.target, self.proposer.hidden_layers) as tap:
            return self._generate(prompts, max_new_tokens, gen, tap)

    def _generate(self, prompts, max_new_tokens, gen, tap: Tap) -> list[RowResult]:
        B = len(prompts)
        res = [RowResult() for _ in range(B)]
        live = list(range(B))  # original index of each active row
        s = self.sampling
        cache = RaggedCache(self.target, self.device, self.dtype)
        sync(self.device)
        t0 = time.perf_counter()
        with self.timer.phase("prefill"):
            out = cache.prefill(prompts, room=max_new_tokens + self.widest + 1)
            last = out.logits[:, -1]
            first = greedy_pick(last) if s.greedy else sample(warp(last, s), gen)
            first = first.tolist()
            hidden = None
            if tap.names:  # left-padded prompts: each row's own positions, left-aligned
                lens = torch.tensor([len(p) for p in prompts], device=self.device)
                P = int(lens.max())
                idx = (torch.arange(P, device=self.device)[None] + (P - lens)[:, None]).clamp(max=P - 1)
                hidden = Hidden(tap.take(), torch.ones_like(lens)).gather(idx, lens)
        now = time.perf_counter() - t0
        seqs = [list(p) + [t] for p, t in zip(prompts, first)]
        for b, t in enumerate(first):
            res[b].tokens.append(t)
            res[b].t_first = res[b].t_done = now
            res[b].hit_eos = t in self.eos
        state = BatchState(seqs=seqs, prompt_lens=[len(p) for p in prompts], sampling=s, gen=gen,
                           device=self.device, eos=self.eos, max_new_tokens=max_new_tokens)
        done = [res[b].hit_eos or max_new_tokens <= 1 for b in range(B)]
        with self.timer.phase("prefill"):  # the method's own prefill (a draft model's cache) is prefill too
            self.proposer.start(state, hidden)
        pending = torch.tensor(first, dtype=torch.long, device=self.device)
        pending = self._drop_finished(done, live, state, cache, pending)

        while live:
            self.iterations += 1
            with self.timer.phase("draft"):
                draft = self.proposer.propose(state)
                if draft is not None:
                    draft.check(len(live))
                    draft = self._trim(draft, [max_new_tokens - len(res[b].tokens) for b in live])
            with self.timer.phase("verify"):
                if draft is None:
                    tokens = pending[:, None]
                    depth = torch.zeros_like(tokens)
                    anc = None
                else:
                    tokens = torch.cat([pending[:, None], draft.tokens], dim=1)
                    if draft.is_chain:
                        depth = torch.arange(tokens.shape[1], device=self.device)[None].expand_as(tokens)
                        anc = None
                    else:
                        depth, anc = draft.geometry()
                self.widest = max(self.widest, tokens.shape[1])
                out = cache.forward(tokens, depth, anc)
            with self.timer.phase("accept"):
                v = verify(out.logits, draft, s, gen)
                cache.commit(v.keep, v.counts)
                extra = v.extra.tolist()
                now = time.perf_counter() - t0
                n_cand = draft.accept_mask().sum(1).tolist() if draft is not None else [0] * len(live)
                n_all = [0] * len(live) if draft is None else [draft.n] * len(live) if draft.valid is None \
                    else draft.valid.sum(1).tolist()
                done = []
                for i, b in enumerate(live):
                    r = res[b]
                    new = v.accepted[i] + [extra[i]]
                    room = max_new_tokens - len(r.tokens)
                    for j, t in enumerate(new[:room]):
                        if t in self.eos:
                            new = new[: j + 1]
                            r.hit_eos = True
                            break
                    new = new[:room]
                    r.tokens.extend(new)
                    state.seqs[i].extend(new)
                    r.steps += 1
                    # drafts kept: an EOS or the token budget cuts the rest
                    r.accept_lens.append(min(len(v.accepted[i]), len(new)))
                    r.drafted.append(int(n_cand[i]))
                    r.nodes.append(int(n_all[i]))
                    r.t_done = now
                    done.append(r.hit_eos or len(r.tokens) >= max_new_tokens)
                hidden = Hidden(tap.take(), v.counts).gather(v.keep, v.counts) if tap.names else None
            with self.timer.phase("draft"):  # the method's own work after a step (a drafter's cache) is drafting
                state.logits = out.logits
                self.proposer.update(state, v.accepted, hidden)
                state.logits = None
            with self.timer.phase("accept"):
                pending = self._drop_finished(done, live, state, cache, v.extra)
        sync(self.device)
        return res

    def _trim(self, draft: Draft, room: list[int]) -> Draft | None:
        """A chain never verifies more drafts than the token budget can still take (the
        step's extra token needs one slot)."""
        if draft.n == 0:
            return None
        if not draft.is_chain:
            return draft
        cap = max(room) - 1
        if cap <= 0:
            return None
        if cap < draft.n:
            draft = Draft(tokens=draft.tokens[:, :cap], parents=draft.parents[:, :cap],
                          valid=None if draft.valid is None else draft.valid[:, :cap],
                          q=None if draft.q is None else draft.q[:, :cap], is_chain=True, typical=draft.typical,
                          relaxed=draft.relaxed)
        if min(room) - 1 < draft.n:
            lim = torch.tensor(room, device=self.device)[:, None] - 1
            ok = torch.arange(draft.n, device=self.device)[None] < lim
            draft.valid = ok if draft.valid is None else draft.valid & ok
        return draft

    def _drop_finished(self, done: list[bool], live: list[int], state: BatchState, cache: RaggedCache,
                       pending: torch.Tensor) -> torch.Tensor:
        """Finished rows leave the batch (engine, cache and method); returns the pending
        tokens of the rows that stay."""
        if not any(done):
            return pending
        keep = [i for i, d in enumerate(done) if not d]
        live[:] = [live[i] for i in keep]
        state.seqs[:] = [state.seqs[i] for i in keep]
        state.prompt_lens[:] = [state.prompt_lens[i] for i in keep]
        if keep:
            cache.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
            self.proposer.select_rows(keep)
        return pending[keep]
