"""AVX-512 VNNI kernels for the CPU quantized matmul (Q4_0, Q4_1, Q8_0 weights).

``kernels.c`` (the quantized GEMM/GEMV and the decode attention step) and
``prefill.c`` (RmsNorm, SwiGLU, RoPE + KV write + causal attention between the
bf16 prefill matmuls; with AMX, an AMX GEMM and the whole prefill layer), shipped
as source, are compiled on first use with the
system C compiler (``$CC`` or ``cc``) into a cache directory
(``$QLIB_CACHE_DIR`` or ``~/.cache/qlib``), keyed by a hash of the source and
the flags, and loaded with ctypes. Semantics are ggml's (activations quantized
to Q8_0 / Q8_1 with x86 rounding, exact integer block dots, float32 scaling),
so results equal ``qlib.quants.reference.matmul`` to float rounding.

``available()`` is False (with ``unavailable_reason()``) when the CPU lacks
AVX-512 F/BW/VL/VNNI or F16C, no compiler works, or ``QLIB_NO_CKERNELS`` is
set; callers then fall back to ``qlib.quants.matmul``. ``amx_available()`` adds
AMX-BF16 (CPU, compiler, Linux's tile-state permission; ``QLIB_NO_AMX`` turns it
off) for the prefill kernels. The library is linked
with ``-fopenmp``; imported after torch it shares torch's ``libgomp`` (same
soname), so its parallel loops use torch's OpenMP thread pool and follow
``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name("kernels.c"), Path(__file__).with_name("prefill.c")]
HEADERS = [Path(__file__).with_name("simd.h")]  # included by both: part of the build's hash
CFLAGS = [
    "-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma",
    "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
]  # fmt: skip
AMX_CFLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]  # prefill.c's AMX kernels only
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
TYPE_CODES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_amx: bool | None = None
_amx_build_error: str | None = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    return Path(os.environ.get("QLIB_CACHE_DIR") or Path.home() / ".cache" / "qlib")


def _compile(flags: list[str]) -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (set CC)")
    src = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = cache_dir() / f"qlib_kernels_{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *flags, "-o", str(tmp_so), *map(str, SOURCES)], capture_output=True, text=True
        )
        if proc.returncode:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp_so, out)  # atomic: concurrent first uses are safe
    return out


def _compiler_knows_amx() -> bool:
    """Whether the C compiler compiles an AMX intrinsic (GCC 11+, clang 12+)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    probe = "#include <immintrin.h>\nvoid f(void) { _tile_zero(0); }\n"  # (AVX512-BF16: GCC 10+)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(probe)
        proc = subprocess.run([cc, *AMX_CFLAGS, "-c", "-o", str(Path(tmp) / "probe.o"), str(src)],
                              capture_output=True)  # fmt: skip
    return proc.returncode == 0


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (see ``unavailable_reason``)."""
    global _lib, _reason
    if _lib is not None or _reason is not None:
        return _lib
    try:
        if os.environ.get("QLIB_NO_CKERNELS", "") not in ("", "0"):
            raise RuntimeError("disabled by QLIB_NO_CKERNELS")
        missing = [f for f in REQUIRED_FLAGS if f not in _cpu_flags()]
        if missing:
            raise RuntimeError(f"CPU lacks {', '.join(missing)}")
        global _amx_build_error
        try:  # with the AMX kernels when the compiler knows AMX (GCC 11+, clang 12+)
            so = _compile(CFLAGS + AMX_CFLAGS)
        except RuntimeError as e:
            _amx_build_error = (
                f"the AMX build failed: {str(e)[-300:]}"
                if _compiler_knows_amx()
                else f"the compiler does not take {' '.join(AMX_CFLAGS)}"
            )
            so = _compile(CFLAGS)
        lib = ctypes.CDLL(str(so))
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.qlib_qgemm.argtypes = [i, p, p, p, i, i, p, i, p]
        lib.qlib_qgemm.restype = i
        f = ctypes.c_float
        lib.qlib_qgemm_ex.argtypes = [i, p, p, p, i, i, p, i, p, p, f, i, i]
        lib.qlib_qgemm_ex.restype = i
        lib.qlib_attn_decode.argtypes = [p, p, p, i, i, i, i, i, p, p, i, p]
        lib.qlib_attn_decode.restype = i
        lib.qlib_repack.argtypes = [i, p, i, i, p, p, p]
        lib.qlib_repack.restype = None
        lib.qlib_dequant_bf16.argtypes = [i, p, p, p, i, i, p]
        lib.qlib_dequant_bf16.restype = None
        lib.qlib_add_rmsnorm.argtypes = [p, p, i, i, p, f, p, i]
        lib.qlib_add_rmsnorm.restype = None
        lib.qlib_swiglu_bf16.argtypes = [p, i, i, p]
        lib.qlib_swiglu_bf16.restype = None
        lib.qlib_attn_prefill_ex.argtypes = [p, i, p, p, i, i, i, i, i, p, p, i, i, p, i]
        lib.qlib_attn_prefill_ex.restype = i
        lib.qlib_amx_init.argtypes = []
        lib.qlib_amx_init.restype = i
        if hasattr(lib, "qlib_prefill_layer"):  # built with AMX
            lib.qlib_amx_gemm.argtypes = [p, i, i, i, p, p, p, i, i, p, i]
            lib.qlib_amx_gemm.restype = i
            lib.qlib_prefill_layer.argtypes = [p, i, i, p, p, f, p, i, i, p, p, p, p, p, p, i,
                                               i, i, i, i, p, p, i, i]  # fmt: skip
            lib.qlib_prefill_layer.restype = i
        lib.qlib_exp.argtypes = [p, i, p]
        lib.qlib_exp.restype = None
        _lib = lib
    except (OSError, RuntimeError) as e:
        _reason = str(e)
    return _lib


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _reason


def amx_unavailable_reason() -> str | None:
    """Why ``amx_available()`` is False (None when it is True)."""
    if amx_available():
        return None
    if load() is None:
        return f"no C kernels: {_reason}"
    if os.environ.get("QLIB_NO_AMX", "") not in ("", "0"):
        return "disabled by QLIB_NO_AMX"
    if not {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags():
        return "the CPU lacks AMX-BF16 or AVX512-BF16"
    if _amx_build_error:
        return _amx_build_error
    return "Linux did not grant the AMX tile state (arch_prctl)"


def amx_available() -> bool:
    """Whether the AMX (bf16 tiles) prefill kernels can run: the CPU has AMX-BF16, the
    library was built with it, Linux granted the tile state, and ``QLIB_NO_AMX`` is unset."""
    global _amx
    if _amx is None:
        lib = load()
        _amx = bool(
            lib is not None
            and os.environ.get("QLIB_NO_AMX", "") in ("", "0")
            and {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags()
            and hasattr(lib, "qlib_prefill_layer")
            and lib.qlib_amx_init() == 0
        )
    return _amx


AMX_EPILOGUES = {"bf16": 0, "add": 1, "swiglu": 2}
AMX_KINDS = {"bf16": 0, "q4": 1, "q8": 2}


class AmxWeightC(ctypes.Structure):
    """``amx_weight`` of prefill.c."""

    _fields_ = [("kind", ctypes.c_int), ("t", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p)]  # fmt: skip


@dataclass
class AmxWeight:
    """A weight for the AMX prefill kernels: bf16 B tiles (``kind="bf16"``, from ``pack_amx``),
    or the 4/8-bit codes in tile order with float32 scales (``"q4"``, ``"q8"``, from
    ``pack_amx_quantized``), expanded to bf16 tiles per column block inside the GEMM."""

    kind: str
    n: int
    k: int
    tiles: torch.Tensor
    d: torch.Tensor | None = None  # [n/16, k/32, 16] float32
    m: torch.Tensor | None = None  # [n/16, k/32, 16] float32 (None: 0)

    def nbytes(self) -> int:
        ts = (self.tiles, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def c_struct(self) -> AmxWeightC:
        """The C descriptor (holds raw pointers: keep this object alive while it is used)."""
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        return AmxWeightC(AMX_KINDS[self.kind], self.tiles.data_ptr(), ptr(self.d), ptr(self.m))


def pack_amx(w: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """A bf16 weight ``[n, k]`` (n % 32, k % 32 == 0) as AMX B tiles ``[n/16, k/32, 16, 16, 2]``.

    Tile ``(j, c)``, row ``r``, column ``i`` holds ``w[16 j + i, 32 c + 2 r : 32 c + 2 r + 2]``
    (the VNNI pairs ``_tile_dpbf16ps`` multiplies). ``interleave``: ``w`` is ``[gate; up]``
    and its tiles are ordered gate 0, up 0, gate 1, up 1, ... (the SwiGLU epilogue's input).
    """
    n, k = w.shape
    if w.dtype != torch.bfloat16 or n % 32 or k % 32:
        raise ValueError(f"pack_amx: a bf16 [n, k] weight with n, k % 32 == 0, got {list(w.shape)}")
    rows = _tile_rows(n, interleave)
    if rows is not None:
        w = w[rows]
    return w.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def _tile_rows(n: int, interleave: bool) -> torch.Tensor | None:
    """The row order that puts the tiles of ``[gate; up]`` as gate 0, up 0, gate 1, ..."""
    if not interleave:
        return None
    return torch.arange(n).view(2, n // 32, 16).transpose(0, 1).reshape(-1)


def pack_amx_quantized(pw: PackedWeight, interleave: bool = False) -> AmxWeight:
    """A repacked Q4_0 / Q4_1 / Q8_0 weight as AMX-ordered codes and float32 scales (see
    ``AmxWeight``): 0.75 (4-bit) or 1.125 (Q8_0) bytes per weight instead of bf16's 2; the
    GEMM expands them to exactly the bf16 values ``dequantize_bf16`` gives."""
    n, k = pw.n, pw.k
    if n % 32 or k % 64:
        raise ValueError(f"pack_amx_quantized: n % 32 and k % 64 == 0 needed, got {n}x{k}")
    d = pw.d.view(torch.float16).float()
    if pw.type_name == "Q8_0":
        q = (pw.codes.to(torch.int16) - 128).to(torch.int8)
        m = None
    else:  # per 64 elements 32 bytes: byte i = e[i] | e[i + 32] << 4
        c = pw.codes.view(n, k // 64, 32)
        q = torch.cat([c & 15, c >> 4], dim=-1).reshape(n, k)
        m = pw.m.view(torch.float16).float() if pw.type_name == "Q4_1" else d * -8.0
    rows = _tile_rows(n, interleave)
    if rows is not None:
        q, d = q[rows], d[rows]
        m = m[rows] if m is not None else None
    q = q.reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
    if pw.type_name == "Q8_0":
        tiles, kind = q.contiguous(), "q8"
    else:
        tiles, kind = (q[..., 0] | (q[..., 1] << 4)).contiguous(), "q4"
    scales = lambda x: x.reshape(n // 16, 16, k // 32).permute(0, 2, 1).contiguous()  # noqa: E731
    return AmxWeight(kind, n, k, tiles, scales(d), scales(m) if m is not None else None)


def amx_gemm(a: torch.Tensor, tiles: torch.Tensor | AmxWeight, epilogue: str = "bf16",
             out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``a @ w.T`` on AMX tiles (``tiles`` from ``pack_amx``, or an ``AmxWeight``), for tests
    and tools.

    ``a``: ``[m, k]`` bf16. Epilogues: ``"bf16"`` -> a new ``[m, n]`` bf16; ``"add"``: ``out``
    (``[m, n]`` float32) += the product; ``"swiglu"`` (interleaved tiles) -> ``[m, n/2]`` bf16
    ``silu(gate) * up``.
    """
    lib = _lib_or_raise()
    if not amx_available():
        raise RuntimeError("AMX is not available here")
    m, k = a.shape
    if isinstance(tiles, torch.Tensor):
        if tiles.shape[1:] != (k // 32, 16, 16, 2):
            raise ValueError("amx_gemm: tiles [n/16, k/32, 16, 16, 2] for a [m, k]")
        tiles = AmxWeight("bf16", tiles.shape[0] * 16, k, tiles.contiguous())
    n = tiles.n
    if a.dtype != torch.bfloat16 or tiles.k != k or k % 32:
        raise ValueError("amx_gemm: a [m, k] bf16 and a weight of k columns")
    padded = torch.zeros(m + 32, k, dtype=torch.bfloat16)  # row blocks of 32 read past m
    padded[:m] = a
    epi = AMX_EPILOGUES[epilogue]
    if epilogue == "add":
        if out is None or out.dtype != torch.float32 or out.shape != (m, n):
            raise ValueError("amx_gemm: 'add' needs out [m, n] float32")
        _check(out, torch.float32, "out")
    else:
        out = torch.empty(m, n // 2 if epilogue == "swiglu" else n, dtype=torch.bfloat16)
    w = tiles.c_struct()
    if lib.qlib_amx_gemm(padded.data_ptr(), m, k, w.kind, w.t, w.d, w.m, n, epi, out.data_ptr(),
                         out.shape[1]):  # fmt: skip
        raise MemoryError("qlib_amx_gemm: out of memory")
    return out


def supports(type_name: str, k: int) -> bool:
    """Whether the C kernel handles a weight of this type and row length."""
    return type_name in TYPE_CODES and k % 64 == 0 and available()


@dataclass
class PackedWeight:
    """A weight repacked for ``qlib_qgemm``: per-row code bytes and f16 scale planes."""

    type_name: str
    n: int
    k: int
    codes: torch.Tensor  # [n, k/2] (Q4_*) or [n, k] (Q8_0) uint8
    d: torch.Tensor  # [n, k/32] int16 (f16 bits)
    m: torch.Tensor | None  # [n, k/32] int16 (Q4_1)

    def nbytes(self) -> int:
        ts = (self.codes, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def pack(qtensors) -> PackedWeight:
    """Repack one 2-D QTensor, or several with the same type and k stacked by rows."""
    qtensors = list(qtensors) if isinstance(qtensors, (list, tuple)) else [qtensors]
    name = qtensors[0].dtype.name
    k = int(qtensors[0].shape[-1])
    if any(q.dtype.name != name or int(q.shape[-1]) != k or len(q.shape) != 2 for q in qtensors):
        raise ValueError("pack: weights must be 2-D with one type and one row length")
    if name not in TYPE_CODES or k % 64:
        raise ValueError(f"pack: no C kernel for {name} with k={k} (needs k % 64 == 0)")
    n = sum(int(q.shape[0]) for q in qtensors)
    G = k // 32
    codes = torch.empty(n, k if name == "Q8_0" else k // 2, dtype=torch.uint8)
    d = torch.empty(n, G, dtype=torch.int16)
    m = torch.empty(n, G, dtype=torch.int16) if name == "Q4_1" else None
    lib = load()
    if lib is not None:
        j = 0
        for q in qtensors:  # each weight into its rows of the planes
            rows, data = int(q.shape[0]), q.data.cpu().contiguous()
            mp = m[j].data_ptr() if m is not None else None
            lib.qlib_repack(TYPE_CODES[name], data.data_ptr(), rows, k, codes[j].data_ptr(),
                            d[j].data_ptr(), mp)  # fmt: skip
            j += rows
        return PackedWeight(name, n, k, codes, d, m)
    rows = torch.cat([q.data.cpu().reshape(-1) for q in qtensors])
    blocks = rows.view(n, G, -1)  # the same in torch (slow), for machines without the kernel
    d.copy_(blocks[:, :, 0:2].contiguous().view(torch.int16).reshape(n, G))
    if name == "Q8_0":
        codes.copy_(blocks[:, :, 2:34].reshape(n, k) ^ 0x80)
    else:
        if m is not None:
            m.copy_(blocks[:, :, 2:4].contiguous().view(torch.int16).reshape(n, G))
        qs = blocks[:, :, (4 if m is not None else 2) :][:, :, :16]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, k // 64, 2, 32)  # natural order
        codes.copy_((q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2))
    return PackedWeight(name, n, k, codes, d, m)


def dequantize_bf16(pw: PackedWeight) -> torch.Tensor:
    """``[n, k]`` bfloat16: ggml's dequantized float32 values, rounded to nearest even."""
    out = torch.empty(pw.n, pw.k, dtype=torch.bfloat16)
    load().qlib_dequant_bf16(
        TYPE_CODES[pw.type_name], pw.codes.data_ptr(), pw.d.data_ptr(),
        pw.m.data_ptr() if pw.m is not None else None, pw.n, pw.k, out.data_ptr(),
    )  # fmt: skip
    return out


def qgemm(x: torch.Tensor, pw: PackedWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``[m, k]`` float32 (CPU, contiguous): ``[m, n]`` float32."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"C kernels unavailable: {_reason}")
    x = x.contiguous().float()
    m = x.shape[0]
    y = out if out is not None else torch.empty(m, pw.n, dtype=torch.float32)
    rc = lib.qlib_qgemm(
        TYPE_CODES[pw.type_name],
        pw.codes.data_ptr(),
        pw.d.data_ptr(),
        pw.m.data_ptr() if pw.m is not None else None,
        pw.n,
        pw.k,
        x.data_ptr(),
        m,
        y.data_ptr(),
    )
    if rc:
        raise RuntimeError("qlib_qgemm failed (k % 64 != 0 or out of memory)")
    return y


# -- prefill kernels (prefill.c): float32 arithmetic, bf16 matmul inputs/outputs -----------


def _lib_or_raise() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"C kernels unavailable: {_reason}")
    return lib


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: need a contiguous CPU {dtype} tensor, got {t.dtype}")


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
    lib = _lib_or_raise()
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
    dp = delta.data_ptr() if delta is not None else None
    bf16 = int(out.dtype == torch.bfloat16)
    lib.qlib_add_rmsnorm(h.data_ptr(), dp, t, k, weight.data_ptr(), eps, out.data_ptr(), bf16)
    return out


def swiglu_bf16(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gu``: ``[t, 2 n_ff]`` bfloat16 (gate | up) -> ``silu(gate) * up`` ``[t, n_ff]`` bf16."""
    lib = _lib_or_raise()
    _check(gu, torch.bfloat16, "gu")
    t, n2 = gu.shape
    if n2 % 32:
        raise ValueError("swiglu_bf16: n_ff % 16 == 0 needed")
    out = out if out is not None else torch.empty(t, n2 // 2, dtype=torch.bfloat16)
    _check(out, torch.bfloat16, "out")
    lib.qlib_swiglu_bf16(gu.data_ptr(), t, n2 // 2, out.data_ptr())
    return out


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
) -> torch.Tensor:
    """RoPE + KV-cache write + causal GQA attention of one layer's prefill chunk.

    ``qkv``: ``[t, (n_head + 2 n_kv) d]`` bfloat16 (positions ``pos..pos+t-1``);
    ``kc``, ``vc``: float32 caches ``[n_kv, max_seq, d]`` (rows ``pos..pos+t-1``
    are written, rows before ``pos`` are read); ``cos``, ``sin``: ``[max_seq, d/2]``
    tables from position 0. Returns ``[t - q_from, n_head d]`` bfloat16: the
    attention output of rows ``q_from..t-1`` (all rows go to the cache).
    ``amx``: the two attention matmuls on AMX tiles (q, k, v and the softmax weights
    rounded to bf16) when ``amx_available()`` and ``d % 32 == 0``; else float32.
    """
    lib = _lib_or_raise()
    _check(qkv, torch.bfloat16, "qkv")
    for name, c in (("kc", kc), ("vc", vc), ("cos", cos), ("sin", sin)):
        _check(c, torch.float32, name)
    t = qkv.shape[0]
    n_kv_c, max_seq, d = kc.shape
    if (n_kv_c != n_kv or vc.shape != kc.shape or qkv.shape[1] != (n_head + 2 * n_kv) * d
            or pos + t > max_seq or cos.shape[0] < pos + t or cos.shape[1] != d // 2
            or not 0 <= q_from < t):  # fmt: skip
        raise ValueError("attn_prefill: shapes")
    out = out if out is not None else torch.empty(t - q_from, n_head * d, dtype=torch.bfloat16)
    _check(out, torch.bfloat16, "out")
    if out.shape != (t - q_from, n_head * d):
        raise ValueError("attn_prefill: out shape")
    rc = lib.qlib_attn_prefill_ex(qkv.data_ptr(), t, kc.data_ptr(), vc.data_ptr(), pos, n_head,
                                  n_kv, d, max_seq, cos.data_ptr(), sin.data_ptr(), int(neox),
                                  q_from, out.data_ptr(), int(amx and amx_available()))  # fmt: skip
    if rc:
        raise RuntimeError("qlib_attn_prefill failed (d % 16, d > 128, heads, memory)")
    return out


def exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' vector ``e^x`` (float32, numel % 16 == 0), for tests."""
    lib = _lib_or_raise()
    x = x.contiguous().float()
    if x.numel() % 16:
        raise ValueError("exp: numel % 16 == 0 needed")
    y = torch.empty_like(x)
    lib.qlib_exp(x.data_ptr(), x.numel(), y.data_ptr())
    return y


# -- transparent huge pages for the weights ---------------------------------------------

_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_HUGE = 2 << 20


def collapse_hugepages(min_bytes: int = 4 << 20, min_resident: float = 0.9) -> int:
    """Back this process's large, resident anonymous mappings with 2 MB pages (Linux).

    The prefill streams ~212 MB of bf16 weights and decode ~100 MB of packed
    weights per token: with 4 KB pages every 4 KB is a TLB miss and a page walk.
    For each private anonymous read-write mapping of at least ``min_bytes`` whose
    resident share is at least ``min_resident`` (so mostly-untouched buffers, such
    as the KV cache, are not populated), ``madvise(MADV_HUGEPAGE)`` and
    ``MADV_COLLAPSE`` (Linux 6.1+) its 2 MB-aligned interior. Returns the bytes
    advised; errors (other systems, THP disabled) are ignored: it is only a hint.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        text = Path("/proc/self/smaps").read_text()
    except (OSError, AttributeError):
        return 0
    done = 0
    head: list[str] | None = None
    for line in [*text.splitlines(), "end"]:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
            head = fields
            continue
        if not head or not line.startswith("Rss:"):
            continue
        lo, hi = (int(x, 16) for x in head[0].split("-"))
        name = head[5] if len(head) > 5 else ""
        anonymous = name in ("", "[heap]")
        head, rss = None, int(fields[1]) * 1024
        if not anonymous or hi - lo < min_bytes or rss < min_resident * (hi - lo):
            continue
        a, b = (lo + _HUGE - 1) & ~(_HUGE - 1), hi & ~(_HUGE - 1)
        if b - a < _HUGE:
            continue
        if madvise(a, b - a, _MADV_HUGEPAGE) == 0:
            madvise(a, b - a, _MADV_COLLAPSE)  # may fail (busy, old kernel): a hint
            done += b - a
    return done
