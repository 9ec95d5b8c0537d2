"""GGUF block formats: layouts, quantize / dequantize, and quantized dot products.

* ``quantize`` / ``dequantize`` / ``dequantize_torch``: F32, F16, BF16, Q4_0,
  Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q6_K, Q8_K (``api``; one module per family:
  ``floats``, ``legacy``, ``kquants``).
* ``quantize_activations`` / ``VEC_DOT_TYPE``: activation rows as ggml's x86
  CPU backend quantizes them (``activations``).
* ``qmatmul`` / ``prepare``: the CPU quantized matmul with ggml semantics
  (``matmul``); CUDA/MPS inputs go to ``gpu``.
* ``reference``: slow literal transcriptions of ggml, the yardstick in tests.
* ``bench.bench_qmatmul``: timing of the three QMatMul forms.
"""

from .activations import VEC_DOT_TYPE, QActivations, quantize_activations
from .api import SUPPORTED, block_format, dequantize, dequantize_torch, quantize
from .matmul import PreparedWeight, clear_cache, prepare, qmatmul
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
    "PreparedWeight",
    "prepare",
    "qmatmul",
    "clear_cache",
]
