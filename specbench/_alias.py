"""Old names kept for one release as aliases of their new homes: importing one warns, and it is
the very module object of its new home (a plug-in's ``from methods.base import Proposer`` is
specbench's ``Proposer``). The top-level ``methods`` and ``analysis`` (from a checkout: an install
has only ``specbench.methods`` and ``specbench.analysis``), and the modules that moved into
``specbench.decode``, ``specbench.run`` and ``specbench.engines.vllm``, or were renamed there
(``MOVED``)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


class _Renamed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old name as the module of its new name (``_real``); warns when ``warns``."""

    warns = False

    def __init__(self):
        self._specs: dict = {}

    def _real(self, name: str) -> str | None:
        raise NotImplementedError

    def find_spec(self, name, path=None, target=None):
        real_name = self._real(name)
        real = None if real_name is None else importlib.util.find_spec(real_name)
        if real is None:
            return None
        return importlib.util.spec_from_loader(name, self, origin=real.origin,
                                               is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        real = self._real(spec.name)
        if self.warns:
            warnings.warn(f"`{spec.name}` is now `{real}`: import it from there (the old name goes in the next "
                          "release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(real)
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:  # loaded already; the import machinery set its spec to the alias's
        module.__spec__ = self._specs.pop(module.__name__)

    def get_code(self, name):  # `python -m methods.x` runs `specbench.methods.x`
        real = self._real(name)
        return importlib.util.find_spec(real).loader.get_code(real)


class _Alias(_Renamed):
    """The submodules of an old package name (the package itself warned when imported: ``alias``)."""

    def __init__(self, old: str, new: str):
        super().__init__()
        self.old, self.new = old, new

    def _real(self, name: str) -> str | None:
        return self.new + name[len(self.old):] if name.startswith(self.old + ".") else None


# specbench's modules before they were grouped into folders -> where they are now
MOVED = {f"specbench.{old}": f"specbench.{new}" for old, new in {
    "engine": "decode.engine", "kv": "decode.kv", "verify": "decode.verify", "draft": "decode.tree",
    "hidden": "decode.hidden", "timing": "decode.timing", "runner": "run.runner", "measure": "run.measure",
    "validation": "run.validation", "schema": "run.schema", "records": "run.records", "summary": "run.summary",
    "tune": "run.tune", "quality": "run.quality", "data": "run.data", "monitor": "run.monitor",
    "vllm_engine": "engines.vllm.engine", "decode.draft": "decode.tree"}.items()}


class _Moved(_Renamed):
    """The modules of ``MOVED`` under their old names (each warns once, when first imported)."""

    warns = True

    def _real(self, name: str) -> str | None:
        return MOVED.get(name)


def keep_moved_names() -> None:
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.append(_Moved())


def alias(old: str, new: str) -> None:
    """Make the package being imported as ``old`` the package ``new``, and its submodules too."""
    warnings.warn(f"`{old}` is now `{new}`: import it from there (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    if not any(isinstance(f, _Alias) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(old, new))
    sys.modules[old] = importlib.import_module(new)
