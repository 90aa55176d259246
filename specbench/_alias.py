"""Old names kept for one release as aliases of their new homes: importing one warns, and it is
the very module object of its new home (a plug-in's ``from methods.base import Proposer`` is
specbench's ``Proposer``). The top-level ``methods`` and ``analysis`` (from a checkout: an install
has only ``specbench.methods`` and ``specbench.analysis``), and the modules that moved into
``specbench.decode``, ``specbench.run`` and ``specbench.engines.vllm`` (``MOVED``)."""

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


# specbench's modules before they were grouped into folders -> where they are now
MOVED = {f"specbench.{old}": f"specbench.{new}" for old, new in {
    "engine": "decode.engine", "kv": "decode.kv", "verify": "decode.verify", "draft": "decode.draft",
    "hidden": "decode.hidden", "timing": "decode.timing", "runner": "run.runner", "measure": "run.measure",
    "validation": "run.validation", "schema": "run.schema", "records": "run.records", "summary": "run.summary",
    "tune": "run.tune", "quality": "run.quality", "data": "run.data", "monitor": "run.monitor",
    "vllm_engine": "engines.vllm.engine"}.items()}


class _Moved(_Alias):
    """The modules of ``MOVED`` under their old names (each warns once, when first imported)."""

    def __init__(self):
        super().__init__("", "")
        self._specs: dict = {}

    def find_spec(self, name, path=None, target=None):
        new = MOVED.get(name)
        if new is None:
            return None
        real = importlib.util.find_spec(new)
        return importlib.util.spec_from_loader(name, self, origin=real.origin, is_package=False)

    def create_module(self, spec):
        warnings.warn(f"`{spec.name}` is now `{MOVED[spec.name]}`: import it from there (the old name goes in the "
                      "next release)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__
        return module

    def get_code(self, name):
        return importlib.util.find_spec(MOVED[name]).loader.get_code(MOVED[name])


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
