"""The CPU quantized matmul (ggml semantics) against the literal transcription of ggml.

``qlib.quants.reference.matmul`` quantizes each activation row as ggml's x86
CPU backend does and runs the generic ``ggml_vec_dot_<type>_<dot>`` loops.
Both sides compute the per-block integer sums exactly; they differ only in how
the float32 per-block terms are combined (ggml: one after the other, qlib: a
pairwise tree over scale groups). Each combination's rounding error is at most
(number of terms) * 2**-24 * (sum of |terms|), so the tolerance is
``(k / 16 + 8) * 2**-23 * M`` with ``M = |x_q| @ |w parts|`` bounding the sum of
|terms| (``test_quants_llama.py`` checks the same against ggml's own vec_dot).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quants_data import kinds

from qlib.quants import VEC_DOT_TYPE, qmatmul, quantize, quantize_activations, reference
from qlib.quants.bench import bench_qmatmul, random_qtensor
from qlib.quants.cpu.matmul import prepare
from qlib.quants.qtensor import QMatMul, QTensor

MATMUL_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
MATMUL_TYPES += ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def weight(t: str, n: int, k: int, seed: int = 0) -> tuple[QTensor, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) * np.exp(rng.uniform(-1, 1, (n, 1)))
    packed = quantize(w.astype(np.float32), t)
    return QTensor.from_bytes(packed, (n, k), t), packed


def magnitude(x: torch.Tensor, w: QTensor) -> np.ndarray:
    """``M[i, j]``: sum over the row of |activation| * (|scale * code| + |offset|)."""
    pw = prepare(w)
    act = quantize_activations(x, VEC_DOT_TYPE[w.dtype.name])
    a = act.dequantize().abs().double()
    if pw.dense is not None:
        return (a @ pw.dense.abs().double().t()).numpy()
    n, k = pw.shape
    scale = pw.scales.t().repeat_interleave(pw.group, dim=1)  # [n, k]
    parts = (pw.codes.float() * scale).abs()
    if pw.offsets is not None:
        parts = parts + pw.offsets.t().repeat_interleave(pw.group, dim=1).abs()
    return (a @ parts.double().t()).numpy()


def tolerance(x: torch.Tensor, w: QTensor) -> np.ndarray:
    k = w.shape[1]
    return (k / 16 + 8) * 2.0**-23 * magnitude(x, w) + 1e-30


@pytest.fixture(scope="module")
def x() -> torch.Tensor:
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((4, 512)).astype(np.float32)
    rows[1] *= 30.0
    rows[2] = np.round(rows[2] * 8) / 8  # ties after scaling
    rows[3, ::3] = 0
    return torch.from_numpy(rows)


def test_vec_dot_types():
    assert VEC_DOT_TYPE["Q4_0"] == VEC_DOT_TYPE["Q5_0"] == VEC_DOT_TYPE["Q8_0"] == "Q8_0"
    assert VEC_DOT_TYPE["Q4_1"] == VEC_DOT_TYPE["Q5_1"] == "Q8_1"
    assert {VEC_DOT_TYPE[t] for t in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]} == {"Q8_K"}
    assert [VEC_DOT_TYPE[t] for t in ["F32", "F16", "BF16"]] == ["F32", "F16", "BF16"]


@pytest.mark.parametrize("dot", ["Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32"])
def test_activations_match_literal_x86_transcription(dot):
    rows = np.concatenate(list(kinds(rows=1).values()))
    ours = quantize_activations(torch.from_numpy(rows), dot).to_bytes()
    expected = np.stack([reference.quantize_activation_row(r, dot) for r in rows])
    np.testing.assert_array_equal(ours, expected)


def test_x86_rounding_is_not_the_reference_one():
    """On exact ties x86 rounds half to even; quantize_row_q8_0_ref rounds half away from 0."""
    row = (np.arange(32, dtype=np.float32) - 15.5) * np.float32(127 / 15.5)  # amax -> 127
    row[0] = np.float32(-127.0)
    row[1:9] = [2.5, -2.5, 0.5, 1.5, -0.5, 3.5, 100.5, -6.5]
    ours = quantize_activations(torch.from_numpy(row[None]), "Q8_0").codes[0, 1:9]
    assert ours.tolist() == [2, -2, 0, 2, -0, 4, 100, -6]
    ref = reference.quantize_row_q8_0_ref(row)[2:].view(np.int8)[1:9]
    assert ref.tolist() == [3, -3, 1, 2, -1, 4, 101, -7]


@pytest.mark.parametrize("t", MATMUL_TYPES)
def test_qmatmul_matches_reference(t, x):
    k = x.shape[1]
    w, packed = weight(t, 6, k, seed=len(t))
    y = qmatmul(x, w)
    assert y.dtype == torch.float32 and y.shape == (4, 6)
    expected = reference.matmul(packed, x.numpy(), t)
    assert (np.abs(y.numpy() - expected) <= tolerance(x, w)).all()
    if t not in ("F32", "F16", "BF16"):  # the torch path too (qmatmul may take the C kernel)
        y_torch = qmatmul(x, prepare(w))
        assert (np.abs(y_torch.numpy() - expected) <= tolerance(x, w)).all()


@pytest.mark.parametrize("t", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_rows_are_independent(t):
    """A row's result is bit-identical whatever other rows are computed with it in the same
    path of the C kernel (``GEMM_MIN_ROWS`` rows and more: the tiled path; fewer: the GEMV
    loops); the two paths agree to float rounding (see tests/test_gemm_paths.py)."""
    from qlib.quants.cpu.ops import GEMM_MIN_ROWS

    rng = np.random.default_rng(1)
    w, _ = weight(t, 1100, 512)
    x = torch.from_numpy(rng.standard_normal((24, 512)).astype(np.float32))
    full = qmatmul(x, w)
    alone = torch.cat([qmatmul(x[i : i + 1], w) for i in range(24)])
    for m in (1, 2, 3, 4, 8, 9, 13):
        ref = full if m >= GEMM_MIN_ROWS else alone
        assert torch.equal(qmatmul(x[:m], w), ref[:m]), m
    torch.testing.assert_close(alone, full, rtol=1e-5, atol=1e-5 * full.abs().max().item())


def test_both_group_sum_paths_agree(monkeypatch):
    """The int8 block-diagonal path (few rows) and the float32 batched one give the same bits."""
    import qlib.quants.cpu.matmul as mm

    w, _ = weight("Q5_K", 300, 512)
    pw = prepare(w)  # the torch path (a QTensor may go to the C kernel)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    few = qmatmul(x, pw)
    monkeypatch.setattr(mm, "_INT_ROWS", 0)
    assert torch.equal(qmatmul(x, pw), few)


def test_prepared_weight_and_cache(x):
    w, _ = weight("Q4_K", 64, 512)
    pw = prepare(w)
    assert pw.codes.dtype == torch.int8 and pw.codes.shape == (64, 512)
    assert pw.scales.shape == (512 // 32, 64) and pw.offsets.shape == pw.scales.shape
    import qlib.quants.cpu.matmul as mm

    y = qmatmul(x, pw)  # the torch path; a QTensor: the C kernel where it runs (float order)
    assert torch.equal(y, mm.qmatmul_prepared(x, pw))
    torch.testing.assert_close(qmatmul(x, w), y, rtol=1e-5, atol=1e-5 * y.abs().max().item())

    assert mm._prepared(w) is mm._prepared(w)


def test_half_inputs_cast_back(x):
    w, _ = weight("Q8_0", 16, 512)
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        y = qmatmul(xh, w)
        assert y.dtype == dtype
        assert torch.equal(y, qmatmul(xh.float(), w).to(dtype))


def test_activation_quantization_is_visible(x):
    """The result differs from a float matmul by about the Q8 activation rounding, not more."""
    w, packed = weight("Q4_0", 32, 512)
    W = torch.from_numpy(np.asarray(w.dequantize()))
    y, dense = qmatmul(x, w), x @ W.t()
    rel = ((y - dense).norm() / dense.norm()).item()
    assert 1e-5 < rel < 2e-2


def test_qmatmul_through_qmatmul_seam():
    w, _ = weight("Q5_1", 48, 256)
    x = torch.randn(2, 3, 256)
    y = QMatMul(w, "quantized")(x)
    assert y.shape == (2, 3, 48)
    assert torch.equal(y.reshape(6, 48), qmatmul(x.reshape(6, 256), w))


def test_bad_shapes_and_types():
    w, _ = weight("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="does not match"):
        qmatmul(torch.randn(2, 32), w)
    q81 = QTensor.from_bytes(quantize(np.ones((2, 32), np.float32), "Q8_1"), (2, 32), "Q8_1")
    with pytest.raises(NotImplementedError, match="Q8_1"):
        qmatmul(torch.randn(1, 32), q81)
    with pytest.raises(ValueError, match="Q8_K.*256"):
        quantize_activations(torch.randn(1, 64), "Q8_K")


@pytest.mark.parametrize("form", ["quantized", "f32", "f16"])
def test_bench_qmatmul(form):
    r = bench_qmatmul(64, 256, "Q4_K", m=3, form=form, device="cpu", repeats=2)
    assert r["form"] == form and r["type"] == "Q4_K" and r["m"] == 3
    assert 0 < r["time_s"] <= r["median_s"]
    expected_bytes = {"quantized": 64 * 144, "f32": 64 * 256 * 4, "f16": 64 * 256 * 2}[form]
    assert r["weight_bytes"] == expected_bytes
    assert r["gbps"] == pytest.approx(expected_bytes / r["time_s"] / 1e9)
    assert random_qtensor(10, 256, "Q4_K").shape == (10, 256)


@pytest.mark.slow
def test_real_weight_matches_reference():
    """SmolLM2's blk.0.attn_q (Q4_1) and token_embd (Q8_0) rows against the reference."""
    import gguf

    from qlib import models

    tensors = {t.name: t for t in gguf.GGUFReader(models.path()).tensors}
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(0))
    for name in ["blk.0.attn_q.weight", "token_embd.weight"]:
        t = tensors[name]
        packed = np.asarray(t.data).view(np.uint8)[:8]
        w = QTensor.from_bytes(packed, (8, 576), t.tensor_type.name)
        expected = reference.matmul(packed, x.numpy(), t.tensor_type.name)
        assert (np.abs(qmatmul(x, w).numpy() - expected) <= tolerance(x, w)).all(), name
