"""AVX-512 VNNI kernels for the CPU quantized matmul (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights
repacked; Q2_K..Q6_K on their GGUF blocks).

``kernels.c`` (the quantized GEMM/GEMV of repacked Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 planes),
``kquants.c`` (the same for K-quant blocks as the file has them),
``attn.c`` (the decode attention step), ``decode.c`` (the decode step's GEMVs and
attention run in one C call, in one OpenMP region: ``DecodeChain``) and
``prefill.c`` (RmsNorm, SwiGLU, RoPE + KV write + causal attention between the
bf16 prefill matmuls; with AMX, an AMX GEMM and the whole prefill layer) and ``rows.c``
(rows of a weight dequantized: the embedding lookup), shipped as source, are compiled on
first use and loaded with ctypes. Semantics are ggml's (activations quantized to Q8_0 /
Q8_1 / Q8_K with x86 rounding, exact integer block dots, float32 scaling), so results equal
``qlib.quants.reference.matmul`` to float rounding.

Modules, each importing only those above it:

* ``build``: compiler flags, the cache directory, compiling and loading the library,
  ``available()`` / ``unavailable_reason()``;
* ``layout``: the weight layouts the kernels read (``PackedWeight``, ``AmxWeight``);
* ``ops``: the C signatures and one typed, checked wrapper per C entry point
  (``qgemm``, ``add_rmsnorm``, ``attn_prefill``, ...), the prepared calls of the
  decode step (``qgemm_plan``, ``attn_decode_plan``, ``RowLookup``) and their one-call
  chain (``DecodeChain``), ``amx_available()``;
* ``packing``: QTensors -> ``PackedWeight`` (``pack``, ``supports``), weights -> AMX tiles;
* ``memory``: ``reserve`` (memory taken as written: the KV cache), ``resident_bytes``, 2 MB
  pages for the weights (``hugepage_weights`` with ``weights_empty`` / ``weights_copy`` while
  they are packed, ``collapse_hugepages`` after a load), ``trim_heap`` (a load's freed
  temporaries given back);
* ``matmul``: the quantized matmul with ggml semantics in torch, using the C kernels
  when they take the weight (not imported here).

``available()`` is False (with ``unavailable_reason()``) when the CPU lacks
AVX-512 F/BW/VL/VNNI or F16C, no compiler works, or ``QLIB_NO_CKERNELS`` is
set; callers then fall back to ``qlib.quants.cpu.matmul``. ``amx_available()`` adds
AMX-BF16 (CPU, compiler, Linux's tile-state permission; ``QLIB_NO_AMX`` turns it
off) for the prefill kernels. This package re-exports the public names of its modules.
"""

from .build import available, cache_dir, unavailable_reason
from .layout import TYPE_CODES, AmxWeight, AmxWeightC, PackedWeight
from .memory import (
    collapse_hugepages,
    hugepage_weights,
    reserve,
    resident_bytes,
    trim_heap,
    weights_copy,
    weights_empty,
)
from .ops import (
    DECODE_MODES,
    PREFILL_PHASES,
    ROW_TYPES,
    AmxLayer,
    DecodeChain,
    DecodePosition,
    KernelCall,
    PrefillScratch,
    RowLookup,
    add_plan,
    add_rmsnorm,
    amx_available,
    amx_gemm,
    amx_unavailable_reason,
    attn_decode_plan,
    attn_prefill,
    dequant_rows,
    dequantize_bf16,
    exp,
    exp_diff,
    has_steps,
    load,
    moe_decode_plan,
    prefill_layers,
    prefill_phase_seconds,
    qgemm,
    qgemm_alloc_plan,
    qgemm_plan,
    swiglu,
    swiglu_bf16,
)
from .packing import (
    AMX_CODES,
    amx_code_bytes,
    amx_codes_plan,
    dequantize_rows,
    pack,
    pack_amx,
    pack_amx_bf16,
    pack_amx_codes,
    pack_amx_quantized,
    supports,
)

__all__ = [
    "available",
    "cache_dir",
    "unavailable_reason",
    "TYPE_CODES",
    "AmxWeight",
    "AmxWeightC",
    "PackedWeight",
    "collapse_hugepages",
    "trim_heap",
    "hugepage_weights",
    "reserve",
    "resident_bytes",
    "weights_copy",
    "weights_empty",
    "DECODE_MODES",
    "PREFILL_PHASES",
    "ROW_TYPES",
    "AmxLayer",
    "DecodeChain",
    "DecodePosition",
    "KernelCall",
    "PrefillScratch",
    "RowLookup",
    "add_plan",
    "add_rmsnorm",
    "amx_available",
    "amx_gemm",
    "amx_unavailable_reason",
    "attn_decode_plan",
    "attn_prefill",
    "dequant_rows",
    "dequantize_bf16",
    "dequantize_rows",
    "has_steps",
    "exp",
    "exp_diff",
    "load",
    "moe_decode_plan",
    "prefill_layers",
    "prefill_phase_seconds",
    "qgemm",
    "qgemm_alloc_plan",
    "qgemm_plan",
    "swiglu",
    "swiglu_bf16",
    "pack",
    "pack_amx",
    "pack_amx_bf16",
    "pack_amx_codes",
    "pack_amx_quantized",
    "AMX_CODES",
    "amx_code_bytes",
    "amx_codes_plan",
    "supports",
]
