"""The run config's schema: every setting of conf/config.yaml and of the model, dataset and draft_model
groups, with its type and range, declared once as dataclasses. ``check`` holds a composed config
to it before anything loads, strictly (Hydra reads ``K=true`` as a boolean and ``K=1.5`` as a
float; neither is an integer here; a key none declares is refused, not ignored), and says what is
wrong in one line. A method's own settings (``cfg.method``) are checked by the method
(``Proposer.check``), its keys against its yaml (``methods.check_keys``). The defaults are the configs'
(conf/); the dataclasses hold types and ranges only and are never instantiated."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from omegaconf import DictConfig, OmegaConf

from specbench.kernels import KERNELS
from specbench.errors import ConfigError, did_you_mean, unknown_key
from specbench.models import DTYPES


def setting(*, lo=None, hi=None, above=None, required_by: tuple = (), doc: str | dict = ""):
    """A field with its range: ``lo`` <= v <= ``hi``, v > ``above``; ``required_by``: the
    group options (``name``) for which it must be given; ``doc``: what it is (per option: a dict)."""
    return field(metadata={"lo": lo, "hi": hi, "above": above, "required_by": required_by, "doc": doc})


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
class Slo:
    ttft_ms: Optional[float] = setting(above=0)
    tpot_ms: Optional[float] = setting(above=0)


@dataclass
class Tune:
    K: Any  # a list of integers >= 1: checked in check()
    prompts: int = setting(lo=1)
    tokens: Optional[int] = setting(lo=1)
    reps: int = setting(lo=1)
    cost: Optional[str] = None  # a cost model (analysis.costmodel): checked in check()


@dataclass
class Vllm:
    python: str
    enforce_eager: bool
    max_num_batched_tokens: Optional[int] = setting(lo=1)
    block_size: Optional[int] = setting(lo=1)
    prefix_caching: bool
    kv_cache_gb: float = setting(above=0)
    threads: Any  # a core list such as 0-1 (VLLM_CPU_OMP_THREADS_BIND) or null


@dataclass
class Thinking:  # a model that thinks: its span's tags, each one token of its vocabulary (null: none)
    open: Optional[str]
    close: Optional[str]


@dataclass
class Config:
    model: Model
    dataset: Dataset
    draft_model: DraftModel
    method: Any  # checked by the method
    logger: Any
    accept: Accept
    K: Any  # an integer >= 1 or auto: checked in check()
    bs: int = setting(lo=1)
    batching: Literal["static", "continuous"]
    rate: Any  # inf or a number > 0: checked in check()
    prefill_chunk: Optional[int] = setting(lo=1)
    slo: Slo
    tune: Tune
    thinking: Thinking
    ctx: Optional[int] = setting(lo=1)
    limit: Optional[int] = setting(lo=1)
    max_new_tokens: int = setting(lo=1)
    temperature: float = setting(lo=0)
    top_k: int = setting(lo=0)
    top_p: float = setting(above=0, hi=1)
    seed: int
    dtype: Literal[("auto",) + tuple(DTYPES)]
    device: str
    kernel: Literal[KERNELS]
    backend: Literal["specbench", "vllm"]
    vllm: Vllm
    compile: Any  # true, false or graphs: models.check_compile says so in its own words
    warmup: bool
    repeats: int = setting(lo=1)
    resume: bool
    ar_baseline: Literal["sweep", "any", "paired"]
    results_dir: str
    records: str
    progress: bool


def _is(v, tp) -> bool:
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    return True


def _what(tp, meta: dict, optional: bool) -> str:
    kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a value")
    lo, hi, above = meta.get("lo"), meta.get("hi"), meta.get("above")
    if above is not None and hi is not None:
        kind += f" in ({above}, {hi}]"
    elif lo is not None and hi is not None:
        kind += f" in [{lo}, {hi}]"
    elif lo is not None:
        kind += f" >= {lo}"
    elif above is not None:
        kind += f" > {above}"
    return kind + (" or null" if optional else "")


def _in_range(v, meta: dict) -> bool:
    lo, hi, above = meta.get("lo"), meta.get("hi"), meta.get("above")
    return (lo is None or v >= lo) and (hi is None or v <= hi) and (above is None or v > above)


# Top-level keys an experiment preset carries beside the settings (read by specbench.bench, not by a job).
PRESET_KEYS = ("bench",)


def _type_at(path: str):
    """The schema's type at a dotted ``path`` ("" for the top level), None where it declares none."""
    tp = Config
    for part in path.split(".") if path else ():
        tp = typing.get_type_hints(tp).get(part) if dataclasses.is_dataclass(tp) else None
        if tp is None:
            return None
    return tp


def _optional(tp) -> tuple:
    """(the type inside ``Optional[...]``, True), or (``tp``, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _unknown_choice(key: str, v, choices) -> ConfigError:
    return ConfigError(f"unknown {key} '{v}';{did_you_mean(v, choices)} choices: {', '.join(map(str, choices))}")


def declared(path: str) -> list[str] | None:
    """The keys the schema declares at ``path`` ("" for the top level, ``model``, ``slo``, ...);
    None at a setting it does not describe key by key (a method's, a logger's, a value)."""
    tp = _type_at(path)
    return [f.name for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else None


def check_choice(key: str, values: list[str]) -> None:
    """Refuse, before a sweep starts, a command-line value of ``key`` outside the setting's fixed
    choices (a ``Literal`` of strings): each of ``values``, the items of a comma list. Values in
    Hydra's sweep or interpolation syntax are left to the job's own check."""
    tp, optional = _optional(_type_at(key))
    choices = typing.get_args(tp) if typing.get_origin(tp) is Literal else ()
    if not choices or not all(isinstance(c, str) for c in choices):
        return
    for v in values:
        if any(c in v for c in "()[]{}$") or (optional and v == "null"):
            continue
        if v not in choices:
            raise _unknown_choice(key, v, choices)


def _owner(path: str) -> str:
    return f"{path}'s" if path else "top-level"


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
            raise unknown_key(shown or key, keys, _owner(at), i - len(parts))


def _check_node(node: DictConfig, schema, prefix: str, group: str | None) -> None:
    hints = typing.get_type_hints(schema)
    option = node.get("name") if group else None
    present = set(node.keys())  # `in` says False for a missing (???) value
    keys = [f.name for f in dataclasses.fields(schema)]
    unknown = [k for k in node.keys() if k not in keys and (prefix or k not in PRESET_KEYS)]
    if unknown:
        raise unknown_key(prefix + str(unknown[0]), keys, _owner(prefix[:-1]))
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        if f.name not in present:
            continue
        tp, meta = hints[f.name], f.metadata
        missing = OmegaConf.is_missing(node, f.name)
        v = None if missing else node[f.name]
        if missing or (v is None and group and option in meta.get("required_by", ())):
            if group and option in meta.get("required_by", ()):
                doc = meta.get("doc") or ""
                doc = f" ({doc.get(option) if isinstance(doc, dict) else doc})" if doc else ""
                raise ConfigError(f"{group}={option} needs {key}=<...>{doc}")
            raise ConfigError(f"{key} is required: add {key}=<...>")
        if dataclasses.is_dataclass(tp):
            _check_node(v, tp, key + ".", f.name)
            continue
        tp, optional = _optional(tp)
        if optional and v is None:
            continue
        if typing.get_origin(tp) is Literal:
            if v not in typing.get_args(tp):
                raise _unknown_choice(key, v, typing.get_args(tp))
            continue
        if tp is Any:
            continue
        if not _is(v, tp) or (tp in (int, float) and not _in_range(v, meta)):
            raise ConfigError(f"{key} must be {_what(tp, meta, optional)}, got {v!r}")


def check(cfg: DictConfig) -> None:
    """Hold a composed run config to ``Config``; one ConfigError line for the first setting that
    does not fit (its name, what it must be, what it got)."""
    _check_node(cfg, Config, "", None)
    K = cfg.get("K")
    if K != "auto" and not (_is(K, int) and K >= 1):
        raise ConfigError(f"K must be an integer >= 1, got {K!r} (or auto: sized per method and batch size)")
    ks = (cfg.get("tune") or {}).get("K")
    if ks is not None and not (OmegaConf.is_list(ks) and len(ks) and all(_is(k, int) and k >= 1 for k in ks)):
        raise ConfigError(f"tune.K must be a list of integers >= 1 (the lengths K=auto chooses among), got {ks!r}")
    if (cfg.get("tune") or {}).get("cost") is not None:
        from specbench.analysis import costmodel

        costmodel.resolve(str(cfg.tune.cost))  # one line for a name, a shape or a file it does not know
    acc = cfg.get("accept")
    if acc is not None and acc.get("name") == "synthetic":
        for key, what in (("rates", "one per draft depth"), ("sibling_rates", "a tree's children of rank 2, 3, ...")):
            r = acc.get(key)  # sibling_rates null or absent: the published default (conf/accept/synthetic.yaml)
            rs = list(r) if OmegaConf.is_list(r) else [r]
            if (key == "rates" or r is not None) and not (rs and all(_is(x, float) and 0 <= x <= 1 for x in rs)):
                raise ConfigError(f"accept.{key} must be a probability in [0, 1] or a non-empty list of them ({what}), "
                                  f"got {OmegaConf.to_container(r) if OmegaConf.is_list(r) else r!r}")
    rate = cfg.get("rate", "inf")
    if not (str(rate).lower() in ("inf", "infinity") or (isinstance(rate, (int, float)) and not isinstance(rate, bool)
                                                         and rate > 0)):
        raise ConfigError(f"rate must be inf or a number of requests per second > 0, got {rate!r}")
    if cfg.get("batching", "static") == "static" and str(rate).lower() not in ("inf", "infinity"):
        raise ConfigError("rate applies to batching=continuous (requests arriving while others run); "
                          "add batching=continuous")

