"""Weights into the layouts of ``layout``: QTensors -> ``PackedWeight`` (``pack``); bf16,
packed or quantized weights -> AMX tiles (``pack_amx``; ``pack_amx_quantized`` from the
planes, ``pack_amx_codes`` from the GGUF blocks of any quantized type or mix).

``supports`` says which weights ``pack`` and the kernels take (what ``matmul.qmatmul``
uses). Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 become per-row planes (Q5_*: their low 4 bits as
Q4_*'s nibbles, their fifth bits as the blocks' ``qh`` words; until 2026-12-04 Q5_0 was
widened into Q8_0 planes, the same values and sums in 34 bytes a block against 22, and Q5_1
read from its blocks). With ``panels`` Q4_0, Q4_1, Q8_0 and Q4_K become 16-row panels
instead (``PackedWeight.panels``: the fast engine's layout, a decode GEMV of half the
instructions). The other K-quant and the F32 / F16 / BF16 weights (``BLOCK_CODES``) are not
repacked: ``kquants.c`` (``floats.c`` for the float types) reads their GGUF rows, which
``pack`` copies row after row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from ..base import FORMATS
from ..forms import bf16_form, kernel_form
from ..fp4 import LEGACY_FORM, as_legacy
from ..gridquants import X3_TYPES, as_x4, x3_from_x4, x4_tables
from ..types import ggml_type
from . import build, ops
from .layout import (
    BLOCK_CODES,
    BLOCKS,
    K_PANEL_RECORD,
    LEGACY_TYPES,
    M_WORDS,
    PANEL_FORMS,
    PANEL_RECORD,
    PANELS_ONLY,
    ROW_MULTIPLE,
    TYPE_CODES,
    X4_TYPES,
    AmxWeight,
    PackedWeight,
)
from .memory import weights_copy, weights_empty

Q = TypeVar("Q")  # a QTensor (qtensor imports this module)


def supports(type_name: str, k: int) -> bool:
    """Whether the C kernels handle a weight of this type and row length (``kernels.c``: Q4_0,
    Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (panels, else Q8_0 planes), k % 64 == 0, and as their
    blocks MXFP4 (MXFP4H panels, else Q5_0), NVFP4 (NVFP4H panels) and Q1_0 (Q1_0H panels,
    else Q4_0, k % 128); ``kquants.c``: Q2_K..Q6_K, IQ4_XS, k % 256 == 0, and as X4 blocks
    (X3 for those of at most 8 levels) the grid i-quants, the ternary types and NVFP4
    without panels (bf16 rows where k % 256 or its scales do not allow); ``floats.c``: F32,
    F16, BF16, k % 64)."""
    multiple = ROW_MULTIPLE.get(type_name)
    return multiple is not None and k % multiple == 0 and build.available()


PACK_CHUNK = 4 << 20  # bytes of GGUF blocks ``pack`` reads between two ``release`` calls


def _chunks(rows: int, row_bytes: int, multiple: int = 1) -> list[slice]:
    """Rows ``0 .. rows`` in pieces of about ``PACK_CHUNK`` bytes of blocks (each a multiple
    of ``multiple`` rows)."""
    step = max(1, PACK_CHUNK // max(row_bytes, 1) // multiple) * multiple
    return [slice(r, min(rows, r + step)) for r in range(0, rows, step)]


def pack(qtensors, release: Callable[[torch.Tensor], object] | None = None,
         panels: bool = False) -> PackedWeight:  # fmt: skip
    """Repack one 2-D QTensor, or several with the same type and k stacked by rows.

    ``panels``: Q4_0 / Q4_1 / Q8_0 / IQ4_NL weights whose every part has a multiple of 16
    rows, and Q4_K / IQ4_XS weights of a multiple of 16 rows, become 16-row panels
    (``PackedWeight.panels``: the decode GEMV's faster layout; no AMX tiles from them), MXFP4
    and NVFP4 ones MXFP4H / NVFP4H panels, Q1_0 ones Q1_0H panels (their blocks of 32 with
    the scales as f16, where f16 holds an MXFP4 one; ggml's Q8_0 activations); other weights
    are packed as without it.

    ``release``, if given, is called with each piece of the blocks once it is packed (about
    ``PACK_CHUNK`` bytes: ``gguf.release_pages`` drops a mapped file's pages of it), so a
    weight packed from a mapped file never holds its blocks and its packed copy whole at once.
    """
    qtensors = list(qtensors) if isinstance(qtensors, (list, tuple)) else [qtensors]
    name = qtensors[0].dtype.name
    k = int(qtensors[0].shape[-1])
    if any(q.dtype.name != name or int(q.shape[-1]) != k or len(q.shape) != 2 for q in qtensors):
        raise ValueError("pack: weights must be 2-D with one type and one row length")
    weights = [(int(q.shape[0]), q.data.cpu().contiguous()) for q in qtensors]  # rows, bytes
    source = name  # MXFP4 / NVFP4 / Q1_0 as panels: their blocks converted piece by piece
    rows_in_16s = all(r % 16 == 0 for r, _ in weights)
    if name in PANEL_FORMS and panels and build.available() and k % 64 == 0 and rows_in_16s:
        # MXFP4H / NVFP4H / Q1_0H panels: 4.5 / 5 / 1.5 bits a weight (Q5_0 planes 5.5, X4
        # blocks 5.1, Q4_0 4.5)
        name = PANEL_FORMS[name]
    if name in LEGACY_TYPES:  # MXFP4, Q1_0: their values as Q5_0 / Q4_0 (else bf16), packed
        forms = [_legacy(q) for q in qtensors]
        if any(f is None for f in forms):
            forms = [bf16_form(q) for q in qtensors]
        packed = pack(forms, panels=panels)
        if release is not None:
            for q in qtensors:
                release(q.data)
        return packed
    if name in X4_TYPES:  # the grid i-quants, ternary types, NVFP4: their values as X4 blocks
        # (X3 where 8 levels hold them), written where they are kept (NVFP4, which may not
        # fit: first into memory of its own)
        kind = "X3" if name in X3_TYPES else "X4"
        n, row_bytes = sum(r for r, _ in weights), k // 256 * BLOCKS[kind][1]
        may_fail = name == "NVFP4"
        empty = torch.empty if may_fail else weights_empty
        codes = empty((n, row_bytes), dtype=torch.uint8) if k % 256 == 0 else None
        j = 0
        for rows, data in weights:
            if codes is None or not _x4(data, name, release, codes[j : j + rows], kind):
                # NVFP4 rows of no whole super-blocks, or its scales too far apart: its values
                # as bf16 rows
                return pack([bf16_form(q) for q in qtensors], panels=panels)
            j += rows
        return PackedWeight(kind, n, k, weights_copy(codes) if may_fail else codes, None, None)
    if name in BLOCK_CODES:  # kquants.c / floats.c read the GGUF rows: a copy, row after row
        elements, nbytes = BLOCKS[name]
        if k % ROW_MULTIPLE[name]:
            raise ValueError(f"pack: no C kernel for {name} with k={k} (k % {ROW_MULTIPLE[name]})")
        n = sum(rows for rows, _ in weights)
        row_bytes = k // elements * nbytes
        kpanels = panels and name in K_PANEL_RECORD and n % 16 == 0 and build.available()
        if kpanels:  # Q4_K as 16-row panels: each row's lanes written where they belong
            codes = weights_empty((n // 16, k // 256 * K_PANEL_RECORD[name]), torch.uint8)
        else:
            codes = weights_empty((n, row_bytes), torch.uint8)
        j = 0
        for rows, data in weights:
            data = data.reshape(rows, row_bytes)
            for part in _chunks(rows, row_bytes):
                if kpanels:
                    ops.kpanels_put(name, data[part], k, codes, j + part.start)
                else:
                    codes[j + part.start : j + part.stop].copy_(data[part])
                if release is not None:
                    release(data[part])
            j += rows
        return PackedWeight(name, n, k, codes, None, None, panels=kpanels)
    if name not in TYPE_CODES or k % 64:
        raise ValueError(f"pack: no C kernel for {name} with k={k} (needs k % 64 == 0)")
    n = sum(rows for rows, _ in weights)
    G = k // 32
    panels = panels and name in PANEL_RECORD and rows_in_16s
    if name in PANELS_ONLY and not (panels and build.available()):  # Q8_0 planes of its values
        packed = pack([kernel_form(q) for q in qtensors], panels=panels)
        if release is not None:
            for _, data in weights:
                release(data)
        return packed
    if panels and build.available():
        codes = weights_empty((n // 16, G * PANEL_RECORD[name]), torch.uint8)
        j = 0
        for rows, data in weights:  # each weight into its panels, 16 rows at a time
            data = data.reshape(rows, -1)
            for part in _chunks(rows, data.shape[1], multiple=16):
                dst = slice((j + part.start) // 16, (j + part.stop) // 16)
                blocks = data[part] if source == name else _panel_form(data[part], source)
                if blocks is None:  # an MXFP4 scale without an f16 (a Q1_0 d NaN): no panels
                    return pack(qtensors, release, panels=False)
                ops.repack(name, blocks, k, codes[dst], None, None, panels=True)
                if release is not None:
                    release(data[part])
            j += rows
        return PackedWeight(name, n, k, codes, None, None, panels=True)
    codes = weights_empty((n, k if name == "Q8_0" else k // 2), torch.uint8)
    d = weights_empty((n, G), torch.int16)
    m = weights_empty((n, G * M_WORDS[name]), torch.int16) if name in M_WORDS else None
    if build.available():
        j = 0
        for rows, data in weights:  # each weight into its rows of the planes, piece by piece
            data = data.reshape(rows, -1)
            for part in _chunks(rows, data.shape[1]):
                dst = slice(j + part.start, j + part.stop)
                m_dst = m[dst] if m is not None else None
                ops.repack(name, data[part], k, codes[dst], d[dst], m_dst)
                if release is not None:
                    release(data[part])
            j += rows
        return PackedWeight(name, n, k, codes, d, m)
    rows = torch.cat([data.reshape(-1) for _, data in weights])
    blocks = rows.view(n, G, -1)  # the same in torch (slow), for machines without the kernel
    d.copy_(blocks[:, :, 0:2].contiguous().view(torch.int16).reshape(n, G))
    if name == "Q8_0":
        codes.copy_(blocks[:, :, 2:34].reshape(n, k) ^ 0x80)
    else:
        extra = 2 * M_WORDS.get(name, 0)  # bytes of m and / or qh after d
        if name == "Q5_1":  # the row's minimums, then its qh words
            m[:, :G].copy_(blocks[:, :, 2:4].contiguous().view(torch.int16).reshape(n, G))
            m[:, G:].copy_(blocks[:, :, 4:8].contiguous().view(torch.int16).reshape(n, 2 * G))
        elif m is not None:
            m.copy_(blocks[:, :, 2 : 2 + extra].contiguous().view(torch.int16).reshape(n, -1))
        qs = blocks[:, :, 2 + extra :][:, :, :16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, k // 64, 2, 32)  # natural order
        codes.copy_((q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2))
    return PackedWeight(name, n, k, codes, d, m)


def _x4(data: torch.Tensor, type_name: str, release, out: torch.Tensor, kind: str = "X4") -> bool:
    """GGUF blocks of an ``X4_TYPES`` weight as X4 blocks (``gridquants.as_x4``: the same
    values; ``kind`` X3: then as X3 blocks, ``x3_from_x4``) into ``out`` (uint8, its rows'
    bytes), piece by piece (``release`` drops each piece's mapped pages once read). A block
    that does not fit is a ``ValueError`` (ggml's blocks of the grid and ternary types always
    do), or False for NVFP4 (its values then go as bf16 rows)."""
    t = ggml_type(type_name)
    per = 256 // t.block_size  # GGUF blocks an X4 block
    blocks = data.reshape(-1, t.type_size)
    out = out.view(-1, BLOCKS[kind][1])
    step = max(1, PACK_CHUNK // t.type_size // per) * per
    for b in range(0, blocks.shape[0], step):
        src, dst = blocks[b : b + step], out[b // per : (b + step) // per]
        if build.available():  # in C (gridx4.c): the same bytes, ~7x faster
            done = ops.x4_from_blocks(type_name, src, *x4_tables(type_name), dst, kind)
        else:
            made = as_x4(src, type_name)
            done = made is not None
            if done:
                dst.copy_(made if kind == "X4" else x3_from_x4(made))
            elif type_name != "NVFP4":
                raise ValueError(f"{type_name} blocks with a scale that is no whole multiple of "
                                 "their d (a non-finite or corrupt d)")  # fmt: skip
        if not done:  # NVFP4 scales no one unit holds
            return False
        if release is not None:
            release(src)
    return True


def _panel_form(data: torch.Tensor, type_name: str) -> torch.Tensor | None:
    """A piece of a weight's GGUF blocks (bytes) as its ``PANEL_FORMS`` blocks of 32 (the same
    codes under their scales as f16; ``ops.panel_form_blocks``), or None where an MXFP4 scale
    has no f16 or a Q1_0 d is NaN."""
    size, per, bytes_out = ops.PANEL_FORM_BLOCKS[type_name][:3]
    blocks = data.reshape(-1, size)
    out = torch.empty((blocks.shape[0] * per, bytes_out), dtype=torch.uint8)
    return out.reshape(-1) if ops.panel_form_blocks(type_name, blocks, out) else None


def _legacy(q: Q) -> Q | None:
    """MXFP4 / Q1_0 QTensor ``q``'s values as its ``LEGACY_FORM`` type (Q5_0 / Q4_0; in C,
    ``gridx4.c``, else ``fp4.as_legacy``), or None where an MXFP4 scale has no f16."""
    t = q.dtype
    legacy = ggml_type(LEGACY_FORM[t.name])
    blocks = q.data.reshape(-1, t.type_size)
    if build.available():
        out = torch.empty((blocks.shape[0] * t.block_size // 32, legacy.type_size),
                          dtype=torch.uint8)  # fmt: skip
        if not ops.legacy_from_blocks(t.name, blocks, out):
            return None
    else:
        out = as_legacy(blocks, t.name)
        if out is None:
            return None
    return type(q)(out.reshape(-1), q.shape, legacy.name)


def _plane_codes(codes: torch.Tensor, type_name: str,
                 qh: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The codes of packed planes ``[rows, bytes]`` as int16 ``[rows, k]``, in element order:
    Q8_0's ``q`` (stored ``q + 128``), Q4_*'s nibbles 0..15 (before Q4_0's -8), Q5_1's 0..31,
    Q5_0's ``q - 16`` (their fifth bits from ``qh``, the qh words of their rows)."""
    if type_name == "Q8_0":
        return codes.to(torch.int16) - 128
    rows = codes.shape[0]
    c = codes.view(rows, -1, 32)  # per 64 elements 32 bytes: e[i] | e[i + 32] << 4
    q = torch.cat([c & 15, c >> 4], dim=-1).reshape(rows, -1).to(torch.int16)
    if type_name in ("Q5_0", "Q5_1"):
        words = qh.contiguous().view(torch.int32).reshape(rows, -1, 1)
        bits = (words >> torch.arange(32, dtype=torch.int32)) & 1  # [rows, blocks, 32]
        q = q + (bits.reshape(rows, -1) * 16 - (16 if type_name == "Q5_0" else 0)).to(torch.int16)
    return q


def _qh(pw: PackedWeight, rows) -> torch.Tensor | None:
    """The qh words (as int16 pairs) of rows ``rows`` of a Q5_* weight's planes, else None."""
    if pw.type_name not in ("Q5_0", "Q5_1"):
        return None
    m = pw.m[rows]
    return m[:, pw.k // 32 :] if pw.type_name == "Q5_1" else m


def _mins(pw: PackedWeight, rows) -> torch.Tensor:
    """The f16 minimums of rows ``rows`` of a Q4_1 / Q5_1 weight's planes, as float32."""
    return pw.m[rows][:, : pw.k // 32].contiguous().view(torch.float16).float()


def dequantize_rows(pw: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a packed weight as float32 ``[len(ids), k]``: the values
    ``QTensor.dequantize`` gives for those rows of the weight it was packed from (a tied
    embedding looked up in the output layer's weight: ``q * d (+ m)``, the same float32
    products). Panels and GGUF blocks in one C call (``ops.dequant_rows``), planes in torch."""
    ids = ids.reshape(-1)
    t, k = ids.numel(), pw.k
    if pw.blocks or pw.panels:
        return ops.dequant_rows(pw.codes, pw.type_name, pw.n, k, ids, panels=pw.panels)
    q = _plane_codes(pw.codes[ids], pw.type_name, _qh(pw, ids))
    if pw.type_name == "Q4_0":
        q = q - 8
    d = pw.d[ids].view(torch.float16).float().unsqueeze(-1)
    y = q.float().view(t, k // 32, 32) * d
    if pw.type_name in ("Q4_1", "Q5_1"):
        y = y + _mins(pw, ids).unsqueeze(-1)
    return y.reshape(t, k)


def _tile_rows(n: int, interleave: bool) -> torch.Tensor | None:
    """The row order that puts the tiles of ``[gate; up]`` as gate 0, up 0, gate 1, ..."""
    if not interleave:
        return None
    return torch.arange(n).view(2, n // 32, 16).transpose(0, 1).reshape(-1)


def pack_amx(w: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """A bf16 weight ``[n, k]`` (n % 32, k % 32 == 0) as AMX B tiles ``[n/16, k/32, 16, 16, 2]``.

    Tile ``(j, c)``, row ``r``, column ``i`` holds ``w[16 j + i, 32 c + 2 r : 32 c + 2 r + 2]``
    (the VNNI pairs ``_tile_dpbf16ps`` multiplies). ``interleave``: ``w`` is ``[gate; up]``
    and its tiles are ordered gate 0, up 0, gate 1, up 1, ... (the SwiGLU epilogue's input).
    """
    n, k = w.shape
    if w.dtype != torch.bfloat16 or n % 32 or k % 32:
        raise ValueError(f"pack_amx: a bf16 [n, k] weight with n, k % 32 == 0, got {list(w.shape)}")
    rows = _tile_rows(n, interleave)
    if rows is not None:
        w = w[rows]
    return weights_copy(w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4))


def pack_amx_bf16(w: torch.Tensor, interleave: bool = False) -> AmxWeight:
    """``pack_amx``'s tiles as an ``AmxWeight`` (``kind="bf16"``)."""
    n, k = w.shape
    return AmxWeight("bf16", n, k, pack_amx(w, interleave))


@dataclass(frozen=True)
class AmxCodes:
    """How a quantized type's values become the AMX codes (``pack_amx_codes``): ``bits`` a
    code needs (4: the nibble tiles), one scale per ``group`` k, whether values have an
    offset (``code * scale + offset``, ``BlockFormat.unpack``), and the ``shift`` that makes
    signed codes fit the 4-bit tiles (offset ``-shift * scale`` then: exact in float32)."""

    bits: int
    group: int
    offset: bool
    shift: int = 0


AMX_CODES = {
    "Q4_0": AmxCodes(4, 32, False, 8), "Q4_1": AmxCodes(4, 32, True),
    "Q5_0": AmxCodes(8, 32, False), "Q5_1": AmxCodes(8, 32, True), "Q8_0": AmxCodes(8, 32, False),
    "Q2_K": AmxCodes(4, 16, True), "Q3_K": AmxCodes(4, 16, False, 4),
    "Q4_K": AmxCodes(4, 32, True), "Q5_K": AmxCodes(8, 32, True), "Q6_K": AmxCodes(8, 16, False),
    # their levels as int8 codes (IQ4's -127..113, the FP4 types' doubled E2M1 -12..12)
    "IQ4_NL": AmxCodes(8, 32, False), "IQ4_XS": AmxCodes(8, 32, False),
    "MXFP4": AmxCodes(8, 32, False), "NVFP4": AmxCodes(8, 16, False),
}  # fmt: skip


def amx_codes_plan(type_names) -> tuple[str, int, bool] | None:
    """``(kind, group, offsets)`` of the AMX codes for a stack of these types (a mix too): the
    widest code, the finest scale group, offsets if any part needs them; None when a type
    has no codes (F32 / F16 / BF16: a bf16 tile copy instead)."""
    specs = [AMX_CODES.get(name) for name in type_names]
    if not specs or None in specs:
        return None
    bits, group = max(s.bits for s in specs), min(s.group for s in specs)
    offsets = any(s.offset or (bits == 4 and s.shift) for s in specs)
    return ("q4" if bits == 4 else "q8") + ("g16" if group == 16 else ""), group, offsets


def amx_code_bytes(type_names) -> float | None:
    """Bytes a weight of the AMX codes of such a stack takes (codes and float32 scales and
    offsets), or None (``amx_codes_plan``): Q4_0 0.75, Q8_0 1.125, Q6_K 1.25, bf16 tiles 2."""
    plan = amx_codes_plan(type_names)
    if plan is None:
        return None
    kind, group, offsets = plan
    return (0.5 if kind.startswith("q4") else 1.0) + 4 / group * (2 if offsets else 1)


def _amx_code_tiles(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                    interleave: bool) -> AmxWeight:  # fmt: skip
    """Codes ``q`` ``[n, k]`` (int8; 0..15 for the 4-bit kinds) and per-group scales and
    offsets ``[n, k / group]`` float32 -> an ``AmxWeight`` in tile order."""
    n, k = q.shape
    groups = d.shape[1]
    rows = _tile_rows(n, interleave)
    if rows is not None:
        q, d = q[rows], d[rows]
        m = m[rows] if m is not None else None
    q = q.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)  # [.., row, column, pair]
    if kind.startswith("q4"):  # columns 0..7's codes in the low nibbles, 8..15's in the high
        q = q.view(torch.uint8)
        low_high = q[..., :8, :] | (q[..., 8:, :] << 4)  # [.., row, 8 columns, pair]
        tiles = weights_copy(low_high.reshape(n // 16, k // 32, 16, 16))
    else:
        tiles = weights_copy(q)
    scales = lambda x: weights_copy(x.reshape(n // 16, 16, groups).permute(0, 2, 1))  # noqa: E731
    return AmxWeight(kind, n, k, tiles, scales(d), scales(m) if m is not None else None)


def pack_amx_quantized(pw: PackedWeight, interleave: bool = False) -> AmxWeight:
    """A repacked Q4_0 / Q4_1 / Q5_* / Q8_0 weight as AMX-ordered codes and float32 scales (see
    ``AmxWeight``): 0.75 (4-bit) or 1.125 (Q8_0; Q5_0 as its ``q - 16``; Q5_1 with its offsets
    1.25) bytes per weight instead of bf16's 2; the GEMM expands them to exactly the bf16
    values ``dequantize_bf16`` gives."""
    n, k = pw.n, pw.k
    if n % 32 or k % 64 or pw.panels:
        raise ValueError(
            f"pack_amx_quantized: planes (not panels) of n % 32 and k % 64 == 0, got {n}x{k}"
        )
    d = pw.d.view(torch.float16).float()
    q = _plane_codes(pw.codes, pw.type_name, _qh(pw, slice(None))).to(torch.int8)
    if pw.type_name in ("Q8_0", "Q5_0"):
        return _amx_code_tiles("q8", q, d, None, interleave)
    if pw.type_name == "Q5_1":
        return _amx_code_tiles("q8", q, d, _mins(pw, slice(None)), interleave)
    m = _mins(pw, slice(None)) if pw.type_name == "Q4_1" else d * -8.0
    return _amx_code_tiles("q4", q, d, m, interleave)


def pack_amx_codes(
    qtensors, interleave: bool = False, release: Callable[[torch.Tensor], object] | None = None
) -> AmxWeight:
    """A stack of quantized weights (any types of ``AMX_CODES``, mixed too: Q4_K_M's Q4_K
    q, k with a Q6_K v) as AMX codes with float32 scales per 32 or 16 k (``amx_codes_plan``),
    read from their GGUF blocks (``BlockFormat.unpack``, in pieces; ``release`` as for
    ``pack``). The GEMM expands each code to ``code * scale + offset`` in float32, one
    rounding of an exact product as ggml's dequantization does, then to bf16: the values of
    ``QTensor.dequantize(dtype=torch.bfloat16)`` bit for bit."""
    qtensors = list(qtensors)
    plan = amx_codes_plan([q.dtype.name for q in qtensors])
    k = int(qtensors[0].shape[-1])
    n = sum(int(q.shape[0]) for q in qtensors)
    if plan is None or n % 32 or k % 32 or any(int(q.shape[-1]) != k for q in qtensors):
        names = ", ".join(q.dtype.name for q in qtensors)
        raise ValueError(f"pack_amx_codes: no AMX codes for [{names}] of {n}x{k}")
    kind, group, offsets = plan
    q = torch.empty(n, k, dtype=torch.int8)
    d = torch.empty(n, k // group)
    m = torch.zeros(n, k // group) if offsets else None
    r = 0
    for qt in qtensors:
        fmt, spec = FORMATS[qt.dtype.name], AMX_CODES[qt.dtype.name]
        shift = spec.shift if kind.startswith("q4") else 0
        rep = spec.group // group  # 2: a type with scales per 32 in a stack with scales per 16
        data = qt.data.cpu().reshape(int(qt.shape[0]), -1)
        for part in _chunks(data.shape[0], data.shape[1]):
            rows = slice(r + part.start, r + part.stop)
            codes, scale, offset = fmt.unpack(data[part].reshape(-1, fmt.type_size))
            nr = part.stop - part.start
            q[rows] = (codes.reshape(nr, k).to(torch.int16) + shift).to(torch.int8)
            d[rows] = scale.reshape(nr, -1).repeat_interleave(rep, dim=1)
            if offset is not None:
                m[rows] = offset.reshape(nr, -1).repeat_interleave(rep, dim=1)
            elif shift:
                m[rows] = d[rows] * -float(shift)
            if release is not None:
                release(data[part])
        r += int(qt.shape[0])
    return _amx_code_tiles(kind, q, d, m, interleave)
