"""safetensors <-> GGUF for llama models: names, q/k permutation, types, metadata.

    gguf_to_hf(gguf, folder)                      GGUF -> model.safetensors + config + tokenizer
    hf_to_gguf(folder, out, "Q4_K_M")             transformers folder -> GGUF of a type or recipe
    quantize_gguf(gguf, out, "Q8_0")              GGUF -> GGUF at another type or recipe
    convert(inp, out, to="gguf", spec="Q8_0")     what ``python -m qlib convert`` calls

Command line: ``python -m qlib convert --in PATH --out PATH --to safetensors|gguf
[--type TYPE|RECIPE]`` and ``python -m qlib quantize --in GGUF --out GGUF --type
TYPE|RECIPE`` (see docs/convert.md).
"""

from __future__ import annotations

from .cli import add_parser, convert
from .names import gguf_name, hf_name, permute, unpermute
from .recipes import FALLBACK, PLAIN_TYPES, RECIPES, TensorChoice, normalize_spec, plan
from .to_gguf import FROM_GGUF_KEYS, ConvertReport, hf_to_gguf, quantize_gguf, requantize_plan
from .to_hf import ExportReport, gguf_to_hf

__all__ = [
    "FALLBACK", "FROM_GGUF_KEYS", "PLAIN_TYPES", "RECIPES", "ConvertReport", "ExportReport",
    "TensorChoice", "add_parser", "convert", "gguf_name", "gguf_to_hf", "hf_name",
    "hf_to_gguf", "normalize_spec", "permute", "plan", "quantize_gguf", "requantize_plan",
    "unpermute",
]  # fmt: skip
