"""GGUF constants shared by the reader and the writer: magic, versions, limits,
metadata value types, and the error types."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

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
READ_CHUNK = 1 << 24  # largest single read when the file size is unknown


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
NUMERIC_DTYPES: dict[int, np.dtype] = {
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
SCALAR_STRUCTS: dict[int, struct.Struct] = {
    t: struct.Struct("<" + c) for t, c in zip(NUMERIC_DTYPES, "BbHhIifBQqd", strict=True)
}
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
LEN_PREFIX = 8  # v2 and v3 store lengths and counts as u64

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


def spec_name(spec: Any) -> str:
    if isinstance(spec, tuple):
        item = spec[1]
        inner = "ARRAY" if isinstance(item, list) else spec_name(item)
        return f"ARRAY[{inner}]"
    try:
        return VT(int(spec)).name
    except (TypeError, ValueError):
        return repr(spec)
