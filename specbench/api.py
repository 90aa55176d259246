"""The stable surface for a method from another package: import from here, not from the modules
behind it (which may move).

    from specbench.api import BatchState, ConfigError, Draft, Proposer

``Proposer`` is the method contract (``MethodSpec`` its declared half), ``BatchState`` what the
engine shows a method each step, ``Draft`` what a method proposes (``Draft.chain``,
``Draft.from_lists``, ``Draft.from_trees``), ``Sampling`` the job's sampling settings,
``ConfigError`` the one-line refusal of bad settings, ``setting`` a field of ``Settings`` with a
range. docs/adding-a-method.md walks through one.
"""

from specbench.methods.base import BatchState, MethodSpec, Proposer
from specbench.decode.tree import Draft, prefix_tree
from specbench.errors import ConfigError
from specbench.decode.verify import Sampling
from specbench.settings import setting

__all__ = ["BatchState", "ConfigError", "Draft", "MethodSpec", "Proposer", "Sampling", "prefix_tree", "setting"]
