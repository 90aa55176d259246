"""Registry of speculative-decoding methods: name -> proposer class, imported lazily.

One discovery. A built-in method is a module ``methods/<name>.py`` here whose ``Proposer``
subclass has ``name = "<name>"``; a method from another package needs no fork: its package
declares an entry point in the group ``specbench.methods`` (``name = "my_pkg.my_module:MyProposer"``);
and a run may name a class itself (``method=my_pkg.my_module:MyProposer``).

One loader. Every method declares its settings as a dataclass, ``Proposer.Settings`` (a field
``name: str`` and one field a key, typed, with its default). ``settings`` reads it, and ``store``
puts it into Hydra's config store as ``method/<name>``: Hydra refuses a key it does not declare
and a value of the wrong type, ``<name>.<key>=...`` overrides it, and each ``check`` keeps only
what types cannot say (ranges, choices, files).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from importlib import metadata
from pathlib import Path

from specbench.errors import did_you_mean, unknown_key

GROUP = "specbench.methods"  # the entry-point group of outside methods
NOT_METHODS = ("base",)  # modules here that are not a method


def builtin() -> list[str]:
    """The built-in methods: each module here but ``NOT_METHODS`` (its name is the method's)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)])
                  if not m.name.startswith("_") and m.name not in NOT_METHODS)


@functools.cache
def plugins() -> dict[str, str]:
    """Methods other installed packages declare (entry points of ``GROUP``): name -> target.
    A name that shadows a built-in method is refused, not silently taken."""
    out, own = {}, builtin()
    for ep in metadata.entry_points(group=GROUP):
        if ep.name in own:
            raise KeyError(f"package {ep.dist.name if ep.dist else '?'} declares method '{ep.name}', "
                           "the name of a built-in method; rename its entry point")
        out[ep.name] = ep.value
    return out


def is_target(name: str) -> bool:
    """``name`` names a class itself (``module:Class``), not a registered method."""
    mod, colon, cls = name.partition(":")
    return bool(colon and mod and cls.isidentifier())


def names() -> list[str]:
    """The registered methods: built-in and declared by installed packages."""
    return sorted({*builtin(), *plugins()})


def target(name: str) -> str:
    """``module:Class`` of a method name (or of a ``module:Class`` name itself)."""
    if name in builtin():
        try:
            mod = importlib.import_module(f"{__name__}.{name}")
        except ImportError as e:
            raise KeyError(f"method '{name}': cannot import {__name__}.{name} ({type(e).__name__}: {e})") from e
        from specbench.methods.base import Proposer

        own = [c for c in vars(mod).values() if isinstance(c, type) and issubclass(c, Proposer)
               and c.__module__ == mod.__name__ and c.name == name]
        if len(own) != 1:
            raise KeyError(f"method '{name}': {mod.__name__} must define one Proposer subclass with name = "
                           f"'{name}', found {len(own)}")
        return f"{mod.__name__}:{own[0].__name__}"
    if name in plugins():
        return plugins()[name]
    if is_target(name):
        return name
    raise KeyError(f"unknown method '{name}';{did_you_mean(name, names())} choices: {', '.join(names())}, "
                   "or module:Class")


def get(name: str):
    """The proposer class of a method name (built-in, an entry point, or ``module:Class``)."""
    mod, _, cls = target(name).partition(":")
    try:
        obj = getattr(importlib.import_module(mod), cls)
    except (ImportError, AttributeError) as e:
        raise KeyError(f"method '{name}': cannot import {mod}:{cls} ({type(e).__name__}: {e})") from e
    from specbench.methods.base import Proposer

    if not (isinstance(obj, type) and issubclass(obj, Proposer)):
        raise KeyError(f"method '{name}': {mod}:{cls} is not a methods.base.Proposer subclass")
    return obj


def settings(name: str):
    """The method config node a run of ``name`` starts from: its ``Settings`` dataclass's keys and
    defaults (a key it lacks refused; values held to their types by ``check_types``), ``name`` set
    to the name it was chosen by. A method that declares no settings has ``name`` alone."""
    from omegaconf import OmegaConf

    from specbench.settings import loose

    cls = get(name)
    if cls.Settings is None and getattr(cls, "config_file", None):
        raise KeyError(f"method '{name}': {cls.__name__}.config_file is no longer read; declare its settings as a "
                       "Settings dataclass (docs/adding-a-method.md, section 2)")
    if cls.Settings is None:
        node = OmegaConf.create({"name": name})
    elif not dataclasses.is_dataclass(cls.Settings):
        raise KeyError(f"method '{name}': {cls.__name__}.Settings must be a dataclass")
    elif "name" not in {f.name for f in dataclasses.fields(cls.Settings)}:
        raise KeyError(f"method '{name}': {cls.__name__}.Settings needs a field `name: str`")
    else:
        node = OmegaConf.structured(loose(cls.Settings))  # typed Any: check_types holds the types, strictly
    node.name = name
    return node


def keys(name: str) -> list[str]:
    """The keys method ``name`` declares (those of its ``settings``): the only ones it takes."""
    return [str(k) for k in settings(name).keys()]


def store(named=()) -> None:
    """Put every registered method's settings, and those of each ``module:Class`` in ``named``,
    into Hydra's config store as ``method/<name>``: before a config is composed. A method of
    ``named`` that does not import (or is no proposer) raises KeyError with the reason in one line;
    an installed one that is not named and does not import is left out, so it fails no other run."""
    from hydra.core.config_store import ConfigStore

    for name in dict.fromkeys([*names(), *(n for n in named if is_target(n))]):
        try:
            node = settings(name)
        except KeyError:
            if name in named:
                raise
            continue
        ConfigStore.instance().store(group="method", name=name, node=node)


def check_keys(node, name: str, where: str = "method.") -> None:
    """Refuse, in one line, a key of the settings ``node`` that method ``name`` does not declare
    (``where``: how the settings are reached, for the message)."""
    own = keys(name)
    bad = [k for k in node.keys() if k not in own]
    if bad:
        raise unknown_key(f"{where}{bad[0]}", own, f"{name}'s")


def check_types(node, name: str, where: str | None = None) -> None:
    """Hold the settings ``node`` of method ``name`` to the types and ranges its ``Settings`` declares,
    strictly (``2`` is no boolean, ``true`` no integer): one ConfigError line. ``where``: how the
    settings are reached, for the message (``pld.``, by default ``<name>.``)."""
    from specbench.settings import check_node

    cls = get(name)
    if cls.Settings is not None:
        check_node(node, cls.Settings, where or ("method." if is_target(name) else f"{name}."), whose=f"{name}'s")


def member_cfg(cfg, name: str, opts=None, where: str | None = None):
    """``cfg`` with ``method`` replaced by method ``name``'s own settings (``settings``), ``opts``
    over them (a key it does not declare, or a value not of its type, is refused; ``where``: how
    ``opts`` are reached, for the message). A member's drafts are taken apart as deterministic
    candidates (``Draft.rows``): ``deterministic_drafts`` tells a method that could sample them not to."""
    from omegaconf import OmegaConf

    where = where or f"{name}."
    check_keys(opts or {}, name, where)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # not struct: the member's own keys
    out.method = OmegaConf.merge(settings(name), opts or {})
    check_types(out.method, name, where)
    out.deterministic_drafts = True
    return out
