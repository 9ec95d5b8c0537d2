"""Triton kernels over the planes of ``cuda.layout.Prepared``: GEMV, GEMM and dequantize.

Every kernel reads a 32-element group as two halves: ``lo`` (elements 0..15) and ``hi``
(16..31), the low and high nibbles of the group's 16 ``qs`` bytes, so no nibble is ever
interleaved (Q2_K/Q3_K: their 2-bit planes, read as Q6_K's ``qh``; Q1_0: a word of signs a
group). ``_codes`` gives the signed integer codes of both halves, ``_scales`` their scales
and offsets (the min of Q4_1/Q5_1, ``-dmin * m`` of Q4_K/Q5_K, the same for both halves;
Q2_K's ``-dmin * m`` of each 16 elements); the value of element ``e`` is ``code * scale +
offset``, as in ``dequantize_torch``. Formats with a scale per 16 elements (Q6_K, Q3_K,
Q2_K, NVFP4, the table types) scale the halves' sums separately (NVFP4's, MXFP4's, IQ4_NL's
and the table types' codes are indices into the 16 levels of ``qh``: the FP4 types' E2M1
values doubled, looked up faster than made by selects, docs/gpu.md); Q2_K (``two offsets``)
adds the halves' x-sums times their offsets separately.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layout import FORMAT_ID, Prepared

# Format ids (as gpu.FORMAT_ID), constexpr for the kernels.
Q4_0 = tl.constexpr(FORMAT_ID["Q4_0"])
Q4_1 = tl.constexpr(FORMAT_ID["Q4_1"])
Q5_0 = tl.constexpr(FORMAT_ID["Q5_0"])
Q5_1 = tl.constexpr(FORMAT_ID["Q5_1"])
Q8_0 = tl.constexpr(FORMAT_ID["Q8_0"])
Q4_K = tl.constexpr(FORMAT_ID["Q4_K"])
Q5_K = tl.constexpr(FORMAT_ID["Q5_K"])
Q6_K = tl.constexpr(FORMAT_ID["Q6_K"])
Q2_K = tl.constexpr(FORMAT_ID["Q2_K"])
Q3_K = tl.constexpr(FORMAT_ID["Q3_K"])
NVFP4 = tl.constexpr(FORMAT_ID["NVFP4"])
Q1_0 = tl.constexpr(FORMAT_ID["Q1_0"])
MXFP4 = tl.constexpr(FORMAT_ID["MXFP4"])
IQ4_NL = tl.constexpr(FORMAT_ID["IQ4_NL"])
TABLE = tl.constexpr(FORMAT_ID["IQ4_XS"])  # the types of gridquants.TABLE_TYPES of 16 levels
TABLE3 = tl.constexpr(FORMAT_ID["IQ2_XS"])  # those of at most 8 (gridquants.X3_TYPES)
# a scale per 16 elements: the formats Q6_K, Q2_K, Q3_K, NVFP4 (ids 7 to 10) and the table
# formats (the last ids): ``(FMT >= Q6_K and FMT <= NVFP4) or FMT >= TABLE`` (test_gpu's
# test_format_ids_stable holds the order)
_HAS_OFFSET = {FORMAT_ID[n] for n in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")}


@triton.jit
def _codes(qs, qh, mn, row, g, i, qs_stride, qh_stride, FMT: tl.constexpr):
    """Signed codes of elements ``32g + i`` (lo) and ``32g + 16 + i`` (hi) of weight row ``row``.

    ``row`` (int64), ``g`` and ``i`` broadcast against each other; so do the results.
    """
    if FMT == Q8_0:
        p = qs + row * qs_stride + g * 32 + i
        lo = tl.load(p).to(tl.int32)
        hi = tl.load(p + 16).to(tl.int32)
    elif FMT == Q1_0:  # a word of signs a group
        h = tl.load(qs + row * qs_stride + g)
        lo = ((h >> i) & 1) * 2 - 1
        hi = ((h >> (i + 16)) & 1) * 2 - 1
    elif FMT == Q2_K or FMT == Q3_K or FMT == TABLE3:
        b = tl.load(qs + row * qs_stride + g * 8 + (i % 8)).to(tl.int32)
        shift = (i // 8) * 2
        lo = (b >> shift) & 3
        hi = (b >> (shift + 4)) & 3
        if FMT == Q3_K or FMT == TABLE3:
            h = tl.load(qh + row * qh_stride + g)
            lo = lo | (((h >> i) & 1) << 2)
            hi = hi | (((h >> (i + 16)) & 1) << 2)
        if FMT == Q3_K:
            lo = lo - 4
            hi = hi - 4
        if FMT == TABLE3:  # 3-bit indices into the type's 8 levels (mn: int8)
            lo = tl.load(mn + lo).to(tl.int32)
            hi = tl.load(mn + hi).to(tl.int32)
    else:
        b = tl.load(qs + row * qs_stride + g * 16 + i).to(tl.int32)
        lo = b & 15
        hi = b >> 4
        if FMT == Q5_0 or FMT == Q5_1 or FMT == Q5_K:
            h = tl.load(qh + row * qh_stride + g)
            lo = lo | (((h >> i) & 1) << 4)
            hi = hi | (((h >> (i + 16)) & 1) << 4)
        if FMT == Q6_K:
            h = tl.load(qh + row * qh_stride + g * 8 + (i % 8)).to(tl.int32)
            shift = (i // 8) * 2
            lo = lo | (((h >> shift) & 3) << 4)
            hi = hi | (((h >> (shift + 4)) & 3) << 4)
        if FMT == Q4_0:
            lo = lo - 8
            hi = hi - 8
        if FMT == Q5_0:
            lo = lo - 16
            hi = hi - 16
        if FMT == Q6_K:
            lo = lo - 32
            hi = hi - 32
        if FMT == IQ4_NL or FMT == TABLE or FMT == NVFP4 or FMT == MXFP4:
            # indices into the type's 16 levels (qh: int8; the FP4 types' E2M1 values doubled)
            lo = tl.load(qh + lo).to(tl.int32)
            hi = tl.load(qh + hi).to(tl.int32)
    return lo, hi


@triton.jit
def _scales(d, dm, sc, mn, row, g, d_stride, sc_stride, FMT: tl.constexpr):
    """Float32 scales of group ``g``'s lo and hi halves, and their offsets (meaningless if none;
    equal but for Q2_K)."""
    if FMT == Q4_K or FMT == Q5_K:
        sb = row * d_stride + g // 8
        s_lo = tl.load(d + sb).to(tl.float32) * tl.load(sc + row * sc_stride + g).to(tl.float32)
        s_hi = s_lo
        mins = tl.load(mn + row * sc_stride + g).to(tl.float32)
        off_lo = -(tl.load(dm + sb).to(tl.float32) * mins)
        off_hi = off_lo
    elif FMT == Q1_0:  # a scale per 128 elements
        s_lo = tl.load(d + row * d_stride + g // 4).to(tl.float32)
        s_hi = s_lo
        off_lo = s_lo
        off_hi = s_lo
    elif FMT == NVFP4:  # a float16 scale per 16 elements
        s_lo = tl.load(d + row * d_stride + 2 * g).to(tl.float32)
        s_hi = tl.load(d + row * d_stride + 2 * g + 1).to(tl.float32)
        off_lo = s_lo
        off_hi = s_hi
    elif FMT == Q6_K or FMT == Q3_K or FMT == Q2_K or FMT == TABLE or FMT == TABLE3:
        sb = row * d_stride + g // 8
        dd = tl.load(d + sb).to(tl.float32)
        s_lo = dd * tl.load(sc + row * sc_stride + 2 * g).to(tl.float32)
        s_hi = dd * tl.load(sc + row * sc_stride + 2 * g + 1).to(tl.float32)
        if FMT == Q2_K:
            dmin = tl.load(dm + sb).to(tl.float32)
            off_lo = -(dmin * tl.load(mn + row * sc_stride + 2 * g).to(tl.float32))
            off_hi = -(dmin * tl.load(mn + row * sc_stride + 2 * g + 1).to(tl.float32))
        else:
            off_lo = s_lo
            off_hi = s_hi
    else:
        s_lo = tl.load(d + row * d_stride + g).to(tl.float32)
        s_hi = s_lo
        if FMT == Q4_1 or FMT == Q5_1:
            off_lo = tl.load(dm + row * d_stride + g).to(tl.float32)
        else:
            off_lo = s_lo
        off_hi = off_lo
    return s_lo, s_hi, off_lo, off_hi


@triton.jit
def _dot_rows(
    x, nw, rstd, row, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, NORM: tl.constexpr, BN: tl.constexpr,
    NG: tl.constexpr, G0=0,
):  # fmt: skip
    """``x @ W[row].T`` for one row of x and the int64 weight rows ``row`` ``[BN]``, float32 FMAs,
    NG groups a step; ``NORM``: x is RmsNorm'ed on the fly (``x * rstd * nw``, float32 ``nw``).
    Groups ``G0 .. G0 + G - 1`` of the rows only (x indexed by element, as the whole row).
    """
    gi = tl.arange(0, NG)
    i = tl.arange(0, 16)
    acc = tl.zeros([BN, NG], dtype=tl.float32)
    for g0 in range(0, G, NG):
        g = g0 + gi
        gmask = (g < G)[:, None]
        g = G0 + tl.minimum(g, G - 1)  # out-of-range groups read the last one and meet x = 0
        xo = g[:, None] * 32 + i[None, :]
        x_lo = tl.load(x + xo, mask=gmask, other=0.0).to(tl.float32)
        x_hi = tl.load(x + xo + 16, mask=gmask, other=0.0).to(tl.float32)
        if NORM:
            x_lo = x_lo * rstd * tl.load(nw + xo, mask=gmask, other=0.0)
            x_hi = x_hi * rstd * tl.load(nw + xo + 16, mask=gmask, other=0.0)
        lo, hi = _codes(
            qs, qh, mn, row[:, None, None], g[None, :, None], i[None, None, :],
            qs_stride, qh_stride, FMT,
        )  # fmt: skip
        s_lo, s_hi, off_lo, off_hi = _scales(
            d, dm, sc, mn, row[:, None], g[None, :], d_stride, sc_stride, FMT
        )
        if (FMT >= Q6_K and FMT <= NVFP4) or FMT >= TABLE:  # a scale per 16 (the ids' order)
            acc += tl.sum(lo.to(tl.float32) * x_lo[None, :, :], 2) * s_lo
            acc += tl.sum(hi.to(tl.float32) * x_hi[None, :, :], 2) * s_hi
        else:
            part = lo.to(tl.float32) * x_lo[None, :, :] + hi.to(tl.float32) * x_hi[None, :, :]
            acc += tl.sum(part, 2) * s_lo
        if HAS_OFF:
            if FMT == Q2_K:
                acc += off_lo * tl.sum(x_lo, 1)[None, :] + off_hi * tl.sum(x_hi, 1)[None, :]
            else:
                acc += off_lo * tl.sum(x_lo + x_hi, 1)[None, :]
    return tl.sum(acc, 1)


@triton.jit(do_not_specialize=["N", "G"])
def _gemv_kernel(
    x, y, qs, qh, d, dm, sc, mn, N, G, x_stride, y_stride,
    qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
):  # fmt: skip
    """``y[r, rows] = x[r] @ W[rows].T``: BN weight rows, NG groups a step, f32 FMAs."""
    r = tl.program_id(0).to(tl.int64)  # x rows vary fastest: they share the weight tile in L2
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    row = tl.minimum(rows, N - 1).to(tl.int64)
    xr = x + r * x_stride
    out = _dot_rows(xr, xr, 1.0, row, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride, d_stride,
                    sc_stride, FMT, HAS_OFF, False, BN, NG)  # fmt: skip
    tl.store(y + r * y_stride + rows, out.to(y.dtype.element_ty), mask=rows < N)


@triton.jit
def _dot3(a, b):
    """``a @ b`` for float32 ``a`` and bf16 ``b`` (exact integers): a as three bf16 parts."""
    a1 = a.to(tl.bfloat16)
    r = a - a1.to(tl.float32)
    a2 = r.to(tl.bfloat16)
    a3 = (r - a2.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(a3, b)
    acc = tl.dot(a2, b, acc)
    return tl.dot(a1, b, acc)


@triton.jit(do_not_specialize=["M", "N", "G"])
def _gemm_kernel(
    x, y, qs, qh, d, dm, sc, mn, M, N, G, x_stride, y_stride,
    qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    """``y[BM, BN] tile = x @ W.T``: per group, a tensor-core dot with the codes, then scaled."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    pid_m = pid % num_m  # the m tiles of one n tile run together: W is read once from DRAM
    pid_n = pid // num_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    xrow = tl.minimum(rm, M - 1).to(tl.int64)
    wrow = tl.minimum(rn, N - 1).to(tl.int64)
    i = tl.arange(0, 16)
    xp = x + xrow[:, None] * x_stride + i[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for g in range(0, G):
        x_lo = tl.load(xp + g * 32)
        x_hi = tl.load(xp + g * 32 + 16)
        lo, hi = _codes(qs, qh, mn, wrow[None, :], g, i[:, None], qs_stride, qh_stride, FMT)
        s_lo, s_hi, off_lo, off_hi = _scales(d, dm, sc, mn, wrow, g, d_stride, sc_stride, FMT)
        # codes -> float32 -> 16-bit: exact (|code| <= 128); no direct int -> bf16 cast
        w_lo = lo.to(tl.float32)
        w_hi = hi.to(tl.float32)
        if SPLIT:
            w_lo = w_lo.to(tl.bfloat16)
            w_hi = w_hi.to(tl.bfloat16)
        else:
            w_lo = w_lo.to(x_lo.dtype)
            w_hi = w_hi.to(x_lo.dtype)
        if (FMT >= Q6_K and FMT <= NVFP4) or FMT >= TABLE:  # a scale per 16 (the ids' order)
            if SPLIT:
                p_lo = _dot3(x_lo, w_lo)
                p_hi = _dot3(x_hi, w_hi)
            else:
                p_lo = tl.dot(x_lo, w_lo)
                p_hi = tl.dot(x_hi, w_hi)
            acc += p_lo * s_lo[None, :] + p_hi * s_hi[None, :]
        else:
            if SPLIT:
                p = _dot3(x_lo, w_lo) + _dot3(x_hi, w_hi)
            else:
                p = tl.dot(x_hi, w_hi, tl.dot(x_lo, w_lo))
            acc += p * s_lo[None, :]
        if HAS_OFF:
            if FMT == Q2_K:
                acc += tl.sum(x_lo.to(tl.float32), 1)[:, None] * off_lo[None, :]
                acc += tl.sum(x_hi.to(tl.float32), 1)[:, None] * off_hi[None, :]
            else:
                xs = tl.sum(x_lo.to(tl.float32), 1) + tl.sum(x_hi.to(tl.float32), 1)
                acc += xs[:, None] * off_lo[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    yp = y + rm.to(tl.int64)[:, None] * y_stride + rn[None, :]
    tl.store(yp, acc.to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "G"])
def _dequant_kernel(
    out, qs, qh, d, dm, sc, mn, N, G, out_stride, qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
):  # fmt: skip
    """``out[rows, groups] = code * scale + offset`` in float32, stored in out's dtype."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    g = tl.program_id(1) * NG + tl.arange(0, NG)
    row = tl.minimum(rows, N - 1).to(tl.int64)
    gl = tl.minimum(g, G - 1)
    i = tl.arange(0, 16)
    lo, hi = _codes(
        qs, qh, mn, row[:, None, None], gl[None, :, None], i[None, None, :],
        qs_stride, qh_stride, FMT,
    )  # fmt: skip
    s_lo, s_hi, off_lo, off_hi = _scales(
        d, dm, sc, mn, row[:, None], gl[None, :], d_stride, sc_stride, FMT
    )
    v_lo = lo.to(tl.float32) * s_lo[:, :, None]
    v_hi = hi.to(tl.float32) * s_hi[:, :, None]
    if HAS_OFF:
        v_lo += off_lo[:, :, None]
        v_hi += off_hi[:, :, None]
    mask = (rows < N)[:, None, None] & (g < G)[None, :, None]
    p = out + row[:, None, None] * out_stride + g[None, :, None] * 32 + i[None, None, :]
    tl.store(p, v_lo.to(out.dtype.element_ty), mask=mask)
    tl.store(p + 16, v_hi.to(out.dtype.element_ty), mask=mask)


# --- launchers -----------------------------------------------------------------------------


def _args(p: Prepared) -> tuple:
    """Plane pointers and row strides in kernel order (unused planes stand in as ``qs``)."""
    args = p.cache.get("args")
    if args is None:
        qs = p.qs
        planes = [t if t is not None else qs for t in (qs, p.qh, p.d, p.dm, p.sc, p.mn)]
        strides = [t.stride(0) if t is not None else 0 for t in (p.qs, p.qh, p.d, p.sc)]
        args = p.cache["args"] = (tuple(planes), tuple(strides))
    return args


def gemv_config(n: int, groups: int) -> tuple[int, int, int]:
    """(BN, NG, num_warps) for the GEMV kernel, the best tiles of the H200 sweep (docs/gpu.md):
    long rows (k >= 2048) 4 rows x 32 groups a step; short ones 16 x 8, even where 8 does not
    divide the groups (k = 576: 18 groups in 3 steps)."""
    if groups >= 64:
        return 4, 32, 4
    return 16, min(8, triton.next_power_of_2(groups)), 4


def gemv(x: torch.Tensor, p: Prepared, y: torch.Tensor, config=None) -> None:
    """``y = x @ W.T`` for few rows of x (one program per BN weight rows and x row)."""
    planes, strides = _args(p)
    bn, ng, warps = config or gemv_config(p.n, p.groups)
    fmt = p.format_id
    _gemv_kernel[(x.shape[0], triton.cdiv(p.n, bn))](
        x, y, *planes, p.n, p.groups, x.stride(0), y.stride(0), *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, BN=bn, NG=ng, num_warps=warps,
    )  # fmt: skip


def gemm_config(m: int, n: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for the GEMM kernel: 64 x 128 was best on an H200 at
    m = 203; for m <= 32, BN = 64 (twice the programs) was twice as fast as 128."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return bm, 64 if m <= 32 else 128, 4, 3


def gemm(x: torch.Tensor, p: Prepared, y: torch.Tensor, config=None) -> None:
    """``y = x @ W.T`` on tensor cores; float32 x as three bf16 parts."""
    planes, strides = _args(p)
    m = x.shape[0]
    bm, bn, warps, stages = config or gemm_config(m, p.n)
    fmt = p.format_id
    grid = (triton.cdiv(m, bm) * triton.cdiv(p.n, bn),)
    _gemm_kernel[grid](
        x, y, *planes, m, p.n, p.groups, x.stride(0), y.stride(0), *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, BM=bm, BN=bn, SPLIT=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


def dequantize(p: Prepared, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense ``[n, k]`` tensor of ``dtype`` (values rounded from float32)."""
    planes, strides = _args(p)
    out = torch.empty((p.n, p.k), dtype=dtype, device=p.qs.device)
    bn, ng = 32, 8
    fmt = p.format_id
    grid = (triton.cdiv(p.n, bn), triton.cdiv(p.groups, ng))
    _dequant_kernel[grid](
        out, *planes, p.n, p.groups, out.stride(0), *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, BN=bn, NG=ng, num_warps=4,
    )  # fmt: skip
    return out
