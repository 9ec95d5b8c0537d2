"""The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q8_1.

Quantizers transcribe llama.cpp's ``quantize_row_<type>_ref`` (ggml-quants.c)
over all blocks at once; byte identity with gguf-py's ``gguf.quants.quantize``
is tested for every one but Q8_1, which has no file format and is tested
against the literal transcription in ``qlib.quants.reference``.

Layouts (bytes per block): Q4_0 ``d:f16 qs[16]``; Q4_1 ``d:f16 m:f16 qs[16]``;
Q5_0 ``d:f16 qh[4] qs[16]``; Q5_1 ``d:f16 m:f16 qh[4] qs[16]``; Q8_0
``d:f16 qs:i8[32]``; Q8_1 ``d:f16 s:f16 qs:i8[32]`` (``s = d * sum(qs)``).
Nibble ``j`` of ``qs`` holds element ``j`` (low) and ``j + 16`` (high); bit ``j``
of the little-endian ``qh`` is the fifth bit of element ``j``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import BlockFormat
from .common import (
    F32,
    bits_to_bytes,
    c_int,
    f16_bytes,
    first_absmax,
    inv_or_zero,
    pack,
    roundf,
    t_bits,
    t_f16,
    t_nibbles,
)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """``(B, 32)`` codes < 16 -> ``(B, 16)`` bytes: element j low, element j+16 high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _five_bits(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(B, 32)`` 5-bit codes -> (qh bytes ``(B, 4)``, qs bytes ``(B, 16)``)."""
    return bits_to_bytes((q >> 4) & 1), _nibbles(q & 0x0F)


def _symmetric_scale(x: np.ndarray, div: float) -> tuple[np.ndarray, np.ndarray]:
    """``d = max / div`` (signed max of largest magnitude) and ``id = d ? 1/d : 0``."""
    d = first_absmax(x, axis=1) / F32(div)
    return d, inv_or_zero(d)


def _min_max_scale(x: np.ndarray, levels: int):
    lo, hi = x.min(axis=1), x.max(axis=1)
    d = (hi - lo) / F32(levels)
    return d, inv_or_zero(d), lo


class Q4_0(BlockFormat, type_name="Q4_0"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, inv = _symmetric_scale(x, -8)
        q = np.minimum(15, c_int(x * inv[:, None] + F32(8.5)))
        return pack(f16_bytes(d), _nibbles(q))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return t_nibbles(b[:, 2:18]).to(torch.int8) - 8, t_f16(b, 0), None


class Q4_1(BlockFormat, type_name="Q4_1"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, inv, lo = _min_max_scale(x, 15)
        q = np.minimum(15, c_int((x - lo[:, None]) * inv[:, None] + F32(0.5)))
        return pack(f16_bytes(d), f16_bytes(lo), _nibbles(q))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return t_nibbles(b[:, 4:20]), t_f16(b, 0), t_f16(b, 2)


class Q5_0(BlockFormat, type_name="Q5_0"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, inv = _symmetric_scale(x, -16)
        q = np.minimum(31, c_int(x * inv[:, None] + F32(16.5)))
        return pack(f16_bytes(d), *_five_bits(q))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        q = t_nibbles(b[:, 6:22]) | (t_bits(b[:, 2:6]) << 4)
        return q.to(torch.int8) - 16, t_f16(b, 0), None


class Q5_1(BlockFormat, type_name="Q5_1"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, inv, lo = _min_max_scale(x, 31)
        q = c_int((x - lo[:, None]) * inv[:, None] + F32(0.5)) & 0xFF  # (uint8_t), no clamp
        return pack(f16_bytes(d), f16_bytes(lo), *_five_bits(q))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        q = t_nibbles(b[:, 8:24]) | (t_bits(b[:, 4:8]) << 4)
        return q, t_f16(b, 0), t_f16(b, 2)


def _q8_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_0_ref / q8_1_ref: ``d = amax/127``, ``q = roundf(x * (1/d))``."""
    d = np.abs(x).max(axis=1) / F32(127)
    q = roundf(x * inv_or_zero(d)[:, None]).astype(np.int8)
    return d, q


class Q8_0(BlockFormat, type_name="Q8_0"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, q = _q8_ref(x)
        return pack(f16_bytes(d), q)

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return b[:, 2:34].contiguous().view(torch.int8), t_f16(b, 0), None


class Q8_1(BlockFormat, type_name="Q8_1"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        d, q = _q8_ref(x)
        s = q.sum(axis=1, dtype=np.int32).astype(F32) * d
        return pack(f16_bytes(d), f16_bytes(s), q)

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return b[:, 4:36].contiguous().view(torch.int8), t_f16(b, 0), None
