"""Write GGUF files that llama.cpp and gguf-py read (``write``, ``write_path``)."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from enum import IntEnum
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ..quants.qtensor import QTensor
from ..quants.types import GGMLType, ggml_type
from . import constants as C
from .constants import VT, GGUFError, GGUFValueType, Spec, Typed

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
    out += C.U64.pack(len(b))
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
            out += C.SCALAR_STRUCTS[spec].pack(value)
        except (struct.error, TypeError, OverflowError) as e:
            raise GGUFError(
                f"metadata key {key!r}: cannot write {value!r} as {spec.name}: {e}"
            ) from None


def _encode_array(out: bytearray, item: Spec | list, values: Any, key: str) -> None:
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise GGUFError(f"metadata key {key!r}: expected an array, got {type(values).__name__}")
    n = len(values)
    item_id = VT.ARRAY if isinstance(item, (list, tuple)) else item
    out += C.U32.pack(item_id)
    out += C.U64.pack(n)
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
    dt = C.NUMERIC_DTYPES[item]
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
    if version not in C.SUPPORTED_VERSIONS:
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
        alignment = C.DEFAULT_ALIGNMENT if meta_align is None else int(meta_align)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"alignment {alignment} is not a positive power of two")
    if meta_align is None and alignment != C.DEFAULT_ALIGNMENT:
        entries.append(("general.alignment", VT.UINT32, alignment))
    elif meta_align is not None and int(meta_align) != alignment:
        raise GGUFError(f"alignment={alignment} disagrees with general.alignment = {meta_align}")

    parts = []
    for name, t in tensors.items():
        raw, shape, gt = _tensor_parts(name, t)
        if not 1 <= len(shape) <= C.MAX_DIMS or any(d <= 0 for d in shape):
            raise GGUFError(
                f"tensor {name!r}: shape {list(shape)} needs 1 to {C.MAX_DIMS} dims, each > 0"
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

    head = bytearray(C.GGUF_MAGIC)
    head += struct.pack("<IQQ", version, len(parts), len(entries))
    for key, spec, value in entries:
        _encode_string(head, key, key)
        head += C.U32.pack(spec[0] if isinstance(spec, tuple) else spec)
        _encode_value(head, spec, value, key)
    offset = 0
    for name, _, shape, gt, nbytes in parts:
        _encode_string(head, name, name)
        head += C.U32.pack(len(shape))
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
