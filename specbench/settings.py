"""Settings declared as dataclasses, for the run (``specbench.run.schema``) and for each method
(``Proposer.Settings``): a field per key with its type, default and range (``setting``).

Hydra is given ``loose`` nodes (the same keys and defaults, every value typed ``Any``), so it
refuses a key none declares and coerces nothing; ``check_node`` then holds the values to the
declared types strictly (``K=true`` is a boolean and ``K=1.5`` a float, neither an integer here;
``2`` is no boolean) and says what is wrong in one line."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import field
from typing import Any, Literal

from omegaconf import DictConfig, OmegaConf

from specbench.errors import ConfigError, did_you_mean, unknown_key


def setting(default=dataclasses.MISSING, *, lo=None, hi=None, above=None, required_by: tuple = (),
            doc: str | dict = ""):
    """A field with its default (a dataclass or a list: made anew for each config) and its range:
    ``lo`` <= v <= ``hi``, v > ``above``; ``required_by``: the group options (``name``) for which it
    must be given; ``doc``: what it is (per option: a dict)."""
    meta = {"lo": lo, "hi": hi, "above": above, "required_by": required_by, "doc": doc}
    if dataclasses.is_dataclass(default) or isinstance(default, list):
        return field(default_factory=default if dataclasses.is_dataclass(default) else lambda: list(default),
                     metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache  # one class a dataclass: the command line and every job ask again
def loose(tp, extra: tuple = ()):
    """``tp`` as Hydra's node: the same keys and defaults, every setting typed ``Any``
    (``check_node`` holds the types), a field without a default (a config group's) None until
    its option is composed; ``extra``: more keys, None by default."""
    hints, out = typing.get_type_hints(tp), []
    for f in dataclasses.fields(tp):
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub) and f.default_factory is not dataclasses.MISSING:
            node = loose(sub)
            out.append((f.name, node, field(default_factory=node)))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, Any, field(default_factory=f.default_factory)))
        else:
            out.append((f.name, Any, field(default=None if f.default is dataclasses.MISSING else f.default)))
    out += [(k, Any, field(default=None)) for k in extra]
    return dataclasses.make_dataclass(tp.__name__, out)


def optional(tp) -> tuple:
    """(the type inside ``Optional[...]``, True), or (``tp``, False)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def is_a(v, tp) -> bool:
    """``v`` is a ``tp`` strictly: no boolean is a number, no number a boolean."""
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return isinstance(v, str)
    return True


def what(tp, meta: dict, opt: bool) -> str:
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
    return kind + (" or null" if opt else "")


def in_range(v, meta: dict) -> bool:
    lo, hi, above = meta.get("lo"), meta.get("hi"), meta.get("above")
    return (lo is None or v >= lo) and (hi is None or v <= hi) and (above is None or v > above)


def unknown_choice(key: str, v, choices) -> ConfigError:
    choices = [str(c).lower() if isinstance(c, bool) else str(c) for c in choices]  # as the command line writes them
    return ConfigError(f"unknown {key} '{v}';{did_you_mean(v, choices)} choices: {', '.join(choices)}")


def owner(path: str) -> str:
    return f"{path}'s" if path else "top-level"


def check_node(node: DictConfig, schema, prefix: str = "", group: str | None = None, skip: tuple = (),
               whose: str | None = None, moved=None) -> None:
    """Hold ``node`` to the dataclass ``schema``: a key it does not declare (but ``skip``), a missing
    required value, a value not of its type or out of its range raise one ConfigError line.
    ``prefix``: the keys' path as the user writes it (``"slo."``, ``"pld."``); ``group``: the config
    group ``node`` is an option of (its ``name``: the option, for ``required_by``); ``whose``: the
    owner the unknown-key message names (by default the path); ``moved(path, key)``: where a key
    the node lacks is declared instead (a did-you-mean), or None."""
    hints = typing.get_type_hints(schema)
    option = node.get("name") if group else None
    present = set(node.keys())  # `in` says False for a missing (???) value
    keys = [f.name for f in dataclasses.fields(schema)]
    unknown = [k for k in node.keys() if k not in keys and k not in skip]
    if unknown:
        raise unknown_key(prefix + str(unknown[0]), keys, whose or owner(prefix[:-1]),
                          moved=moved(prefix[:-1], str(unknown[0])) if moved else None)
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
            check_node(v, tp, key + ".", f.name, moved=moved)
            continue
        tp, opt = optional(tp)
        if opt and v is None:
            continue
        if typing.get_origin(tp) is Literal:
            if v not in typing.get_args(tp):
                raise unknown_choice(key, v, typing.get_args(tp))
            continue
        if tp is Any:
            continue
        if not is_a(v, tp) or (tp in (int, float) and not in_range(v, meta)):
            raise ConfigError(f"{key} must be {what(tp, meta, opt)}, got {v!r}")
