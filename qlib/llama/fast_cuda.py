"""The fast CUDA path: the llama forward in a few fused Triton kernels, replayed as CUDA graphs.

``CudaFastModel.from_gguf(content, f, "cuda")`` has ``ModelWeights``' interface
(``forward(x, index_pos, all_logits=)``, ``clear_kv_cache``, ``kv_len``). Numerics
are those of the faithful CUDA path (weights dequantized exactly to float32 inside
the kernels, float32 activations and accumulation), so its logits equal the
``f32`` form's to float rounding. What differs is the shape of the work:

* **decode** (``decode="auto"``, the default: one persistent kernel a step where
  ``auto_decode`` finds it measured faster, ``qlib.quants.cuda.persistent``; elsewhere, or
  with ``decode="fused"``) is six kernels per layer (``qlib.quants.cuda.fused``): RmsNorm +
  stacked q/k/v GEMV + RoPE + KV-cache write; attention over the live length (blocks of
  positions in parallel, then their combine); output projection + residual (with
  ``decode="merged"`` the combine runs inside this kernel, five a layer); RmsNorm +
  stacked gate/up GEMV + SwiGLU; down projection + residual. Weights stay packed (2- to
  8-bit planes). The token id and the position are read from device tensors, so the whole
  step (183 kernels for SmolLM2) is captured once in a CUDA graph and replayed for every
  position: one launch per token instead of hundreds. On Hopper and later the kernels launch with
  programmatic dependent launch (``pdl=True``, the default where available: each kernel's
  blocks wait on the device for the previous one instead of launching after it);
* **prefill** (``t > 1``) uses dense copies of the layer weights made at load, multiplied by
  cuBLAS: float32 with TF32 off (``prefill="f32"``, the default where those copies take at
  most half the GPU's free memory, else ``packed``: ``default_prefill``; the f32 form's numerics),
  the same copies with TF32 tensor cores on (``"tf32"``), or bfloat16 copies (``"bf16"``:
  half the memory; bf16 matmul inputs, float32 outputs and residual stream, attention in
  bf16 (flash); drift measured in docs/gpu.md); or the exact tensor-core GEMM of the packed
  weights (``"packed"``: no extra memory, slower). Attention is
  ``scaled_dot_product_attention``; a prefill from position 0 is captured as a
  CUDA graph per prompt length (the first call runs eagerly, the second captures);
* **static KV cache** ``[layers, 2, n_kv, max_seq_len, d]``, allocated on the device at load:
  float32 (``kv_type="f32"``, the default: the f32 form's numerics) or IEEE half
  (``"f16"``, llama.cpp's default: keys and values rounded to nearest even when written,
  read back into float32 arithmetic; half the bytes the long-context decode reads).
  ``max_seq_len`` defaults to the file's ``llama.context_length`` (the RoPE tables as long;
  the split attention's grid covers it, its blocks past the position exit at once).

**Any mix of types.** Projections that read one input are stacked where neighbours share
a type (``stack_runs``): a uniform q/k/v or gate/up is one weight and one fused kernel; a
mix (Q4_K_M's Q6_K ``attn_v``, Q5_0 / Q8_0 fallbacks) is one part per run, each a GEMV into
its slice of the same buffer, then RoPE + cache write (``rope_store``) or the gate epilogue.
Types with Triton kernels (``qlib.quants.cuda.layout.NATIVE``) keep their packed planes;
the others (F32, F16, BF16) are a float32 ``DenseWeight`` multiplied by cuBLAS
(the same values and float32 accumulation, so the numerics above hold for every part).

**Greedy decoding** (``greedy_step``, which ``generate`` takes) keeps the argmax on the
device and reads back only the id; with CUDA graphs and ``launch_ahead`` (the default) the
next step is queued before that id is read, so the GPU never waits for the host between steps
(a step queued for a call that does not come finishes unused).

``index_pos`` must equal the cache length or be 0 (starts over): anything else
raises ``IndexPosError``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch
import torch.nn.functional as F

from .. import progress
from ..devices import DeviceLike, as_device
from ..quants.cuda.layout import EPI_ADD, EPI_GATE, EPI_STORE, EPI_SWIGLU, NATIVE, Prepared, repack
from ..quants.forms import KERNEL_TYPE, kernel_form
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
from .config import MAX_SEQ_LEN, LlamaConfig, bias_names, check_tensors, rope_tables
from .errors import ModelError
from .fused import FUSED_STACKS, Biased, layer_biases

PREFILL_MODES = ("f32", "tf32", "bf16", "packed")
PREFILL_DTYPES = {"f32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
ATTENTION_MODES = ("split", "single")  # decode attention: blocks in parallel, or one loop
# six fused kernels per layer; five, the attention's combine merged into the output
# projection (the heads' shares summed with float atomics); one persistent kernel; or "auto"
# (the default): persistent where ``auto_decode`` finds it measured faster, else fused
DECODE_MODES = ("auto", "fused", "merged", "persistent")
PERSISTENT_MAX_WIDTH = 768  # decode="auto": wider models run fused (docs/gpu.md measures)
GRAPH_CACHE = 4  # prefill graphs kept (one per prompt length)
STEPS_MASK = 0xFFFFFFFF  # the persistent kernel counts its steps in 32 bits


@dataclass
class DenseWeight:
    """A weight of a type without Triton kernels (not in ``NATIVE``: F32, F16, BF16): its
    float32 values ``[n, k]`` on the device, multiplied by torch (cuBLAS)."""

    type_name: str
    n: int
    k: int
    w: torch.Tensor

    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


Part = Prepared | DenseWeight  # one run of a stack: Triton planes or a dense fallback


def stack_runs(types: list[str]) -> list[tuple[str, int, int]]:
    """The runs of a stack's projections (their types, in row order) that share a type, as
    ``(type, first, end)`` indices: each run becomes one part (q, k Q5_0 and v Q8_0: two)."""
    runs: list[tuple[str, int, int]] = []
    for i, t in enumerate(types):
        if runs and runs[-1][0] == t:
            runs[-1] = (t, runs[-1][1], i + 1)
        else:
            runs.append((t, i, i + 1))
    return runs


def _prepare_stacked(qtensors: list[QTensor], dense: torch.Tensor | None = None) -> list[Part]:
    """The parts of several weights with one row length, stacked by rows where the types agree:
    GPU planes for the ``NATIVE`` types, float32 values for the others (rows of ``dense``, the
    float32 stack, when given; else dequantized here)."""
    if len({q.shape[-1] for q in qtensors}) != 1:
        raise ModelError("stacked projections read one input: one row length")
    out: list[Part] = []
    row0 = [0]
    for q in qtensors:
        row0.append(row0[-1] + q.shape[0])
    for name, i, j in stack_runs([q.dtype.name for q in qtensors]):
        g = qtensors[i:j]
        n, k = row0[j] - row0[i], g[0].shape[-1]
        if name in NATIVE:
            data = torch.cat([q.data.reshape(q.shape[0], -1) for q in g])
            out.append(repack(data, name, (n, k)))
        else:
            w = (dense[row0[i] : row0[j]] if dense is not None
                 else torch.cat([q.dequantize(dtype=torch.float32) for q in g]))  # fmt: skip
            out.append(DenseWeight(name, n, k, w))
    return out


class CudaLinear:
    """One (possibly stacked) weight: packed planes for decode (a float32 ``DenseWeight`` for
    types without kernels), a dense copy (float32 or bfloat16) for prefill. A stack of mixed
    types is one part per run of one type, run one after the other into slices of one output."""

    def __init__(self, qtensors: list[QTensor], dense: torch.dtype | None):
        self.dense: torch.Tensor | None = None
        if dense is not None:
            self.dense = torch.cat([q.dequantize(dtype=torch.float32) for q in qtensors])
        f32 = self.dense if dense == torch.float32 else None  # rows the dense parts can share
        self.parts = _prepare_stacked(qtensors, f32)
        if self.dense is not None and dense != torch.float32:
            self.dense = self.dense.to(dense)
        self.out_features = sum(p.n for p in self.parts)
        self.in_features = self.parts[0].k

    @property
    def types(self) -> list[str]:
        """The GGUF type of each part, in row order."""
        return [p.type_name for p in self.parts]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for a block of float32 rows ``[t, k]`` (prefill): float32 out; a bf16
        dense copy multiplies ``x`` rounded to bf16 (float32 accumulation and output)."""
        if self.dense is not None:
            if self.dense.dtype == torch.float32:
                return x @ self.dense.t()
            return torch.mm(x.to(self.dense.dtype), self.dense.t(), out_dtype=torch.float32)
        from ..quants.cuda import kernels

        y = torch.empty(x.shape[0], self.out_features, device=x.device)
        row = 0
        for p in self.parts:
            if isinstance(p, DenseWeight):
                y[:, row : row + p.n] = x @ p.w.t()
            else:
                kernels.gemm(x, p, y[:, row : row + p.n])
            row += p.n
        return y

    def nbytes(self) -> int:
        # dense parts are rows of the float32 prefill copy when there is one (not counted twice)
        shared = self.dense is not None and self.dense.dtype == torch.float32
        n = sum(p.nbytes() for p in self.parts if not (shared and isinstance(p, DenseWeight)))
        dense = self.dense.numel() * self.dense.element_size() if self.dense is not None else 0
        return n + dense


def gemv(x: torch.Tensor, w: Part, y: torch.Tensor, *, norm: torch.Tensor | None = None,
         eps: float = 0.0, epilogue: int = EPI_STORE) -> None:  # fmt: skip
    """``fused.norm_gemv`` for any part: the Triton kernel for planes, torch ops with the same
    epilogues (``EPI_*``) for a ``DenseWeight``."""
    if not isinstance(w, DenseWeight):
        from ..quants.cuda import fused

        fused.norm_gemv(x, w, y, norm=norm, eps=eps, epilogue=epilogue)
        return
    v = x.reshape(1, w.k)
    if norm is not None:
        v = F.rms_norm(v, (w.k,), norm, eps)
    r, out = (v @ w.w.t()).view(-1), y.view(-1)
    if epilogue == EPI_STORE:
        out.copy_(r)
    elif epilogue == EPI_ADD:
        out.add_(r)
    elif epilogue == EPI_SWIGLU:
        out.copy_(F.silu(r[: w.n // 2]) * r[w.n // 2 :])
    elif epilogue == EPI_GATE:
        out.copy_(F.silu(out) * r)
    else:
        raise ValueError(f"gemv: unknown epilogue {epilogue}")


def embed(ids: torch.Tensor, w: Part, out: torch.Tensor) -> None:
    """``out[t] = W[ids[t]]`` (float32) for int64 device ids, any part."""
    if isinstance(w, DenseWeight):
        torch.index_select(w.w, 0, ids, out=out)
        return
    from ..quants.cuda import fused

    fused.embed(ids, w, out)


def default_prefill(content, free: int | None) -> tuple[str, str]:
    """The prefill a file gets by default (``from_gguf(prefill=None)``), and why: ``f32``
    (cuBLAS on float32 copies of the layers' weights, the f32 form's numerics) where those
    copies take at most half the device's ``free`` bytes, else ``packed`` (the exact GEMM of
    the packed weights: no copy; a 7B model's float32 copies alone are 28 GB)."""
    weights = sum(i.n_elements for n, i in content.tensor_infos.items()
                  if n.startswith("blk.") and len(i.shape) >= 2)  # fmt: skip
    need = 4 * weights
    if free is None or need <= free // 2:
        return "f32", "float32 copies of the weights for cuBLAS"
    return "packed", (f"float32 copies of the weights would take {need / 2**30:.1f} GiB of the "
                      f"{free / 2**30:.1f} GiB free: the packed weights' GEMM")  # fmt: skip


def check_cache_fits(config: LlamaConfig, positions: int, dtype: torch.dtype,
                     free: int | None, device: str) -> None:  # fmt: skip
    """A ``ModelError`` where the static KV cache (and its RoPE tables) for ``positions``
    would not fit the ``free`` bytes of ``device`` (a file's ``llama.context_length`` is the
    default: a long or corrupt one should say so, not fail inside an allocation)."""
    c = config
    cache = c.block_count * 2 * c.head_count_kv * c.head_dim * positions * dtype.itemsize
    need = cache + 2 * 4 * positions * (c.rope_dim // 2)
    if free is not None and need > free:
        raise ModelError(f"a KV cache of {positions} positions needs {need / 2**30:.1f} GiB, more "
                         f"than the {free / 2**30:.1f} GiB free on {device}: pass a smaller "
                         "max_seq_len (--max-seq-len)")  # fmt: skip


def auto_decode(types: dict[str, str], config: LlamaConfig, capability: tuple[int, int],
                biases: bool = False) -> tuple[str, str]:  # fmt: skip
    """What ``decode="auto"`` runs for a model (its matrices' GGUF types), and why: the
    persistent kernel where it was measured faster than the fused kernels (docs/gpu.md: a
    Hopper GPU, a float32 or float16 cache, models up to ``PERSISTENT_MAX_WIDTH`` wide), else
    fused."""
    from ..quants.cuda import persistent

    why = persistent.unsupported(types, config.head_dim, config.rope_dim, config.q_dim,
                                 config.embedding_length, biases)  # fmt: skip
    if why:
        return "fused", why
    if capability[0] != 9:
        return "fused", "the persistent kernel is tuned and measured on Hopper (sm_90) only"
    if config.embedding_length > PERSISTENT_MAX_WIDTH:
        return "fused", (f"the persistent kernel is tuned for models up to {PERSISTENT_MAX_WIDTH} "
                         f"wide, not {config.embedding_length}")  # fmt: skip
    return "persistent", "one kernel a step (measured faster than the fused kernels here)"


def _persistent_decoder(model: CudaFastModel, get, tok: QTensor, out: QTensor,
                        **options):  # fmt: skip
    """The ``PersistentDecoder`` of ``model`` (whose types ``persistent.unsupported`` passed):
    the GGUF blocks of every matrix on the device, each in its ``kernel_form`` (Q1_0, which
    the Triton kernels take as it is, as Q4_0 blocks: the kernel reads those natively)."""
    from ..quants.cuda import persistent

    c = model.config
    tok_k = kernel_form(tok)
    out_k = tok_k if out is tok else kernel_form(out)
    layers = []
    for i, ly in enumerate(model.layers):
        raw = {n: kernel_form(get(f"blk.{i}.{n}.weight")) for n in persistent.MATRICES}
        raw.update(attn_norm=ly.attn_norm, ffn_norm=ly.ffn_norm)
        layers.append(raw)
    try:
        return persistent.PersistentDecoder(c, layers, tok_k, out_k, model.norm, model.cos,
                                            model.sin, model.cache, model.device,
                                            **options)  # fmt: skip
    except persistent.PersistentError as e:
        raise ModelError(str(e)) from None


@contextlib.contextmanager
def _fp32_precision(mode: str):
    """cuBLAS's float32 matmul precision set to ``mode`` (``tf32``, ``ieee``) for a block."""
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = mode
    try:
        yield
    finally:
        matmul.fp32_precision = old


Experts = list[tuple[CudaLinear, CudaLinear]]  # each expert's (gate | up, down)


def _stack_experts(experts: Experts) -> tuple[Prepared, Prepared] | None:
    """Every expert's gate | up planes in one ``Prepared`` (their rows one expert after
    another), and their down planes in another, for the decode step's device routing
    (``fused.experts_gemv``); each expert's own parts become row views of them (no second
    copy). None where an expert's projections are not one packed part of one type and shape
    (they stay as they are: the routing in torch)."""
    stacks = []
    for i in (0, 1):
        parts = [pair[i].parts for pair in experts]
        first = parts[0][0]
        shape = (first.type_name, first.n, first.k)
        if any(len(ps) != 1 or not isinstance(ps[0], Prepared) for ps in parts) or any(
                (ps[0].type_name, ps[0].n, ps[0].k) != shape for ps in parts):  # fmt: skip
            return None
        planes = {}
        for name in ("qs", "qh", "d", "dm", "sc", "mn"):
            got = [getattr(ps[0], name) for ps in parts]
            planes[name] = torch.cat(got) if got[0] is not None else None
        for e, pair in enumerate(experts):
            rows = slice(e * first.n, (e + 1) * first.n)
            views = {n: t[rows] if t is not None else None for n, t in planes.items()}
            pair[i].parts = [Prepared(first.type_name, first.n, first.k, **views)]
        stacks.append(Prepared(first.type_name, first.n * len(experts), first.k, **planes))
    return stacks[0], stacks[1]


class CudaLayer(Biased):
    """One block's weights: wqkv, wo, w13 (gate | up), w2 (down), or for a mixture of experts
    (``n_expert`` > 1) the router and each expert's (w13, w2) (``moe.expert_matrices``;
    ``tensor_names``: the file's)."""

    wqkv: CudaLinear
    wo: CudaLinear
    w13: CudaLinear | None
    w2: CudaLinear | None

    def __init__(self, get, p: str, dense: torch.dtype | None, n_expert: int = 0,
                 tensor_names=()):  # fmt: skip
        self.router: CudaLinear | None = None
        self.experts: Experts | None = None
        for attr, names in FUSED_STACKS.items():  # wqkv, wo, w13, w2
            if n_expert > 1 and attr in ("w13", "w2"):
                setattr(self, attr, None)
                continue
            setattr(self, attr, CudaLinear([get(f"{p}.{n}.weight") for n in names], dense))
        self.expert_stacks: tuple[Prepared, Prepared] | None = None
        if n_expert > 1:
            self.router = CudaLinear([get(f"{p}.ffn_gate_inp.weight")], dense)
            mats = moe.expert_matrices(get, p, n_expert, tensor_names)
            self.experts = [(CudaLinear([g, u], dense), CudaLinear([d], dense)) for g, u, d in mats]
            self.expert_stacks = _stack_experts(self.experts)
        self.attn_norm = get(f"{p}.attn_norm.weight").dequantize()
        self.ffn_norm = get(f"{p}.ffn_norm.weight").dequantize()
        # the file's optional projection biases, by stacked projection (llama.cpp adds them)
        dense = [attr for attr in FUSED_STACKS if getattr(self, attr) is not None]
        self.biases = layer_biases(tensor_names, lambda n: get(n).dequantize(),
                                   lambda n: get(n).shape[0], p, dense)  # fmt: skip

    def linears(self) -> list[CudaLinear]:
        """Every weight of the block."""
        ffn = [self.w13, self.w2] if self.experts is None else \
            [self.router, *(w for pair in self.experts for w in pair)]  # fmt: skip
        return [self.wqkv, self.wo, *ffn]

    def experts_ffn(self, a: torch.Tensor, n_used: int) -> torch.Tensor:
        """A mixture of experts' FFN of the normed rows ``a`` (``moe``: each row's chosen
        experts, their weighted sum in expert order)."""

        def expert(w13: CudaLinear, w2: CudaLinear, x: torch.Tensor) -> torch.Tensor:
            gu = w13.matmul(x)
            n_ff = gu.shape[1] // 2
            return w2.matmul(F.silu(gu[:, :n_ff]) * gu[:, n_ff:])

        runs = [functools.partial(expert, w13, w2) for w13, w2 in self.experts]
        return moe.ffn(a, self.router.matmul, runs, n_used)


class CudaFastModel(StaticKVState):
    """A llama GGUF on one CUDA device: fused packed decode kernels, CUDA graphs, static cache."""

    def __init__(
        self,
        config: LlamaConfig,
        tok_embd: Part,
        layers: list[CudaLayer],
        norm: torch.Tensor,
        output: Part,
        device: torch.device,
        *,
        prefill: str = "f32",
        graphs: bool = True,
        attention: str = "split",
        max_seq_len: int = MAX_SEQ_LEN,
        rope_freqs: torch.Tensor | None = None,
        pdl: bool | None = None,
        kv_type: str = DEFAULT_KV_TYPE,
    ):
        if attention not in ATTENTION_MODES:
            raise ModelError(f"unknown attention {attention!r}: {', '.join(ATTENTION_MODES)}")
        self.config = config
        self.prefill = prefill
        self.kv_type = check_kv_type(kv_type)
        self.attention = attention
        self.pdl = pdl if pdl is not None else device.type == "cuda"  # (used where available)
        self._split_attention = None
        self.device = device
        self.tok_embd = tok_embd
        self.vocab_size = output.n
        self.layers = layers
        self.norm = norm
        self.output = output
        self.graphs = graphs and device.type == "cuda"
        self.moe = bool(layers) and layers[0].experts is not None  # a mixture of experts
        self.max_seq_len = check_max_seq_len(max_seq_len)
        c = config
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        check_cache_fits(c, self.max_seq_len, KV_TYPES[self.kv_type], free, str(device))
        self.cos, self.sin = rope_tables(config, device, max(self.max_seq_len, MAX_SEQ_LEN),
                                         rope_freqs)  # the file's RoPE scaling  # fmt: skip
        self.heads = (c.head_count, c.head_count_kv, c.head_dim)
        # Allocated once, never zeroed: only positions < kv_len are read.
        self.cache = torch.empty(
            c.block_count, 2, c.head_count_kv, self.max_seq_len, c.head_dim,
            dtype=KV_TYPES[self.kv_type], device=device,
        )  # fmt: skip
        self._kv_len = 0
        # Decode state: every kernel of a step reads or writes only these.
        n_ff = layers[0].w13.out_features // 2 if layers and layers[0].w13 is not None else 0
        n_qkv = layers[0].wqkv.out_features if layers else 0
        self._tok = torch.zeros(1, dtype=torch.int64, device=device)
        self._tok_host: int | None = None  # the id self._tok holds when known (greedy_step)
        self._pos = torch.zeros(1, dtype=torch.int32, device=device)
        self._h = torch.empty(1, c.embedding_length, device=device)
        self._qkv = torch.empty(n_qkv, device=device)
        self._q = torch.empty(c.q_dim, device=device)
        self._att = torch.empty(c.q_dim, device=device)
        self._g = torch.empty(n_ff, device=device)
        self._gu = torch.empty(2 * n_ff, device=device)  # gate | up, where they have a bias
        if self.moe:  # the decode step's routing and the chosen experts' outputs
            moe_ff = layers[0].experts[0][0].out_features // 2
            self._moe_logits = torch.empty(c.expert_count, device=device)
            self._moe_chosen = torch.zeros(c.expert_used_count, dtype=torch.int32, device=device)
            self._moe_weights = torch.empty(c.expert_used_count, device=device)
            self._moe_g = torch.empty(c.expert_used_count, moe_ff, device=device)
        self.merged = False  # decode="merged": the combine in the output projection's kernel
        self.decode_note = "as asked"  # why this decode (from_gguf's decode="auto" says)
        self.prefill_note = "as asked"  # why this prefill (from_gguf's prefill=None says)
        self._logits = torch.empty(1, output.n, device=device)
        self._decode_graph: torch.cuda.CUDAGraph | None = None
        self._greedy_graph: torch.cuda.CUDAGraph | None = None  # the step + its argmax
        self._decode_runs = 0
        self._device_pos = 0  # the value self._pos holds (host mirror: no read-back)
        self._prefill_graphs: OrderedDict[int, tuple] = OrderedDict()
        self._persistent = None  # a PersistentDecoder when from_gguf(decode="persistent")
        self._prefill_seen: set[int] = set()
        # the greedy loop's launch-ahead (greedy_step): pinned host words that each step's
        # argmax goes to (a word per step parity: the persistent kernel writes its count of
        # steps done in the high 32 bits and the token in the low ones, one 8-byte store; the
        # fused path's graph copies the token there), the (position, token) of the step
        # already queued, the greedy steps launched (the persistent kernel's count of steps
        # done), the fused path's graph and completion event per parity
        self.launch_ahead = True
        self._host_out = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._host_words = self._host_out.numpy().view(np.uint64)  # (no torch overhead)
        self._ahead: tuple[int, int] | None = None
        self._steps_run = 0  # mod 2^32, as the kernel's u32 count
        self._ahead_graphs: list[torch.cuda.CUDAGraph | None] = [None, None]
        self._ahead_events: list[torch.cuda.Event] | None = None

    @classmethod
    def from_gguf(
        cls,
        content,
        f: BinaryIO,
        device: DeviceLike = "cuda",
        *,
        prefill: str | None = None,
        graphs: bool = True,
        attention: str = "split",
        max_seq_len: int | None = None,
        kv_type: str | None = None,
        decode: str = "auto",
        decode_options: dict | None = None,
        pdl: bool | None = None,
    ) -> CudaFastModel:
        """Build from a parsed ``gguf_file.Content`` and its open file.

        ``prefill``: ``f32``, ``tf32``, ``bf16`` or ``packed`` (the module docstring; None:
        ``default_prefill``, f32 where its copies fit half the GPU's free memory, and
        ``prefill_note`` says which);
        ``max_seq_len``: positions the KV cache holds (None: the file's ``llama.context_length``,
        else 4096); ``kv_type``: ``f32`` (None: the default) or ``f16`` (the module docstring;
        every decode reads either); ``decode``: ``auto`` (the default: ``persistent`` where
        ``auto_decode`` says so, else ``fused``; ``decode_note`` says why), ``fused`` (six fused
        kernels per layer), ``merged`` (five:
        the attention's combine in the output projection's kernel, float atomics summing the
        heads' shares, so the last bits vary run to run) or ``persistent`` (the whole step in
        one kernel, ``qlib.quants.cuda.persistent``: a device copy of the GGUF blocks as well,
        K-quants expanded exactly to 12 bits a weight; ``decode_options`` go to its
        ``PersistentDecoder`` when it runs: ``threads``, ``split``, ``min_split``,
        ``kv_stage``, ``stage_times``, ``macros``);
        ``pdl``: programmatic dependent launch of the fused kernels (None: on where the device
        and Triton have it, ``fused.pdl_available()``)."""
        dev = as_device(device)
        if decode not in DECODE_MODES:
            raise ModelError(f"unknown decode mode {decode!r}: {', '.join(DECODE_MODES)}")
        kv_type = check_kv_type(kv_type)
        config = LlamaConfig.from_metadata(content.metadata)
        check_tensors(content, config, "f32")  # names, shapes, types (before any data is read)
        biased = bool(bias_names(content.tensor_infos))
        auto, note = decode == "auto", "as asked"
        mats = {n: KERNEL_TYPE.get(i.dtype.name, i.dtype.name)
                for n, i in content.tensor_infos.items() if len(i.shape) == 2}  # fmt: skip
        moe_file = config.expert_count > 1
        if moe_file:  # the fused kernels, the routing on the device (see below)
            if decode not in ("auto", "fused"):
                raise ModelError(f"decode {decode} has no routing for a mixture of experts "
                                 "(llama.expert_count > 1): decode fused runs it")  # fmt: skip
            decode, note = "fused", "fused: a mixture of experts routed on the device"
        elif auto:
            cc = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else (0, 0)
            decode, note = auto_decode(mats, config, cc, biased)
        elif decode == "persistent":
            from ..quants.cuda import persistent

            if dev.type != "cuda":
                raise ModelError(f"decode persistent runs on a CUDA device, not {dev.type}")
            why = persistent.unsupported(mats, config.head_dim, config.rope_dim, config.q_dim,
                                         config.embedding_length, biased)  # fmt: skip
            if why:
                raise ModelError(why)
        if max_seq_len is None:
            max_seq_len = context_length(content.metadata)
        prefill_note = "as asked"
        if prefill is None:
            free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
            prefill, prefill_note = default_prefill(content, free)
        if prefill not in PREFILL_MODES:
            raise ModelError(f"unknown prefill mode {prefill!r}: {', '.join(PREFILL_MODES)}")

        def get(name: str) -> QTensor:  # (types with Triton planes as they are)
            return kernel_form(content.tensor(f, name, dev), keep=NATIVE)

        dense = PREFILL_DTYPES.get(prefill)  # None: "packed"
        blocks = progress.layers(range(config.block_count), config.block_count)
        layers = [CudaLayer(get, f"blk.{i}", dense, config.expert_count, content.tensor_infos)
                  for i in blocks]  # fmt: skip
        tok = get("token_embd.weight")
        out = get("output.weight") if "output.weight" in content.tensor_infos else tok
        tok_p = _prepare_stacked([tok])[0]
        out_p = tok_p if out is tok else _prepare_stacked([out])[0]
        norm = get("output_norm.weight").dequantize()
        freqs = "rope_freqs.weight" in content.tensor_infos  # Llama 3.1+ RoPE scaling
        rope_freqs = get("rope_freqs.weight").dequantize() if freqs else None
        model = cls(config, tok_p, layers, norm, out_p, dev, prefill=prefill, graphs=graphs,
                    attention=attention, max_seq_len=max_seq_len,
                    rope_freqs=rope_freqs, pdl=pdl, kv_type=kv_type)  # fmt: skip
        model.merged = decode == "merged"
        model.decode_note = note
        model.prefill_note = prefill_note
        if moe_file and any(ly.expert_stacks is None for ly in layers):
            model.graphs = False  # the routing reads the choice back to the host
            model.decode_note = ("fused without CUDA graphs: a mixture of experts routes in "
                                 "torch (experts of mixed types or without kernels)")  # fmt: skip
        if decode == "persistent":
            try:
                model._persistent = _persistent_decoder(model, get, tok, out,
                                                        **(decode_options or {}))  # fmt: skip
            except ModelError as e:
                if not auto:
                    raise
                model.decode_note = f"fused: the persistent kernel failed to build ({e})"
        return model

    # -- state -------------------------------------------------------------

    def nbytes(self) -> int:
        """Bytes held by the weights (packed planes, dense prefill copies, embedding)."""
        lin = [w for ly in self.layers for w in ly.linears()]
        extra = 0 if self.output is self.tok_embd else self.output.nbytes()
        return sum(w.nbytes() for w in lin) + self.tok_embd.nbytes() + extra

    @property
    def decode(self) -> str:
        """``fused`` (six kernels per layer), ``merged`` (five) or ``persistent`` (one kernel a
        step)."""
        if self._persistent is not None:
            return "persistent"
        return "merged" if self.merged else "fused"

    def _mergeable(self, ly: CudaLayer) -> bool:
        """Whether ``decode="merged"`` merges this layer's attention combine into its output
        projection: split attention, a packed ``attn_output`` (not a dense part), head dim a
        multiple of 32 (each head's columns whole groups)."""
        return (self.merged and self.attention == "split" and self.config.head_dim % 32 == 0
                and isinstance(ly.wo.parts[0], Prepared))  # fmt: skip

    # -- decode: six fused kernels per layer -----------------------------------------------

    def _decode_kernels(self) -> None:
        """One token: ``self._tok`` at ``self._pos`` -> ``self._logits`` (device state only)."""
        from ..quants.cuda import fused

        if self._persistent is not None:  # the whole step in one kernel
            self._persistent.step(self._tok, self._pos, self._logits, self._host_out)
            return
        c, h = self.config, self._h
        eps = c.rms_norm_eps
        if self.attention == "split":
            if self._split_attention is None:
                self._split_attention = fused.SplitAttention(
                    self.heads, self.max_seq_len, self.device
                )
            attend = self._split_attention
        else:
            attend = functools.partial(fused.attn_decode, heads=self.heads)
        embed(self._tok, self.tok_embd, h)
        for i, ly in enumerate(self.layers):
            kc, vc = self.cache[i, 0], self.cache[i, 1]
            qkv = ly.wqkv.parts
            if len(qkv) == 1 and isinstance(qkv[0], Prepared) and "wqkv" not in ly.biases:
                fused.qkv_rope(h, ly.attn_norm, eps, qkv[0], self._q, kc, vc, self._pos,
                               self.cos, self.sin, heads=self.heads,
                               neox=c.rope_is_neox)  # fmt: skip
            else:  # q, k, v of different types (or none native): one GEMV each, then RoPE
                row = 0
                for p in qkv:
                    gemv(h, p, self._qkv[row : row + p.n], norm=ly.attn_norm, eps=eps)
                    row += p.n
                if "wqkv" in ly.biases:  # (before RoPE, as llama.cpp adds it)
                    self._qkv += ly.biases["wqkv"]
                fused.rope_store(self._qkv[None], self._q[None], kc, vc, self._pos, self.cos,
                                 self.sin, heads=self.heads, neox=c.rope_is_neox)  # fmt: skip
            if self._mergeable(ly):  # h is read by no kernel while the heads' shares land
                attend.split(self._q, kc, vc, self._pos)
                attend.combine_wo(ly.wo.parts[0], h, self._att, self._pos)
            else:
                attend(self._q, kc, vc, self._att, self._pos)
                gemv(self._att, ly.wo.parts[0], h, epilogue=EPI_ADD)
            if "wo" in ly.biases:
                h += ly.biases["wo"]
            if ly.expert_stacks is not None:  # a mixture of experts routed on the device
                gate_up, down = ly.expert_stacks
                gemv(h, ly.router.parts[0], self._moe_logits, norm=ly.ffn_norm, eps=eps)
                fused.moe_route(self._moe_logits, self._moe_chosen, self._moe_weights)
                fused.experts_gemv(h, gate_up, self._moe_g, self._moe_chosen, c.expert_count,
                                   norm=ly.ffn_norm, eps=eps)  # fmt: skip
                fused.experts_gemv(self._moe_g, down, h, self._moe_chosen, c.expert_count,
                                   weights=self._moe_weights)  # fmt: skip
                continue
            if ly.experts is not None:  # routed in torch (reads the choice back: no graphs)
                h += ly.experts_ffn(F.rms_norm(h, (c.embedding_length,), ly.ffn_norm, eps),
                                    c.expert_used_count)  # fmt: skip
                continue
            if "w13" in ly.biases:  # gate | up, + their bias, then SwiGLU
                row, gu, n_ff = 0, self._gu, self._g.numel()
                for p in ly.w13.parts:
                    gemv(h, p, gu[row : row + p.n], norm=ly.ffn_norm, eps=eps)
                    row += p.n
                gu += ly.biases["w13"]
                torch.mul(F.silu(gu[:n_ff]), gu[n_ff:], out=self._g)
            elif len(ly.w13.parts) == 1:
                gemv(h, ly.w13.parts[0], self._g, norm=ly.ffn_norm, eps=eps, epilogue=EPI_SWIGLU)
            else:
                gate, up = ly.w13.parts
                gemv(h, gate, self._g, norm=ly.ffn_norm, eps=eps)
                gemv(h, up, self._g, norm=ly.ffn_norm, eps=eps, epilogue=EPI_GATE)
            gemv(self._g, ly.w2.parts[0], h, epilogue=EPI_ADD)
            if "w2" in ly.biases:
                h += ly.biases["w2"]
        gemv(h, self.output, self._logits, norm=self.norm, eps=eps)

    def _decode_step(self) -> None:
        """The decode kernels, then the device position moves to the next one."""
        from ..quants.cuda import fused

        with fused.launch_mode(self.pdl):
            self._decode_kernels()
        if self._persistent is None:  # (the persistent kernel advances it itself)
            self._pos.add_(1)

    def _run_step(
        self, kernels, pos: int, graph: torch.cuda.CUDAGraph | None
    ) -> torch.cuda.CUDAGraph | None:
        """``kernels`` (a decode step's launches) at position ``pos``: eagerly on the first step
        (it compiles them), then replaying ``graph``, captured here when None; returns it."""
        if pos != self._device_pos:  # after a prefill or a restart; a step advances it itself
            self._pos.fill_(pos)
        if not self.graphs or self._decode_runs == 0:
            kernels()
        else:
            if graph is None:
                graph = self._capture(kernels)
            graph.replay()
        self._decode_runs += 1
        self._device_pos = pos + 1
        return graph

    def _decode(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        self._tok.copy_(token.reshape(1), non_blocking=True)
        self._tok_host = None
        self._decode_graph = self._run_step(self._decode_step, pos, self._decode_graph)
        return self._logits.clone()

    def _greedy_step_kernels(self, slot: int | None = None) -> None:
        """The decode step, then the argmax of its logits into ``self._tok`` (the next input)
        and, given ``slot`` (the fused path's launch-ahead), into that host word (the
        persistent kernel writes both itself, its word by the step's parity)."""
        if self._persistent is not None:  # its last block writes the argmax into the input
            self._persistent.step(self._tok, self._pos, self._logits, self._host_out, self._tok)
        else:
            self._decode_step()
            torch.argmax(self._logits, dim=1, out=self._tok)
            if slot is not None:
                self._host_out[slot : slot + 1].copy_(self._tok, non_blocking=True)

    def clear_kv_cache(self) -> None:
        self._ahead = None
        super().clear_kv_cache()

    def greedy_step(self, token: int, index_pos: int) -> int:
        """``forward`` of one token at ``index_pos``, then the argmax of its logits (the next
        greedy token, read back to the host), all on the device: the argmax runs inside the
        step's CUDA graph and only its id comes back, not the logits. The id stays on the
        device as the next input, so a caller that feeds it back sends nothing there.

        With CUDA graphs and ``launch_ahead`` (the default) the step after this one is queued
        before this one's id is read (from pinned host memory: the persistent kernel writes it
        there, the fused path's graph copies it), so the GPU never waits for the host between
        greedy steps: when the caller feeds the id back at the next position, that step is
        already running; any other call lets it finish unused (it wrote only the KV row of a
        position past ``kv_len``)."""
        check_positions(index_pos, 1, self._kv_len, self.max_seq_len)
        check_token_ids(token, token, self.vocab_size)
        with span("model"):
            if self.graphs and self.launch_ahead:
                return self._greedy_ahead(token, index_pos)
            self._ahead = None
            if token != self._tok_host:
                self._tok.fill_(token)
            self._greedy_graph = self._run_step(self._greedy_step_kernels, index_pos,
                                                self._greedy_graph)  # fmt: skip
            self._kv_len = index_pos + 1
            self._tok_host = int(self._tok.item())
        return self._tok_host

    def _greedy_ahead(self, token: int, index_pos: int) -> int:
        """``greedy_step`` with the next step launched before this one's id is read."""
        if self._ahead != (index_pos, token):  # not the step queued last time: start here
            self._ahead = None
            if self._persistent is not None:  # the kernel's count (a sync)
                self._steps_run = int(self._persistent.steps.item()) & STEPS_MASK
            if token != self._tok_host:
                self._tok.fill_(token)
            self._launch_greedy(index_pos)
        this = self._steps_run  # this step's count once done
        self._kv_len = index_pos + 1
        ahead = index_pos + 1 < self.max_seq_len
        if ahead:  # its input is this step's argmax, written on the device
            self._launch_greedy(index_pos + 1)
        token = self._host_token(this)
        self._ahead, self._tok_host = ((index_pos + 1, token), None) if ahead else (None, token)
        return token

    def _launch_greedy(self, pos: int) -> None:
        if self._persistent is not None:  # one graph: the kernel picks the words by parity
            self._greedy_graph = self._run_step(self._greedy_step_kernels, pos,
                                                self._greedy_graph)  # fmt: skip
        else:  # a graph and an event per parity: the token copied into that pair of words
            parity = self._steps_run & 1
            if self._ahead_events is None:
                self._ahead_events = [torch.cuda.Event(), torch.cuda.Event()]
            kernels = functools.partial(self._greedy_step_kernels, slot=parity)
            self._ahead_graphs[parity] = self._run_step(kernels, pos, self._ahead_graphs[parity])
            self._ahead_events[parity].record()
        self._steps_run = (self._steps_run + 1) & STEPS_MASK

    def _host_token(self, count: int) -> int:
        """The argmax of the greedy step launched as the ``count``-th, from the host words it
        writes (the persistent kernel's count there, else the step's event; spinning until
        done; an error of the stream raises)."""
        words, slot = self._host_words, (count - 1) & 1
        if self._persistent is None:
            event = self._ahead_events[slot]
            while not event.query():
                pass
            return int(words[slot])
        spins = 0
        while int(words[slot]) >> 32 != count:
            spins += 1
            if spins % 4096 == 0 and torch.cuda.current_stream(self.device).query():
                if int(words[slot]) >> 32 != count:  # every queued step is done: none wrote
                    raise RuntimeError(f"the persistent decode step {count} wrote no token")
        return int(words[slot]) & STEPS_MASK

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    # -- prefill -----------------------------------------------------------------------------

    def _prefill_rows(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        """Tokens ``ids`` (int64 ``[t]`` on the device) from ``pos`` (``self._pos`` holds it)."""
        from ..quants.cuda import fused, kernels

        c = self.config
        t, end = ids.numel(), pos + ids.numel()
        nq, nkv, hd = self.heads
        eps, dims, group = c.rms_norm_eps, (c.embedding_length,), nq // nkv
        # the attention's dtype: bf16 (flash attention) in the bf16 mode, else float32
        adt = torch.bfloat16 if self.prefill == "bf16" else torch.float32
        h = torch.empty(t, c.embedding_length, device=self.device)
        embed(ids, self.tok_embd, h)
        mask = None
        if pos:  # a chunk after a prefix: row i sees columns <= pos + i
            cols = torch.arange(end, device=self.device)
            mask = cols[None, :] <= torch.arange(t, device=self.device)[:, None] + pos
        for i, ly in enumerate(self.layers):
            kc, vc = self.cache[i, 0], self.cache[i, 1]
            qkv = ly.add_bias("wqkv", ly.wqkv.matmul(F.rms_norm(h, dims, ly.attn_norm, eps)))
            q = torch.empty(t, nq * hd, device=self.device)
            fused.rope_store(qkv, q, kc, vc, self._pos, self.cos, self.sin, heads=self.heads,
                             neox=c.rope_is_neox)  # fmt: skip
            if adt == torch.float32:  # the float32 kernels take GQA as repeated K/V heads
                k, v = kc[:, None, :end].float(), vc[:, None, :end].float()  # (f16: a copy)
                k = k.expand(nkv, group, end, hd).reshape(nq, end, hd)
                v = v.expand(nkv, group, end, hd).reshape(nq, end, hd)
            else:
                k, v = kc[:, :end].to(adt), vc[:, :end].to(adt)
            y = F.scaled_dot_product_attention(
                q.view(t, nq, hd).transpose(0, 1)[None].to(adt), k[None], v[None],
                attn_mask=mask, is_causal=mask is None, scale=1.0 / math.sqrt(hd),
                enable_gqa=k.shape[0] != nq,
            )  # fmt: skip
            h = h + ly.add_bias("wo", ly.wo.matmul(y[0].transpose(0, 1).reshape(t, nq * hd)))
            if ly.experts is not None:
                h = h + ly.experts_ffn(F.rms_norm(h, dims, ly.ffn_norm, eps), c.expert_used_count)
                continue
            gu = ly.add_bias("w13", ly.w13.matmul(F.rms_norm(h, dims, ly.ffn_norm, eps)))
            n_ff = gu.shape[1] // 2
            h = h + ly.add_bias("w2", ly.w2.matmul(F.silu(gu[:, :n_ff]) * gu[:, n_ff:]))
        if all_logits:
            out = self.output
            w = out.w if isinstance(out, DenseWeight) else kernels.dequantize(out, torch.float32)
            return F.rms_norm(h, dims, self.norm, eps) @ w.t()  # (transient: exact values)
        logits = torch.empty(1, self.output.n, device=self.device)
        gemv(h[t - 1], self.output, logits, norm=self.norm, eps=eps)
        return logits

    def _matmul_precision(self) -> contextlib.AbstractContextManager:
        """TF32 tensor cores for float32 matmuls while a ``tf32`` prefill runs (restored after)."""
        if self.prefill != "tf32":
            return contextlib.nullcontext()
        return _fp32_precision("tf32")

    def _prefill(self, ids: torch.Tensor, pos: int, all_logits: bool) -> torch.Tensor:
        self._pos.fill_(pos)
        self._device_pos = pos
        t = ids.numel()
        # (a mixture of experts' prefill routes in torch, reading the choice back: no graph)
        if not self.graphs or self.moe or pos != 0 or all_logits or t not in self._prefill_seen:
            self._prefill_seen.add(t)
            with self._matmul_precision():
                return self._prefill_rows(ids, pos, all_logits)
        entry = self._prefill_graphs.get(t)
        if entry is None:
            with torch.inference_mode(False):  # (a graph made under generate's inference mode
                static_ids = ids.clone()  # takes prompts outside it too)
            out: list[torch.Tensor] = []
            with self._matmul_precision():  # the captured cuBLAS kernels keep their math mode
                graph = self._capture(lambda: out.append(self._prefill_rows(static_ids, 0, False)))
            entry = (graph, static_ids, out[0])
            self._prefill_graphs[t] = entry
            while len(self._prefill_graphs) > GRAPH_CACHE:
                self._prefill_graphs.popitem(last=False)
        graph, static_ids, logits = entry
        self._prefill_graphs.move_to_end(t)
        static_ids.copy_(ids)
        graph.replay()
        return logits.clone()

    # -- the forward pass ----------------------------------------------------

    def forward(self, x: torch.Tensor, index_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``x`` (``(1, seq_len)``) from ``index_pos``: ``(1, vocab)``.

        ``all_logits=True`` gives every position: ``(1, seq_len, vocab)``.
        """
        t = self.check_input(x, index_pos)
        ids = x.reshape(-1).to(self.device, torch.int64)
        self._ahead = None  # a greedy step queued ahead runs first (stream order), unused
        with span("model"):
            if t == 1:
                logits = self._decode(ids, index_pos)
            else:
                logits = self._prefill(ids, index_pos, all_logits)
        self._kv_len = index_pos + t
        return logits[None] if all_logits else logits

    __call__ = forward
