"""Progress bars for long steps (loading a model's layers, compiling the C kernels) and a
notice for long single steps (compiling the persistent CUDA kernel), shown only when the step
takes longer than ``DELAY_S`` and stderr is a terminal (``QLIB_PROGRESS=1`` forces them on,
``0`` off)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
DELAY_S = 2.0


def bar(items: Iterable[T], total: int, desc: str, unit: str) -> Iterator[T]:
    """``items`` with a tqdm bar that appears after ``DELAY_S`` seconds."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is a base dependency; a bare interpreter still runs
        yield from items
        return
    switch = _switch()
    disable = None if switch is None else not switch  # None: on when stderr is a terminal
    yield from tqdm(items, total=total, desc=desc, unit=unit, delay=DELAY_S,
                    disable=disable, leave=False)  # fmt: skip


def _switch() -> bool | None:
    """``$QLIB_PROGRESS``: True (1), False (0) or None (unset: on when stderr is a terminal)."""
    flag = os.environ.get("QLIB_PROGRESS")
    return None if flag is None else flag != "0"


@contextlib.contextmanager
def waiting(desc: str) -> Iterator[None]:
    """A block that cannot count its progress: ``desc ...`` on stderr once it has taken
    ``DELAY_S`` seconds, then how long it took."""
    switch = _switch()
    if not (sys.stderr.isatty() if switch is None else switch):
        yield
        return
    start, shown = time.perf_counter(), threading.Event()

    def notice() -> None:
        shown.set()
        print(f"{desc} ...", file=sys.stderr, flush=True)

    timer = threading.Timer(DELAY_S, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if shown.is_set():
            print(f"{desc}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def layers(items: Iterable[T], total: int, desc: str = "loading layers") -> Iterator[T]:
    """``items`` (a model's layers) with a bar that appears after ``DELAY_S`` seconds."""
    return bar(items, total, desc, "layer")
