"""Where specbench keeps things: the repository's configs, the cache directory, and the lock
that makes one-time work in the cache (a conversion, an index, a kernel build) one process's."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# the configs: inside the package where a wheel ships them, else at the checkout's top
CONF_DIR = next((d for d in (Path(__file__).resolve().parent / "conf", REPO / "conf") if (d / "config.yaml").exists()),
                REPO / "conf")


def cache_dir() -> Path:
    return Path(os.environ.get("SPECBENCH_CACHE", Path.home() / ".cache" / "specbench"))


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path`` (created if needed) across processes: one-time work in
    the cache (a model conversion, a data index) is done by one process while the others
    wait, then find it done."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def group_options(group: str) -> list[str]:
    """The choices of a Hydra config group (``conf/<group>/*.yaml``)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def resolve_path(p) -> str:
    """A relative path that does not exist from the working directory is taken from the
    repository root (shipped checkpoints work from anywhere)."""
    q = Path(str(p)).expanduser()
    if not q.is_absolute() and not q.exists() and (REPO / q).exists():
        return str(REPO / q)
    return str(q) if q.exists() else str(p)
