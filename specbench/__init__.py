"""specbench: a benchmark harness for speculative decoding.

The checkout keeps ``methods/``, ``analysis/`` and ``conf/`` at its top (the project's declared
layout); the package installs them as ``specbench.methods``, ``specbench.analysis`` and
``specbench.conf`` (pyproject's ``package-dir``), from a checkout as an editable install
(``make setup``) and from a wheel as files inside the package.
"""

__version__ = "0.1.0"
