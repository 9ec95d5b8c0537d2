"""The host rule: a notebook that measures time runs alone on its host.

Every notebook run (a plain ``suite run``, with or without ``--workers``, and every sweep
point on any executor) holds a lock on a file in the host's temporary folder
(``$QLIB_LOCK_DIR`` to choose another) while its notebook runs: a timing notebook an
exclusive one, any other a shared one (``host_slot``). So on one host, at any time, either
one timing notebook runs and nothing else of any run or sweep, or any number of others do.
The lock is ``flock(2)``'s: the kernel releases it when its process ends, killed or not,
and it needs no configuration.

Which notebooks measure time: their metadata ``{"qlib": {"timing": true}}`` (``false`` to
say not), else ``TIMING_NOTEBOOKS`` (``is_timing``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR_ENV = "QLIB_LOCK_DIR"

# Notebooks whose results are timings (speeds, ms/token, spans): each runs alone on its host.
TIMING_NOTEBOOKS = frozenset(
    {
        "01_generate_one_token",
        "02_forward_spans",
        "03_throughput_vs_context",
        "07_qmatmul_forms",
        "09_speed_vs_pytorch",
        "10_format_zoo",
        "11_gpu_decode_ladder",
    }
)


def is_timing(path: Path) -> bool:
    """Whether the notebook measures time: its metadata ``qlib.timing``, else the registry."""
    import nbformat

    try:
        meta = nbformat.read(str(path), as_version=4).metadata.get("qlib") or {}
    except Exception:
        meta = {}
    if "timing" in meta:
        return bool(meta["timing"])
    return Path(path).stem in TIMING_NOTEBOOKS


def host_name() -> str:
    return platform.node() or socket.gethostname()


def lock_path(host: str | None = None) -> Path:
    base = Path(os.environ.get(LOCK_DIR_ENV) or tempfile.gettempdir())
    return base / f"qlib-suite-{host or host_name()}.lock"


@contextlib.contextmanager
def host_slot(exclusive: bool) -> Iterator[float]:
    """Hold this host's notebook lock: exclusive for a timing notebook, shared otherwise.

    Yields the seconds spent waiting for it. Where ``fcntl`` is missing (Windows), no lock.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield 0.0
        return
    path = lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        t0 = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield round(time.perf_counter() - t0, 2)
    finally:
        os.close(fd)  # releases the lock
