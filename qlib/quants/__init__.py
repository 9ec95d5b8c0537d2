"""GGUF block formats: layouts, quantize / dequantize, and quantized dot products.

* ``quantize`` / ``dequantize`` / ``dequantize_torch``: F32, F16, BF16, Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q6_K, Q8_K (``api``; one module per family:
  ``floats``, ``legacy``, ``kquants``).
* ``quantize_activations`` / ``VEC_DOT_TYPE``: activation rows as ggml's x86
  CPU backend quantizes them (``activations``).
* ``QTensor`` (packed blocks on a device), ``QMatMul`` (candle's three forms) and
  ``qmatmul`` (``qtensor``): the device dispatch to ``cpu.matmul`` (ggml semantics,
  C kernels in ``cpu``) and ``cuda.matmul`` (Triton kernels in ``cuda``).
* ``reference``: slow literal transcriptions of ggml, the yardstick in tests.
* ``bench``: benchmark weights and the timing of the three QMatMul forms.
"""

from .activations import VEC_DOT_TYPE, QActivations, quantize_activations
from .api import SUPPORTED, block_format, dequantize, dequantize_torch, quantize
from .qtensor import FORMS, QMatMul, QTensor, default_form, qmatmul
from .types import GGML_TYPES, GGML_TYPES_BY_ID, GGMLType, ggml_type

__all__ = [
    "GGML_TYPES",
    "GGML_TYPES_BY_ID",
    "GGMLType",
    "ggml_type",
    "SUPPORTED",
    "block_format",
    "quantize",
    "dequantize",
    "dequantize_torch",
    "VEC_DOT_TYPE",
    "QActivations",
    "quantize_activations",
    "FORMS",
    "QMatMul",
    "QTensor",
    "default_form",
    "qmatmul",
]
