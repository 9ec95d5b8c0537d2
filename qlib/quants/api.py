"""``quantize`` / ``dequantize`` / ``dequantize_torch`` for every supported ggml type."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import floats, fp4, gridquants, iquants, kquants, legacy  # noqa: F401  (register the formats)
from .base import FORMATS, BlockFormat
from .types import ggml_type

SUPPORTED: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS", "MXFP4", "NVFP4", "Q1_0",
    *gridquants.GRID_TYPES, *gridquants.TERNARY_TYPES,
)  # fmt: skip
# types qlib reads and computes with but does not write (their quantizers need ggml's search)
READ_ONLY: tuple[str, ...] = (*gridquants.GRID_TYPES, *gridquants.TERNARY_TYPES)
WRITABLE: tuple[str, ...] = tuple(t for t in SUPPORTED if t not in READ_ONLY)  # ``quantize``

# Quantize in chunks of about this many floats: small enough to stay in cache
# through the many passes of the K-quant searches, large enough to amortize NumPy.
_CHUNK = 1 << 16


def block_format(type_name: str) -> type[BlockFormat]:
    """The format class of ``type_name``; a clear error for types qlib cannot compute with."""
    t = ggml_type(type_name)
    try:
        return FORMATS[t.name]
    except KeyError:
        supported = ", ".join(SUPPORTED)
        raise NotImplementedError(
            f"ggml type {t.name} is not supported by qlib.quants (supported: {supported})"
        ) from None


def _check_row_length(fmt: type[BlockFormat], n: int) -> None:
    if n % fmt.block_size:
        raise ValueError(
            f"cannot quantize to {fmt.name}: row length {n} is not a multiple of "
            f"its block size {fmt.block_size}"
        )


def quantize(x: np.ndarray, type_name: str, threads: int | None = None) -> np.ndarray:
    """Quantize the rows of ``x`` (2-D float32, rows along the last axis) into GGUF blocks.

    Uses llama.cpp's reference quantizers (``quantize_row_*_ref``, no importance
    matrix). Returns uint8 ``[rows, row_bytes]``. Work is split over ``threads``
    (default: all cores) in chunks of blocks; the result does not depend on it.
    """
    fmt = block_format(type_name)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise ValueError(f"quantize expects a 2-D array of rows, got shape {x.shape}")
    rows, n = x.shape
    _check_row_length(fmt, n)
    blocks = np.ascontiguousarray(x).reshape(-1, fmt.block_size)
    out = np.empty((blocks.shape[0], fmt.type_size), dtype=np.uint8)
    step = max(1, _CHUNK // fmt.block_size)
    starts = range(0, blocks.shape[0], step)

    def work(i: int) -> None:
        with np.errstate(all="ignore"):  # masked lanes may divide by zero, as the C code would
            out[i : i + step] = fmt.quantize_blocks(blocks[i : i + step])

    threads = threads or os.cpu_count() or 1
    if threads > 1 and len(starts) > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, starts))
    else:
        for i in starts:
            work(i)
    return out.reshape(rows, -1)


def dequantize_torch(
    data: torch.Tensor, type_name: str, shape, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Dequantize GGUF blocks (uint8, flat or ``[rows, row_bytes]``) on their own device.

    Pure torch ops, so the same code runs on CPU, CUDA and MPS. Values are
    computed in float32 exactly as ggml's ``dequantize_row_*`` and then cast
    to ``dtype``.
    """
    fmt = block_format(type_name)
    shape = tuple(int(d) for d in shape)
    t = ggml_type(fmt.name)
    t.check_packed(shape, data.numel(), data.dtype == torch.uint8)
    blocks = data.reshape(-1, fmt.type_size)
    values = fmt.dequantize_blocks(blocks)
    if dtype != torch.float32:
        values = values.to(dtype)
    return values.reshape(shape)


def dequantize(data: np.ndarray, type_name: str, shape) -> np.ndarray:
    """Dequantize GGUF blocks to a float32 NumPy array of ``shape`` (via the torch code, on CPU)."""
    raw = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(-1)
    with warnings.catch_warnings():  # read-only (e.g. memory-mapped) input: only read here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(raw)
    return dequantize_torch(tensor, type_name, shape).numpy()
