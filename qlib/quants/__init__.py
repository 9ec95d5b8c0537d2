"""GGUF block formats: layouts, quantize / dequantize, and quantized dot products."""

from .types import GGML_TYPES, GGML_TYPES_BY_ID, GGMLType, ggml_type

__all__ = ["GGML_TYPES", "GGML_TYPES_BY_ID", "GGMLType", "ggml_type"]
