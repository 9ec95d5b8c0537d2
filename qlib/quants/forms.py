"""Kernel forms: types the kernels run as another type that holds exactly the same values.

* IQ4_NL, MXFP4 and Q1_0 as Q8_0 (``iquants.nl_as_q8_0``, ``fp4.as_q8_0``: their values are
  int8 codes under one f16 scale a 32 weights, and ggml's dot products of all three are
  Q8_0's): the CUDA engine and the C kernels' planes, which have no layout of their own for
  them (the fast CPU layers run IQ4_NL panels of their own). An MXFP4 tensor whose scales
  leave f16's range stays as it is;
* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 as Q6_K (``gridquants.as_q6_k``: a tensor
  whose every block fits, 6.56 bits a weight; else it stays as it is): the fast CUDA engine,
  whose Q6_K kernels are Triton code.

What stays a grid, ternary or FP4 type is expanded further down: into ``T_X8`` blocks by the
persistent CUDA kernel (the fused CUDA kernels run it as float32 weights). The C kernels take
every grid and ternary type as X4 blocks (``packing.pack``: 4-bit indices into the type's (at
most 16) codes, 5.1 bits a weight, fewer than Q6_K's), in both CPU engines, and NVFP4 (a
scale a 16 weights under Q8_0 activations: no C kernel has that) through the torch matmul
with ggml's semantics in the faithful engine, as bf16 weights (exact) in the fast one.
"""

from __future__ import annotations

import torch

from .fp4 import as_q8_0
from .gridquants import Q6_K_FORM, as_q6_k
from .iquants import nl_as_q8_0

Q8_0_FORM = ("IQ4_NL", "MXFP4", "Q1_0")
KERNEL_TYPE: dict[str, str] = {**dict.fromkeys(Q8_0_FORM, "Q8_0"),
                               **dict.fromkeys(Q6_K_FORM, "Q6_K")}  # fmt: skip


def kernel_form(q):
    """QTensor ``q``, or the same values in its ``KERNEL_TYPE`` where it has one and every
    block fits."""
    name = q.dtype.name
    if name not in KERNEL_TYPE:
        return q
    blocks = q.data.reshape(-1, q.dtype.type_size)
    if name == "IQ4_NL":
        return type(q)(nl_as_q8_0(blocks), q.shape, "Q8_0")
    if name in Q8_0_FORM:
        q8 = as_q8_0(blocks, name)
        return q if q8 is None else type(q)(q8.reshape(-1), q.shape, "Q8_0")
    q6 = as_q6_k(blocks, name)
    return q if q6 is None else type(q)(q6.reshape(-1), q.shape, "Q6_K")


def bf16_form(q):
    """QTensor ``q``'s values as a BF16 QTensor (exact for the FP4 types: at most 6
    significant bits)."""
    values = q.dequantize(dtype=torch.bfloat16).contiguous()
    return type(q)(values.view(torch.uint8).reshape(-1), q.shape, "BF16")
