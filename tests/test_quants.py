"""Block formats: byte identity with independent implementations, round trips, torch dequantize.

Reference routes:
* F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: gguf-py's ``gguf.quants.quantize`` (bytes) here;
* Q2_K..Q6_K (and the legacy ones again): llama.cpp itself, in ``test_quants_llama.py``;
* Q8_1, Q8_K (dot-product types, no file format): the literal transcriptions of
  ``quantize_row_q8_1_ref`` / ``quantize_row_q8_K_ref`` in ``qlib.quants.reference``
  (and, in ``test_quants_llama.py``, llama.cpp's ``quantize_row_q8_K_ref``);
* dequantize: gguf-py's ``gguf.quants.dequantize`` for every type it knows.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from quants_data import kinds, stacked

from qlib.quants import dequantize, dequantize_torch, quantize, reference
from qlib.quants.api import WRITABLE
from qlib.quants.types import ggml_type

GGUF_QUANTIZE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
GGUF_DEQUANTIZE = [*GGUF_QUANTIZE, "F32", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
GGUF_DEQUANTIZE += ["IQ4_NL", "IQ4_XS"]

# Largest |error| in a 256-value block over that block's max |x|. Closed forms for
# the simple formats (half a step plus the f16 rounding of the scale; Q4_0 and
# Q5_0 lose one level on the side opposite the max); the K-quant searches have
# none, so theirs are ~1.3x the worst seen over these cases.
MAX_BLOCK_ERROR = {
    "F32": 0.0,
    "F16": 2**-11,
    "BF16": 2**-8,
    "Q4_0": 1 / 8 + 0.005,
    "Q4_1": 1 / 15 + 0.005,
    "Q5_0": 1 / 16 + 0.005,
    "Q5_1": 1 / 31 + 0.003,
    "Q8_0": 0.5 / 127 + 0.001,
    "Q8_1": 0.5 / 127 + 0.001,
    "Q8_K": 0.5 / 127 + 0.0001,
    "Q2_K": 0.40,
    "Q3_K": 0.20,
    "Q4_K": 0.10,
    "Q5_K": 0.06,
    "Q6_K": 0.02,
    "IQ4_NL": 0.11,
    "IQ4_XS": 0.11,
    "MXFP4": 0.25,  # a power-of-two scale: up to half the gap between 8 and 12 (measured 0.23)
    "NVFP4": 0.17,  # (measured 0.16, where the values lie in its scales' range, below)
    "Q1_0": 1.0,  # a sign and the mean magnitude: a block's largest value can be all error
}
# kinds outside a type's range: NVFP4's E4M3 scales run from 2^-10 to 224, so values below
# ~0.006 vanish (all_equal's 3e-3 row) and above 2,688 saturate (outliers' 1e4); its files keep
# a tensor's magnitude elsewhere
OUT_OF_RANGE = {"NVFP4": ("all_equal", "outliers")}
# RMS error over RMS value on normal data: more bits, less error.
MAX_RMS_ERROR = {
    "F32": 0.0,
    "F16": 3e-4,
    "BF16": 2e-3,
    "Q8_0": 6e-3,
    "Q8_1": 6e-3,
    "Q8_K": 8e-3,
    "Q6_K": 0.02,
    "Q5_1": 0.045,
    "Q5_0": 0.05,
    "Q5_K": 0.04,
    "Q4_K": 0.08,
    "IQ4_NL": 0.085,
    "IQ4_XS": 0.085,
    "Q4_1": 0.09,
    "Q4_0": 0.10,
    "Q3_K": 0.17,
    "Q2_K": 0.33,
    "MXFP4": 0.13,  # measured 0.120
    "NVFP4": 0.10,  # measured 0.096
    "Q1_0": 0.62,  # measured 0.597: one bit a weight
}
ROUND_TRIP_KINDS = [k for k in kinds() if k != "wide_range"]  # f16 scales over/underflow there


def gguf_bytes(x: np.ndarray, t: str) -> np.ndarray:
    out = gguf.quants.quantize(x, gguf.GGMLQuantizationType[t])
    return np.ascontiguousarray(out).view(np.uint8).reshape(x.shape[0], -1)


@pytest.fixture(scope="module")
def data() -> np.ndarray:
    return stacked()


@pytest.fixture(scope="module")
def packed(data) -> dict[str, np.ndarray]:
    return {t: quantize(data, t) for t in WRITABLE}


@pytest.mark.parametrize("t", GGUF_QUANTIZE)
def test_bytes_match_gguf_py(t, data, packed):
    np.testing.assert_array_equal(packed[t], gguf_bytes(data, t))


def test_bytes_match_gguf_py_odd_rows():
    """Every legacy format on a row of 96 values (3 blocks) and a single block."""
    rng = np.random.default_rng(5)
    for shape in [(7, 96), (1, 32)]:
        x = rng.standard_normal(shape).astype(np.float32)
        for t in GGUF_QUANTIZE:
            np.testing.assert_array_equal(quantize(x, t), gguf_bytes(x, t), err_msg=t)


@pytest.mark.parametrize("t", GGUF_DEQUANTIZE)
def test_dequantize_matches_gguf_py(t, data, packed):
    ours = dequantize(packed[t], t, data.shape)
    theirs = gguf.quants.dequantize(packed[t], gguf.GGMLQuantizationType[t]).reshape(data.shape)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("t", ["Q8_1", "Q8_K"])
def test_dot_types_match_literal_reference(t, data, packed):
    ref = {"Q8_1": reference.quantize_row_q8_1_ref, "Q8_K": reference.quantize_row_q8_K_ref}[t]
    rows = data[::5]  # the literal loops are slow: one row of each kind
    expected = np.stack([ref(row) for row in rows])
    np.testing.assert_array_equal(quantize(rows, t), expected)


@pytest.mark.parametrize("t", WRITABLE)
def test_layout(t, packed, data):
    tt = ggml_type(t)
    assert packed[t].dtype == np.uint8
    assert packed[t].shape == (data.shape[0], tt.row_bytes(data.shape[1]))


@pytest.mark.parametrize("t", WRITABLE)
def test_round_trip_error(t):
    for name in ROUND_TRIP_KINDS:
        x = kinds()[name]
        y = dequantize(quantize(x, t), t, x.shape)
        assert y.dtype == np.float32 and np.isfinite(y).all(), name
        err = np.abs(y - x)
        if name == "tiny":  # below every f16 scale: only Q8_K (f32 scale) and BF16 keep them
            assert err.max() <= 1e-29, name
            continue
        if name == "zeros":
            assert not y.any(), name
            continue
        if name in OUT_OF_RANGE.get(t, ()):
            continue
        block = 1 if ggml_type(t).block_size == 1 else 256
        amax = np.abs(x).reshape(-1, block).max(axis=1)
        worst = (err.reshape(-1, block).max(axis=1) / np.maximum(amax, 1e-38)).max()
        assert worst <= MAX_BLOCK_ERROR[t], (name, worst)
    x = kinds()["normal"]
    y = dequantize(quantize(x, t), t, x.shape)
    assert np.sqrt(((y - x) ** 2).mean() / (x**2).mean()) <= MAX_RMS_ERROR[t]


def test_more_bits_less_error():
    x = kinds(rows=8)["normal"]

    def rms(t):
        return np.sqrt(((dequantize(quantize(x, t), t, x.shape) - x) ** 2).mean())

    errors = [rms(t) for t in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"]]
    assert errors == sorted(errors, reverse=True)


@pytest.mark.parametrize("t", WRITABLE)
def test_dequantize_torch_equals_dequantize(t, packed, data):
    expected = dequantize(packed[t], t, data.shape)
    flat = torch.from_numpy(packed[t].reshape(-1).copy())
    got = dequantize_torch(flat, t, data.shape)
    assert got.dtype == torch.float32 and got.shape == data.shape
    np.testing.assert_array_equal(got.numpy(), expected)
    rows = torch.from_numpy(packed[t].copy())
    half = dequantize_torch(rows, t, data.shape, dtype=torch.float16)
    assert torch.equal(half, torch.from_numpy(expected).half())


def test_dequantize_torch_3d_shape(packed, data):
    flat = torch.from_numpy(packed["Q4_K"].reshape(-1).copy())
    shape = (2, data.shape[0] // 2, data.shape[1])
    got = dequantize_torch(flat, "Q4_K", shape)
    np.testing.assert_array_equal(
        got.reshape(data.shape).numpy(), dequantize(packed["Q4_K"], "Q4_K", data.shape)
    )


@pytest.mark.parametrize("t", [t for t in WRITABLE if ggml_type(t).block_size > 1])
def test_row_length_not_multiple_of_block(t):
    size = ggml_type(t).block_size
    with pytest.raises(ValueError, match=rf"{t}.*\b{size + 16}\b.*block size {size}"):
        quantize(np.zeros((2, size + 16), dtype=np.float32), t)


def test_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        quantize(np.zeros(64, dtype=np.float32), "Q8_0")
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        quantize(np.zeros((1, 256), dtype=np.float32), "IQ2_XXS")
    with pytest.raises(ValueError, match="Q4_0.*needs 36"):
        dequantize_torch(torch.zeros(35, dtype=torch.uint8), "Q4_0", (64,))


def test_quantize_threads_do_not_change_bytes(data):
    big = np.tile(data, (8, 1))
    for t in ["Q4_K", "Q8_0"]:
        np.testing.assert_array_equal(quantize(big, t, threads=1), quantize(big, t, threads=2))


@pytest.mark.slow
def test_real_file_dequantize_matches_gguf_py():
    """SmolLM2's Q4_1 projections and Q8_0 token_embd dequantize exactly as gguf-py does."""
    from qlib import models

    reader = gguf.GGUFReader(models.path())
    by_name = {t.name: t for t in reader.tensors}
    for name in ["blk.0.attn_q.weight", "blk.29.ffn_down.weight", "token_embd.weight"]:
        t = by_name[name]
        raw = np.asarray(t.data).view(np.uint8)[:4096]  # the first rows suffice
        shape = (raw.shape[0], int(t.shape[0]))
        ours = dequantize(raw, t.tensor_type.name, shape)
        theirs = gguf.quants.dequantize(raw, t.tensor_type)
        np.testing.assert_array_equal(ours, theirs.reshape(shape), err_msg=name)
