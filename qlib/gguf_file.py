"""Read and write GGUF files, as candle's ``quantized::gguf_file`` does.

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
import os
import stat
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .devices import DeviceLike, as_device
from .qtensor import QTensor
from .quants.types import GGMLType, ggml_type

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)

# Plausibility limits: a corrupt count never turns into an allocation.
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 20
MAX_STRING = 1 << 26
MAX_ARRAY = 1 << 30
MAX_DEPTH = 64
MAX_DIMS = 4
_CHUNK = 1 << 24  # largest single read when the file size is unknown


class GGUFError(ValueError):
    """A GGUF file (or a value to write) is malformed; the message says what and where."""


class TensorNotFoundError(GGUFError, KeyError):
    """``Content.tensor`` was asked for a name the directory does not hold."""

    __str__ = ValueError.__str__  # no KeyError quoting


class GGUFValueType(IntEnum):
    """Metadata value types (ids as in the GGUF spec and gguf-py)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


VT = GGUFValueType
# Numeric value types: little-endian numpy dtype (struct for scalars derives from it).
_NUMERIC: dict[int, np.dtype] = {
    VT.UINT8: np.dtype("<u1"),
    VT.INT8: np.dtype("<i1"),
    VT.UINT16: np.dtype("<u2"),
    VT.INT16: np.dtype("<i2"),
    VT.UINT32: np.dtype("<u4"),
    VT.INT32: np.dtype("<i4"),
    VT.FLOAT32: np.dtype("<f4"),
    VT.BOOL: np.dtype("<u1"),
    VT.UINT64: np.dtype("<u8"),
    VT.INT64: np.dtype("<i8"),
    VT.FLOAT64: np.dtype("<f8"),
}
_STRUCT: dict[int, struct.Struct] = {
    t: struct.Struct("<" + c) for t, c in zip(_NUMERIC, "BbHhIifBQqd", strict=True)
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_LEN_PREFIX = 8  # v2 and v3 store lengths and counts as u64

# A value's GGUF type: a scalar type, or (ARRAY, item type) for an array whose items
# all have that type, or (ARRAY, [type of each item]) for an array of arrays.
Spec = GGUFValueType | tuple


@dataclass(frozen=True)
class Typed:
    """A metadata value with its GGUF type forced, e.g. ``Typed(GGUFValueType.UINT32, 64)``.

    ``type`` is a ``Spec``; a scalar type with a list value means an array of that type.
    """

    type: Any
    value: Any


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
        """Load tensor ``name`` from ``f`` as a ``QTensor`` on ``device``."""
        info = self.tensor_infos.get(name)
        if info is None:
            raise TensorNotFoundError(f"cannot find tensor info for {name}")
        dev = as_device(device)
        data = torch.frombuffer(self.tensor_bytes(f, name), dtype=torch.uint8)
        return QTensor(data.to(dev), info.shape, info.dtype)

    def __repr__(self) -> str:
        return (
            f"Content(version={self.version}, {len(self.metadata)} metadata keys, "
            f"{len(self.tensor_infos)} tensors, data at {self.tensor_data_offset}, "
            f"alignment={self.alignment})"
        )


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
            chunk = f.read(min(n - got, _CHUNK))
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
        chunk = f.read(min(n - len(buf), _CHUNK))
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
        b = self.f.read(n) if n <= _CHUNK else b""
        if b is None or len(b) != n:
            b = self._take_slow(b or b"", n, where)
        self.pos += n
        return b

    def _take_slow(self, b: bytes, n: int, where: str | Callable[[], str]) -> bytes:
        parts, got = [b], len(b)
        while got < n:
            chunk = self.f.read(min(n - got, _CHUNK))
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
        return _U32.unpack(self.take(4, where))[0]

    def u64(self, where: str | Callable[[], str]) -> int:
        return _U64.unpack(self.take(8, where))[0]

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
    s = _STRUCT.get(vt)
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
    dt = _NUMERIC.get(it)
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
        r.fits(n, _LEN_PREFIX, what)
        return _read_strings(r, n, key), (VT.ARRAY, VT.STRING)
    if it == VT.ARRAY:
        r.fits(n, 4 + _LEN_PREFIX, what)
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
    read, unpack = r.f.read, _U64.unpack
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
        raise GGUFError(f"general.alignment has type {_spec_name(t)}, expected an unsigned integer")
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


# ----------------------------------------------------------------------------- writing

TensorLike = QTensor | tuple | np.ndarray | torch.Tensor

_NP_TO_VT = {
    np.dtype(np.uint8): VT.UINT8,
    np.dtype(np.int8): VT.INT8,
    np.dtype(np.uint16): VT.UINT16,
    np.dtype(np.int16): VT.INT16,
    np.dtype(np.uint32): VT.UINT32,
    np.dtype(np.int32): VT.INT32,
    np.dtype(np.uint64): VT.UINT64,
    np.dtype(np.int64): VT.INT64,
    np.dtype(np.float16): VT.FLOAT32,
    np.dtype(np.float32): VT.FLOAT32,
    np.dtype(np.float64): VT.FLOAT64,
    np.dtype(np.bool_): VT.BOOL,
}
_NP_TO_GGML = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}
_TORCH_TO_GGML = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _spec_name(spec: Any) -> str:
    if isinstance(spec, tuple):
        item = spec[1]
        inner = "ARRAY" if isinstance(item, list) else _spec_name(item)
        return f"ARRAY[{inner}]"
    try:
        return VT(int(spec)).name
    except (TypeError, ValueError):
        return repr(spec)


def _norm_spec(spec: Any, key: str) -> Spec:
    """Normalize a spec (accepting gguf-py's enum members or plain ints)."""
    if isinstance(spec, tuple):
        if len(spec) != 2 or int(spec[0]) != VT.ARRAY:
            raise GGUFError(f"metadata key {key!r}: bad type {spec!r}, expected (ARRAY, item type)")
        item = spec[1]
        if isinstance(item, list):
            return (VT.ARRAY, [_norm_spec(s, key) for s in item])
        return (VT.ARRAY, _norm_spec(item, key))
    try:
        t = VT(int(spec))
    except (TypeError, ValueError):
        raise GGUFError(f"metadata key {key!r}: unknown GGUF value type {spec!r}") from None
    return t


def _int_spec(lo: int, hi: int, key: str) -> GGUFValueType:
    if -(1 << 31) <= lo and hi < 1 << 31:
        return VT.INT32
    if -(1 << 63) <= lo and hi < 1 << 63:
        return VT.INT64
    if lo >= 0 and hi < 1 << 64:
        return VT.UINT64
    raise GGUFError(
        f"metadata key {key!r}: integer {hi if hi >= 1 << 64 else lo} fits no GGUF type"
    )


def _infer_spec(value: Any, key: str) -> Spec:
    """The GGUF type of a plain Python value: int -> INT32 (wider if needed), float -> FLOAT32."""
    if isinstance(value, (bool, np.bool_)):
        return VT.BOOL
    if isinstance(value, np.generic):
        if value.dtype in _NP_TO_VT:
            return _NP_TO_VT[value.dtype]
        raise GGUFError(f"metadata key {key!r}: no GGUF type for numpy {value.dtype}")
    if isinstance(value, int):
        return _int_spec(value, value, key)
    if isinstance(value, float):
        return VT.FLOAT32
    if isinstance(value, (str, bytes)):
        return VT.STRING
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype not in _NP_TO_VT:
            raise GGUFError(
                f"metadata key {key!r}: cannot store a {value.dtype} array of shape {value.shape}"
            )
        return (VT.ARRAY, _NP_TO_VT[value.dtype])
    if isinstance(value, (list, tuple)):
        if not value:
            return (VT.ARRAY, VT.INT32)
        if all(isinstance(v, (str, bytes)) for v in value):
            return (VT.ARRAY, VT.STRING)
        if all(isinstance(v, (bool, np.bool_)) for v in value):
            return (VT.ARRAY, VT.BOOL)
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (VT.ARRAY, _int_spec(min(value), max(value), key))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            return (VT.ARRAY, VT.FLOAT32)
        if all(isinstance(v, (list, tuple, np.ndarray)) for v in value):
            return (VT.ARRAY, [_infer_spec(v, key) for v in value])
        kinds = sorted({type(v).__name__ for v in value})
        raise GGUFError(
            f"metadata key {key!r}: array mixes item types {kinds}; use Typed to say which"
        )
    raise GGUFError(f"metadata key {key!r}: cannot store a value of type {type(value).__name__}")


def _encode_string(out: bytearray, s: Any, key: str) -> None:
    if isinstance(s, str):
        b = s.encode("utf-8", "surrogateescape")
    elif isinstance(s, (bytes, bytearray)):
        b = bytes(s)
    else:
        raise GGUFError(f"metadata key {key!r}: expected a string, got {type(s).__name__}")
    out += _U64.pack(len(b))
    out += b


def _encode_value(out: bytearray, spec: Spec, value: Any, key: str) -> None:
    """Append ``value`` (without its type id) encoded as ``spec``."""
    if isinstance(spec, tuple):
        _encode_array(out, spec[1], value, key)
    elif spec == VT.STRING:
        _encode_string(out, value, key)
    elif spec == VT.ARRAY:
        _encode_array(out, _infer_spec(value, key)[1], value, key)
    else:
        if spec == VT.BOOL and not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
            raise GGUFError(f"metadata key {key!r}: {value!r} is not a bool")
        if spec == VT.BOOL:
            value = int(bool(value))
        if spec not in (VT.FLOAT32, VT.FLOAT64) and not isinstance(value, (int, np.integer)):
            raise GGUFError(f"metadata key {key!r}: {value!r} is not an integer for {spec.name}")
        try:
            out += _STRUCT[spec].pack(value)
        except (struct.error, TypeError, OverflowError) as e:
            raise GGUFError(
                f"metadata key {key!r}: cannot write {value!r} as {spec.name}: {e}"
            ) from None


def _encode_array(out: bytearray, item: Spec | list, values: Any, key: str) -> None:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise GGUFError(f"metadata key {key!r}: expected an array, got {type(values).__name__}")
    n = len(values)
    item_id = VT.ARRAY if isinstance(item, (list, tuple)) else item
    out += _U32.pack(item_id)
    out += _U64.pack(n)
    if isinstance(item, list):
        if len(item) != n:
            raise GGUFError(f"metadata key {key!r}: {n} sub-arrays but {len(item)} item types")
        for v, s in zip(values, item, strict=True):
            _encode_array(out, s[1], v, key)
    elif isinstance(item, tuple):
        for v in values:
            _encode_array(out, item[1], v, key)
    elif item == VT.STRING:
        for v in values:
            _encode_string(out, v, key)
    elif item == VT.ARRAY:
        for v in values:
            _encode_array(out, _infer_spec(v, key)[1], v, key)
    else:
        out += _numeric_array_bytes(item, values, key)


def _numeric_array_bytes(item: GGUFValueType, values: Any, key: str) -> bytes:
    dt = _NUMERIC[item]
    if len(values) == 0:
        return b""
    try:
        a = np.asarray(values)
    except (ValueError, OverflowError) as e:
        raise GGUFError(f"metadata key {key!r}: cannot make an array of {item.name}: {e}") from None
    if a.ndim != 1:
        raise GGUFError(f"metadata key {key!r}: expected a flat array of {item.name}")
    if item == VT.BOOL:
        if a.dtype.kind != "b" and not (a.dtype.kind in "iu" and a.min() >= 0 and a.max() <= 1):
            raise GGUFError(f"metadata key {key!r}: array of BOOL holds non-bool values")
        return a.astype(dt).tobytes()
    if dt.kind in "iu":
        if a.dtype.kind not in "iub":
            raise GGUFError(
                f"metadata key {key!r}: array of {item.name} holds non-integers ({a.dtype})"
            )
        info = np.iinfo(dt)
        lo, hi = int(a.min()), int(a.max())
        if lo < info.min or hi > info.max:
            raise GGUFError(
                f"metadata key {key!r}: values {lo}..{hi} do not fit {item.name} "
                f"({info.min}..{info.max})"
            )
    elif a.dtype.kind not in "iuf":
        raise GGUFError(f"metadata key {key!r}: array of {item.name} holds non-numbers ({a.dtype})")
    return a.astype(dt).tobytes()


def _tensor_parts(name: str, t: Any) -> tuple[Any, tuple[int, ...], GGMLType]:
    """(raw bytes-like, torch-order shape, ggml type) of a tensor to write."""
    if isinstance(t, QTensor):
        return t.data.detach().cpu().contiguous().numpy().reshape(-1), t.shape, t.dtype
    if isinstance(t, torch.Tensor):
        if t.dtype not in _TORCH_TO_GGML:
            raise GGUFError(
                f"tensor {name!r}: cannot write torch {t.dtype}; pass (bytes, shape, type)"
            )
        gt = _TORCH_TO_GGML[t.dtype]
        c = t.detach().cpu().contiguous()
        raw = (c.view(torch.int16) if t.dtype == torch.bfloat16 else c).numpy()
        return raw.reshape(-1).view(np.uint8), tuple(t.shape), ggml_type(gt)
    if isinstance(t, np.ndarray):
        if t.dtype not in _NP_TO_GGML:
            raise GGUFError(
                f"tensor {name!r}: cannot write numpy {t.dtype}; pass (bytes, shape, type)"
            )
        a = np.ascontiguousarray(t, dtype=t.dtype.newbyteorder("<"))
        return a.reshape(-1).view(np.uint8), tuple(t.shape), ggml_type(_NP_TO_GGML[t.dtype])
    if isinstance(t, tuple) and len(t) == 3:
        raw, shape, gt = t
        try:
            gt = ggml_type(gt)
        except (ValueError, AttributeError) as e:
            raise GGUFError(f"tensor {name!r}: {e}") from None
        if isinstance(raw, np.ndarray):
            raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        return raw, tuple(int(d) for d in shape), gt
    raise GGUFError(
        f"tensor {name!r}: expected a QTensor, a float array or (bytes, shape, ggml type), "
        f"got {type(t).__name__}"
    )


def _write_all(f: BinaryIO, data: Any) -> None:
    """Write everything, looping over short writes of raw files."""
    mv = memoryview(data).cast("B")
    while len(mv):
        n = f.write(mv)
        if n is None:
            raise GGUFError("cannot write: the file is non-blocking and not ready")
        mv = mv[n:]


def write(
    f: BinaryIO,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorLike],
    *,
    types: Mapping[str, Spec] | None = None,
    version: int = 3,
    alignment: int | None = None,
) -> None:
    """Write a little-endian GGUF file (metadata and tensors in the mappings' order).

    A metadata value's type comes from ``Typed(type, value)`` or ``(GGUFValueType, value)``,
    else from ``types[key]`` (pass ``content.metadata_types`` to copy a file exactly), else
    from its Python type (bool BOOL, int INT32 or wider, float FLOAT32, str STRING, list
    ARRAY; numpy scalars and arrays keep their dtype). ``alignment`` defaults to the
    metadata's ``general.alignment`` or 32; a non-default one not in the metadata is added
    as UINT32. A tensor is a ``QTensor``, a float numpy array or torch tensor (F32/F16/BF16),
    or ``(raw bytes or uint8 array, shape in torch order, ggml type)``.
    """
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"cannot write GGUF version {version} (supported: 2, 3)")
    types = types or {}
    entries: list[tuple[str, Spec, Any]] = []
    for key, value in metadata.items():
        if not isinstance(key, str):
            raise GGUFError(f"metadata keys must be strings, got {key!r}")
        if isinstance(value, Typed):
            spec, value = _norm_spec(value.type, key), value.value
        elif isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], IntEnum):
            spec, value = _norm_spec(value[0], key), value[1]
        elif key in types:
            spec = _norm_spec(types[key], key)
        else:
            spec = _infer_spec(value, key)
        if (
            not isinstance(spec, tuple)
            and spec != VT.ARRAY
            and isinstance(value, (list, np.ndarray))
        ):
            spec = (VT.ARRAY, spec)  # Typed(FLOAT32, [...]) means an array of FLOAT32
        entries.append((key, spec, value))

    meta_align = next((v for k, _, v in entries if k == "general.alignment"), None)
    if alignment is None:
        alignment = DEFAULT_ALIGNMENT if meta_align is None else int(meta_align)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"alignment {alignment} is not a positive power of two")
    if meta_align is None and alignment != DEFAULT_ALIGNMENT:
        entries.append(("general.alignment", VT.UINT32, alignment))
    elif meta_align is not None and int(meta_align) != alignment:
        raise GGUFError(f"alignment={alignment} disagrees with general.alignment = {meta_align}")

    parts = []
    for name, t in tensors.items():
        raw, shape, gt = _tensor_parts(name, t)
        if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 for d in shape):
            raise GGUFError(
                f"tensor {name!r}: shape {list(shape)} needs 1 to {MAX_DIMS} dims, each > 0"
            )
        if shape[-1] % gt.block_size:
            raise GGUFError(
                f"tensor {name!r} of type {gt.name}: last dim {shape[-1]} is not divisible by "
                f"the block size {gt.block_size}"
            )
        nbytes = gt.nbytes(shape)
        if memoryview(raw).nbytes != nbytes:
            raise GGUFError(
                f"tensor {name!r}: {gt.name} of shape {list(shape)} needs {nbytes} bytes, "
                f"got {memoryview(raw).nbytes}"
            )
        parts.append((name, raw, shape, gt, nbytes))

    head = bytearray(GGUF_MAGIC)
    head += struct.pack("<IQQ", version, len(parts), len(entries))
    for key, spec, value in entries:
        _encode_string(head, key, key)
        head += _U32.pack(spec[0] if isinstance(spec, tuple) else spec)
        _encode_value(head, spec, value, key)
    offset = 0
    for name, _, shape, gt, nbytes in parts:
        _encode_string(head, name, name)
        head += _U32.pack(len(shape))
        head += struct.pack(f"<{len(shape)}Q", *reversed(shape))
        head += struct.pack("<IQ", gt.id, offset)
        offset += -(-nbytes // alignment) * alignment

    try:
        start = f.tell()
    except (AttributeError, OSError, ValueError):
        start = 0
    head += bytes(-(start + len(head)) % alignment)
    _write_all(f, head)
    for _, raw, _, _, nbytes in parts:
        _write_all(f, raw)
        pad = -nbytes % alignment
        if pad:
            _write_all(f, bytes(pad))


def write_path(
    path: str | os.PathLike,
    metadata: Mapping[str, Any],
    tensors: Mapping[str, TensorLike],
    **kwargs: Any,
) -> Path:
    """``write`` to a new file at ``path``; returns the path."""
    path = Path(path)
    with open(path, "wb") as f:
        write(f, metadata, tensors, **kwargs)
    return path
