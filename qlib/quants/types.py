"""The ggml tensor types: id, name, block size and bytes per block.

This table is the single source of truth for the GGUF reader, the writer and
the block formats. It lists every type id llama.cpp knows, so a file holding
a type qlib cannot compute with still opens and names that type in the error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGMLType:
    """One ggml tensor type."""

    name: str
    id: int
    block_size: int  # elements per block
    type_size: int  # bytes per block

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements (``n`` a multiple of the block size)."""
        return n // self.block_size * self.type_size

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of ``shape`` (rows along the last axis)."""
        count = 1
        for d in shape:
            count *= d
        return count // self.block_size * self.type_size

    def check_packed(self, shape: tuple[int, ...], nbytes: int, is_uint8: bool = True) -> None:
        """Raise ``ValueError`` unless ``nbytes`` uint8 bytes hold a tensor of ``shape``."""
        if shape and shape[-1] % self.block_size:
            raise ValueError(
                f"quantized tensor must have their last dim divisible by block size: "
                f"shape {list(shape)}, {self.name} blocks of {self.block_size}"
            )
        expected = self.nbytes(shape)
        if not is_uint8 or nbytes != expected:
            raise ValueError(
                f"{self.name} tensor of shape {list(shape)} needs {expected} bytes of uint8, "
                f"got {nbytes}" + ("" if is_uint8 else " elements of another dtype")
            )

    @property
    def is_quantized(self) -> bool:
        return self.block_size > 1

    def __str__(self) -> str:
        return self.name


_TABLE = [
    # name, id, block size, type size
    ("F32", 0, 1, 4),
    ("F16", 1, 1, 2),
    ("Q4_0", 2, 32, 18),
    ("Q4_1", 3, 32, 20),
    ("Q5_0", 6, 32, 22),
    ("Q5_1", 7, 32, 24),
    ("Q8_0", 8, 32, 34),
    ("Q8_1", 9, 32, 36),  # ggml: two f16 (d, s) + 32 int8; gguf-py still says 40
    ("Q2_K", 10, 256, 84),
    ("Q3_K", 11, 256, 110),
    ("Q4_K", 12, 256, 144),
    ("Q5_K", 13, 256, 176),
    ("Q6_K", 14, 256, 210),
    ("Q8_K", 15, 256, 292),
    ("IQ2_XXS", 16, 256, 66),
    ("IQ2_XS", 17, 256, 74),
    ("IQ3_XXS", 18, 256, 98),
    ("IQ1_S", 19, 256, 50),
    ("IQ4_NL", 20, 32, 18),
    ("IQ3_S", 21, 256, 110),
    ("IQ2_S", 22, 256, 82),
    ("IQ4_XS", 23, 256, 136),
    ("I8", 24, 1, 1),
    ("I16", 25, 1, 2),
    ("I32", 26, 1, 4),
    ("I64", 27, 1, 8),
    ("F64", 28, 1, 8),
    ("IQ1_M", 29, 256, 56),
    ("BF16", 30, 1, 2),
    ("TQ1_0", 34, 256, 54),
    ("TQ2_0", 35, 256, 66),
    ("MXFP4", 39, 32, 17),
    ("NVFP4", 40, 64, 36),
    ("Q1_0", 41, 128, 18),
]

GGML_TYPES: dict[str, GGMLType] = {n: GGMLType(n, i, b, s) for n, i, b, s in _TABLE}
GGML_TYPES_BY_ID: dict[int, GGMLType] = {t.id: t for t in GGML_TYPES.values()}


def ggml_type(key: str | int | GGMLType) -> GGMLType:
    """Look a type up by name (case-insensitive), id, or pass one through."""
    if isinstance(key, GGMLType):
        return key
    if isinstance(key, int):
        try:
            return GGML_TYPES_BY_ID[key]
        except KeyError:
            raise ValueError(f"unknown ggml type id {key}") from None
    try:
        return GGML_TYPES[key.upper()]
    except KeyError:
        known = ", ".join(GGML_TYPES)
        raise ValueError(f"unknown ggml type {key!r} (known: {known})") from None
