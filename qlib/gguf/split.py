"""GGUF models split over several files, as llama.cpp's ``gguf-split`` (and gguf-py's writer
with ``split_max_size``) writes them, and one way to open any model file: ``open_model``;
``shards`` lays a model out over such files for writing.

A model in N shards is N GGUF files named ``PREFIX-00001-of-0000N.gguf`` to
``PREFIX-0000N-of-0000N.gguf``. Each carries ``split.no`` (0 for the first), ``split.count``
(N) and ``split.tensors.count`` (the model's tensors) in its metadata; the first shard holds
the model's metadata, and every shard some of its tensors. As llama.cpp does, the model is
opened by the first shard's path and the others are found by their names. ``open_model`` gives
a ``Content`` whose directory lists every shard's tensors (``SplitContent``) and a file
(``ShardFiles``) through which ``Content.tensor`` reads each tensor from its own shard; a file
that is not split comes back as ``Content.read`` and the (mapped) file give it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..devices import DeviceLike
from ..quants.qtensor import QTensor
from .constants import GGUFError, GGUFValueType, TensorNotFoundError, Typed
from .reader import Content, MappedFile

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
SHARD_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def split_count(content: Content) -> int:
    """How many files the model of ``content`` spans (1 for a file that is not split)."""
    n = content.get(SPLIT_COUNT, 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 99999:
        raise GGUFError(f"{SPLIT_COUNT} = {n!r} is not a shard count (1 to 99999)")
    return n


def shard_paths(first: str | Path, count: int) -> list[Path]:
    """The paths of a split model's ``count`` shards, from its first shard's path."""
    first = Path(first)
    m = SHARD_NAME.match(first.name)
    if m is None:
        raise GGUFError(
            f"{first} is the first of {count} shards of a split model, but its name does not "
            f"follow llama.cpp's PREFIX-00001-of-{count:05d}.gguf, so the others cannot be found"
        )
    prefix = m["prefix"]
    return [first.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


@dataclass(repr=False)
class SplitContent(Content):
    """The ``Content`` of a split model: the first shard's metadata, every shard's tensors.

    ``tensor_infos`` lists them all (their ``offset`` is within their own shard);
    ``tensor`` and ``tensor_bytes`` read a tensor from its shard's file in ``ShardFiles``."""

    shards: list[Content] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    shard_of: dict[str, int] = field(default_factory=dict)

    def _where(self, f: Any, name: str) -> tuple[Content, Any]:
        i = self.shard_of.get(name)
        if i is None:
            raise TensorNotFoundError(f"cannot find tensor info for {name}")
        if not isinstance(f, ShardFiles):
            raise TypeError("a split model's tensors are read through its ShardFiles")
        return self.shards[i], f.files[i]

    def tensor_bytes(self, f: Any, name: str) -> bytearray:
        shard, sf = self._where(f, name)
        return shard.tensor_bytes(sf, name)

    def tensor(self, f: Any, name: str, device: DeviceLike = "cpu") -> QTensor:
        shard, sf = self._where(f, name)
        return shard.tensor(sf, name, device)

    def __repr__(self) -> str:
        return (f"SplitContent({len(self.shards)} shards, {len(self.metadata)} metadata keys, "
                f"{len(self.tensor_infos)} tensors)")  # fmt: skip


class ShardFiles:
    """The open files of a split model's shards, in order (mapped where they can be)."""

    def __init__(self, files: list[MappedFile | BinaryIO]):
        self.files = files

    def release(self) -> None:
        """Drop every shard's mapped pages (``MappedFile.release``)."""
        for f in self.files:
            if isinstance(f, MappedFile):
                f.release()

    def release_view(self, t: torch.Tensor) -> bool:
        """``MappedFile.release_view`` on the shard that ``t`` is a view of."""
        return any(isinstance(f, MappedFile) and f.release_view(t) for f in self.files)


def release_pages(f: Any, view: torch.Tensor | None = None) -> None:
    """Drop the mapped pages of a ``MappedFile`` or of every shard of ``ShardFiles``
    (``view``: only the pages under that view); nothing for any other file."""
    if isinstance(f, (MappedFile, ShardFiles)):
        if view is None:
            f.release()
        else:
            f.release_view(view)


def _merge(first: Content, path: Path, shards: list[Content], paths: list[Path]) -> SplitContent:
    """One ``SplitContent`` from the shards' own, checking that they are one model's."""
    count = len(shards)
    infos, shard_of = {}, {}
    for i, (c, p) in enumerate(zip(shards, paths, strict=True)):
        no, n = c.get(SPLIT_NO), split_count(c)
        if no != i or n != count:
            raise GGUFError(f"{p} says it is shard {no!r} (0-based) of {n}, expected shard {i} "
                            f"of {count}: the files are not one split model")  # fmt: skip
        for name, info in c.tensor_infos.items():
            if name in infos:
                raise GGUFError(f"tensor {name!r} is in both {paths[shard_of[name]]} and {p}")
            infos[name], shard_of[name] = info, i
    expected = first.get(SPLIT_TENSORS)
    if expected is not None and expected != len(infos):
        raise GGUFError(f"{path}: {SPLIT_TENSORS} = {expected}, but the {count} shards hold "
                        f"{len(infos)} tensors")  # fmt: skip
    return SplitContent(first.version, first.metadata, first.metadata_types, infos,
                        first.tensor_data_offset, first.alignment,
                        sum(c.file_size or 0 for c in shards), shards=shards, paths=paths,
                        shard_of=shard_of)  # fmt: skip


def _check_first(content: Content, path: Path) -> int:
    """The shard count of the model whose file ``path`` is; an error for a later shard."""
    count = split_count(content)
    no = content.get(SPLIT_NO, 0)
    if count > 1 and no != 0:
        m = SHARD_NAME.match(path.name)
        first = f"{m['prefix']}-00001-of-{count:05d}.gguf" if m else "its first shard"
        raise GGUFError(f"{path} is shard {no + 1} of {count} of a split model: "
                        f"open the first one, {first}")  # fmt: skip
    return count


def _missing(paths: list[Path]) -> None:
    gone = [p for p in paths if not p.exists()]
    if gone:
        raise GGUFError(f"a split model's shard is missing: {gone[0]} ({len(gone)} of "
                        f"{len(paths)} shards not found)")  # fmt: skip


def read_content(path: str | Path) -> Content:
    """``Content.read_path`` of a model file; for a split model's first shard, the merged
    directory of all its shards (``SplitContent``; nothing is left open)."""
    path = Path(path)
    first = Content.read_path(path)
    count = _check_first(first, path)
    if count == 1:
        return first
    paths = shard_paths(path, count)
    _missing(paths)
    shards = [first] + [Content.read_path(p) for p in paths[1:]]
    return _merge(first, path, shards, paths)


@contextlib.contextmanager
def open_model(
    path: str | Path, *, buffered: bool = True, mmap: bool = True
) -> Iterator[tuple[Content, MappedFile | BinaryIO | ShardFiles]]:
    """Open a model file for reading its tensors: ``(content, f)`` for ``content.tensor(f,
    name)``, every file closed on exit. ``mmap`` (with ``buffered``): the files are mapped
    (``MappedFile``); ``buffered=False`` reads through unbuffered files. A split model, given
    by its first shard, opens all its shards (``SplitContent``, ``ShardFiles``)."""
    path = Path(path)

    def opened(p: Path, stack: contextlib.ExitStack) -> MappedFile | BinaryIO:
        raw = stack.enter_context(open(p, "rb", buffering=-1 if buffered else 0))
        return MappedFile.open(raw) if mmap and buffered else raw

    with contextlib.ExitStack() as stack:
        f = opened(path, stack)
        first = Content.read(f)
        count = _check_first(first, path)
        if count == 1:
            yield first, f
            return
        paths = shard_paths(path, count)
        _missing(paths)
        files = [f] + [opened(p, stack) for p in paths[1:]]
        shards = [first] + [Content.read(sf) for sf in files[1:]]
        yield _merge(first, path, shards, paths), ShardFiles(files)


def tensor_nbytes(t: Any) -> int:
    """The data bytes of a tensor as ``write`` takes it (a ``QTensor``, a float array or
    tensor, or ``(bytes, shape, type)``)."""
    if isinstance(t, tuple):
        t = t[0]
    if isinstance(t, QTensor):
        return t.data.numel()
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return len(t) if isinstance(t, (bytes, bytearray, memoryview)) else int(t.nbytes)


def shards(path: str | Path, metadata: dict[str, Any], tensors: dict[str, Any],
           max_bytes: int) -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:  # fmt: skip
    """A model's files when each holds at most ``max_bytes`` of tensor data (a tensor larger
    than that alone in its file): ``(path, metadata, tensors)`` each, in order. One file is
    ``path`` as it is; N files are ``PREFIX-0000i-of-0000N.gguf`` beside it (``PREFIX``:
    ``path`` without ``.gguf``), the first with the model's metadata, each with ``split.no``,
    ``split.count`` and ``split.tensors.count`` (UINT16, UINT16, INT32, as llama.cpp writes
    them)."""
    if max_bytes <= 0:
        raise ValueError(f"a shard's size limit must be positive, got {max_bytes}")
    groups: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = tensor_nbytes(t)
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    path = Path(path)
    if len(groups) == 1:
        return [(path, metadata, tensors)]
    count = len(groups)
    prefix = path.name.removesuffix(".gguf")
    out = []
    for i, group in enumerate(groups):
        keys = {SPLIT_NO: Typed(GGUFValueType.UINT16, i),
                SPLIT_COUNT: Typed(GGUFValueType.UINT16, count),
                SPLIT_TENSORS: Typed(GGUFValueType.INT32, len(tensors))}  # fmt: skip
        md = {**metadata, **keys} if i == 0 else keys
        out.append((path.with_name(f"{prefix}-{i + 1:05d}-of-{count:05d}.gguf"), md, group))
    return out
