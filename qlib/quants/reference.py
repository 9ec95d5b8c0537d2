"""Slow, literal transcriptions of ggml's activation quantizers and CPU dot products.

This is the yardstick for the fast paths: per-element Python loops over the
block bytes, float32 arithmetic step by step (``np.float32`` scalars), written
from ggml's C (``ggml-quants.c``: ``quantize_row_q8_0_ref``, ``q8_1_ref``,
``q8_K_ref``; ``ggml-cpu/quants.c``: ``ggml_vec_dot_<type>_<dot>_generic``;
``ggml-cpu/arch/x86/quants.c``: the AVX2 ``quantize_row_q8_0`` / ``q8_1``).
It shares no code with the fast modules: it parses block bytes itself.
Use it on small shapes only.
"""

from __future__ import annotations

import numpy as np

from .types import ggml_type

F32 = np.float32
QK_K = 256


def _f16(b: np.ndarray, off: int) -> np.float32:
    return F32(np.frombuffer(bytes(b[off : off + 2]), dtype="<f2")[0])


def _f32(b: np.ndarray, off: int) -> np.float32:
    return np.frombuffer(bytes(b[off : off + 4]), dtype="<f4")[0]


def _to_f16_bytes(v) -> bytes:
    return np.array([v], dtype="<f2").tobytes()


def _roundf(v: float) -> int:
    return int(np.trunc(np.float64(v) + np.copysign(0.5, v)))


def _nearest_int(v) -> int:
    """ggml's bit trick: ``v + 12582912.f``, low 23 bits minus 0x400000."""
    bits = np.array([F32(v) + F32(12582912.0)], dtype=F32).view(np.int32)[0]
    return int((bits & 0x007FFFFF) - 0x00400000)


def _int8(v: int) -> int:
    return (v + 128) % 256 - 128


# --- activation quantizers --------------------------------------------------------------


def quantize_row_q8_0_ref(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_0_ref``: ``d = amax/127``, ``id = 1/d``, ``roundf``."""
    out = bytearray()
    for blk in np.asarray(x, dtype=F32).reshape(-1, 32):
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = F32(amax / F32(127))
        idd = F32(F32(1) / d) if d else F32(0)
        out += _to_f16_bytes(d)
        out += bytes((_roundf(F32(v * idd)) & 0xFF) for v in blk)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def quantize_row_q8_1_ref(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_1_ref``: as Q8_0 plus ``s = sum(q) * d``."""
    out = bytearray()
    for blk in np.asarray(x, dtype=F32).reshape(-1, 32):
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = F32(amax / F32(127))
        idd = F32(F32(1) / d) if d else F32(0)
        qs = [_roundf(F32(v * idd)) for v in blk]
        out += _to_f16_bytes(d) + _to_f16_bytes(F32(F32(sum(qs)) * d))
        out += bytes(q & 0xFF for q in qs)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def _cvt_round_even(v: np.float32) -> int:
    """``_mm256_round_ps(v, NEAREST)`` then ``_mm256_cvtps_epi32`` (INT_MIN when invalid)."""
    if not np.isfinite(v) or abs(float(np.rint(v))) >= 2.0**31:
        return -(2**31)
    return int(np.rint(v))


def _q8_x86(x: np.ndarray, with_sum: bool) -> np.ndarray:
    out = bytearray()
    for blk in np.asarray(x, dtype=F32).reshape(-1, 32):
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = F32(amax / F32(127))
        idd = F32(F32(127) / amax) if amax != 0 else F32(0)
        ints = [_cvt_round_even(F32(v * idd)) for v in blk]
        out += _to_f16_bytes(d)
        if with_sum:
            total = (sum(ints) + 2**31) % 2**32 - 2**31  # int32 lanes wrap
            out += _to_f16_bytes(F32(d * F32(total)))
        out += bytes(min(127, max(-128, i)) & 0xFF for i in ints)
    return np.frombuffer(bytes(out), dtype=np.uint8)


def quantize_row_q8_0_x86(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's x86 ``quantize_row_q8_0`` (AVX2): ``id = 127/amax``, round half to even."""
    return _q8_x86(x, False)


def quantize_row_q8_1_x86(x: np.ndarray) -> np.ndarray:
    """ggml-cpu's x86 ``quantize_row_q8_1`` (AVX2), ``s`` from the int32 sum."""
    return _q8_x86(x, True)


def quantize_row_q8_K_ref(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q8_K_ref`` (also what x86 runs): ``iscale = -127/max``, ``nearest_int``."""
    out = bytearray()
    for blk in np.asarray(x, dtype=F32).reshape(-1, QK_K):
        vmax, amax = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, vmax = abs(v), v
        if not amax:
            out += bytes(4 + QK_K + 32)
            continue
        iscale = F32(F32(-127) / vmax)
        qs = [_int8(min(127, _nearest_int(F32(iscale * v)))) for v in blk]
        out += np.array([F32(1) / iscale], dtype="<f4").tobytes()
        out += bytes(q & 0xFF for q in qs)
        out += np.array([sum(qs[16 * j : 16 * j + 16]) for j in range(16)], dtype="<i2").tobytes()
    return np.frombuffer(bytes(out), dtype=np.uint8)


X86_ACTIVATIONS = {
    "Q8_0": quantize_row_q8_0_x86,
    "Q8_1": quantize_row_q8_1_x86,
    "Q8_K": quantize_row_q8_K_ref,
}


# --- dot products (ggml_vec_dot_<type>_<dot>_generic) ------------------------------------


def _blocks(row: np.ndarray, size: int):
    row = np.asarray(row, dtype=np.uint8)
    return [row[i : i + size] for i in range(0, len(row), size)]


def _i8(b: np.ndarray, off: int, count: int) -> list[int]:
    return [int(v) for v in b[off : off + count].view(np.int8)]


def vec_dot_q4_0_q8_0(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 18), _blocks(y, 34), strict=True):
        qy = _i8(by, 2, 32)
        sumi0 = sumi1 = 0
        for j in range(16):
            sumi0 += ((int(bx[2 + j]) & 0x0F) - 8) * qy[j]
            sumi1 += ((int(bx[2 + j]) >> 4) - 8) * qy[j + 16]
        sumf += F32(F32(sumi0 + sumi1) * _f16(bx, 0)) * _f16(by, 0)
    return sumf


def vec_dot_q4_1_q8_1(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 20), _blocks(y, 36), strict=True):
        qy = _i8(by, 4, 32)
        sumi0 = sumi1 = 0
        for j in range(16):
            sumi0 += (int(bx[4 + j]) & 0x0F) * qy[j]
            sumi1 += (int(bx[4 + j]) >> 4) * qy[j + 16]
        dd = F32(_f16(bx, 0) * _f16(by, 0))
        sumf += F32(dd * F32(sumi0 + sumi1)) + F32(_f16(bx, 2) * _f16(by, 2))
    return sumf


def vec_dot_q5_0_q8_0(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 22), _blocks(y, 34), strict=True):
        qh = int.from_bytes(bytes(bx[2:6]), "little")
        qy = _i8(by, 2, 32)
        sumi0 = sumi1 = 0
        for j in range(16):
            xh_0 = ((qh & (1 << j)) >> j) << 4
            xh_1 = (qh & (1 << (j + 16))) >> (j + 12)
            x0 = _int8(((int(bx[6 + j]) & 0x0F) | xh_0) - 16)
            x1 = _int8(((int(bx[6 + j]) >> 4) | xh_1) - 16)
            sumi0 += x0 * qy[j]
            sumi1 += x1 * qy[j + 16]
        sumf += F32(F32(_f16(bx, 0) * _f16(by, 0)) * F32(sumi0 + sumi1))
    return sumf


def vec_dot_q5_1_q8_1(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 24), _blocks(y, 36), strict=True):
        qh = int.from_bytes(bytes(bx[4:8]), "little")
        qy = _i8(by, 4, 32)
        sumi0 = sumi1 = 0
        for j in range(16):
            xh_0 = ((qh >> j) << 4) & 0x10
            xh_1 = (qh >> (j + 12)) & 0x10
            sumi0 += ((int(bx[8 + j]) & 0x0F) | xh_0) * qy[j]
            sumi1 += ((int(bx[8 + j]) >> 4) | xh_1) * qy[j + 16]
        dd = F32(_f16(bx, 0) * _f16(by, 0))
        sumf += F32(dd * F32(sumi0 + sumi1)) + F32(_f16(bx, 2) * _f16(by, 2))
    return sumf


def vec_dot_q8_0_q8_0(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 34), _blocks(y, 34), strict=True):
        qx, qy = _i8(bx, 2, 32), _i8(by, 2, 32)
        sumi = sum(a * b for a, b in zip(qx, qy, strict=True))
        sumf += F32(F32(sumi) * F32(_f16(bx, 0) * _f16(by, 0)))
    return sumf


def _q8k(by):
    d = _f32(by, 0)
    qs = _i8(by, 4, QK_K)
    bsums = [int(v) for v in np.frombuffer(bytes(by[260:292]), dtype="<i2")]
    return d, qs, bsums


def vec_dot_q2_K_q8_K(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 84), _blocks(y, 292), strict=True):
        yd, q8, bsums = _q8k(by)
        sc = [int(v) for v in bx[0:16]]
        q2 = [int(v) for v in bx[16:80]]
        summs = sum(bsums[j] * (sc[j] >> 4) for j in range(16))
        dall = F32(yd * _f16(bx, 80))
        dmin = F32(yd * _f16(bx, 82))
        isum, is_, p8 = 0, 0, 0
        for k in range(QK_K // 128):
            for shift in (0, 2, 4, 6):
                for half in (0, 16):
                    d = sc[is_] & 0xF
                    is_ += 1
                    isuml = sum(q8[p8 + half + l] * ((q2[32 * k + half + l] >> shift) & 3)
                                for l in range(16))  # fmt: skip
                    isum += d * isuml
                p8 += 32
        sumf += F32(F32(dall * F32(isum)) - F32(dmin * F32(summs)))
    return sumf


def _lanes(a, q8, sums, d, scale_of):
    """The generic K-quant kernels' 8 int32 lanes: ``aux32[l] += scale * q8 * a`` per 8.

    ``scale_of[j]`` is the integer scale of elements ``8j .. 8j + 7``.
    """
    aux32 = [0] * 8
    for j in range(QK_K // 8):
        sc = scale_of[j]
        for lane in range(8):
            aux32[lane] += sc * _int16(q8[8 * j + lane] * a[8 * j + lane])
    for lane in range(8):
        sums[lane] = F32(sums[lane] + F32(d * F32(aux32[lane])))


def _int16(v: int) -> int:
    return (v + 32768) % 65536 - 32768


def vec_dot_q3_K_q8_K(n, x, y):
    sums = [F32(0)] * 8
    for bx, by in zip(_blocks(x, 110), _blocks(y, 292), strict=True):
        yd, q8, _ = _q8k(by)
        hm, q3 = [int(v) for v in bx[0:32]], [int(v) for v in bx[32:96]]
        a, m = [], 1
        for j in range(2):
            for shift in (0, 2, 4, 6):
                a += [((q3[32 * j + l] >> shift) & 3) - (0 if hm[l] & m else 4) for l in range(32)]
                m <<= 1
        auxs = [int.from_bytes(bytes(bx[96 + 4 * i : 100 + 4 * i]), "little") for i in range(3)]
        kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
        tmp = auxs[2]
        words = [
            (auxs[0] & kmask2) | (((tmp >> 0) & kmask1) << 4),
            (auxs[1] & kmask2) | (((tmp >> 2) & kmask1) << 4),
            ((auxs[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4),
            ((auxs[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4),
        ]
        scales = [_int8(v) for v in b"".join(w.to_bytes(4, "little") for w in words)]
        d = F32(_f16(bx, 108) * yd)
        _lanes(a, q8, sums, d, [scales[j // 2] - 32 for j in range(QK_K // 8)])
    sumf = F32(0)
    for lane in range(8):
        sumf = F32(sumf + sums[lane])
    return sumf


def _k4_scales(raw: bytes):
    """The ``utmp`` shuffle of the Q4_K/Q5_K generic kernels: (scales[8], mins[8])."""
    kmask1, kmask2, kmask3 = 0x3F3F3F3F, 0x0F0F0F0F, 0x03030303
    utmp = [int.from_bytes(raw[4 * i : 4 * i + 4], "little") for i in range(3)] + [0]
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4)
    uaux = utmp[1] & kmask1
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4)
    utmp[2] = uaux
    utmp[0] &= kmask1
    b = b"".join(u.to_bytes(4, "little") for u in utmp)
    return list(b[0:8]), list(b[8:16])


def _vec_dot_q45_K(x, y, size, qs_off, qh_off):
    sums = [F32(0)] * 8
    sumf = F32(0)
    for bx, by in zip(_blocks(x, size), _blocks(y, 292), strict=True):
        yd, q8, bsums = _q8k(by)
        q4 = [int(v) for v in bx[qs_off : qs_off + 128]]
        hm = [int(v) for v in bx[qh_off : qh_off + 32]] if qh_off else None
        a, m = [], 1
        for j in range(QK_K // 64):
            for shift in (0, 4):
                part = [(q4[32 * j + l] >> shift) & 0xF for l in range(32)]
                if hm is not None:
                    part = [v + (16 if hm[l] & m else 0) for l, v in enumerate(part)]
                    m <<= 1
                a += part
        scales, mins = _k4_scales(bytes(bx[4:16]))
        sumi = sum(bsums[j] * mins[j // 2] for j in range(16))
        d = F32(_f16(bx, 0) * yd)
        _lanes(a, q8, sums, d, [scales[j // 4] for j in range(QK_K // 8)])
        dmin = F32(_f16(bx, 2) * yd)
        sumf = F32(sumf - F32(dmin * F32(sumi)))
    for lane in range(8):
        sumf = F32(sumf + sums[lane])
    return sumf


def vec_dot_q4_K_q8_K(n, x, y):
    return _vec_dot_q45_K(x, y, 144, 16, 0)


def vec_dot_q5_K_q8_K(n, x, y):
    return _vec_dot_q45_K(x, y, 176, 48, 16)


def vec_dot_q6_K_q8_K(n, x, y):
    sums = [F32(0)] * 8
    for bx, by in zip(_blocks(x, 210), _blocks(y, 292), strict=True):
        yd, q8, _ = _q8k(by)
        ql, qh = [int(v) for v in bx[0:128]], [int(v) for v in bx[128:192]]
        a = [0] * QK_K
        for j in range(2):
            q4, h = ql[64 * j :], qh[32 * j :]
            for l in range(32):
                a[128 * j + l + 0] = ((q4[l] & 0xF) | (((h[l] >> 0) & 3) << 4)) - 32
                a[128 * j + l + 32] = ((q4[l + 32] & 0xF) | (((h[l] >> 2) & 3) << 4)) - 32
                a[128 * j + l + 64] = ((q4[l] >> 4) | (((h[l] >> 4) & 3) << 4)) - 32
                a[128 * j + l + 96] = ((q4[l + 32] >> 4) | (((h[l] >> 6) & 3) << 4)) - 32
        scales = _i8(bx, 192, 16)
        d = F32(_f16(bx, 208) * yd)
        _lanes(a, q8, sums, d, [scales[j // 2] for j in range(QK_K // 8)])
    sumf = F32(0)
    for lane in range(8):
        sumf = F32(sumf + sums[lane])
    return sumf


def _vec_dot_float(dtype):
    def dot(n, x, y):
        xs = np.frombuffer(bytes(x), dtype=dtype).astype(np.float64)
        ys = np.frombuffer(bytes(y), dtype=dtype).astype(np.float64)
        total = 0.0  # ggml_float (double) accumulation, as the generic loops
        for a, b in zip(xs, ys, strict=True):
            total += float(F32(F32(a) * F32(b)))
        return F32(total)

    return dot


def _bf16_bytes_to_f32(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def vec_dot_bf16(n, x, y):
    xs, ys = _bf16_bytes_to_f32(bytes(x)), _bf16_bytes_to_f32(bytes(y))
    total = 0.0
    for a, b in zip(xs, ys, strict=True):
        total += float(F32(a * b))
    return F32(total)


KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def vec_dot_iq4_nl_q8_0(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 18), _blocks(y, 34), strict=True):
        d = F32(_f16(by, 0) * _f16(bx, 0))
        qy = _i8(by, 2, 32)
        sumi1 = sum(qy[j] * KVALUES_IQ4NL[int(bx[2 + j]) & 0xF] for j in range(16))
        sumi2 = sum(qy[j + 16] * KVALUES_IQ4NL[int(bx[2 + j]) >> 4] for j in range(16))
        sumf += F32(d * F32(sumi1 + sumi2))
    return sumf


def vec_dot_iq4_xs_q8_K(n, x, y):
    sumf = F32(0)
    for bx, by in zip(_blocks(x, 136), _blocks(y, 292), strict=True):
        dy, qy, _ = _q8k(by)
        d4d8 = F32(_f16(bx, 0) * dy)
        h = int(bx[2]) | int(bx[3]) << 8
        for ib in range(0, 8, 2):
            ls1 = (int(bx[4 + ib // 2]) & 0xF) | ((h << 4) & 0x30)
            ls2 = (int(bx[4 + ib // 2]) >> 4) | ((h << 2) & 0x30)
            h >>= 4
            d1, d2 = F32(d4d8 * F32(ls1 - 32)), F32(d4d8 * F32(ls2 - 32))
            qs, q8 = bx[8 + 16 * ib : 8 + 16 * ib + 32], qy[32 * ib : 32 * ib + 64]
            sumi1 = sum(q8[j] * KVALUES_IQ4NL[int(qs[j]) & 0xF] for j in range(16))
            sumi1 += sum(q8[j + 16] * KVALUES_IQ4NL[int(qs[j]) >> 4] for j in range(16))
            sumi2 = sum(q8[j + 32] * KVALUES_IQ4NL[int(qs[j + 16]) & 0xF] for j in range(16))
            sumi2 += sum(q8[j + 48] * KVALUES_IQ4NL[int(qs[j + 16]) >> 4] for j in range(16))
            sumf += F32(d1 * F32(sumi1))
            sumf += F32(d2 * F32(sumi2))
    return sumf


VEC_DOT = {
    "Q4_0": vec_dot_q4_0_q8_0,
    "Q4_1": vec_dot_q4_1_q8_1,
    "Q5_0": vec_dot_q5_0_q8_0,
    "Q5_1": vec_dot_q5_1_q8_1,
    "Q8_0": vec_dot_q8_0_q8_0,
    "Q2_K": vec_dot_q2_K_q8_K,
    "Q3_K": vec_dot_q3_K_q8_K,
    "Q4_K": vec_dot_q4_K_q8_K,
    "Q5_K": vec_dot_q5_K_q8_K,
    "Q6_K": vec_dot_q6_K_q8_K,
    "IQ4_NL": vec_dot_iq4_nl_q8_0,
    "IQ4_XS": vec_dot_iq4_xs_q8_K,
    "F16": _vec_dot_float("<f2"),
    "F32": _vec_dot_float("<f4"),
    "BF16": vec_dot_bf16,
}

DOT_TYPE = {
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1",
    "Q2_K": "Q8_K", "Q3_K": "Q8_K", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K",
    "IQ4_NL": "Q8_0", "IQ4_XS": "Q8_K", "F16": "F16", "BF16": "BF16", "F32": "F32",
}  # fmt: skip


def quantize_activation_row(x: np.ndarray, dot_type: str) -> np.ndarray:
    """One activation row as ggml's x86 CPU backend stores it for the dot product."""
    x = np.asarray(x, dtype=F32)
    if dot_type == "F32":
        return x.view(np.uint8)
    if dot_type == "F16":
        return x.astype("<f2").view(np.uint8)
    if dot_type == "BF16":
        u = x.view(np.uint32).astype(np.uint64)
        bits = np.where(
            (u & 0x7FFFFFFF) > 0x7F800000, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        )
        return bits.astype("<u2").view(np.uint8)
    return X86_ACTIVATIONS[dot_type](x)


def matmul(w: np.ndarray, x: np.ndarray, type_name: str) -> np.ndarray:
    """``[m, n]``: every activation row quantized as on x86, dotted with every weight row."""
    name = ggml_type(type_name).name
    x = np.asarray(x, dtype=F32)
    k = x.shape[1]
    dot = VEC_DOT[name]
    acts = [quantize_activation_row(row, DOT_TYPE[name]) for row in x]
    out = np.zeros((x.shape[0], w.shape[0]), dtype=F32)
    for i, a in enumerate(acts):
        for j in range(w.shape[0]):
            out[i, j] = dot(k, w[j], a)
    return out
