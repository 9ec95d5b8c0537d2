"""Read GGUF files, as candle's ``quantized::gguf_file`` does.

A GGUF file is a header (magic ``GGUF``, version, tensor count, metadata
count), typed key/value metadata, a tensor directory (name, dims, ggml type,
offset) and, after padding to ``general.alignment`` (default 32), the tensor
data. ``Content.read`` parses everything but the data; ``Content.tensor``
seeks to one tensor and loads it as a ``QTensor``; ``write`` produces a file
that llama.cpp and gguf-py read.

Differences from candle 0.11.0, all on malformed input: corrupt files fail
with a ``GGUFError`` naming the problem and where it is; strings keep their
exact bytes (invalid UTF-8 survives as surrogate escapes, trailing NULs are
kept) so that ``write(read(f))`` reproduces a file byte for byte; duplicate
keys or tensor names, a ``general.alignment`` that is not a positive power
of two, tensor data offsets that are not multiples of the alignment (as
llama.cpp) and tensors whose data overlap are errors; v1 files are refused.
"""

from __future__ import annotations

import io
import mmap
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import torch

from ..devices import DeviceLike, as_device
from ..quants.qtensor import QTensor
from ..quants.types import GGMLType, ggml_type
from .constants import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    LEN_PREFIX,
    MAX_ARRAY,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_KV,
    MAX_STRING,
    MAX_TENSORS,
    NUMERIC_DTYPES,
    READ_CHUNK,
    SCALAR_STRUCTS,
    SUPPORTED_VERSIONS,
    U32,
    U64,
    VT,
    GGUFError,
    GGUFValueType,
    Spec,
    TensorNotFoundError,
    spec_name,
)


@dataclass(frozen=True)
class TensorInfo:
    """A tensor directory entry: ``shape`` in torch order, ``offset`` from the data start."""

    name: str
    dtype: GGMLType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(repr=False)
class Content:
    """What ``Content.read`` finds in a GGUF file: metadata and the tensor directory."""

    version: int
    metadata: dict[str, Any]
    metadata_types: dict[str, Spec]
    tensor_infos: dict[str, TensorInfo]
    tensor_data_offset: int
    alignment: int = DEFAULT_ALIGNMENT
    file_size: int | None = field(default=None)

    @classmethod
    def read(cls, f: BinaryIO) -> Content:
        """Parse header, metadata and tensor directory from ``f`` (raw or buffered); no data."""
        return _read_content(f)

    @classmethod
    def read_path(cls, path: str | os.PathLike, buffering: int = -1) -> Content:
        """``Content.read`` on a file opened by path (``buffering=0``: raw, unbuffered)."""
        with open(path, "rb", buffering=buffering) as f:
            return cls.read(f)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` when the key is absent."""
        return self.metadata.get(key, default)

    def tensor_bytes(self, f: BinaryIO, name: str) -> bytearray:
        """The raw block bytes of tensor ``name``, read from ``f``."""
        info = self.tensor_infos.get(name)
        if info is None:
            raise TensorNotFoundError(f"cannot find tensor info for {name}")
        start = self.tensor_data_offset + info.offset
        size = _file_size(f)
        if size is not None and start + info.nbytes > size:
            raise GGUFError(_outside_msg(info, self.tensor_data_offset, size))
        try:
            f.seek(start)
        except (OverflowError, OSError, ValueError) as e:
            raise GGUFError(
                f"tensor {name!r}: cannot seek to its data at offset {start}: {e}"
            ) from None
        where = lambda: f"tensor data of {name!r}"  # noqa: E731
        if size is None:  # unknown size: grow with the data, never trust nbytes
            return _read_growing(f, info.nbytes, where, start)
        buf = bytearray(info.nbytes)
        _readinto_exact(f, buf, where, start)
        return buf

    def tensor(self, f: BinaryIO, name: str, device: DeviceLike = "cpu") -> QTensor:
        """Load tensor ``name`` from ``f`` as a ``QTensor`` on ``device``.

        From a ``MappedFile`` a CPU tensor is a view of the mapped file (no copy: its pages
        are read from the page cache when first touched); any other file is read."""
        info = self.tensor_infos.get(name)
        if info is None:
            raise TensorNotFoundError(f"cannot find tensor info for {name}")
        dev = as_device(device)
        if isinstance(f, MappedFile):
            start = self.tensor_data_offset + info.offset
            if start + info.nbytes > f.size:
                raise GGUFError(_outside_msg(info, self.tensor_data_offset, f.size))
            data = f.view(start, info.nbytes)
            if dev.type != "cpu":  # copied to the device: the mapped pages are not needed
                data = data.to(dev)
                f.release()
            return QTensor(data, info.shape, info.dtype)
        data = torch.frombuffer(self.tensor_bytes(f, name), dtype=torch.uint8)
        return QTensor(data.to(dev), info.shape, info.dtype)

    def __repr__(self) -> str:
        return (
            f"Content(version={self.version}, {len(self.metadata)} metadata keys, "
            f"{len(self.tensor_infos)} tensors, data at {self.tensor_data_offset}, "
            f"alignment={self.alignment})"
        )


# ----------------------------------------------------------------------------- mapping


class MappedFile:
    """An open GGUF file with its bytes mapped into memory, for ``Content.tensor``.

    The mapping is private copy-on-write (``ACCESS_COPY``) and never written, so tensors are
    zero-copy views whose pages come from the page cache as they are touched; they count in
    the process's RSS only while resident, and ``release`` drops them (after an engine has
    repacked or copied what it read; a later touch reads them again). Reads (``read``,
    ``readinto``, ``seek``, ``tell``) go to the file itself, so ``Content.read`` parses
    through it. ``open`` returns the plain file where it cannot be mapped (a pipe, an
    empty file). A mapped file that another process truncates while in use can kill the
    interpreter with SIGBUS, as with any mapping (llama.cpp's mmap included).
    """

    def __init__(self, f: BinaryIO):
        self.file = f
        self.size = os.fstat(f.fileno()).st_size
        self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        self._base: int | None = None  # the mapping's address (``release_view``)

    @classmethod
    def open(cls, f: BinaryIO) -> MappedFile | BinaryIO:
        """``f`` mapped, or ``f`` itself when it cannot be mapped."""
        try:
            if stat.S_ISREG(os.fstat(f.fileno()).st_mode) and os.fstat(f.fileno()).st_size:
                return cls(f)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            pass
        return f

    def view(self, start: int, n: int) -> torch.Tensor:
        """Bytes ``start .. start + n`` of the file as a uint8 tensor (no copy)."""
        return torch.frombuffer(self.map, dtype=torch.uint8, count=n, offset=start)

    def release(self, start: int = 0, n: int | None = None) -> None:
        """Drop the mapped pages of bytes ``start .. start + n`` (default: the whole file) from
        this process (``MADV_DONTNEED``, on the pages that hold any of them; the views stay
        valid: a later touch reads the page cache again)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = self.size if n is None else min(self.size, start + n)
        lo = max(0, start) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > lo:
            self.map.madvise(mmap.MADV_DONTNEED, lo, end - lo)

    def release_view(self, t: torch.Tensor) -> bool:
        """``release`` the bytes under ``t`` when it is a view of this mapping (contiguous, as
        ``view`` and ``Content.tensor`` make them); False, and nothing done, for any other."""
        if self._base is None:
            self._base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        n = t.numel() * t.element_size()
        start = t.data_ptr() - self._base
        if not t.is_contiguous() or start < 0 or start + n > self.size or not n:
            return False
        self.release(start, n)
        return True

    def read(self, n: int = -1) -> bytes:
        return self.file.read(n)

    def readinto(self, b) -> int | None:
        return self.file.readinto(b)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.file.seek(pos, whence)

    def tell(self) -> int:
        return self.file.tell()

    def fileno(self) -> int:
        return self.file.fileno()


# ----------------------------------------------------------------------------- reading


def _file_size(f: BinaryIO) -> int | None:
    """Size of a regular file or seekable stream, None when it cannot be known."""
    try:
        st = os.fstat(f.fileno())
        if stat.S_ISREG(st.st_mode):
            return st.st_size
    except (AttributeError, OSError, ValueError):
        pass
    try:
        pos = f.tell()
        end = f.seek(0, io.SEEK_END)
        f.seek(pos)
        return end
    except (AttributeError, OSError, ValueError):
        return None


def _readinto_exact(f: BinaryIO, buf: bytearray, where: Callable[[], str], start: int) -> None:
    """Fill ``buf`` from ``f``, looping over short reads; EOF first is truncation."""
    mv = memoryview(buf)
    got, n = 0, len(buf)
    readinto = getattr(f, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(mv[got:])
        else:
            chunk = f.read(min(n - got, READ_CHUNK))
            k = None if chunk is None else len(chunk)
            if k:
                mv[got : got + k] = chunk
        if k is None:
            raise GGUFError(f"cannot read {where()}: the file is non-blocking and has no data")
        if k == 0:
            raise GGUFError(
                f"truncated {where()}: needs {n} bytes at offset {start}, "
                f"but the file ends at offset {start + got}"
            )
        got += k


def _read_growing(f: BinaryIO, n: int, where: Callable[[], str], start: int) -> bytearray:
    """Read ``n`` bytes in chunks, so a corrupt ``n`` costs no more memory than the file."""
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(min(n - len(buf), READ_CHUNK))
        if chunk is None:
            raise GGUFError(f"cannot read {where()}: the file is non-blocking and has no data")
        if not chunk:
            raise GGUFError(
                f"truncated {where()}: needs {n} bytes at offset {start}, "
                f"but the file ends at offset {start + len(buf)}"
            )
        buf += chunk
    return buf


def _outside_msg(info: TensorInfo, data_offset: int, size: int) -> str:
    start = data_offset + info.offset
    return (
        f"tensor {info.name!r} data lies outside the file: offset {info.offset} "
        f"(absolute {start}), size {info.nbytes} bytes, ends at {start + info.nbytes}, "
        f"file size {size}"
    )


class _Reader:
    """Reads exact byte counts through the caller's file object and tracks the offset."""

    __slots__ = ("f", "pos", "size")

    def __init__(self, f: BinaryIO, pos: int, size: int | None):
        self.f, self.pos, self.size = f, pos, size

    def remaining(self) -> int | None:
        return None if self.size is None else self.size - self.pos

    def take(self, n: int, where: str | Callable[[], str]) -> bytes:
        b = self.f.read(n) if n <= READ_CHUNK else b""
        if b is None or len(b) != n:
            b = self._take_slow(b or b"", n, where)
        self.pos += n
        return b

    def _take_slow(self, b: bytes, n: int, where: str | Callable[[], str]) -> bytes:
        parts, got = [b], len(b)
        while got < n:
            chunk = self.f.read(min(n - got, READ_CHUNK))
            if not chunk:
                w = where() if callable(where) else where
                if chunk is None:
                    raise GGUFError(f"cannot read {w}: the file is non-blocking and has no data")
                raise GGUFError(
                    f"truncated {w}: needs {n} bytes at offset {self.pos}, "
                    f"but the file ends at offset {self.pos + got}"
                )
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def u32(self, where: str | Callable[[], str]) -> int:
        return U32.unpack(self.take(4, where))[0]

    def u64(self, where: str | Callable[[], str]) -> int:
        return U64.unpack(self.take(8, where))[0]

    def fits(self, count: int, min_item: int, what: Callable[[], str]) -> None:
        """Refuse ``count`` items of at least ``min_item`` bytes that the file cannot hold."""
        rem = self.remaining()
        if rem is not None and count * min_item > rem:
            raise GGUFError(
                f"{what()}: {count} items need at least {count * min_item} bytes, "
                f"only {rem} left in the file after offset {self.pos}"
            )

    def string(self, where: str) -> str:
        at = self.pos
        n = self.u64(lambda: f"{where} (string length)")
        self._check_string_len(n, where, at)
        return self.take(n, lambda: f"{where} (string of {n} bytes)").decode(
            "utf-8", "surrogateescape"
        )

    def _check_string_len(self, n: int, where: str, at: int) -> None:
        if n > MAX_STRING:
            raise GGUFError(
                f"{where}: implausible string length {n} at offset {at} (max {MAX_STRING})"
            )
        rem = self.remaining()
        if rem is not None and n > rem:
            raise GGUFError(
                f"{where}: string length {n} at offset {at} is larger than the "
                f"{rem} bytes left in the file"
            )


def _read_content(f: BinaryIO) -> Content:
    try:
        start = f.tell()
    except (AttributeError, OSError, ValueError):
        start = 0
    size = _file_size(f)
    r = _Reader(f, start, size)

    magic = r.take(4, "header (magic)")
    if magic != GGUF_MAGIC:
        hexed = " ".join(f"{b:02x}" for b in magic)
        raise GGUFError(f"not a GGUF file: bad magic {magic!r} ({hexed}), expected b'GGUF'")
    version = r.u32("header (version)")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in (1, 2, 3):
            raise GGUFError(
                f"unsupported GGUF version {version:#010x}: big-endian files are not supported"
            )
        raise GGUFError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = r.u64("header (tensor count)")
    n_kv = r.u64("header (metadata count)")
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"implausible tensor count {n_tensors} in header (max {MAX_TENSORS})")
    if n_kv > MAX_KV:
        raise GGUFError(f"implausible metadata count {n_kv} in header (max {MAX_KV})")
    rem = r.remaining()
    # Smallest possible entries: key (8 + 0) + type (4) + 1 byte value; name (8) + n_dims (4)
    # + one dim (8) + type (4) + offset (8).
    need = n_kv * 13 + n_tensors * 32
    if rem is not None and need > rem:
        raise GGUFError(
            f"implausible header: {n_tensors} tensors and {n_kv} metadata entries need at least "
            f"{need} bytes, only {rem} left in the file"
        )

    metadata: dict[str, Any] = {}
    types: dict[str, Spec] = {}
    for i in range(n_kv):
        key_at = r.pos
        key = r.string(f"metadata (key #{i})")
        if key in metadata:
            raise GGUFError(f"duplicate metadata key {key!r} at offset {key_at}")
        where = f"metadata (key {key!r})"
        vt_at = r.pos
        vt = r.u32(f"{where} type")
        metadata[key], types[key] = _read_value(r, vt, key, vt_at, 0)

    alignment = _alignment(metadata, types)

    infos: dict[str, TensorInfo] = {}
    for i in range(n_tensors):
        info = _read_tensor_info(r, i)
        if info.name in infos:
            raise GGUFError(f"duplicate tensor name {info.name!r} in the tensor directory")
        infos[info.name] = info

    data_offset = -(-r.pos // alignment) * alignment
    _check_layout(infos, alignment)
    if size is not None:
        for info in infos.values():
            if data_offset + info.offset + info.nbytes > size:
                raise GGUFError(_outside_msg(info, data_offset, size))
    return Content(version, metadata, types, infos, data_offset, alignment, size)


def _check_layout(infos: dict[str, TensorInfo], alignment: int) -> None:
    """Tensor data offsets must be multiples of the alignment and data ranges disjoint.

    So the tensors of a file never hold more bytes than the file has (no amplification
    by many entries pointing at the same bytes).
    """
    for info in infos.values():
        if info.offset % alignment:
            raise GGUFError(
                f"tensor {info.name!r}: data offset {info.offset} is not a multiple of the "
                f"alignment {alignment}"
            )
    prev = None
    for info in sorted(infos.values(), key=lambda t: t.offset):
        if prev is not None and info.offset < prev.offset + prev.nbytes:
            raise GGUFError(
                f"tensors {prev.name!r} and {info.name!r} overlap: {prev.name!r} holds bytes "
                f"{prev.offset}..{prev.offset + prev.nbytes} of the data section, "
                f"{info.name!r} starts at {info.offset}"
            )
        prev = info


def _read_value(r: _Reader, vt: int, key: str, at: int, depth: int) -> tuple[Any, Spec]:
    """One value of type ``vt`` (its id was read at offset ``at``)."""
    s = SCALAR_STRUCTS.get(vt)
    if s is not None:
        (v,) = s.unpack(r.take(s.size, lambda: f"metadata (value of key {key!r})"))
        if vt == VT.BOOL:
            if v > 1:
                raise GGUFError(f"metadata key {key!r}: bad bool value {v} at offset {r.pos - 1}")
            v = bool(v)
        return v, VT(vt)
    if vt == VT.STRING:
        return r.string(f"metadata (value of key {key!r})"), VT.STRING
    if vt == VT.ARRAY:
        return _read_array(r, key, depth)
    raise GGUFError(f"unknown metadata value type {vt} for key {key!r} at offset {at}")


def _read_array(r: _Reader, key: str, depth: int) -> tuple[list, Spec]:
    if depth >= MAX_DEPTH:
        raise GGUFError(f"metadata key {key!r}: arrays nested deeper than {MAX_DEPTH}")
    where = f"metadata (array header of key {key!r})"
    it_at = r.pos
    it = r.u32(where)
    count_at = r.pos
    n = r.u64(where)
    if n > MAX_ARRAY:
        raise GGUFError(
            f"metadata key {key!r}: implausible array length {n} at offset {count_at} "
            f"(max {MAX_ARRAY})"
        )
    what = lambda: f"metadata key {key!r}: array length {n} at offset {count_at}"  # noqa: E731
    dt = NUMERIC_DTYPES.get(it)
    if dt is not None:
        r.fits(n, dt.itemsize, what)
        raw = r.take(n * dt.itemsize, lambda: f"metadata (array of key {key!r})")
        arr = np.frombuffer(raw, dtype=dt)
        if it == VT.BOOL:
            if n and arr.max() > 1:
                bad = int(np.argmax(arr > 1))
                raise GGUFError(f"metadata key {key!r}: bad bool value {arr[bad]} at item {bad}")
            return arr.astype(bool).tolist(), (VT.ARRAY, VT.BOOL)
        return arr.tolist(), (VT.ARRAY, VT(it))
    if it == VT.STRING:
        r.fits(n, LEN_PREFIX, what)
        return _read_strings(r, n, key), (VT.ARRAY, VT.STRING)
    if it == VT.ARRAY:
        r.fits(n, 4 + LEN_PREFIX, what)
        values, specs = [], []
        for j in range(n):
            v, s = _read_array(r, f"{key}[{j}]", depth + 1)
            values.append(v)
            specs.append(s)
        return values, (VT.ARRAY, specs)
    raise GGUFError(
        f"unknown metadata value type {it} for the items of array key {key!r} at offset {it_at}"
    )


def _read_strings(r: _Reader, n: int, key: str) -> list[str]:
    """``n`` length-prefixed strings: two reads each, through the caller's file object."""
    read, unpack = r.f.read, U64.unpack
    out: list[str] = []
    append = out.append
    for j in range(n):
        b = read(8)
        if b is None or len(b) != 8:
            b = r._take_slow(b or b"", 8, lambda j=j: f"metadata (key {key!r} item {j} length)")
        (m,) = unpack(b)
        r.pos += 8
        if m > MAX_STRING or (r.size is not None and m > r.size - r.pos):
            r._check_string_len(m, f"metadata key {key!r} item {j}", r.pos - 8)
        s = read(m)
        if s is None or len(s) != m:
            s = r._take_slow(s or b"", m, lambda j=j: f"metadata (key {key!r} item {j})")
        r.pos += m
        append(s.decode("utf-8", "surrogateescape"))
    return out


def _alignment(metadata: dict, types: dict) -> int:
    if "general.alignment" not in metadata:
        return DEFAULT_ALIGNMENT
    a, t = metadata["general.alignment"], types["general.alignment"]
    if not isinstance(t, GGUFValueType) or t in (VT.BOOL, VT.STRING, VT.FLOAT32, VT.FLOAT64):
        raise GGUFError(f"general.alignment has type {spec_name(t)}, expected an unsigned integer")
    if a <= 0 or a & (a - 1):
        raise GGUFError(f"general.alignment = {a} is not a positive power of two")
    return a


def _read_tensor_info(r: _Reader, i: int) -> TensorInfo:
    name = r.string(f"tensor directory (name of tensor #{i})")
    where = f"tensor directory (entry {name!r})"
    n_dims_at = r.pos
    n_dims = r.u32(where)
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(
            f"tensor {name!r} has {n_dims} dimensions at offset {n_dims_at}; "
            f"GGUF tensors have 1 to {MAX_DIMS}"
        )
    dims = struct.unpack(f"<{n_dims}Q", r.take(8 * n_dims, where))
    type_at = r.pos
    type_id = r.u32(where)
    offset = r.u64(where)
    try:
        dtype = ggml_type(type_id)
    except ValueError:
        raise GGUFError(
            f"unknown ggml type id {type_id} for tensor {name!r} at offset {type_at}"
        ) from None
    shape = tuple(reversed(dims))  # GGUF stores ne0 (innermost) first
    count = 1
    for d in dims:
        if d <= 0 or d >= 1 << 63:
            raise GGUFError(f"tensor {name!r} has a dimension <= 0: ggml dims {list(dims)}")
        count *= d
    if count >= 1 << 63:
        raise GGUFError(f"tensor {name!r} is implausibly large: shape {list(shape)}")
    if dims[0] % dtype.block_size:
        raise GGUFError(
            f"tensor {name!r} of type {dtype.name}: last dim {dims[0]} (shape {list(shape)}) "
            f"is not divisible by the block size {dtype.block_size}"
        )
    nbytes = dtype.nbytes(shape)
    if offset + nbytes >= 1 << 63:
        raise GGUFError(f"tensor {name!r}: implausible data offset {offset} (size {nbytes} bytes)")
    return TensorInfo(name, dtype, shape, offset, nbytes)
