"""The block-format interface and registry (one class per ggml type, as in gguf-py)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from .types import ggml_type

FORMATS: dict[str, type[BlockFormat]] = {}


class BlockFormat:
    """One ggml block format: quantize blocks in NumPy, dequantize blocks in torch.

    ``quantize_blocks`` maps ``(B, block_size)`` float32 to ``(B, type_size)`` uint8
    in GGUF layout; ``dequantize_blocks`` maps ``(B, type_size)`` uint8 on any
    device to ``(B, block_size)`` float32 with pure torch ops on that device.
    """

    name: ClassVar[str]
    block_size: ClassVar[int]
    type_size: ClassVar[int]

    def __init_subclass__(cls, type_name: str, **kwargs):
        super().__init_subclass__(**kwargs)
        t = ggml_type(type_name)
        cls.name, cls.block_size, cls.type_size = t.name, t.block_size, t.type_size
        FORMATS[t.name] = cls

    @classmethod
    def quantize_blocks(cls, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError(
            f"qlib reads {cls.name} but does not write it (llama.cpp's llama-quantize does)"
        )

    @classmethod
    def unpack(cls, blocks: torch.Tensor):
        """``(codes, scales, offsets)``: integer codes ``(B, block_size)``, float32
        scales and offsets (or None) per group ``(B, groups)``, such that a value is
        ``scale * code + offset`` with ggml's own rounding order."""
        raise NotImplementedError

    @classmethod
    def dequantize_blocks(cls, blocks: torch.Tensor) -> torch.Tensor:
        q, scale, offset = cls.unpack(blocks)
        y = q.float().view(blocks.shape[0], scale.shape[1], -1) * scale.unsqueeze(-1)
        if offset is not None:
            y = y + offset.unsqueeze(-1)
        return y.reshape(blocks.shape[0], -1)
