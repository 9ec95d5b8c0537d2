"""QTensor (packed ggml blocks on a device) and QMatMul (the three forms of candle).

A ``QTensor`` is not a ``torch.Tensor``: it holds the raw block bytes of a
GGUF tensor as a uint8 tensor on a device, plus the logical shape and the
ggml type. It never takes part in autograd.

``QMatMul`` wraps one weight in one of three forms, as candle's enum does:

* ``quantized``: keep the blocks, multiply with a quantized kernel;
* ``f32``: dequantize once to float32, then a plain matmul;
* ``f16``: dequantize once to float16, cast the input to f16, cast back.
"""

from __future__ import annotations

import os
from typing import Literal

import numpy as np
import torch

from ..devices import DeviceLike, as_device
from ..spans import span
from .api import dequantize_torch, quantize
from .cpu import matmul as cpu_matmul
from .cuda import matmul as cuda_matmul
from .types import GGMLType, ggml_type

Form = Literal["quantized", "f32", "f16"]
FORMS: tuple[str, ...] = ("quantized", "f32", "f16")


class QTensor:
    """Packed quantized blocks on a device: ``data`` (uint8), ``shape`` and ``dtype``."""

    __slots__ = ("data", "shape", "dtype")

    def __init__(self, data: torch.Tensor, shape: tuple[int, ...], dtype: GGMLType | str):
        dtype = ggml_type(dtype)
        shape = tuple(int(d) for d in shape)
        if not shape:
            raise ValueError("a QTensor needs at least one dimension")
        dtype.check_packed(shape, data.numel(), data.dtype == torch.uint8)
        expected = dtype.nbytes(shape)
        rows = expected // max(dtype.row_bytes(shape[-1]), 1)
        self.data = data.reshape(rows, dtype.row_bytes(shape[-1])).detach()
        self.shape = shape
        self.dtype = dtype

    @classmethod
    def from_bytes(
        cls,
        raw: bytes | bytearray | memoryview | np.ndarray,
        shape,
        dtype,
        device: DeviceLike = "cpu",
    ) -> QTensor:
        """Wrap raw GGUF block bytes (copied) and move them to ``device``."""
        arr = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        data = torch.from_numpy(arr.astype(np.uint8, copy=True).reshape(-1))
        return cls(data.to(as_device(device)), shape, dtype)

    @classmethod
    def quantize(
        cls, x: torch.Tensor | np.ndarray, dtype, device: DeviceLike | None = None
    ) -> QTensor:
        """Quantize a float tensor (rows along the last axis) into ``dtype`` blocks."""
        t = ggml_type(dtype)
        arr = x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        shape = tuple(arr.shape)
        packed = quantize(arr.reshape(-1, shape[-1]).astype(np.float32), t.name)
        dev = device if device is not None else (x.device if isinstance(x, torch.Tensor) else "cpu")
        return cls.from_bytes(packed, shape, t, dev)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: DeviceLike) -> QTensor:
        return QTensor(self.data.to(as_device(device)), self.shape, self.dtype)

    def nbytes(self) -> int:
        return self.data.numel()

    def unstack(self) -> list[QTensor]:
        """The matrices of a 3-D QTensor along its first dimension (views of its bytes): the
        experts of a stacked ``ffn_*_exps`` tensor."""
        if len(self.shape) != 3:
            raise ValueError(f"unstack needs a 3-D QTensor, got shape {list(self.shape)}")
        n, rows, k = self.shape
        data = self.data.reshape(n, -1)
        return [QTensor(data[i], (rows, k), self.dtype) for i in range(n)]

    def dequantize(self, device: DeviceLike | None = None, dtype=torch.float32) -> torch.Tensor:
        """Float tensor of ``shape`` on ``device`` (default: where the blocks are)."""
        data = self.data if device is None else self.data.to(as_device(device))
        return dequantize_torch(data, self.dtype.name, self.shape, dtype=dtype)

    def __repr__(self) -> str:
        return f"QTensor({self.dtype.name}, shape={list(self.shape)}, device={self.device})"


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "")
    return value not in ("", "0")


def default_form(qtensor: QTensor | GGMLType | str) -> str:
    """candle's ``QMatMul::from_arc`` rule: float types and the env flags dequantize.

    Takes a QTensor or just its ggml type (so a loader can check before reading data).
    """
    dtype = qtensor.dtype if isinstance(qtensor, QTensor) else ggml_type(qtensor)
    if dtype.name in ("F32", "F16", "BF16"):
        return "f32"
    if _env_flag("QLIB_DEQUANTIZE_ALL_F16"):
        return "f16"
    if _env_flag("QLIB_DEQUANTIZE_ALL"):
        return "f32"
    return "quantized"


class QMatMul:
    """``y = x @ w.T`` for a GGUF weight ``w`` of shape (out, in), in one of three forms."""

    def __init__(self, qtensor: QTensor, form: str | None = None):
        form = form or default_form(qtensor)
        if form not in FORMS:
            raise ValueError(f"unknown QMatMul form {form!r}; choose one of {', '.join(FORMS)}")
        self.form = form
        self.qtensor = qtensor
        self.out_features, self.in_features = qtensor.shape[0], qtensor.shape[-1]
        self.weight: torch.Tensor | None = None
        if form == "f32":
            self.weight = qtensor.dequantize(dtype=torch.float32)
        elif form == "f16":
            self.weight = qtensor.dequantize(dtype=torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with span("qmatmul"):
            if x.shape[-1] != self.in_features:
                raise ValueError(
                    f"qmatmul: input has {x.shape[-1]} features, weight "
                    f"{list(self.qtensor.shape)} expects {self.in_features}"
                )
            if self.form == "f32":
                return (
                    x @ self.weight.t()
                    if x.dtype == torch.float32
                    else ((x.float() @ self.weight.t()).to(x.dtype))
                )
            if self.form == "f16":
                return (x.to(torch.float16) @ self.weight.t()).to(x.dtype)
            lead = x.shape[:-1]
            y = qmatmul(x.reshape(-1, self.in_features), self.qtensor)
            return y.reshape(*lead, self.out_features)

    __call__ = forward


def qmatmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` ``[m, k]`` and a 2-D QTensor ``w``, on ``x``'s device: ggml's
    semantics on CPU (``cpu.matmul``), the Triton kernels on CUDA (``cuda.matmul``)."""
    if x.device.type != "cpu":
        return cuda_matmul.qmatmul(x, w)
    return cpu_matmul.qmatmul(x, w)
