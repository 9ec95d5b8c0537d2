"""Typed, checked Python entry points for every C kernel (the only module that calls them).

The C signatures are declared here (``load()``); each C entry point has one wrapper that
takes tensors, checks dtypes, shapes and contiguity, and turns the C flags into keyword
arguments:

* ``kernels.c`` and ``kquants.c``: ``repack``, ``dequantize_bf16``, ``qgemm`` (the quantized
  GEMM/GEMV with ggml semantics, optionally RmsNorm or SwiGLU of its input and a residual
  add: ``qlib_qgemm_ex`` for repacked planes, ``qlib_kgemm`` for GGUF blocks), and the
  decode attention step (``attn_decode_plan``);
* ``prefill.c``: ``add_rmsnorm``, ``swiglu_bf16``, ``attn_prefill``, and with AMX
  ``amx_gemm`` and the whole stack of prefill layers (``prefill_layers``); ``exp`` (a test
  hook).

**Plans.** The decode step makes ~5 calls per layer per token, so its wrappers are split:
``qgemm_plan`` and ``attn_decode_plan`` check everything once and return a ``KernelCall``,
a ``functools.partial`` of the C function with every argument bound (no Python frame
between the caller and ctypes). What changes per token is not an argument: the position
and RoPE rows live in a ``DecodePosition`` that all attention plans of a model share, set
once per token by ``DecodePosition.at(pos)``. A plan holds raw pointers: it keeps
references to its tensors, which must not be resized or reallocated while it is used.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import torch

from ..types import ggml_type
from . import build
from .layout import (
    BLOCK_CODES,
    BLOCKS,
    K_PANEL_RECORD,
    M_WORDS,
    PANEL_RECORD,
    PANELS,
    ROW_MULTIPLE,
    TYPE_CODES,
    AmxWeight,
    AmxWeightC,
    PackedWeight,
)

T = TypeVar("T")
KernelCall = Callable[[], int]
"""A prepared C call: all arguments bound; returns the kernel's status (0: done)."""

AMX_EPILOGUES = {"bf16": 0, "add": 1, "swiglu": 2}  # amx_gemm's epilogues in prefill.c
_BLOCK_BYTES = {
    "Q4_0": 18,
    "Q4_1": 20,
    "Q5_0": 22,
    "Q5_1": 24,
    "Q8_0": 34,
    "IQ4_NL": 18,
    "MXFP4H": 18,
    "NVFP4H": 20,
    "Q1_0H": 6,
}  # GGUF (MXFP4H, NVFP4H, Q1_0H: qlib's), 32 values

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# name: (argument types, result type); the qlib_amx_* / qlib_prefill_layers entries exist
# only in a build with AMX (``qlib_amx_init`` is always there)
_SIGNATURES = {
    "qlib_qgemm_ex": ([_i, _p, _p, _p, _i, _i, _p, _i, _p, _p, _f, _i, _i], _i),
    "qlib_kgemm": ([_i, _p, _i, _i, _p, _i, _p, _p, _f, _i, _i], _i),
    "qlib_qgemm_set_min_rows": ([_i], None),
    "qlib_gemv_set_prefetch": ([_i, _i], None),
    "qlib_decode_set_prefetch": ([_i], None),
    "qlib_gemv_set_seq_k": ([_i], None),
    "qlib_gemv_set_panel_prefetch": ([_i], None),
    "qlib_gemv_set_act_prefetch": ([_i], None),
    "qlib_kgemv_set_prefetch": ([_i], None),
    "qlib_kpanel_set_prefetch": ([_i], None),
    "qlib_kpanel_put": ([_i, _p, _i, _i, _p, _i], _i),
    "qlib_x4_from_blocks": ([_i, _p, ctypes.c_int64, _p, _p, _p, _p], _i),
    "qlib_x3_from_blocks": ([_i, _p, ctypes.c_int64, _p, _p, _p, _p], _i),
    "qlib_legacy_from_blocks": ([_i, _p, ctypes.c_int64, _p], _i),
    "qlib_mxfp4h_from_blocks": ([_p, ctypes.c_int64, _p], _i),
    "qlib_nvfp4h_from_blocks": ([_p, ctypes.c_int64, _p], _i),
    "qlib_q1_0h_from_blocks": ([_p, ctypes.c_int64, _p], _i),
    "qlib_kpanel_get": ([_i, _p, _i, _i, _p, _i, _p], _i),
    "qlib_dequant_rows": ([_i, _p, _i, _i, _p, _i, _p], _i),
    "qlib_attn_set_two_pass": ([_i], None),
    "qlib_attn_set_prefetch": ([_i], None),
    "qlib_attn_decode": ([_p, _p, _p, _i, _i, _i, _i, _i, _p, _p, _i, _p], _i),
    "qlib_attn_decode_kv": ([_p, _p, _p, _i, _i, _i, _i, _i, _p, _p, _i, _p, _i, _i], _i),
    "qlib_repack": ([_i, _p, _i, _i, _p, _p, _p], None),
    "qlib_dequant_bf16": ([_i, _p, _p, _p, _i, _i, _p], None),
    "qlib_add_rmsnorm": ([_p, _p, _i, _i, _p, _f, _p, _i], None),
    "qlib_swiglu_bf16": ([_p, _i, _i, _p], None),
    "qlib_attn_prefill_ex": ([_p, _i, _p, _p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i], _i),
    "qlib_attn_prefill_flash": ([_p, _i, _i, _p, _p, _i, _i, _i, _i, _i, _p, _p, _i, _i, _p, _i,
                                 _i, _i], _i),
    "qlib_swiglu_f32": ([_p, _i, _i, _p], None),
    "qlib_attn_set_rows": ([_i], None),
    "qlib_exp": ([_p, _i, _p], None),
    "qlib_exp_diff": ([_p, _i, _f, _p], None),
    "qlib_decode_run": ([_p, _i, _i], _i),
    "qlib_decode_set_times": ([_p], None),
    "qlib_amx_init": ([], _i),
    "qlib_amx_gemm": ([_p, _i, _i, _i, _p, _p, _p, _i, _i, _p, _i], _i),
    "qlib_prefill_set_times": ([_p, _i], None),
    "qlib_prefill_phases": ([], _i),
    "qlib_prefill_layers": ([_p, _i, _i, _i, _p, _f, _p, _i, _i, _p, _p, _p, _p, _p, _i, _i,
                             _i, _i, _i, _p, _p, _i, _i], _i),
}  # fmt: skip
_AMX_ONLY = ("qlib_amx_gemm", "qlib_prefill_layers", "qlib_prefill_set_times",
             "qlib_prefill_phases")  # fmt: skip

_declared: ctypes.CDLL | None = None
_amx: bool | None = None


def load() -> ctypes.CDLL | None:
    """The compiled library with its C signatures declared, or None (see
    ``build.unavailable_reason``)."""
    global _declared
    lib = build.load_library()
    if lib is not None and lib is not _declared:
        for name, (argtypes, restype) in _SIGNATURES.items():
            if name in _AMX_ONLY and not hasattr(lib, name):
                continue
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
        _declared = lib
    return lib


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"C kernels unavailable: {build.unavailable_reason()}")
    return lib


GEMM_MIN_ROWS = 4
"""From this many rows ``qgemm`` takes the kernels' tiled (GEMM) path: a tile of weight rows
re-laid once per call, times several activation rows (the prefill); below it, the GEMV
loops (decode). Both sum the same exact integer block dots (ggml semantics); only the
float32 order of the per-block terms differs, so their outputs agree to float rounding.
Within one path a row's result never depends on the other rows."""


def set_gemm_min_rows(rows: int) -> None:
    """Sets the row count from which ``qgemm`` takes the tiled path (tests: 1 forces it,
    a huge value forces the GEMV loops); ``GEMM_MIN_ROWS`` is the default."""
    lib = _lib()
    lib.qlib_qgemm_set_min_rows(int(rows))


def set_gemv_prefetch(spread: bool = True, spread_k: int = 0) -> None:
    """How the Q4_0 / Q4_1 / Q8_0 GEMV prefetches the codes two groups of rows ahead (an A/B
    hook; results are the same): ``spread`` (the default) a few lines per block step for rows
    of ``k >= spread_k``, else one burst per group (the earlier kernel)."""
    _lib().qlib_gemv_set_prefetch(int(spread), int(spread_k))


def set_gemv_sequential(max_k: int = 1 << 30) -> None:
    """Q8_0 GEMV rows of ``k <= max_k`` (by default every k) are taken one after the other
    without software prefetch, longer ones and the 4-bit types 4 rows side by side (an A/B
    hook; results are the same; 0: every type 4 rows side by side)."""
    _lib().qlib_gemv_set_seq_k(int(max_k))


def set_panel_prefetch(distance: int = -1) -> None:
    """Bytes ahead of a thread's stream that the GEMV over panels prefetches into L1 (an A/B
    hook; results are the same; -1, the default: by the CPU's vendor, AMD 0, else 4,096)."""
    _lib().qlib_gemv_set_panel_prefetch(int(distance))


def set_act_prefetch(on: bool = True) -> None:
    """Whether the GEMVs over panels prefetch the activation row's next codes and scales into
    L1 as they go (an A/B hook; results are the same; on by default)."""
    _lib().qlib_gemv_set_act_prefetch(int(on))


def set_kgemv_prefetch(groups: int = 2) -> None:
    """How many groups of 4 rows ahead the decode step's K-quant GEMV prefetches into L2 (an
    A/B hook; results are the same; 0: none)."""
    _lib().qlib_kgemv_set_prefetch(int(groups))


def set_kpanel_prefetch(distance: int = -1) -> None:
    """Bytes ahead of a thread's stream that the GEMV over Q4_K panels prefetches into L2 (an
    A/B hook; results are the same; -1, the default: by the CPU's vendor, AMD 0, else two
    panel records, 4,736)."""
    _lib().qlib_kpanel_set_prefetch(int(distance))


def set_attn_two_pass(on: int = -1) -> None:
    """Whether the decode attention over a float32 cache reads a piece's keys, then its values
    (1), or both side by side in one pass (0); -1 (the default): by the CPU's vendor, AMD 1
    (an A/B hook; the two differ by float rounding)."""
    _lib().qlib_attn_set_two_pass(int(on))


def set_attn_prefetch(rows: int = 16) -> None:
    """How many positions ahead the three-pass decode attention over a float32 cache
    prefetches its keys (an A/B hook; results are the same; 0: none)."""
    _lib().qlib_attn_set_prefetch(int(rows))


def set_decode_prefetch(groups: int = 8) -> None:
    """How many groups of 4 rows of the next GEMV each thread of the one-region decode step
    prefetches into L2 before a step (an A/B hook; results are the same; 0: none)."""
    _lib().qlib_decode_set_prefetch(int(groups))


def amx_available() -> bool:
    """Whether the AMX (bf16 tiles) prefill kernels can run: the CPU has AMX-BF16, the
    library was built with it, Linux granted the tile state, and ``QLIB_NO_AMX`` is unset."""
    global _amx
    if _amx is None:
        lib = load()
        _amx = bool(
            lib is not None
            and not build.env_flag("QLIB_NO_AMX")
            and set(build.AMX_FLAGS) <= build.cpu_flags()
            and hasattr(lib, "qlib_prefill_layers")
            and lib.qlib_amx_init() == 0
        )
    return _amx


def amx_unavailable_reason() -> str | None:
    """Why ``amx_available()`` is False (None when it is True)."""
    if amx_available():
        return None
    if load() is None:
        return f"no C kernels: {build.unavailable_reason()}"
    if build.env_flag("QLIB_NO_AMX"):
        return "disabled by QLIB_NO_AMX"
    if not set(build.AMX_FLAGS) <= build.cpu_flags():
        return "the CPU lacks AMX-BF16 or AVX512-BF16"
    if build.amx_build_error():
        return build.amx_build_error()
    return "Linux did not grant the AMX tile state (arch_prctl)"


# -- checks ------------------------------------------------------------------------------


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype}")


def _panel_bytes(w: PackedWeight) -> int | None:
    """The bytes of a panel weight's codes (kernels.c's Q4_0 / Q4_1 / Q8_0 records per 32,
    kquants.c's Q4_K records per 256), or None where its type and shape have no panels."""
    if w.n % 16:
        return None
    if w.type_name in PANEL_RECORD and w.k % 64 == 0:
        return w.n // 16 * (w.k // 32) * PANEL_RECORD[w.type_name]
    if w.type_name in K_PANEL_RECORD and w.k % 256 == 0:
        return w.n // 16 * (w.k // 256) * K_PANEL_RECORD[w.type_name]
    return None


def _check_packed(w: PackedWeight) -> None:
    if w.panels:  # 16-row panels (kernels.c; Q4_K: kquants.c)
        size = _panel_bytes(w)
        if size is None:
            raise ValueError(f"PackedWeight: panels are Q4_0 / Q4_1 / Q8_0 / Q4_K of n % 16 "
                             f"== 0, not {w.type_name} of n={w.n}, k={w.k}")  # fmt: skip
        _check(w.codes, torch.uint8, "codes")
        if w.codes.numel() != size or w.d is not None or w.m is not None:
            raise ValueError("PackedWeight: panels do not match n, k (and have no d, m)")
        return
    if w.blocks:  # GGUF blocks for kquants.c
        elements, nbytes = BLOCKS[w.type_name]
        if w.k % ROW_MULTIPLE[w.type_name]:
            raise ValueError(f"no C kernel for {w.type_name} with k={w.k}")
        _check(w.codes, torch.uint8, "codes")
        size = w.n * (w.k // elements) * nbytes
        if w.codes.numel() != size or w.d is not None or w.m is not None:
            raise ValueError("PackedWeight: GGUF blocks do not match n, k (and have no d, m)")
        return
    if w.type_name not in TYPE_CODES or w.k % 64:
        raise ValueError(f"no C kernel for {w.type_name} with k={w.k} (needs k % 64 == 0)")
    row = w.k if w.type_name == "Q8_0" else w.k // 2
    _check(w.codes, torch.uint8, "codes")
    _check(w.d, torch.int16, "d")
    if w.codes.numel() != w.n * row or w.d.numel() != w.n * (w.k // 32):
        raise ValueError("PackedWeight: planes do not match n, k")
    if (w.m is not None) != (w.type_name in M_WORDS):
        raise ValueError("PackedWeight: m is for Q4_1, Q5_0 and Q5_1 only, and they need it")
    if w.m is not None:
        _check(w.m, torch.int16, "m")
        if w.m.numel() != w.d.numel() * M_WORDS[w.type_name]:
            raise ValueError("PackedWeight: m must hold M_WORDS int16 a block")


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _prepared(fn, *args, keep: tuple, step: DecodeStepC | None = None) -> KernelCall:
    """``fn`` with ``args`` bound, holding ``keep`` (the tensors the pointers point into);
    ``steps``: the call as ``decode_chain`` steps (None: it has none)."""
    call = partial(fn, *args)
    call.keep = keep
    call.steps = (step,) if step is not None else None
    return call


# -- decode.c: the whole decode step in one C call -----------------------------------------

STEP_QGEMV, STEP_KGEMV, STEP_ATTN, STEP_MOE, STEP_ADD = 1, 2, 3, 4, 5  # decode.c's qlib_step.kind
MAX_EXPERTS = 256  # decode.c's: the most experts a MoE step routes over
DECODE_MODES = {"c": 0, "region": 1}  # qlib_decode_run's modes (see decode_chain)


class DecodeStepC(ctypes.Structure):
    """``qlib_step`` of decode.c: one prepared GEMV, attention, mixture-of-experts or add step
    (raw pointers: the plan that made it keeps its tensors)."""


DecodeStepC._fields_ = [
    ("kind", _i), ("type", _i), ("w", _p), ("d", _p), ("m", _p), ("n", _i), ("k", _i),
    ("x", _p), ("y", _p), ("norm", _p), ("eps", _f), ("swiglu", _i), ("accumulate", _i),
    ("kc", _p), ("vc", _p), ("pos", _p), ("cos_row", _p), ("sin_row", _p),
    ("n_head", _i), ("n_kv", _i), ("head_dim", _i), ("max_seq", _i), ("neox", _i),
    ("kv_f16", _i), ("split", _i),
    ("experts", ctypes.POINTER(DecodeStepC)), ("first", _p), ("outs", _p), ("chosen", _p),
    ("weights", _p), ("n_used", _i),
]  # fmt: skip


class DecodeChain:
    """Prepared calls with steps (``call.steps``: ``qgemm_plan``, ``attn_decode_plan``,
    ``FastLinear.plan`` of C parts), then optionally a ``qgemm_alloc_plan`` (``output``: the
    logits), run in order by ONE C call (``qlib_decode_run``):

    * ``mode="c"``: each step is its kernel's own entry point, called from C (the Python
      loop of the same calls without its ctypes cost, ~4 us a call);
    * ``mode="region"``: one OpenMP parallel region for all steps, each kernel's loop shared
      out over the team with a barrier after it (no fork/join per call), the scratch
      allocated once per run.

    Both are bit-identical to calling the plans one by one. Calling it runs the steps and
    returns the new ``[m, n]`` output of ``output`` (None without one); MemoryError when a
    kernel could not allocate its scratch."""

    def __init__(self, calls: list[KernelCall], mode: str = "region",
                 output: Callable[[], torch.Tensor] | None = None):  # fmt: skip
        if mode not in DECODE_MODES:
            raise ValueError(f"DecodeChain: mode {mode!r} ({', '.join(DECODE_MODES)})")
        owned = [(i, s) for i, c in enumerate([*calls, *([output] if output is not None else [])])
                 for s in chain_steps(c)]  # fmt: skip
        steps = [s for _, s in owned]
        self.owners = [i for i, _ in owned]  # the call of each step (len(calls): the output's)
        self.mode = mode
        self.keep = (tuple(calls), output)
        self._array = (DecodeStepC * len(steps))(*steps)
        self._shape = output.shape if output is not None else None
        self._last = self._array[len(steps) - 1] if steps else None  # a view into _array
        self._call = partial(_lib().qlib_decode_run, self._array, len(steps), DECODE_MODES[mode])

    def __len__(self) -> int:
        return len(self._array)

    def __call__(self, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Run the chain: the output layer's result (into ``out`` when given, else a new
        tensor), or None where the chain has no output step."""
        y = None
        if self._shape is not None:
            if out is not None:
                _check(out, torch.float32, "out")
                if out.shape != self._shape:
                    raise ValueError(f"DecodeChain: out {list(out.shape)}, not {list(self._shape)}")
            y = out if out is not None else torch.empty(self._shape)
            self._last.y = y.data_ptr()
        if self._call():
            raise MemoryError("the C decode step: out of memory")
        return y

    def step_seconds(self) -> tuple[torch.Tensor | None, list[float]]:
        """Run once (``mode="region"``): the output as calling it gives, and each step's
        seconds, thread 0's clock after each step's closing barrier (``owners[i]``: the call
        of step i)."""
        if self.mode != "region":
            raise ValueError("step_seconds: a region chain (mode='region')")
        times = (ctypes.c_double * len(self._array))()
        lib = _lib()
        lib.qlib_decode_set_times(times)
        try:
            y = self()
        finally:
            lib.qlib_decode_set_times(None)
        return y, list(times)


def chain_steps(call: KernelCall) -> tuple[DecodeStepC, ...]:
    """The ``DecodeChain`` steps of a prepared call (ValueError: it has torch parts or no C
    steps)."""
    steps = getattr(call, "steps", None)
    if steps is None:
        raise ValueError("a prepared call without C steps (torch parts)")
    return steps


def has_steps(call: KernelCall) -> bool:
    """Whether a prepared call can run in a ``DecodeChain``."""
    return getattr(call, "steps", None) is not None


# -- kernels.c: repacking, the quantized GEMM/GEMV, decode attention -----------------------


def repack(type_name: str, blocks: torch.Tensor, k: int, codes: torch.Tensor,
           d: torch.Tensor | None, m: torch.Tensor | None,
           panels: bool = False) -> None:  # fmt: skip
    """GGUF blocks (``blocks``: the uint8 bytes of ``[n, k/32]`` blocks) -> the planes of a
    ``PackedWeight`` of ``n = codes.shape[0]`` rows, written into ``codes``, ``d``, ``m``;
    with ``panels`` (Q4_0 / Q4_1 / Q8_0) its panels, ``n = 16 codes.shape[0]``, into
    ``codes``."""
    lib = _lib()
    n = codes.shape[0] * (16 if panels else 1)
    _check(blocks, torch.uint8, "blocks")
    if type_name not in TYPE_CODES or k % 64:
        raise ValueError(f"repack: no C kernel for {type_name} with k={k} (k % 64 == 0)")
    if blocks.numel() != n * (k // 32) * _BLOCK_BYTES[type_name]:
        raise ValueError(f"repack: {n} rows of {type_name} blocks, k={k} (k % 64 == 0)")
    w = PackedWeight(type_name, n, k, codes, d, m, panels)
    _check_packed(w)
    lib.qlib_repack(w.type_code, blocks.data_ptr(), n, k, codes.data_ptr(), _ptr(d), _ptr(m))


def kpanels_put(type_name: str, blocks: torch.Tensor, k: int, panels: torch.Tensor,
                j0: int) -> None:  # fmt: skip
    """GGUF Q4_K blocks (the uint8 bytes of rows of ``k / 256`` blocks) -> rows ``j0 ..`` of
    the 16-row panels ``panels`` (``[n / 16, k / 256 * K_PANEL_RECORD]`` uint8)."""
    _check(blocks, torch.uint8, "blocks")
    _check(panels, torch.uint8, "panels")
    row_bytes = k // 256 * BLOCKS[type_name][1] if type_name in K_PANEL_RECORD else 0
    if not row_bytes or k % 256 or blocks.numel() % row_bytes:
        raise ValueError(f"kpanels_put: no panels for {type_name} rows of k={k}")
    rows = blocks.numel() // row_bytes
    if (j0 + rows + 15) // 16 * (k // 256) * K_PANEL_RECORD[type_name] > panels.numel():
        raise ValueError(f"kpanels_put: rows {j0}..{j0 + rows} past the panels")
    if _lib().qlib_kpanel_put(BLOCK_CODES[type_name], blocks.data_ptr(), rows, k,
                              panels.data_ptr(), j0):  # fmt: skip
        raise ValueError(f"kpanels_put: {type_name} rows of k={k}")


def x4_from_blocks(type_name: str, blocks: torch.Tensor, grid: torch.Tensor,
                   index: torch.Tensor, levels: torch.Tensor,
                   out: torch.Tensor, kind: str = "X4") -> bool:  # fmt: skip
    """GGUF blocks of a grid i-quant, ternary type or NVFP4 (uint8 ``[n, block bytes]``) -> X4
    blocks (``out``, uint8 ``[n / per, 164]``, ``per`` GGUF blocks a 256 weights), as
    ``gridquants.as_x4`` makes them (``gridx4.c``), or with ``kind`` X3 X3 blocks (``[n / per,
    124]``, as ``gridquants.x3_from_x4`` makes them of those; the types of ``X3_TYPES``):
    ``grid`` the type's grid (int8 rows; any int8 tensor for the others), ``index[c + 128]``
    the level index of code ``c`` (16: none) and ``levels`` the 16 level bytes (uint8). False,
    for NVFP4 scales that no one unit holds (the caller takes another form); a ``ValueError``
    for a block with a non-finite d or a code outside the levels."""
    t = ggml_type(type_name)
    for name, tensor, dtype in (("blocks", blocks, torch.uint8), ("grid", grid, torch.int8),
                                ("index", index, torch.uint8), ("levels", levels, torch.uint8),
                                ("out", out, torch.uint8)):  # fmt: skip
        _check(tensor, dtype, name)
    size = t.type_size * 256 // t.block_size
    n = blocks.numel() // size
    if blocks.numel() != n * size or out.numel() != n * BLOCKS[kind][1]:
        raise ValueError(f"x4_from_blocks: {blocks.numel()} bytes of {t.name} blocks for "
                         f"{out.numel()} bytes of {kind} blocks")  # fmt: skip
    if index.numel() != 256 or levels.numel() != 16:
        raise ValueError("x4_from_blocks: index needs 256 entries and levels 16")
    convert = _lib().qlib_x3_from_blocks if kind == "X3" else _lib().qlib_x4_from_blocks
    status = convert(t.id, blocks.data_ptr(), n, grid.data_ptr(), index.data_ptr(),
                     levels.data_ptr(), out.data_ptr())  # fmt: skip
    if status == -1:
        raise ValueError(f"x4_from_blocks: no X4 decoder for {t.name}")
    if status == -4:
        return False
    if status == -5:
        raise ValueError(f"x4_from_blocks: {t.name} has more than 8 levels: no X3 blocks")
    if status:
        raise ValueError(f"{t.name} blocks with a scale that is no whole multiple of their d "
                         "(a non-finite or corrupt d)")  # fmt: skip
    return True


def legacy_from_blocks(type_name: str, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """MXFP4 blocks -> Q5_0 blocks, Q1_0 blocks -> Q4_0 blocks (four a block) of the same values,
    as ``fp4.as_legacy`` makes them (``gridx4.c``); ``out`` uint8 ``[n x 32-weight blocks, 22 or
    18]``. False where a scale has no f16 (the caller takes another form)."""
    t = ggml_type(type_name)
    _check(blocks, torch.uint8, "blocks")
    _check(out, torch.uint8, "out")
    n = blocks.numel() // t.type_size
    per = t.block_size // 32
    legacy = {"MXFP4": 22, "Q1_0": 18}.get(t.name)
    if legacy is None or blocks.numel() != n * t.type_size or out.numel() != n * per * legacy:
        raise ValueError(f"legacy_from_blocks: {blocks.numel()} bytes of {t.name} blocks for "
                         f"{out.numel()} bytes")  # fmt: skip
    return _lib().qlib_legacy_from_blocks(t.id, blocks.data_ptr(), n, out.data_ptr()) == 0


# GGUF type -> (its block's bytes, qlib blocks of 32 a block and their bytes, the C conversion)
PANEL_FORM_BLOCKS = {
    "MXFP4": (17, 1, 18, "qlib_mxfp4h_from_blocks"),
    "NVFP4": (36, 2, 20, "qlib_nvfp4h_from_blocks"),
    "Q1_0": (18, 4, 6, "qlib_q1_0h_from_blocks"),
}


def panel_form_blocks(type_name: str, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """GGUF MXFP4 / NVFP4 / Q1_0 blocks (uint8) -> qlib's MXFP4H / NVFP4H / Q1_0H blocks of 32
    (``out``; ``layout.PANEL_FORMS``: the same codes under their scales as f16; ``gridx4.c``),
    the input of kernels.c's panels of them. False where an MXFP4 scale has no f16 or a Q1_0 d
    is NaN (the caller takes another form)."""
    size, per, bytes_out, fn = PANEL_FORM_BLOCKS[type_name]
    _check(blocks, torch.uint8, "blocks")
    _check(out, torch.uint8, "out")
    n = blocks.numel() // size
    if blocks.numel() != n * size or out.numel() != n * per * bytes_out:
        raise ValueError(f"panel_form_blocks: {blocks.numel()} bytes of {type_name} blocks for "
                         f"{out.numel()} bytes")  # fmt: skip
    return getattr(_lib(), fn)(blocks.data_ptr(), n, out.data_ptr()) == 0


def kpanels_get(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """The GGUF blocks (uint8 ``[len(ids), row bytes]``) of rows ``ids`` of a Q4_K panel
    weight: the bytes it was packed from."""
    _check_packed(w)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), w.k // 256 * BLOCKS[w.type_name][1], dtype=torch.uint8)
    if _lib().qlib_kpanel_get(BLOCK_CODES[w.type_name], w.codes.data_ptr(), w.n, w.k,
                              ids.data_ptr(), ids.numel(), out.data_ptr()):  # fmt: skip
        raise IndexError(f"kpanels_get: a row id outside 0..{w.n - 1}")
    return out


ROW_TYPES = {**TYPE_CODES, **BLOCK_CODES}
"""The types ``dequant_rows`` reads as GGUF blocks (ggml's type ids)."""


def _rows_args(data: torch.Tensor, type_name: str, n: int, k: int, panels: bool) -> tuple:
    """``qlib_dequant_rows``'s arguments before the ids: checked (ValueError)."""
    _check(data, torch.uint8, "data")
    code = ROW_TYPES.get(type_name)
    if code is None:
        raise ValueError(f"dequant_rows: {type_name} is not read by the C kernels")
    if panels:
        size = _panel_bytes(PackedWeight(type_name, n, k, data, None, None, panels=True))
        code |= PANELS
    else:
        qk, nbytes = BLOCKS.get(type_name) or (32, _BLOCK_BYTES[type_name])
        size = n * (k // qk) * nbytes if k % qk == 0 else None
    if size is None or data.numel() != size:
        what = "panels" if panels else "blocks"
        raise ValueError(f"dequant_rows: {data.numel()} bytes are not {type_name} {what} of "
                         f"[{n}, {k}]")  # fmt: skip
    return code, data.data_ptr(), n, k


def dequant_rows(data: torch.Tensor, type_name: str, n: int, k: int, ids: torch.Tensor, *,
                 panels: bool = False) -> torch.Tensor:  # fmt: skip
    """Rows ``ids`` of an ``[n, k]`` weight as float32 ``[len(ids), k]``, the values of
    ggml's ``dequantize_row_*`` (rows.c): ``data`` holds its GGUF blocks row after row
    (``ROW_TYPES``), or with ``panels`` its 16-row panels (Q4_0 / Q4_1 / Q8_0 / Q4_K)."""
    args = _rows_args(data, type_name, n, k, panels)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k)
    if _lib().qlib_dequant_rows(*args, ids.data_ptr(), ids.numel(), out.data_ptr()):
        raise IndexError(f"dequant_rows: a row id outside 0..{n - 1}")
    return out


class RowLookup:
    """``dequant_rows`` of one row into a fixed ``out`` (``k`` float32), prepared once: a
    decode step's embedding row in one C call (``lookup(row)``)."""

    def __init__(self, data: torch.Tensor, type_name: str, n: int, k: int, out: torch.Tensor,
                 *, panels: bool = False):  # fmt: skip
        _check(out, torch.float32, "out")
        if out.numel() != k:
            raise ValueError(f"RowLookup: out holds {out.numel()} floats, not k={k}")
        self.n, self.keep = n, (data, out)
        self._row = ctypes.c_int64(0)
        self._call = partial(_lib().qlib_dequant_rows, *_rows_args(data, type_name, n, k, panels),
                             ctypes.byref(self._row), 1, out.data_ptr())  # fmt: skip

    def __call__(self, row: int) -> None:
        self._row.value = row
        if self._call():
            raise IndexError(f"RowLookup: row {row} outside 0..{self.n - 1}")


def dequantize_bf16(w: PackedWeight) -> torch.Tensor:
    """``[n, k]`` bfloat16: ggml's dequantized float32 values, rounded to nearest even."""
    lib = _lib()
    _check_packed(w)
    if w.blocks or w.panels:
        what = "panels" if w.panels else "GGUF blocks"
        raise ValueError(f"dequantize_bf16: {w.type_name} is {what} (QTensor.dequantize)")
    out = torch.empty(w.n, w.k, dtype=torch.bfloat16)
    lib.qlib_dequant_bf16(w.type_code, w.codes.data_ptr(), w.d.data_ptr(), _ptr(w.m), w.n, w.k,
                          out.data_ptr())  # fmt: skip
    return out


def _qgemm_args(w: PackedWeight, x: torch.Tensor, out: torch.Tensor | None,
                norm: torch.Tensor | None, eps: float, swiglu: bool,
                accumulate: bool) -> tuple[int, tuple]:  # fmt: skip
    """The C function (``qlib_qgemm_ex`` for planes, ``qlib_kgemm`` for GGUF blocks), its
    checked arguments before ``y`` and after it, and the rows."""
    _check_packed(w)
    _check(x, torch.float32, "x")
    width = w.k * (2 if swiglu else 1)  # swiglu: each input row is [gate | up]
    m = x.numel() // width if width else 0
    if x.numel() != m * width or (x.dim() == 2 and x.shape[1] != width) or x.dim() > 2:
        raise ValueError(f"qgemm: x {list(x.shape)}: rows of {width} floats for k={w.k}")
    if out is not None:
        _check(out, torch.float32, "out")
        if out.numel() != m * w.n:
            raise ValueError(f"qgemm: out {list(out.shape)}: {m} rows of {w.n} floats")
    if norm is not None:
        _check(norm, torch.float32, "norm")
        if norm.numel() != w.k:
            raise ValueError(f"qgemm: norm has {w.k} weights")
    lib = _lib()
    if w.blocks:
        fn, head = lib.qlib_kgemm, (w.type_code, w.codes.data_ptr(), w.n, w.k, x.data_ptr(), m)
    else:
        head = (w.type_code, w.codes.data_ptr(), _ptr(w.d), _ptr(w.m), w.n, w.k, x.data_ptr(), m)
        fn = lib.qlib_qgemm_ex
    return m, (fn, head, (_ptr(norm), float(eps), int(swiglu), int(accumulate)))


def qgemm(
    x: torch.Tensor,
    w: PackedWeight,
    out: torch.Tensor | None = None,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    accumulate: bool = False,
) -> torch.Tensor:
    """``f(x) @ W.T`` for ``x`` ``[m, k]`` float32 (CPU, made contiguous): ``[m, n]`` float32.

    ggml semantics: each input row quantized to the weight's dot type (Q8_0 / Q8_1; Q8_K for
    the K-quants), exact integer block dots.
    ``norm``: f is ``rms_norm(x, eps) * norm`` (``norm``: ``[k]`` float32); ``swiglu``:
    the rows of ``x`` hold ``[gate | up]`` (``2k`` floats) and f is ``silu(gate) * up``;
    ``accumulate``: ``out`` (required then) += the product (a residual add).
    """
    x = x.contiguous().float()
    if accumulate and out is None:
        raise ValueError("qgemm: accumulate needs out")
    m, (fn, head, tail) = _qgemm_args(w, x, out, norm, eps, swiglu, accumulate)
    y = out if out is not None else torch.empty(m, w.n, dtype=torch.float32)
    if fn(*head, y.data_ptr(), *tail):
        raise RuntimeError(f"{fn.__name__} failed (out of memory)")
    return y


def qgemm_plan(
    w: PackedWeight,
    x: torch.Tensor,
    out: torch.Tensor,
    *,
    norm: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    accumulate: bool = False,
) -> KernelCall:
    """``qgemm(x, w, out, norm=, eps=, swiglu=, accumulate=)`` as a prepared call on these
    buffers (checked once; ``x`` and ``out`` of any shape with the right number of floats:
    rows of ``k`` (``2k`` with ``swiglu``) and ``n``). The call returns nonzero when the
    kernel could not allocate its scratch."""
    if out is None:
        raise ValueError("qgemm_plan: out is required (see qgemm_alloc_plan)")
    m, (fn, head, tail) = _qgemm_args(w, x, out, norm, eps, swiglu, accumulate)
    return _prepared(
        fn,
        *head,
        out.data_ptr(),
        *tail,
        keep=(w, x, out, norm),
        step=_gemv_step(w, x, out, norm, eps, swiglu, accumulate) if m == 1 else None,
    )


def _gemv_step(w: PackedWeight, x: torch.Tensor, out: torch.Tensor | None,
               norm: torch.Tensor | None, eps: float, swiglu: bool,
               accumulate: bool) -> DecodeStepC | None:  # fmt: skip
    """The checked one-row GEMV as a ``DecodeChain`` step (``out`` None: set per call), or
    None when ``x`` and ``out`` overlap (the chain's threads each read ``x`` while others
    write ``out``)."""
    xs, xe = x.data_ptr(), x.data_ptr() + x.numel() * 4
    ys, ye = (out.data_ptr(), out.data_ptr() + out.numel() * 4) if out is not None else (0, 0)
    if xs < ye and ys < xe:
        return None
    kind = STEP_KGEMV if w.blocks else STEP_QGEMV
    return DecodeStepC(
        kind=kind, type=w.type_code, w=w.codes.data_ptr(), d=_ptr(w.d), m=_ptr(w.m), n=w.n,
        k=w.k, x=xs, y=ys or None, norm=_ptr(norm), eps=float(eps), swiglu=int(swiglu),
        accumulate=int(accumulate),
    )  # fmt: skip


def qgemm_alloc_plan(
    w: PackedWeight, x: torch.Tensor, *, norm: torch.Tensor | None = None, eps: float = 0.0
) -> Callable[[], torch.Tensor]:
    """``qgemm(x, w, norm=, eps=)`` as a prepared call that returns a new ``[m, n]`` float32
    tensor each time (for results the caller keeps, such as logits)."""
    m, (fn, head, tail) = _qgemm_args(w, x, None, norm, eps, False, False)
    y_ptr = ctypes.c_void_p()  # the one argument that changes: read by ctypes at each call
    call = partial(fn, *head, y_ptr, *tail)
    n, keep = w.n, (w, x, norm)
    # as a DecodeChain's last step (its output set per call): a one-row input only
    step = _gemv_step(w, x, None, norm, eps, False, False) if m == 1 else None

    def run() -> torch.Tensor:
        y = torch.empty(m, n)
        y_ptr.value = y.data_ptr()
        if call():
            raise RuntimeError(f"{fn.__name__} failed (out of memory)")
        return y

    run.keep = keep
    run.steps = (step,) if step is not None else None
    run.shape = (m, n)
    return run


class DecodePosition:
    """The position of a decode step, shared by the ``attn_decode_plan`` calls of one model:
    ``at(pos)`` sets it and the rows ``pos`` of the RoPE tables once per token.

    ``cos``, ``sin``: ``[max_pos, d/2]`` float32 tables from position 0.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        for name, t in (("cos", cos), ("sin", sin)):
            _check(t, torch.float32, name)
        if cos.dim() != 2 or sin.shape != cos.shape:
            raise ValueError("DecodePosition: cos and sin [max_pos, d/2]")
        self.cos, self.sin = cos, sin
        self.max_pos, self.half = cos.shape  # positions, d/2
        self._row = cos.shape[1] * cos.element_size()
        self._cos0, self._sin0 = cos.data_ptr(), sin.data_ptr()
        self.pos = ctypes.c_int(0)  # the C arguments, read at each call
        self.cos_row = ctypes.c_void_p(self._cos0)
        self.sin_row = ctypes.c_void_p(self._sin0)

    def at(self, pos: int) -> None:
        """Set the position of the next decode calls (``0 <= pos < max_pos``)."""
        if not 0 <= pos < self.max_pos:
            raise IndexError(f"decode position {pos} outside the RoPE tables ({self.max_pos})")
        self.pos.value = pos
        self.cos_row.value = self._cos0 + pos * self._row
        self.sin_row.value = self._sin0 + pos * self._row


def attn_decode_plan(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    position: DecodePosition,
    out: torch.Tensor,
    *,
    n_head: int,
    n_kv: int,
    neox: bool,
    split: int = 0,
) -> KernelCall:
    """One layer's decode attention as a prepared call, at ``position``: RoPE of q and k in
    ``qkv`` (in place; ``neox``: pairs ``(i, i + d/2)``, else ``(2i, 2i + 1)``), k and v
    into row ``pos`` of the caches, then GQA attention of the query heads over cache
    positions ``0..pos`` into ``out`` (``attn.c``: the positions of each KV head cut into
    pieces read once for all its query heads, spread over the threads, then combined).

    ``qkv``: ``(n_head + 2 n_kv) d`` float32 (q, k, v heads); ``k_cache``, ``v_cache``:
    ``[n_kv, max_seq, d]`` float32 or float16 (k and v stored rounded to nearest even);
    ``out``: ``n_head d`` float32; ``d % 16 == 0``, ``d <= 128``. ``split``: positions per
    piece (0: as many pieces as fill the threads evenly). The call returns nonzero when out
    of memory.
    """
    lib = _lib()
    for name, t in (("qkv", qkv), ("out", out)):
        _check(t, torch.float32, name)
    kv_dtype = k_cache.dtype
    if kv_dtype not in (torch.float32, torch.float16):
        raise ValueError(f"attn_decode_plan: the KV cache is float32 or float16, not {kv_dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t, kv_dtype, name)
    n_kv_c, max_seq, d = k_cache.shape
    if (d % 16 or d > 128 or n_kv_c != n_kv or n_head % n_kv or v_cache.shape != k_cache.shape
            or qkv.numel() != (n_head + 2 * n_kv) * d or out.numel() != n_head * d
            or position.half * 2 != d or position.max_pos < max_seq or split < 0):  # fmt: skip
        raise ValueError("attn_decode_plan: shapes (d % 16 == 0, d <= 128, tables [., d/2])")
    step = DecodeStepC(
        kind=STEP_ATTN, x=qkv.data_ptr(), y=out.data_ptr(), kc=k_cache.data_ptr(),
        vc=v_cache.data_ptr(), pos=ctypes.addressof(position.pos),
        cos_row=ctypes.addressof(position.cos_row), sin_row=ctypes.addressof(position.sin_row),
        n_head=n_head, n_kv=n_kv, head_dim=d, max_seq=max_seq, neox=int(neox),
        kv_f16=int(kv_dtype == torch.float16), split=split,
    )  # fmt: skip
    return _prepared(
        lib.qlib_attn_decode_kv, qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        position.pos, n_head, n_kv, d, max_seq, position.cos_row, position.sin_row, int(neox),
        out.data_ptr(), int(kv_dtype == torch.float16), split,
        keep=(qkv, k_cache, v_cache, out, position), step=step,
    )  # fmt: skip


def add_plan(x: torch.Tensor, y: torch.Tensor) -> KernelCall:
    """``y += x`` (float32, as many values: a projection's bias added to its output in the
    decode step) as a prepared call, a ``DecodeChain`` step."""
    _check(x, torch.float32, "x")
    _check(y, torch.float32, "y")
    if x.numel() != y.numel():
        raise ValueError(f"add_plan: {x.numel()} values added to {y.numel()}")
    return _step_call(DecodeStepC(kind=STEP_ADD, n=y.numel(), x=x.data_ptr(), y=y.data_ptr()),
                      keep=(x, y))  # fmt: skip


def _step_call(step: DecodeStepC, keep: tuple) -> KernelCall:
    """A decode.c step of its own as a prepared call (``qlib_decode_run`` of it alone, its
    kernels' entry points) that is also that ``DecodeChain`` step."""
    one = (DecodeStepC * 1)(step)
    return _prepared(_lib().qlib_decode_run, one, 1, DECODE_MODES["c"], keep=(*keep, one),
                     step=step)  # fmt: skip


def moe_decode_plan(router_logits: torch.Tensor, h: torch.Tensor,
                    experts: list[list[KernelCall]], outs: list[torch.Tensor],
                    n_used: int) -> KernelCall | None:  # fmt: skip
    """A mixture of experts' FFN in the decode step as one prepared call, after the router's
    GEMV into ``router_logits`` (``n_expert`` floats): the token's ``n_used`` experts and
    their weights (``llama.moe.route``'s: softmax, the largest, over their sum), each chosen
    expert's prepared calls (``experts[e]``, its GEMVs into ``outs[e]``), then ``h +=`` their
    weighted sum in expert order (``llama.moe.combine``'s additions), all in C (``decode.c``),
    so that it runs in a ``DecodeChain``. The call's ``chosen`` and ``weights`` tensors hold
    the last routing (of its ``router_logits``). None where an expert's calls have torch
    parts (no C steps)."""
    _check(router_logits, torch.float32, "router_logits")
    _check(h, torch.float32, "h")
    n = router_logits.numel()
    if not 1 <= n_used <= n <= MAX_EXPERTS or len(experts) != n or len(outs) != n:
        raise ValueError(f"moe_decode_plan: {n_used} of {n} experts ({len(experts)} given; "
                         f"at most {MAX_EXPERTS})")  # fmt: skip
    if not all(has_steps(call) for calls in experts for call in calls):
        return None
    for out in outs:
        _check(out, torch.float32, "outs")
        if out.numel() != h.numel():
            raise ValueError("moe_decode_plan: each expert's output must be like h")
    steps = [[s for call in calls for s in call.steps] for calls in experts]
    first = torch.tensor([0, *itertools.accumulate(len(e) for e in steps)], dtype=torch.int32)
    array = (DecodeStepC * max(1, int(first[-1])))(*(s for e in steps for s in e))
    out_ptrs = (ctypes.c_void_p * n)(*(o.data_ptr() for o in outs))
    chosen = torch.zeros(n_used, dtype=torch.int32)
    weights = torch.zeros(n_used)
    step = DecodeStepC(
        kind=STEP_MOE, n=n, k=h.numel(), x=router_logits.data_ptr(), y=h.data_ptr(),
        experts=ctypes.cast(array, ctypes.POINTER(DecodeStepC)), first=first.data_ptr(),
        outs=ctypes.addressof(out_ptrs), chosen=chosen.data_ptr(), weights=weights.data_ptr(),
        n_used=n_used,
    )  # fmt: skip
    call = _step_call(step, keep=(router_logits, h, experts, outs, first, array, out_ptrs))
    call.router_logits, call.chosen, call.weights = router_logits, chosen, weights
    return call


# -- prefill.c: float32 arithmetic, bf16 matmul inputs/outputs -----------------------------


def add_rmsnorm(
    h: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """``h += delta`` (in place, when given), then ``out = rms_norm(h) * weight``.

    ``h``: ``[t, k]`` float32; ``delta``: ``[t, k]`` bfloat16; ``out``: ``[t, k]``
    bfloat16 or float32. ``k % 16 == 0``.
    """
    lib = _lib()
    t, k = h.shape
    _check(h, torch.float32, "h")
    _check(weight, torch.float32, "weight")
    if k % 16 or out.shape != h.shape or weight.numel() != k:
        raise ValueError("add_rmsnorm: shapes (k % 16 == 0, out like h, weight [k])")
    if delta is not None:
        _check(delta, torch.bfloat16, "delta")
        if delta.shape != h.shape:
            raise ValueError("add_rmsnorm: delta must be like h")
    _check(out, out.dtype, "out")
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("add_rmsnorm: out is bfloat16 or float32")
    bf16 = int(out.dtype == torch.bfloat16)
    lib.qlib_add_rmsnorm(h.data_ptr(), _ptr(delta), t, k, weight.data_ptr(), eps,
                         out.data_ptr(), bf16)  # fmt: skip
    return out


def swiglu_bf16(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gu``: ``[t, 2 n_ff]`` bfloat16 (gate | up) -> ``silu(gate) * up`` ``[t, n_ff]`` bf16."""
    lib = _lib()
    _check(gu, torch.bfloat16, "gu")
    t, n2 = gu.shape
    if n2 % 32:
        raise ValueError("swiglu_bf16: n_ff % 16 == 0 needed")
    out = out if out is not None else torch.empty(t, n2 // 2, dtype=torch.bfloat16)
    _check(out, torch.bfloat16, "out")
    if out.shape != (t, n2 // 2):
        raise ValueError("swiglu_bf16: out [t, n_ff]")
    lib.qlib_swiglu_bf16(gu.data_ptr(), t, n2 // 2, out.data_ptr())
    return out


def _check_attn_tables(kc, vc, cos, sin, cache_dtype: torch.dtype = torch.float32) -> None:
    for name, c, dtype in (("kc", kc, cache_dtype), ("vc", vc, cache_dtype),
                           ("cos", cos, torch.float32), ("sin", sin, torch.float32)):  # fmt: skip
        _check(c, dtype, name)


def attn_prefill(
    qkv: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: int,
    n_head: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool,
    out: torch.Tensor | None = None,
    q_from: int = 0,
    amx: bool = False,
    flash: bool | None = None,
    int8: bool = False,
) -> torch.Tensor:
    """RoPE + KV-cache write + causal GQA attention of one layer's prefill chunk.

    ``qkv``: ``[t, (n_head + 2 n_kv) d]`` bfloat16 or float32 (positions ``pos..pos+t-1``);
    ``kc``, ``vc``: caches ``[n_kv, max_seq, d]`` (rows ``pos..pos+t-1``
    are written, rows before ``pos`` are read), float32, or float16 for the flash kernel
    (k and v rounded to nearest even as stored, the attention reading the rounded values);
    ``cos``, ``sin``: ``[max_seq, d/2]``
    tables from position 0. Returns ``[t - q_from, n_head d]`` of ``qkv``'s dtype (or
    ``out``'s: bfloat16 or float32): the attention output of rows ``q_from..t-1`` (all rows
    go to the cache).
    ``flash``: the tiled float32 kernel (key blocks of 64, online softmax;
    ``qlib_attn_prefill_flash``); None: for float32 ``qkv`` or ``out``, or a float16 cache. Else
    ``amx``: the two attention matmuls on AMX tiles (q, k, v and the softmax weights
    rounded to bf16) when ``amx_available()`` and ``d % 32 == 0``; else the float32 kernel
    over whole score rows (``qlib_attn_prefill``, bf16 in and out only).
    ``int8``: the flash kernel with int8 products (``flash`` implied): queries, keys and
    values rounded to int8 codes with one scale per row, each key block's softmax weights
    (times the values' scales) to unsigned 8-bit codes with one scale per query row; the
    softmax float32 (docs/performance.md, "int8 attention").
    """
    lib = _lib()
    if qkv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("attn_prefill: qkv is bfloat16 or float32")
    _check(qkv, qkv.dtype, "qkv")
    f16 = kc.dtype == torch.float16
    _check_attn_tables(kc, vc, cos, sin, torch.float16 if f16 else torch.float32)
    t = qkv.shape[0]
    n_kv_c, max_seq, d = kc.shape
    if (n_kv_c != n_kv or vc.shape != kc.shape or qkv.shape[1] != (n_head + 2 * n_kv) * d
            or pos + t > max_seq or cos.shape[0] < pos + t or cos.shape[1] != d // 2
            or sin.shape != cos.shape or not 0 <= q_from < t):  # fmt: skip
        raise ValueError("attn_prefill: shapes")
    out = out if out is not None else torch.empty(t - q_from, n_head * d, dtype=qkv.dtype)
    if out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("attn_prefill: out is bfloat16 or float32")
    _check(out, out.dtype, "out")
    if out.shape != (t - q_from, n_head * d):
        raise ValueError("attn_prefill: out shape")
    f32 = torch.float32 in (qkv.dtype, out.dtype)
    if flash is None:
        flash = f32 or f16 or int8
    if int8 and not flash:
        raise ValueError("attn_prefill: int8 products are the flash kernel's (flash=True)")
    if f16 and not (flash or f32):
        raise ValueError("attn_prefill: a float16 cache needs the flash kernel (flash=True)")
    if flash or f32:
        rc = lib.qlib_attn_prefill_flash(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), t,
                                         kc.data_ptr(), vc.data_ptr(), pos, n_head, n_kv, d,
                                         max_seq, cos.data_ptr(), sin.data_ptr(), int(neox),
                                         q_from, out.data_ptr(),
                                         int(out.dtype == torch.bfloat16), int(f16),
                                         int(int8))  # fmt: skip
    else:
        rc = lib.qlib_attn_prefill_ex(qkv.data_ptr(), t, kc.data_ptr(), vc.data_ptr(), pos,
                                      n_head, n_kv, d, max_seq, cos.data_ptr(), sin.data_ptr(),
                                      int(neox), q_from, out.data_ptr(),
                                      int(amx and amx_available()))  # fmt: skip
    if rc:
        raise RuntimeError("qlib_attn_prefill failed (d % 16, d > 128, heads, memory)")
    return out


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gu``: ``[t, 2 n_ff]`` float32 (gate | up) -> ``silu(gate) * up`` ``[t, n_ff]``
    float32 (the vector e^x of ``swiglu_bf16``, no rounding to bf16)."""
    lib = _lib()
    _check(gu, torch.float32, "gu")
    t, n2 = gu.shape
    if n2 % 32:
        raise ValueError("swiglu: n_ff % 16 == 0 needed")
    out = out if out is not None else torch.empty(t, n2 // 2)
    _check(out, torch.float32, "out")
    if out.shape != (t, n2 // 2):
        raise ValueError("swiglu: out [t, n_ff]")
    lib.qlib_swiglu_f32(gu.data_ptr(), t, n2 // 2, out.data_ptr())
    return out


def _vector_hook(name: str, x: torch.Tensor, *scalars: float) -> torch.Tensor:
    """y = the C test hook ``name`` over float32 x (numel % 16 == 0), with its scalar args."""
    lib = _lib()
    x = x.contiguous().float()
    if x.numel() % 16:
        raise ValueError(f"{name.removeprefix('qlib_')}: numel % 16 == 0 needed")
    y = torch.empty_like(x)
    getattr(lib, name)(x.data_ptr(), x.numel(), *scalars, y.data_ptr())
    return y


def exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' vector ``e^x`` (float32, numel % 16 == 0), for tests."""
    return _vector_hook("qlib_exp", x)


def exp_diff(s: torch.Tensor, m: float) -> torch.Tensor:
    """The int8 attention's ``e^(s - m)`` for ``s <= m`` (float32, numel % 16 == 0), for tests."""
    return _vector_hook("qlib_exp_diff", s, float(m))


# -- prefill.c with AMX: the GEMM and the whole layer ----------------------------------------


def _amx_lib() -> ctypes.CDLL:
    lib = _lib()
    if not amx_available():
        raise RuntimeError(f"AMX is not available here: {amx_unavailable_reason()}")
    return lib


def amx_gemm(a: torch.Tensor, tiles: torch.Tensor | AmxWeight, epilogue: str = "bf16",
             out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ w.T`` on AMX tiles (``tiles`` from ``pack_amx``, or an ``AmxWeight``), for tests
    and tools.

    ``a``: ``[m, k]`` bf16. Epilogues: ``"bf16"`` -> a new ``[m, n]`` bf16; ``"add"``: ``out``
    (``[m, n]`` float32) += the product; ``"swiglu"`` (interleaved tiles) -> ``[m, n/2]`` bf16
    ``silu(gate) * up``.
    """
    lib = _amx_lib()
    m, k = a.shape
    if isinstance(tiles, torch.Tensor):
        if tiles.shape[1:] != (k // 32, 16, 16, 2):
            raise ValueError("amx_gemm: tiles [n/16, k/32, 16, 16, 2] for a [m, k]")
        tiles = AmxWeight("bf16", tiles.shape[0] * 16, k, tiles.contiguous())
    n = tiles.n
    if a.dtype != torch.bfloat16 or tiles.k != k or k % 32:
        raise ValueError("amx_gemm: a [m, k] bf16 and a weight of k columns")
    if epilogue not in AMX_EPILOGUES:
        raise ValueError(f"amx_gemm: epilogue {epilogue!r}: {', '.join(AMX_EPILOGUES)}")
    padded = torch.zeros(m + 32, k, dtype=torch.bfloat16)  # row blocks of 32 read past m
    padded[:m] = a
    if epilogue == "add":
        if out is None or out.dtype != torch.float32 or out.shape != (m, n):
            raise ValueError("amx_gemm: 'add' needs out [m, n] float32")
        _check(out, torch.float32, "out")
    else:
        out = torch.empty(m, n // 2 if epilogue == "swiglu" else n, dtype=torch.bfloat16)
    w = tiles.c_struct()
    if lib.qlib_amx_gemm(padded.data_ptr(), m, k, w.kind, w.t, w.d, w.m, n,
                         AMX_EPILOGUES[epilogue], out.data_ptr(), out.shape[1]):  # fmt: skip
        raise MemoryError("qlib_amx_gemm: out of memory")
    return out


class AmxLayer:
    """The four AMX weights of one llama layer (wqkv; wo; w13, tiles interleaved as
    gate 0, up 0, gate 1, ...; w2) and their C descriptors, for ``prefill_layers``."""

    def __init__(self, wqkv: AmxWeight, wo: AmxWeight, w13: AmxWeight, w2: AmxWeight):
        k, n_qkv, n_ff = wqkv.k, wqkv.n, w13.n // 2
        if (wo.n != k or w13.k != k or w2.n != k or w2.k != n_ff or w13.n % 2
                or any(x % 32 for x in (k, n_qkv, wo.k, n_ff))):  # fmt: skip
            raise ValueError("AmxLayer: weights of one layer (widths % 32 == 0)")
        self.weights = (wqkv, wo, w13, w2)  # held: the descriptors point into them
        self.k, self.n_qkv, self.n_attn, self.n_ff = k, n_qkv, wo.k, n_ff
        self.c = (AmxWeightC * 4)(*(w.c_struct() for w in self.weights))


@dataclass
class PrefillScratch:
    """bf16 buffers of ``prefill_layers`` for up to ``rows`` rows, each with 32 rows of
    padding (the kernel's row blocks of 32 read past the last row). The kernel keeps ``a``,
    ``y`` and ``g`` (the GEMMs' A operands) as AMX A tiles, not rows: 16 x 32 values a KB
    (``a_tile_at`` in prefill.c)."""

    rows: int
    a: torch.Tensor  # [rows + 32, k]
    qkv: torch.Tensor  # [rows + 32, n_qkv]
    y: torch.Tensor  # [rows + 32, n_head d]
    g: torch.Tensor  # [rows + 32, n_ff]

    @classmethod
    def for_layer(cls, layer: AmxLayer, rows: int) -> PrefillScratch:
        a, qkv, y, g = (torch.empty(rows + 32, n, dtype=torch.bfloat16)
                        for n in (layer.k, layer.n_qkv, layer.n_attn, layer.n_ff))  # fmt: skip
        return cls(rows, a, qkv, y, g)


PREFILL_PHASES = ("attention norm", "wqkv", "RoPE, q, KV write", "cache tiles",
                  "attention tasks", "wo", "FFN norm", "w13 + SwiGLU", "w2")  # fmt: skip
"""The phases of an AMX prefill layer, in order, as ``prefill_phase_seconds`` reports them."""


def prefill_phase_seconds(run: Callable[[], T], threads: int) -> tuple[T, torch.Tensor]:
    """Call ``run`` (which runs ``prefill_layers``) with the layer kernel timing itself:
    ``run``'s result and a float64 tensor ``[threads, len(PREFILL_PHASES), 2]``, per OpenMP
    thread below ``threads`` and phase, the seconds of the thread's own work and of its wait
    at the barrier that closes the phase, summed over the layers. Nothing else changes."""
    lib = _amx_lib()
    if lib.qlib_prefill_phases() != len(PREFILL_PHASES):
        raise RuntimeError("prefill_phase_seconds: PREFILL_PHASES does not match prefill.c")
    times = torch.zeros(threads, len(PREFILL_PHASES), 2, dtype=torch.float64)
    lib.qlib_prefill_set_times(times.data_ptr(), threads)
    try:
        out = run()
    finally:
        lib.qlib_prefill_set_times(None, 0)
    return out, times


def prefill_layers(
    h: torch.Tensor,
    layers: list[AmxLayer],
    scratch: PrefillScratch,
    cache: torch.Tensor,
    *,
    norms: list[torch.Tensor],
    eps: float,
    pos: int,
    n_head: int,
    n_kv: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool,
    q_from: int = 0,
) -> None:
    """Llama layers of a prefill chunk on AMX, one C call for them all, in place on the
    residual stream ``h`` (``[t, k]`` float32, positions ``pos..pos+t-1``); each layer:
    RmsNorm -> qkv (bf16) -> RoPE, KV write, attention -> ``h`` += wo, then += the SwiGLU
    FFN of ``h``. Layer ``l`` takes ``norms[2 l]`` (attention) and ``norms[2 l + 1]`` (FFN)
    and its keys and values ``cache[l, 0]``, ``cache[l, 1]`` (``cache``: ``[layers, 2, n_kv,
    max_seq, d]`` float32); the last layer computes rows ``q_from..t-1`` only after its
    attention's KV write. ``cos``, ``sin``: ``[max_seq, d/2]`` tables from position 0;
    ``d % 32 == 0``."""
    lib = _amx_lib()
    _check(h, torch.float32, "h")
    n = len(layers)
    if n == 0 or len(norms) != 2 * n or cache.dim() != 5 or cache.shape[:2] != (n, 2):
        raise ValueError("prefill_layers: two norms a layer, cache [layers, 2, n_kv, max_seq, d]")
    for name, x in (("cache", cache), ("cos", cos), ("sin", sin)):
        _check(x, torch.float32, name)
    t, k = h.shape
    n_kv_c, max_seq, d = cache.shape[2:]
    first = layers[0]
    for wt in norms:
        _check(wt, torch.float32, "norm")
        if wt.numel() != k:
            raise ValueError("prefill_layers: norms [k]")
    if (any((ly.k, ly.n_qkv, ly.n_attn, ly.n_ff) != (first.k, first.n_qkv, first.n_attn,
                                                    first.n_ff) for ly in layers)
            or k != first.k or t > scratch.rows or scratch.a.shape[1] != k
            or n_kv_c != n_kv or first.n_qkv != (n_head + 2 * n_kv) * d
            or first.n_attn != n_head * d or scratch.qkv.shape[1] != first.n_qkv
            or scratch.y.shape[1] != first.n_attn or scratch.g.shape[1] != first.n_ff
            or pos + t > max_seq or cos.shape[0] < pos + t or cos.shape[1] != d // 2
            or sin.shape != cos.shape or d % 32 or not 0 <= q_from < t):  # fmt: skip
        raise ValueError("prefill_layers: shapes")
    s = scratch
    norm_ptrs = (ctypes.c_void_p * (2 * n))(*(wt.data_ptr() for wt in norms))
    step = cache[0, 0].numel() * cache.element_size()
    kv_ptrs = (ctypes.c_void_p * (2 * n))(
        *range(cache.data_ptr(), cache.data_ptr() + 2 * n * step, step)
    )
    weights = (ctypes.c_void_p * n)(*(ctypes.addressof(ly.c) for ly in layers))
    if lib.qlib_prefill_layers(
        h.data_ptr(), t, k, n, norm_ptrs, eps, weights, first.n_qkv, first.n_ff,
        s.a.data_ptr(), s.qkv.data_ptr(), s.y.data_ptr(), s.g.data_ptr(), kv_ptrs, pos,
        n_head, n_kv, d, max_seq, cos.data_ptr(), sin.data_ptr(), int(neox), q_from,
    ):  # fmt: skip
        raise RuntimeError("qlib_prefill_layers failed (memory)")
