"""Tracing-style spans: per-name count, total time and self time.

Code marks regions with ``with span("qmatmul"): ...`` (the names follow
candle's ``tracing`` spans). Nothing is recorded unless a ``SpanRecorder`` is
active, and then a span costs two ``perf_counter_ns`` calls. *Self* time is a
span's time minus the time of the spans entered inside it, as in the seed's
subscriber. On a GPU a span measures the time to enqueue work, not to run it
(pass ``sync=`` to ``SpanRecorder`` to synchronize at every exit instead).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

_active: SpanRecorder | None = None


@dataclass
class SpanStats:
    count: int = 0
    total_ns: int = 0
    self_ns: int = 0

    @property
    def total_ms(self) -> float:
        return self.total_ns / 1e6

    @property
    def self_ms(self) -> float:
        return self.self_ns / 1e6


@dataclass
class SpanRecorder:
    """Collects span statistics while active (``with SpanRecorder() as rec:``)."""

    sync: Callable[[], None] | None = None
    stats: dict[str, SpanStats] = field(default_factory=dict)
    _stack: list[list] = field(default_factory=list)  # [name, start_ns, child_ns]

    def __enter__(self) -> SpanRecorder:
        global _active
        self._previous = _active
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._previous

    def enter(self, name: str) -> None:
        self._stack.append([name, time.perf_counter_ns(), 0])

    def exit(self) -> None:
        if self.sync is not None:
            self.sync()
        name, start, child = self._stack.pop()
        elapsed = time.perf_counter_ns() - start
        s = self.stats.get(name)
        if s is None:
            s = self.stats[name] = SpanStats()
        s.count += 1
        s.total_ns += elapsed
        s.self_ns += elapsed - child
        if self._stack:
            self._stack[-1][2] += elapsed

    def reset(self) -> None:
        self.stats.clear()

    def table(self) -> list[dict]:
        """Rows sorted by self time: name, count, total_ms, self_ms."""
        rows = [
            {"name": n, "count": s.count, "total_ms": s.total_ms, "self_ms": s.self_ms}
            for n, s in self.stats.items()
        ]
        return sorted(rows, key=lambda r: -r["self_ms"])


class _Span:
    __slots__ = ("name", "rec")

    def __init__(self, name: str, rec: SpanRecorder):
        self.name = name
        self.rec = rec

    def __enter__(self) -> None:
        self.rec.enter(self.name)

    def __exit__(self, *exc) -> None:
        self.rec.exit()


_NULL = contextlib.nullcontext()


def span(name: str):
    """A context manager recording ``name`` when a recorder is active; free otherwise."""
    rec = _active
    if rec is None:
        return _NULL
    return _Span(name, rec)


@contextlib.contextmanager
def recording(sync: Callable[[], None] | None = None) -> Iterator[SpanRecorder]:
    """``with recording() as rec:`` shorthand."""
    with SpanRecorder(sync=sync) as rec:
        yield rec
