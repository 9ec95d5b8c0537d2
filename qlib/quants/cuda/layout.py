"""How a weight's GGUF blocks are laid out for the CUDA kernels.

GGUF blocks are 18, 20, 22, 34, 84, 110, 210 bytes..., not 4-byte aligned, so ``prepare(w)``
repacks them once into planes (row-major, one row per weight row) that keep the GGUF
values bit for bit:

* ``qs``  uint8 ``[n, k/2]``: the low 4 bits of the codes; for each group of 32
  elements, 16 bytes where byte ``i`` holds element ``i`` (low nibble) and
  ``i + 16`` (high nibble): the GGUF order of Q4_0/Q4_1/Q5_x, and a reorder for
  the K-quants. Q8_0 instead keeps ``qs`` int8 ``[n, k]``; Q2_K and Q3_K keep
  the low 2 bits in uint8 ``[n, k/4]`` (8 bytes a group, byte ``j`` holding
  elements ``j, j+8, j+16, j+24`` at bits 0-1, 2-3, 4-5, 6-7: the layout of
  Q6_K's ``qh``).
* ``qh``  the high bits: Q5_x int32 ``[n, k/32]`` (bit ``j`` = fifth bit of
  element ``j`` of the group: GGUF's ``qh``), Q3_K the same for its third bit
  (GGUF's ``hmask``); Q6_K uint8 ``[n, k/4]`` (8 bytes a group, byte ``j``
  holding bits 4-5 of elements ``j, j+8, j+16, j+24``).
* ``d``/``dm`` float16: per group of 32 (Q4_0..Q8_0: d, and the min m of
  Q4_1/Q5_1), or per super-block of 256 (K-quants: d, dmin).
* ``sc``/``mn``: K-quant sub-block scales and mins, uint8 ``[n, k/32]`` (Q4_K,
  Q5_K, the 6-bit values unpacked), per 16 elements ``[n, k/16]``: int8 for the
  signed scales of Q6_K and Q3_K (Q3_K's 6-bit ``sc - 32``), uint8 for Q2_K's
  4-bit scales and mins.
* NVFP4: ``qs`` as above holds the E2M1 codes, indices into ``qh`` (int8 ``[16]``, ggml's
  doubled table ``kvalues_mxfp4``: 0, 1, 2, 3, 4, 6, 8, 12 and their negatives), ``d`` float16
  ``[n, k/16]`` the scale of each 16 (the E4M3 byte's value halved, as ggml's
  ``ggml_ue4m3_to_fp32``: exact in float16): 5 bits a weight.
* MXFP4: ``qs`` and ``qh`` as NVFP4's, ``d`` float32 ``[n, k/32]`` the scale of each 32 (the
  E8M0 exponent as ggml's ``GGML_E8M0_TO_FP32_HALF``: it may leave float16's range):
  5 bits a weight.
* IQ4_NL and the table types (``gridquants.TABLE_TYPES``: the grid i-quants, the ternary
  types, IQ4_XS): ``qs`` as Q4_0's, the indices of the type's 16 levels, which ``qh``
  holds (int8 ``[16]``: IQ4's KVALUES, ``gridquants.x4_levels``); IQ4_NL's ``d`` float16
  ``[n, k/32]``; the table types' ``d`` float32 ``[n, k/256]``, a super-block's unit, and
  ``sc`` int8 ``[n, k/16]``, each 16's multiple of it (``gridquants.table_form``): 4.5
  and 4.6 bits a weight. The table types of at most 8 levels (``gridquants.X3_TYPES``)
  keep 3-bit indices instead, as Q3_K's codes (``qs`` their low two bits, ``qh`` the
  third), and their 8 levels in ``mn``: 3.6 bits a weight.
* Q1_0: ``qs`` int32 ``[n, k/32]``, bit ``j`` of word ``g`` the sign of element
  ``32g + j`` (set: +1, clear: -1; GGUF's ``qs`` as it is), ``d`` float16
  ``[n, k/128]``: 1.125 bits a weight.

Codes are signed after the format's offset (``_OFFSET``: Q3_K ``q3 - 4``, with
``q3 = low2 | hmask bit << 2``); a value is ``code * scale + offset`` with
Q2_K's offset ``-dmin * m`` per 16 elements (two per 32-group).

The planes take about the bytes of the GGUF tensor (Q4_K/Q5_K a little more:
one byte per scale and min instead of 6 bits; Q3_K 4% more, Q2_K 19%: a byte
per 4-bit scale and min; the table types' 4.6 bits, 3.6 for those of at most 8
levels, up to 1.7 times their file's, the IQ2 family's 2.1-2.5). They are kept beside the
``QTensor`` (keyed on its ``data`` tensor, released with it); ``QTensor.data``
is never changed. ``dequantize_prepared`` is the pure-torch reading of the
planes that the kernels implement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..fp4 import KVALUES_MXFP4, e8m0_half, ue4m3_to_f32
from ..gridquants import TABLE_TYPES, X3_TYPES, table_form, x4_levels
from ..iquants import KVALUES
from ..types import ggml_type

_FORMATS: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "NVFP4",
    "Q1_0", "MXFP4", "IQ4_NL", "TABLE", "TABLE3",
)  # fmt: skip
# the GGUF types with kernels; the ``TABLE_TYPES`` share the two table formats, 4-bit indices
# and (``X3_TYPES``, at most 8 levels) 3-bit ones (ids stable: append; the table formats last)
NATIVE: tuple[str, ...] = (*_FORMATS[:-2], *TABLE_TYPES)
FORMAT_ID: dict[str, int] = {name: i for i, name in enumerate(_FORMATS[:-2])} | {
    t: len(_FORMATS) - (1 if t in X3_TYPES else 2) for t in TABLE_TYPES
}
# the epilogues of ``fused.norm_gemv`` (here, so that callers need not import Triton):
# store, add into y, SwiGLU of a stacked gate/up, gate (y holds the gate: silu(y) * x @ W.T)
EPI_STORE, EPI_ADD, EPI_SWIGLU, EPI_GATE = 0, 1, 2, 3
TABLE_CHUNK = 1 << 22  # weights of a table type unpacked at a time (``repack``)
_OFFSET = {"Q4_0": -8, "Q5_0": -16, "Q6_K": -32, "Q3_K": -4}  # symmetric formats: code - offset


@dataclass
class Prepared:
    """A weight repacked into GPU planes (see the module docstring for the layout)."""

    type_name: str
    n: int
    k: int
    qs: torch.Tensor
    qh: torch.Tensor | None = None
    d: torch.Tensor | None = None
    dm: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    mn: torch.Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False)  # launch arguments, per kernel module

    @property
    def format_id(self) -> int:
        return FORMAT_ID[self.type_name]

    @property
    def groups(self) -> int:
        return self.k // 32

    def nbytes(self) -> int:
        planes = (self.qs, self.qh, self.d, self.dm, self.sc, self.mn)
        return sum(t.numel() * t.element_size() for t in planes if t is not None)


# --- repacking GGUF blocks into planes (pure torch, any device) ---------------------------


def _field(blocks: torch.Tensor, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """One scalar field of every block: ``[n, nb, T]`` uint8 -> ``[n, nb]`` of ``dtype``."""
    size = torch.empty((), dtype=dtype).element_size()
    return blocks[..., offset : offset + size].contiguous().view(dtype).squeeze(-1)


def _nibble_plane(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[n, k]`` (< 16) -> ``[n, k/2]``: per 32-group, byte i = code i | code i+16 << 4."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def _crumb_plane(codes: torch.Tensor) -> torch.Tensor:
    """2-bit values ``[n, k]`` -> ``[n, k/4]``: per 32-group, byte j = values j, j+8, j+16, j+24
    at bits 0, 2, 4, 6."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 4, 8)  # [.., group, e // 8, e % 8]
    out = c[:, :, 0] | (c[:, :, 1] << 2) | (c[:, :, 2] << 4) | (c[:, :, 3] << 6)
    return out.reshape(n, k // 4).contiguous()


def _kquant_2bit(raw: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Q2_K/Q3_K ``qs`` bytes ``[n, nb, 64]`` -> codes ``[n, k]`` (< 4): element
    ``128c + 32j + l`` is bits ``2j`` of byte ``32c + l``."""
    shifts = torch.tensor([0, 2, 4, 6], device=raw.device, dtype=torch.uint8).view(1, 1, 1, 4, 1)
    return ((raw.reshape(n, -1, 2, 1, 32) >> shifts) & 3).reshape(n, k)


def _bit_plane(bits: torch.Tensor) -> torch.Tensor:
    """Bits ``[n, k]`` (0/1) -> int32 ``[n, k/32]``, bit j of word g = element 32g + j."""
    n, k = bits.shape
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    words = (bits.reshape(n, k // 32, 32).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _kquant_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12 scale bytes ``[n, nb, 12]`` -> 6-bit scales, mins ``[n, nb, 8]`` (uint8)."""
    lo, mid, hi = raw[..., 0:4], raw[..., 4:8], raw[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def repack(data: torch.Tensor, type_name: str, shape: tuple[int, int]) -> Prepared:
    """GGUF blocks ``[n, row_bytes]`` (uint8, any device) -> ``Prepared`` planes on that device."""
    t = ggml_type(type_name)
    if t.name not in FORMAT_ID:
        raise NotImplementedError(f"no GPU layout for {t.name} (native: {', '.join(NATIVE)})")
    n, k = (int(s) for s in shape)
    if k % t.block_size:
        raise ValueError(f"{t.name} rows need a multiple of {t.block_size} elements, got {k}")
    b = data.reshape(n, k // t.block_size, t.type_size)
    name, f16, u8 = t.name, torch.float16, torch.uint8
    if name == "Q8_0":
        qs = b[..., 2:34].contiguous().view(torch.int8).reshape(n, k)
        return Prepared(name, n, k, qs, d=_field(b, 0, f16))
    if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        has_m, has_h = name.endswith("_1"), name.startswith("Q5")
        q0 = 2 + 2 * has_m + 4 * has_h
        return Prepared(
            name, n, k,
            qs=b[..., q0 : q0 + 16].reshape(n, k // 2).contiguous(),
            qh=_field(b, 2 + 2 * has_m, torch.int32) if has_h else None,
            d=_field(b, 0, f16),
            dm=_field(b, 2, f16) if has_m else None,
        )  # fmt: skip
    if name in ("Q4_K", "Q5_K"):
        qs = b[..., 16:144] if name == "Q4_K" else b[..., 48:176]
        qs = qs.reshape(n, -1, 4, 1, 32)  # [.., chunk, -, l]: elements 64c + l, 64c + 32 + l
        codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)
        qh = None
        if name == "Q5_K":  # fifth bit of element 32j + l: bit j of qh[l]
            shifts = torch.arange(8, device=b.device, dtype=u8).view(1, 1, 8, 1)
            high = (b[..., 16:48].reshape(n, -1, 1, 32) >> shifts) & 1
            qh = _bit_plane(high.reshape(n, k))
        sc, mn = _kquant_scales(b[..., 4:16])
        return Prepared(
            name, n, k, _nibble_plane(codes), qh=qh, d=_field(b, 0, f16), dm=_field(b, 2, f16),
            sc=sc.reshape(n, k // 32).contiguous(), mn=mn.reshape(n, k // 32).contiguous(),
        )  # fmt: skip
    if name == "Q2_K":  # scales[16] qs[64] d dmin: value d * (sc & 15) * q - dmin * (sc >> 4)
        scales = b[..., 0:16].reshape(n, k // 16)
        return Prepared(
            name, n, k, _crumb_plane(_kquant_2bit(b[..., 16:80], n, k)),
            d=_field(b, 80, f16), dm=_field(b, 82, f16),
            sc=(scales & 15).contiguous(), mn=(scales >> 4).contiguous(),
        )  # fmt: skip
    if name == "Q3_K":  # hmask[32] qs[64] scales[12] d: value d * (sc - 32) * (q3 - 4)
        shifts = torch.arange(8, device=b.device, dtype=u8).view(1, 1, 8, 1)
        high = (b[..., 0:32].reshape(n, -1, 1, 32) >> shifts) & 1  # bit e // 32 of byte e % 32
        raw = b[..., 96:108]
        lo4 = torch.cat([raw[..., 0:8] & 15, raw[..., 0:8] >> 4], dim=-1)
        sh = torch.tensor([0, 2, 4, 6], device=b.device, dtype=u8).view(1, 1, 4, 1)
        hi2 = ((raw[..., 8:12].reshape(n, -1, 1, 4) >> sh) & 3).reshape(n, -1, 16)
        sc = ((lo4 | (hi2 << 4)).to(torch.int16) - 32).to(torch.int8)
        return Prepared(
            name, n, k, _crumb_plane(_kquant_2bit(b[..., 32:96], n, k)),
            qh=_bit_plane(high.reshape(n, k)), d=_field(b, 108, f16),
            sc=sc.reshape(n, k // 16).contiguous(),
        )  # fmt: skip
    if name == "Q1_0":  # d qs[16]: bit j of the 128 (little-endian) set is +d, clear -d
        bits = b[..., 2:18].contiguous().view(torch.int32).reshape(n, k // 32)
        return Prepared(name, n, k, bits, d=_field(b, 0, f16))
    if name == "IQ4_NL":  # d qs[16]: indices into KVALUES, element j low, j + 16 high
        levels = torch.from_numpy(KVALUES).to(b.device)
        qs = b[..., 2:18].reshape(n, k // 2).contiguous()
        return Prepared(name, n, k, qs, qh=levels, d=_field(b, 0, f16))
    if name in TABLE_TYPES:  # indices into the type's 16 levels, int8 scales a 16, a unit
        three = name in X3_TYPES  # 3-bit indices: a 2-bit plane and a bit plane (Q3_K's)
        qs = torch.empty((n, k // 4 if three else k // 2), dtype=u8, device=b.device)
        qh = torch.empty((n, k // 32), dtype=torch.int32, device=b.device) if three else None
        sc = torch.empty((n, k // 16), dtype=torch.int8, device=b.device)
        unit = torch.empty((n, k // 256), dtype=torch.float32, device=b.device)
        step = max(1, TABLE_CHUNK // k)  # rows a piece: the unpacking's temporaries stay small
        for r in range(0, n, step):
            parts = table_form(b[r : r + step].reshape(-1, t.type_size), name)
            if parts is None:
                raise ValueError(f"{name} blocks whose scales are no whole multiples of their d")
            rows = min(step, n - r)
            index = parts[0].reshape(rows, k)
            if three:
                qs[r : r + rows] = _crumb_plane(index & 3)
                qh[r : r + rows] = _bit_plane(index >> 2)
            else:
                qs[r : r + rows] = _nibble_plane(index)
            sc[r : r + rows] = parts[1].reshape(rows, k // 16)
            unit[r : r + rows] = parts[2].reshape(rows, k // 256)
        levels = torch.from_numpy(x4_levels(name)).to(b.device)
        if three:  # the levels in ``mn``: ``qh`` holds the indices' third bits
            return Prepared(name, n, k, qs, qh=qh, d=unit, sc=sc, mn=levels[:8].contiguous())
        return Prepared(name, n, k, qs, qh=levels, d=unit, sc=sc)
    if name in ("MXFP4", "NVFP4"):  # the E2M1 values (doubled) as qh, the codes' table
        e2m1 = torch.from_numpy(KVALUES_MXFP4).to(b.device)
    if name == "MXFP4":  # e qs[16]: element j low, j + 16 high (the Q4_0 order)
        scales = torch.from_numpy(e8m0_half(b[..., 0].cpu().numpy())).to(b.device)
        qs = b[..., 1:17].reshape(n, k // 2).contiguous()
        return Prepared(name, n, k, qs, qh=e2m1, d=scales.reshape(n, k // 32).contiguous())
    if name == "NVFP4":  # d[4] qs[32]: group s's 8 bytes hold its element j low, j + 8 high
        qs = b[..., 4:36].reshape(n, -1, 4, 8)
        index = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)  # E2M1 codes (table indices)
        scales = ue4m3_to_f32(b[..., 0:4]).reshape(n, k // 16)  # exact in f16
        return Prepared(name, n, k, _nibble_plane(index), qh=e2m1, d=scales.to(f16).contiguous())
    # Q6_K: element 128h + 32j + l; ql byte 64h + 32(j % 2) + l, nibble j // 2; qh byte 32h + l
    ql = b[..., 0:128].reshape(n, -1, 2, 2, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=3)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=u8).view(1, 1, 1, 4, 1)
    high = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> shifts) & 3
    codes = (low | (high << 4)).reshape(n, k)  # 0..63
    return Prepared(
        name, n, k, _nibble_plane(codes & 15), qh=_crumb_plane(codes >> 4),
        d=_field(b, 208, f16), sc=b[..., 192:208].contiguous().view(torch.int8).reshape(n, k // 16),
    )  # fmt: skip


def dequantize_prepared(p: Prepared) -> torch.Tensor:
    """Float32 ``[n, k]`` from the planes, exactly as the kernels read them (reference, tests)."""
    n, G, dev = p.n, p.groups, p.qs.device
    j = torch.arange(32, device=dev)
    if p.type_name == "Q1_0":
        q = ((p.qs.unsqueeze(-1) >> j) & 1) * 2 - 1
        return (q.float() * p.d.float().repeat_interleave(4, dim=1).unsqueeze(-1)).reshape(n, -1)
    if p.type_name == "Q8_0":
        q = p.qs.reshape(n, G, 32).to(torch.int32)
    elif p.type_name in ("Q2_K", "Q3_K") or p.type_name in X3_TYPES:
        c = p.qs.reshape(n, G, 8).to(torch.int32)[..., j % 8]
        q = (c >> (2 * (j // 8))) & 3
        if p.type_name != "Q2_K":
            q = q | (((p.qh.unsqueeze(-1) >> j) & 1) << 2)
    else:
        c = p.qs.reshape(n, G, 16).to(torch.int32)
        q = torch.cat([c & 15, c >> 4], dim=-1)
        if p.type_name in ("Q5_0", "Q5_1", "Q5_K"):
            q = q | (((p.qh.unsqueeze(-1) >> j) & 1) << 4)
        elif p.type_name == "Q6_K":
            h = p.qh.reshape(n, G, 8).to(torch.int32)[..., j % 8]
            q = q | (((h >> (2 * (j // 8))) & 3) << 4)
    if p.type_name in ("NVFP4", "MXFP4"):
        q = torch.from_numpy(KVALUES_MXFP4).to(dev)[q.long()]
    elif p.type_name in X3_TYPES:  # the levels' indices
        q = p.mn.to(torch.int32)[q.long()]
    elif p.type_name == "IQ4_NL" or p.type_name in TABLE_TYPES:
        q = p.qh.to(torch.int32)[q.long()]
    q = q.float() + _OFFSET.get(p.type_name, 0)
    if p.type_name == "NVFP4":  # a scale per 16 elements
        return (q.reshape(n, -1, 16) * p.d.float().unsqueeze(-1)).reshape(n, -1)
    if p.type_name in ("Q4_K", "Q5_K"):
        d = p.d.float().repeat_interleave(8, dim=1)
        s, off = d * p.sc.float(), -(p.dm.float().repeat_interleave(8, dim=1) * p.mn.float())
        return (q * s.unsqueeze(-1) + off.unsqueeze(-1)).reshape(n, -1)
    if p.type_name in ("Q6_K", "Q3_K", "Q2_K", *TABLE_TYPES):
        s = p.d.float().repeat_interleave(16, dim=1) * p.sc.float()  # per 16 elements
        y = q.reshape(n, -1, 16) * s.unsqueeze(-1)
        if p.type_name == "Q2_K":
            y = y + (-(p.dm.float().repeat_interleave(16, dim=1) * p.mn.float())).unsqueeze(-1)
        return y.reshape(n, -1)
    y = q * p.d.float().unsqueeze(-1)
    if p.dm is not None:
        y = y + p.dm.float().unsqueeze(-1)
    return y.reshape(n, -1)


# --- the cache of prepared weights ---------------------------------------------------------

_PREPARED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def prepare(w) -> Prepared:
    """The GPU planes of QTensor ``w`` (made on first use, cached while ``w.data`` lives)."""
    p = _PREPARED.get(w.data)
    if p is None or p.type_name != w.dtype.name:
        if len(w.shape) != 2:
            raise ValueError(f"qmatmul needs a 2-D weight, got shape {list(w.shape)}")
        p = repack(w.data, w.dtype.name, w.shape)
        _PREPARED[w.data] = p
    return p
