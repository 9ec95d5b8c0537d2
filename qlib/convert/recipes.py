"""Which ggml type each tensor gets: plain types, llama.cpp-style mixed recipes, fallbacks.

A plain type (``Q8_0``, ``Q4_K``, ...) quantizes every matrix to that type, as
``llama-quantize --pure`` does; 1-D tensors (the RMSNorm weights) stay F32.
A recipe (``Q4_K_M``, ...) follows llama.cpp's ``llama_tensor_get_type`` for
that file type on a llama model: the output matrix (or ``token_embd`` when the
output is tied to it) gets Q6_K, some ``attn_v`` / ``ffn_down`` layers get more
bits. Afterwards, as in llama.cpp, a K-quant (256 values per block) that does
not divide a tensor's rows falls back to a 32-block type (``FALLBACK``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..quants.api import READ_ONLY
from ..quants.types import ggml_type
from .names import layer_index

FLOAT_TYPES = ("F32", "F16", "BF16")
PLAIN_TYPES = (*FLOAT_TYPES, "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
               "MXFP4", "NVFP4", "Q1_0")  # fmt: skip
RECIPES = ("Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M")

# llama.cpp's fallback (llama_tensor_get_type) for rows not divisible by 256
FALLBACK: dict[str, str] = {
    "Q2_K": "IQ4_NL", "Q3_K": "IQ4_NL", "IQ4_XS": "IQ4_NL", "Q4_K": "Q5_0", "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}  # fmt: skip

# general.file_type (llama.cpp's llama_ftype); a plain K type is recorded as its _S file type
FILE_TYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K": 11, "Q4_K": 14, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K": 16, "Q5_K_S": 16,
    "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30, "BF16": 32,
    "MXFP4": 38, "NVFP4": 39, "Q1_0": 40,  # (38: llama.cpp's MXFP4_MOE, its only MXFP4 type)
}  # fmt: skip


@dataclass(frozen=True)
class TensorChoice:
    """The type chosen for one tensor: ``wanted`` by the rule, ``type`` after any fallback."""

    name: str
    shape: tuple[int, ...]
    wanted: str
    type: str
    rule: str

    @property
    def fell_back(self) -> bool:
        return self.wanted != self.type


def normalize_spec(spec: str) -> str:
    """Upper-case a type or recipe name and check it (``q4_k_m`` -> ``Q4_K_M``)."""
    s = spec.strip().upper()
    if s in READ_ONLY:
        raise ValueError(
            f"qlib reads {s} but does not write it (llama.cpp's llama-quantize does, with an "
            f"importance matrix for most such types): types {', '.join(PLAIN_TYPES)}; "
            f"recipes {', '.join(RECIPES)}"
        )
    if s not in PLAIN_TYPES and s not in RECIPES:
        raise ValueError(
            f"unknown type or recipe {spec!r}: types {', '.join(PLAIN_TYPES)}; "
            f"recipes {', '.join(RECIPES)}"
        )
    return s


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of layers that get more bits: first and last eighth, every third."""
    eighth = n_layer // 8
    return i_layer < eighth or i_layer >= 7 * n_layer // 8 or (i_layer - eighth) % 3 == 2


def _recipe_type(name: str, recipe: str, n_layer: int, has_output: bool, row: int):
    """(type, rule) of a matrix under a recipe, before the fallback."""
    base = recipe[:4]  # "Q4_K" / "Q5_K"
    medium = recipe.endswith("_M")
    i = layer_index(name)
    if name == "output.weight" or (not has_output and name == "token_embd.weight"):
        if row % ggml_type(base).block_size:
            return "Q8_0", "output matrix: Q8_0 (rows not divisible by 256)"
        return "Q6_K", "output matrix: Q6_K"
    if name.endswith(".attn_v.weight") and i is not None:
        if medium and use_more_bits(i, n_layer):
            return "Q6_K", "attn_v: Q6_K on use_more_bits layers"
        if recipe == "Q4_K_S" and i < 4:
            return "Q5_K", "attn_v: Q5_K on the first 4 layers"
    if name.endswith(".ffn_down.weight") and i is not None:
        if medium and use_more_bits(i, n_layer):
            return "Q6_K", "ffn_down: Q6_K on use_more_bits layers"
        if recipe == "Q4_K_S" and i < n_layer // 8:
            return "Q5_K", "ffn_down: Q5_K on the first eighth"
    return base, f"default {base}"


def choose(
    name: str, shape: tuple[int, ...], spec: str, n_layer: int, has_output: bool
) -> TensorChoice:
    """The type of one tensor (torch-order ``shape``, rows along the last axis)."""
    spec = normalize_spec(spec)
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        return TensorChoice(name, shape, "F32", "F32", "1-D: kept F32")
    if name.endswith("ffn_gate_inp.weight"):  # as llama.cpp's quantize
        return TensorChoice(name, shape, "F32", "F32", "a mixture of experts' router: kept F32")
    if spec in RECIPES:
        wanted, rule = _recipe_type(name, spec, n_layer, has_output, shape[-1])
    else:
        wanted, rule = spec, f"plain {spec}"
    final = wanted
    if shape[-1] % ggml_type(wanted).block_size:
        final = FALLBACK.get(wanted, "F16")
        if shape[-1] % ggml_type(final).block_size:
            final = "F16"
        rule += f"; rows of {shape[-1]} not divisible by {ggml_type(wanted).block_size}: {final}"
    return TensorChoice(name, shape, wanted, final, rule)


def plan(shapes: Mapping[str, tuple[int, ...]], spec: str, n_layer: int) -> list[TensorChoice]:
    """``choose`` for every tensor of a llama model (llama.cpp names -> torch shapes)."""
    has_output = "output.weight" in shapes
    return [choose(n, s, spec, n_layer, has_output) for n, s in shapes.items()]


def file_type(spec: str) -> int:
    """``general.file_type`` value for a type or recipe."""
    return FILE_TYPES[normalize_spec(spec)]
