"""The C kernels for K-quant weights (``qlib/quants/cpu/kquants.c``, ``qlib_kgemm``) and Q5_1
(since 2026-12-04 ``kernels.c``'s planes, as Q4_1 with the fifth bits: the same checks).

The kernel reads the GGUF blocks as they are, quantizes each activation row to the weight's
dot type (Q8_K for Q2_K..Q6_K, Q8_1 for Q5_1, as ``qlib.quants.activations``) and sums exact
integer block dots; only the float32 combination of the per-block terms is in another order
than the torch fallback (``qmatmul_prepared``: one product per scale group, a pairwise tree
sum) or ggml's. So results equal the fallback to float rounding: ``TOL`` = 1e-5 x the
largest |output| (observed <= 4e-7; a wrong scale, code or offset moves outputs by
1e-2 and more). The fused input transforms are compared on inputs whose transform is
computed the same way in numpy (RmsNorm: a sequential float32 sum of squares, as the C
loop) or is exact whatever the exp implementation (SwiGLU with gates of magnitude >= 17:
``silu(g) = g`` exactly, or a value so small that its Q8_K code is 0), so the activation
codes are the kernel's own and the tolerance stays ``TOL``.

Engine: the fast engine on tiny synthetic llamas of each type (every projection a
``qlib_kgemm`` call) against the faithful engine's ``quantized`` form, as
``test_mixed_types``' ``PREFILL_TOL`` / ``DECODE_TOL``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import Content
from qlib.llama import fast_cpu as fast
from qlib.llama.faithful import ModelWeights
from qlib.quants import cpu, reference
from qlib.quants.activations import quantize_activations
from qlib.quants.cpu import ops
from qlib.quants.cpu.matmul import prepare, qmatmul, qmatmul_prepared
from qlib.quants.qtensor import QTensor

KTYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q5_1")
TOL = 1e-5  # x max |output|: float rounding of the per-block combination (see above)
SHAPES = [(37, 256), (13, 512), (10, 2048), (6, 4096)]  # n not a multiple of 4 rows mostly

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)


def _weight(type_name: str, n: int, k: int, seed: int) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    return QTensor.quantize(torch.randn(n, k, generator=g), type_name)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=TOL, atol=TOL * ref.abs().max().item())


def _rms_like_c(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's RmsNorm: sequential float32 sum of squares, x * r * w (float32 steps)."""
    f = np.float32
    out = []
    for row in x.numpy().astype(f):
        ss = np.cumsum(row * row, dtype=f)[-1]
        r = f(1) / np.sqrt(ss / f(row.size) + f(eps))
        out.append(row * r * w.numpy())
    return torch.from_numpy(np.stack(out))


def _gate_up(m: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[gate | up] rows whose silu(gate) * up the kernel and torch compute alike (see above),
    and that product as the reference computes it."""
    sign = torch.where(torch.rand(m, k, generator=g) < 0.7, 1.0, -1.0)
    gate = sign * (17 + 13 * torch.rand(m, k, generator=g))
    up = torch.randn(m, k, generator=g)
    act = torch.where(gate > 0, gate * up, gate / (1 + torch.exp(-gate)) * up)
    return torch.cat([gate, up], dim=1).contiguous(), act


@pytest.mark.parametrize("type_name", KTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kgemm_matches_torch_fallback(type_name, n, k):
    w = _weight(type_name, n, k, seed=n + k)
    pw = cpu.pack(w)
    assert cpu.supports(type_name, k) and pw.type_name == type_name
    assert pw.blocks == (type_name != "Q5_1")  # Q5_1: planes
    assert pw.codes.data_ptr() != w.data.data_ptr()  # a copy: the file's pages may go
    pr = prepare(w)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=g) * 2
    y = cpu.qgemm(x, pw)
    _close(y, qmatmul_prepared(x, pr))
    # every row alone (m = 1: the GEMV loops, weight rows 4 at a time) equals the 5 rows
    # (the tiled path from GEMM_MIN_ROWS rows, tests/test_gemm_paths.py) to float rounding;
    # within a path, and with rows 0..4 of the weight alone, the same bits: a row's result
    # does not depend on the other rows, nor on the unrolls
    alone = torch.cat([cpu.qgemm(x[i : i + 1], pw) for i in range(5)])
    _close(alone, y)
    assert torch.equal(cpu.qgemm(x[1:], pw), y[1:])  # 4 rows: the tiled path too
    assert torch.equal(cpu.qgemm(x[:2], pw), alone[:2])  # 2 rows: GEMV, each super-block once
    head = cpu.pack(QTensor(w.data[:5].clone(), (5, k), type_name))
    assert torch.equal(cpu.qgemm(x, head), y[:, :5])
    # fused RmsNorm
    norm = torch.rand(k, generator=g) + 0.5
    yn = cpu.qgemm(x, pw, norm=norm, eps=1e-5)
    _close(yn, qmatmul_prepared(_rms_like_c(x, norm, 1e-5), pr))
    # fused SwiGLU of [gate | up]
    gu, act = _gate_up(2, k, g)
    ys = cpu.qgemm(gu, pw, swiglu=True)
    _close(ys, qmatmul_prepared(act, pr))
    # accumulate: out += the product, exactly
    h = torch.randn(5, n, generator=g)
    acc = cpu.qgemm(x, pw, h.clone(), accumulate=True)
    assert torch.equal(acc, h + y)
    _close(acc, h + qmatmul_prepared(x, pr))


@pytest.mark.parametrize("type_name", KTYPES)
def test_kgemm_plans(type_name):
    """The decode step's prepared calls give the one-off call's bits."""
    k, n = 512, 21
    pw = cpu.pack(_weight(type_name, n, k, seed=5))
    g = torch.Generator().manual_seed(6)
    x, gu = torch.randn(1, k, generator=g), torch.randn(2 * k, generator=g)
    norm, h = torch.rand(k, generator=g) + 0.5, torch.randn(1, n, generator=g)
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


@pytest.mark.parametrize("type_name", KTYPES)
def test_kgemm_matches_ggml_transcription(type_name):
    """Against ``reference.matmul`` (ggml's quantizer and vec_dot, transcribed literally;
    it shares no code with the kernel or the fallback), and (K-quants) against gguf-py's
    dequantized weight times our dequantized Q8_K activations (float64: another float
    order; not Q5_1, whose dot uses Q8_1's f16-rounded ``s = d * sum(q)`` for the mins)."""
    import gguf

    k = 256 if type_name != "Q5_1" else 128
    w = _weight(type_name, 3, k, seed=11)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(12)) * 3
    y = cpu.qgemm(x, cpu.pack(w))
    ref = torch.from_numpy(reference.matmul(w.data.numpy(), x.numpy(), type_name)).float()
    _close(y, ref)
    if type_name == "Q5_1":
        return
    wd = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[type_name])
    a = quantize_activations(x, "Q8_K").dequantize().double()
    exact = a @ torch.from_numpy(np.asarray(wd, dtype=np.float64)).reshape(3, k).T
    torch.testing.assert_close(y.double(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item())


def test_kgemm_special_rows():
    """Zero rows (d = 0), a row whose largest magnitude is negative, ties of +a / -a."""
    k = 512
    pw = cpu.pack(_weight("Q4_K", 9, k, seed=3))
    pr = prepare(_weight("Q4_K", 9, k, seed=3))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    x[0] = 0
    x[1, 300] = -50
    x[2, 10], x[2, 20] = 9.0, -9.0
    x[3, :256] = 0
    _close(cpu.qgemm(x, pw), qmatmul_prepared(x, pr))


@pytest.mark.parametrize("type_name", ["Q4_K", "IQ4_XS"])
@pytest.mark.parametrize("n,k", [(48, 256), (16, 512), (32, 2048)])
def test_k_panels(n, k, type_name):
    """Q4_K and IQ4_XS packed as 16-row panels against the same rows packed as their GGUF
    blocks: the
    blocks come back exactly (``dequantize_rows``), the products agree to float rounding
    (``TOL``: the same exact integer sums, per super-block in another float order) on the
    GEMV, the decode region's GEMV and the tiled path (whose tiles are the same bytes: bit
    for bit), and rows stacked from parts that split panels equal one weight's."""
    w = _weight(type_name, n, k, seed=n * k)
    panels, blocks = cpu.pack(w, panels=True), cpu.pack(w)
    assert panels.panels and not blocks.panels and panels.type_code == blocks.type_code | 64
    ids = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(cpu.dequantize_rows(panels, ids), cpu.dequantize_rows(blocks, ids))
    assert torch.equal(ops.kpanels_get(panels, torch.arange(n)).reshape(-1), w.data.reshape(-1))
    with pytest.raises(IndexError):
        ops.kpanels_get(panels, torch.tensor([n]))
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(n)) * 2
    for rows in (1, 2, 6):  # GEMV, GEMV per row, the tiled path
        _close(cpu.qgemm(x[:rows], panels), cpu.qgemm(x[:rows], blocks))
    assert torch.equal(cpu.qgemm(x, panels), cpu.qgemm(x, blocks))  # the same tiles (bytes)
    region = cpu.DecodeChain([], "region", output=cpu.qgemm_alloc_plan(panels, x[:1]))
    assert torch.equal(region(), cpu.qgemm(x[:1], panels))  # the decode step's GEMV
    parts = [QTensor(w.data[a:b].clone(), (b - a, k), type_name) for a, b in ((0, 3), (3, n))]
    stacked = cpu.pack(parts, panels=True)
    assert stacked.panels and torch.equal(stacked.codes, panels.codes)
    odd = _weight(type_name, 20, 256, seed=1)  # not a multiple of 16 rows: its blocks
    assert not cpu.pack(odd, panels=True).panels


def test_refused_shapes_and_types():
    assert not cpu.supports("Q4_K", 384) and not cpu.supports("Q5_1", 96)
    assert cpu.supports("Q6_K", 256) and cpu.supports("Q5_1", 64) and cpu.supports("F16", 64)
    assert not cpu.supports("F16", 96) and not cpu.supports("Q8_1", 64)
    with pytest.raises(ValueError):
        cpu.dequantize_bf16(cpu.pack(_weight("Q6_K", 2, 256, seed=1)))


def test_qmatmul_uses_the_kernel():
    """``qmatmul`` (the faithful engine's quantized form) runs the C kernel for K-quants."""
    w = _weight("Q6_K", 8, 512, seed=9)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(10))
    assert torch.equal(qmatmul(x, w), cpu.qgemm(x, cpu.pack(w)))


# -- the whole fast engine ---------------------------------------------------------------

SIZES = dict(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_kv_head=2)


def _build(path, cls=ModelWeights, **kw):
    with open(path, "rb") as f:
        content = Content.read(f)
        return cls.from_gguf(content, f, "cpu", **kw)


@pytest.mark.parametrize("type_name", KTYPES)
def test_fast_engine_matches_faithful(type_name, tmp_path):
    path = write_tiny_llama(tmp_path / f"{type_name}.gguf", weight_type=type_name, **SIZES)
    fm = _build(path, fast.FastModel, prefill="int8")
    assert fm._plan is not None
    for ly in fm.layers:
        for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2):
            assert lin.packed is not None  # one C call each (qlib_kgemm; Q5_1: qlib_qgemm_ex)
            assert lin.packed.blocks == (type_name != "Q5_1")
    assert fm.output.packed is not None and fm.output.packed.type_name == type_name
    ref = _build(path, form="quantized", attention="sdpa", kv_cache="static")
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        a = fm.forward(ids[:, :10], 0, all_logits=True)
        b = ref.forward(ids[:, :10], 0, all_logits=True)
        scale = b.abs().max()
        # the same GEMM kernels on both sides, but not the same attention (C tiles against
        # torch's SDPA, whose float order follows torch's CPU capability): an ulp there can
        # move an activation onto the other side of a Q8 rounding tie, flipping one code of a
        # later layer's input (ggml's own sensitivity: docs/design.md, position 0). Seen on
        # one row of ten (Q5_1, torch's AVX512 kernels on a Zen 4: 1.7e-3 x scale; exact with
        # ATEN_CPU_CAPABILITY=avx2). So: every row but one to ulps, that one as a decode step.
        rows = (a - b).abs().amax(-1).flatten()
        assert int((rows > 1e-5 * scale).sum()) <= 1, rows / scale
        assert rows.max() <= 1e-2 * scale
        for pos in range(10, 14):  # decode: C attention (another float order, exp)
            a, b = fm.forward(ids[:, pos : pos + 1], pos), ref.forward(ids[:, pos : pos + 1], pos)
            assert (a - b).abs().max() <= 1e-2 * scale, pos


def test_fast_engine_without_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setattr(cpu.build, "_reason", "disabled by the test")
    assert not cpu.supports("Q4_K", 256)
    path = write_tiny_llama(tmp_path / "q4k.gguf", weight_type="Q4_K", **SIZES)
    fm = _build(path, fast.FastModel, prefill="int8")
    assert fm._plan is None and all(ly.wqkv.packed is None for ly in fm.layers)


# -- F32 / F16 / BF16 rows (floats.c, through qlib_kgemm) ------------------------------------


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n, k", [(576, 576), (13, 64), (40, 1536)])
def test_float_rows_match_ggml_semantics(type_name, n, k):
    """floats.c against the torch reference (``qmatmul_prepared``: the activations rounded to
    the weight's vec_dot type, float32 products and sums) for the GEMV (m < 4) and the tiled
    GEMM (m >= 4), n not a multiple of the 16-row tiles; rows independent within a path."""
    w = _weight(type_name, n, k, seed=11)
    pw, pr = cpu.pack(w), prepare(w)
    assert pw.blocks and pw.codes.numel() == w.data.numel()  # the GGUF rows as they are
    x = torch.randn(21, k, generator=torch.Generator().manual_seed(12))
    for m in (1, 3, 4, 21):
        y = cpu.qgemm(x[:m].contiguous(), pw)
        _close(y, qmatmul_prepared(x[:m], pr))
    assert torch.equal(cpu.qgemm(x[5:9].contiguous(), pw), cpu.qgemm(x, pw)[5:9])
    assert torch.equal(cpu.qgemm(x[2:3].contiguous(), pw), cpu.qgemm(x[:3].contiguous(), pw)[2:3])
