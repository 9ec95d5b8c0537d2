"""MXFP4, NVFP4 (4-bit E2M1 codes) and Q1_0 (a sign a weight), ``qlib.quants.fp4``:

* quantization byte for byte as ggml's ``ggml_quantize_chunk`` and dequantization as its
  ``to_float`` (peers), and as gguf-py's (MXFP4, NVFP4: the package has no Q1_0);
* ``qmatmul`` as ggml's ``vec_dot`` on its own Q8_0 activations (peers);
* the kernels' forms: MXFP4 as Q5_0 and Q1_0 as Q4_0 blocks of the same values (bf16 rows
  where an MXFP4 scale leaves f16's range), each as MXFP4H / NVFP4H / Q1_0H panels (the fast
  CPU engine's layers and the faithful matmul, rows in 16s), NVFP4 as X4 blocks otherwise
  (bf16 rows where its scales do not fit);
* a tiny llama of each type in every CPU engine and form, its position-0 logits against
  llama.cpp's (peers), and on a GPU the fused and persistent CUDA engines against the f32 form.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import TYPE_SIZES, first_logits, fused_cuda_gap, fused_kernels_skip, type_files

from qlib.llama.engine import load
from qlib.quants import VEC_DOT_TYPE, cpu, dequantize, qmatmul, quantize
from qlib.quants.cpu.matmul import prepare, qmatmul_prepared
from qlib.quants.forms import KERNEL_TYPE, kernel_form
from qlib.quants.qtensor import QTensor

TYPES = ["MXFP4", "NVFP4", "Q1_0"]
# The quantized form (Q8_0 activations) against the f32 form of the same file, largest |logit
# diff| / largest |logit|: measured 0.004-0.024 over these types (the activations' 8-bit
# rounding through two layers); 0.05 as for the grid types.
QUANTIZED_TOL = 0.05


def _rows(scale: float = 0.02, rows: int = 8, k: int = 512, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32) * scale
    x[0, :40] = 0  # an all-zero block
    return x


@pytest.mark.peers
@pytest.mark.parametrize("scale", [1e-6, 0.02, 1.0, 300.0])
@pytest.mark.parametrize("t", TYPES)
def test_quantize_matches_ggml_bytes(ggml, t, scale):
    x = _rows(scale)
    ours = quantize(x, t)
    np.testing.assert_array_equal(ours, ggml.quantize(x, t))
    np.testing.assert_array_equal(dequantize(ours, t, x.shape), ggml.to_float(ours, t, 512))


@pytest.mark.parametrize("t", ["MXFP4", "NVFP4"])
def test_dequantize_matches_gguf_py(t):
    gquants = pytest.importorskip("gguf.quants")
    import gguf

    x = _rows()
    blocks = quantize(x, t)
    expected = gquants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, t))
    np.testing.assert_array_equal(dequantize(blocks, t, x.shape), expected.reshape(x.shape))
    if t == "MXFP4":  # (gguf-py quantizes MXFP4, not NVFP4)
        np.testing.assert_array_equal(blocks, gquants.quantize(x, gguf.GGMLQuantizationType.MXFP4))


@pytest.mark.peers
@pytest.mark.parametrize("t", TYPES)
def test_qmatmul_matches_ggml_vec_dot(ggml, t):
    """Against the CPU backend's own vec_dot on its own Q8_0 activations: the same integer
    sums per group, combined in another float32 order (measured <= 1.4e-7 of the largest
    output); 1e-6 of it. (Q1_0's one scale a 128 weights meets activation blocks of 32.)"""
    blocks = ggml.quantize(_rows(), t)
    w = QTensor(torch.from_numpy(blocks.reshape(-1)), (8, 512), t)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    assert VEC_DOT_TYPE[t] == "Q8_0"
    expected = ggml.matmul(blocks, ggml.from_float(x.numpy(), "Q8_0"), t, 512)
    assert np.abs(qmatmul(x, w).numpy() - expected).max() <= 1e-6 * np.abs(expected).max()


@pytest.mark.parametrize("t", ["MXFP4", "Q1_0"])
def test_legacy_form_holds_the_same_values(t):
    """MXFP4 as Q5_0, Q1_0 as Q4_0 (an all-zero block included)."""
    w = QTensor.quantize(torch.from_numpy(_rows()), t)
    legacy = kernel_form(w)
    assert legacy.dtype.name == {"MXFP4": "Q5_0", "Q1_0": "Q4_0"}[t] == KERNEL_TYPE[t]
    assert torch.equal(legacy.dequantize(), w.dequantize())


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
def test_mxfp4_scales_past_f16_run_as_bf16_rows():
    """An MXFP4 block scale of 2^20 (E8M0 byte 148) has no f16: the tensor stays MXFP4 in
    ``kernel_form`` and the C kernels take its exact values as bf16 rows."""
    w = QTensor.quantize(torch.from_numpy(_rows(scale=2.0**22)), "MXFP4")
    assert kernel_form(w).dtype.name == "MXFP4"
    packed = cpu.pack(w)
    assert packed.type_name == "BF16"
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(2))
    want = x.bfloat16().float() @ w.dequantize().T  # ggml's bf16 dot: the row rounded to bf16
    assert (cpu.qgemm(x, packed) - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
@pytest.mark.parametrize("t", TYPES)
def test_panels(t):
    """MXFP4 / NVFP4 / Q1_0 weights of rows in 16s packed with ``panels`` (the fast engine's
    layers, and the faithful matmul): MXFP4H / NVFP4H / Q1_0H panels (4.5 / 5 / 1.5 bits a
    weight) of the file's values (rows read back exactly), whose products in every path
    (GEMV, the tiled GEMM) equal ggml's semantics on Q8_0 activations (the torch path,
    ``qmatmul_prepared``) to float rounding (1e-6 of the largest output; measured <= 1.7e-7);
    the tiled GEMMs of MXFP4 and Q1_0 equal their Q5_0 / Q4_0 planes' bit for bit (the same
    tiles). The faithful ``qmatmul`` takes the panels. An MXFP4 scale f16 lacks takes the
    Q5_0 / bf16 forms as before."""
    w = QTensor.quantize(torch.from_numpy(_rows(rows=32)), t)
    panels = cpu.pack(w, panels=True)
    assert (panels.type_name, panels.panels) == (t + "H", True)
    assert panels.nbytes() == 32 * 512 // 32 * {"MXFP4": 18, "NVFP4": 20, "Q1_0": 6}[t]
    assert torch.equal(cpu.dequantize_rows(panels, torch.arange(32)), w.dequantize())
    for m in (1, 3, 9):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        want = qmatmul_prepared(x, prepare(w))
        got = cpu.qgemm(x, panels)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max(), m
        assert torch.equal(qmatmul(x, w), got), m
        if m >= 4 and t != "NVFP4":
            assert torch.equal(got, cpu.qgemm(x, cpu.pack(w)))
    if t == "MXFP4":
        far = QTensor.quantize(torch.from_numpy(_rows(rows=16, scale=2.0**22)), "MXFP4")
        assert cpu.pack(far, panels=True).type_name == "BF16"


@pytest.mark.peers
@pytest.mark.parametrize("t", TYPES)
def test_panels_match_ggml_vec_dot(ggml, t):
    """MXFP4H / NVFP4H / Q1_0H panels against the CPU backend's own vec_dot on its own Q8_0
    activations: GEMV (1 and 3 rows) and tiled GEMM (9 rows), 1e-6 of the largest output."""
    blocks = ggml.quantize(_rows(rows=32), t)
    w = QTensor(torch.from_numpy(blocks.reshape(-1)), (32, 512), t)
    panels = cpu.pack(w, panels=True)
    assert panels.type_name == t + "H"
    for m in (1, 3, 9):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(10 + m))
        expected = ggml.matmul(blocks, ggml.from_float(x.numpy(), "Q8_0"), t, 512)
        got = cpu.qgemm(x, panels).numpy()
        assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max(), m


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
def test_nvfp4_as_x4_blocks_and_bf16_rows():
    """NVFP4 in the C kernels without panels: X4 blocks of exactly its values (every E4M3 scale of a
    super-block of 256 a whole multiple <= 127 of the finest power of two among them), bf16
    rows where one super-block's scales lie more than 2^3 apart or rows do not divide into
    super-blocks (SmolLM2's 576); for rows not in 16s (these 8) the faithful matmul keeps
    ggml's Q8_0 activations in the torch path (``matmul.OTHER_DOT``)."""
    x = torch.from_numpy(_rows())
    w = QTensor.quantize(x, "NVFP4")
    x4 = cpu.pack(w)
    assert x4.type_name == "X4"
    assert torch.equal(cpu.dequantize_rows(x4, torch.arange(8)), w.dequantize())
    spread = x.clone()
    spread[3, :16] *= 100  # one group's scale 2^6.6 above its super-block's others
    w2 = QTensor.quantize(spread, "NVFP4")
    bf16 = cpu.pack(w2)
    assert bf16.type_name == "BF16"
    assert torch.equal(cpu.dequantize_rows(bf16, torch.arange(8)), w2.dequantize())
    odd = QTensor.quantize(torch.from_numpy(_rows(k=576)), "NVFP4")  # rows of 9 blocks of 64
    assert cpu.supports("NVFP4", 576) and cpu.pack(odd).type_name == "BF16"
    a = torch.randn(2, 512, generator=torch.Generator().manual_seed(7))
    want = qmatmul_prepared(a, prepare(w))  # the torch path, Q8_0 activations
    assert torch.equal(qmatmul(a, w), want)


@pytest.mark.skipif(not cpu.available(), reason="needs the C kernels")
def test_load_conversions_in_c_equal_torchs():
    """The load's conversions in C (``cpu/gridx4.c``) give torch's bytes: MXFP4 -> Q5_0 and
    Q1_0 -> Q4_0 (``fp4.as_legacy``; a zero block, and an MXFP4 scale f16 lacks: refused by
    both), NVFP4 -> X4 (``gridquants.as_x4``; scales too far apart: refused by both)."""
    from qlib.quants.cpu import ops
    from qlib.quants.fp4 import as_legacy
    from qlib.quants.gridquants import as_x4, x4_tables

    for t, size in (("MXFP4", 22), ("Q1_0", 18)):
        blocks = torch.from_numpy(quantize(_rows(k=1024), t)).reshape(-1, 17 if t == "MXFP4"
                                                                       else 18)  # fmt: skip
        out = torch.empty((blocks.shape[0] * (4 if t == "Q1_0" else 1), size), dtype=torch.uint8)
        assert ops.legacy_from_blocks(t, blocks, out)
        assert torch.equal(out.reshape(blocks.shape[0], -1), as_legacy(blocks, t))
    far = torch.from_numpy(quantize(_rows(scale=2.0**22), "MXFP4")).reshape(-1, 17)
    assert as_legacy(far, "MXFP4") is None
    assert not ops.legacy_from_blocks(
        "MXFP4", far, torch.empty((far.shape[0], 22), dtype=torch.uint8)
    )
    x = _rows(k=1024)
    for case in ("fit", "apart"):
        if case == "apart":
            x[5, 256:272] *= 100
        blocks = torch.from_numpy(quantize(x, "NVFP4")).reshape(-1, 36)
        out = torch.empty((blocks.shape[0] // 4, 164), dtype=torch.uint8)
        done = ops.x4_from_blocks("NVFP4", blocks, *x4_tables("NVFP4"), out)
        ref = as_x4(blocks, "NVFP4")
        assert done == (case == "fit") == (ref is not None)
        assert not done or torch.equal(out, ref)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return type_files(tmp_path_factory.mktemp("fp4"), TYPES)


@pytest.mark.parametrize("t", TYPES)
def test_every_cpu_engine_runs_them(files, t):
    """The faithful engine's f32 and quantized forms and the fast engine (MXFP4H / NVFP4H /
    Q1_0H panels): within ``QUANTIZED_TOL`` of the f32 form."""
    f32 = first_logits(files[t], form="f32")
    scale = f32.abs().max()
    for kw in (dict(form="quantized"), dict(engine="fast")):
        assert (first_logits(files[t], **kw) - f32).abs().max() <= QUANTIZED_TOL * scale, kw


@pytest.mark.parametrize("t", TYPES)
def test_fast_engine_kernel_types(files, t):
    """The layers as the type's own panels (``layout.PANEL_FORMS``); on a CPU with AMX too
    for MXFP4 and NVFP4, whose AMX codes are read from their blocks, while Q1_0, which has
    none (``packing.AMX_CODES``), keeps the planes of ``forms.kernel_form`` that the AMX
    prefill makes its tiles from."""
    model, _ = load(files[t], "cpu", engine="fast")
    parts = [p for layer in model.layers for p in layer.wqkv.parts + layer.w2.parts]
    kinds = {p.packed.type_name if p.packed is not None else None for p in parts}
    if cpu.available():
        layers = "Q4_0" if t == "Q1_0" and model.amx_layers else t + "H"
        assert kinds == {layers}


@pytest.mark.peers
@pytest.mark.parametrize("t", TYPES)
def test_position0_matches_llama_cpp(files, t):
    """Each token alone at position 0, the faithful quantized form against llama.cpp: within
    1e-5 on most tokens, as for the other types (``test_position0.py``)."""
    pytest.importorskip("llama_cpp")
    import test_position0 as pos0

    d = pos0.quantized_pos0_gap(files[t], range(0, TYPE_SIZES["vocab"], 4))
    assert (d <= pos0.FAITHFUL_TOL).mean() >= pos0.FAITHFUL_SHARE, (np.median(d), d.max())


@fused_kernels_skip()
@pytest.mark.parametrize("t", TYPES)
def test_fast_cuda_fused_as_f32_form(files, t):
    """The fast CUDA engine's fused kernels (each type as planes of its own, ``cuda.layout``)
    against the f32 form: 1e-4 of the logits' scale, as for the
    other types (the persistent kernel, ``T_X8`` blocks: test_persistent_cuda's
    ``test_kquants_and_mixes_decode_as_f32_form``)."""
    assert fused_cuda_gap(files[t]) <= 1e-4
