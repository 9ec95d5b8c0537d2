"""Quantized matmul on a GPU: ``y = x @ dequantize(w).T`` with the weight kept packed.

On CUDA the weight's blocks are read and dequantized inside Triton kernels; the
activations are *not* quantized (unlike the CPU ggml path) and every product is
accumulated in float32:

* ``gemv``: m <= ``GEMV_MAX_M`` (4) rows (decode); CUDA cores, one program
  per x row and 16 (or 4) weight rows. Exact: float32 FMAs.
* ``gemm``: tensor cores. Each 32-element group is a dot of x with the
  group's integer codes (exact in f16/bf16), then scaled by the group's scale
  (and its offset times the group's x-sum) in float32, so no weight is
  rounded. A float32 x is split into three bf16 parts (24 bits), three dots.
  Taken by float32 x for every m > 4, and by f16/bf16 x for 4 < m < 16.
* ``dequant``: f16/bf16 x with m >= ``DEQUANT_MIN_M`` (16): the weight is
  dequantized to x's dtype once per call (a scratch tensor the size of a dense
  weight), then cuBLAS. The weight values are rounded to x's dtype here, as
  llama.cpp does for batches; measured 3x faster than ``gemm`` at m = 203.
* ``fallback``: every other format, MPS tensors and CUDA without Triton:
  ``dequantize_torch`` on the device (float32) each call, then a matmul.

Formats done natively: ``NATIVE``. Inputs may be float32, float16 or bfloat16;
the result has x's dtype. Anything else raises ``TypeError``.
"""

from __future__ import annotations

import functools
import os

import torch

from ..api import dequantize_torch
from .layout import FORMAT_ID, prepare

PATHS: tuple[str, ...] = ("auto", "gemv", "gemm", "dequant", "fallback")
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

# Path thresholds on the number of activation rows m (measured on an H200: docs/gpu.md).
# float32 x never takes ``dequant``: the exact 3 x bf16 GEMM beats f32 cuBLAS at every m.
GEMV_MAX_M = 4
DEQUANT_MIN_M: dict[torch.dtype, int | None] = {
    torch.float16: 16, torch.bfloat16: 16, torch.float32: None,
}  # fmt: skip

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors through Triton (debugging)


# --- paths ---------------------------------------------------------------------------------


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (the kernels need it; everything else falls back)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def dequantize_matmul(x: torch.Tensor, w) -> torch.Tensor:
    """The fallback: ``dequantize_torch`` on ``w``'s device to float32 each call, then a matmul.

    Used for formats without a kernel, on MPS, and on CUDA without Triton.
    """
    W = dequantize_torch(w.data, w.dtype.name, w.shape, dtype=torch.float32)
    return (x.float() @ W.t()).to(x.dtype)


def choose_path(m: int, w, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The path ``qmatmul`` takes for ``m`` rows of ``dtype`` input on ``device`` ("auto")."""
    on_gpu = device.type == "cuda" or (_INTERPRET and device.type == "cpu")
    if not on_gpu or w.dtype.name not in FORMAT_ID or not triton_available():
        return "fallback"
    if m <= GEMV_MAX_M:
        return "gemv"
    threshold = DEQUANT_MIN_M.get(dtype)
    return "dequant" if threshold is not None and m >= threshold else "gemm"


def qmatmul(
    x: torch.Tensor, w, *, out: torch.Tensor | None = None, path: str = "auto"
) -> torch.Tensor:
    """``x @ dequantize(w).T`` for x ``[..., k]`` (f32/f16/bf16) and QTensor ``w`` ``(n, k)``.

    Returns ``[..., n]`` in x's dtype (into ``out`` if given: contiguous, that
    shape and dtype). ``path`` forces one of ``PATHS`` (tests, benchmarks).
    """
    if x.dtype not in DTYPES:
        raise TypeError(f"qmatmul: input dtype {x.dtype} not supported (float32/16, bfloat16)")
    n, k = w.shape[0], w.shape[-1]
    if x.shape[-1] != k:
        raise ValueError(f"qmatmul: input has {x.shape[-1]} features, weight {list(w.shape)}")
    if x.device != w.data.device:
        raise ValueError(f"qmatmul: input on {x.device}, weight on {w.data.device}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if path == "auto":
        path = choose_path(m, w, x.device, x.dtype)
    if path == "fallback":
        y = dequantize_matmul(x2, w)
        if out is not None:
            out.view(-1, n).copy_(y)
            return out
        return y.reshape(*lead, n)
    if path not in PATHS:
        raise ValueError(f"qmatmul: unknown path {path!r}; choose one of {', '.join(PATHS)}")
    from . import kernels

    p = prepare(w)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    if m:
        if path == "gemv":
            kernels.gemv(x2, p, y)
        elif path == "gemm":
            kernels.gemm(x2, p, y)
        else:
            wd = kernels.dequantize(p, x.dtype)
            torch.matmul(x2, wd.t(), out=y)
    return out if out is not None else y.reshape(*lead, n)
