"""The run config's schema: every top-level setting (``Config``: its type, range, default and what
it is) and those of the model, dataset, draft_model and accept groups (types and ranges; their
defaults are their options' yaml in conf/), declared once as dataclasses (``specbench.settings``).
``store`` puts ``Config`` into Hydra's config store as the base conf/config.yaml composes on, so
Hydra refuses a key none declares; ``check`` holds a composed config to the types, strictly, in one
line. A method's own settings (``cfg.method``) are its ``Settings`` dataclass's, held to their
types by ``methods.check_types`` and to what types cannot say by the method (``Proposer.check``)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional

from omegaconf import DictConfig, OmegaConf

from specbench.kernels import KERNELS
from specbench.errors import ConfigError, unknown_key
from specbench.models import DTYPES
from specbench.settings import check_node, is_a, loose, optional, owner, setting, unknown_choice


@dataclass
class Model:
    name: str
    package: Optional[str]
    file: Optional[str]
    path: Optional[str] = setting(required_by=("hf",), doc="a hub id or a local folder")
    chat: bool
    attn_implementation: Optional[str]
    shape: Optional[str] = setting(required_by=("random",), doc="a shape of specbench/shapes")
    logit_std: Optional[float] = setting(above=0)
    tokenizer: Optional[str]


@dataclass
class Dataset:
    name: str
    path: Optional[str] = setting(required_by=("jsonl", "hf", "spec_bench", "speed_bench"), doc={
        "jsonl": "a .jsonl file of questions", "hf": "a hub id, a save_to_disk folder or parquet/json/jsonl/csv files",
        "spec_bench": "Spec-Bench's data/spec_bench/question.jsonl", "speed_bench": "a folder of SPEED-Bench's splits"})
    max_turns: Optional[int] = setting(lo=1)
    order: Literal["file", "categories"]
    language: Optional[str]
    split: Optional[str] = setting(required_by=("speed_bench",), doc="qualitative or throughput_1k|2k|8k|16k|32k")
    config: Optional[str]  # dataset=hf: the hub data set's config (load_dataset's name)
    revision: Optional[str]  # a hub data set's revision (commit, tag, branch)
    prompt: Optional[str]  # dataset=hf: the column of one-turn prompts ...
    turns: Optional[str]  # ... or of lists of turns
    id: Optional[str]  # ... of question ids
    category: Optional[str]  # ... of categories
    categories: Any  # only these categories (a name or a list of names; null: all): checked on loading
    cache_dir: Optional[str]  # datasets' cache (null: its default, HF_DATASETS_CACHE)


@dataclass
class DraftModel:
    name: str
    label: Optional[str]
    path: Optional[str] = setting(required_by=("hf",), doc="a hub id, a local folder or a trained checkpoint")
    layers: Optional[int] = setting(lo=1)


@dataclass
class Accept:
    name: Literal["exact", "synthetic"]
    rates: Any  # a probability or a list of them, required by synthetic: checked in check()
    sibling_rates: Any  # synthetic: the same, for a tree's children of rank 2, 3, ...: checked in check()


@dataclass
class Slo:  # goodput: requests per second whose TTFT and TPOT stay under these (null = no bound)
    ttft_ms: Optional[float] = setting(None, above=0)
    tpot_ms: Optional[float] = setting(None, above=0)


@dataclass
class Sampling:  # how tokens are drawn (decode.verify.Sampling.of reads the node whole)
    temperature: float = setting(0.0, lo=0)  # 0 = greedy
    top_k: int = setting(0, lo=0)
    top_p: float = setting(1.0, above=0, hi=1)


@dataclass
class Serving:  # how requests arrive and are batched (run.workload.Serving.of reads the node whole)
    batching: Literal["static", "continuous"] = "static"  # static: bs prompts start together and the batch drains; continuous: bs requests stay in flight, the next joins as a row finishes
    rate: Any = "inf"  # serving.batching=continuous: requests arriving per second (Poisson, seeded); inf = all at once. Checked in check()
    prefill_chunk: Optional[int] = setting(None, lo=1)  # null: prompts joining together prefilled in one left-padded forward; N: each alone, N tokens between decoding steps
    slo: Slo = setting(Slo)


@dataclass
class Tune:  # K=auto: each setting the method lists is piloted (untimed) on held-out questions (the ones after limit)
    K: Any = setting([1, 2, 3, 4, 6, 8])  # the lengths a chain method chooses among (tree methods list their own sizes): checked in check()
    prompts: int = setting(8, lo=1)  # held-out questions piloted (first turns, each at least once, in batches of bs rows)
    tokens: Optional[int] = setting(None, lo=1)  # new tokens per pilot row (null: the job's max_new_tokens; acceptance grows along an answer)
    reps: int = setting(3, lo=1)  # forwards per profiled cost point (median)
    cost: Optional[str] = None  # price on a GPU cost model instead of profiling here: specdecode-bench-h100, <gpu>:<model>, a fitted .json (analysis.costmodel; checked in check())


@dataclass
class Vllm:  # backend=vllm: its settings that change the numbers (recorded; in the AR pairing key)
    python: str = ".venv-vllm/bin/python"  # the interpreter of vLLM's environment (make setup-vllm)
    enforce_eager: bool = True  # false: vLLM compiles its model (torch.compile; minutes more per engine start on 2 cores)
    max_num_batched_tokens: Optional[int] = setting(None, lo=1)  # tokens per scheduler step (null: vLLM's default; it chunks longer prefills)
    block_size: Optional[int] = setting(None, lo=1)  # KV cache block size (null: vLLM's default)
    prefix_caching: bool = False  # vLLM's prefix cache (false: every prompt prefilled, as our engine does)
    kv_cache_gb: float = setting(2, above=0)  # KV cache per engine, GiB (CPU: VLLM_CPU_KVCACHE_SPACE)
    threads: Any = None  # CPU cores its engine binds (VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1); null = all


@dataclass
class Thinking:  # a model that thinks: acceptance inside and outside its thinking span (metrics.acceptance_by.thinking)
    open: Optional[str] = "<think>"  # the tags, each one token of the tokenizer's vocabulary; a tokenizer with neither: no split
    close: Optional[str] = "</think>"


@dataclass
class Config:
    """The run's settings (`python -m specbench key=value`): each with its type, range and default.
    The groups (model, dataset, draft_model, method, logger, accept) come from conf/ and the
    methods' own settings; conf/config.yaml picks their defaults."""

    model: Model
    dataset: Dataset
    draft_model: DraftModel
    method: Any  # checked by the method
    logger: Any
    accept: Accept
    K: Any = 4  # speculation length (draft tokens per step); ignored by ar. auto: sized per method and batch size (tune). Checked in check()
    bs: int = setting(1, lo=1)  # batch size: prompts decoded together (serving.batching=continuous: requests in flight)
    sampling: Sampling = setting(Sampling)
    serving: Serving = setting(Serving)
    tune: Tune = setting(Tune)
    thinking: Thinking = setting(Thinking)
    ctx: Optional[int] = setting(None, lo=1)  # null = natural prompts; N = every prompt exactly N tokens (first turns only)
    limit: Optional[int] = setting(8, lo=1)  # first N questions of the dataset (null = all; MT-Bench: one per category)
    max_new_tokens: int = setting(64, lo=1)  # per turn (the default sweep stays under ~5 min on 2 CPU cores)
    seed: int = 0  # arrivals, sampling, pilots
    dtype: Literal[("auto",) + tuple(DTYPES)] = "auto"  # auto = fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto = cuda when there is one, else cpu
    kernel: Literal[KERNELS] = "auto"  # linear layers (target and drafters), specbench.kernels: auto = native on an AVX2 CPU (own kernels + fused Llama layers), else onednn (prepacked), torch on GPU
    backend: Literal["specbench", "vllm"] = "specbench"  # specbench: this engine; vllm: vLLM's engine on the same prompts and token ids, same records (make setup-vllm; docs/vllm.md)
    vllm: Vllm = setting(Vllm)
    compile: Literal[False, True, "graphs"] = False  # true: torch.compile the target's forward (dynamic shapes); graphs: its decode/verify forwards captured at static shapes (CUDA graphs on a GPU; fullgraph compile on the CPU); both in the untimed warm-up, kernel=torch. models.check_compile says what it takes
    warmup: bool = True  # one short untimed generation before each timed job
    repeats: int = setting(1, lo=1)  # N: time the whole prompt set N times per job (error bars then resample repeats x batches)
    resume: bool = False  # true: skip jobs whose ok record (same settings, machine and code) exists; AR pairs across sweeps
    ar_baseline: Literal["sweep", "any", "paired"] = "paired"  # speedup against: paired = AR run by each job, taking turns with the method batch by batch (survives a drifting host or another process); sweep = an AR job of this sweep (run once, if missing); any = any matching AR record
    results_dir: str = "results"
    records: str = "${results_dir}/records.jsonl"
    progress: bool = True


# Top-level keys an experiment preset carries beside the settings (read by specbench.bench, not by a job).
PRESET_KEYS = ("bench",)
BASE = "specbench_config"  # Config's name in Hydra's config store (conf/config.yaml's first default)


def store(named=()) -> None:
    """Put ``Config`` into Hydra's config store as conf/config.yaml's base, and every method's settings
    as ``method/<name>`` (``methods.store``; ``named``: the methods a command line names), before a
    config is composed."""
    from hydra.core.config_store import ConfigStore

    from specbench import methods

    ConfigStore.instance().store(name=BASE, node=loose(Config, extra=PRESET_KEYS))
    methods.store(named)


def _type_at(path: str):
    """The schema's type at a dotted ``path`` ("" for the top level), None where it declares none."""
    tp = Config
    for part in path.split(".") if path else ():
        tp = typing.get_type_hints(tp).get(part) if dataclasses.is_dataclass(tp) else None
        if tp is None:
            return None
    return tp


def declared(path: str) -> list[str] | None:
    """The keys the schema declares at ``path`` ("" for the top level, ``model``, ``slo``, ...);
    None at a setting it does not describe key by key (a method's, a logger's, a value)."""
    tp = _type_at(path)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else None


def declared_at(key: str) -> bool:
    """Whether the schema declares the dotted ``key`` (a setting or a node of settings)."""
    return _type_at(key) is not None


def check_value(key: str, values: list) -> None:
    """Refuse, before a sweep starts, a command-line value of the top-level setting ``key`` (dotted)
    that its declared type, range or choices do not take, in one line: each of ``values`` (as
    Hydra parsed them). A node of settings set whole (``serving=continuous``) is refused too;
    a config group's choice is the command line's to check, and settings no dataclass describes
    (a logger's) are left to the job."""
    parent, _, name = key.rpartition(".")
    tp = _type_at(parent)
    if not dataclasses.is_dataclass(tp) or name not in declared(parent):
        return
    if dataclasses.is_dataclass(typing.get_type_hints(tp)[name]):
        raise ConfigError(f"{key} holds settings, not a value: set {key}.<key>=... ({', '.join(declared(key))})")
    for v in values:
        check_node(OmegaConf.create({name: v}), tp, prefix=f"{parent}." if parent else "")


def moved(path: str, name: str) -> str | None:
    """The dotted key of a setting ``name`` that ``path``'s node lacks but one node below it
    declares (a node of defaults, not a group: ``temperature`` -> ``sampling.temperature``, ``slo``
    -> ``serving.slo``), when exactly one does; None otherwise."""
    tp, found = _type_at(path), []

    def walk(node, at: str, below: bool) -> None:
        hints = typing.get_type_hints(node)
        for f in dataclasses.fields(node):
            if below and f.name == name:
                found.append(at + f.name)
            if dataclasses.is_dataclass(hints[f.name]) and f.default_factory is not dataclasses.MISSING:
                walk(hints[f.name], f"{at}{f.name}.", True)

    if dataclasses.is_dataclass(tp):
        walk(tp, f"{path}." if path else "", False)
    return found[0] if len(found) == 1 else None


def check_key(key: str, shown: str | None = None) -> None:
    """Refuse a dotted ``key`` (as a command line sets it) that the schema does not declare, in
    one line with the declared keys; ``shown``: the key as the user wrote it."""
    parts = key.split(".")
    for i, part in enumerate(parts):
        at = ".".join(parts[:i])
        keys = declared(at)
        if keys is None:
            return
        if part not in keys:
            raise unknown_key(shown or key, keys, owner(at), i - len(parts), moved(at, part))


def check(cfg: DictConfig) -> None:
    """Hold a composed run config to ``Config``; one ConfigError line for the first setting that
    does not fit (its name, what it must be, what it got)."""
    check_node(cfg, Config, skip=PRESET_KEYS, moved=moved)
    K = cfg.get("K")
    if K != "auto" and not (is_a(K, int) and K >= 1):
        raise ConfigError(f"K must be an integer >= 1, got {K!r} (or auto: sized per method and batch size)")
    ks = (cfg.get("tune") or {}).get("K")
    if ks is not None and not (OmegaConf.is_list(ks) and len(ks) and all(is_a(k, int) and k >= 1 for k in ks)):
        raise ConfigError(f"tune.K must be a list of integers >= 1 (the lengths K=auto chooses among), got {ks!r}")
    if (cfg.get("tune") or {}).get("cost") is not None:
        from specbench.analysis import costmodel

        costmodel.resolve(str(cfg.tune.cost))  # one line for a name, a shape or a file it does not know
    acc = cfg.get("accept")
    if acc is not None and acc.get("name") == "synthetic":
        for key, what in (("rates", "one per draft depth"), ("sibling_rates", "a tree's children of rank 2, 3, ...")):
            r = acc.get(key)  # sibling_rates null or absent: the published default (conf/accept/synthetic.yaml)
            rs = list(r) if OmegaConf.is_list(r) else [r]
            if (key == "rates" or r is not None) and not (rs and all(is_a(x, float) and 0 <= x <= 1 for x in rs)):
                raise ConfigError(f"accept.{key} must be a probability in [0, 1] or a non-empty list of them ({what}), "
                                  f"got {OmegaConf.to_container(r) if OmegaConf.is_list(r) else r!r}")
    srv = cfg.get("serving") or {}
    rate = srv.get("rate", "inf")
    if not (str(rate).lower() in ("inf", "infinity") or (isinstance(rate, (int, float)) and not isinstance(rate, bool)
                                                         and rate > 0)):
        raise ConfigError(f"serving.rate must be inf or a number of requests per second > 0, got {rate!r}")
    if srv.get("batching", "static") == "static" and str(rate).lower() not in ("inf", "infinity"):
        raise ConfigError("serving.rate applies to serving.batching=continuous (requests arriving while others run); "
                          "add serving.batching=continuous")

