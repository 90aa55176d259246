"""specbench: a benchmark harness for speculative decoding.

The checkout keeps ``methods/``, ``analysis/`` and ``conf/`` at its top (the project's declared
layout); an installed wheel ships them inside this package (pyproject's ``package-dir``). In a
checkout they are ``specbench.methods`` and ``specbench.analysis`` all the same: the finder below
maps those two names to the top-level folders when the package does not hold them itself.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent
_TOP = {f"{__name__}.{n}": _HERE.parent / n for n in ("methods", "analysis")}


class _Checkout(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        folder = _TOP.get(name)
        if folder is None or not (folder / "__init__.py").exists():
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


if not (_HERE / "methods").is_dir() and not any(isinstance(f, _Checkout) for f in sys.meta_path):
    sys.meta_path.append(_Checkout())

from specbench._alias import keep_moved_names  # noqa: E402  (the finders above first)

keep_moved_names()  # specbench.engine, specbench.runner, ...: their old names, for one release
