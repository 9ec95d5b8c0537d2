"""The non-linear 4-bit formats: IQ4_NL (blocks of 32) and IQ4_XS (super-blocks of 256).

Both store 4-bit indices into ggml's table ``kvalues_iq4nl`` (16 int8 levels, denser near
zero) and a scale per 32 weights: a value is ``scale * KVALUES[index]``. IQ4_NL keeps the
scale as one f16 a block (``d:f16 qs[16]``, 18 bytes); IQ4_XS keeps an f16 ``d`` a
super-block and a 6-bit signed multiple of it per 32 (``d:f16 scales_h:u16 scales_l[4]
qs[128]``, 136 bytes; sub-block ``ib`` has scale ``d * (ls - 32)``, ``ls`` its low nibble
from ``scales_l[ib / 2]`` and its two high bits from ``scales_h``). Nibble ``j`` of a
sub-block's 16 bytes holds element ``j`` (low) and ``j + 16`` (high), as in Q4_0.

Quantizers transcribe llama.cpp's ``quantize_row_iq4_nl_impl`` (ggml-quants.c) without an
importance matrix (weights ``x * x``, seven trial scales either side), the path
``llama_model_quantize`` and ``ggml_quantize_chunk`` take, vectorized over sub-blocks with
the C code's float32 rounding and sequential sums, so the bytes match llama.cpp (tested
against ``ggml_quantize_chunk`` from llama-cpp-python); dequantization is tested against
gguf-py. Their dot products take Q8_0 (IQ4_NL) and Q8_K (IQ4_XS) activations, as ggml's.

Working layout as in ``kquants``: a sub-block's 32 values run down axis 0 of a ``(32, S)``
array, one column per sub-block.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import BlockFormat
from .common import F32, f16_bytes, first_absmax, nearest_int, pack, seqsum, t_f16, t_nibbles
from .kquants import GROUP_MAX_EPS

KVALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)
_LEVELS = KVALUES.astype(F32)
_NTRY = 7


def best_index(v: np.ndarray) -> np.ndarray:
    """ggml's ``best_index_int8(16, kvalues_iq4nl, v)``: the nearest level's index (the upper
    one on a tie; NaN gives 15, as the C binary search does)."""
    mu = np.clip(np.searchsorted(_LEVELS, v, side="right"), 1, 15)
    idx = np.where(v - _LEVELS[mu - 1] < _LEVELS[mu] - v, mu - 1, mu)
    return np.where(v <= _LEVELS[0], 0, np.where(v >= _LEVELS[15], 15, idx))


def _sums(xs: np.ndarray, w: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``sumqx += w*q*x; sumq2 += w*q*q`` down each column, in the C loop's order."""
    q = _LEVELS[idx]
    wq = w * q
    return seqsum(wq * xs), seqsum(wq * q)


def _block_scales(xs: np.ndarray) -> np.ndarray:
    """The first loop of ``quantize_row_iq4_nl_impl``: each sub-block's (column's) scale
    after the trial search; 0 where its largest magnitude is below ``GROUP_MAX_EPS``."""
    w = xs * xs
    vmax = first_absmax(xs, axis=0)
    small = np.abs(vmax) < GROUP_MAX_EPS
    vmax = np.where(small, F32(1), vmax)
    d = -vmax / _LEVELS[0]
    sumqx, sumq2 = _sums(xs, w, best_index((F32(1) / d) * xs))
    d = sumqx / sumq2
    best = d * sumqx
    for itry in range(-_NTRY, _NTRY + 1):
        inv = F32(itry + int(KVALUES[0])) / vmax
        sumqx, sumq2 = _sums(xs, w, best_index(inv * xs))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        with np.errstate(all="ignore"):
            trial = sumqx / sumq2
        d = np.where(better, trial, d)
        best = np.where(better, trial * sumqx, best)
    return np.where(small, F32(0), d)


def _inv_or_zero(d: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.where(d != 0, F32(1) / d, F32(0)).astype(F32)


def _nibble_bytes(idx: np.ndarray) -> np.ndarray:
    """``(32, S)`` indices -> ``(S, 16)`` bytes: element j low, element j + 16 high."""
    return (idx[:16] | (idx[16:] << 4)).T.astype(np.uint8)


class IQ4_NL(BlockFormat, type_name="IQ4_NL"):
    """``d:f16 qs[16]``: 32 indices into ``KVALUES`` and one scale."""

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        xs = np.ascontiguousarray(x.T, dtype=F32)
        d = _block_scales(xs)
        idx = best_index(_inv_or_zero(d) * xs)
        return pack(f16_bytes(d), _nibble_bytes(idx))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return _levels(t_nibbles(b[:, 2:18]), b.device), t_f16(b, 0), None


class IQ4_XS(BlockFormat, type_name="IQ4_XS"):
    """``d:f16 scales_h:u16 scales_l[4] qs[128]``: 8 sub-blocks of 32 indices into
    ``KVALUES``, each scaled by ``d * (ls - 32)`` (``ls`` 6 bits)."""

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        B = x.shape[0]
        xs = np.ascontiguousarray(x.reshape(-1, 32).T, dtype=F32)
        scales = _block_scales(xs).reshape(B, 8)
        max_scale = first_absmax(scales, axis=1)
        d = -max_scale / F32(32)
        ls = np.clip(nearest_int(_inv_or_zero(d)[:, None] * scales), -32, 31)
        dl = d[:, None] * ls.astype(F32)
        idx = best_index(_inv_or_zero(dl).reshape(1, -1) * xs)
        ls = (ls + 32).astype(np.uint16)
        low = (ls & 0xF).astype(np.uint8)
        scales_l = low[:, 0::2] | (low[:, 1::2] << 4)
        scales_h = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1, dtype=np.uint16)
        return pack(f16_bytes(d), scales_h.astype("<u2"), scales_l, _nibble_bytes(idx))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        d = t_f16(b, 0)
        h = b[:, 2].int() | (b[:, 3].int() << 8)
        sub = torch.arange(8, device=b.device)
        low = (b[:, 4:8].int().repeat_interleave(2, dim=1) >> (4 * (sub % 2))) & 0xF
        ls = low | (((h.unsqueeze(1) >> (2 * sub)) & 3) << 4)
        nib = t_nibbles(b[:, 8:136].reshape(-1, 16)).reshape(b.shape[0], 256)
        return _levels(nib, b.device), d * (ls - 32).float(), None


def _levels(nibbles: torch.Tensor, device) -> torch.Tensor:
    """Indices (uint8) -> their ``KVALUES`` levels (int8)."""
    return torch.from_numpy(KVALUES).to(device)[nibbles.long()]


def nl_as_q8_0(blocks: torch.Tensor, chunk: int = 1 << 16) -> torch.Tensor:
    """IQ4_NL blocks ``(B, 18)`` as Q8_0 blocks ``(B, 34)`` of the same values: the same f16
    ``d`` and each index's level as the int8 code (every level is in -127..113). ggml's
    IQ4_NL dot product is Q8_0's with those codes (Q8_0 activations, ``d_w d_a`` times the
    block's integer sum), so kernels without an IQ4_NL layout run it on their Q8_0 ones,
    exactly, at 34 bytes a block instead of 18 (the CUDA engine; the CPU's where 16-row panels
    do not fit). ``chunk`` blocks at a time (the byte indices are int64)."""
    out = torch.empty((blocks.shape[0], 34), dtype=torch.uint8, device=blocks.device)
    out[:, :2] = blocks[:, :2]
    lut = _pair_levels(blocks.device)
    for i in range(0, blocks.shape[0], chunk):
        pairs = lut[blocks[i : i + chunk, 2:18].long()]  # (b, 16, 2): element j, j + 16
        out[i : i + chunk, 2:].view(-1, 2, 16).copy_(pairs.transpose(1, 2))
    return out


def _pair_levels(device) -> torch.Tensor:
    """``(256, 2)`` uint8: a qs byte's two levels (low nibble's, high nibble's) as int8 bytes."""
    b = np.arange(256)
    return torch.from_numpy(np.stack([KVALUES[b & 15], KVALUES[b >> 4]], 1).view(np.uint8)).to(
        device
    )
