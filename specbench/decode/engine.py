"""The one engine every method runs through: prefill, then per step propose -> verify (one
target forward over all draft nodes, tree attention) -> accept -> commit -> update.

``generate`` runs one batch until its last row finishes (``serving.batching=static``: the batch drains).
``serve`` holds up to ``concurrency`` requests in flight (``serving.batching=continuous``): whenever rows
finish, requests that have arrived are prefilled and join the running batch, its cache
(``RaggedCache.add_rows``) and the method (``Proposer.add_rows``).

How joining requests are prefilled (``prefill_chunk``): None, together in one left-padded forward
of their own (``separate``); N, each prompt alone (no padding) in pieces, at most N prompt tokens
between two decoding steps of the rows in flight (``chunked``): a long prompt then never stalls
them for more than one piece, and a short one does not wait for the group's longest."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from specbench.methods.base import BatchState, Proposer
from specbench.devices import to_device
from specbench.decode.tree import Draft, check_parents
from specbench.decode.hidden import Hidden, Tap
from specbench.decode.graphs import GraphCache
from specbench.decode.kv import RaggedCache
from specbench.decode.requests import Request, Requests  # noqa: F401 - the engine's inputs, named here too
from specbench.decode.memory import held_bytes
from specbench.decode.timing import PhaseTimer, sync
from specbench.decode.verify import Sampling, greedy_pick, sample, verify, warp


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)  # generated tokens (EOS included if hit)
    steps: int = 0  # decoding steps (the prefill's first token is not a step)
    accept_lens: list[int] = field(default_factory=list)  # accepted draft tokens per step
    drafted: list[int] = field(default_factory=list)  # candidate nodes proposed per step
    nodes: list[int] = field(default_factory=list)  # draft nodes it ran per step: the verify forward's width n of
    # [B, n + 1], the same for every row (padding and non-candidate nodes included)
    valid_nodes: list[int] = field(default_factory=list)  # of those, its own draft's per step (the rest is padding)
    t_first: float = 0.0  # seconds from the engine's start to the first token
    t_done: float = 0.0  # seconds from the engine's start to the last token
    hit_eos: bool = False
    t_arrival: float = 0.0  # when the request arrived (static: the batch's start)
    t_admit: float = 0.0  # when its prefill began
    chunks: list[float] = field(default_factory=list)  # when each decoding step's tokens came out


@dataclass
class _Fill:
    """A request being prefilled alone, piece by piece (``prefill_chunk``)."""
    req: Request
    res: RowResult
    cache: RaggedCache | None = None
    done: int = 0  # prompt tokens in its cache so far
    hidden: list = field(default_factory=list)  # each piece's tapped layers ({name: [1, n, d]})
    first: int | None = None  # its first token, once the whole prompt is in


@dataclass
class _Batch:
    """The rows in flight and how they are served: each row's request key and result, the
    method's view of them, the shared cache, each row's pending token (picked, not yet in the
    cache)."""
    max_new_tokens: int
    gen: torch.Generator | None
    concurrency: int
    together: bool  # a static batch: its rows start decoding together
    live: list = field(default_factory=list)  # the request key of each row
    res: list = field(default_factory=list)  # their RowResults, row by row
    state: BatchState | None = None
    cache: RaggedCache | None = None
    pending: torch.Tensor | None = None  # [B]
    checked: bool = False  # a draft's values checked (one read, once a batch; then with each verdict)


def _proposers(p: Proposer):
    """``p`` and every proposer it wraps (``Proposer.inner``), depth first."""
    yield p
    for q in p.inner():
        yield from _proposers(q)


class Engine:
    def __init__(self, target, proposer: Proposer, sampling: Sampling, device: torch.device,
                 dtype: torch.dtype, eos_ids: set[int], timer: PhaseTimer, prefill_chunk: int | None = None,
                 graphs=None):
        self.target = target
        self.proposer = proposer
        self.sampling = sampling
        self.device = device
        self.dtype = dtype
        self.eos = set(eos_ids)
        self.timer = timer
        self.iterations = 0  # decoding steps of the batch (one target forward each), summed over calls
        self.harness_s = 0.0  # seconds spent in the caller's on_done (outside every phase), summed over calls
        # the most bytes the caches have held at once: the target's KV cache (its buffers, room included)
        # and the method's own tensors (its drafter's cache, its per-row state: ``decode.memory``)
        self.peak_cache_bytes = 0
        self.widest = 64  # the most nodes a verify forward has had (at least 64): the cache's room per batch
        if prefill_chunk is not None and int(prefill_chunk) < 1:
            raise ValueError(f"prefill_chunk must be a positive number of tokens or None, got {prefill_chunk}")
        self.chunk = None if prefill_chunk is None else int(prefill_chunk)
        self.graphs = graphs  # compile=graphs: the target's GraphPool (decode.graphs), its forwards replayed
        if graphs is not None and self.chunk is not None:
            raise ValueError("compile=graphs prefills whole prompts: leave prefill_chunk unset")

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int,
                 gen: torch.Generator | None = None) -> list[RowResult]:
        """One static batch: every prompt starts together and the batch runs until its last row
        finishes. Results in the prompts' order."""
        out = self.serve(Requests([Request(i, p) for i, p in enumerate(prompts)]), max_new_tokens, gen,
                         concurrency=max(1, len(prompts)), together=True)
        return [out[i] for i in range(len(prompts))]

    @torch.inference_mode()
    def serve(self, requests: Requests, max_new_tokens: int, gen: torch.Generator | None = None,
              concurrency: int = 1, on_done=None, together: bool = False) -> dict:
        """Up to ``concurrency`` requests in flight until ``requests`` is empty; a request joins as
        soon as it has arrived, a row is free and its prompt is prefilled. ``on_done(key, result,
        now)`` hears of each finished request (it may add more), between steps and outside every
        phase; the seconds it takes are summed in ``self.harness_s`` (the caller's work, not ours).
        ``together``: the rows start decoding together once every request taken is prefilled (a
        static batch). Returns {key: RowResult}; ``self.trace`` holds (time, rows in flight, tokens
        emitted) per decoding step."""
        with Tap(self.target, self.proposer.hidden_layers) as tap:
            if self.graphs is not None:
                self.graphs.tap, self.graphs.timer = tap, self.timer
            return self._serve(requests, max_new_tokens, gen, concurrency, on_done, tap, together)

    def _clock(self, t0: float) -> float:
        """Seconds since ``t0`` (the serve's start) less the caller's time in ``on_done`` since then:
        every timestamp the engine records (arrivals, admissions, tokens) is on the engine's own clock."""
        return time.perf_counter() - t0 - (self.harness_s - self._harness0)

    def _pick(self, logits: torch.Tensor, gen) -> torch.Tensor:
        """A prompt's first token from its last position's logits [B, V] (greedy or sampled)."""
        s = self.sampling
        return greedy_pick(logits) if s.greedy else sample(warp(logits, s), gen)

    def _first(self, r: RowResult, t: int, now: float) -> None:
        """Record a request's first token (the prefill's), at ``now``."""
        r.tokens.append(t)
        r.t_first = r.t_done = now
        r.hit_eos = t in self.eos

    def _admit(self, reqs, max_new_tokens, gen, tap, t0):
        """Prefill ``reqs`` in a forward of their own: (cache, first tokens, hidden states of the
        prompts or None, results)."""
        prompts = [r.prompt for r in reqs]
        now = self._clock(t0)
        res = [RowResult(t_arrival=r.arrival, t_admit=now) for r in reqs]
        cache = RaggedCache(self.target, self.device, self.dtype) if self.graphs is None else \
            GraphCache(self.target, self.device, self.dtype, self.graphs)
        with self.timer.phase("prefill"):
            out = cache.prefill(prompts, room=max_new_tokens + self.widest + 1)
            first = self._pick(out.logits[:, -1], gen)
            hidden = None
            if tap.names:  # left-padded prompts: each row's own positions, left-aligned
                lens = torch.tensor([len(p) for p in prompts], device=self.device)
                P = int(lens.max())
                idx = (torch.arange(P, device=self.device)[None] + (P - lens)[:, None]).clamp(max=P - 1)
                hidden = Hidden(tap.take(), lens, [len(p) for p in prompts]).gather(idx, lens, [len(p) for p in prompts])
        firsts = first.tolist()  # waits for the prefill on the device: the first tokens exist from here
        now = self._clock(t0)
        for r, t in zip(res, firsts):
            self._first(r, t, now)
        return cache, first, hidden, res

    def _fill(self, filling: deque, max_new_tokens, gen, tap, t0) -> list[_Fill]:
        """Prefill the requests in ``filling`` (each alone, first come first served) for up to
        ``self.chunk`` prompt tokens in all; returns those whose prompt is now whole (taken out of
        ``filling``), their first token picked."""
        budget, out = self.chunk, []
        with self.timer.phase("prefill"):
            while filling and budget > 0:
                f = filling[0]
                prompt = f.req.prompt
                n = min(budget, len(prompt) - f.done)
                piece = prompt[f.done:f.done + n]
                if f.cache is None:
                    f.res.t_admit = self._clock(t0)
                    f.cache = RaggedCache(self.target, self.device, self.dtype)
                    o = f.cache.prefill([piece], room=len(prompt) - n + max_new_tokens + self.widest + 1)
                else:
                    depth = torch.arange(n, device=self.device)[None]
                    o = f.cache.forward(torch.tensor([piece], device=self.device), depth, None, logits_to_keep=1)
                    f.cache.commit_all()
                if tap.names:
                    f.hidden.append(tap.take())
                f.done += n
                budget -= n
                if f.done == len(prompt):
                    f.first = int(self._pick(o.logits[:, -1], gen)[0])
                    self._first(f.res, f.first, self._clock(t0))
                    out.append(filling.popleft())
        return out

    def _fills_hidden(self, fills: list[_Fill]) -> Hidden | None:
        """The prompts' tapped states of requests prefilled piece by piece, as ``_admit`` gives a
        group's: [B, longest prompt, d] per layer, each row's own from the left."""
        if not fills[0].hidden:
            return None
        lens = [len(f.req.prompt) for f in fills]
        P = max(lens)
        layers = {}
        for name in fills[0].hidden[0]:
            rows = [torch.cat([h[name] for h in f.hidden], dim=1) for f in fills]
            layers[name] = torch.cat([torch.nn.functional.pad(r, (0, 0, 0, P - r.shape[1])) for r in rows])
        return Hidden(layers, torch.tensor(lens, device=self.device), lens)

    def _serve(self, requests, max_new_tokens, gen, concurrency, on_done, tap, together=False) -> dict:
        batch = _Batch(max_new_tokens, gen, concurrency, together)
        self.trace = []
        sync(self.device)
        self._harness0 = self.harness_s
        t0 = time.perf_counter()
        results: dict = {}  # key -> RowResult of every request done
        finished: list = []  # (key, result) of requests done since on_done last heard
        filling: deque = deque()  # requests being prefilled piece by piece (prefill_chunk)
        ready: list = []  # whole prompts waiting for the rest of a static batch (together)
        while True:
            if finished and on_done is not None:  # the caller's work (its next turn) is not ours to time
                sync(self.device)  # the device's queued work is the engine's: done before the caller's starts
                h = time.perf_counter()
                for key, r in finished:
                    on_done(key, r, self._clock(t0))
                self.harness_s += time.perf_counter() - h
            finished.clear()
            free = concurrency - len(batch.live) - len(filling) - len(ready)
            joining = requests.take(free, self._clock(t0)) if free > 0 else []
            if self.chunk is None:
                if joining:
                    sub, first, hidden, new_res = self._admit(joining, max_new_tokens, gen, tap, t0)
                    self._join(batch, joining, [sub], first, hidden, new_res)
                    finished += self._finish(batch, [r.hit_eos or max_new_tokens <= 1 for r in batch.res], results)
                    continue  # more may have arrived, and rows may be free again
            else:
                filling.extend(_Fill(r, RowResult(t_arrival=r.arrival)) for r in joining)  # admitted at its first piece
                if filling:
                    ready += self._fill(filling, max_new_tokens, gen, tap, t0)
                if ready and not (together and filling):
                    fills, ready = ready, []
                    self._join(batch, [f.req for f in fills], [f.cache for f in fills],
                               torch.tensor([f.first for f in fills], device=self.device), self._fills_hidden(fills),
                               [f.res for f in fills])
                    finished += self._finish(batch, [r.hit_eos or max_new_tokens <= 1 for r in batch.res], results)
                if not batch.live and (filling or ready):
                    continue  # no rows to decode between the pieces
            if not batch.live:
                nxt = requests.next_arrival()
                if nxt is None:
                    break
                time.sleep(max(0.0, nxt - (self._clock(t0))))  # idle until the next arrival
                continue
            extra, done = self._step(batch, tap, t0)
            with self.timer.phase("accept"):
                batch.pending = extra
                finished += self._finish(batch, done, results)
        sync(self.device)
        return results

    def _join(self, batch: "_Batch", joining, subs, first, hidden, new_res) -> None:
        """Prefilled requests join the batch (its cache, the method) or start it."""
        new_state = BatchState(seqs=[list(r.prompt) + [t] for r, t in zip(joining, first.tolist())],
                               prompt_lens=[len(r.prompt) for r in joining], sampling=self.sampling, gen=batch.gen,
                               device=self.device, eos=self.eos, max_new_tokens=batch.max_new_tokens,
                               rows=batch.concurrency, graphs=self.graphs)
        room = batch.max_new_tokens + self.widest + 1
        with self.timer.phase("prefill"):  # the method's own prefill (a draft model's cache) is prefill too
            if not batch.live:
                batch.cache, batch.state, batch.pending = subs[0], new_state, first
                if len(subs) > 1:
                    batch.cache.add_rows(*subs[1:], room=room, rows=batch.concurrency, wider=not batch.together)
                self.proposer.start(batch.state, hidden)
            else:
                batch.cache.add_rows(*subs, room=room, rows=batch.concurrency, wider=True)
                batch.state.seqs += new_state.seqs
                batch.state.prompt_lens += new_state.prompt_lens
                batch.pending = torch.cat([batch.pending, first])
                self.proposer.add_rows(new_state, hidden)
        batch.live.extend(r.key for r in joining)
        batch.res.extend(new_res)
        self._held(batch)  # the target's buffers are made at joins

    def _held(self, batch: "_Batch") -> None:
        """Note what the caches hold now (``peak_cache_bytes``): at joins, and before rows leave (a
        method's cache grows from one to the other)."""
        self.peak_cache_bytes = max(self.peak_cache_bytes, batch.cache.nbytes() + held_bytes(self.proposer))

    def _finish(self, batch: "_Batch", done: list[bool], results: dict) -> list:
        """Finished rows leave the batch (engine, cache and method) into ``results``; returns them
        as (key, result)."""
        gone = [(batch.live[i], batch.res[i]) for i, d in enumerate(done) if d]
        if gone:
            self._held(batch)
            keep = [i for i, d in enumerate(done) if not d]
            batch.live[:] = [batch.live[i] for i in keep]
            batch.res[:] = [batch.res[i] for i in keep]
            batch.state.seqs[:] = [batch.state.seqs[i] for i in keep]
            batch.state.prompt_lens[:] = [batch.state.prompt_lens[i] for i in keep]
            if keep:
                batch.cache.select_rows(keep)
                self.proposer.select_rows(keep)
            batch.pending = batch.pending[keep]
        results.update(gone)
        return gone

    def _step(self, batch: "_Batch", tap, t0):
        """One decoding step of the rows in flight: propose, verify, accept, commit, update.
        Returns (each row's pending token, which rows finished)."""
        state, cache, res, max_new_tokens = batch.state, batch.cache, batch.res, batch.max_new_tokens
        self.iterations += 1
        with self.timer.phase("draft"):
            draft = self.proposer.propose(state)
            if draft is not None:
                draft.check(len(res), values=not batch.checked)
                batch.checked = True
                draft = self._trim(draft, [max_new_tokens - len(r.tokens) for r in res])
        with self.timer.phase("verify"):
            tokens, depth, anc = self._nodes(batch.pending, draft)
            self.widest = max(self.widest, tokens.shape[1])
            out = cache.forward(tokens, depth, anc)
        with self.timer.phase("accept"):
            v = verify(out.logits, draft, self.sampling, batch.gen)
        with self.timer.phase("draft"):  # the method's own work after a step (a drafter's cache) is drafting
            state.logits, state.nodes = out.logits, tokens
            state.node_valid = None if draft is None or draft.valid is None else \
                torch.cat([torch.ones_like(draft.valid[:, :1]), draft.valid], dim=1)
            asks = [(p, t) for p in _proposers(self.proposer) if (t := p.host(state)) is not None]
        with self.timer.phase("accept"):
            # the step's one wait for the device: the verdict, what the records say of the draft, and
            # what the method asked for (``Proposer.host``)
            own = () if draft is None else (draft.accept_mask().sum(1), self._valid(draft), draft.bad_parents())
            widths = [t.reshape(len(res), -1).shape[1] for _, t in asks]
            info = v.read(*own, *(t for _, t in asks))
            if draft is not None:
                check_parents(any(r[2] for r in info))
            state.host, at = {}, len(own)
            for (p, _), w in zip(asks, widths):
                state.host[id(p)] = [r[at:at + w] for r in info]
                at += w
            cache.commit(v.keep_ids, v.count_ids)
            done = self._emit(batch, v, info, draft, t0)
            hidden = Hidden(tap.take(), v.counts, v.count_ids).gather(v.keep, v.counts, v.count_ids) \
                if tap.names else None
        with self.timer.phase("draft"):
            self.proposer.update(state, v.accepted, hidden)
            state.logits = state.nodes = state.node_valid = state.host = None
        return v.extra, done

    def _nodes(self, pending: torch.Tensor, draft: Draft | None):
        """The verify forward's nodes [B, n+1] (each row's pending token, then its draft), their
        depths, and the tree's ancestor matrix (None for a chain or no draft)."""
        if draft is None:
            tokens = pending[:, None]
            return tokens, torch.zeros_like(tokens), None
        tokens = torch.cat([pending[:, None], draft.tokens], dim=1)
        if draft.is_chain:
            return tokens, torch.arange(tokens.shape[1], device=self.device)[None].expand_as(tokens), None
        depth, anc = draft.geometry()
        return tokens, depth, anc

    def _valid(self, draft: Draft) -> torch.Tensor:
        """[B] each row's own draft nodes (the rest of the verify width is padding)."""
        if draft.valid is None:
            return torch.full((draft.tokens.shape[0],), draft.n, dtype=torch.long, device=draft.tokens.device)
        return draft.valid.sum(1)

    def _emit(self, batch: "_Batch", v, info: list, draft: Draft | None, t0: float) -> list[bool]:
        """Each row's accepted drafts and extra token into its result and sequence (cut at an EOS
        and at the token budget), and the step's trace; returns which rows finished. ``v`` has been
        read (the tokens exist from here); ``info``: per row its draft's candidates and own nodes."""
        res, max_new_tokens = batch.res, batch.max_new_tokens
        extra = v.extra_ids
        now = self._clock(t0)
        width = 0 if draft is None else draft.n  # every row runs it, whatever it drafted
        n_cand = [0] * len(res) if draft is None else [r[0] for r in info]
        n_valid = [0] * len(res) if draft is None else [r[1] for r in info]
        done = []
        emitted = 0
        for i, r in enumerate(res):
            new = v.accepted[i] + [extra[i]]
            room = max_new_tokens - len(r.tokens)
            for j, t in enumerate(new[:room]):
                if t in self.eos:
                    new = new[: j + 1]
                    r.hit_eos = True
                    break
            new = new[:room]
            r.tokens.extend(new)
            batch.state.seqs[i].extend(new)
            r.steps += 1
            r.accept_lens.append(min(len(v.accepted[i]), len(new)))  # drafts kept: an EOS or the budget cuts the rest
            r.drafted.append(int(n_cand[i]))
            r.nodes.append(width)
            r.valid_nodes.append(int(n_valid[i]))
            r.t_done = now
            r.chunks.append(now)
            emitted += len(new)
            done.append(r.hit_eos or len(r.tokens) >= max_new_tokens)
        self.trace.append((now, len(res), emitted))
        return done

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
            lim = to_device(room, torch.long, self.device)[:, None] - 1
            ok = torch.arange(draft.n, device=self.device)[None] < lim
            draft.valid = ok if draft.valid is None else draft.valid & ok
        return draft
