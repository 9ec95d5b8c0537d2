"""The fast CPU path (qlib.llama.fast_cpu, qlib.quants.cpu) against the faithful one.

Kernels: ``qlib.quants.cpu.qgemm`` equals the literal ggml transcription
(``qlib.quants.reference.matmul``) to float rounding (rtol 1e-5: only the
order of the float32 block sums differs); the repacked bf16 weights equal the
float32 dequantized values rounded to bf16, bit for bit.

Prefill kernels (``prefill.c``): ``add_rmsnorm`` and ``swiglu_bf16`` equal
``F.rms_norm`` / ``F.silu(g) * u`` in float32 rounded to bf16 (at most one bf16
ulp apart: another summation order, another exp); ``attn_prefill`` writes the
cache rows exactly as torch's RoPE (1e-6) and its output equals SDPA in
float32 to the bf16 rounding of the output (2 bf16 ulps of the largest value; the tiled
float32 kernel of the int8 prefill, float32 in and out: 1e-5 x the largest value), with
AMX tiles too (scores as three bf16 products of hi/lo splits, ~16 bits; the softmax
weights and v in bf16: same bound). ``amx_gemm`` equals the float32 product of its bf16
inputs to float32 summation order (1e-5 relative) before its epilogue: bf16 output
(one bf16 rounding, 2^-8), float32 residual add, SwiGLU.

Models: with ``prefill="int8"`` FastModel has ggml semantics everywhere, as the
faithful ``quantized`` form, so logits agree to float rounding (2e-5 x the
logit scale). One caveat: a one-ulp difference in an activation (another float
order in RmsNorm, RoPE or attention) can flip one Q8 code and move a logit by
~1e-3 of its scale, so quantized tiny models allow that (5e-3 x scale). The
bf16 prefill is compared with the f32 form by teacher-forced argmax agreement.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib import models
from qlib.gguf import Content
from qlib.llama import fast_cpu as fast
from qlib.llama.errors import IndexPosError, InputError
from qlib.llama.faithful import ModelWeights
from qlib.quants import cpu, reference
from qlib.quants.cpu.layout import PANEL_FORMS
from qlib.quants.qtensor import QTensor

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)
needs_amx = pytest.mark.skipif(
    not cpu.amx_available(), reason=f"AMX unavailable: {cpu.amx_unavailable_reason()}"
)
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@needs_kernels
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_qgemm_matches_ggml_reference(type_name, m):
    g = torch.Generator().manual_seed(1)
    w = QTensor.quantize(torch.randn(37, 192, generator=g), type_name)
    x = torch.randn(m, 192, generator=g) * 3
    y = cpu.qgemm(x, cpu.pack(w))
    ref = reference.matmul(w.data.numpy(), x.numpy(), type_name)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_kernels
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_pack_stacked_and_bf16(type_name):
    g = torch.Generator().manual_seed(2)
    a = QTensor.quantize(torch.randn(8, 128, generator=g), type_name)
    b = QTensor.quantize(torch.randn(5, 128, generator=g), type_name)
    pw = cpu.pack([a, b])
    both = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(cpu.dequantize_bf16(pw), both.to(torch.bfloat16))
    x = torch.randn(2, 128, generator=g)
    y = cpu.qgemm(x, pw)
    assert torch.allclose(y[:, :8], cpu.qgemm(x, cpu.pack(a)), rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_qgemm_flags_and_plans(type_name):
    """``qgemm``'s keyword flags (``norm``, ``swiglu``, ``accumulate``) and the prepared calls
    of the decode step: a plan gives the one-off call's bits, ``accumulate`` adds exactly."""
    g = torch.Generator().manual_seed(3)
    k, n = 128, 40
    pw = cpu.pack(QTensor.quantize(torch.randn(n, k, generator=g), type_name))
    x, gu = torch.randn(1, k, generator=g), torch.randn(2 * k, generator=g)
    norm, h = torch.rand(k, generator=g) + 0.5, torch.randn(1, n, generator=g)
    y = cpu.qgemm(x, pw)
    acc = cpu.qgemm(x, pw, h.clone(), accumulate=True)
    assert torch.equal(acc, h + y)
    for kw, inp in ((dict(), x), (dict(norm=norm, eps=1e-5), x), (dict(swiglu=True), gu)):
        want = cpu.qgemm(inp.view(1, -1), pw, **kw)
        out = torch.full((n,), float("nan"))
        assert cpu.qgemm_plan(pw, inp, out, **kw)() == 0
        assert torch.equal(out, want[0])
        out2 = h.clone()
        assert cpu.qgemm_plan(pw, inp, out2, accumulate=True, **kw)() == 0
        assert torch.equal(out2, h + want)
    assert torch.equal(cpu.qgemm_alloc_plan(pw, x, norm=norm, eps=1e-5)(),
                       cpu.qgemm(x, pw, norm=norm, eps=1e-5))  # fmt: skip
    with pytest.raises(ValueError):
        cpu.qgemm_plan(pw, x, torch.empty(n + 1))  # out of the wrong size
    with pytest.raises(ValueError):
        cpu.qgemm_plan(pw, x, torch.empty(n), swiglu=True)  # swiglu rows are [gate | up]


@needs_kernels
def test_exp_kernel():
    x = torch.linspace(-80, 88, 16 * 500)
    ref = torch.exp(x.double())
    assert ((cpu.exp(x).double() - ref).abs() / ref).max() <= 2e-7
    assert cpu.exp(torch.full((16,), -1e4)).max() <= 2e-38  # clamped, no inf/nan/denormal


@needs_kernels
def test_exp_diff_kernel():
    """The int8 attention's e^(s - m) (base 2, degree-5 polynomial) over the range a softmax
    sees. Bounds: the polynomial's truncation on |f| <= 1/2 ((ln 2 / 2)^6 / 6! * sqrt 2 =
    3.4e-6 relative) plus the rounding of the base-2 argument t = (s - m) log2(e), half an ulp
    of t, i.e. 2^-24 |t| ln 2 relative. So it is within 3.5e-6 of the row's maximum weight (1)
    everywhere; the weights are rounded to 8-bit codes of that maximum next. And 0 (not inf,
    nan or a denormal) far below the maximum."""
    m = 12.5
    x = -torch.linspace(0, 86, 16 * 500)
    s = m + x
    x = (s - m).double()  # as rounded into s
    ref, got = torch.exp(x), cpu.exp_diff(s, m).double()
    assert (got - ref).abs().max() <= 3.5e-6
    assert ((got - ref).abs() / ref <= 3.5e-6 + 2**-24 * x.abs() * 1.4427 * 0.6932).all()
    far = cpu.exp_diff(torch.full((16,), -1e4), m)
    assert far.max() <= 2.4e-38 and torch.isfinite(far).all()


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units of the last place (same-sign finite values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@needs_kernels
@pytest.mark.parametrize("t", [1, 7, 203])
def test_add_rmsnorm_matches_torch(t):
    g = torch.Generator().manual_seed(5)
    k = 576
    h = torch.randn(t, k, generator=g) * 3
    delta = torch.randn(t, k, generator=g).to(torch.bfloat16)
    w = torch.randn(k, generator=g)
    h1 = h.clone()
    out = cpu.add_rmsnorm(h1, delta, w, 1e-5, torch.empty(t, k, dtype=torch.bfloat16))
    assert torch.equal(h1, h + delta.float())  # the residual add is exact float32
    ref = torch.nn.functional.rms_norm(h + delta.float(), (k,), w, 1e-5)
    assert _bf16_ulps(out, ref.to(torch.bfloat16)).max() <= 1
    out32 = cpu.add_rmsnorm(h.clone(), None, w, 1e-5, torch.empty(t, k))
    ref = torch.nn.functional.rms_norm(h, (k,), w, 1e-5)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@needs_kernels
def test_swiglu_matches_torch():
    g = torch.Generator().manual_seed(6)
    gu = (torch.randn(33, 2 * 1536, generator=g) * 4).to(torch.bfloat16)
    gu[0, :16] = torch.tensor([-200.0, 200.0, 0.0, -0.0] * 4)  # saturating exp, both signs
    out = cpu.swiglu_bf16(gu)
    f = gu.float()
    ref = torch.nn.functional.silu(f[:, :1536]) * f[:, 1536:]
    assert torch.isfinite(out.float()).all()
    big = ref.abs() > 1e-30  # silu(-200): torch 0, the kernel -6e-37 (e^x saturates at 88.7)
    assert _bf16_ulps(out[big], ref[big].to(torch.bfloat16)).max() <= 1
    assert out.float()[~big].abs().max() <= 1e-30


def _rope_qkv(qkv, pos, n_head, n_kv, d, cos, sin, neox):
    """q and k roped, v as given, in float32 torch ops: ``(1, heads, t, d)`` each."""
    from qlib.llama.faithful import rope_i, rope_neox

    t = qkv.shape[0]
    x = qkv.float().view(t, n_head + 2 * n_kv, d).transpose(0, 1)[None]  # (1, heads, t, d)
    c, s = cos[pos : pos + t], sin[pos : pos + t]
    rope = rope_neox if neox else rope_i
    return (
        rope(x[:, :n_head], c, s),
        rope(x[:, n_head : n_head + n_kv], c, s),
        x[:, n_head + n_kv :],
    )


def _causal_sdpa(q, kc, vc, pos):
    """Rows ``pos..pos+t-1`` of q (``(1, n_head, t, d)``) over cache positions ``0..pos+i``
    (``kc``, ``vc``: ``[n_kv, max_seq, d]``, read as float32) -> ``[t, n_head d]``."""
    t = q.shape[2]
    L = pos + t
    mask = torch.arange(L)[None, :] <= (torch.arange(t)[:, None] + pos)
    y = torch.nn.functional.scaled_dot_product_attention(
        q, kc[None, :, :L].float(), vc[None, :, :L].float(), attn_mask=mask, enable_gqa=True
    )
    return y[0].transpose(0, 1).reshape(t, -1)


def _attn_reference(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox):
    """RoPE, cache write and masked SDPA in float32 torch ops (as the faithful path)."""
    t, d = qkv.shape[0], kc.shape[-1]
    q, k, v = _rope_qkv(qkv, pos, n_head, n_kv, d, cos, sin, neox)
    kc, vc = kc.clone(), vc.clone()
    kc[:, pos : pos + t] = k[0]
    vc[:, pos : pos + t] = v[0]
    return _causal_sdpa(q, kc, vc, pos), kc, vc


@needs_kernels
@pytest.mark.parametrize(
    "t,pos,n_head,n_kv,d,neox",
    [(203, 0, 9, 3, 64, False), (5, 40, 9, 3, 64, False), (1, 0, 4, 4, 32, True),
     (70, 3, 8, 1, 128, True), (33, 0, 10, 2, 48, False), (17, 2, 6, 2, 48, True)],
)  # fmt: skip
def test_attn_prefill_matches_sdpa(t, pos, n_head, n_kv, d, neox):
    from qlib.llama.config import precompute_freqs_cis

    g = torch.Generator().manual_seed(7)
    max_seq = 256
    cos, sin = precompute_freqs_cis(d, 10000.0, "cpu")
    cos, sin = cos[:max_seq].contiguous(), sin[:max_seq].contiguous()
    kc = torch.randn(n_kv, max_seq, d, generator=g)
    vc = torch.randn(n_kv, max_seq, d, generator=g)
    qkv = (torch.randn(t, (n_head + 2 * n_kv) * d, generator=g) * 2).to(torch.bfloat16)
    ref, kref, vref = _attn_reference(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox)
    out = torch.full((t, n_head * d), float("nan"), dtype=torch.bfloat16)
    cpu.attn_prefill(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox, out=out)
    torch.testing.assert_close(kc, kref, rtol=1e-6, atol=1e-6)  # rows < pos kept, rest roped
    assert torch.equal(vc, vref)
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max() <= 2 * 2**-8 * scale
    q_from = t // 2  # the output of the last rows only (the cache gets every row)
    kc2, vc2 = torch.randn(n_kv, max_seq, d, generator=g), torch.randn(n_kv, max_seq, d)
    kc2[:, :pos], vc2[:, :pos] = kc[:, :pos], vc[:, :pos]
    part = cpu.attn_prefill(qkv, kc2, vc2, pos, n_head, n_kv, cos, sin, neox, q_from=q_from)
    assert part.shape == (t - q_from, n_head * d)
    assert torch.equal(part, out[q_from:])
    assert torch.equal(kc2[:, : pos + t], kc[:, : pos + t])


@needs_kernels
@pytest.mark.parametrize(
    "t,pos,n_head,n_kv,d,neox",
    [(203, 0, 9, 3, 64, False), (5, 40, 9, 3, 64, False), (1, 0, 4, 4, 32, True),
     (70, 3, 8, 1, 128, True), (33, 0, 10, 2, 48, False), (17, 2, 6, 2, 48, True),
     (150, 100, 32, 8, 64, False), (129, 0, 16, 1, 16, False), (40, 1000, 9, 3, 64, False)],
)  # fmt: skip
def test_attn_prefill_flash_matches_sdpa(t, pos, n_head, n_kv, d, neox):
    """The tiled float32 kernel (the int8 prefill's: float32 qkv and out; key blocks of 64,
    online softmax): the cache rows as torch's RoPE, the output equal to SDPA in float32 to
    float rounding (observed <= 1.9e-6 x the largest value); each row's output independent of
    the task split (8 or 16 query rows, q_from); bf16 in and out: the bf16 kernel's bound."""
    from qlib.llama.config import precompute_freqs_cis

    g = torch.Generator().manual_seed(13)
    max_seq = pos + t + 70  # rows past pos + t stay unread (garbage there must not matter)
    cos, sin = (x[:max_seq].contiguous() for x in precompute_freqs_cis(d, 10000.0, "cpu"))
    kc = torch.randn(n_kv, max_seq, d, generator=g)
    vc = torch.randn(n_kv, max_seq, d, generator=g)
    kc[:, pos + t :], vc[:, pos + t :] = float("nan"), float("nan")
    qkv = torch.randn(t, (n_head + 2 * n_kv) * d, generator=g) * 2
    ref, kref, vref = _attn_reference(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox)
    k0, v0 = kc.clone(), vc.clone()
    out = cpu.attn_prefill(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox)
    assert out.dtype == torch.float32 and out.shape == (t, n_head * d)
    torch.testing.assert_close(kc[:, : pos + t], kref[:, : pos + t], rtol=1e-6, atol=1e-6)
    assert torch.equal(vc[:, : pos + t], vref[:, : pos + t])
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    lib = cpu.load()
    try:
        for rows in (8, 16, 5):
            lib.qlib_attn_set_rows(rows)
            k2, v2 = k0.clone(), v0.clone()
            assert torch.equal(cpu.attn_prefill(qkv, k2, v2, pos, n_head, n_kv, cos, sin, neox),
                               out)  # fmt: skip
    finally:
        lib.qlib_attn_set_rows(0)
    q_from = t // 2
    k2, v2 = k0.clone(), v0.clone()
    part = cpu.attn_prefill(qkv, k2, v2, pos, n_head, n_kv, cos, sin, neox, q_from=q_from)
    assert torch.equal(part, out[q_from:])
    qb = qkv.to(torch.bfloat16)
    refb = _attn_reference(qb, k0, v0, pos, n_head, n_kv, cos, sin, neox)[0]
    outb = cpu.attn_prefill(qb, k0.clone(), v0.clone(), pos, n_head, n_kv, cos, sin, neox,
                            flash=True)  # fmt: skip
    assert outb.dtype == torch.bfloat16
    assert (outb.float() - refb).abs().max() <= 2 * 2**-8 * refb.abs().max()


@needs_kernels
@pytest.mark.parametrize(
    "t,pos,n_head,n_kv,d,neox",
    [(203, 0, 9, 3, 64, False), (5, 40, 9, 3, 64, True), (70, 3, 8, 1, 128, True),
     (129, 0, 16, 1, 16, False), (40, 1000, 9, 3, 64, False)],
)  # fmt: skip
def test_attn_prefill_flash_half_cache(t, pos, n_head, n_kv, d, neox):
    """A float16 cache: k and v are stored rounded to nearest even (bit-equal to torch's
    ``.half()`` of the float32 kernel's rows) and the attention reads those rounded values:
    equal to SDPA over the half cache's values to the float32 kernel's bound (1e-5 x max)."""
    from qlib.llama.config import precompute_freqs_cis

    g = torch.Generator().manual_seed(17)
    max_seq = pos + t + 70
    cos, sin = (x[:max_seq].contiguous() for x in precompute_freqs_cis(d, 10000.0, "cpu"))
    k0 = torch.randn(n_kv, max_seq, d, generator=g).half()
    v0 = torch.randn(n_kv, max_seq, d, generator=g).half()
    qkv = torch.randn(t, (n_head + 2 * n_kv) * d, generator=g) * 2
    k32, v32 = k0.float(), v0.float()
    cpu.attn_prefill(qkv, k32, v32, pos, n_head, n_kv, cos, sin, neox)  # the float32 rows
    kc, vc = k0.clone(), v0.clone()
    out = cpu.attn_prefill(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox)
    assert torch.equal(kc, k32.half()) and torch.equal(vc, v32.half())
    # the reference: SDPA over the rounded rows (the chunk's own included)
    q = _rope_qkv(qkv, pos, n_head, n_kv, d, cos, sin, neox)[0]
    ref = _causal_sdpa(q, kc, vc, pos)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    q_from = t // 2
    part = cpu.attn_prefill(qkv, k0.clone(), v0.clone(), pos, n_head, n_kv, cos, sin, neox,
                            q_from=q_from)  # fmt: skip
    assert torch.equal(part, out[q_from:])
    qb = qkv.to(torch.bfloat16)
    outb = cpu.attn_prefill(qb, k0.clone(), v0.clone(), pos, n_head, n_kv, cos, sin, neox)
    assert outb.dtype == torch.bfloat16  # a half cache takes the flash kernel for bf16 io too
    with pytest.raises(ValueError, match="flash"):
        cpu.attn_prefill(qb, k0.clone(), v0.clone(), pos, n_head, n_kv, cos, sin, neox,
                         flash=False)  # fmt: skip


def _codes(x: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``x`` (float32) as the int8 kernel rounds them: codes ``rint(x * top / max|x|)``
    in float32 (ties to even), and the scales ``max|x| / top``."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return torch.round(x * inv), amax / top


def _int8_attention(q, kc, vc, pos):
    """The int8 attention of ``qlib_attn_prefill_flash`` in torch: q (``(1, n_head, t, d)``,
    roped) and the cache rows to int8 codes with one scale per row, the scores
    ``qs ks (qc . kc)``, then per key block of 64 the online softmax (float64) and the block's
    weights ``p vs`` to unsigned 8-bit codes with one scale per query row (the bound
    ``e^(block max - m) max vs`` where the row sees the whole block, else their max)."""
    _, n_head, t, d = q.shape
    n_kv, L = kc.shape[0], pos + t
    rep = n_head // n_kv
    qc, qs = _codes(q[0] / d**0.5, 127.0)  # (h, t, d), (h, t, 1)
    kq, ks = _codes(kc[:, :L].float(), 127.0)  # (g, L, d), (g, L, 1)
    vq, vs = _codes(vc[:, :L].float(), 127.0)
    kq, ks, vq, vs = (x.repeat_interleave(rep, 0) for x in (kq, ks, vq, vs))
    s = ((qc @ kq.transpose(1, 2)) * qs * ks.transpose(1, 2)).double()  # float32, then exact
    lim = (pos + torch.arange(t))[None, :, None]  # the last key each row sees
    m = torch.full((n_head, t, 1), -torch.inf, dtype=torch.float64)
    lsum = torch.zeros(n_head, t, 1, dtype=torch.float64)
    o = torch.zeros(n_head, t, d, dtype=torch.float64)
    for l0 in range(0, L, 64):
        keys = torch.arange(l0, min(l0 + 64, L))[None, None, :]
        seen = keys <= lim
        sb = s[:, :, l0 : l0 + 64].masked_fill(~seen, -torch.inf)
        bmax = sb.amax(-1, keepdim=True)
        mn = torch.maximum(m, bmax)
        alpha = torch.exp(m - mn).nan_to_num(0.0)  # rows that see no key yet keep m = -inf
        p = torch.exp(sb - mn).nan_to_num(0.0)
        lsum = lsum * alpha + p.sum(-1, keepdim=True)
        w = p * vs[:, l0 : l0 + 64, 0].double()[:, None, :]
        whole = lim - l0 + 1 >= 64
        bound = torch.exp(bmax - mn) * vs[:, l0 : l0 + 64].double().amax(1)[:, None, :]
        wmax = torch.where(whole, bound, w.amax(-1, keepdim=True)).nan_to_num(0.0)
        inv = torch.where(wmax > 1e-30, 255.0 / wmax, torch.zeros_like(wmax))
        u = torch.round(w * inv).clamp(0, 255)
        o = o * alpha + (wmax / 255.0) * (u @ vq[:, l0 : l0 + 64].double())
        m = torch.where(seen.any(-1, keepdim=True), mn, m)
    return (o / lsum).float().transpose(0, 1).reshape(t, -1)


@needs_kernels
@pytest.mark.parametrize(
    "t,pos,n_head,n_kv,d,neox,f16",
    [(203, 0, 9, 3, 64, False, False), (150, 70, 9, 3, 64, False, True),
     (70, 3, 8, 2, 128, True, False), (33, 17, 6, 2, 96, False, True),
     (1, 0, 4, 4, 32, True, False)],
)  # fmt: skip
def test_attn_prefill_int8(t, pos, n_head, n_kv, d, neox, f16):
    """``int8=True``: the same cache rows as the float32 kernel; the output equal to a torch
    emulation of its rounding (``_int8_attention``) within one weight code step, 4e-3 x max
    (1/255 of the block's largest weight: a code may round the other way where the kernel's
    float32 softmax and the emulation's float64 one differ; with float32 caches they agree to
    ~1e-7, with half caches ~3% of the rows differ by a step), on average within 5e-5 x max;
    to float32 SDPA within the rounding itself: 3e-2 x max, the mean error within 4e-3 x max
    (8-bit codes: ~0.2-0.4% steps), i.e. 10-100x farther than the emulation. Chunks equal
    the whole."""
    from qlib.llama.config import precompute_freqs_cis

    g = torch.Generator().manual_seed(23)
    max_seq = pos + t + 70
    dtype = torch.float16 if f16 else torch.float32
    cos, sin = (x[:max_seq].contiguous() for x in precompute_freqs_cis(d, 10000.0, "cpu"))
    k0 = torch.randn(n_kv, max_seq, d, generator=g).to(dtype)
    v0 = torch.randn(n_kv, max_seq, d, generator=g).to(dtype)
    qkv = torch.randn(t, (n_head + 2 * n_kv) * d, generator=g)
    kc, vc = k0.clone(), v0.clone()
    out = cpu.attn_prefill(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox, int8=True)
    kf, vf = k0.clone(), v0.clone()
    cpu.attn_prefill(qkv, kf, vf, pos, n_head, n_kv, cos, sin, neox)
    assert torch.equal(kc, kf) and torch.equal(vc, vf)
    q = _rope_qkv(qkv, pos, n_head, n_kv, d, cos, sin, neox)[0]
    emulated = _int8_attention(q, kc, vc, pos)
    ref = _causal_sdpa(q, kc, vc, pos)
    scale = ref.abs().max()
    assert (out - emulated).abs().max() <= 4e-3 * scale
    assert (out - emulated).abs().mean() <= 5e-5 * scale
    assert (out - ref).abs().max() <= 3e-2 * scale
    assert (out - ref).abs().mean() <= 4e-3 * scale
    if t > 1:  # rows pos.. in two chunks: the same result, bit for bit
        cut = t // 3
        kc2, vc2 = k0.clone(), v0.clone()
        parts = [cpu.attn_prefill(qkv[a:b].contiguous(), kc2, vc2, pos + a, n_head, n_kv,
                                  cos, sin, neox, int8=True)
                 for a, b in ((0, cut), (cut, t))]  # fmt: skip
        assert torch.equal(torch.cat(parts), out)
    with pytest.raises(ValueError, match="flash"):
        cpu.attn_prefill(qkv.to(torch.bfloat16), k0.clone().float(), v0.clone().float(), pos,
                         n_head, n_kv, cos, sin, neox, flash=False, int8=True)  # fmt: skip


@needs_kernels
def test_swiglu_f32_matches_torch():
    g = torch.Generator().manual_seed(6)
    gu = torch.randn(33, 2 * 1536, generator=g) * 4
    gu[0, :16] = torch.tensor([-200.0, 200.0, 0.0, -0.0] * 4)
    out = cpu.swiglu(gu)
    ref = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-30)


@needs_amx
@pytest.mark.parametrize(
    "t,pos,n_head,n_kv,d,neox",
    [(203, 0, 9, 3, 64, False), (5, 40, 9, 3, 64, False), (1, 0, 4, 4, 32, True),
     (70, 3, 8, 1, 128, True), (33, 17, 6, 2, 96, False), (200, 45, 6, 2, 64, True),
     (161, 0, 9, 3, 64, False)],
)  # fmt: skip
def test_attn_prefill_amx_matches_sdpa(t, pos, n_head, n_kv, d, neox):
    """The AMX attention: same cache writes as the float32 kernel; output within one bf16
    ulp of the largest value of SDPA in float32, and on average within 1.3x the float32
    kernel's error (which is the output's bf16 rounding). Scores from one bf16 product
    (no hi/lo split) miss both: max 7.8e-3, mean 2.3x on the first case. On two threads
    the 203- and 200-row chunks deal their groups of 32 rows to the threads, the 161-row
    one finds no balanced deal, and the rows from ``q_from`` never deal them: the same
    sums either way."""
    from qlib.llama.config import precompute_freqs_cis

    g = torch.Generator().manual_seed(11)
    max_seq = 256
    cos, sin = (x[:max_seq].contiguous() for x in precompute_freqs_cis(d, 10000.0, "cpu"))
    kc = torch.randn(n_kv, max_seq, d, generator=g)
    vc = torch.randn(n_kv, max_seq, d, generator=g)
    qkv = (torch.randn(t, (n_head + 2 * n_kv) * d, generator=g) * 2).to(torch.bfloat16)
    ref, kref, vref = _attn_reference(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox)
    kf, vf = kc.clone(), vc.clone()
    o32 = cpu.attn_prefill(qkv, kf, vf, pos, n_head, n_kv, cos, sin, neox)  # float32 kernel
    out = cpu.attn_prefill(qkv, kc, vc, pos, n_head, n_kv, cos, sin, neox, amx=True)
    assert torch.equal(kc, kf) and torch.equal(vc, vf)
    err, err32 = (out.float() - ref).abs(), (o32.float() - ref).abs()
    assert err.max() <= 2**-8 * ref.abs().max()
    assert err.mean() <= 1.3 * err32.mean() + 1e-7
    if t > 1:
        q_from = t // 2
        kc2, vc2 = kc.clone(), vc.clone()
        part = cpu.attn_prefill(qkv, kc2, vc2, pos, n_head, n_kv, cos, sin, neox,
                                q_from=q_from, amx=True)  # fmt: skip
        assert torch.equal(part, out[q_from:])


def test_amx_builds_where_the_compiler_knows_amx():
    """A compiler that takes the AMX flags must build the AMX kernels, on any CPU (a broken
    AMX build would otherwise show only as skipped tests, a slower prefill on AMX machines and
    a failed compile in every process elsewhere)."""
    if not cpu.available() or not cpu.build.compiler_knows_amx():
        pytest.skip("no C kernels, or a compiler without AMX")
    assert cpu.build.amx_build_error() is None, cpu.build.amx_build_error()
    if {"amx_tile", "amx_bf16"} <= cpu.build.cpu_flags():
        reason = cpu.amx_unavailable_reason() or ""
        assert "build failed" not in reason, reason


def test_a_failed_build_is_not_retried(tmp_path, monkeypatch):
    """A build that fails leaves its first error in the cache, and the next process reads
    it instead of compiling again (each retry cost ~20 s)."""
    if cpu.build._compiler() is None:
        pytest.skip("no C compiler")
    bad = tmp_path / "bad.c"
    bad.write_text("int f(void) { return undeclared_name; }\n")
    monkeypatch.setattr(cpu.build, "SOURCES", [bad])
    monkeypatch.setattr(cpu.build, "HEADERS", [])
    monkeypatch.setenv("QLIB_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="undeclared_name") as first:
        cpu.build._compile(["-c"])
    monkeypatch.setattr(cpu.build.subprocess, "run", lambda *a, **k: pytest.fail("recompiled"))
    with pytest.raises(RuntimeError) as second:
        cpu.build._compile(["-c"])
    assert str(second.value) == str(first.value)


@needs_amx
@pytest.mark.parametrize("m", [1, 17, 32, 203])
def test_amx_gemm_epilogues(m):
    g = torch.Generator().manual_seed(m)
    n, k = 96, 160
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    ref = a.double() @ w.double().T  # exact products of the bf16 inputs
    bound = 1e-5 * (a.double().abs() @ w.double().abs().T)  # float32 summation
    out = cpu.amx_gemm(a, cpu.pack_amx(w))
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= 2**-8 * ref.abs() + bound).all()
    h = torch.randn(m, n, generator=g)
    h0 = h.double()
    cpu.amx_gemm(a, cpu.pack_amx(w), "add", out=h)
    assert ((h.double() - (h0 + ref)).abs() <= bound + 2**-23 * (h0 + ref).abs()).all()
    sw = cpu.amx_gemm(a, cpu.pack_amx(w, interleave=True), "swiglu")
    gate, up = ref[:, : n // 2], ref[:, n // 2 :]
    want = torch.nn.functional.silu(gate) * up
    # the products' float32 error, carried through silu (|silu'| <= 1.1) and up, then bf16
    slack = bound[:, : n // 2] * (up.abs() * 1.1 + gate.abs()) + 1e-6 * want.abs()
    assert ((sw.double() - want).abs() <= 2**-8 * want.abs() + slack + 1e-30).all()
    with pytest.raises(ValueError):
        cpu.pack_amx(w[:, :40])  # k % 32 != 0


AMX_PASS_BYTES = 1 << 20  # prefill.c: the A rows (bf16) one pass of amx_gemm holds


@needs_amx
@pytest.mark.parametrize("n", [64, 96])  # 64: one column block a thread (2 threads)
def test_amx_gemm_row_passes_equal_slices(n):
    """Rows in several passes (A larger than a pass: 320 rows of k = 1536) give each row the
    bits it gets in a call of its own rows, for every epilogue; the rows of a pass boundary
    and the software-pipelined epilogue of each pass's last block included."""
    g = torch.Generator().manual_seed(n)
    k = 1536
    rows = AMX_PASS_BYTES // (2 * k) // 32 * 32
    m = 2 * rows + 45
    a = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    for epi, tiles in (("bf16", cpu.pack_amx(w)), ("swiglu", cpu.pack_amx(w, interleave=True))):
        whole = cpu.amx_gemm(a, tiles, epi)
        for r0 in range(0, m, rows - 64):  # slices across each pass boundary
            part = cpu.amx_gemm(a[r0 : r0 + rows - 32], tiles, epi)
            assert torch.equal(part, whole[r0 : r0 + rows - 32]), (epi, r0)
    h = torch.randn(m, n, generator=g)
    want = h.clone()
    cpu.amx_gemm(a, cpu.pack_amx(w), "add", out=h)
    for r0 in range(0, m, rows):
        cpu.amx_gemm(a[r0 : r0 + rows], cpu.pack_amx(w), "add", out=want[r0 : r0 + rows])
    assert torch.equal(h, want)


def test_collapse_hugepages_keeps_data():
    x = torch.arange(8 << 20, dtype=torch.float32)  # 32 MB, resident
    before = x.clone()
    done = cpu.collapse_hugepages()
    assert done >= 0 and torch.equal(x, before)


def _mapping_at(address: int) -> dict | None:
    """This process's mapping that holds ``address`` (Linux ``/proc/self/smaps``): its
    ``name`` ("" anonymous, "[heap]", a path), ``flags`` (VmFlags: "hg" is
    ``MADV_HUGEPAGE``) and ``huge_kb`` (AnonHugePages), or None."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            if found is not None:
                break
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                found = {"name": fields[5] if len(fields) > 5 else "", "flags": [], "huge_kb": 0}
        elif found is not None and fields[0] == "AnonHugePages:":
            found["huge_kb"] = int(fields[1])
        elif found is not None and fields[0] == "VmFlags:":
            found["flags"] = fields[1:]
    return found


def _thp_available() -> bool:
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def test_weights_arena_gives_aligned_tensors_on_2mb_pages():
    """Inside ``hugepage_weights``, ``weights_empty`` carves 64-byte-aligned tensors one after
    the other from mappings advised before their first write (2 MB pages where the kernel
    has transparent huge pages); a request larger than a chunk gets a mapping of its own;
    outside, it is ``torch.empty``. Values written are read back, tensors do not overlap."""
    with cpu.hugepage_weights(chunk_bytes=8 << 20):
        a = cpu.weights_empty((3, 5), torch.int16)
        b = cpu.weights_empty((1000, 1000), torch.float32)  # 4 MB: the same chunk
        c = cpu.weights_empty((3 << 20,), torch.float32)  # 12 MB > the chunk: its own
        d = cpu.weights_copy(torch.arange(10.0).view(2, 5).t())
    plain = cpu.weights_empty((4,), torch.float32)
    assert all(t.data_ptr() % 64 == 0 for t in (a, b, c, d))
    assert a.data_ptr() + a.numel() * 2 <= b.data_ptr() and d.is_contiguous()
    assert torch.equal(d, torch.arange(10.0).view(2, 5).t())
    for t, v in ((a, 7), (b, 1.5), (c, -2.0)):
        t.fill_(v)
    assert (a == 7).all() and (b == 1.5).all() and (c == -2.0).all()
    assert plain.shape == (4,) and plain.dtype == torch.float32
    if _thp_available() and sys.platform == "linux":
        for t, kb in ((b, 2048), (c, 10 * 1024)):  # b's 4 MB span a whole 2 MB page
            where = _mapping_at(t.data_ptr())
            assert where["name"] == "" and "hg" in where["flags"] and where["huge_kb"] >= kb


@pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason() or "no C kernels")
def test_fast_model_packs_its_weights_on_2mb_pages(tmp_path, monkeypatch):
    """``FastModel.from_gguf`` packs inside ``hugepage_weights``: the planes of a weight of
    several MB are written into a mapping of their own advised ``MADV_HUGEPAGE``, on 2 MB pages
    before (here: without) ``collapse_hugepages`` (not the heap, which numpy advises in parts
    for its own large arrays); ``hugepages=False`` gives the same logits."""
    monkeypatch.setattr(cpu, "collapse_hugepages", lambda *a, **k: 0)
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0", n_embd=512, n_head=8,
                            n_kv_head=8, n_ff=4096, n_layer=1)  # fmt: skip
    with_pages = _build(path, fast.FastModel)
    codes = with_pages.layers[0].w13.packed.codes  # 8192 x 512: 4 MB
    assert codes.numel() >= 4 << 20
    if _thp_available() and sys.platform == "linux":
        where = _mapping_at(codes.data_ptr())
        assert where["name"] == "" and "hg" in where["flags"] and where["huge_kb"] >= 2048
    without = _build(path, fast.FastModel, hugepages=False)
    x = torch.randint(0, 256, (1, 5))
    assert torch.equal(with_pages.forward(x, 0), without.forward(x, 0))


def test_unsupported_shapes_are_refused():
    w = QTensor.quantize(torch.randn(4, 96), "Q8_0")  # k % 64 != 0
    assert not cpu.supports("Q8_0", 96) and not cpu.supports("Q4_K", 320)
    with pytest.raises(ValueError):
        cpu.pack(w)


def _build(path, cls=ModelWeights, **kw):
    with open(path, "rb") as f:
        content = Content.read(f)
        return cls.from_gguf(content, f, "cpu", **kw)


@pytest.fixture(params=["F32", "Q8_0", "Q4_1", "Q4_0"])
def tiny(request, tmp_path):
    wt = request.param
    path = write_tiny_llama(tmp_path / f"tiny_{wt}.gguf", weight_type=wt, n_embd=128, n_ff=256)
    return wt, path


def _check_against_faithful(path, wt, fm):
    ref = _build(path)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    tol = 2e-5 if wt == "F32" else 5e-3
    with torch.inference_mode():
        a = fm.forward(ids[:, :9], 0, all_logits=True)
        b = ref.forward(ids[:, :9], 0, all_logits=True)
        scale = b.abs().max()
        assert (a - b).abs().max() <= tol * scale
        for pos in range(9, 12):  # decode steps
            a = fm.forward(ids[:, pos : pos + 1], pos)
            b = ref.forward(ids[:, pos : pos + 1], pos)
            assert (a - b).abs().max() <= tol * scale, pos


def test_fast_model_matches_faithful(tiny):
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="int8")
    if cpu.available() and wt != "F32":
        assert fm._plan is not None  # the fused C decode step is what is tested
    _check_against_faithful(path, wt, fm)


def test_fast_model_without_kernels(tiny, monkeypatch):
    wt, path = tiny
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setattr(cpu.build, "_reason", "disabled by the test")
    fm = _build(path, fast.FastModel, prefill="int8")
    assert fm._plan is None and all(ly.wqkv.packed is None for ly in fm.layers)
    _check_against_faithful(path, wt, fm)


@needs_amx
@pytest.mark.parametrize("t", [40, 200])
def test_amx_layers_match_onednn_prefill(tiny, t):
    """The AMX layer kernel (default where AMX is) vs the oneDNN matmuls + C kernels
    (``amx=False``): both round matmul inputs to bf16; the AMX one keeps matmul outputs that
    feed the residual (and SwiGLU's inputs) in float32, so they differ by bf16 roundings.
    On two threads the 200-row chunk deals its groups of 32 rows to the threads (the first
    RmsNorm, the qkv GEMM split by rows, the attention); 40 rows do not."""
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    fo = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2, amx=False)
    ref = _build(path, form="f32")
    assert fm.amx_layers and not fo.amx_layers
    ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        a, b = (m.forward(ids, 0, all_logits=True)[0] for m in (fm, fo))
        r = ref.forward(ids, 0, all_logits=True)[0]
        last = fm.forward(ids, 0)  # the last layer for the last row only
        a2 = fm.forward(ids[:, :4], t, all_logits=True)[0]  # a chunk after a prefix
        b2 = fo.forward(ids[:, :4], t, all_logits=True)[0]
    scale = r.abs().max()
    assert (a - b).abs().max() <= 0.02 * scale and (a2 - b2).abs().max() <= 0.02 * scale
    assert (a - r).abs().mean() <= 1.5 * (b - r).abs().mean() + 1e-6 * scale
    assert (last[0] - a[-1]).abs().max() <= 0.02 * scale


@needs_amx
def test_prefill_layers_in_one_call_equal_layer_by_layer(tiny):
    """``cpu.prefill_layers`` over the whole stack in one C call leaves the residual stream
    and the KV cache bit for bit as the same entry called a layer at a time (the last row
    only in the last layer, as the model asks), and refuses inputs it cannot take."""
    _, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    c, t = fm.config, 40
    ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(9))
    h0 = fm.embed(ids).contiguous()
    scratch = cpu.PrefillScratch.for_layer(fm._amx[0], t)
    kw = dict(eps=c.rms_norm_eps, pos=0, n_head=c.head_count, n_kv=c.head_count_kv,
              cos=fm.cos, sin=fm.sin, neox=c.rope_is_neox)  # fmt: skip
    n = len(fm._amx)
    h_one, cache_one = h0.clone(), fm.cache.clone()
    cpu.prefill_layers(h_one, fm._amx, scratch, cache_one, norms=fm._amx_norms, q_from=t - 1,
                       **kw)  # fmt: skip
    h_each, cache_each = h0.clone(), fm.cache.clone()
    for i in range(n):
        cpu.prefill_layers(h_each, fm._amx[i : i + 1], scratch, cache_each[i : i + 1],
                           norms=fm._amx_norms[2 * i : 2 * i + 2],
                           q_from=t - 1 if i == n - 1 else 0, **kw)  # fmt: skip
    assert torch.equal(h_one, h_each) and torch.equal(cache_one, cache_each)
    assert not torch.equal(h_one, h0)
    with pytest.raises(ValueError, match="two norms a layer"):
        cpu.prefill_layers(h_one, fm._amx, scratch, cache_one, norms=fm._amx_norms[:-1], **kw)
    with pytest.raises(ValueError, match="shapes"):
        cpu.prefill_layers(h_one, fm._amx, scratch, cache_one, norms=fm._amx_norms,
                           q_from=t, **kw)  # fmt: skip


@needs_amx
def test_amx_prefill_same_logits_on_any_thread_count(tiny):
    """The AMX prefill deals its rows to the threads by their number (or not at all), and
    every output element is summed in the same order either way: 200 rows on 1, 2 and 3
    threads give the same logits and cache, bit for bit."""
    _, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(8))
    threads, outs = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            with torch.inference_mode():
                fm.clear_kv_cache()
                outs.append((fm.forward(ids, 0, all_logits=True), fm.cache.clone()))
    finally:
        torch.set_num_threads(threads)
    for logits, cache in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(cache, outs[0][1])


@needs_amx
def test_prefill_phase_times(tiny):
    """The AMX prefill timed by its own clock: the logits bit for bit those of a plain
    forward, every phase of ``cpu.PREFILL_PHASES`` timed on every thread (work > 0, waits
    >= 0), and work plus waits within the wall time of the call; timing off again after."""
    _, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        plain = fm.forward(ids, 0)
        t0 = time.perf_counter()
        timed, times = fm.prefill_phase_times(ids)
        wall = time.perf_counter() - t0
        kept = times.clone()
        again = fm.forward(ids, 0)
    assert torch.equal(plain, timed) and torch.equal(plain, again)
    assert torch.equal(times, kept)  # the plain forward after it kept no times
    assert times.shape == (torch.get_num_threads(), len(cpu.PREFILL_PHASES), 2)
    assert (times[..., 0] > 0).all() and (times[..., 1] >= 0).all()
    assert (times.sum(dim=(1, 2)) <= wall).all()


@needs_amx
def test_amx_packed_weights_equal_bf16_tiles(tiny):
    """Q4_0 / Q4_1 / Q8_0 weights kept 4/8-bit for the AMX kernels (expanded to bf16 tiles
    inside the GEMM) give the same logits, bit for bit, as a bf16 tile copy: the expansion
    computes code * d + m in float32 (the product is exact) and rounds to bf16 once, as
    ``dequantize_bf16`` does. The GEMM alone, too, for every epilogue."""
    wt, path = tiny
    fp = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    fb = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2, amx_packed=False)
    kinds = {ly.w13.amx.kind for ly in fp.layers}
    assert kinds == ({"bf16"} if wt == "F32" else {"q8" if wt == "Q8_0" else "q4"})
    assert {ly.w13.amx.kind for ly in fb.layers} == {"bf16"}
    if wt != "F32":
        assert fp.nbytes() < fb.nbytes()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(fp.forward(ids, 0, all_logits=True), fb.forward(ids, 0, all_logits=True))
    if wt == "F32":
        return
    k = fp.layers[0].w13.in_features
    for m in (37, AMX_PASS_BYTES // (2 * k) // 32 * 32 + 37):  # one pass of rows; two
        a = torch.randn(m, k).to(torch.bfloat16)
        for epi in ("bf16", "swiglu"):
            want = cpu.amx_gemm(a, fb.layers[0].w13.amx, epi)
            assert torch.equal(cpu.amx_gemm(a, fp.layers[0].w13.amx, epi), want)


def _expand_amx_codes(w: cpu.AmxWeight) -> torch.Tensor:
    """``amx_expand_tile`` of prefill.c in torch: each code -> ``code * d + m`` (the product
    is exact in float32, so this is the kernel's one fused rounding) -> bf16, in row order."""
    nj, nc = w.n // 16, w.k // 32
    t = w.tiles.to(torch.int16) if w.kind.startswith("q8") else w.tiles
    if w.kind.startswith("q4"):  # byte i of tile row r: value i | value 16 + i << 4
        t = torch.stack([t & 15, t >> 4], dim=-2).to(torch.int16)
    q = t.reshape(nj, nc, 16, 16, 2).permute(0, 3, 1, 2, 4).reshape(w.n, w.k).float()
    groups = w.d.shape[1]
    per = lambda x: x.permute(0, 2, 1).reshape(w.n, groups).repeat_interleave(w.k // groups, 1)  # noqa: E731
    y = q * per(w.d)
    return (y + per(w.m) if w.m is not None else y).to(torch.bfloat16)


AMX_CODE_STACKS = [*[[t] for t in cpu.AMX_CODES], ["Q4_K", "Q4_K", "Q6_K"], ["Q5_0", "Q3_K"],
                   ["Q4_0", "Q2_K"], ["Q4_1", "Q5_K"]]  # fmt: skip


@pytest.mark.parametrize("types", AMX_CODE_STACKS, ids="+".join)
@pytest.mark.parametrize("interleave", [False, True])
def test_amx_codes_hold_the_bf16_values(types, interleave):
    """``pack_amx_codes`` (every quantized type, and mixes as Q4_K_M stacks them), expanded as
    the AMX GEMM expands it, gives the values of ``QTensor.dequantize`` rounded to bf16 bit for
    bit, in the tile order of ``pack_amx`` (gate/up interleaved too); its bytes are
    ``amx_code_bytes``'. Runs without AMX: the C expansion is tested against the same bf16
    tiles in ``test_amx_codes_equal_bf16_tiles``."""
    g = torch.Generator().manual_seed(7)
    qs = [QTensor.quantize(torch.randn(64, 512, generator=g) * 0.05, t) for t in types]
    w = cpu.pack_amx_codes(qs, interleave=interleave)
    want = torch.cat([q.dequantize(dtype=torch.bfloat16) for q in qs])
    tiles = cpu.pack_amx(want, interleave=interleave)  # bf16 tiles, in tile order
    want = tiles.permute(0, 3, 1, 2, 4).reshape(want.shape)  # back to rows, interleaved
    assert torch.equal(_expand_amx_codes(w), want)
    assert w.nbytes() == cpu.amx_code_bytes(types) * want.numel() < 2 * want.numel()
    assert w.kind == cpu.amx_codes_plan(types)[0]


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_amx_codes_from_the_planes_hold_the_bf16_values(type_name):
    """``pack_amx_quantized`` (the planes of ``pack``; Q5_* as 8-bit codes, Q5_0's ``q - 16``),
    expanded as the AMX GEMM expands it, gives ``QTensor.dequantize``'s values rounded to bf16
    bit for bit, in ``pack_amx``'s tile order. Runs without AMX."""
    g = torch.Generator().manual_seed(9)
    q = QTensor.quantize(torch.randn(64, 512, generator=g) * 0.05, type_name)
    w = cpu.pack_amx_quantized(cpu.pack(q))
    want = q.dequantize(dtype=torch.bfloat16)
    want = cpu.pack_amx(want).permute(0, 3, 1, 2, 4).reshape(want.shape)
    assert torch.equal(_expand_amx_codes(w), want)


def test_amx_codes_refuse_float_parts():
    w = QTensor.quantize(torch.randn(32, 256), "F16")
    assert cpu.amx_codes_plan(["Q4_K", "F16"]) is None and cpu.amx_code_bytes(["F32"]) is None
    with pytest.raises(ValueError, match="no AMX codes"):
        cpu.pack_amx_codes([w])


Q4_K_M_LIKE = {"*attn_v*": "Q6_K", "*ffn_down*": "Q6_K", "token_embd*": "Q8_0"}


@needs_amx
@pytest.mark.parametrize("types", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_1", "Q4_K_M",
                                   "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4"])  # fmt: skip
def test_amx_codes_equal_bf16_tiles(tmp_path, types):
    """K-quant (and Q5_1, a Q4_K_M-like mix, the IQ4 and FP4 types) weights kept as AMX codes
    give the logits of a bf16 tile copy bit for bit, and hold fewer bytes."""
    mix = Q4_K_M_LIKE if types == "Q4_K_M" else None
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_K" if mix else types,
                            weight_types=mix, n_embd=256, n_kv_head=2, n_ff=512)  # fmt: skip
    fp = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    fb = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2, amx_packed=False)
    assert fp.amx_layers and {ly.w2.amx.kind for ly in fp.layers} != {"bf16"}
    assert fp.nbytes() < fb.nbytes()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert torch.equal(fp.forward(ids, 0, all_logits=True), fb.forward(ids, 0, all_logits=True))
    a = torch.randn(37, 256).to(torch.bfloat16)
    for epi in ("bf16", "swiglu"):
        want = cpu.amx_gemm(a, fb.layers[0].w13.amx, epi)
        assert torch.equal(cpu.amx_gemm(a, fp.layers[0].w13.amx, epi), want)


def test_bf16_prefill_close_to_f32(tiny):
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    ref = _build(path, form="f32")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a = fm.forward(ids, 0, all_logits=True)[0]
        b = ref.forward(ids, 0, all_logits=True)[0]
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


@needs_kernels
def test_fused_prefill_matches_unfused(tiny):
    """The C prefill kernels vs the same bf16 prefill in torch ops (``_fused_prefill`` off)."""
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    if wt != "F32":
        assert fm._fused_prefill
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        a = fm.forward(ids[:, :30], 0, all_logits=True)[0]
        a2 = fm.forward(ids[:, 30:], 30, all_logits=True)[0]  # a chunk after a prefix
        a3 = fm.forward(ids[:, 39:40], 40)  # a C decode step over the prefilled cache
        # the last layer for the last row only: its wo and FFN in the packed C kernels when
        # the weights have them (ggml semantics: Q8 activations, or float32 rows for F32),
        # else the same bf16 matmuls
        last = fm.forward(ids[:, :30], 0)
        tol = 1e-5 if fm.layers[-1].w2.packed is None else 0.02
        assert (last[0] - a[-1]).abs().max() <= tol * a.abs().max()
        fm._fused_prefill = False
        b = fm.forward(ids[:, :30], 0, all_logits=True)[0]
        b2 = fm.forward(ids[:, 30:], 30, all_logits=True)[0]
        b3 = fm.forward(ids[:, 39:40], 40)
    # both round matmul inputs to bf16; the fused path also rounds matmul outputs
    scale = b.abs().max()
    for x, y in ((a, b), (a2, b2), (a3, b3)):
        assert (x - y).abs().max() <= 0.02 * scale
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_index_pos_is_checked(tiny):
    _, path = tiny
    fm = _build(path, fast.FastModel)
    with torch.inference_mode():
        fm.forward(torch.tensor([[1, 2, 3]]), 0)
        with pytest.raises(IndexPosError):
            fm.forward(torch.tensor([[4]]), 5)
        fm.forward(torch.tensor([[4]]), 3)
        assert fm.kv_len == 4
        fm.forward(torch.tensor([[5, 6]]), 4)  # a chunk after a prefix (masked SDPA)
        fm.forward(torch.tensor([[1]]), 0)  # 0 starts over
        assert fm.kv_len == 1


# -- memory: pages released while packing, the embedding looked up once ---------------------

PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS",
                "MXFP4", "NVFP4", "Q1_0")  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("type_name", PACKED_TYPES)
@pytest.mark.parametrize("panels", [False, True])
def test_dequantize_rows_of_packed_weights(type_name, panels):
    """A packed weight's rows (planes, GGUF blocks, 16-row panels) dequantize to exactly the
    values of the QTensor it was packed from: a tied embedding is looked up there."""
    g = torch.Generator().manual_seed(4)
    w = QTensor.quantize(torch.randn(48, 512, generator=g), type_name)
    pw = cpu.pack(w, panels=panels)
    assert pw.panels == (panels and type_name not in ("Q5_0", "Q5_1", "Q6_K"))
    # (IQ4_NL without panels: Q8_0 planes of the same values; MXFP4, NVFP4, Q1_0: Q5_0 planes,
    # X4 blocks, Q4_0 planes)
    ids = torch.tensor([0, 47, 7, 7, 12, 16])
    assert torch.equal(cpu.dequantize_rows(pw, ids), w.dequantize()[ids])


@needs_kernels
# (qlib's own blocks: X4, X3 in test_grid_types.py, the panels' forms in test_fp4_types.py)
@pytest.mark.parametrize(
    "type_name", sorted(set(cpu.ROW_TYPES) - {"X4", "X3", *PANEL_FORMS.values()})
)
def test_dequant_rows_equals_the_blocks_dequantized(type_name):
    """rows.c's rows of GGUF blocks of every type it reads are ``dequantize_torch``'s (ggml's
    ``dequantize_row_*``, itself held to the gguf package's in test_quants) bit for bit,
    weights scaled so that every code and sub-block scale occurs; bad ids and sizes refused."""
    g = torch.Generator().manual_seed(5)
    w = QTensor.quantize(torch.randn(20, 512, generator=g) * torch.rand(20, 1, generator=g) * 8,
                         type_name)  # fmt: skip
    ids = torch.tensor([19, 0, 5, 5])
    got = cpu.dequant_rows(w.data, type_name, 20, 512, ids)
    assert torch.equal(got, w.dequantize()[ids])
    lookup_out = torch.empty(512)
    lookup = cpu.RowLookup(w.data, type_name, 20, 512, lookup_out)
    lookup(5)
    assert torch.equal(lookup_out, got[2])
    with pytest.raises(IndexError):
        lookup(20)
    with pytest.raises(IndexError):
        cpu.dequant_rows(w.data, type_name, 20, 512, torch.tensor([-1]))
    with pytest.raises(ValueError, match="not"):
        cpu.dequant_rows(w.data, type_name, 21, 512, ids)


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q6_K"])
def test_pack_releases_every_piece(type_name, monkeypatch):
    """``pack(release=)`` is called on pieces of the blocks that cover each weight once, in
    order, and the packed weight is the one packed without it."""
    from qlib.quants.cpu import packing

    monkeypatch.setattr(packing, "PACK_CHUNK", 3000)  # a few rows a piece
    g = torch.Generator().manual_seed(5)
    a = QTensor.quantize(torch.randn(24, 512, generator=g), type_name)
    b = QTensor.quantize(torch.randn(9, 512, generator=g), type_name)
    pieces: list[torch.Tensor] = []
    pw = cpu.pack([a, b], release=pieces.append)
    ref = cpu.pack([a, b])
    for x, y in ((pw.codes, ref.codes), (pw.d, ref.d), (pw.m, ref.m)):
        assert (x is None and y is None) or torch.equal(x, y)
    assert len(pieces) > 2
    assert torch.equal(torch.cat([p.reshape(-1) for p in pieces]),
                       torch.cat([a.data.reshape(-1), b.data.reshape(-1)]))  # fmt: skip


@pytest.mark.parametrize("tie", [True, False])
def test_mapped_fast_engine_embedding(tmp_path, tie):
    """Mapped, the fast engine looks a tied embedding up in the output's packed weight and an
    untied one in the file (dropping its pages again): the same rows, the same logits as the
    read file's engine; the norms are not views of the mapping."""
    from qlib.llama.engine import load

    p = write_tiny_llama(tmp_path / "t.gguf", weight_type="Q8_0", n_embd=128, n_ff=256,
                         tie_output=tie)  # fmt: skip
    mapped, _ = load(p, engine="fast")
    read, _ = load(p, engine="fast", mmap=False)
    packed = mapped.output.packed is not None
    assert (mapped._embed_rows is not None) == (tie and packed)
    ids = torch.tensor([3, 0, 200, 3])
    want = mapped.tok_embd.dequantize()[ids]
    assert torch.equal(mapped.embed(ids), want) and torch.equal(read.embed(ids), want)
    spans = [[int(a, 16) for a in line.split()[0].split("-")]
             for line in open("/proc/self/maps") if line.rstrip().endswith(str(p))]  # fmt: skip
    in_file = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in spans)  # noqa: E731
    assert in_file(mapped.tok_embd.data) or not spans  # (no /proc: nothing to check)
    assert not any(in_file(ly.attn_norm) or in_file(ly.ffn_norm) for ly in mapped.layers)
    assert not in_file(mapped.norm)
    x = torch.tensor([[1, 5, 7, 3, 9]])
    with torch.inference_mode():
        assert torch.equal(mapped.forward(x, 0), read.forward(x, 0))
        assert torch.equal(mapped.forward(x[:, :1], 5), read.forward(x[:, :1], 5))


@needs_kernels
def test_greedy_step_equals_forward_and_argmax(tiny):
    """``greedy_step`` (``generate``'s greedy step: the C step's logits into a kept buffer,
    the id handed back) gives the ids of ``forward`` and ``argmax``, and checks its input."""
    from qlib.generate import generate
    from qlib.llama.engine import GreedyOnDevice, load

    fm, _ = load(tiny[1], engine="fast")
    assert isinstance(fm, GreedyOnDevice) and fm.decode_chained
    prompt, want = [1, 5, 7, 3], []
    with torch.inference_mode():
        token = int(fm.forward(torch.tensor([prompt]), 0).argmax())
        for pos in range(len(prompt), len(prompt) + 6):
            want.append(token)
            token = int(fm.forward(torch.tensor([[token]]), pos).argmax())
    assert generate(fm, prompt, 7) == [*want, token]
    with pytest.raises(IndexPosError):
        fm.greedy_step(3, 2)
    with pytest.raises(InputError, match="vocabulary"):
        fm.greedy_step(fm.vocab_size, fm.kv_len)


@needs_kernels
@pytest.mark.parametrize("weight_type,tie", [("Q8_0", True), ("Q4_1", False), ("Q6_K", False),
                                             ("Q4_K", True), ("F16", False)])  # fmt: skip
def test_decode_step_reads_the_embedding_row_in_c(tmp_path, weight_type, tie):
    """A decode step writes its token's embedding row with one C call (``cpu.RowLookup``) on
    the tied output's panels or blocks, or on the file's blocks (then dropping only that
    row's mapped pages): the same logits as through ``embed``, step after step."""
    from qlib.llama.engine import load

    n_embd = 256 if weight_type.endswith("_K") else 128
    p = write_tiny_llama(tmp_path / "t.gguf", weight_type=weight_type, n_embd=n_embd,
                         n_ff=2 * n_embd, tie_output=tie)  # fmt: skip
    fm, _ = load(p, engine="fast")
    assert fm._embed_row is not None and fm.decode_chained
    released: list[torch.Tensor] = []
    if fm._embed_release is not None:
        release = fm._embed_release
        fm._embed_release = lambda view: (released.append(view), release(view))
    x = torch.tensor([[1, 5, 7, 3, 9]])
    with torch.inference_mode():
        fm.forward(x, 0)
        released.clear()  # the prefill's ``embed`` dropped the whole tensor's pages
        lookup, c_logits = fm._embed_row, []
        for pos, tok in enumerate([200, 4, 200], start=5):
            c_logits.append(fm.forward(torch.tensor([[tok]]), pos))
        decode_releases = [v.numel() for v in released]
        fm._embed_row = None  # through ``embed``
        fm.forward(x, 0)
        for pos, tok in enumerate([200, 4, 200], start=5):
            assert torch.equal(fm.forward(torch.tensor([[tok]]), pos), c_logits[pos - 5])
    fm._embed_row = lookup
    assert (fm._embed_rows is None) == (not tie or fm.output.packed is None)
    if fm._embed_rows is None:  # the file's rows: each decode step drops its row's pages
        row_bytes = fm.tok_embd.data.numel() // fm.tok_embd.shape[0]
        assert decode_releases == [row_bytes] * 3


# -- SmolLM2 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    from qlib.tokenizer import Tokenizer

    with open(path, "rb") as f:
        content = Content.read(f)
    ids = Tokenizer.from_metadata(content.metadata).encode(
        models.data_file("passage.txt").read_text()
    )[:203]
    return path, torch.tensor([ids])


@pytest.mark.slow
def test_smollm2_bf16_prefill_argmax_agreement(smollm2):
    """Teacher forcing over the 203-token benchmark prompt: >= 95% argmax agreement."""
    path, ids = smollm2
    fm = _build(path, fast.FastModel)
    ref = _build(path, form="f32")
    with torch.inference_mode():
        a = fm.forward(ids, 0, all_logits=True)[0]
        b = ref.forward(ids, 0, all_logits=True)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


@pytest.mark.slow
def test_smollm2_decode_matches_quantized_form(smollm2):
    """int8 prefill + C decode vs the faithful quantized form: same greedy tokens."""
    path, ids = smollm2
    fm = _build(path, fast.FastModel, prefill="int8")
    ref = _build(path)
    prompt = ids[:, :40]
    with torch.inference_mode():
        a, b = fm.forward(prompt, 0), ref.forward(prompt, 0)
        pos = prompt.shape[1]
        for _ in range(8):
            assert int(a.argmax()) == int(b.argmax())
            # ggml semantics on both sides; rare Q8 code flips stay well below 5% of scale
            assert (a - b).abs().max() <= 0.05 * b.abs().max()
            tok = torch.tensor([[int(b.argmax())]])
            a, b = fm.forward(tok, pos), ref.forward(tok, pos)
            pos += 1


def test_default_prefill_follows_the_cpu(monkeypatch):
    """bf16 prefill only where the CPU has AMX tiles; int8 elsewhere (emulated bf16, and
    oneDNN's bf16 on AVX512-BF16 alone, were slower than int8: docs/performance.md)."""
    from qlib.quants.cpu import build

    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx512f", "avx512_vnni", "avx512_bf16"})
    assert fast.default_prefill() == "int8"
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert fast.default_prefill() == "bf16"
    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx512f", "avx512_vnni"})
    assert fast.default_prefill() == "int8"


def test_default_prefill_skips_a_large_copy(monkeypatch):
    """On bf16 hardware the default is int8 (no copy) once the bf16 prefill's own weight copy
    would pass ``PREFILL_COPY_MAX_BYTES`` (a 1B model's would double its memory)."""
    from qlib.quants.cpu import build

    monkeypatch.setattr(build, "cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert fast.default_prefill(fast.PREFILL_COPY_MAX_BYTES) == "bf16"
    assert fast.default_prefill(fast.PREFILL_COPY_MAX_BYTES + 1) == "int8"


def test_prefill_copy_bytes_is_the_copy_built(tiny):
    """``prefill_copy_bytes`` (from the tensor directory alone) equals the bytes of the prefill
    copy the bf16 model then holds: AMX tiles (codes or bf16) or oneDNN's bf16 copy."""
    _check_copy_bytes(tiny[1])


def test_prefill_copy_bytes_counts_mixed_stacks(tmp_path):
    """The same for a Q4_K_M-like mix (K-quant codes per 16 and 32 k; Q6_K in q, k, v)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_K", weight_types=Q4_K_M_LIKE,
                            n_embd=256, n_head=4, n_kv_head=2, n_ff=512)  # fmt: skip
    _check_copy_bytes(path)


def _check_copy_bytes(path):
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    lins = [getattr(ly, n) for ly in fm.layers for n in ("wqkv", "wo", "w13", "w2")]
    held = sum(lin.amx.nbytes() if lin.amx is not None else 2 * lin.bf16.numel() for lin in lins)
    with open(path, "rb") as f:
        content = Content.read(f)
    assert fast.prefill_copy_bytes(content, fm.amx_layers) == held
