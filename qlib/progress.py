"""Progress bars for long steps (loading a model's layers, compiling the C kernels), shown
only when the step takes longer than ``DELAY_S`` and stderr is a terminal (``QLIB_PROGRESS=1``
forces them on, ``0`` off)."""

from __future__ import annotations

import os
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
    flag = os.environ.get("QLIB_PROGRESS")
    disable = None if flag is None else flag == "0"  # None: on when stderr is a terminal
    yield from tqdm(items, total=total, desc=desc, unit=unit, delay=DELAY_S,
                    disable=disable, leave=False)  # fmt: skip


def layers(items: Iterable[T], total: int, desc: str = "loading layers") -> Iterator[T]:
    """``items`` (a model's layers) with a bar that appears after ``DELAY_S`` seconds."""
    return bar(items, total, desc, "layer")
