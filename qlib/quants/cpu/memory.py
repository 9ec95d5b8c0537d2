"""The engine's memory (Linux, with fallbacks): ``reserve`` (address space taken page by page as
written, on 2 MB pages if asked: the KV cache), ``resident_bytes``, and transparent huge pages
for the weights: ``hugepage_weights`` with ``weights_empty`` / ``weights_copy`` (weights written
on 2 MB pages from the start), ``collapse_hugepages`` (what else is large and resident, moved
onto them after a load); ``trim_heap`` (a load's freed temporaries given back)."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import math
import mmap
from collections.abc import Iterator
from pathlib import Path

import torch

_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE = 2 << 20
_ALIGN = 64  # bytes: each tensor of an arena starts on a cache line
MAP_NORESERVE = 0x4000  # Linux; not in Python's mmap module


def _mapping(nbytes: int, hugepages: bool) -> torch.Tensor:
    """``nbytes`` of reserved address space (an anonymous private ``mmap``, ``MAP_NORESERVE``)
    as a uint8 tensor that keeps the mapping alive; with ``hugepages`` from a 2 MB boundary and
    advised ``MADV_HUGEPAGE`` before anything is written. OSError / ValueError / AttributeError
    where that cannot be done (not Linux; no THP)."""
    pad = _HUGE if hugepages else 0
    mm = mmap.mmap(-1, nbytes + pad, flags=mmap.MAP_PRIVATE | MAP_NORESERVE)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds a reference to the mapping
    start = -whole.data_ptr() % _HUGE if hugepages else 0
    if hugepages:
        mm.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes]


def reserve(shape: tuple[int, ...], dtype: torch.dtype, hugepages: bool = False) -> torch.Tensor:
    """An uninitialized tensor on reserved address space: an anonymous private ``mmap``
    (``MAP_NORESERVE``), so memory is taken page by page as it is first written. The
    tensor keeps the mapping alive (``torch.frombuffer`` holds a reference to it).
    ``hugepages``: 2 MB-aligned and advised ``MADV_HUGEPAGE`` before anything is written,
    so its pages are 2 MB ones (taken 2 MB at a time; ordinary pages where that fails)."""
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    for huge in (True, False) if hugepages else (False,):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            return _mapping(n, huge).view(dtype).view(shape)
    return torch.empty(shape, dtype=dtype)  # not Linux: an ordinary (lazily mapped) allocation


def resident_bytes(t: torch.Tensor) -> int | None:
    """Bytes of ``t``'s storage backed by memory now (``mincore``, Linux), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = t.untyped_storage().data_ptr()
        lo, hi = start & ~(page - 1), start + t.untyped_storage().nbytes()
        pages = (hi - lo + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        if libc.mincore(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), vec) != 0:
            return None
        return sum(b & 1 for b in vec) * page
    except (OSError, AttributeError):
        return None


class _Arena:
    """Tensors carved one after the other from anonymous mappings of ``chunk_bytes`` (reserved,
    not committed: ``MAP_NORESERVE``), 2 MB-aligned and advised ``MADV_HUGEPAGE`` before anything
    is written, so the kernel backs them with 2 MB pages as they are first written. Nothing is
    ever freed here: a chunk's mapping lives as long as a tensor of it does."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, from a 2 MB boundary
        self._used = 0
        self._failed = False  # no mapping could be advised: ordinary memory from then on

    def _new_chunk(self, need: int) -> bool:
        size = max(self.chunk_bytes, -(-need // _HUGE) * _HUGE)
        try:
            self._chunk, self._used = _mapping(size, hugepages=True), 0
        except (AttributeError, OSError, ValueError):  # not Linux, or no THP: ordinary memory
            self._failed = True
            return False
        return True

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialized tensor from the arena, or None (no mapping could be made)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        at = -(-self._used // _ALIGN) * _ALIGN
        if self._chunk is None or at + nbytes > self._chunk.numel():
            if self._failed or not self._new_chunk(nbytes):
                return None
            at = 0
        self._used = at + nbytes
        return self._chunk[at : at + nbytes].view(dtype).view(shape)


_arena: contextvars.ContextVar[_Arena | None] = contextvars.ContextVar("qlib_arena", default=None)


@contextlib.contextmanager
def hugepage_weights(enabled: bool = True, chunk_bytes: int = 256 << 20) -> Iterator[None]:
    """While the block runs, ``weights_empty`` takes its tensors from 2 MB pages (Linux).

    Weights written into memory advised before their first write are on 2 MB pages at once:
    moving 1.2 GB written on 4 KB pages onto them afterwards (``MADV_COLLAPSE``) took 1.6-2.9 s
    here, writing them advised 0.08 s. ``enabled=False``: ordinary allocations."""
    token = _arena.set(_Arena(chunk_bytes) if enabled else None)
    try:
        yield
    finally:
        _arena.reset(token)


def weights_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor for weights kept as long as the model: inside
    ``hugepage_weights``, from its 2 MB pages; else ``torch.empty``."""
    arena = _arena.get()
    t = arena.empty(tuple(shape), dtype) if arena is not None else None
    return t if t is not None else torch.empty(tuple(shape), dtype=dtype)


def weights_copy(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values, contiguous, in ``weights_empty`` memory (for weights kept as long as the
    model: an arena never gives memory back before all of its chunk's tensors are gone)."""
    out = weights_empty(tuple(x.shape), x.dtype)
    out.copy_(x)
    return out


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). A load's temporaries (a weight's converted blocks before they are packed, up to
    tens of MB each) are freed into the heap, which glibc keeps: measured after the 1B NVFP4
    load, 945 MB resident against 694 after the trim, with the same 728 MB of weights."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def collapse_hugepages(min_bytes: int = 4 << 20, min_resident: float = 0.9) -> int:
    """Back this process's large, resident anonymous mappings with 2 MB pages (Linux).

    The prefill streams ~212 MB of bf16 weights and decode ~100 MB of packed
    weights per token: with 4 KB pages every 4 KB is a TLB miss and a page walk.
    For each private anonymous read-write mapping of at least ``min_bytes`` whose
    resident share is at least ``min_resident`` (so mostly-untouched buffers, such
    as the KV cache, are not populated), ``madvise(MADV_HUGEPAGE)`` and
    ``MADV_COLLAPSE`` (Linux 6.1+) its 2 MB-aligned interior. Returns the bytes
    advised; errors (other systems, THP disabled) are ignored: it is only a hint.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        text = Path("/proc/self/smaps").read_text()
    except (OSError, AttributeError):
        return 0
    done = 0
    head: list[str] | None = None
    for line in [*text.splitlines(), "end"]:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            head = fields
            continue
        if not head or not line.startswith("Rss:"):
            continue
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        name = head[5] if len(head) > 5 else ""
        anonymous = name in ("", "[heap]")
        head, rss = None, int(fields[1]) * 1024
        if not anonymous or hi - lo < min_bytes or rss < min_resident * (hi - lo):
            continue
        a, b = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if b - a < _HUGE:
            continue
        if madvise(a, b - a, _MADV_HUGEPAGE) == 0:
            madvise(a, b - a, _MADV_COLLAPSE)  # may fail (busy, old kernel): a hint
            done += b - a
    return done
