"""The old top-level package names (``methods``, ``analysis``), kept for one release as aliases of
their homes under ``specbench``: importing one warns once, and each of its submodules is the very
module object of its new home (a plug-in's ``from methods.base import Proposer`` is specbench's)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, old: str, new: str):
        self.old, self.new = old, new
        self._specs: dict = {}

    def _real(self, name: str) -> str:
        return self.new + name[len(self.old):]

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(self.old + "."):
            return None
        real = importlib.util.find_spec(self._real(name))
        if real is None:
            return None
        return importlib.util.spec_from_loader(name, self, origin=real.origin,
                                               is_package=real.submodule_search_locations is not None)

    def create_module(self, spec):
        module = importlib.import_module(self._real(spec.name))
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module) -> None:  # loaded already; the import machinery set its spec to the alias's
        module.__spec__ = self._specs.pop(module.__name__)

    def get_code(self, name):  # `python -m methods.x` runs `specbench.methods.x`
        real = self._real(name)
        return importlib.util.find_spec(real).loader.get_code(real)


def alias(old: str, new: str) -> None:
    """Make the package being imported as ``old`` the package ``new``, and its submodules too."""
    warnings.warn(f"`{old}` is now `{new}`: import it from there (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)
    if not any(isinstance(f, _Alias) and f.old == old for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(old, new))
    sys.modules[old] = importlib.import_module(new)
