"""Registry of speculative-decoding methods: name -> proposer class, imported lazily.

Built-in methods live here: a module ``methods/<name>.py`` beside a yaml
``conf/method/<name>.yaml`` is a method (its class: the ``Proposer`` subclass whose
``name`` is ``<name>``); ``REGISTRY`` names the classes of the first ones explicitly. A
method from another package needs no fork: its package declares an entry point in the group
``specbench.methods`` (``name = "my_pkg.my_module:MyProposer"``), or a run names the class
itself (``method=my_pkg.my_module:MyProposer``). Such a method declares its own settings
(``Proposer.Settings``, a dataclass; or ``Proposer.config_file``, a yaml beside its module),
which ``<name>.<key>=...`` overrides and Hydra checks as it does a built-in method's. A method's
keys are those its settings declare: any other is refused (``check_keys``), never ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from importlib import metadata
from pathlib import Path

from specbench.errors import did_you_mean, unknown_key

GROUP = "specbench.methods"  # the entry-point group of outside methods

REGISTRY: dict[str, str] = {
    "ar": "specbench.methods.ar:AR",
    "pld": "specbench.methods.pld:PromptLookup",
    "leviathan": "specbench.methods.leviathan:Leviathan",
    "medusa": "specbench.methods.medusa:Medusa",
    "eagle": "specbench.methods.eagle:Eagle",
    "specdec": "specbench.methods.specdec:SpecDec",
    "lookahead": "specbench.methods.lookahead:Lookahead",
    "rest": "specbench.methods.rest:Rest",
    "reject": "specbench.methods.reject:Reject",
    "recycle": "specbench.methods.recycle:TokenRecycling",
    "sam": "specbench.methods.sam:SamDecoding",
    "suffix": "specbench.methods.suffix:SuffixDecoding",
    "combo": "specbench.methods.combo:Combo",
}


def found() -> dict[str, str]:
    """Built-in methods beyond ``REGISTRY``: name -> module, for each yaml under conf/method with a
    module of its name here."""
    from specbench.paths import CONF_DIR

    here = Path(__file__).parent
    return {p.stem: f"specbench.methods.{p.stem}" for p in sorted((CONF_DIR / "method").glob("*.yaml"))
            if p.stem not in REGISTRY and (here / f"{p.stem}.py").exists()}


def builtin() -> list[str]:
    """The built-in methods: ``REGISTRY``'s and those found beside their yaml."""
    return sorted({*REGISTRY, *found()})


@functools.cache
def plugins() -> dict[str, str]:
    """Methods other installed packages declare (entry points of ``GROUP``): name -> target.
    A name that shadows a built-in method is refused, not silently taken."""
    out = {}
    for ep in metadata.entry_points(group=GROUP):
        if ep.name in builtin():
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
    if name in REGISTRY:
        return REGISTRY[name]
    here = found()
    if name in here:
        mod = importlib.import_module(here[name])
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
    """The method config node of an outside method (its ``Settings`` dataclass, its
    ``config_file``, or just its name), with ``name`` set to the name it was chosen by."""
    from omegaconf import OmegaConf

    cls = get(name)
    if getattr(cls, "Settings", None) is not None:
        if not dataclasses.is_dataclass(cls.Settings):
            raise KeyError(f"method '{name}': {cls.__name__}.Settings must be a dataclass")
        fields = {f.name for f in dataclasses.fields(cls.Settings)}
        if "name" not in fields:
            raise KeyError(f"method '{name}': {cls.__name__}.Settings needs a field `name: str`")
        node = OmegaConf.structured(cls.Settings)
    elif getattr(cls, "config_file", None):
        path = Path(importlib.import_module(cls.__module__).__file__).parent / cls.config_file
        if not path.exists():
            raise KeyError(f"method '{name}': its config_file {path} does not exist")
        node = OmegaConf.load(path)
    else:
        node = OmegaConf.create({})
    node.name = name
    return node


def defaults(name: str):
    """The method config node a run of ``name`` starts from: a built-in method's yaml, an outside
    method's own settings (``settings``)."""
    from omegaconf import OmegaConf

    from specbench.paths import CONF_DIR

    path = CONF_DIR / "method" / f"{name}.yaml"
    return OmegaConf.load(path) if name in builtin() and path.exists() else settings(name)


def keys(name: str) -> list[str]:
    """The keys method ``name`` declares (those of ``defaults``): the only ones its settings take."""
    return [str(k) for k in defaults(name).keys()]


def check_keys(node, name: str, where: str = "method.") -> None:
    """Refuse, in one line, a key of the settings ``node`` that method ``name`` does not declare
    (``where``: how the settings are reached, for the message)."""
    own = keys(name)
    bad = [k for k in node.keys() if k not in own]
    if bad:
        raise unknown_key(f"{where}{bad[0]}", own, f"{name}'s")


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``'module:Class'`` in this process (for tests; outside packages use
    the entry point group, which every process of a sweep sees)."""
    REGISTRY[name] = target


def member_cfg(cfg, name: str, opts=None, where: str | None = None):
    """``cfg`` with ``method`` replaced by method ``name``'s own settings (``defaults``: its yaml, or an
    outside method's), ``opts`` over them (a key it does not declare is refused; ``where``: how
    ``opts`` are reached, for the message). A member's drafts are taken apart as deterministic
    candidates (``Draft.rows``): ``deterministic_drafts`` tells a method that could sample them not to."""
    from omegaconf import OmegaConf

    conf = defaults(name)
    check_keys(opts or {}, name, where or f"{name}.")
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # not struct: the member's own keys
    out.method = OmegaConf.merge(conf, opts or {})
    out.deterministic_drafts = True
    return out
