"""F32, F16 and BF16: one element per "block"; stored little-endian.

Byte identity is checked against gguf-py's ``gguf.quants.quantize`` (F16, BF16).
BF16 rounds to nearest even and quiets NaNs, as ggml's ``ggml_compute_fp32_to_bf16``.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import BlockFormat


class F32(BlockFormat, type_name="F32"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype="<f4").view(np.uint8)

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float32)


class F16(BlockFormat, type_name="F16"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32).astype("<f2").view(np.uint8)

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.float16).float()


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even, NaN forced quiet."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (u >> 16) | 64, rounded).astype(np.uint16)


class BF16(BlockFormat, type_name="BF16"):
    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        return bf16_bits(x).astype("<u2").view(np.uint8)

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(torch.bfloat16).float()
