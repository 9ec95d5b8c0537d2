"""Shared helpers for the block formats: ggml's scalar float idioms in NumPy, byte packing.

The quantizers must reproduce llama.cpp's reference C code bit for bit, so the
helpers here mirror C semantics exactly, always in float32:

* ``nearest_int``: ggml's magic-number rounding (round half to even, and the
  same wrap-around garbage as C for out-of-range inputs);
* ``roundf``: C's ``roundf`` (half away from zero);
* ``c_int``: C's float-to-int conversion (truncation toward zero);
* ``seqsum``: a strictly left-to-right float32 sum, as a C ``for`` loop
  accumulates (NumPy's own ``sum`` is pairwise and would round differently).

Vectorized quantizers keep their data as ``(n, B)`` arrays: ``n`` values per
(sub-)block along axis 0 and ``B`` (sub-)blocks along axis 1, so that a
sequential loop over a block's elements is a loop over contiguous rows.
"""

from __future__ import annotations

import numpy as np
import torch

F32 = np.float32
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23


def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: add 1.5*2**23 in float32 and read the low mantissa bits."""
    bits = (np.asarray(v, dtype=F32) + _MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def nearest_int_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as float32 codes.

    Fast path: ``rint`` equals ggml's trick while ``|v| <= 4194303``; beyond that
    the trick returns wrapped bits, so those (pathological) inputs take the exact path.
    """
    v = np.asarray(v, dtype=F32)
    if v.size and not (v.max() <= 4194303 and v.min() >= -4194303):
        return np.clip(nearest_int(v), lo, hi).astype(F32)
    r = np.rint(v)
    return np.clip(r, lo, hi, out=r)


def roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` (half away from zero), exact for every float32 (computed in float64)."""
    v64 = np.asarray(v, dtype=np.float64)
    return np.trunc(v64 + np.copysign(0.5, v64))


def c_int(v: np.ndarray) -> np.ndarray:
    """C's ``(int)`` conversion of a float: truncation toward zero."""
    return np.asarray(v, dtype=F32).astype(np.int32)


def inv_or_zero(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` in float32."""
    d = np.asarray(d, dtype=F32)
    out = np.zeros_like(d)
    np.divide(F32(1.0), d, out=out, where=d != 0)
    return out


def f16_round(v: np.ndarray) -> np.ndarray:
    """``GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))``: to half (nearest even) and back."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def seqsum(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over axis 0 of an ``(n, B)`` array, starting from ``0.0f``.

    NumPy reduces a C-contiguous array over its outer axis row by row (``out +=
    row``), which is the C loop's order; it only switches to pairwise summation
    when the reduced axis is the inner one, so a single column takes the loop.
    """
    a = np.ascontiguousarray(a, dtype=F32)
    if a.ndim == 2 and a.shape[1] > 1:
        return np.add.reduce(a, axis=0, initial=F32(0))
    acc = np.zeros(a.shape[1:], dtype=F32)
    for row in a:
        acc += row
    return acc


def first_absmax(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """ggml's ``max``: the signed value of largest magnitude along ``axis`` (first on ties).

    As the C loop ``if (fabsf(v) > amax)`` from ``amax = 0``: NaNs never win and an
    all-zero (or all-NaN) lane gives 0.
    """
    a = np.abs(x)
    a = np.where(np.isnan(a), F32(-1), a)
    idx = np.expand_dims(a.argmax(axis=axis), axis)
    value = np.take_along_axis(x, idx, axis=axis).squeeze(axis)
    return np.where(np.take_along_axis(a, idx, axis=axis).squeeze(axis) > 0, value, F32(0))


def running_max(x: np.ndarray, axis: int) -> np.ndarray:
    """``m = 0; if (v > m) m = v`` along ``axis``: the max with 0, NaNs ignored."""
    return np.fmax.reduce(x, axis=axis, initial=F32(0))


def pack(*fields: np.ndarray) -> np.ndarray:
    """Concatenate per-block fields (leading axis = blocks) into ``(B, bytes)`` uint8."""
    n = fields[0].shape[0]
    parts = [np.ascontiguousarray(f).reshape(n, -1).view(np.uint8) for f in fields]
    return np.concatenate(parts, axis=1)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """Float32 values as little-endian half-precision bytes, ``(B,) -> (B, 2)``."""
    return np.asarray(v, dtype=F32).astype("<f2").reshape(-1, 1)


def bits_to_bytes(bits: np.ndarray) -> np.ndarray:
    """``(B, 8*n)`` array of 0/1 (bit ``j`` of a little-endian bitfield) -> ``(B, n)`` uint8."""
    b = bits.astype(np.uint8).reshape(bits.shape[0], -1, 8)
    return (b << np.arange(8, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)


# --- torch side: reading block fields on any device ---------------------------------------


def t_f16(blocks: torch.Tensor, offset: int, count: int = 1) -> torch.Tensor:
    """``count`` half floats at byte ``offset`` of each block, as float32 ``(B, count)``."""
    raw = blocks[:, offset : offset + 2 * count].contiguous()
    return raw.view(torch.float16).float()


def t_f32(blocks: torch.Tensor, offset: int, count: int = 1) -> torch.Tensor:
    raw = blocks[:, offset : offset + 4 * count].contiguous()
    return raw.view(torch.float32)


def t_bits(raw: torch.Tensor) -> torch.Tensor:
    """``(B, n)`` uint8 -> ``(B, 8*n)`` uint8 of its bits, bit ``j`` of the little-endian field."""
    shifts = torch.arange(8, device=raw.device, dtype=torch.uint8)
    return ((raw.unsqueeze(-1) >> shifts) & 1).reshape(raw.shape[0], -1)


def t_nibbles(raw: torch.Tensor) -> torch.Tensor:
    """``(B, n)`` uint8 -> ``(B, 2n)``: all low nibbles, then all high nibbles."""
    return torch.cat([raw & 0x0F, raw >> 4], dim=1)
