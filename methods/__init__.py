"""Registry of speculative-decoding methods: name -> proposer class, imported lazily.

Adding a method = one module here + ``conf/method/<name>.yaml`` + its tests.
"""

from __future__ import annotations

import importlib

REGISTRY: dict[str, str] = {
    "ar": "methods.ar:AR",
    "pld": "methods.pld:PromptLookup",
    "leviathan": "methods.leviathan:Leviathan",
    "medusa": "methods.medusa:Medusa",
    "eagle": "methods.eagle:Eagle",
    "specdec": "methods.specdec:SpecDec",
    "lookahead": "methods.lookahead:Lookahead",
    "rest": "methods.rest:Rest",
    "reject": "methods.reject:Reject",
}


def names() -> list[str]:
    return sorted(REGISTRY)


def get(name: str):
    if name not in REGISTRY:
        raise KeyError(f"unknown method '{name}'; choices: {', '.join(names())}")
    mod, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)


def register(name: str, target: str) -> None:
    """Register ``name`` -> ``'module:Class'`` (for plug-ins and tests)."""
    REGISTRY[name] = target
