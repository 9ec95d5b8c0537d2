"""Kernel forms: types the kernels run as another type that holds exactly the same values.

* IQ4_NL as Q8_0 (``iquants.nl_as_q8_0``: its levels are int8 codes under the same f16
  ``d``): the persistent CUDA kernel and the C kernels' planes, which have no IQ4_NL layout
  (the fast CPU layers run IQ4_NL panels of their own);
* MXFP4 as Q5_0 and Q1_0 as Q4_0 (``fp4.as_legacy``: their codes fit those types' under one
  f16 scale a 32 weights, and ggml's dot products of all four are alike): the persistent CUDA
  kernel, and the C kernels where a weight's rows do not come in 16s (else qlib's MXFP4H /
  Q1_0H panels, ``packing.pack``). An MXFP4 tensor whose scales leave f16's range stays as it
  is;
* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 as Q6_K (``gridquants.as_q6_k``: a tensor
  whose every block fits, 6.56 bits a weight; else it stays as it is): the persistent CUDA
  kernel (which expands Q6_K, as every K-quant, into its ``T_X8`` blocks).

The fused CUDA kernels take none of these forms (``kernel_form(keep=cuda.layout.NATIVE)``):
their planes hold every one of these types, NVFP4 and the IQ2 family as they are
(``cuda.layout``). What stays a grid, ternary or FP4 type is expanded into ``T_X8`` blocks by
the persistent kernel. The C kernels take every grid and ternary type as X4 blocks
(``packing.pack``: 4-bit indices into the type's (at most 16) codes, 5.1 bits a weight, fewer
than Q6_K's; X3, 3-bit indices, 3.9 bits, for those of at most 8), in both CPU engines; NVFP4
as qlib's NVFP4H panels (each scale an f16, ggml's Q8_0 activations) in both, and where rows do
not come in 16s as X4 blocks in the fast one (bf16 rows, ``bf16_form``, where a super-block's
scales lie too far apart) and the torch matmul with ggml's semantics in the faithful one (X4's
dot takes Q8_K activations: ``matmul.OTHER_DOT``).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from .api import dequantize_torch
from .fp4 import LEGACY_FORM, as_legacy
from .gridquants import Q6_K_FORM, as_q6_k
from .iquants import nl_as_q8_0

KERNEL_TYPE: dict[str, str] = {"IQ4_NL": "Q8_0", **LEGACY_FORM,
                               **dict.fromkeys(Q6_K_FORM, "Q6_K")}  # fmt: skip


def kernel_form(q, keep: Collection[str] = ()):
    """QTensor ``q``, or the same values in its ``KERNEL_TYPE`` where it has one and every
    block fits (types in ``keep``, which the caller's kernels run as they are, stay)."""
    name = q.dtype.name
    if name not in KERNEL_TYPE or name in keep:
        return q
    blocks = q.data.reshape(-1, q.dtype.type_size)
    if name == "IQ4_NL":
        return type(q)(nl_as_q8_0(blocks), q.shape, "Q8_0")
    if name in LEGACY_FORM:
        legacy = as_legacy(blocks, name)
        return q if legacy is None else type(q)(legacy.reshape(-1), q.shape, LEGACY_FORM[name])
    q6 = as_q6_k(blocks, name)
    return q if q6 is None else type(q)(q6.reshape(-1), q.shape, "Q6_K")


def bf16_form(q, chunk: int = 1 << 20):
    """2-D QTensor ``q``'s values as a BF16 QTensor (exact for the FP4 types: at most 6
    significant bits), about ``chunk`` weights at a time."""
    rows, k = int(q.shape[0]), int(q.shape[-1])
    blocks = q.data.reshape(rows, -1)
    out = torch.empty((rows, k), dtype=torch.bfloat16, device=blocks.device)
    step = max(1, chunk // k)
    for r in range(0, rows, step):
        part = blocks[r : r + step]
        out[r : r + step] = dequantize_torch(part, q.dtype.name, (part.shape[0], k), torch.bfloat16)
    return type(q)(out.view(torch.uint8).reshape(-1), q.shape, "BF16")
