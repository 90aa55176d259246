"""The method contract. ``MethodSpec``: what a method declares before anything loads;
``Proposer``: what it does at run time. A method only proposes: the engine verifies, accepts,
commits the KV cache and measures. A method never times itself nor writes metrics."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from specbench.decode.tree import Draft
from specbench.decode.verify import Sampling


@dataclass
class BatchState:
    """What the engine shows a method. Rows are the batch's unfinished rows, in order."""

    seqs: list[list[int]]  # prompt + emitted tokens per row; the last one is not in the target cache yet
    prompt_lens: list[int]
    sampling: Sampling
    gen: torch.Generator | None
    device: torch.device
    eos: set[int] = field(default_factory=set)
    extra: dict = field(default_factory=dict)
    # during update(): the target's logits [B, n+1, V] at every node of the step's verify
    # forward (root first), non-candidate nodes included (Lookahead reads its window's here)
    logits: torch.Tensor | None = None
    # during update(): the tokens of that forward's nodes [B, n+1] (root first) and which are real
    # (None: all); what the step verified, whoever drafted it (a wrapped method's members learn too)
    nodes: torch.Tensor | None = None
    node_valid: torch.Tensor | None = None
    # during update(): what each proposer asked to have on the host (``Proposer.host``), by id()
    host: dict | None = None
    max_new_tokens: int = 0  # the most tokens a row emits after its prompt (to size caches once)
    rows: int = 0  # the most rows the batch holds at once (its concurrency; to size caches for joiners)
    # compile=graphs: the target's GraphPool (a drafter's cache made with it replays its forwards:
    # drafters.cache.DrafterCache); None: eager
    graphs: object = None


class MethodSpec:
    """What a method declares, read before anything loads (class-level, each with a default): its
    name and settings, its config checks, the shape of its drafts, what a record calls its draft,
    its vLLM counterpart and the settings that run it on a tiny model."""

    name = "base"
    # its settings: a dataclass with a field `name: str` and a typed field, with its default, per key
    # (`<name>.<key>=...` on the command line); None: it takes none. See specbench.methods.
    Settings = None
    lossless = True  # False for relaxed acceptance rules; recorded with every job
    # target hidden states the method drafts from ("final" = after the final norm, or a
    # decoder layer index); the engine hands them to start() and update() (specbench.decode.hidden)
    hidden_layers: tuple = ()
    # how a GPU cost model prices the method's drafting (``tune.cost``; specbench.analysis.costmodel):
    # "ngram" (lookups on the host, a share of the verify), "eagle" (a one-layer drafter's forward
    # per draft depth on the target's states), None (none modelled: K=auto on a cost model refuses)
    cost_kind: str | None = None

    @classmethod
    def check(cls, cfg, target_config) -> None:
        """Refuse a bad ``cfg.method`` (or draft) in one ``ConfigError`` line, before any
        weights load. ``target_config``: the target's HF config."""

    @classmethod
    def spec_len(cls, cfg, device: torch.device) -> int | None:
        """The speculation length recorded as the job's ``K``: the most draft tokens on one path
        of a step. ``cfg.K`` by default; a method whose drafts take their shape from its own
        settings returns that depth, or None when it has no fixed one."""
        return int(cfg.K)

    @classmethod
    def tune_space(cls, cfg, device: torch.device) -> list[dict]:
        """The settings ``K=auto`` chooses among (``specbench.run.tune``), narrowest first, each a dict
        of config overrides: ``{"K": 3}``, or a tree method's own keys (``{"method.depth": 2}``).
        By default the lengths in ``tune.K`` for a method whose drafts are ``cfg.K`` long (one
        that keeps the default ``spec_len``); [] for one with nothing to size."""
        if cls.spec_len.__func__ is not Proposer.spec_len.__func__:
            return []
        return [{"K": int(k)} for k in (cfg.get("tune") or {}).get("K") or (1, 2, 3, 4, 6, 8)]

    @classmethod
    def reach(cls, cfg, device: torch.device) -> int:
        """How far past a row's committed tokens a verify forward can place a node (the deepest
        node's depth, candidates or not): the run is refused where prompt + max_new_tokens +
        reach + 1 exceeds the model's positions. ``spec_len`` by default."""
        return int(cls.spec_len(cfg, device) or 0)

    @classmethod
    def positions(cls, cfg, target_config) -> int:
        """The positions every model the method runs can take (the target's; a method with a
        draft model of its own also bounds it by the draft's)."""
        from specbench.hf import max_positions

        return max_positions(target_config)

    @classmethod
    def draft_label(cls, cfg) -> str | None:
        """The draft model this job runs, for the record (None: the method has none)."""
        return None

    @classmethod
    def vllm_config(cls, cfg) -> dict | None:
        """``backend=vllm``: the ``speculative_config`` vLLM runs this method with for ``cfg``
        (None: plain decoding). A method vLLM has no counterpart of leaves this as it is, and
        ``backend=vllm`` refuses it, naming those that have one (``specbench.engines.vllm.engine``)."""
        raise NotImplementedError

    @classmethod
    def tiny(cls, target, tokenizer, folder) -> dict:
        """Settings over this method's defaults (``{"K": 3, "method": {...}}``) that run it on a
        tiny random ``target`` (a few-layer HF Llama named ``tiny`` in ``cfg.model``, its word-level
        ``tokenizer``) with nothing downloaded. Every registered method is decoded with them and held
        token-identical to greedy decoding (tests/test_registry.py). Write what they need (a random
        drafter, a datastore) under the folder ``folder``. {} by default: the defaults need nothing."""
        return {}

    @classmethod
    def joins_rows(cls) -> bool:
        """Whether rows can join a running batch: the method says how (``add_rows``) or keeps no
        per-row state (overrides neither ``start`` nor ``select_rows``)."""
        if cls.add_rows is not Proposer.add_rows:
            return True
        return cls.start is Proposer.start and cls.select_rows is Proposer.select_rows


class Proposer(MethodSpec):
    """The runtime protocol: a method is built for a job (``__init__``), then for each batch
    ``start``, then per step ``propose`` and, after the verify, ``update``; rows leave
    (``select_rows``) and join (``add_rows``) a running batch. A method keeps per-row state in its
    ``per_row`` attributes and the base does that bookkeeping; what it learns across requests is in
    its ``learned`` attributes."""

    # attributes holding what the method learns across requests (answers it has seen, statistics
    # of them): the runner snapshots them before its untimed warm-up and restores them after it
    # and at the start of every repeat, so a timed request only benefits from those before it
    learned: tuple = ()
    # attributes holding one entry per batch row (a list, a tensor whose first dimension is the
    # row, or a cache with select_rows(keep) and add_rows(other): drafters.cache.DrafterCache, or
    # DraftRaggedCache for a draft model's): the base's start, add_rows and select_rows keep them
    # from what new_rows makes, so a method with per-row state writes none of that bookkeeping
    per_row: tuple = ()

    def __init__(self, cfg, target, tokenizer, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.target = target
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype

    def modules(self) -> list[torch.nn.Module]:
        """Extra models the method runs. Every call into them counts as model time (``time_s.forward``)
        whatever its entry: their ``forward``, a module they borrow from the target, or a method of
        their own class (DFlash's ``block``, EAGLE's ``step``): ``decode.timing.PhaseTimer.watch``."""
        return []

    def new_rows(self, state: BatchState, hidden=None) -> dict:
        """The ``per_row`` attributes' entries for the rows of ``state`` (a new batch, or rows
        joining one; ``hidden`` as ``start`` gets it): {name: a list or a tensor, one entry a row}."""
        raise NotImplementedError(f"method {self.name} lists per_row attributes but has no new_rows")

    def start(self, state: BatchState, hidden=None) -> None:
        """A new batch was prefilled; ``state.seqs`` hold prompt + first token. ``hidden``
        (a ``specbench.decode.hidden.Hidden``): the prompt tokens' states when asked for. By default the
        ``per_row`` attributes are made anew (``new_rows``) and the wrapped proposers started."""
        if self.per_row:
            for k, v in self.new_rows(state, hidden).items():
                setattr(self, k, v)
        for p in self.inner():
            p.start(state, hidden)

    def propose(self, state: BatchState) -> Draft | None:
        """Return a draft tree per row, or None to take a plain decoding step."""
        return None

    def update(self, state: BatchState, accepted: list[list[int]], hidden=None) -> None:
        """After a step: ``accepted[b]`` are row b's accepted draft tokens; ``state.seqs``
        already hold them plus the extra token. ``hidden``: the states of the tokens just
        committed to the target cache (the step's root and its accepted drafts)."""

    def host(self, state: BatchState) -> torch.Tensor | None:
        """What this method needs on the host after a step, made from the step's ``state.logits`` /
        ``nodes`` / ``node_valid`` (on the device): integers or booleans [B] or [B, k]. The engine
        reads them with the step's verdict, in the step's one wait for the device, and ``update``
        finds them as ``self.host_rows(state)``, a list a row. None (the default): nothing."""
        return None

    def host_rows(self, state: BatchState) -> list[list[int]] | None:
        """During ``update``: this method's ``host`` tensor, read (one list of ints a row). Called
        outside the engine's step (no ``state.host``), it reads ``host(state)`` itself."""
        if state.host is not None and id(self) in state.host:
            return state.host[id(self)]
        t = self.host(state)
        return None if t is None else t.reshape(t.shape[0], -1).tolist()

    def select_rows(self, keep: list[int]) -> None:
        """Finished rows left the batch: keep only the rows at these indices (by default, of the
        ``per_row`` attributes and in the wrapped proposers)."""
        idx = {}  # the rows kept, one index tensor per device (one host-to-device copy each)
        for k in self.per_row:
            v = getattr(self, k)
            if hasattr(v, "select_rows"):  # a cache keeps its own rows
                v.select_rows(keep)
            elif torch.is_tensor(v):
                if v.device not in idx:
                    idx[v.device] = torch.tensor(keep, dtype=torch.long, device=v.device)
                setattr(self, k, v[idx[v.device]])
            else:
                setattr(self, k, [v[i] for i in keep])
        for p in self.inner():
            p.select_rows(keep)

    def add_rows(self, state: BatchState, hidden=None) -> None:
        """Rows joined the running batch (``serving.batching=continuous``), after the rows already there:
        ``state`` holds only the new rows (prompt + first token each, as ``start`` sees a batch),
        ``hidden`` their prompts' states. By default the ``per_row`` attributes get the new rows'
        entries (``new_rows``) and the wrapped proposers the rows; a method that keeps per-row
        state otherwise (overriding ``start`` or ``select_rows``) must extend it here."""
        if not self.joins_rows():
            raise NotImplementedError(f"method {self.name} keeps per-row state but has no add_rows")
        if self.per_row:
            new = self.new_rows(state, hidden)
            for k in self.per_row:
                old = getattr(self, k)
                if hasattr(old, "add_rows"):  # a cache takes the new rows' cache after its own
                    old.add_rows(new[k])
                else:
                    setattr(self, k, torch.cat([old, new[k]]) if torch.is_tensor(old) else list(old) + list(new[k]))
        for p in self.inner():
            p.add_rows(state, hidden)

    def inner(self) -> list["Proposer"]:
        """The proposers this one wraps (combo's members, SAM's fallback): their learning is its too."""
        return []

    def snapshot(self) -> dict:
        """A copy of what the method (and those it wraps) has learned across requests (``learned``)."""
        return {"own": {k: copy.deepcopy(getattr(self, k)) for k in self.learned},
                "inner": [p.snapshot() for p in self.inner()]}

    def restore(self, snap: dict) -> None:
        """Back to a ``snapshot`` (which stays usable again)."""
        for k, v in snap["own"].items():
            setattr(self, k, copy.deepcopy(v))
        for p, s in zip(self.inner(), snap["inner"]):
            p.restore(s)

    def describe(self) -> dict:
        """Method-specific fields recorded with the job."""
        return {}
