"""Fused Triton kernels for ``qlib.llama.fast_cuda``: a decode step in six kernels per layer.

Each kernel reads the packed planes of ``qlib.quants.cuda.layout.Prepared`` through the
``_codes``/``_scales`` helpers of ``kernels.py`` (so every format of ``NATIVE``
works) and accumulates in float32, with float32 activations:

* ``embed``: dequantize the looked-up rows of ``token_embd`` (ids read on the device);
* ``norm_gemv``: ``y = rms_norm(x) @ W.T`` (or plain ``x @ W.T``) with an epilogue:
  store, add into ``y`` (the residual stream), or SwiGLU (``silu(gate) * up``
  of the stacked gate/up weight);
* ``qkv_rope``: the stacked q/k/v GEMV after RmsNorm, RoPE on q and k, k and v
  written into the KV cache at the position read from the device;
* ``attn_decode``: one query token over the live cache length (read from the
  device), the query heads of a KV head reading the same K/V rows, online softmax;
* ``rope_store``: RoPE and the cache write for a block of prefill rows.

Positions and token ids are read from device tensors, so a whole decode step
can be captured once in a CUDA graph and replayed for every position.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from .kernels import _HAS_OFFSET, _args, _codes, _dot_rows, _scales

try:  # grid dependency control (programmatic dependent launch, sm90+), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None
from .layout import EPI_ADD, EPI_GATE, EPI_STORE, EPI_SWIGLU, Prepared

__all__ = ["EPI_ADD", "EPI_GATE", "EPI_STORE", "EPI_SWIGLU"]  # re-exported from layout


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """With programmatic dependent launch: let the next kernel launch now, then wait until the
    previous one has finished (its writes visible) before touching any memory."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _prefetch_l2(ptrs):
    """Ask for the 128-byte lines at ``ptrs`` in L2 (``prefetch.global.L2``: no result)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _prefetch_rows(qs, d, row, qs_stride, d_stride, QL: tl.constexpr):
    """Prefetch the first ``QL`` 128-byte lines of weight rows ``row`` and their scales."""
    lines = tl.minimum(tl.arange(0, QL) * 128, qs_stride - 1)
    _prefetch_l2(qs + row[:, None] * qs_stride + lines[None, :])
    _prefetch_l2(d + row * d_stride)


@triton.jit
def _rstd(x, K, eps, KB: tl.constexpr):
    """1 / sqrt(mean(x[:K]^2) + eps) of one float32 row."""
    k = tl.arange(0, KB)
    v = tl.load(x + k, mask=k < K, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(v * v, 0) / K + eps)


@triton.jit(do_not_specialize=["eps"])
def _norm_gemv_kernel(
    x, nw, y, qs, qh, d, dm, sc, mn, N, K, G, eps, qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, NORM: tl.constexpr, EPI: tl.constexpr,
    BN: tl.constexpr, NG: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr, QL: tl.constexpr,
):  # fmt: skip
    """One row of x; BN output rows a program (SwiGLU: BN gate rows and their up rows)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    n_out = N // 2 if EPI == 2 else N
    mask = rows < n_out
    row = tl.minimum(rows, n_out - 1).to(tl.int64)
    if PDL:  # launch the next kernel; fetch this program's weight rows while the last one ends
        gdc_launch_dependents()
        if QL > 0:
            _prefetch_rows(qs, d, row, qs_stride, d_stride, QL)
            if EPI == 2:
                _prefetch_rows(qs, d, row + n_out, qs_stride, d_stride, QL)
        gdc_wait()
    rstd = 1.0
    if NORM:
        rstd = _rstd(x, K, eps, KB)
    a = _dot_rows(x, nw, rstd, row, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride, d_stride,
                  sc_stride, FMT, HAS_OFF, NORM, BN, NG)  # fmt: skip
    if EPI == 2:
        b = _dot_rows(x, nw, rstd, row + n_out, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride,
                      d_stride, sc_stride, FMT, HAS_OFF, NORM, BN, NG)  # fmt: skip
        a = a / (1.0 + tl.exp(-a)) * b
    if EPI == 1:
        a += tl.load(y + rows, mask=mask, other=0.0)
    if EPI == 3:  # y holds the gate GEMV: silu(gate) * up
        gate = tl.load(y + rows, mask=mask, other=0.0)
        a = gate / (1.0 + tl.exp(-gate)) * a
    tl.store(y + rows, a, mask=mask)


@triton.jit
def _rope_pair_rows(j, D: tl.constexpr, NEOX: tl.constexpr):
    """Pair j of the stacked q/k/v rows -> (head, i, first row, second row)."""
    head = j // (D // 2)
    i = j % (D // 2)
    if NEOX:
        ra = head * D + i
        rb = ra + D // 2
    else:
        ra = head * D + 2 * i
        rb = ra + 1
    return head, i, ra, rb


@triton.jit
def _store_qkv(
    a, b, head, ra, rb, mask, pos, q, kc, vc, cos, sin, i,
    S, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """RoPE (q and k heads) at position ``pos``, then q -> ``q``, k/v -> the caches at ``pos``."""
    is_q = head < NQ
    is_k = (head >= NQ) & (head < NQ + NKV)
    is_v = head >= NQ + NKV
    c = tl.load(cos + pos * (D // 2) + i, mask=mask & (is_q | is_k), other=1.0)
    s = tl.load(sin + pos * (D // 2) + i, mask=mask & (is_q | is_k), other=0.0)
    rot = is_q | is_k
    a2 = tl.where(rot, a * c - b * s, a)
    b2 = tl.where(rot, a * s + b * c, b)
    ea = ra - head * D
    eb = rb - head * D
    tl.store(q + ra, a2, mask=mask & is_q)
    tl.store(q + rb, b2, mask=mask & is_q)
    kvh = tl.where(is_k, head - NQ, head - NQ - NKV)
    base = (kvh.to(tl.int64) * S + pos) * D
    a2, b2 = a2.to(kc.dtype.element_ty), b2.to(kc.dtype.element_ty)  # f16 cache: rounded
    tl.store(kc + base + ea, a2, mask=mask & is_k)
    tl.store(kc + base + eb, b2, mask=mask & is_k)
    tl.store(vc + base + ea, a2, mask=mask & is_v)
    tl.store(vc + base + eb, b2, mask=mask & is_v)


@triton.jit(do_not_specialize=["eps", "S"])
def _qkv_rope_kernel(
    x, nw, q, kc, vc, pos_ptr, cos, sin, qs, qh, d, dm, sc, mn, K, G, eps, S,
    qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr,
    D: tl.constexpr, NEOX: tl.constexpr, BP: tl.constexpr, NG: tl.constexpr, KB: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """RmsNorm, the stacked q/k/v GEMV (BP row pairs a program), RoPE, KV-cache write."""
    _pdl_start(PDL)
    rstd = _rstd(x, K, eps, KB)
    pos = tl.load(pos_ptr).to(tl.int64)
    j = tl.program_id(0) * BP + tl.arange(0, BP)
    n_pairs = (NQ + 2 * NKV) * (D // 2)
    mask = j < n_pairs
    j = tl.minimum(j, n_pairs - 1)
    head, i, ra, rb = _rope_pair_rows(j, D, NEOX)
    a = _dot_rows(x, nw, rstd, ra.to(tl.int64), qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride,
                  d_stride, sc_stride, FMT, HAS_OFF, True, BP, NG)  # fmt: skip
    b = _dot_rows(x, nw, rstd, rb.to(tl.int64), qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride,
                  d_stride, sc_stride, FMT, HAS_OFF, True, BP, NG)  # fmt: skip
    _store_qkv(a, b, head, ra, rb, mask, pos, q, kc, vc, cos, sin, i, S, NQ, NKV, D)


@triton.jit(do_not_specialize=["S", "q_stride", "qkv_stride"])
def _rope_store_kernel(
    qkv, q, kc, vc, cos, sin, pos_ptr, S, qkv_stride, q_stride,
    NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, NEOX: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    """Row t: RoPE of its q/k heads at ``pos + t``; q -> ``q[t]``, k/v -> the caches (pos read)."""
    t = tl.program_id(0)
    j = tl.program_id(1) * BP + tl.arange(0, BP)
    n_pairs = (NQ + 2 * NKV) * (D // 2)
    mask = j < n_pairs
    j = tl.minimum(j, n_pairs - 1)
    head, i, ra, rb = _rope_pair_rows(j, D, NEOX)
    row = qkv + t.to(tl.int64) * qkv_stride
    a = tl.load(row + ra, mask=mask, other=0.0)
    b = tl.load(row + rb, mask=mask, other=0.0)
    pos = tl.load(pos_ptr).to(tl.int64) + t
    _store_qkv(a, b, head, ra, rb, mask, pos, q + t.to(tl.int64) * q_stride, kc, vc, cos, sin, i,
               S, NQ, NKV, D)  # fmt: skip


@triton.jit(do_not_specialize=["S", "scale"])
def _attn_decode_kernel(
    q, kc, vc, out, pos_ptr, S, scale, GROUP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr
):
    """Query head ``h`` over cache positions ``0..pos``: online softmax, float32."""
    h = tl.program_id(0)
    kvh = (h // GROUP).to(tl.int64)
    n = tl.load(pos_ptr).to(tl.int64) + 1
    dd = tl.arange(0, D)
    qv = tl.load(q + h * D + dd) * scale
    m = tl.max(tl.full([BL], float("-inf"), tl.float32), 0)
    den = tl.sum(tl.zeros([BL], tl.float32), 0)
    acc = tl.zeros([D], tl.float32)
    base = kvh * S * D
    for s0 in range(0, n, BL):
        offs = s0 + tl.arange(0, BL)
        valid = offs < n
        p = base + offs[:, None] * D + dd[None, :]
        k = tl.load(kc + p, mask=valid[:, None], other=0.0).to(tl.float32)
        score = tl.where(valid, tl.sum(k * qv[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(score, 0))
        w = tl.exp(score - m_new)
        alpha = tl.exp(m - m_new)
        v = tl.load(vc + p, mask=valid[:, None], other=0.0).to(tl.float32)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * v, 0)
        m = m_new
    tl.store(out + h * D + dd, acc / den)


@triton.jit(do_not_specialize=["S", "NS", "scale"])
def _attn_split_kernel(
    q, kc, vc, pm, pl, pacc, pos_ptr, S, NS, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Query head ``h``, cache positions ``BL s .. BL s + BL - 1`` (up to ``pos``): the block's
    max score, its softmax denominator and its weighted sum of V, for ``_attn_combine_kernel``."""
    _pdl_start(PDL)
    h = tl.program_id(0)
    s = tl.program_id(1)
    n = tl.load(pos_ptr).to(tl.int64) + 1
    if s * BL < n:
        kvh = (h // GROUP).to(tl.int64)
        dd = tl.arange(0, D)
        qv = tl.load(q + h * D + dd) * scale
        offs = s * BL + tl.arange(0, BL)
        valid = offs < n
        p = kvh * S * D + offs[:, None] * D + dd[None, :]
        k = tl.load(kc + p, mask=valid[:, None], other=0.0).to(tl.float32)
        score = tl.where(valid, tl.sum(k * qv[None, :], 1), float("-inf"))
        m = tl.max(score, 0)
        w = tl.exp(score - m)
        v = tl.load(vc + p, mask=valid[:, None], other=0.0).to(tl.float32)
        slot = h * NS + s
        tl.store(pm + slot, m)
        tl.store(pl + slot, tl.sum(w, 0))
        tl.store(pacc + slot * D + dd, tl.sum(w[:, None] * v, 0))


@triton.jit
def _combine_head(pm, pl, pacc, h, n, NS, D: tl.constexpr, BL: tl.constexpr, NSB: tl.constexpr):
    """Head ``h``'s output over ``n`` positions: ``sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M)
    l_s`` over its live blocks (``[D]``)."""
    dd = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    den = tl.sum(tl.zeros([NSB], tl.float32), 0)
    big = tl.max(tl.full([NSB], float("-inf"), tl.float32), 0)
    for s0 in range(0, tl.cdiv(n, BL), NSB):
        ss = s0 + tl.arange(0, NSB)
        live = ss * BL < n
        slot = h * NS + ss
        m = tl.load(pm + slot, mask=live, other=float("-inf"))
        big_new = tl.maximum(big, tl.max(m, 0))
        w = tl.where(live, tl.exp(m - big_new), 0.0)
        alpha = tl.exp(big - big_new)
        den = den * alpha + tl.sum(w * tl.load(pl + slot, mask=live, other=0.0), 0)
        a = tl.load(pacc + slot[:, None] * D + dd[None, :], mask=live[:, None], other=0.0)
        acc = acc * alpha + tl.sum(w[:, None] * a, 0)
        big = big_new
    return acc / den


@triton.jit(do_not_specialize=["NS"])
def _attn_combine_kernel(
    out, pm, pl, pacc, pos_ptr, NS, D: tl.constexpr, BL: tl.constexpr, NSB: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """The blocks of head ``h`` merged into ``out[h]`` (``_combine_head``)."""
    _pdl_start(PDL)
    h = tl.program_id(0)
    n = tl.load(pos_ptr).to(tl.int64) + 1
    tl.store(out + h * D + tl.arange(0, D), _combine_head(pm, pl, pacc, h, n, NS, D, BL, NSB))


@triton.jit(do_not_specialize=["NS"])
def _combine_wo_kernel(
    res, att, pm, pl, pacc, pos_ptr, NS,
    qs, qh, d, dm, sc, mn, N, GW, qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, D: tl.constexpr, BL: tl.constexpr,
    NSB: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program (h, r): head h's blocks merged, then its share of the output projection,
    ``W[rows, h D : h D + D] @ out[h]`` for BN rows, added into the residual ``res`` with
    float atomics (the heads' shares meet there, in an order that varies run to run)."""
    h = tl.program_id(0)
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = rows < N
    row = tl.minimum(rows, N - 1).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        _prefetch_l2(qs + row * qs_stride + (h * (D // 32) * qs_stride) // GW)
        gdc_wait()
    n = tl.load(pos_ptr).to(tl.int64) + 1
    dd = tl.arange(0, D)
    tl.store(att + h * D + dd, _combine_head(pm, pl, pacc, h, n, NS, D, BL, NSB))
    tl.debug_barrier()  # the head's output, stored by every thread, read back by every thread
    a = _dot_rows(att, att, 1.0, row, qs, qh, d, dm, sc, mn, D // 32, qs_stride, qh_stride,
                  d_stride, sc_stride, FMT, HAS_OFF, False, BN, D // 32, h * (D // 32))  # fmt: skip
    tl.atomic_add(res + rows, a, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["K", "G"])
def _embed_kernel(
    ids, out, qs, qh, d, dm, sc, mn, K, G, qs_stride, qh_stride, d_stride, sc_stride,
    FMT: tl.constexpr, HAS_OFF: tl.constexpr, GB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``out[t] = dequantize(W[ids[t]])`` (float32)."""
    _pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(ids + t).to(tl.int64)
    g = tl.arange(0, GB)
    gmask = (g < G)[:, None]
    g = tl.minimum(g, G - 1)
    i = tl.arange(0, 16)
    lo, hi = _codes(qs, qh, mn, row, g[:, None], i[None, :], qs_stride, qh_stride, FMT)
    s_lo, s_hi, off_lo, off_hi = _scales(d, dm, sc, mn, row, g, d_stride, sc_stride, FMT)
    v_lo = lo.to(tl.float32) * s_lo[:, None]
    v_hi = hi.to(tl.float32) * s_hi[:, None]
    if HAS_OFF:
        v_lo += off_lo[:, None]
        v_hi += off_hi[:, None]
    p = out + t * K + g[:, None] * 32 + i[None, :]
    tl.store(p, v_lo, mask=gmask)
    tl.store(p + 16, v_hi, mask=gmask)


@triton.jit
def _moe_route_kernel(logits, chosen, weights, E, NU: tl.constexpr, EB: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    """A token's experts (``llama.moe.route``'s rule): the softmax over the ``E`` router
    logits, the ``NU`` largest (the lower index first on ties), each over their running sum;
    written in ascending expert order, the order their outputs are added in."""
    _pdl_start(PDL)
    e = tl.arange(0, EB)
    live = e < E
    x = tl.load(logits + e, mask=live, other=float("-inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(live, p, 0.0)
    p = p / tl.sum(p, 0)
    taken = e < 0
    total = 0.0
    for _ in tl.static_range(NU):
        q = tl.where(taken | ~live, -1.0, p)
        taken = taken | (e == tl.argmax(q, 0, tie_break_left=True))
        total += tl.max(q, 0)
    slot = tl.cumsum(taken.to(tl.int32), 0) - 1
    tl.store(chosen + slot, e, mask=taken)
    tl.store(weights + slot, p / total, mask=taken)


@triton.jit(do_not_specialize=["eps"])
def _experts_gemv_kernel(
    x, nw, y, chosen, weights, qs, qh, d, dm, sc, mn, N, K, G, eps, qs_stride, qh_stride,
    d_stride, sc_stride, FMT: tl.constexpr, HAS_OFF: tl.constexpr, NORM: tl.constexpr,
    GATE_UP: tl.constexpr, NU: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr,
    KB: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The chosen experts' GEMVs of one token; ``W`` holds every expert's ``N`` rows, one
    expert after another. ``GATE_UP``: program (i, j) writes ``y[j] = silu(gate) * up`` of
    the j-th chosen expert (its rows gate then up) for the (normed) row ``x``; else (down)
    ``y += sum_j weights[j] * (x[j] @ W_j.T)``, summed from zero in slot order."""
    _pdl_start(PDL)
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    n_out = N // 2 if GATE_UP else N
    mask = rows < n_out
    row = tl.minimum(rows, n_out - 1).to(tl.int64)
    if GATE_UP:
        j = tl.program_id(1)
        row += tl.load(chosen + j).to(tl.int64) * N
        rstd = 1.0
        if NORM:
            rstd = _rstd(x, K, eps, KB)
        a = _dot_rows(x, nw, rstd, row, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride,
                      d_stride, sc_stride, FMT, HAS_OFF, NORM, BN, NG)  # fmt: skip
        b = _dot_rows(x, nw, rstd, row + n_out, qs, qh, d, dm, sc, mn, G, qs_stride, qh_stride,
                      d_stride, sc_stride, FMT, HAS_OFF, NORM, BN, NG)  # fmt: skip
        tl.store(y + j * n_out + rows, a / (1.0 + tl.exp(-a)) * b, mask=mask)
    else:
        acc = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(NU):
            e_row = row + tl.load(chosen + j).to(tl.int64) * N
            a = _dot_rows(x + j * K, x, 1.0, e_row, qs, qh, d, dm, sc, mn, G, qs_stride,
                          qh_stride, d_stride, sc_stride, FMT, HAS_OFF, False, BN, NG)  # fmt: skip
            acc = acc + a * tl.load(weights + j)
        tl.store(y + rows, tl.load(y + rows, mask=mask, other=0.0) + acc, mask=mask)


# --- launchers -----------------------------------------------------------------------------


def _np2(n: int) -> int:
    return triton.next_power_of_2(n)


_PDL = [False]  # programmatic dependent launch of the decode kernels (``launch_mode``)
_PREFETCH = [True]  # with it, the GEMVs prefetch their weight rows into L2 before the wait


@functools.cache
def pdl_available() -> bool:
    """Whether the decode kernels can launch dependently: Triton's grid dependency control
    and a CUDA device of compute capability 9.0+ (Hopper), not the interpreter."""
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@contextlib.contextmanager
def launch_mode(pdl: bool):
    """Kernels launched in this block use programmatic dependent launch (where available):
    each kernel's CTAs become resident while the previous kernel finishes and wait for it on
    the device (``_pdl_start``), so the launch gap overlaps the previous kernel's tail. A
    CUDA graph captured in the block keeps those programmatic edges."""
    old = _PDL[0]
    _PDL[0] = bool(pdl) and pdl_available()
    try:
        yield
    finally:
        _PDL[0] = old


def _pdl() -> dict:
    return {"PDL": True, "launch_pdl": True} if _PDL[0] else {"PDL": False}


def norm_gemv(
    x: torch.Tensor,
    w: Prepared,
    y: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    epilogue: int = EPI_STORE,
    bn: int | None = None,
    ng: int = 32,
    num_warps: int = 4,
) -> None:
    """``y (op)= rms_norm(x) @ W.T`` for one float32 row ``x`` ``[k]`` (norm optional).

    ``epilogue``: ``EPI_STORE`` writes ``y``, ``EPI_ADD`` adds into it, ``EPI_SWIGLU``
    writes ``silu(gate) * up`` (``y`` has ``w.n / 2`` elements: gate rows first),
    ``EPI_GATE`` turns ``y`` (holding the gate) into ``silu(y) * (x @ W.T)``.
    """
    planes, strides = _args(w)
    n_out = w.n // 2 if epilogue == EPI_SWIGLU else w.n
    if bn is None:  # H200 sweep (tools/gpu_tune.py): 4 rows, whole 576-rows in one step
        bn, ng = (32, 8) if n_out >= 16384 else (4, ng)
    fmt = w.format_id
    _norm_gemv_kernel[(triton.cdiv(n_out, bn),)](
        x, norm if norm is not None else x, y, *planes, w.n, w.k, w.groups, eps, *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, NORM=norm is not None, EPI=epilogue,
        BN=bn, NG=min(ng, _np2(w.groups)), KB=_np2(w.k), num_warps=num_warps, **_pdl(),
        QL=_np2(triton.cdiv(w.qs.stride(0) * w.qs.element_size(), 128)) if _PREFETCH[0] else 0,
    )  # fmt: skip


def moe_route(logits: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> None:
    """A token's experts from the router's ``logits`` ``[E]``: ``chosen`` (int32 ``[n_used]``,
    ascending) and their ``weights`` (float32), as ``llama.moe.route`` chooses them."""
    n = logits.numel()
    _moe_route_kernel[(1,)](logits, chosen, weights, n, NU=chosen.numel(), EB=_np2(n),
                            num_warps=1, **_pdl())  # fmt: skip


def experts_gemv(x: torch.Tensor, w: Prepared, y: torch.Tensor, chosen: torch.Tensor,
                 n_expert: int, *, weights: torch.Tensor | None = None,
                 norm: torch.Tensor | None = None, eps: float = 0.0, ng: int = 32,
                 num_warps: int = 4) -> None:  # fmt: skip
    """The chosen experts' GEMVs (``w``: every expert's rows, ``n_expert`` equal runs).
    Without ``weights``: each expert's rows are its gate then its up rows, and ``y`` ``[n_used,
    n_ff]`` receives ``silu(gate) * up`` of ``rms_norm(x)`` (norm optional) per chosen expert;
    with them (the down projection): ``y += sum_j weights[j] * x[j] @ W_j.T`` for the rows
    ``x`` ``[n_used, k]``."""
    planes, strides = _args(w)
    n, n_used, gate_up = w.n // n_expert, chosen.numel(), weights is None
    n_out = n // 2 if gate_up else n
    bn = 32 if n_out >= 16384 else 4
    fmt = w.format_id
    _experts_gemv_kernel[(triton.cdiv(n_out, bn), n_used if gate_up else 1)](
        x, norm if norm is not None else x, y, chosen, weights if weights is not None else x,
        *planes, n, w.k, w.groups, eps, *strides, FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET,
        NORM=norm is not None, GATE_UP=gate_up, NU=n_used, BN=bn, NG=min(ng, _np2(w.groups)),
        KB=_np2(w.k), num_warps=num_warps, **_pdl(),
    )  # fmt: skip


def qkv_rope(
    x: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    w: Prepared,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: tuple[int, int, int],
    neox: bool,
    bp: int = 4,
    ng: int = 32,
    num_warps: int = 4,
) -> None:
    """RmsNorm + stacked q/k/v GEMV + RoPE + KV write at ``pos`` (a device int tensor).

    ``heads`` = (query heads, KV heads, head dim); ``kc``/``vc``: ``[n_kv, S, d]``.
    """
    nq, nkv, hd = heads
    planes, strides = _args(w)
    fmt = w.format_id
    n_pairs = (nq + 2 * nkv) * hd // 2
    _qkv_rope_kernel[(triton.cdiv(n_pairs, bp),)](
        x, norm, q, kc, vc, pos, cos, sin, *planes, w.k, w.groups, eps, kc.shape[1], *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, NQ=nq, NKV=nkv, D=hd, NEOX=neox, BP=bp,
        NG=min(ng, _np2(w.groups)), KB=_np2(w.k), num_warps=num_warps, **_pdl(),
    )  # fmt: skip


def rope_store(
    qkv: torch.Tensor,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: tuple[int, int, int],
    neox: bool,
    bp: int = 64,
) -> None:
    """Rows ``qkv`` ``[t, (nq + 2 nkv) d]`` from position ``pos`` (a device int tensor):
    RoPE, q -> ``q`` ``[t, nq d]``, k and v into the caches at ``pos .. pos + t``."""
    nq, nkv, hd = heads
    n_pairs = (nq + 2 * nkv) * hd // 2
    grid = (qkv.shape[0], triton.cdiv(n_pairs, bp))
    _rope_store_kernel[grid](
        qkv, q, kc, vc, cos, sin, pos, kc.shape[1], qkv.stride(0), q.stride(0),
        NQ=nq, NKV=nkv, D=hd, NEOX=neox, BP=bp, num_warps=2,
    )  # fmt: skip


def attn_decode(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    out: torch.Tensor,
    pos: torch.Tensor,
    *,
    heads: tuple[int, int, int],
    bl: int = 64,
    num_warps: int = 4,
) -> None:
    """``out[h] = softmax(q[h] . K[:pos+1] / sqrt(d)) V[:pos+1]`` for every query head."""
    nq, nkv, hd = heads
    _attn_decode_kernel[(nq,)](
        q, kc, vc, out, pos, kc.shape[1], hd**-0.5, GROUP=nq // nkv, D=hd, BL=bl,
        num_warps=num_warps,
    )  # fmt: skip


class SplitAttention:
    """Decode attention in two kernels: blocks of ``bl`` positions in parallel, then a combine.

    Holds the partial results (``[n_head, max_seq_len / bl]`` maxima and denominators, and
    weighted V sums): every query head gets ``ceil((pos + 1) / bl)`` programs instead of one
    program looping over the whole cache.
    """

    def __init__(self, heads: tuple[int, int, int], max_seq_len: int, device, bl: int = 64):
        # bl = 64 with 4 warps: the best of the H200 sweep; 64 blocks a combine step (an A/B
        # on the H200, 30 layers' calls: 558 -> 348 us at 8176 positions, 124 -> 137 at 256)
        nq, _, hd = heads
        self.heads, self.bl = heads, bl
        self.ns = triton.cdiv(max_seq_len, bl)
        self.m = torch.empty(nq, self.ns, device=device)
        self.l = torch.empty(nq, self.ns, device=device)
        self.acc = torch.empty(nq, self.ns, hd, device=device)

    def __call__(self, q, kc, vc, out, pos, *, num_warps: int = 4, nsb: int = 64) -> None:
        self.split(q, kc, vc, pos, num_warps=num_warps)
        _attn_combine_kernel[(self.heads[0],)](
            out, self.m, self.l, self.acc, pos, self.ns, D=self.heads[2], BL=self.bl, NSB=nsb,
            num_warps=2, **_pdl(),
        )  # fmt: skip

    def split(self, q, kc, vc, pos, *, num_warps: int = 4) -> None:
        """The blocks' partial results (the first kernel of ``__call__``)."""
        nq, nkv, hd = self.heads
        _attn_split_kernel[(nq, self.ns)](
            q, kc, vc, self.m, self.l, self.acc, pos, kc.shape[1], self.ns, hd**-0.5,
            GROUP=nq // nkv, D=hd, BL=self.bl, num_warps=num_warps, **_pdl(),
        )  # fmt: skip

    def combine_wo(self, wo: Prepared, res, out, pos, *, bn: int = 32, nsb: int = 64,
                   num_warps: int = 1) -> None:  # fmt: skip
        """After ``split``: ``res += wo @ attention`` in one kernel (``_combine_wo_kernel``;
        bn = 32 rows, 1 warp: the best of an H200 sweep); ``out`` receives the attention."""
        nq, _, hd = self.heads
        planes, strides = _args(wo)
        fmt = wo.format_id
        _combine_wo_kernel[(nq, triton.cdiv(wo.n, bn))](
            res, out, self.m, self.l, self.acc, pos, self.ns, *planes, wo.n, wo.groups,
            *strides, FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, D=hd, BL=self.bl, NSB=nsb, BN=bn,
            num_warps=num_warps, **_pdl(),
        )  # fmt: skip


def embed(ids: torch.Tensor, w: Prepared, out: torch.Tensor) -> None:
    """``out[t] = dequantize(W[ids[t]])`` for int64 device ids; ``out`` ``[t, k]`` float32."""
    planes, strides = _args(w)
    fmt = w.format_id
    _embed_kernel[(ids.numel(),)](
        ids, out, *planes, w.k, w.groups, *strides,
        FMT=fmt, HAS_OFF=fmt in _HAS_OFFSET, GB=_np2(w.groups), num_warps=4, **_pdl(),
    )  # fmt: skip
