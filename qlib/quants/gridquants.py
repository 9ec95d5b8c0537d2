"""The i-quants whose codes index a grid (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S) and the ternary types (TQ1_0, TQ2_0): read, dequantized, multiplied; not written.

Every one is a super-block of 256 weights whose value is ``scale * code`` with an integer
code and a float32 scale per group of 16, 32 or 256 weights, so the engines take them as
they take the K-quants (``BlockFormat.unpack``):

* **IQ2_XXS / IQ2_XS / IQ2_S, IQ3_XXS / IQ3_S**: eight (IQ3: four) magnitudes at a time are
  one entry of a fixed grid (``_grid_np``: 256 to 1024 entries of values 8 / 25 / 43, 4..62 or
  1..15), with a sign bit each; IQ2_XXS, IQ2_XS and IQ3_XXS store seven sign bits and take
  the eighth from their parity (``_ksigns``). Scales: ``d * (0.5 + ls) / 4`` (IQ2, per 32 or
  16), ``d * (0.5 + ls) / 2`` (IQ3_XXS, per 32), ``d * (1 + 2 ls)`` (IQ3_S, per 32).
* **IQ1_S / IQ1_M**: eight values from a grid of -1 / 0 / +1 plus a shift of +-1/8 (one
  sign per 32, IQ1_S; per 8, IQ1_M): the code here is ``8 g +- 1`` and the scale
  ``d (2 s + 1) / 8`` (per 32 or 16; IQ1_M keeps its f16 ``d`` in its scales' top nibbles).
  ``dl * (g + delta)`` and ``(dl / 8) * (8 g + 1)`` are the same real product, rounded once.
* **TQ1_0 / TQ2_0**: codes -1 / 0 / +1 (five a byte in base 3, or four a byte in 2 bits)
  and one f16 ``d`` a block.

Field layouts and arithmetic follow ggml's ``dequantize_row_*`` (ggml-quants.c); the tests
hold the values to ggml's own ``to_float`` (llama-cpp-python) and to gguf-py. The grids are
data of the format (ggml-common.h's ``iq2xxs_grid`` ...): read from the ``gguf`` package,
which carries them. ggml quantizes these types with a search that needs an importance matrix
for most of them; qlib does not write them (``llama-quantize`` does).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .base import FORMATS, BlockFormat
from .common import t_f16
from .fp4 import KVALUES_MXFP4
from .iquants import KVALUES

GRID_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")
TERNARY_TYPES = ("TQ1_0", "TQ2_0")
IQ1_DELTA = 0.125  # ggml's IQ1S_DELTA and IQ1M_DELTA


@functools.cache
def _grid_np(type_name: str) -> np.ndarray:
    """``(entries, 8 or 4)`` int8: the type's grid, as the ``gguf`` package holds it."""
    try:
        from gguf import quants
    except ImportError as e:  # a core dependency; only a broken install lacks it
        raise NotImplementedError(
            f"{type_name} needs the grid tables of the 'gguf' package (pip install gguf)"
        ) from e
    cls = getattr(quants, "IQ1_S" if type_name == "IQ1_M" else type_name)
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape).astype(np.int8)


@functools.cache
def _tables(type_name: str, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(grid ``(entries, w)``, sign table ``(256, 8)``) on ``device``, int8 (a code is at most
    62 in magnitude)."""
    grid = torch.from_numpy(_grid_np(type_name)).to(device)
    bits = (np.arange(256)[:, None] >> np.arange(8)) & 1
    signs = torch.from_numpy((1 - 2 * bits).astype(np.int8)).to(device)  # bit j: element j < 0
    return grid, signs


_KSIGNS = np.array([i | (bin(i).count("1") & 1) << 7 for i in range(128)])


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """ggml's ``ksigns_iq2xs``: seven stored sign bits and an eighth that makes their count
    even (a table of 128 sign bytes)."""
    return torch.from_numpy(_KSIGNS).to(index.device)[index.long()]


def _u16(b: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """``count`` little-endian uint16 at byte ``offset`` of each block, as int32."""
    raw = b[:, offset : offset + 2 * count].to(torch.int32).view(b.shape[0], count, 2)
    return raw[..., 0] | (raw[..., 1] << 8)


def _words(raw: torch.Tensor) -> torch.Tensor:
    """``(..., 4)`` bytes -> ``(...)``: their little-endian uint32, as int64."""
    w = raw.to(torch.int64)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def _signed(grid: torch.Tensor, signs: torch.Tensor, index, sign_bytes) -> torch.Tensor:
    """Grid rows ``index`` times the signs of ``sign_bytes`` (same leading shape)."""
    return grid[index.long()] * signs[sign_bytes.long()]


def _scales(d: torch.Tensor, ls: torch.Tensor, factor: float) -> torch.Tensor:
    """``d * (0.5 + ls) * factor`` in float32, as ggml orders it."""
    return d * (0.5 + ls.float()) * factor


class IQ2_XXS(BlockFormat, type_name="IQ2_XXS"):
    """``d:f16 qs:u16[32]``; per 32 weights two words: four grid indices (bytes), then four
    7-bit sign indices and the scale's 4 bits (top)."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, signs = _tables(cls.name, b.device.type)
        q = b[:, 2:66].reshape(-1, 8, 8)
        aux = _words(q[:, :, 4:8])  # (B, 8): the second word of each 32
        shifts = torch.arange(0, 28, 7, device=b.device)
        codes = _signed(grid, signs, q[:, :, :4], _ksigns((aux[..., None] >> shifts) & 127))
        return codes.reshape(-1, 256), _scales(t_f16(b, 0), aux >> 28, 0.25), None


class IQ2_XS(BlockFormat, type_name="IQ2_XS"):
    """``d:f16 qs:u16[32] scales[8]``; each word a 9-bit grid index and a 7-bit sign index,
    a 4-bit scale per 16."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, signs = _tables(cls.name, b.device.type)
        qs = _u16(b, 2, 32)
        codes = _signed(grid, signs, qs & 511, _ksigns(qs >> 9))
        return codes.reshape(-1, 256), _scales(t_f16(b, 0), _nibble_scales(b[:, 66:74]), 0.25), None


class IQ2_S(BlockFormat, type_name="IQ2_S"):
    """``d:f16 qs[32] signs[32] qh[8] scales[8]``; 10-bit grid indices (2 high bits each
    from ``qh``), a full sign byte per 8, a 4-bit scale per 16."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, signs = _tables(cls.name, b.device.type)
        low = b[:, 2:34].to(torch.int32).view(-1, 8, 4)
        qh = b[:, 66:74].to(torch.int32)[..., None]
        shifts = torch.arange(8, 0, -2, device=b.device, dtype=torch.int32)
        index = low | ((qh << shifts) & 0x300)
        codes = _signed(grid, signs, index, b[:, 34:66].view(-1, 8, 4))
        return codes.reshape(-1, 256), _scales(t_f16(b, 0), _nibble_scales(b[:, 74:82]), 0.25), None


class IQ3_XXS(BlockFormat, type_name="IQ3_XXS"):
    """``d:f16 qs[64] scales_signs:u32[8]``; per 32 weights eight grid indices (4 values
    each) and one word: four 7-bit sign indices, the scale's 4 bits (top)."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, signs = _tables(cls.name, b.device.type)
        aux = _words(b[:, 66:98].reshape(-1, 8, 4))
        shifts = torch.arange(0, 28, 7, device=b.device)
        sign_bytes = _ksigns((aux[..., None] >> shifts) & 127)  # (B, 8, 4)
        values = grid[b[:, 2:66].long()].view(-1, 8, 4, 8)  # two grid rows per sign byte
        codes = values * signs[sign_bytes.long()]
        return codes.reshape(-1, 256), _scales(t_f16(b, 0), aux >> 28, 0.5), None


class IQ3_S(BlockFormat, type_name="IQ3_S"):
    """``d:f16 qs[64] qh[8] signs[32] scales[4]``; 9-bit grid indices (the ninth from
    ``qh``), a sign byte per 8, a 4-bit scale ``1 + 2 ls`` per 32."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, signs = _tables(cls.name, b.device.type)
        low = b[:, 2:66].to(torch.int32).view(-1, 8, 8)
        qh = b[:, 66:74].to(torch.int32)[..., None]
        # index p (of 8 per 32 weights) takes bit p of qh as its ninth bit (shift 8 - p)
        shifts = 8 - torch.arange(8, device=b.device, dtype=torch.int32)
        index = low | ((qh << shifts) & 256)
        values = grid[index.long()].view(-1, 8, 4, 8)
        codes = values * signs[b[:, 74:106].view(-1, 8, 4).long()]
        ls = _nibble_scales(b[:, 106:110])
        scale = t_f16(b, 0) * (1 + 2 * ls).float()
        return codes.reshape(-1, 256), scale, None


class IQ1_S(BlockFormat, type_name="IQ1_S"):
    """``d:f16 qs[32] qh:u16[8]``; 11-bit grid indices (3 high bits from ``qh``), per 32
    a 3-bit scale and the shift's sign (``qh``'s top bits)."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, _ = _tables(cls.name, b.device.type)
        qh = _u16(b, 34, 8)  # (B, 8)
        shifts = torch.arange(0, 12, 3, device=b.device, dtype=torch.int32)
        index = b[:, 2:34].to(torch.int32).view(-1, 8, 4) | (((qh[..., None] >> shifts) & 7) << 8)
        shift = 1 - 2 * ((qh >> 15) & 1)  # +1 or -1: the shift's eighths
        codes = 8 * grid[index.long()] + shift[..., None, None]
        dl = t_f16(b, 0) * (2 * ((qh >> 12) & 7) + 1).float()
        return codes.reshape(-1, 256), dl * IQ1_DELTA, None


class IQ1_M(BlockFormat, type_name="IQ1_M"):
    """``qs[32] qh[16] scales:u16[4]``; 11-bit grid indices (3 high bits from ``qh``), the
    shift's sign per 8, 3-bit scales per 16, and ``d`` (f16) in the scales' top nibbles."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        grid, _ = _tables(cls.name, b.device.type)
        sc = _u16(b, 48, 4)  # (B, 4)
        d = _iq1_m_d(sc)
        qh = b[:, 32:48].to(torch.int32).view(-1, 8, 2, 1)  # two bytes per 32
        halves = torch.tensor([8, 4], device=b.device).view(1, 1, 1, 2)
        index = b[:, 0:32].to(torch.int32).view(-1, 8, 2, 2) | ((qh << halves) & 0x700)
        shift = 1 - 2 * ((qh >> torch.tensor([3, 7], device=b.device)) & 1)  # (B, 8, 2, 2)
        codes = 8 * grid[index.long()] + shift[..., None]
        s = sc.repeat_interleave(2, dim=1) >> torch.tensor([0, 6], device=b.device).repeat(4)
        ls = torch.stack([s & 7, (s >> 3) & 7], dim=2).reshape(-1, 16)  # per 16
        return codes.reshape(-1, 256), d * (2 * ls + 1).float() * IQ1_DELTA, None


def _iq1_m_d(sc: torch.Tensor) -> torch.Tensor:
    """IQ1_M's f16 ``d`` from the top nibbles of its four scale words, float32 ``(B, 1)``."""
    bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00)
    bits = bits | (sc[:, 3] & 0xF000)
    bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits)  # as int16
    return bits.to(torch.int16).view(torch.float16).float()[:, None]


class TQ1_0(BlockFormat, type_name="TQ1_0"):
    """``qs[48] qh[4] d:f16``: 240 codes five a byte in base 3 (``qs``; the top digit first,
    read as ``(byte * 3^n mod 256) * 3 >> 8``), 16 four a byte (``qh``); values ``d (t - 1)``."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        pow3 = torch.tensor([1, 3, 9, 27, 81], device=b.device, dtype=torch.int32)

        def digits(raw: torch.Tensor, n: int) -> torch.Tensor:  # (B, bytes) -> (B, n * bytes)
            q = (raw.to(torch.int32)[:, None, :] * pow3[:n, None]) & 255
            return ((q * 3) >> 8).reshape(raw.shape[0], -1)

        t = torch.cat([digits(b[:, 0:32], 5), digits(b[:, 32:48], 5), digits(b[:, 48:52], 4)], 1)
        return t - 1, t_f16(b, 52), None


class TQ2_0(BlockFormat, type_name="TQ2_0"):
    """``qs[64] d:f16``: 2-bit codes ``t``, four a byte (element ``128 h + 32 l + m`` in
    bits ``2l`` of byte ``32 h + m``); values ``d (t - 1)``."""

    @classmethod
    def unpack(cls, b: torch.Tensor):
        shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
        t = (b[:, 0:64].view(-1, 2, 1, 32) >> shifts) & 3
        return t.reshape(-1, 256).to(torch.int32) - 1, t_f16(b, 64), None


def _nibble_scales(raw: torch.Tensor) -> torch.Tensor:
    """Bytes of two 4-bit scales (low nibble first) -> ``(B, 2 * bytes)`` int32."""
    s = raw.to(torch.int32)
    return torch.stack([s & 0xF, s >> 4], dim=2).reshape(raw.shape[0], -1)


# The types whose values Q6_K holds exactly, and how: ``d`` / 2^shift as Q6_K's ``d``, the
# codes divided by ``div`` as its 6-bit codes, each group's scale x ``div`` / that ``d`` as
# its int8 scale (IQ3_XXS: codes 4..62 even, scale d (2 ls + 1) / 4 -> d / 2, 2 ls + 1, code
# / 2; IQ1_*: d (2 s + 1) / 8 -> d / 8, 2 s + 1; IQ3_S: d (2 ls + 1) as it is; TQ*: d, 1)
Q6_K_FORM: dict[str, tuple[int, int]] = {
    "IQ3_XXS": (1, 2), "IQ3_S": (0, 1), "IQ1_S": (3, 1), "IQ1_M": (3, 1),
    "TQ1_0": (0, 1), "TQ2_0": (0, 1),
}  # fmt: skip
_D_AT = {"TQ1_0": 52, "TQ2_0": 64}  # byte offset of d (else 0; IQ1_M: in its scales)


def block_d(blocks: torch.Tensor, type_name: str) -> torch.Tensor:
    """Each block's f16 ``d`` as float32 ``(B, 1)``."""
    if type_name == "IQ1_M":
        return _iq1_m_d(_u16(blocks, 48, 4))
    return t_f16(blocks, _D_AT.get(type_name, 0))


def _whole_scales(scale: torch.Tensor, unit: torch.Tensor) -> torch.Tensor | None:
    """Group scales ``(B, groups)`` as int8 multiples ``(B, 16)`` (per 16 weights) of each
    block's ``unit`` ``(B, 1)``, or None unless every one is exactly such a multiple."""
    scale = scale.repeat_interleave(16 // scale.shape[1], dim=1)
    sc = torch.where(unit == 0, torch.zeros_like(scale), scale / unit)
    if not ((sc == sc.round()) & (sc.abs() <= 127)).all() or (unit * sc != scale).any():
        return None
    return sc.to(torch.int8)


def as_q6_k(blocks: torch.Tensor, type_name: str, chunk: int = 1 << 15) -> torch.Tensor | None:
    """Blocks ``(B, bytes)`` of a ``Q6_K_FORM`` type as Q6_K blocks ``(B, 210)`` of exactly
    the same values (ggml dequantizes both as ``d * scale * code``), or None where a block
    does not fit (a ``d`` / 2^shift below f16's normal range: IQ3_XXS's small d, which is the
    common case there): the fused CUDA kernels' Q6_K planes then run it, at 6.56 bits a
    weight. ``chunk`` blocks at a time."""
    shift, div = Q6_K_FORM[type_name]
    d = block_d(blocks, type_name)
    d6 = (d / 2**shift).to(torch.float16)
    if not (d6.float() * 2**shift == d).all():  # (checked first: it needs no unpacking)
        return None
    out = torch.empty((blocks.shape[0], 210), dtype=torch.uint8, device=blocks.device)
    for i in range(0, blocks.shape[0], chunk):
        codes, scale, _ = FORMATS[type_name].unpack(blocks[i : i + chunk])
        sc = _whole_scales(scale * div, d6[i : i + chunk].float())
        q = codes if div == 1 else codes // div
        exact = div == 1 or (q * div == codes).all()
        if sc is None or not (exact and -32 <= q.min() <= q.max() <= 31):
            return None
        out[i : i + chunk] = q6_k_blocks(q, sc, d6[i : i + chunk])
    return out


# Every type here as qlib's X4 blocks (the C kernels', ``kquants.c``): ``qs[128]`` (4-bit
# indices, byte 32 c + j: element 64 c + j low, 64 c + 32 + j high), ``levels[16]`` (the
# type's codes + 64, ``x4_levels``), an int8 scale per 16, float32 ``d`` = the block's d x
# ``X4_UNIT``, so that d x scale is each group's scale exactly (IQ2: d (2 ls + 1) / 8; IQ3_XXS:
# d (2 ls + 1) / 4; IQ3_S: d (2 ls + 1); IQ1: d (2 s + 1) / 8; ternary: d x 1). Every one has
# at most 16 distinct codes (IQ3_XXS and IQ3_S exactly 16): 5.1 bits a weight.
X4_UNIT: dict[str, float] = {
    "IQ2_XXS": 0.125, "IQ2_XS": 0.125, "IQ2_S": 0.125, "IQ3_XXS": 0.25, "IQ3_S": 1.0,
    "IQ1_S": 0.125, "IQ1_M": 0.125, "TQ1_0": 1.0, "TQ2_0": 1.0,
}  # fmt: skip
X4_BYTES = 164
# X3: X4 for the types of at most 8 levels (``X3_TYPES``): ``qs[64]`` (the indices' low two
# bits, bits 2i of byte l: element 64 i + l), ``hb[32]`` (their third bits, bit e: element e),
# ``levels[8]``, the same scales and d: 3.9 bits a weight
X3_TYPES = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0")
X3_BYTES = 124


@functools.cache
def x4_levels(type_name: str) -> np.ndarray:
    """The codes a type can hold, ascending, as 16 int8 (the last repeated to fill): the
    grid's magnitudes with both signs, ``8 g +- 1`` for IQ1, -1 / 0 / 1 for the ternary
    (TQ2_0's 2 bits also hold a 2, which its quantizer never writes)."""
    if type_name in TERNARY_TYPES:
        codes = {-1, 0, 1, 2} if type_name == "TQ2_0" else {-1, 0, 1}
    elif type_name == "NVFP4":
        codes = {int(v) for v in KVALUES_MXFP4}
    elif type_name == "IQ4_XS":
        codes = {int(v) for v in KVALUES}
    elif type_name in ("IQ1_S", "IQ1_M"):
        codes = {8 * g + s for g in (-1, 0, 1) for s in (-1, 1)}
    else:
        codes = {sign * int(m) for m in np.unique(np.abs(_grid_np(type_name))) for sign in (-1, 1)}
    levels = sorted(codes)
    return np.array(levels + levels[-1:] * (16 - len(levels)), dtype=np.int8)


@functools.cache
def _x4_index(type_name: str) -> np.ndarray:
    """``(256,)`` uint8: the index in ``x4_levels`` of code ``c`` at ``c + 128`` (16: none; the
    first of the repeated last level, so that a type of at most 8 levels has indices below 8:
    X3's)."""
    lut = np.full(256, 16, dtype=np.uint8)
    levels = x4_levels(type_name).astype(np.int16)
    for i in reversed(range(16)):
        lut[levels[i] + 128] = i
    return lut


@functools.cache
def x4_tables(type_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the C expansion into X4 blocks (``cpu/gridx4.c``) reads for a grid or ternary
    type: its grid (int8 rows; one zero for the ternary types), the level index of code ``c``
    at ``c + 128`` and the 16 level bytes (codes + 64)."""
    grid = _grid_np(type_name) if type_name in GRID_TYPES else np.zeros((1, 8), np.int8)
    levels = (x4_levels(type_name).astype(np.int16) + 64).astype(np.uint8)
    return (torch.from_numpy(np.ascontiguousarray(grid)), torch.from_numpy(_x4_index(type_name)),
            torch.from_numpy(levels))  # fmt: skip


def _finest_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """Per row of scales ``(S, groups)`` the largest power of two that divides every one,
    ``(S, 1)``, for scales of at most 4 significant bits (NVFP4's E4M3: ``s = N 2^e``, N < 16)."""
    _, exp = torch.frexp(scale)  # scale = m 2^exp, 0.5 <= m < 1: m 16 is a whole N
    e = torch.where(scale > 0, exp - 4, torch.full_like(exp, 1 << 20)).amin(1, keepdim=True)
    return torch.ldexp(torch.ones(e.shape), torch.where(e == 1 << 20, 0, e))


# The CUDA kernels' table form (``cuda.layout``) of every type whose weights are a block's
# unit x an int8 scale per 16 x one of 16 levels: X4's parts (the grid and ternary types), and
# IQ4_XS (the unit its d, ls - 32 per 32, its 16 KVALUES levels)
TABLE_TYPES = (*X4_UNIT, "IQ4_XS")


def table_form(blocks: torch.Tensor, type_name: str):
    """Blocks ``(B, bytes)`` of a ``TABLE_TYPES`` type (or NVFP4: four blocks of 64 a 256) as
    ``(index, scales, unit)`` per 256 weights: each weight's index into ``x4_levels`` (uint8
    ``(B, 256)``), the int8 scale of each 16 ``(B, 16)`` and the float32 unit ``(B, 1)``, every
    weight ``unit * scale * level`` exactly (X4's parts, ``as_x4``); None if a scale is no
    integer multiple (<= 127) of the unit: a non-finite d, or NVFP4 scales of one 256 more
    than 2^3 apart."""
    codes, scale, _ = FORMATS[type_name].unpack(blocks)
    if type_name == "NVFP4":  # the unit: the finest power of two of the super-block's scales
        codes, scale = codes.reshape(-1, 256), scale.reshape(-1, 16)
        unit = _finest_power_of_two(scale)
    else:
        unit = block_d(blocks, type_name) * X4_UNIT.get(type_name, 1.0)  # a power of 2 (or 1)
    sc = _whole_scales(scale, unit)
    if sc is None:
        return None
    # code -> index, looked up by the code's byte with its sign bit flipped (code + 128), in
    # NumPy (uint8 indices as they are; torch's would be widened to int64 first)
    index = _x4_index(type_name)[codes.to(torch.int8).cpu().numpy().view(np.uint8) ^ 0x80]
    if (index == 16).any():
        return None
    return torch.from_numpy(index).to(blocks.device), sc, unit


def as_x4(blocks: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """Blocks ``(B, bytes)`` of an ``X4_UNIT`` type, or NVFP4 (four blocks of 64 a super-block
    of 256), as X4 blocks ``(B, 164)`` (``(B / 4, 164)``) of exactly the same values; None if a
    scale is not an integer multiple (<= 127) of the unit: a non-finite d (not for blocks ggml
    writes), or NVFP4 scales of one super-block more than 2^3 apart."""
    parts = table_form(blocks, type_name)
    if parts is None:
        return None
    index, sc, unit = parts
    levels = x4_levels(type_name)
    idx = index.view(-1, 4, 2, 32)
    qs = (idx[:, :, 0] | (idx[:, :, 1] << 4)).reshape(-1, 128)
    level_bytes = (
        torch.from_numpy((levels.astype(np.int16) + 64).astype(np.uint8))
        .to(blocks.device)
        .expand(qs.shape[0], 16)
    )
    return torch.cat([qs, level_bytes, sc.view(torch.uint8),
                      unit.view(torch.uint8).reshape(-1, 4)], 1)  # fmt: skip


def x3_from_x4(x4: torch.Tensor) -> torch.Tensor:
    """X4 blocks ``(B, 164)`` whose indices are all below 8 (an ``X3_TYPES`` type's) as X3
    blocks ``(B, 124)`` of the same values."""
    nib = x4[:, :128].reshape(-1, 4, 32)  # byte 32 c + j: element 64 c + j low, + 32 high
    index = torch.cat([nib & 15, nib >> 4], dim=2)  # (B, 4, 64): element 64 c + l
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=x4.device).view(1, 4, 1)
    low = ((index & 3) << shifts).sum(1, dtype=torch.uint8)  # disjoint bits: a sum is an or
    bits = torch.arange(8, dtype=torch.uint8, device=x4.device)
    high = ((index >> 2).reshape(-1, 32, 8) << bits).sum(2, dtype=torch.uint8)
    return torch.cat([low, high, x4[:, 128:136], x4[:, 144:164]], 1)


def q6_k_blocks(q: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks ``(B, 210)`` from codes ``(B, 256)`` in -32..31, int8 scales ``(B, 16)``
    and f16 ``d`` ``(B, 1)``: ``ql[128] qh[64] scales[16] d`` (element ``128 h + 32 k + l``:
    its low nibble in byte ``64 h + 32 (k % 2) + l`` of ``ql``, low half when ``k < 2``; its
    two high bits at bit ``2 k`` of byte ``32 h + l`` of ``qh``)."""
    q6 = (q + 32).to(torch.uint8).view(-1, 2, 4, 32)  # [block, h, k, l]
    low = q6 & 0xF
    ql = torch.stack([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], 2)
    shifts = torch.tensor([0, 2, 4, 6], device=q.device, dtype=torch.uint8).view(1, 1, 4, 1)
    qh = ((q6 >> 4) << shifts).sum(dim=2, dtype=torch.uint8)  # disjoint bits: a sum is an or
    return torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(torch.uint8),
                      d.view(torch.uint8).reshape(-1, 2)], 1)  # fmt: skip
