"""``qlib.quants.cuda``: the GPU layout (on CPU, always) and the CUDA kernels (skip without CUDA).

Reference: ``ref = x.double() @ W.double().T`` with ``W = dequantize_torch(...)``
(exact float32 weight values). Two checks, both must hold, and every output
must be finite (the output is NaN-poisoned first where ``out=`` is used):

* per element ``|y - ref| <= 1.01 u |ref| + a * rms(ref)``: ``u`` the unit
  roundoff of the output dtype (0 for f32, 2**-11 f16, 2**-8 bf16: rounding
  the f32 accumulator once), ``a = 1e-5`` for float32 accumulation over
  k <= 4096 terms (its error is about 1e-7 of rms(ref)); the ``dequant`` path
  also rounds the weights to x's dtype, so it gets ``a = 1e-5 + 5u``
  (the rounding error is about u / sqrt(3) of rms(ref); 5u is ~9 sigma).
* ``||y - ref|| / ||ref|| <= u + 1e-5`` (dequant path: ``6u + 1e-5``).

The kernels never round weights or activations on the other paths (codes are
exact in f16/bf16, float32 x is split into three bf16 parts), so the f32
results are float32-accurate whatever the path.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from qlib.quants.api import dequantize_torch
from qlib.quants.bench import random_blocks
from qlib.quants.cuda import layout
from qlib.quants.cuda import matmul as gpu
from qlib.quants.gridquants import TABLE_TYPES, X3_TYPES
from qlib.quants.types import ggml_type

CUDA = torch.cuda.is_available() and gpu.triton_available()
INTERPRET = os.environ.get("QLIB_TRITON_INTERPRET") == "1" and gpu.triton_available()
MPS = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")

UNIT = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
SHAPES = [*SMOLLM2, (8192, 4096)]
MS = [1, 2, 7, 64, 203]
DTYPES = list(gpu.DTYPES)
# each kernel format once: the table types share one (their planes: test_repack_keeps_values)
KERNEL_NAMES = [n for n in layout.NATIVE if n not in TABLE_TYPES] + ["IQ2_XXS", "IQ4_XS"]
try:  # on the GPU machine: `pytest -n 8 --dist loadgroup` compiles each format's kernels once
    import xdist  # noqa: F401

    NAMES = [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in KERNEL_NAMES]
except ImportError:
    NAMES = KERNEL_NAMES


def check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, rounded_weights=False) -> None:
    """Assert ``y`` matches the float64 reference within the tolerances of the module docstring."""
    u = UNIT[dtype]
    a = 1e-5 + (5 * u if rounded_weights else 0.0)
    assert y.dtype == dtype and y.shape == ref.shape
    yd = y.double()
    assert torch.isfinite(yd).all(), "non-finite output"
    err = (yd - ref).abs()
    rms = ref.pow(2).mean().sqrt()
    bound = 1.01 * u * ref.abs() + a * rms
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"element {divmod(worst.item(), ref.shape[-1])}: |diff| {err.flatten()[worst]:.3g} "
        f"> bound {bound.flatten()[worst]:.3g} (rms {rms:.3g})"
    )
    rel = ((yd - ref).norm() / ref.norm()).item()
    assert rel <= (6 * u if rounded_weights else u) + 1e-5, f"relative error {rel:.3g}"


# --- CPU: the GPU layout, the fallback, the API --------------------------------------------


@pytest.mark.parametrize("name", layout.NATIVE)
def test_repack_keeps_values(name):
    """The planes hold exactly the GGUF values (read as the kernels read them)."""
    w = random_blocks(24, 512, name, seed=3)
    p = layout.repack(w.data, name, w.shape)
    ref = dequantize_torch(w.data, name, w.shape)
    assert torch.equal(layout.dequantize_prepared(p), ref)
    if name in X3_TYPES:  # 3.625 bits a weight and the 8 levels, whatever the file's bits
        assert p.nbytes() == 24 * 512 * 29 // 64 + 8
    elif name in TABLE_TYPES:  # 4.625 bits and the 16 levels
        assert p.nbytes() == 24 * 512 * 37 // 64 + 16
    else:
        assert w.data.numel() <= p.nbytes() <= w.data.numel() * 1.3


def test_table_planes_made_in_pieces(monkeypatch):
    """A table type's planes made a few rows at a time (``TABLE_CHUNK``; a short last piece)
    are the whole weight's."""
    w = random_blocks(10, 512, "IQ2_XS", seed=4)
    whole = layout.repack(w.data, "IQ2_XS", w.shape)
    monkeypatch.setattr(layout, "TABLE_CHUNK", 3 * 512)
    pieces = layout.repack(w.data, "IQ2_XS", w.shape)
    for a, b in ((whole.qs, pieces.qs), (whole.sc, pieces.sc), (whole.d, pieces.d)):
        assert torch.equal(a, b)
    want = dequantize_torch(w.data, "IQ2_XS", w.shape)
    assert torch.equal(layout.dequantize_prepared(pieces), want)


def test_prepare_is_cached_and_keeps_gguf_bytes():
    w = random_blocks(8, 64, "Q4_1")
    before = w.data.clone()
    assert layout.prepare(w) is layout.prepare(w)
    assert torch.equal(w.data, before)


def test_repack_rejects_non_native():
    w = random_blocks(4, 256, "Q8_1")
    with pytest.raises(NotImplementedError, match="Q8_1"):
        layout.repack(w.data, "Q8_1", w.shape)


def test_format_ids_stable():
    """Ids are baked into compiled kernels and caches: new formats are appended."""
    assert layout.NATIVE[:8] == ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
    assert layout.FORMAT_ID["Q2_K"] == 8 and layout.FORMAT_ID["Q3_K"] == 9
    assert layout.FORMAT_ID["NVFP4"] == 10 and layout.FORMAT_ID["Q1_0"] == 11
    assert layout.FORMAT_ID["MXFP4"] == 12
    # kernels.py's "a scale per 16": ids Q6_K .. NVFP4 and the table formats, the last ids
    assert [layout.FORMAT_ID[n] for n in ("Q6_K", "Q2_K", "Q3_K", "NVFP4")] == [7, 8, 9, 10]
    assert max(layout.FORMAT_ID.values()) == layout.FORMAT_ID["IQ2_XS"]
    assert layout.FORMAT_ID["IQ2_XS"] == layout.FORMAT_ID["IQ4_XS"] + 1 == 15


@pytest.mark.parametrize("dtype", DTYPES)
def test_fallback_on_cpu(dtype):
    """CPU and MPS tensors (and non-native formats) take the dequantize-then-matmul path."""
    w = random_blocks(32, 64, "Q8_0")
    x = torch.randn(3, 64).to(dtype)
    assert gpu.choose_path(3, w, x.device, dtype) in (
        "fallback",
        "gemv",
    )  # gemv: TRITON_INTERPRET=1
    ref = x.double() @ dequantize_torch(w.data, "Q8_0", w.shape).double().T
    check(gpu.qmatmul(x, w, path="fallback"), ref, dtype)


def test_bad_inputs():
    w = random_blocks(8, 64, "Q4_0")
    with pytest.raises(TypeError, match="int32"):
        gpu.qmatmul(torch.ones(2, 64, dtype=torch.int32), w)
    with pytest.raises(ValueError, match="features"):
        gpu.qmatmul(torch.ones(2, 32), w)
    with pytest.raises(ValueError, match="path"):
        gpu.qmatmul(torch.ones(2, 64), w, path="magic")


# --- CUDA ----------------------------------------------------------------------------------

_WEIGHTS: dict = {}


def weight(name: str, shape: tuple[int, int]):
    """A random CUDA QTensor and its float64 dequantized values, cached per (format, shape)."""
    key = (name, shape)
    if key not in _WEIGHTS:
        if len(_WEIGHTS) > 12:
            _WEIGHTS.clear()
        w = random_blocks(*shape, name, device="cuda", seed=zlib.crc32(repr(key).encode()))
        _WEIGHTS[key] = w, dequantize_torch(w.data, name, w.shape).double()
    return _WEIGHTS[key]


def block_skip(name: str, k: int) -> None:
    size = ggml_type(name).block_size
    if k % size:
        pytest.skip(f"{name} needs rows of a multiple of {size}, k={k}")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", NAMES)
def test_qmatmul_cuda(name, dtype, shape, m):
    """The automatic path for every native format, input dtype, shape and row count."""
    block_skip(name, shape[1])
    w, W = weight(name, shape)
    x = torch.randn(m, shape[1], device="cuda").to(dtype)
    path = gpu.choose_path(m, w, x.device, dtype)
    y = gpu.qmatmul(x, w)
    check(y, x.double() @ W.T, dtype, rounded_weights=path == "dequant" and dtype != torch.float32)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 203])
@pytest.mark.parametrize("path", ["gemv", "gemm", "dequant"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", NAMES)
def test_each_path_cuda(name, dtype, path, m):
    """Every path forced, whatever m (the thresholds may move), into a NaN-poisoned ``out``."""
    w, W = weight(name, (576, 1536))
    x = torch.randn(m, 1536, device="cuda").to(dtype)
    out = torch.full((m, 576), float("nan"), device="cuda", dtype=dtype)
    y = gpu.qmatmul(x, w, out=out, path=path)
    assert y is out
    check(y, x.double() @ W.T, dtype, rounded_weights=path == "dequant" and dtype != torch.float32)


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_fallback_formats_cuda(name):
    w = random_blocks(64, 512, name, device="cuda")
    W = dequantize_torch(w.data, name, w.shape).double()
    assert gpu.choose_path(5, w, torch.device("cuda")) == "fallback"
    for dtype in DTYPES:
        x = torch.randn(5, 512, device="cuda").to(dtype)
        check(gpu.qmatmul(x, w), x.double() @ W.T, dtype)


@pytest.mark.skipif(
    not (CUDA or INTERPRET), reason="needs CUDA and Triton (or QLIB_TRITON_INTERPRET=1)"
)
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["gemv", "gemm", "dequant"])
@pytest.mark.parametrize("name", NAMES)
def test_each_path_small(name, path):
    """Every native format and path on a small weight (64 x 512, two super-blocks a row), also
    on a CPU through Triton's interpreter. Its bf16 is wrong (``tl.dot``; float32 -> bf16
    truncates): there bf16 x is skipped and the GEMM is checked with f16 x only (float32 x
    takes three bf16 dots)."""
    device = "cuda" if CUDA else "cpu"
    w = random_blocks(64, 512, name, device=device, seed=zlib.crc32(name.encode()))
    W = dequantize_torch(w.data, name, w.shape).double()
    dtypes = DTYPES
    if not CUDA:
        dtypes = [torch.float16] if path == "gemm" else [torch.float32, torch.float16]
    for m in (1, 7):
        for dtype in dtypes:
            x = torch.randn(m, 512, device=device).to(dtype)
            out = torch.full((m, 64), float("nan"), device=device, dtype=dtype)
            y = gpu.qmatmul(x, w, out=out, path=path)
            rounded = path == "dequant" and dtype != torch.float32
            check(y, x.double() @ W.T, dtype, rounded_weights=rounded)


@needs_cuda
@pytest.mark.gpu
def test_batched_and_strided_input_cuda():
    w, W = weight("Q4_1", (576, 576))
    x = torch.randn(2, 3, 2 * 576, device="cuda")[..., ::2]  # not contiguous
    y = gpu.qmatmul(x, w)
    assert y.shape == (2, 3, 576)
    check(y.reshape(6, 576), x.reshape(6, 576).double() @ W.T, torch.float32)
    assert gpu.qmatmul(x[:0], w).shape == (0, 3, 576)


@needs_cuda
@pytest.mark.gpu
def test_qmatmul_entry_point_dispatches_to_gpu():
    """``qlib.quants.qtensor.qmatmul`` (the device dispatch) hands CUDA tensors to this module."""
    from qlib.quants.qtensor import qmatmul

    w, W = weight("Q8_0", (576, 576))
    x = torch.randn(3, 576, device="cuda")
    check(qmatmul(x, w), x.double() @ W.T, torch.float32)


@pytest.mark.skipif(not MPS, reason="needs MPS")
@pytest.mark.gpu
def test_mps_fallback():
    w = random_blocks(64, 256, "Q4_K", device="mps")
    x = torch.randn(3, 256, device="mps")
    assert gpu.choose_path(3, w, x.device) == "fallback"
    W = dequantize_torch(w.data.cpu(), "Q4_K", w.shape).double()
    check(gpu.qmatmul(x, w).cpu(), x.cpu().double() @ W.T, torch.float32)
