"""The FP4 formats and the 1-bit one: MXFP4, NVFP4 (4-bit E2M1 codes) and Q1_0 (a sign a weight).

* **MXFP4** (``e:u8 qs[16]``, 32 weights): a value is ``KVALUES_MXFP4[index] * 2^(e - 128)``
  (an E8M0 exponent; ggml's ``GGML_E8M0_TO_FP32_HALF``, since the table holds E2M1 values
  doubled: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives). Nibble ``j`` of ``qs``: element ``j``
  low, ``j + 16`` high.
* **NVFP4** (``d:u8[4] qs[32]``, 64 weights): four groups of 16, each with an unsigned E4M3
  scale (``ue4m3``: 4 exponent bits, bias 7, 3 mantissa bits; ggml halves it for the doubled
  table); group ``s``'s 8 bytes hold its element ``j`` low and ``j + 8`` high.
* **Q1_0** (``d:f16 qs[16]``, 128 weights): bit ``j`` set is ``+d``, clear ``-d``.

Quantizers transcribe ggml's ``quantize_row_{mxfp4,nvfp4,q1_0}_ref`` (the E8M0 exponent of
the block's largest magnitude less 2; the E4M3 of each group's largest magnitude / 6; the mean
magnitude) with the nearest table value (first of ties); the tests hold them to ggml's bytes.
Their dot products take Q8_0 activations, as ggml's (``activations.VEC_DOT_TYPE``).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import FORMATS, BlockFormat
from .common import F32, bits_to_bytes, f16_bytes, pack, t_bits, t_f16, t_nibbles

KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def e8m0_half(e: np.ndarray | torch.Tensor):
    """``2^(e - 128)`` as float32 (ggml's ``GGML_E8M0_TO_FP32_HALF``: exact, subnormal below
    ``e = 2``), NumPy or torch."""
    if isinstance(e, torch.Tensor):
        e = e.to(torch.int32)
        bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
        return bits.view(torch.float32)
    e = np.asarray(e, dtype=np.uint32)
    return np.where(e < 2, np.uint32(0x00200000) << e, (e - 1) << np.uint32(23)).view(F32)


def ue4m3_to_f32(x: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_ue4m3_to_fp32``: the unsigned E4M3 byte's value halved (0 for 0 and
    0x7F), float32, exact."""
    x = x.to(torch.int32)
    exp, man = (x >> 3) & 0xF, (x & 7).float()
    raw = torch.where(exp == 0, man * 2.0**-9, (1 + man / 8) * torch.exp2((exp - 7).float()))
    return torch.where((x == 0) | (x == 0x7F), torch.zeros_like(raw), raw * 0.5)


def _f32_to_ue4m3(x: np.ndarray) -> np.ndarray:
    """ggml's ``ggml_fp32_to_ue4m3`` (round half up on the fourth mantissa bit; saturating
    at 0x7E; subnormals ``(int)(x * 512 + 0.5)``), uint8."""
    x = np.minimum(np.where(x > 0, x, F32(0)), F32(448)).astype(F32)
    bits = x.view(np.uint32).astype(np.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = ((bits >> 20) & 7) + ((bits >> 19) & 1)
    exp, man = np.where(man > 7, exp + 1, exp), np.where(man > 7, 0, man)
    normal = np.where(exp >= 15, 0x7E, (exp << 3) | man)
    sub = np.minimum((x * F32(512) + F32(0.5)).astype(np.int64), 7)  # C's truncation
    sub = np.where(sub < 1, 0, sub)
    out = np.where(((bits >> 23) & 0xFF) - 127 + 7 <= 0, sub, normal)
    return np.where(x > 0, out, 0).astype(np.uint8)


def _ue4m3_np(u: np.ndarray) -> np.ndarray:
    return ue4m3_to_f32(torch.from_numpy(np.ascontiguousarray(u))).numpy()


def _best_index(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """ggml's ``best_index_mxfp4``: the index of the table value ``k * d`` nearest ``x`` (the
    first of equals), ``x`` ``(..., n)`` and ``d`` ``(..., 1)``."""
    err = np.abs(KVALUES_MXFP4.astype(F32) * d[..., None] - x[..., None])
    return err.argmin(axis=-1).astype(np.uint8)


def _absmax(x: np.ndarray) -> np.ndarray:
    """``amax = 0; if (amax < fabsf(v)) amax = fabsf(v)`` over the last axis."""
    return np.fmax.reduce(np.abs(x), axis=-1, initial=F32(0))


def _levels(nibbles: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(KVALUES_MXFP4).to(nibbles.device)[nibbles.long()]


class MXFP4(BlockFormat, type_name="MXFP4"):
    """``e:u8 qs[16]``: 32 E2M1 codes under one power-of-two scale."""

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=F32)
        amax = _absmax(x)
        with np.errstate(divide="ignore"):  # log2 in float64, rounded once: as log2f's result
            log2 = np.log2(amax.astype(np.float64)).astype(F32)
        e = np.where(amax > 0, np.floor(log2) - 2 + 127, 0).astype(np.int64).astype(np.uint8)
        idx = _best_index(x, e8m0_half(e)[:, None])
        return pack(e[:, None], idx[:, :16] | (idx[:, 16:] << 4))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return _levels(t_nibbles(b[:, 1:17])), e8m0_half(b[:, :1]), None


class NVFP4(BlockFormat, type_name="NVFP4"):
    """``d:u8[4] qs[32]``: four groups of 16 E2M1 codes, each under an unsigned E4M3 scale."""

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        xs = np.asarray(x, dtype=F32).reshape(-1, 4, 16)
        ue = _f32_to_ue4m3(_absmax(xs) / F32(6))
        idx = _best_index(xs, _ue4m3_np(ue)[..., None])
        return pack(ue, idx[..., :8] | (idx[..., 8:] << 4))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        nib = t_nibbles(b[:, 4:36].reshape(-1, 8)).reshape(b.shape[0], 64)
        return _levels(nib), ue4m3_to_f32(b[:, :4]), None


class Q1_0(BlockFormat, type_name="Q1_0"):
    """``d:f16 qs[16]``: 128 signs under one scale."""

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=F32)
        total = np.zeros(x.shape[0], F32)
        for col in np.abs(x).T:  # the C loop's order: left to right in float32
            total += col
        return pack(f16_bytes(total / F32(128)), bits_to_bytes(x >= 0))

    @classmethod
    def unpack(cls, b: torch.Tensor):
        return t_bits(b[:, 2:18]).to(torch.int8) * 2 - 1, t_f16(b, 0), None


# The legacy type each one's values are exactly: MXFP4's codes (-12..12) as Q5_0's (-16..15),
# Q1_0's (+-1) as Q4_0's (-8..7), each 32 weights under one f16 d
LEGACY_FORM = {"MXFP4": "Q5_0", "Q1_0": "Q4_0"}


def as_legacy(blocks: torch.Tensor, type_name: str, chunk: int = 1 << 14) -> torch.Tensor | None:
    """MXFP4 or Q1_0 blocks ``(B, bytes)`` as ``LEGACY_FORM`` blocks (Q5_0 ``d qh[4] qs[16]``,
    Q4_0 ``d qs[16]``) of exactly the same values: per 32 weights the scale as the f16 ``d`` and
    the codes plus 16 (8) as the 5-bit (4-bit) codes. ggml's dot products of all four take
    Q8_0 activations and scale each 32's integer sum by ``d_w d_a``, so those kernels run them
    exactly, at 5.5 and 4.5 bits a weight (against 4.25 and 1.125). None for an MXFP4 tensor
    with a scale outside f16's range (``2^-24 .. 2^15``) under a block that is not all zeros.
    ``chunk`` blocks at a time (a 1B model's output matrix holds 100 M weights)."""
    five = LEGACY_FORM[type_name] == "Q5_0"
    per = FORMATS[type_name].block_size // 32  # legacy blocks a block
    out = torch.empty((blocks.shape[0] * per, 22 if five else 18), dtype=torch.uint8,
                      device=blocks.device)  # fmt: skip
    for i in range(0, blocks.shape[0], chunk):
        codes, scale, _ = FORMATS[type_name].unpack(blocks[i : i + chunk])
        d = scale.repeat_interleave(per // scale.shape[1], dim=1).reshape(-1, 1)
        q = codes.reshape(-1, 32).to(torch.uint8) + (16 if five else 8)  # (wraps back to 0..31)
        d = torch.where((q == (16 if five else 8)).all(1, keepdim=True), 0.0, d)  # zeros
        d16 = d.to(torch.float16)
        if not (d16.float() == d).all():
            return None
        dst = out[i * per : (i + chunk) * per]
        dst[:, :2] = d16.view(torch.uint8)
        dst[:, -16:] = (q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)  # element j low, j + 16 high
        if five:  # qh: bit j of the little-endian word is element j's fifth bit
            bits = (q >> 4).view(-1, 4, 8) << torch.arange(8, dtype=torch.uint8, device=q.device)
            dst[:, 2:6] = bits.sum(2, dtype=torch.uint8)
    return out.reshape(blocks.shape[0], -1)
