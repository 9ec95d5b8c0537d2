"""The persistent decode kernel (``persistent.cu``): a whole decode step in one launch.

``PersistentDecoder`` compiles the kernel at first use with NVRTC for the model's sizes (they
are macros, so every loop bound is a constant) and this GPU's architecture, loads it with the
CUDA driver API and launches it on torch's current stream, so the launch can be captured in a
CUDA graph like any other. Both libraries are reached through ctypes: NVRTC from the
``nvidia-cuda-nvrtc`` wheel that CUDA builds of torch depend on (``$QLIB_NVRTC`` names another),
the driver from ``libcuda.so.1``; nothing else is needed. The grid is one block per SM, all
resident at once, which the kernel's grid-wide barriers require.

The weights are the GGUF blocks as in the file (``SUPPORTED``: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0), each tensor a device copy of its bytes; ``unsupported(types)`` says why a model cannot
run here (K-quants have no code in the kernel yet).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("persistent.cu")
SUPPORTED = ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
THREADS = 384  # measured best of 256 / 384 / 512 on the H200 (docs/gpu.md)
CH = 32  # cached positions per attention task (persistent.cu)
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("attn_norm", "ffn_norm")
_SHARED_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class PersistentError(RuntimeError):
    """The persistent kernel cannot be built or run here (the message says why)."""


def unsupported(types: dict[str, str], head_dim: int, rope_dim: int) -> str | None:
    """Why a model with these tensor types and head size cannot run the kernel, or None."""
    bad = sorted({t for t in types.values() if t not in SUPPORTED})
    if bad:
        runs = ", ".join(SUPPORTED)
        return f"the persistent kernel has no code for {', '.join(bad)} (it runs {runs})"
    if head_dim % 32 or head_dim > 256:
        return f"the persistent kernel needs head_dim a multiple of 32 up to 256, not {head_dim}"
    if rope_dim != head_dim:
        return "the persistent kernel rotates whole heads (rope_dim == head_dim)"
    return None


def _nvrtc() -> ctypes.CDLL:
    names = [os.environ.get("QLIB_NVRTC", "")]
    for base in sys.path:
        # nvidia/cu13/lib (CUDA 13 wheels), nvidia/cuda_nvrtc/lib (CUDA 12 wheels)
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")))
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for name in names:
        if not name or "builtins" in name or ".alt." in name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise PersistentError(
        "NVRTC (libnvrtc.so) not found: install nvidia-cuda-nvrtc or set QLIB_NVRTC"
    )


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise PersistentError(f"the CUDA driver library is not loadable: {e}") from None


def compile_cubin(macros: dict[str, object], arch: str) -> bytes:
    """``persistent.cu`` compiled by NVRTC for ``arch`` (``sm_90``) with ``-D`` ``macros``."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    src = SOURCE.read_bytes()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"persistent.cu", 0, None, None):
        raise PersistentError("nvrtcCreateProgram failed")
    opts = [f"-arch={arch}", "-std=c++17", "-default-device"]
    opts += [f"-D{k}={v}" for k, v in macros.items()]
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc:
            raise PersistentError(f"NVRTC could not compile persistent.cu:\n{log.value.decode()}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin):
            raise PersistentError("nvrtcGetCUBIN failed")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


class Kernel:
    """A loaded ``qlib_decode_step`` and its launch through ``cuLaunchKernel``."""

    def __init__(self, cubin: bytes, shared_bytes: int, device: torch.device, threads: int):
        torch.cuda.init()
        torch.empty(1, device=device)  # the primary context is current on this thread
        self.cu = _driver()
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))
        self._check(self.cu.cuModuleLoadData(ctypes.byref(self.module), self._cubin), "load")
        name = b"qlib_decode_step"
        self._check(self.cu.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name), "get")
        if shared_bytes > 48 * 1024:
            rc = self.cu.cuFuncSetAttribute(self.fn, _SHARED_ATTR, ctypes.c_int(shared_bytes))
            self._check(rc, "set the shared memory size")
        self.shared_bytes, self.threads = shared_bytes, threads
        self.blocks = torch.cuda.get_device_properties(device).multi_processor_count
        self.device = device

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise PersistentError(f"CUDA driver error {rc} ({what} the persistent kernel)")

    def launch(self, args: list[ctypes._SimpleCData]) -> None:
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        rc = self.cu.cuLaunchKernel(self.fn, self.blocks, 1, 1, self.threads, 1, 1,
                                    self.shared_bytes, stream, params, None)  # fmt: skip
        self._check(rc, "launch")


class PersistentDecoder:
    """One decode step of a llama model in one kernel launch, on the buffers of a fast model.

    ``layers``: per layer the 7 matrices (``MATRICES``) and 2 norms (``NORMS``) as device
    tensors (GGUF block bytes; float32 norms) with their type names; the KV cache, RoPE
    tables, token / position / logits buffers are the fast engine's own.
    """

    def __init__(self, config, layers: list[dict], tok_embd, output, out_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                 device: torch.device, *, threads: int = THREADS,
                 stage_times: bool = False):  # fmt: skip
        c = config
        n_ff = layers[0]["ffn_gate"].shape[0]
        vocab = output.shape[0]
        max_seq = cache.shape[3]
        self.macros = dict(THREADS=threads, DIM=c.embedding_length, NFF=n_ff, NH=c.head_count,
                           NKV=c.head_count_kv, HD=c.head_dim, NL=c.block_count, VOCAB=vocab,
                           MAXSEQ=max_seq, EPS=f"{c.rms_norm_eps!r}f",
                           NEOX=int(c.rope_is_neox))  # fmt: skip
        if stage_times:  # block 0 notes the time after every stage (``stage_times_ns``)
            self.macros["QLIB_STAGE_TIMES"] = 1
        major, minor = torch.cuda.get_device_capability(device)
        warps = threads // 32
        smem_floats = max(c.embedding_length, n_ff, c.head_count * c.head_dim)
        shared = 4 * (smem_floats + warps + warps * c.head_dim)
        self.kernel = Kernel(compile_cubin(self.macros, f"sm_{major}{minor}"), shared, device,
                             threads)  # fmt: skip
        self.keep: list[torch.Tensor] = []  # every tensor the kernel reads by address
        ptrs, types = [], []
        for ly in layers:
            for name in MATRICES:
                t = ly[name]
                ptrs.append(t.data.data_ptr())
                types.append(TYPE_IDS[t.dtype.name])
                self.keep.append(t.data)
            for name in NORMS:
                ptrs.append(ly[name].data_ptr())
                self.keep.append(ly[name])
        self.weights = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.types = torch.tensor(types, dtype=torch.int32, device=device)
        self.tok_embd, self.output = tok_embd, output
        self.keep += [tok_embd.data, output.data, out_norm, cos, sin, cache]
        nc_max = (max_seq + CH - 1) // CH
        self.h = torch.empty(c.embedding_length, device=device)
        self.q = torch.empty(c.head_count * c.head_dim, device=device)
        self.part = torch.empty(c.head_count * nc_max * (c.head_dim + 2), device=device)
        self.g = torch.empty(n_ff, device=device)
        self.best = torch.zeros(1, dtype=torch.int64, device=device)
        self.bar = torch.zeros(1, dtype=torch.int64, device=device)  # the barrier count
        n_marks = 5 * c.block_count + 2
        self.stage_times = torch.zeros(n_marks, dtype=torch.int64, device=device)
        self.out_norm, self.cos, self.sin, self.cache = out_norm, cos, sin, cache

    def step(self, tok: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor) -> None:
        """Enqueue one step: token ``tok`` (int64 [1]) at position ``pos`` (int32 [1]) ->
        ``logits`` (float32, vocab) and ``best`` (the argmax key); the cache gets the position."""
        p = ctypes.c_uint64
        i = ctypes.c_int32
        args = [
            p(self.weights.data_ptr()), p(self.types.data_ptr()),
            p(self.tok_embd.data.data_ptr()), i(TYPE_IDS[self.tok_embd.dtype.name]),
            p(self.output.data.data_ptr()), i(TYPE_IDS[self.output.dtype.name]),
            p(self.out_norm.data_ptr()), p(self.cos.data_ptr()), p(self.sin.data_ptr()),
            p(self.cache.data_ptr()), p(tok.data_ptr()), p(pos.data_ptr()),
            p(self.h.data_ptr()), p(self.q.data_ptr()), p(self.part.data_ptr()),
            p(self.g.data_ptr()), p(logits.data_ptr()), p(self.best.data_ptr()),
            p(self.bar.data_ptr()), p(self.stage_times.data_ptr()),
        ]  # fmt: skip
        self.kernel.launch(args)

    def stage_times_ns(self) -> dict[str, float]:
        """With ``stage_times=True``: the last step's ns per stage (A .. E summed over the
        layers; ``output``: the output layer and argmax), from block 0's clock."""
        t = self.stage_times.cpu().double()
        d = t[1:] - t[:-1]
        layers = d[:-1].view(-1, 5).sum(0)
        names = ("A qkv+rope", "B attention", "C combine+wo", "D gate/up", "E down")
        out = dict(zip(names, layers.tolist(), strict=True))
        out["output"] = float(d[-1])
        out["total"] = float(t[-1] - t[0])
        return out

    def next_token(self) -> torch.Tensor:
        """The argmax of the last step's logits (int64 [1], on the device; no read-back)."""
        return 0xFFFFFFFF - (self.best & 0xFFFFFFFF)
