"""Byte identity with llama.cpp itself (llama-cpp-python's ggml), skipped without llama_cpp.

Two routes, both the reference quantizers (no importance matrix):
* ``ggml_quantize_chunk`` (libggml-base via ctypes), the function
  ``llama_model_quantize`` calls per tensor: every block format on varied rows;
  Q8_K through ``quantize_row_q8_K_ref``;
* ``llama_model_quantize`` on a tiny llama-architecture F32 GGUF (written with
  gguf-py's GGUFWriter), ``pure = True``, one file per K-quant ftype, tensor by
  tensor.
And the CPU backend's own activation quantizers (``from_float``: the x86 SIMD
``quantize_row_q8_0`` / ``q8_1``, ``quantize_row_q8_K``) against
``quantize_activations``.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from quants_data import stacked

from qlib.quants import quantize, quantize_activations

llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.peers

BLOCK_TYPES = [
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "Q8_K",
    "IQ4_NL",
    "IQ4_XS",
]


@pytest.fixture(scope="module")
def ggml():
    from quants_ggml import load

    return load()


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return np.concatenate([stacked(rows=6, seed=s) for s in range(3)])


@pytest.mark.parametrize("t", BLOCK_TYPES)
def test_bytes_match_ggml_quantize_chunk(ggml, data, t):
    np.testing.assert_array_equal(quantize(data, t), ggml.quantize(data, t))


def test_bytes_match_ggml_on_extreme_rows(ggml):
    """Inf-free extremes: huge and subnormal values, constant blocks, a lone non-zero."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    x[0] *= 1e30
    x[1] *= 1e-40
    x[2, :256] = 3.0
    x[3] = 0
    x[3, 17] = -2.5
    x[4, ::2] = 0
    x[5] = np.abs(x[5]) * 1e-20
    x[6, :128] = x[6, 128:256]
    x[7] = np.float32(1) / 3
    for t in BLOCK_TYPES:
        np.testing.assert_array_equal(quantize(x, t), ggml.quantize(x, t), err_msg=t)


FTYPES = {
    "Q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K",
    "Q3_K": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
    "Q4_K": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "Q5_K": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K",
    "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "IQ4_NL": "LLAMA_FTYPE_MOSTLY_IQ4_NL",
    "IQ4_XS": "LLAMA_FTYPE_MOSTLY_IQ4_XS",
}


def _tiny_llama(path, rng) -> dict[str, np.ndarray]:
    """A valid 1-block llama GGUF in F32 whose matrices have rows of 256 or 512."""
    import gguf

    hidden, ffn, vocab = 256, 512, 256
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(64)
    w.add_file_type(0)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
        "output_norm.weight": (hidden,),
        "output.weight": (vocab, hidden),
    }
    tensors = {}
    for i, (name, shape) in enumerate(shapes.items()):
        a = rng.standard_normal(shape) * np.exp(
            rng.uniform(-3, 3, shape[:1] + (1,) * (len(shape) - 1))
        )
        if i % 3 == 1 and len(shape) == 2:
            a = rng.standard_t(2, shape)  # heavy tails in some
        tensors[name] = a.astype(np.float32)
        w.add_tensor(name, tensors[name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


@pytest.mark.parametrize("t", list(FTYPES))
def test_bytes_match_llama_model_quantize(tmp_path, t):
    import gguf

    src, dst = tmp_path / "f32.gguf", tmp_path / f"{t}.gguf"
    tensors = _tiny_llama(src, np.random.default_rng(1))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[t])
    params.pure = True
    params.nthread = 1
    assert (
        llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
        == 0
    )
    quantized = 0
    for tensor in gguf.GGUFReader(dst).tensors:
        x = tensors[tensor.name]
        if tensor.tensor_type.name == "F32":
            assert x.ndim == 1, tensor.name
            continue
        assert tensor.tensor_type.name == t, tensor.name
        theirs = np.asarray(tensor.data).view(np.uint8).reshape(x.shape[0], -1)
        np.testing.assert_array_equal(quantize(x, t), theirs, err_msg=tensor.name)
        quantized += 1
    assert quantized == 9


@pytest.mark.parametrize("dot", ["Q8_0", "Q8_1", "Q8_K", "F16", "BF16"])
def test_activations_match_ggml_cpu_from_float(ggml, data, dot):
    """What the CPU backend runs on activations (x86 SIMD for Q8_0/Q8_1), byte for byte."""
    x = data.copy()
    x[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # exact ties after scaling
    x[1, :64] = 1e-39  # subnormal: 127/amax overflows to inf
    x[2] *= 3e38 / np.abs(x[2]).max()  # near FLT_MAX
    x[3, 5] = np.inf  # cvtps_epi32 gives INT_MIN, saturated to -128
    ours = quantize_activations(torch.from_numpy(x), dot).to_bytes()
    np.testing.assert_array_equal(ours, ggml.from_float(x, dot))


@pytest.mark.parametrize("t", [t for t in BLOCK_TYPES if t != "Q8_K"])  # (storage types)
def test_qmatmul_matches_ggml_vec_dot(ggml, t):
    """qmatmul against the CPU backend's own (SIMD) vec_dot on its own quantized activations."""
    from test_quants_matmul import tolerance, weight

    from qlib.quants import VEC_DOT_TYPE, qmatmul

    w, packed = weight(t, 8, 512, seed=2)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    acts = ggml.from_float(x.numpy(), VEC_DOT_TYPE[t])
    expected = ggml.matmul(packed, acts, t, 512)
    assert (np.abs(qmatmul(x, w).numpy() - expected) <= tolerance(x, w)).all()
