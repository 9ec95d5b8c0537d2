"""The fast CPU path: the same llama forward as ``quantized_llama``, built for speed.

``FastModel.from_gguf(content, f)`` has ``ModelWeights``' interface
(``forward(x, index_pos, all_logits=)``, ``clear_kv_cache``, ``kv_len``) but
none of candle's sharp edges. What differs from the faithful path:

* **decode GEMVs** (and every matmul of fewer than ``bf16_min_rows`` rows) run
  the AVX-512 VNNI kernels of ``qlib.quants.cpu`` on the packed 4/8-bit
  weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and on the GGUF blocks of the K-quants (Q2_K ..
  Q6_K, rows a multiple of 256): ggml
  semantics (Q8_0 / Q8_1 / Q8_K activations, exact integer block dots), so the logits
  equal the faithful ``quantized`` form's to float rounding. Other types (F32 / F16 /
  BF16, K-quant rows not a multiple of 256), and every type without the kernels (no
  compiler, no AVX-512), go through ``qlib.quants.cpu.matmul``, which does the same sums
  in torch;
* **fused weights**: q, k, v stacked into one matrix, gate and up into another
  (one activation quantization and one kernel call each). A stack of mixed types
  (Q4_K_M's Q6_K ``attn_v``, 32-block fallbacks) is split into runs of neighbours
  of one type (``LinearPart``), each its own C call or torch matmul into its slice
  of the same output buffer, inside the same prepared decode step; nothing is refused;
* **prefill** (``prefill="bf16"``, default): matmuls on bfloat16 weights and
  inputs. Where the CPU has AMX-BF16 (``cpu.amx_available()``) quantized weights (every
  legacy and K-quant type, mixed stacks too) stay 4/8-bit codes in AMX tile order, with
  float32 scales per 32 or 16 k, expanded to bf16 tiles inside the GEMM (F32 / F16 / BF16
  parts: a bf16 tile copy made at load; ``amx_packed=False``: a copy for all), and each
  prefill is one C call for all the layers (``cpu.prefill_layers``, in
  ``qlib/quants/cpu/prefill.c``), each layer: RmsNorm -> bf16, our AMX GEMM with fused
  epilogues (qkv -> bf16; wo and down added to the float32 residual; gate/up ->
  SwiGLU -> bf16), RoPE + KV-cache write + AMX attention (scores from hi/lo bf16
  splits, ~16 bits). Elsewhere (or ``amx=False``, ``QLIB_NO_AMX=1``) a bf16 copy
  made at load (any type or mix: one matrix per stack) is prepacked in oneDNN's
  blocked layout and oneDNN bf16 matmuls run with one C call between each pair
  (add + RmsNorm, RoPE + KV write + float32 attention, SwiGLU). The residual
  stream, the KV cache and all arithmetic outside the matmuls stay float32.
  ``prefill="int8"`` (the default without AMX) keeps ggml semantics for every
  row instead: the C GEMMs over all rows with C RmsNorm, SwiGLU and RoPE + KV write + a
  tiled float32 causal attention (key blocks of 64, online softmax) between them
  (``_prefill_int8``, float32 or f16 caches; a CPU without the kernels: torch ops and SDPA);
  no extra memory. ``prefill="int8-attn"`` is the same with the attention's two products
  in int8 too (queries, keys and values rounded to 8-bit codes per row, each block's
  softmax weights per query row; the softmax float32): 2x faster attention, 1.2x the int8
  prefill's mean logit drift from the f32 form (docs/performance.md, "int8 attention");
  opt-in, decode steps keep the float32 attention;
* **the decode step in one C call**: the prepared calls of a token (per layer qkv GEMV with
  RmsNorm, RoPE + KV write + attention, wo GEMV + residual, gate/up GEMV with RmsNorm, down
  GEMV with SwiGLU + residual; then the logits) are one ``cpu.DecodeChain``: one ctypes call
  a token, all steps inside ONE OpenMP parallel region with a barrier after each
  (``decode_mode="region"``, default; ``"c"``: each kernel's entry point called from C;
  ``"python"``: one ctypes call per step; ``$QLIB_DECODE_MODE`` sets the default). All three
  are bit-identical. A layer with a torch part (a type without a kernel) keeps the Python
  loop for the whole step; torch logits (an F16 output) follow the chain;
* **huge pages**: the packed weights are written on 2 MB pages from the start
  (``cpu.hugepage_weights``); after load, what else is large and resident is moved onto
  them (``cpu.collapse_hugepages``: weights made elsewhere, oneDNN's prepacked bf16 copies,
  and the interpreter's own heap, 0.05-0.33 s of a SmolLM2 load); ``hugepages=False``
  skips both;
* **KV cache**: one ``[layers, 2, n_kv, capacity, d]`` buffer, float32 or
  (``kv_type="f16"``) IEEE half, no cat, for up to ``max_seq_len`` positions (the file's
  ``llama.context_length`` by default: 8192 for SmolLM2; the faithful engine keeps
  candle's 4096). It holds ``kv_first`` positions at first and, when a forward needs more
  (its positions and the next one, so that a prompt never leaves the copy to the first decode
  step), is made again with 1.5 times as many (or 1.25 times what the forward needs, up to
  ``max_seq_len``), the positions held copied over and the decode step prepared again
  (``_grow_cache``): so a short conversation costs its positions, not the maximum
  (``kv_bytes()``: at most 1.5 times the positions used, past the first 256), and the
  buffer can be on 2 MB pages (``kv_hugepages``, by default as ``hugepages``: the decode
  attention's streams then take a TLB entry per 2 MB instead of per 4 KB; a SmolLM2
  decode step 6-13% faster at 2,800-4,000 positions, docs/performance.md);
* **attention**: GQA without ``repeat_kv`` copies (decode in C, ``attn.c``: each KV
  head's positions cut into pieces read once for all its query heads, the pieces spread
  over the threads and combined as in flash-decoding); for prefill in C as above, or,
  without the C kernels, ``scaled_dot_product_attention(enable_gqa=True)`` with a causal
  mask); a head_dim over 128 or not a multiple of 16 (the C attention's limits) leaves the
  C attention out: the decode step runs as a Python loop with the torch attention, the
  prefill without the one-call C layers (tests/test_shapes.py: head_dim 32 to 256);
  RoPE as one complex multiplication; ``F.rms_norm``; in-place residual adds; a ``model``
  span only.

``index_pos`` must equal the cache length or be 0 (starts over): anything else
raises ``IndexPosError``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import BinaryIO

import torch
import torch.nn.functional as F

from .. import progress
from ..devices import DeviceLike, as_device
from ..gguf import release_pages
from ..quants import cpu
from ..quants.api import dequantize_torch
from ..quants.cpu import build
from ..quants.cpu.matmul import PreparedWeight, prepare, qmatmul_prepared
from ..quants.cpu.memory import reserve, resident_bytes
from ..quants.qtensor import QTensor
from ..spans import span
from . import moe
from .checks import (
    DEFAULT_KV_TYPE,
    KV_TYPES,
    StaticKVState,
    check_kv_type,
    check_max_seq_len,
    check_positions,
    check_token_ids,
    context_length,
)
from .config import MAX_SEQ_LEN, LlamaConfig, check_tensors, rope_tables
from .errors import ModelError
from .faithful import rope_neox
from .fused import FUSED_STACKS, Biased, layer_biases

PREFILL_MODES = ("bf16", "int8", "int8-attn")
# The CPU feature that makes the bf16 prefill the faster default: AMX tiles. With AVX512-BF16
# alone (AMD Zen 4) oneDNN's bf16 matmuls were slower than the int8 C GEMMs and held a bf16
# copy of the weights (docs/performance.md, "A Zen 4 VM").
BF16_FLAGS = ("amx_bf16",)
# How the C decode step runs its prepared calls (``FastModel.decode_mode``; the default from
# ``$QLIB_DECODE_MODE``): "region" ONE C call, one OpenMP parallel region for all steps;
# "c" one C call that calls each kernel's entry point; "python" one ctypes call per step
DECODE_MODES = ("region", "c", "python")
DEFAULT_DECODE_MODE = "region"


# The most the bf16 prefill's own weight copy may take for it to be the default: a small
# model's copy is cheap (SmolLM2: 76-212 MiB), a 1B model's would double its memory
# (1B-shape Q8_0: 1.1 GB beside the 1.1 GB file); past it the int8 prefill (no copy) is the
# default. ``prefill="bf16"`` still builds any copy.
PREFILL_COPY_MAX_BYTES = 512 << 20


def prefill_copy_bytes(content, amx: bool) -> int:
    """The bytes the bf16 prefill's weight copy of a file's layers takes: with ``amx``, AMX
    tiles of 4/8-bit codes for a stack of quantized types, mixed too (``cpu.amx_code_bytes``),
    else bf16 values (2 bytes a weight; the AMX tiles or oneDNN's prepacked copy)."""
    infos, total = content.tensor_infos, 0.0
    for i in range(LlamaConfig.from_metadata(content.metadata).block_count):
        for names in FUSED_STACKS.values():
            stack = [infos[f"blk.{i}.{n}.weight"] for n in names if f"blk.{i}.{n}.weight" in infos]
            codes = cpu.amx_code_bytes([t.dtype.name for t in stack]) if amx else None
            total += (codes or 2.0) * sum(t.n_elements for t in stack)
    return int(total)


def default_prefill(copy_bytes: int | None = None) -> str:
    """``bf16`` where the CPU has AMX-BF16 tiles (``BF16_FLAGS``) and the weight copy that
    prefill needs (``copy_bytes``, when known) is at most ``PREFILL_COPY_MAX_BYTES``; else
    ``int8`` (ggml semantics, no copy).

    Without AMX oneDNN's bf16 matmuls lose to the int8 C GEMMs: emulated bf16 on a CPU without
    AVX512-BF16, and on AVX512-BF16 alone too (measured: docs/performance.md, "Prefill
    without bf16 hardware" and "A Zen 4 VM")."""
    if copy_bytes is not None and copy_bytes > PREFILL_COPY_MAX_BYTES:
        return "int8"
    return "bf16" if build.cpu_flags() & set(BF16_FLAGS) else "int8"


PREPACK_BATCH = 256  # oneDNN's row-count hint for the prepacked bf16 weights


def _amx_layer_shapes_ok(c: LlamaConfig, n_ff: int) -> bool:
    """Whether ``cpu.prefill_layers`` takes this model: widths % 32, rope over the whole head."""
    widths = (c.embedding_length, c.q_dim, n_ff,
              (c.head_count + 2 * c.head_count_kv) * c.head_dim, c.head_dim)  # fmt: skip
    return all(w % 32 == 0 for w in widths) and c.head_dim <= 128 and c.rope_dim == c.head_dim


def _stack(qtensors: list[QTensor]) -> QTensor:
    """Several 2-D QTensors of one type and row length, stacked by rows."""
    if len(qtensors) == 1:
        return qtensors[0]
    data = torch.cat([q.data.reshape(-1) for q in qtensors])
    rows = sum(q.shape[0] for q in qtensors)
    return QTensor(data, (rows, qtensors[0].shape[-1]), qtensors[0].dtype)


def _runs(qtensors: list[QTensor]) -> list[list[QTensor]]:
    """The projections of a stack in runs of neighbours that share a type (q, k Q4_K and
    v Q6_K: two runs); each run is one weight, rows after rows."""
    runs: list[list[QTensor]] = []
    for q in qtensors:
        if runs and runs[-1][0].dtype.name == q.dtype.name:
            runs[-1].append(q)
        else:
            runs.append([q])
    return runs


Release = Callable[[torch.Tensor], object]  # drops a mapped file's pages under a view of it


def _owned(q: QTensor) -> torch.Tensor:
    """A small tensor's float32 values in memory of their own. An F32 tensor dequantizes to a
    view of its blocks, here of the mapped file: each touch of it would map the file's page
    cache around it (large folios: up to 2 MB for an 8 KB norm)."""
    return q.dequantize().clone()


class LinearPart:
    """Rows ``r0 .. r0 + n`` of a (stacked) weight, all of one GGUF type: the C kernels'
    weight (``packed``: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 planes, or with ``panels`` Q4_0 /
    Q4_1 / Q8_0 as 16-row panels where the rows allow; the GGUF blocks of K-quants) or, for
    the types and shapes the kernels lack, the torch matmul with ggml semantics
    (``prepared``: int8 codes and float32 scales; the dequantized float32 weight for F32 /
    F16 / BF16)."""

    def __init__(self, qtensors: list[QTensor], r0: int, release: Release | None = None,
                 panels: bool = False):  # fmt: skip
        self.type_name = qtensors[0].dtype.name
        self.r0 = r0
        self.n = sum(q.shape[0] for q in qtensors)
        self.packed: cpu.PackedWeight | None = None
        self.prepared: PreparedWeight | None = None
        if cpu.supports(self.type_name, qtensors[0].shape[-1]):
            self.packed = cpu.pack(qtensors, release=release, panels=panels)
        else:
            self.prepared = prepare(_stack(qtensors))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """ggml semantics: ``x`` ``[m, k]`` float32 -> ``[m, n]`` float32."""
        if self.packed is not None:
            return cpu.qgemm(x, self.packed)
        return qmatmul_prepared(x.float(), self.prepared)

    def dequantize_bf16(self, qtensors: list[QTensor]) -> torch.Tensor:
        """The weight's values rounded to bf16 (``qtensors``: the ones it was made from)."""
        if self.packed is not None and not self.packed.blocks and not self.packed.panels:
            return cpu.dequantize_bf16(self.packed)
        return torch.cat([q.dequantize(dtype=torch.bfloat16) for q in qtensors])

    def nbytes(self) -> int:
        return self.packed.nbytes() if self.packed is not None else self.prepared.nbytes()


def _prepack_bf16(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a bf16 weight (``mkldnn._reorder_linear_weight``), or None.

    ``F.linear`` reorders a plain bf16 weight into this layout on every call; the
    prepacked one is what inductor's CPU freezing uses (``mkldnn._linear_pointwise``).
    """
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PREPACK_BATCH)
        probe = torch.ops.mkldnn._linear_pointwise(w[:2], packed, None, "none", [], "")
        if probe.shape != (2, w.shape[0]) or probe.dtype != torch.bfloat16:
            return None
        return packed
    except (AttributeError, RuntimeError):
        return None


class FastLinear:
    """``y = x @ W.T`` for one (possibly stacked) weight: C kernel, fallback, bf16 copy.

    The projections of a stack (q, k, v; gate, up) are fused where they share a type: each
    run of neighbours of one type is one ``LinearPart`` (rows ``r0 .. r0 + n`` of the output),
    run one after the other into slices of one output. Uniform stacks are one part (``packed``
    or ``prepared`` is then that part's; both None for a mixed stack). The bf16 prefill copy
    (and the AMX tiles) is always one matrix: a mix of types is dequantized to bf16 values.
    ``panels``: Q4_0 / Q4_1 / Q8_0 / Q4_K parts as 16-row panels (``cpu.pack``); where the CPU
    has AMX, the AMX codes are then read from the GGUF blocks (``cpu.pack_amx_codes``), and
    types without such codes (Q1_0, the grid types, ...) keep planes to make theirs from.
    """

    def __init__(self, qtensors: list[QTensor], bf16: bool, amx: bool = False,
                 interleave: bool = False, amx_packed: bool = True,
                 release: Release | None = None, panels: bool = False):  # fmt: skip
        if len({q.shape[-1] for q in qtensors}) != 1:
            rows = ", ".join(str(q.shape[-1]) for q in qtensors)
            raise ModelError(f"stacked projections read one input: rows of {rows} elements")
        self.out_features = sum(q.shape[0] for q in qtensors)
        self.in_features = qtensors[0].shape[-1]
        runs = _runs(qtensors)
        codes = bf16 and amx and amx_packed  # AMX tiles of 4/8-bit codes
        # the codes read from the GGUF blocks where the types have such codes, so that the
        # decode keeps its panels; else (Q1_0, ...) made from the planes, without panels
        block_codes = codes and cpu.amx_codes_plan(q.dtype.name for q in qtensors) is not None
        panels = panels and (block_codes or not codes)
        self.parts: list[LinearPart] = []
        for run in runs:
            r0 = self.parts[-1].r0 + self.parts[-1].n if self.parts else 0
            # blocks released as packed
            self.parts.append(LinearPart(run, r0, release, panels=panels))
        one = self.parts[0] if len(self.parts) == 1 else None
        self.packed: cpu.PackedWeight | None = one.packed if one is not None else None
        self.prepared: PreparedWeight | None = one.prepared if one is not None else None
        # the weight for prefill: for the AMX layer kernel the packed 4/8-bit codes in tile
        # order (expanded to bf16 inside the GEMM) or bf16 tiles; else a bf16 copy,
        # oneDNN-prepacked when possible (``bf16_prepacked``; then no plain copy)
        self.bf16: torch.Tensor | None = None
        self.bf16_prepacked = False
        self.amx: cpu.AmxWeight | None = None
        if codes and self.packed is not None and not (self.packed.blocks or self.packed.panels):
            self.amx = cpu.pack_amx_quantized(self.packed, interleave)  # from the planes
        elif block_codes:  # K-quants, mixes, panels
            self.amx = cpu.pack_amx_codes(qtensors, interleave, release)
        elif bf16:
            w = torch.cat([p.dequantize_bf16(run) for p, run in zip(self.parts, runs, strict=True)])
            if amx:
                self.amx = cpu.pack_amx_bf16(w, interleave)
            else:
                prepacked = _prepack_bf16(w)
                self.bf16_prepacked = prepacked is not None
                self.bf16 = prepacked if prepacked is not None else cpu.weights_copy(w)

    @property
    def has_bf16(self) -> bool:
        return self.bf16 is not None

    @property
    def types(self) -> list[str]:
        """The GGUF type of each part, in row order."""
        return [p.type_name for p in self.parts]

    def quantized(self, x: torch.Tensor) -> torch.Tensor:
        """ggml semantics for every row (``x``: ``[m, k]`` float32)."""
        if self.packed is not None:
            return cpu.qgemm(x, self.packed)
        if self.prepared is not None:
            return qmatmul_prepared(x.float(), self.prepared)
        return torch.cat([p.matmul(x) for p in self.parts], dim=1)

    def quantized_into(self, x: torch.Tensor, out: torch.Tensor,
                       accumulate: bool = False) -> torch.Tensor:  # fmt: skip
        """``out (+)= x @ W.T`` with ggml semantics (``quantized``), written into ``out``
        (``[m, n]`` float32, contiguous; returned): one C call for a single C part, no new
        tensor."""
        if self.packed is not None:
            cpu.qgemm(x, self.packed, out, accumulate=accumulate)
        elif accumulate:
            out.add_(self.quantized(x))
        else:
            out.copy_(self.quantized(x))
        return out

    def plan(self, x: torch.Tensor, out: torch.Tensor, *, norm: torch.Tensor | None = None,
             eps: float = 0.0, swiglu: bool = False,
             accumulate: bool = False) -> cpu.KernelCall:  # fmt: skip
        """One decode GEMV as a prepared call: ``out (+)= f(x) @ W.T`` for one row ``x``, with
        ``f`` as in ``cpu.qgemm_plan`` (RmsNorm with ``norm``, or SwiGLU of ``[gate | up]``).

        A single C part is ``cpu.qgemm_plan`` itself. Otherwise each C part is its own
        prepared kernel call into its slice of ``out`` (the norm or SwiGLU done inside it),
        and the torch parts share one ``f(x)`` computed in torch per call.
        """
        if self.packed is not None:
            return cpu.qgemm_plan(self.packed, x, out, norm=norm, eps=eps, swiglu=swiglu,
                                  accumulate=accumulate)  # fmt: skip
        k, flat = self.in_features, out.view(-1)
        flags = dict(norm=norm, eps=eps, swiglu=swiglu, accumulate=accumulate)
        calls = [cpu.qgemm_plan(p.packed, x, flat[p.r0 : p.r0 + p.n], **flags)
                 for p in self.parts if p.packed is not None]  # fmt: skip
        torch_parts = [p for p in self.parts if p.packed is None]

        def run() -> int:
            for call in calls:
                if call():
                    return 1
            if torch_parts:
                v = x.view(1, -1)
                if norm is not None:
                    v = F.rms_norm(v, (k,), norm, eps)
                elif swiglu:
                    v = F.silu(v[:, :k]) * v[:, k:]
                for p in torch_parts:
                    y, dst = qmatmul_prepared(v, p.prepared).view(-1), flat[p.r0 : p.r0 + p.n]
                    if accumulate:
                        dst.add_(y)
                    else:
                        dst.copy_(y)
            return 0

        run.keep = (x, out, norm, calls)
        # C parts only: their steps run in a cpu.DecodeChain (torch parts: this Python call)
        c_only = not torch_parts and all(cpu.has_steps(c) for c in calls)
        run.steps = tuple(s for c in calls for s in c.steps) if c_only else None
        return run

    def linear_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in bf16 (``x``: ``[m, k]`` bfloat16 -> ``[m, n]`` bfloat16)."""
        if self.bf16_prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, self.bf16, None, "none", [], "")
        return F.linear(x, self.bf16)

    def bf16_io(self, x: torch.Tensor, bf16_min_rows: int) -> torch.Tensor:
        """bf16 in, bf16 out: the bf16 matmul, or for few rows the packed kernel (fewer bytes)."""
        if x.shape[0] < bf16_min_rows and self.packed is not None:
            return cpu.qgemm(x.float(), self.packed).to(torch.bfloat16)
        return self.linear_bf16(x)

    def forward(self, x: torch.Tensor, bf16_min_rows: int) -> torch.Tensor:
        if self.has_bf16 and x.shape[0] >= bf16_min_rows:
            return self.linear_bf16(x.to(torch.bfloat16)).float()
        return self.quantized(x)

    def nbytes(self) -> int:
        n = sum(p.nbytes() for p in self.parts)
        n += self.bf16.numel() * 2 if self.bf16 is not None else 0
        return n + (self.amx.nbytes() if self.amx is not None else 0)


Bias = torch.Tensor | None  # a projection's bias, where the file has one


def _swiglu(w13: FastLinear, w2: FastLinear, rows: int, a: torch.Tensor, b13: Bias = None,
            b2: Bias = None) -> torch.Tensor:  # fmt: skip
    """The SwiGLU MLP: ``down(silu(a gate) * (a up))``, gate | up one fused weight (the
    gate/up output, t x 2 n_ff floats, is freed on return), plus the file's biases if any
    (``b13`` on gate | up, ``b2`` on down)."""
    gu = w13.forward(a, rows)
    if b13 is not None:
        gu += b13
    n_ff = gu.shape[1] // 2
    y = w2.forward(F.silu(gu[:, :n_ff], inplace=True).mul_(gu[:, n_ff:]), rows)
    return y if b2 is None else y.add_(b2)


def _experts(ly: FastLayer, a: torch.Tensor, rows: int, n_used: int) -> torch.Tensor:
    """A mixture of experts' FFN of the normed rows ``a``: each row's ``n_used`` experts
    (``moe.route`` of the router's output) and their weighted sum (``moe.combine``)."""
    runs = [functools.partial(_swiglu, w13, w2, rows) for w13, w2 in ly.experts]
    return moe.ffn(a, functools.partial(ly.router.forward, bf16_min_rows=rows), runs, n_used)


class FastLayer(Biased):
    """One block's fused weights: wqkv, wo, and w13 (gate | up) and w2 (down), or for a
    mixture of experts (``n_expert`` > 1) the router and each expert's (w13, w2)
    (``moe.expert_matrices``; ``tensor_names``: the file's)."""

    wqkv: FastLinear
    wo: FastLinear
    w13: FastLinear | None
    w2: FastLinear | None

    def __init__(self, get, p: str, eps: float, bf16: bool, amx: bool = False,
                 amx_packed: bool = True, release: Release | None = None,
                 panels: bool = True, n_expert: int = 0, tensor_names=()):  # fmt: skip
        def linear(qtensors: list[QTensor], interleave: bool = False) -> FastLinear:
            return FastLinear(qtensors, bf16, amx, interleave=interleave, amx_packed=amx_packed,
                              release=release, panels=panels)  # fmt: skip

        self.router: FastLinear | None = None
        self.experts: list[tuple[FastLinear, FastLinear]] | None = None
        for attr, names in FUSED_STACKS.items():  # wqkv, wo, w13, w2
            if n_expert > 1 and attr in ("w13", "w2"):
                setattr(self, attr, None)
                continue
            setattr(self, attr, linear([get(f"{p}.{n}.weight") for n in names], attr == "w13"))
        if n_expert > 1:
            self.router = linear([get(f"{p}.ffn_gate_inp.weight")])
            mats = moe.expert_matrices(get, p, n_expert, tensor_names)
            self.experts = [(linear([g, u], True), linear([d])) for g, u, d in mats]
        self.attn_norm = _owned(get(f"{p}.attn_norm.weight"))
        self.ffn_norm = _owned(get(f"{p}.ffn_norm.weight"))
        # the file's optional projection biases, by stacked projection (llama.cpp adds them)
        dense = [attr for attr in FUSED_STACKS if getattr(self, attr) is not None]
        self.biases = layer_biases(tensor_names, lambda n: _owned(get(n)),
                                   lambda n: get(n).shape[0], p, dense)  # fmt: skip

    def bias_plan(self, attr: str, y: torch.Tensor) -> tuple[cpu.KernelCall, ...]:
        """``add_bias`` of one decode row ``y`` as a prepared C call (none without a bias)."""
        b = self.biases.get(attr)
        return () if b is None else (cpu.add_plan(b, y.view(-1)),)

    def linears(self) -> list[FastLinear]:
        """Every weight of the block."""
        ffn = [self.w13, self.w2] if self.experts is None else \
            [self.router, *(w for pair in self.experts for w in pair)]  # fmt: skip
        return [self.wqkv, self.wo, *ffn]


class FastModel(StaticKVState):
    """A llama GGUF on CPU with fused packed weights, a static KV cache and fast kernels."""

    # rows of a prompt whose FFN the int8 prefill runs at a time (its gate/up output stays in
    # the cache instead of going to memory and back): docs/performance.md, "The FFN by row
    # chunks"
    mlp_rows = 512
    # positions the KV cache holds at first (``_grow_cache`` makes it 1.5x larger as needed)
    kv_first = 256

    def __init__(
        self,
        config: LlamaConfig,
        tok_embd: QTensor,
        layers: list[FastLayer],
        norm: torch.Tensor,
        output: FastLinear,
        *,
        prefill: str = "bf16",
        bf16_min_rows: int = 16,
        max_seq_len: int = MAX_SEQ_LEN,
        hugepages: bool = True,
        kv_hugepages: bool | None = None,
        amx: bool = True,
        kv_type: str = DEFAULT_KV_TYPE,
        rope_freqs: torch.Tensor | None = None,
        embed_rows: cpu.PackedWeight | None = None,
        embed_release: Release | None = None,
    ):
        self.config = config
        self.device = torch.device("cpu")
        self.tok_embd = tok_embd
        self.vocab_size = tok_embd.shape[0]
        # where ``embed`` reads rows: ``embed_rows`` (a packed weight of the same values,
        # the tied output's) or ``tok_embd``'s blocks, then ``embed_release(tok_embd.data)``
        self._embed_rows = embed_rows
        self._embed_release = embed_release
        self.layers = layers
        # a mixture of experts: the decode step routes each layer in C (``_moe_plan``), the
        # prefill runs the torch path (``moe.ffn``)
        self.moe = bool(layers) and layers[0].experts is not None
        self.norm = norm
        self.output = output
        self.prefill = prefill
        # AMX: the layers hold AMX tiles (built by from_gguf) and prefill runs one C call for
        # all the layers; else the oneDNN matmuls, with AMX attention when ``amx`` and the
        # CPU has it
        self.amx = amx
        self.amx_layers = bool(layers) and layers[0].wqkv.amx is not None
        # per layer, the AMX weights of wqkv, wo, w13, w2 with their C descriptors
        self._amx = [
            cpu.AmxLayer(ly.wqkv.amx, ly.wo.amx, ly.w13.amx, ly.w2.amx) for ly in layers
        ] if self.amx_layers else []  # fmt: skip
        self._amx_norms = [w for ly in layers for w in (ly.attn_norm, ly.ffn_norm)]
        self.bf16_min_rows = bf16_min_rows if prefill == "bf16" else 1 << 62
        self.max_seq_len = check_max_seq_len(max_seq_len)
        self.kv_type = check_kv_type(kv_type)
        self._kv_hugepages = hugepages if kv_hugepages is None else kv_hugepages
        self.cache = self._new_cache(min(self.kv_first, self.max_seq_len))
        self._rope_freqs = rope_freqs  # the file's RoPE scaling, applied as llama.cpp does
        self._rope_tables(max(MAX_SEQ_LEN, self.cache.shape[3]))
        self._kv_len = 0
        self._plan = self._decode_plan()
        self._chains: dict[str, cpu.DecodeChain] = {}
        self.decode_mode = os.environ.get("QLIB_DECODE_MODE") or DEFAULT_DECODE_MODE
        self._fused_prefill = self._fused_prefill_ok()
        self._c_int8_prefill = self._int8_prefill_ok()
        if hugepages:  # the rest onto 2 MB pages too (from_gguf packs the weights onto them)
            cpu.collapse_hugepages()

    def _rope_tables(self, positions: int) -> None:
        """The RoPE tables (``cos``, ``sin``, ``rot``) for ``positions`` positions: built for
        candle's 4096 at first and again as the KV cache grows past them (``_grow_cache``), so
        a file's long context costs nothing until it is used (the same values at every
        length: each angle is one product)."""
        self.cos, self.sin = rope_tables(self.config, self.device, positions, self._rope_freqs)
        self.rot = torch.complex(self.cos, self.sin)  # (positions, d/2) for rope_i

    def _new_cache(self, positions: int) -> torch.Tensor:
        """A KV cache buffer for ``positions`` positions: reserved address space, never
        zeroed (only positions < kv_len are read; a page takes memory when first written)."""
        c = self.config
        return reserve((c.block_count, 2, c.head_count_kv, positions, c.head_dim),
                       KV_TYPES[self.kv_type], hugepages=self._kv_hugepages)  # fmt: skip

    def _grow_cache(self, end: int, keep: int) -> None:
        """Make the KV cache hold positions up to ``end`` (<= ``max_seq_len``) and the next one
        (so that a prompt filling the cache to its last position does not leave the copy to
        the first decode step: ~28 ms for SmolLM2 at 256 positions): a new buffer of 1.5
        times the positions, or 1.25 times that (a long prompt: room for the replies after it
        without another copy), in steps of 256; the first ``keep`` positions copied into it,
        the decode step prepared again on it (its kernels hold the old buffer's pointers)."""
        held, end = self.cache.shape[3], min(end + 1, self.max_seq_len)
        if end <= held:
            return
        grown = -(-max(held * 3 // 2, end + end // 4) // 256) * 256
        new = self._new_cache(min(self.max_seq_len, grown))
        new[:, :, :, :keep].copy_(self.cache[:, :, :, :keep])
        self.cache = new
        if self.cos.shape[0] < new.shape[3]:
            self._rope_tables(new.shape[3])
        self._chains = {}
        self._plan = self._decode_plan()
        self.decode_mode = self._decode_mode

    def _decode_plan(self) -> list[tuple[cpu.KernelCall, ...]] | None:
        """The fused C decode step, prepared once: per layer 5 calls (qkv GEMV of the RmsNorm
        of ``h``; RoPE + KV write + attention; ``h +=`` wo GEMV; gate/up GEMV of the RmsNorm of
        ``h``; ``h +=`` down GEMV of the SwiGLU; each followed by ``+= bias`` where the file
        has one), or None (torch decode). A GEMV whose weight
        is not one C part (a mix of types, a type without a kernel) is ``FastLinear.plan``'s
        call: its C parts as kernel calls into slices of the same buffer, the rest in torch."""
        c = self.config
        if not cpu.available() or c.head_dim % 16 or c.head_dim > 128 or c.rope_dim != c.head_dim:
            return None
        n_ff = self.layers[0].w13.out_features // 2 if self.layers and not self.moe else 0
        h = self._h = torch.empty(1, c.embedding_length)
        qkv = self._qkv = torch.empty(self.layers[0].wqkv.out_features if self.layers else 0)
        att = self._att = torch.empty(c.q_dim)
        gu = self._gu = torch.empty(2 * n_ff)
        self._pos = cpu.DecodePosition(self.cos, self.sin)  # set per token: _decode_c
        self._embed_row = self._embed_row_plan(h)
        self._greedy_logits: torch.Tensor | None = None  # greedy_step's logits, made once
        eps = c.rms_norm_eps
        heads = dict(n_head=c.head_count, n_kv=c.head_count_kv, neox=c.rope_is_neox)
        plan = []
        for i, ly in enumerate(self.layers):
            kc, vc = self.cache[i, 0], self.cache[i, 1]
            attention = (
                ly.wqkv.plan(h, qkv, norm=ly.attn_norm, eps=eps), *ly.bias_plan("wqkv", qkv),
                cpu.attn_decode_plan(qkv, kc, vc, self._pos, att, **heads),
                ly.wo.plan(att, h, accumulate=True), *ly.bias_plan("wo", h),
            )  # fmt: skip
            if ly.experts is not None:  # the router's GEMV, the routing, the chosen experts
                plan.append((*attention, self._moe_plan(ly)))
                continue
            plan.append((*attention, ly.w13.plan(h, gu, norm=ly.ffn_norm, eps=eps),
                         *ly.bias_plan("w13", gu), ly.w2.plan(gu, h, swiglu=True, accumulate=True),
                         *ly.bias_plan("w2", h)))  # fmt: skip
        if self.output.packed is not None:
            self._logits_plan = cpu.qgemm_alloc_plan(self.output.packed, h, norm=self.norm, eps=eps)
        else:  # an output type without a kernel: the torch matmul with ggml semantics

            def logits() -> torch.Tensor:
                return self.output.quantized(F.rms_norm(h, (c.embedding_length,), self.norm, eps))

            self._logits_plan = logits
        return plan

    @property
    def decode_mode(self) -> str:
        """How the C decode step runs (``DECODE_MODES``): "region" (the default) and "c" run
        all layers' prepared calls and the logits in one C call (``cpu.DecodeChain``); when
        a part of the step is torch (a type without a kernel), or with "python", each call
        is its own ctypes call from Python. All are bit-identical."""
        return self._decode_mode

    @decode_mode.setter
    def decode_mode(self, mode: str) -> None:
        if mode not in DECODE_MODES:
            raise ModelError(f"decode_mode {mode!r}: one of {', '.join(DECODE_MODES)}")
        self._decode_mode = mode
        if mode != "python" and mode not in self._chains and self._chainable():
            calls = [call for layer in self._plan for call in layer]
            logits = self._logits_plan if cpu.has_steps(self._logits_plan) else None
            self._chains[mode] = cpu.DecodeChain(calls, mode, output=logits)

    def _chainable(self) -> bool:
        """Whether the layers of the decode step have C steps only (the logits may be torch:
        then they follow the chain)."""
        if self._plan is None:
            return False
        return all(cpu.has_steps(call) for layer in self._plan for call in layer)

    @property
    def decode_chained(self) -> bool:
        """Whether the decode step runs as one C call (``decode_mode``)."""
        return self._plan is not None and self._decode_mode in self._chains

    def _fused_prefill_ok(self) -> bool:
        """Whether bf16 prefill can run in the C kernels of ``prefill.c``: one call per layer
        (AMX tiles built at load), or oneDNN matmuls with C calls between them."""
        c = self.config
        if self.prefill != "bf16" or not cpu.available() or not self.layers or self.moe:
            return False
        if any(ly.biases for ly in self.layers):  # (no bias epilogues there: int8 or torch)
            return False
        if self.amx_layers:  # the layer kernel writes float32 caches
            # from_gguf checked the shapes (_amx_layer_shapes_ok)
            return self.cache.dtype == torch.float32
        if c.head_dim % 16 or c.head_dim > 128 or c.rope_dim != c.head_dim:
            return False
        if c.embedding_length % 16 or (self.layers[0].w13.out_features // 2) % 16:
            return False
        lins = [w for ly in self.layers for w in (ly.wqkv, ly.wo, ly.w13, ly.w2)]
        return all(w.has_bf16 for w in lins)

    def _logits(self, h: torch.Tensor, r0: int, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of rows ``r0..`` of the residual stream ``h`` (plus ``delta``, bf16, the last
        matmul's output when not yet added): final RmsNorm, then the output layer."""
        c = self.config
        hn = torch.empty(h.shape[0] - r0, c.embedding_length)
        cpu.add_rmsnorm(h[r0:], delta, self.norm, c.rms_norm_eps, hn)
        return self.output.quantized(hn)

    def _prefill_fused(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """Prefill of ``t`` tokens: bf16 oneDNN matmuls, 3 C calls per layer between them.

        The residual stream ``h`` stays float32; matmul inputs and outputs are bf16:
        add + RmsNorm -> qkv matmul -> RoPE, KV write, attention -> wo matmul ->
        add + RmsNorm -> gate/up matmul -> SwiGLU -> down matmul (its add is fused
        into the next RmsNorm). Unless ``all_logits``, the last layer computes
        attention, wo and the FFN for the last row only (wo and the FFN then in the
        packed GEMV kernel, which reads a quarter of the bf16 bytes).
        """
        c, rows = self.config, self.bf16_min_rows
        t, k = ids.numel(), c.embedding_length
        n_ff = self.layers[0].w13.out_features // 2
        bf = torch.bfloat16
        h = self.embed(ids).contiguous()
        a, y, g = (torch.empty(t, n, dtype=bf) for n in (k, c.q_dim, n_ff))
        eps, heads = c.rms_norm_eps, (c.head_count, c.head_count_kv)
        cpu.add_rmsnorm(h, None, self.layers[0].attn_norm, eps, a)
        d, r0, last = None, 0, len(self.layers) - 1
        for i, ly in enumerate(self.layers):
            if d is not None:
                cpu.add_rmsnorm(h, d, ly.attn_norm, eps, a)
            qkv = ly.wqkv.linear_bf16(a)
            if i == last and not all_logits:
                # the last layer: every row's k, v go to the cache, but only the last
                # row's attention output, wo and FFN feed the logits
                r0 = t - 1
            m = t - r0  # rows from here on: h[r0:], the first m rows of a, y, g
            kc, vc = self.cache[i, 0], self.cache[i, 1]
            cpu.attn_prefill(qkv, kc, vc, pos, *heads, self.cos, self.sin, c.rope_is_neox,
                             out=y[:m], q_from=r0, amx=self.amx)  # fmt: skip
            o = ly.wo.bf16_io(y[:m], rows)
            cpu.add_rmsnorm(h[r0:], o, ly.ffn_norm, eps, a[:m])
            gu = ly.w13.bf16_io(a[:m], rows)
            cpu.swiglu_bf16(gu, out=g[:m])
            d = ly.w2.bf16_io(g[:m], rows)
        return self._logits(h, r0, d)

    def _c_path(self, t: int):
        """The C path for a forward of ``t`` rows (``f(ids, pos, all_logits)``), or None for the
        torch ops: the decode chain, the bf16 prefill (AMX or oneDNN), the int8 C prefill."""
        if t == 1 and self._plan is not None:
            return lambda ids, pos, _all_logits: self._decode_c(int(ids), pos)
        if self._fused_prefill and t >= self.bf16_min_rows:
            return self._prefill_amx if self.amx_layers else self._prefill_fused
        if self._c_int8_prefill and t > 1:
            return self._prefill_int8
        return None

    def _int8_prefill_ok(self) -> bool:
        """Whether the int8 prefill can run in the C kernels: RmsNorm, SwiGLU and the tiled
        float32 attention of ``prefill.c`` between the int8 GEMMs (``_prefill_int8``)."""
        c = self.config
        if self.prefill not in ("int8", "int8-attn") or not cpu.available() or not self.layers:
            return False
        if self.moe:
            return False
        if c.head_dim % 16 or c.head_dim > 128 or c.rope_dim != c.head_dim:
            return False
        n_ff = self.layers[0].w13.out_features // 2
        return c.embedding_length % 16 == 0 and n_ff % 16 == 0

    def _prefill_int8(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """Prefill of ``t`` tokens with ggml semantics in every matmul: per layer C RmsNorm
        (float32) -> int8 qkv GEMM -> RoPE, KV write and the tiled float32 attention
        (``cpu.attn_prefill``; int8 products with ``prefill="int8-attn"``) -> int8 wo GEMM
        added into ``h`` -> RmsNorm -> int8 gate/up
        GEMM -> SwiGLU -> int8 down GEMM added into ``h``, this FFN over ``mlp_rows`` rows at
        a time; all buffers allocated once.
        Unless ``all_logits``, the last layer computes attention, wo and the FFN for the
        last row only."""
        c, t = self.config, ids.numel()
        l0 = self.layers[0]
        n_ff = l0.w13.out_features // 2
        h = self.embed(ids).contiguous()
        a = torch.empty(t, c.embedding_length)
        qkv = torch.empty(t, l0.wqkv.out_features)
        y = torch.empty(t, c.q_dim)
        chunk = min(t, max(1, self.mlp_rows))
        gu, g = torch.empty(chunk, 2 * n_ff), torch.empty(chunk, n_ff)
        eps, heads = c.rms_norm_eps, (c.head_count, c.head_count_kv)
        r0, last = 0, len(self.layers) - 1
        int8_attention = self.prefill == "int8-attn"
        for i, ly in enumerate(self.layers):
            cpu.add_rmsnorm(h, None, ly.attn_norm, eps, a)
            ly.add_bias("wqkv", ly.wqkv.quantized_into(a, qkv))
            if i == last and not all_logits:
                r0 = t - 1  # every row's k, v go to the cache; the last row feeds the logits
            m = t - r0
            cpu.attn_prefill(qkv, self.cache[i, 0], self.cache[i, 1], pos, *heads, self.cos,
                             self.sin, c.rope_is_neox, out=y[:m], q_from=r0,
                             int8=int8_attention)  # fmt: skip
            ly.add_bias("wo", ly.wo.quantized_into(y[:m], h[r0:], accumulate=True))
            for s0 in range(r0, t, chunk):  # the FFN by row chunks: gate/up stay in cache
                rows, n = h[s0 : s0 + chunk], min(chunk, t - s0)
                cpu.add_rmsnorm(rows, None, ly.ffn_norm, eps, a[:n])
                ly.add_bias("w13", ly.w13.quantized_into(a[:n], gu[:n]))
                cpu.swiglu(gu[:n], out=g[:n])
                ly.add_bias("w2", ly.w2.quantized_into(g[:n], rows, accumulate=True))
        return self._logits(h, r0)

    def _prefill_amx(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """Prefill of ``t`` tokens with one C call for all the layers (``cpu.prefill_layers``):
        AMX bf16 matmuls with fused epilogues (bf16 out; residual add in float32; SwiGLU),
        RmsNorm, RoPE + KV write + AMX attention. The residual stream and the KV cache stay
        float32. Unless ``all_logits``, the last layer's wo and FFN run for the last row only."""
        c, t = self.config, ids.numel()
        h = self.embed(ids).contiguous()
        scratch = cpu.PrefillScratch.for_layer(self._amx[0], t)
        cpu.prefill_layers(
            h, self._amx, scratch, self.cache, norms=self._amx_norms, eps=c.rms_norm_eps,
            pos=pos, n_head=c.head_count, n_kv=c.head_count_kv, cos=self.cos, sin=self.sin,
            neox=c.rope_is_neox, q_from=0 if all_logits else t - 1,
        )  # fmt: skip
        return self._logits(h, 0 if all_logits else t - 1)

    def _decode_c(self, token: int, pos: int, logits: torch.Tensor | None = None) -> torch.Tensor:
        """One token through the fused C kernels: 5 prepared calls per layer and the logits
        (into ``logits`` when given), no torch ops; in one C call (``decode_mode``) or one
        ctypes call each."""
        self._decode_inputs(token, pos)
        chain = self._chains.get(self._decode_mode)
        if chain is not None:  # the whole step in one C call
            out = chain(logits)
            return out if out is not None else self._logits_plan()
        for layer in self._plan:
            if any(call() for call in layer):
                raise MemoryError("the C decode step: out of memory")
        return self._logits_plan()

    def _moe_plan(self, ly: FastLayer) -> cpu.KernelCall:
        """A mixture of experts' FFN in the decode step, prepared: the router's GEMV of the
        RmsNorm of ``h``, then (``cpu.moe_decode_plan``) the token's experts by
        ``moe.route``'s rule, each chosen expert's gate/up and down GEMVs (into buffers of
        their own, the RmsNorm and the SwiGLU inside them) and ``h +=`` their weighted sum in
        expert order (``moe.combine``'s additions): all C steps, so that the decode step stays
        one C call. Where an expert has torch parts, the routing and the sum run in torch."""
        c, h, eps = self.config, self._h, self.config.rms_norm_eps
        logits = torch.empty(1, ly.router.out_features)
        router = ly.router.plan(h, logits, norm=ly.ffn_norm, eps=eps)
        calls, outs = [], []
        for w13, w2 in ly.experts:
            gu, out = torch.empty(w13.out_features), torch.empty(1, c.embedding_length)
            calls.append([w13.plan(h, gu, norm=ly.ffn_norm, eps=eps),
                          w2.plan(gu, out, swiglu=True)])  # fmt: skip
            outs.append(out)
        routed = cpu.moe_decode_plan(logits, h, calls, outs, c.expert_used_count)
        if routed is not None and cpu.has_steps(router):

            def step() -> int:
                return router() or routed()

            step.keep, step.routed = (router, routed), routed
            step.steps = (*router.steps, *routed.steps)
            return step

        def expert(e: int, _a: torch.Tensor) -> torch.Tensor:  # (its input: h, in the calls)
            if any(call() for call in calls[e]):
                raise MemoryError("the C decode step: out of memory")
            return outs[e]

        runs = [functools.partial(expert, e) for e in range(len(calls))]  # made once

        def step_in_torch() -> int:
            if router():
                return 1
            chosen, weights = moe.route(logits, c.expert_used_count)
            h.add_(moe.combine(h, chosen, weights, runs))
            return 0

        return step_in_torch

    def _decode_inputs(self, token: int, pos: int) -> None:
        """The C decode step's inputs: the token's embedding row, the position and the RoPE
        rows every attention call reads."""
        if self._embed_row is not None:
            self._embed_row(token)
        else:
            self._h.copy_(self.embed(torch.tensor([token])))
        self._pos.at(pos)

    def greedy_step(self, token: int, index_pos: int) -> int:
        """``forward`` of one token at ``index_pos``, then the argmax of its logits (the next
        greedy token; ``generate`` and ``bench`` take greedy steps so): with the C decode
        step, the logits go into a buffer kept for it and no tensor is made per token."""
        if self._plan is None:
            return int(self.forward(torch.tensor([[token]]), index_pos).numpy().argmax())
        check_positions(index_pos, 1, self._kv_len, self.max_seq_len)
        check_token_ids(token, token, self.vocab_size)
        self._grow_cache(index_pos + 1, keep=index_pos)
        if self._greedy_logits is None:
            self._greedy_logits = torch.empty(1, self.vocab_size)
        with span("model"):
            logits = self._decode_c(token, index_pos, self._greedy_logits)
        self._kv_len = index_pos + 1
        return int(logits.numpy().argmax())  # (numpy's: ~5 us where torch's took ~90)

    def _embed_row_plan(self, h: torch.Tensor) -> Callable[[int], None] | None:
        """``embed`` of one id into ``h`` in one C call (``cpu.RowLookup``): on the caches a
        decode step leaves, torch's and numpy's ops took 0.15-0.5 ms a token for it
        (docs/performance.md, "The embedding row in C"); None where the C kernels do not read
        the embedding's layout (a tied output's planes, a type without a C dequantizer)."""
        pw = self._embed_rows
        if pw is not None:
            if not (pw.blocks or pw.panels):
                return None
            return cpu.RowLookup(pw.codes, pw.type_name, pw.n, pw.k, h, panels=pw.panels)
        t = self.tok_embd
        if t.dtype.name not in cpu.ROW_TYPES:
            return None
        rows = self._embed_blocks()
        lookup = cpu.RowLookup(rows, t.dtype.name, t.shape[0], t.shape[-1], h)

        def embed_row(row: int) -> None:
            lookup(row)
            if self._embed_release is not None:
                self._embed_release(rows[row])  # the row's mapped pages (``embed``: all)

        return embed_row

    def decode_step_times(self, token: torch.Tensor, pos: int) -> tuple[torch.Tensor, list]:
        """One decode step of ``token`` (one id) at ``pos`` through the one-region C chain,
        timed by the region itself: the logits (as ``forward`` gives them) and, per step of
        the chain, ``(call, seconds)`` with ``call`` the index of its prepared call (5 a
        layer: qkv, attention, wo, gate/up, down; then the logits'). The KV cache's length is
        left as it was (the row at ``pos`` is written). For tools/cpu_decode_profile.py."""
        self._grow_cache(pos + 1, keep=pos)
        chain = self._chains.get("region")
        if chain is None:
            raise ModelError("decode_step_times: this model has no one-region C decode step")
        self._decode_inputs(int(token), pos)
        logits, seconds = chain.step_seconds()
        return logits, list(zip(chain.owners, seconds, strict=True))

    def prefill_phase_times(
        self, ids: torch.Tensor, pos: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill of ``ids`` (``[1, t]``, ``t >= bf16_min_rows``) at ``pos`` through the AMX
        layer kernel, timed by the kernel itself: the logits (as ``forward`` gives them) and
        the seconds per thread and phase, work and barrier wait
        (``cpu.prefill_phase_seconds``, ``cpu.PREFILL_PHASES``). For
        tools/cpu_prefill_profile.py."""
        if not self.amx_layers:
            raise ModelError("prefill_phase_times: this model has no AMX prefill layers")
        return cpu.prefill_phase_seconds(lambda: self.forward(ids, pos), torch.get_num_threads())

    @classmethod
    def from_gguf(
        cls,
        content,
        f: BinaryIO,
        device: DeviceLike = "cpu",
        *,
        prefill: str | None = None,
        bf16_min_rows: int = 16,
        max_seq_len: int | None = None,
        hugepages: bool = True,
        amx: bool = True,
        amx_packed: bool = True,
        kv_type: str | None = None,
        panels: bool = True,
        kv_hugepages: bool | None = None,
    ) -> FastModel:
        """Build from a parsed ``gguf_file.Content`` and its open file (CPU only).

        ``prefill``: ``bf16`` or ``int8`` matmuls for prompts, or ``int8-attn`` (int8 matmuls
        and int8 attention products; None: ``default_prefill()`` of this file's
        ``prefill_copy_bytes``: bf16 on AMX hardware unless its weight copy would pass
        ``PREFILL_COPY_MAX_BYTES``).

        ``amx``: the AMX prefill kernels where the CPU has them (else oneDNN's matmuls);
        ``amx_packed``: their quantized weights (legacy, K-quants, mixes) stay 4/8-bit codes
        (expanded to bf16 tiles inside the GEMM, the same values) instead of a bf16 tile copy.

        ``panels``: the Q4_0 / Q4_1 / Q8_0 / Q4_K weights of the layers and the output as 16-row
        panels (``cpu.pack``: the decode GEMV in about half the instructions; the same
        values, outputs equal to the planes' to float rounding); False: per-row planes.

        ``max_seq_len``: positions the KV cache can hold (None: the file's
        ``llama.context_length``, else 4096; its buffer grows to them as needed, on 2 MB
        pages unless ``kv_hugepages`` (None: as ``hugepages``) is False); ``kv_type``:
        ``f32`` (None: the default, ``DEFAULT_KV_TYPE``) or ``f16`` (half the bytes each
        decode step reads; k and v rounded to half, the attention arithmetic float32; the bf16
        prefill then runs outside the fused C prefill kernels, which write float32 caches).
        """
        if as_device(device).type != "cpu":
            raise ModelError("the fast path runs on CPU; use ModelWeights on other devices")
        config = LlamaConfig.from_metadata(content.metadata)
        check_tensors(content, config, "f32")  # names, shapes, types (before any data is read)
        gate = content.tensor_infos.get("blk.0.ffn_gate.weight")
        amx_ok = (amx and gate is not None and cpu.amx_available()
                  and _amx_layer_shapes_ok(config, gate.shape[0]))  # fmt: skip
        if prefill is None:
            prefill = default_prefill(prefill_copy_bytes(content, amx_ok))
        if prefill not in PREFILL_MODES:
            raise ModelError(f"unknown prefill mode {prefill!r}: {', '.join(PREFILL_MODES)}")
        max_seq_len = context_length(content.metadata) if max_seq_len is None else max_seq_len
        max_seq_len = check_max_seq_len(max_seq_len)
        kv_type = check_kv_type(kv_type)
        bf16 = prefill == "bf16"
        amx_layers = bf16 and amx_ok

        def get(name: str) -> QTensor:
            return content.tensor(f, name, "cpu")

        # Mapped (``gguf.MappedFile``): the tensors are views of the file; packing drops the
        # pages of each piece it has read (``cpu.pack(release=)``), so at any time the file is
        # held once, as packed weights or as mapped pages, never both (but a few MB)
        release = functools.partial(release_pages, f)
        layers = []
        # the packed weights written on 2 MB pages from the start (``hugepages``): decode
        # streams them every token; moved onto them after the load instead, 1.2 GB took 2 s
        with cpu.hugepage_weights(hugepages):
            for i in progress.layers(range(config.block_count), config.block_count):
                layers.append(FastLayer(get, f"blk.{i}", config.rms_norm_eps, bf16, amx_layers,
                                        amx_packed, release, panels, config.expert_count,
                                        content.tensor_infos))  # fmt: skip
                release_pages(f)  # repacked: the layer's mapped pages are not needed any more
            tok_embd = get("token_embd.weight")  # a view of the mapped file: rows read on lookup
            tied = "output.weight" not in content.tensor_infos
            out_w = tok_embd if tied else get("output.weight")
            # prefill: the last row; a tied embedding's rows are read from it (panels too)
            output = FastLinear([out_w], bf16=False, release=release, panels=panels)
        norm = _owned(get("output_norm.weight"))
        release_pages(f)
        cpu.trim_heap()  # the packing's freed temporaries
        freqs = "rope_freqs.weight" in content.tensor_infos  # Llama 3.1+ RoPE scaling
        rope_freqs = _owned(get("rope_freqs.weight")) if freqs else None
        # the embedding's rows: a tied output's packed weight holds exactly the embedding's
        # values (``cpu.dequantize_rows``); else the file's blocks, whose mapped pages each
        # lookup drops again (they would add up to the whole embedding over a conversation)
        embed_rows = output.packed if tied else None
        return cls(config, tok_embd, layers, norm, output, prefill=prefill,
                   bf16_min_rows=bf16_min_rows, max_seq_len=max_seq_len,
                   hugepages=hugepages, kv_hugepages=kv_hugepages, amx=amx, kv_type=kv_type,
                   rope_freqs=rope_freqs, embed_rows=embed_rows,
                   embed_release=release)  # fmt: skip

    # -- state -------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by the weights (packed, bf16 copies, norms)."""
        total = sum(w.nbytes() for layer in self.layers for w in layer.linears())
        return total + self.output.nbytes() + self.tok_embd.nbytes()

    def kv_bytes(self) -> dict[str, int | None]:
        """The KV cache's ``reserved`` bytes (the positions its buffer holds now: ``kv_first``,
        grown as needed up to ``max_seq_len``), the bytes ``used`` by the ``kv_len``
        positions held, and those ``resident`` now (pages touched; None where ``mincore`` is
        unavailable)."""
        c = self.config
        per_pos = c.block_count * 2 * c.head_count_kv * c.head_dim * self.cache.element_size()
        return {"reserved": self.cache.numel() * self.cache.element_size(),
                "used": per_pos * self._kv_len, "resident": resident_bytes(self.cache)}  # fmt: skip

    # -- the forward pass ----------------------------------------------------

    def _embed_blocks(self) -> torch.Tensor:
        """``token_embd``'s bytes as ``[vocab, row bytes]`` uint8 (a view of the mapped file)."""
        t = self.tok_embd
        return t.data.view(torch.uint8).reshape(t.shape[0], -1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantize only the rows of ``token_embd`` that are looked up: ``[t, d]``."""
        if self._embed_rows is not None:
            return cpu.dequantize_rows(self._embed_rows, ids)
        t = self.tok_embd
        if cpu.available() and t.dtype.name in cpu.ROW_TYPES:
            x = cpu.dequant_rows(self._embed_blocks(), t.dtype.name, t.shape[0], t.shape[-1], ids)
        else:
            x = dequantize_torch(t.data[ids].reshape(-1), t.dtype.name, (ids.numel(), t.shape[-1]))
        if self._embed_release is not None:
            self._embed_release(t.data)
        return x

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x: ``(t, heads, d)`` -> rotated (a new tensor)."""
        t, _, d = x.shape
        if self.config.rope_is_neox:
            cos = self.cos[pos : pos + t, None, :]
            sin = self.sin[pos : pos + t, None, :]
            return rope_neox(x, cos, sin)
        pairs = torch.view_as_complex(x.reshape(t, -1, d // 2, 2))
        return torch.view_as_real(pairs * self.rot[pos : pos + t, None, :]).reshape(x.shape)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int):
        """q: ``(t, n_head, d)``; k, v: cache views ``(n_kv, L, d)`` -> ``(t, n_head * d)``."""
        c = self.config
        t, L = q.shape[0], k.shape[1]
        scale = 1.0 / math.sqrt(c.head_dim)
        k, v = k.float(), v.float()  # a float16 cache: its values, exactly
        if t == 1:  # decode: group the query heads of each KV head, no copies of K/V
            qg = q.view(c.head_count_kv, -1, c.head_dim) * scale
            att = torch.softmax(qg @ k.transpose(1, 2), dim=-1)
            return (att @ v).reshape(1, -1)
        mask = None
        if pos:  # chunk after a prefix: row i sees columns <= pos + i
            mask = torch.arange(L)[None, :] <= (torch.arange(t)[:, None] + pos)
        y = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
            is_causal=mask is None, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return y[0].transpose(0, 1).reshape(t, -1)

    def forward(self, x: torch.Tensor, index_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``x`` (``(1, seq_len)``) from ``index_pos``: ``(1, vocab)``.

        ``all_logits=True`` gives every position: ``(1, seq_len, vocab)``.
        """
        t = self.check_input(x, index_pos)
        c = self.config
        nq, nkv, hd = c.q_dim, c.head_count_kv * c.head_dim, c.head_dim
        eps, dims, rows = c.rms_norm_eps, (c.embedding_length,), self.bf16_min_rows
        end = index_pos + t
        self._grow_cache(end, keep=index_pos)  # index_pos: kv_len, or 0 to start over
        path = self._c_path(t)
        if path is not None:
            with span("model"):
                logits = path(x.reshape(-1).cpu(), index_pos, all_logits)
            self._kv_len = end
            return logits[None] if all_logits else logits
        with span("model"):
            h = self.embed(x.reshape(-1).cpu())
            for i, layer in enumerate(self.layers):
                a = F.rms_norm(h, dims, layer.attn_norm, eps)
                qkv = layer.add_bias("wqkv", layer.wqkv.forward(a, rows))
                qk = self.rope(qkv[:, : nq + nkv].view(t, -1, hd), index_pos)
                kc, vc = self.cache[i, 0], self.cache[i, 1]
                kc[:, index_pos:end].copy_(qk[:, c.head_count :].transpose(0, 1))
                vc[:, index_pos:end].copy_(qkv[:, nq + nkv :].view(t, -1, hd).transpose(0, 1))
                y = self.attention(qk[:, : c.head_count], kc[:, :end], vc[:, :end], index_pos)
                h += layer.add_bias("wo", layer.wo.forward(y, rows))
                a = F.rms_norm(h, dims, layer.ffn_norm, eps)
                if layer.experts is None:
                    h += _swiglu(layer.w13, layer.w2, rows, a, layer.biases.get("w13"),
                                 layer.biases.get("w2"))  # fmt: skip
                else:  # a mixture of experts: each token's chosen ones
                    h += _experts(layer, a, rows, c.expert_used_count)
                # free this layer's activations before the next layer makes its own
                del a, qkv, qk, y
            self._kv_len = end
            h = F.rms_norm(h if all_logits else h[t - 1 :], dims, self.norm, eps)
            logits = self.output.quantized(h.contiguous())
        return logits[None] if all_logits else logits

    __call__ = forward
