"""Drafters as their authors publish them, loaded strictly: a checkpoint whose keys do not match
its declared format, or whose shapes do not fit the target, is refused in one line naming what is
missing and what is unexpected (the reference loaders' ``strict=False`` hides partial loads).

One module a format family, each with ``NAMES`` (the formats it reads), ``detect(folder)``,
``check(folder, target_config)``, ``load(folder, target, device, dtype)`` and ``save``; ``FORMATS``
is their registry, in the order ``detect`` asks them. A new format is a module here and a line in
``FORMATS``."""

from __future__ import annotations

import json
from pathlib import Path

from specbench.drafters.formats import dflash, eagle1, eagle3, medusa, mtp, peagle
from specbench.drafters.formats.common import FormatError

FORMATS = (medusa, dflash, peagle, mtp, eagle3, eagle1)  # detection order: a speculators folder also has eagle1's keys
BY_NAME = {name: mod for mod in FORMATS for name in mod.NAMES}


def detect(folder) -> str | None:
    """The published format of ``folder``: ``medusa1``, ``medusa2``, ``eagle1`` (EAGLE-1 and EAGLE-2
    ship one layout), ``eagle3``, ``dflash`` (Z Lab's), ``deepspec`` (DeepSeek's DFlash and DSpark),
    ``speculators-<algorithm>`` (vLLM's format; ``speculators-eagle3``, ``-dflash``, ``-dspark`` and
    ``-peagle`` and ``-mtp`` are read), ``native-mtp`` (a target checkpoint with its MTP module); None: not a published drafter."""
    return next((f for f in (mod.detect(folder) for mod in FORMATS) if f is not None), None)


def module(fmt: str):
    """The module that reads format ``fmt``."""
    try:
        return BY_NAME[fmt]
    except KeyError:
        raise FormatError(f"no reader for the published format '{fmt}'; specbench reads "
                          f"{', '.join(BY_NAME)}") from None


def check(fmt: str, folder, target_config):
    return module(fmt).check(folder, target_config)


def load(fmt: str, folder, target, device, dtype):
    return module(fmt).load(folder, target, device, dtype)


def named_trees(method: str) -> dict[str, list[list[int]]]:
    """The candidate trees ``method``'s authors published, by name (``trees/<method>.json``, made by
    ``tests/fixtures/make_trees.py`` from their repository): each path a list of top-k ranks, one
    per depth. Medusa's and EAGLE-1's share a name (``mc_sim_7b_63``) but are different trees."""
    return json.loads((Path(__file__).parent.parent / "trees" / f"{method}.json").read_text())["trees"]


__all__ = ["FORMATS", "FormatError", "check", "detect", "load", "module", "named_trees"]
