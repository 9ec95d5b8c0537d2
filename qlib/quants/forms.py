"""Kernel forms: types the kernels run as another type that holds exactly the same values.

* IQ4_NL as Q8_0 (``iquants.nl_as_q8_0``: its levels are int8 codes under the same f16
  ``d``): the CUDA engine and the C kernels' planes, which have no IQ4_NL layout (the fast
  CPU layers run IQ4_NL panels of their own);
* IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, TQ1_0, TQ2_0 as Q6_K (``gridquants.as_q6_k``: a tensor
  whose every block fits, 6.56 bits a weight; else it stays as it is): the fast CUDA engine,
  whose Q6_K kernels are Triton code.

What stays a grid or ternary type is expanded further down: into ``T_X8`` blocks by the
persistent CUDA kernel (the fused CUDA kernels run it as float32 weights). The C kernels take
every grid and ternary type as X4 blocks (``packing.pack``: 4-bit indices into the type's (at
most 16) codes, 5.1 bits a weight, fewer than Q6_K's), in both CPU engines.
"""

from __future__ import annotations

from .gridquants import Q6_K_FORM, as_q6_k
from .iquants import nl_as_q8_0

KERNEL_TYPE: dict[str, str] = {"IQ4_NL": "Q8_0", **dict.fromkeys(Q6_K_FORM, "Q6_K")}


def kernel_form(q):
    """QTensor ``q``, or the same values in its ``KERNEL_TYPE`` where it has one and every
    block fits."""
    name = q.dtype.name
    if name not in KERNEL_TYPE:
        return q
    blocks = q.data.reshape(-1, q.dtype.type_size)
    if name == "IQ4_NL":
        return type(q)(nl_as_q8_0(blocks), q.shape, "Q8_0")
    q6 = as_q6_k(blocks, name)
    return q if q6 is None else type(q)(q6.reshape(-1), q.shape, "Q6_K")
