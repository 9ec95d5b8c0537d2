"""The persistent decode kernel (``persistent.cu``): a whole decode step in one launch.

``PersistentDecoder`` compiles the kernel at first use with NVRTC for the model's sizes (they
are macros, so every loop bound is a constant) and this GPU's architecture, loads it with the
CUDA driver API and launches it on torch's current stream, so the launch can be captured in a
CUDA graph like any other. Both libraries are reached through ctypes: NVRTC from the
``nvidia-cuda-nvrtc`` wheel that CUDA builds of torch depend on (``$QLIB_NVRTC`` names another),
the driver from ``libcuda.so.1``; nothing else is needed. A compiled kernel is kept in the cache
directory (``$QLIB_CACHE_DIR`` or ``~/.cache/qlib``, ``persistent/``), keyed by the source, the
macros, the architecture and NVRTC's version, so later loads skip NVRTC's seconds. The grid
is one block per SM, all resident at once, which the kernel's waits on other blocks' words
require; on Hopper and later the grid runs as clusters of two blocks (``MLP_PAIR``: two MLP
tasks pool their values through distributed shared memory), where
``cuOccupancyMaxActiveClusters`` says they all fit at once.

The weights are the GGUF blocks as in the file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0),
each tensor a device copy of its bytes. The K-quants (Q2_K .. Q6_K) and IQ4_XS are expanded
once, exactly, into the kernel's ``T_X8`` blocks (``expand_kquant``: per 16 weights a float32
scale and offset, int8 codes; 12 bits a weight, where Q4_K has 4.5): one code path for six
formats, at the cost of bytes the step reads (an IQ4_NL file comes as Q8_0).
``unsupported(types)`` says why a model cannot run here.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import sys
from pathlib import Path

import torch

from ... import progress
from ..api import READ_ONLY
from ..base import FORMATS
from ..cpu.build import cache_dir

SOURCE = Path(__file__).with_name("persistent.cu")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# the types expanded into T_X8 blocks (``expand_kquant``): a float32 scale and offset per 16
# weights and int8 codes hold every one of them exactly (the grid i-quants and the ternary
# types, MXFP4, NVFP4 and Q1_0 too, where they did not come as Q6_K or Q8_0, ``forms.kernel_form``)
EXPANDED = (*K_QUANTS, "IQ4_XS", *READ_ONLY, "MXFP4", "NVFP4", "Q1_0")
X8 = 20  # persistent.cu's T_X8: the expanded K-quant blocks
# the kernel's type of each GGUF type it runs (GGUF's ids; the K-quants and the i-quants run as
# T_X8; an IQ4_NL file comes as Q8_0, ``forms.kernel_form``)
TYPE_IDS = {"F32": 0, "F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7,
            "Q8_0": 8} | dict.fromkeys(EXPANDED, X8)  # fmt: skip
SUPPORTED = tuple(TYPE_IDS)
THREADS = 384  # threads per block (against 256, 320, 448 and 512 on the H200: docs/gpu.md)
CHUNK = 16  # hidden units per MLP task (persistent.cu)
SPLIT = 512  # cached positions per attention split at long context, at most NSMAX splits
MIN_SPLIT = 64  # below that: splits of at least this many, on the blocks before the MLP blocks
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
NORMS = ("attn_norm", "ffn_norm")
# the spans of a layer that ``stage_times_ns`` reports, each ending at a mark of persistent.cu
# (with XCHG, the default, an attention block waits for q, k and v inside "att: scores")
MARKS = (
    "layer: wait",
    "norm",
    "qkv+signal",
    "att: wait qkv",
    "att: scores",
    "att: values",
    "att: merge",
    "att: wo+signal",
    "mlp: wait",
    "mlp: norm",
    "mlp: gate/up",
    "mlp: down+signal",
)
N_MARKS = len(MARKS)
# block_times_ns's points of the middle layer, in persistent.cu's BLOCK_MARK order (NBMARK)
BLOCK_POINTS = ("residual in", "q/k/v done", "heads in", "MLP done", "staging issued",
                "count seen", "values done", "splits merged")  # fmt: skip
WHERE_MAX = 32  # staged pieces a layer at most (persistent.cu's `where`, passed as a macro)
WHERE_BYTES = 2 * WHERE_MAX * 8  # that static array of 2 x WHERE_MAX pointers: not for staging
_SHARED_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_SHARED_OPTIN_ATTR = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


class PersistentError(RuntimeError):
    """The persistent kernel cannot be built or run here (the message says why)."""


def unsupported(types: dict[str, str], head_dim: int, rope_dim: int,
                q_dim: int | None = None, width: int | None = None,
                biases: bool = False) -> str | None:  # fmt: skip
    """Why a model with these tensor types and head size (its query width ``q_dim``, head
    count x head_dim, against its ``width``, embedding_length, where given; ``biases``: its
    projections have some) cannot run the kernel, or None."""
    bad = sorted({t for t in types.values() if t not in SUPPORTED})
    if bad:
        runs = ", ".join(SUPPORTED)
        return f"the persistent kernel has no code for {', '.join(bad)} (it runs {runs})"
    if head_dim % 32 or head_dim > 256:
        return f"the persistent kernel needs head_dim a multiple of 32 up to 256, not {head_dim}"
    if rope_dim != head_dim:
        return "the persistent kernel rotates whole heads (rope_dim == head_dim)"
    if q_dim is not None and q_dim != width:
        return (f"the persistent kernel needs the heads as wide as the model (head_count x "
                f"head_dim {q_dim}, embedding_length {width})")  # fmt: skip
    if biases:
        return "the persistent kernel adds no projection biases (this file has some)"
    return None


def env_macros(text: str) -> dict[str, int]:
    """``$QLIB_PERSISTENT_MACROS`` (``"MLP_PAIR=0,NORM_FAST=0"``) as macros for the kernel;
    PersistentError names an item that is not ``NAME=integer``."""
    macros = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, value = (part.strip() for part in item.partition("="))
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            raise PersistentError(f"QLIB_PERSISTENT_MACROS: {item!r} is not NAME=integer")
        macros[name] = int(value)
    return macros


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
    """``persistent.cu`` compiled by NVRTC for ``arch`` (``sm_90``) with ``-D`` ``macros``
    (and the options in ``$QLIB_NVRTC_OPTIONS``, such as ``-lineinfo`` for ncu's source view)."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    src = SOURCE.read_bytes()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"persistent.cu", 0, None, None):
        raise PersistentError("nvrtcCreateProgram failed")
    opts = [f"-arch={arch}", "-std=c++17", "-default-device"]
    opts += os.environ.get("QLIB_NVRTC_OPTIONS", "").split()  # e.g. -lineinfo for a profiler
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


def _nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cached_cubin(macros: dict[str, object], arch: str) -> bytes:
    """``compile_cubin(macros, arch)``, read from the cache directory when an earlier process
    compiled the same source with the same macros, options, architecture and NVRTC version;
    a cache that cannot be written only means compiling again next time."""
    options = os.environ.get("QLIB_NVRTC_OPTIONS", "")
    key = hashlib.sha256(b"\0".join([
        SOURCE.read_bytes(), repr(sorted(macros.items())).encode(), arch.encode(),
        options.encode(), _nvrtc_version().encode()])).hexdigest()[:24]  # fmt: skip
    path = cache_dir() / "persistent" / f"{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    with progress.waiting("compiling the persistent decode kernel (once: kept for later loads)"):
        cubin = compile_cubin(macros, arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)  # atomic: concurrent first uses are safe
    except OSError:
        pass
    return cubin


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("n_attrs", ctypes.c_uint)]  # fmt: skip


class Kernel:
    """A loaded ``qlib_decode_step`` and its launch through ``cuLaunchKernel``."""

    def __init__(self, cubin: bytes, shared_bytes: int, device: torch.device, threads: int,
                 cluster: int = 1):  # fmt: skip
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
        if cluster > 1:  # every cluster resident at once, or the kernel's waits never end
            config = _LaunchConfig((self.blocks, 1, 1), (threads, 1, 1), shared_bytes)
            n = ctypes.c_int()
            occupancy = getattr(self.cu, "cuOccupancyMaxActiveClusters", None)
            if occupancy is None:
                raise PersistentError("this CUDA driver cannot say how many clusters fit")
            rc = occupancy(ctypes.byref(n), self.fn, ctypes.byref(config))
            if rc or n.value * cluster < self.blocks:
                raise PersistentError(
                    f"clusters of {cluster} blocks: {n.value} resident at once, not the "
                    f"{self.blocks // cluster} the grid needs (driver code {rc})"
                )

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise PersistentError(f"CUDA driver error {rc} ({what} the persistent kernel)")

    def launch(self, args: list[ctypes._SimpleCData]) -> None:
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        rc = self.cu.cuLaunchKernel(self.fn, self.blocks, 1, 1, self.threads, 1, 1,
                                    self.shared_bytes, stream, params, None)  # fmt: skip
        self._check(rc, "launch")


def expand_kquant(t) -> torch.Tensor:
    """K-quant or i-quant matrix ``t`` (rows x k) as the kernel's ``T_X8`` blocks,
    ``[rows, k / 32 * 48]`` bytes: per 32 weights the scale and offset of each half (float32
    a0 b0 a1 b1), then the 32 codes (int8): weight = a * q + b exactly as ggml dequantizes it
    (``BlockFormat.unpack``)."""
    rows, k = t.shape
    fmt = FORMATS[t.dtype.name]
    q, scale, offset = fmt.unpack(t.data.reshape(-1, fmt.type_size))
    per16 = fmt.block_size // 16
    scale = scale.repeat_interleave(per16 // scale.shape[1], dim=1)  # (Q4_K, Q5_K: groups of 32)
    offset = torch.zeros_like(scale) if offset is None else \
        offset.repeat_interleave(per16 // offset.shape[1], dim=1)  # fmt: skip
    ab = torch.stack([scale, offset], -1).float().reshape(-1, 4).view(torch.uint8)  # per 32
    codes = q.to(torch.int8).reshape(-1, 32).view(torch.uint8)
    return torch.cat([ab, codes], 1).reshape(rows, k // 32 * 48)


def q8_rows(data: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 matrix bytes ``[rows, k / 32 * 34]`` as the kernel's ``OUT_Q8X`` reads them: the
    codes as an int8 matrix (``[rows, k]``, raw bytes) and a float32 scale per 32 codes
    (``[rows, k / 32]``); weight = scale * code, as ggml dequantizes Q8_0."""
    blocks = data.reshape(data.shape[0], k // 32, 34)
    scales = blocks[:, :, :2].contiguous().view(torch.float16).float().reshape(-1, k // 32)
    return blocks[:, :, 2:].reshape(-1, k), scales  # (reshape of a slice: a copy)


def expand_q8(t) -> torch.Tensor:
    """Q8_0 matrix ``t`` as the kernel's ``T_X8`` blocks (``Q8_AS_X8``): per 32 weights a0 = a1 =
    d (float32), b0 = b1 = 0, then the 32 codes, so every weight is ``d * q`` as in the file;
    48 bytes a block against 34, 16-aligned (``X8_WIDE`` reads them by whole words)."""
    rows, k = t.shape
    codes, d = q8_rows(t.data.reshape(rows, -1), k)
    ab = torch.stack([d, torch.zeros_like(d)] * 2, -1).view(torch.uint8)  # [rows, k / 32, 16]
    return torch.cat([ab, codes.reshape(rows, k // 32, 32)], -1).reshape(rows, -1)


def kernel_type(name: str, q8_as_x8: bool = False) -> int:
    """The kernel's type id for a matrix of GGUF type ``name`` (``q8_as_x8``: Q8_0 as ``T_X8``)."""
    return X8 if q8_as_x8 and name == "Q8_0" else TYPE_IDS[name]


def kernel_matrix(t, q8_as_x8: bool = False) -> tuple[torch.Tensor, int]:
    """The bytes the kernel reads for matrix ``t`` (``[rows, row bytes]``) and their type
    (``q8_as_x8``: a Q8_0 matrix as ``T_X8`` blocks, ``expand_q8``)."""
    name, type_id = t.dtype.name, kernel_type(t.dtype.name, q8_as_x8)
    if name in EXPANDED:
        return expand_kquant(t), type_id
    if type_id == X8:
        return expand_q8(t), type_id
    return t.data.reshape(t.shape[0], -1), type_id


def _slabs(data: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """Matrix bytes ``data`` (rows x k elements) re-laid as k / width slabs: slab j holds
    columns [j width, (j + 1) width) of every row, contiguous (the kernel's wo and down)."""
    rows = data.shape[0]
    return data.reshape(rows, k // width, -1).transpose(0, 1).contiguous()


def _device_attribute(device: torch.device, attribute: int) -> int:
    cu = _driver()
    dev, value = ctypes.c_int(), ctypes.c_int()
    index = device.index if device.index is not None else torch.cuda.current_device()
    if cu.cuDeviceGet(ctypes.byref(dev), index) or cu.cuDeviceGetAttribute(
        ctypes.byref(value), attribute, dev
    ):
        raise PersistentError(f"cannot read device attribute {attribute}")
    return value.value


def heads_per_task(config, macros: dict) -> int:
    """``persistent.cu``'s ``HPT``: the query heads an attention task scores at most (a KV
    head's, with ``KV_GROUP``; else one)."""
    return config.head_count // config.head_count_kv if macros["KV_GROUP"] else 1


def kernel_macros(config, layers: list[dict], output, max_seq: int, *, blocks: int, optin: int,
                  major: int, threads: int = THREADS, split: int = SPLIT,
                  min_split: int = MIN_SPLIT, kv_stage: bool = True, stage_times: bool = False,
                  kv_half: bool = False, given: dict[str, int] | None = None,
                  ) -> tuple[dict[str, object], int]:  # fmt: skip
    """``persistent.cu``'s macros for a model on a GPU of ``blocks`` SMs, ``optin`` bytes of
    shared memory a block at most and compute capability ``major``, and the launch's shared
    memory bytes. ``layers`` and ``output`` need only ``shape`` and ``dtype.name`` (no GPU is
    touched: ``tools/persistent_compile.py`` builds the kernel with nvcc from them);
    ``kv_half``: the KV cache in IEEE half (a float16 tensor), else float32; ``given``:
    macros set by the caller (``$QLIB_PERSISTENT_MACROS``, experiments), which win."""
    c = config
    n_ff, dim = layers[0]["ffn_gate"].shape
    hd, nh, nl = c.head_dim, c.head_count, c.block_count
    vocab = output.shape[0]
    if dim % 32 or n_ff % 32:
        raise PersistentError(f"the persistent kernel needs the embedding ({dim}) and the "
                              f"feed-forward size ({n_ff}) multiples of 32")  # fmt: skip
    mlp_blocks = min(n_ff // CHUNK, blocks)
    ns_max = blocks // nh
    if ns_max < 1:
        raise PersistentError(f"the persistent kernel needs {nh} blocks resident at once; "
                              f"this GPU has {blocks} SMs")  # fmt: skip
    pairs = (nh + 2 * c.head_count_kv) * hd // 2
    qpb = 1  # RoPE pairs per q/k/v task: the fewest that give every block at most one
    while qpb < hd // 2 and pairs > qpb * blocks:
        qpb *= 2
    warps = threads // 32
    given = dict(given or {})
    # KV_GROUP: an attention task scores the gqa query heads of its KV head (tagged partials
    # only, XCHG), where their queries and sums fit in registers (gqa x hd <= 256 floats)
    gqa = nh // c.head_count_kv
    given.setdefault("KV_GROUP", int(gqa > 1 and gqa * hd <= 256 and given.get("XCHG", 1) != 0))
    hpt = heads_per_task(c, given)
    # S: a split's scores (hpt heads), flat_dots' scratch, the splits' partials; a multiple
    # of 4 keeps what follows 16-aligned
    smax_pos = max(split + hpt, -(-max_seq // ns_max) + hpt, threads + 2 * max(qpb, CHUNK),
                   ns_max * hpt * (hd + 2))  # fmt: skip
    smax_pos = -(-smax_pos // 4) * 4
    floats = (2 * dim + (4 + hpt) * hd + smax_pos + warps * hpt * hd + 10 * CHUNK
              + warps * hpt + 7 * nl)  # fmt: skip
    # two staging areas, beside the floats and the static addresses (WHERE_BYTES)
    wcap = (optin - 4 * floats - 256 - WHERE_BYTES) // 32 * 16
    shared = 2 * wcap + 4 * floats
    # the layers' Q8_0 matrices as T_X8 blocks, read by whole words (X8_WIDE, on by default):
    # 261 against 282 us a step on the Q8_0 variant (docs/gpu.md); alone, slower (312)
    given.setdefault("Q8_AS_X8", int(given.get("X8_WIDE", 1)))
    kinds = {(ly[n].dtype.name, kernel_type(ly[n].dtype.name, bool(given["Q8_AS_X8"])))
             for ly in layers for n in MATRICES}  # fmt: skip
    types = {1 << t for _, t in kinds}
    m: dict[str, object] = dict(
        THREADS=threads, DIM=dim, NFF=n_ff, NH=nh, NKV=c.head_count_kv, HD=hd, NL=nl,
        VOCAB=vocab, MAXSEQ=max_seq, EPS=f"{c.rms_norm_eps!r}f", NEOX=int(c.rope_is_neox),
        GRID=blocks, MLP_BLOCKS=mlp_blocks, NSMAX=ns_max, SPLIT=split,
        MIN_SPLIT=min(min_split, split), QPB=qpb, SMAXPOS=smax_pos, WCAP=wcap,
        KV_STAGE=int(kv_stage), KV_HALF=int(kv_half),
        # counted fixed-point residual words hold at most 1023 addends a sum
        XRES=int(max(nh, n_ff // CHUNK) < 1024), WHERE_MAX=WHERE_MAX, NBMARK=len(BLOCK_POINTS),
        LAYER_TYPES=sum(types), OUT_TYPES=1 << TYPE_IDS[output.dtype.name])  # fmt: skip
    if stage_times:  # block 0 notes the time at every mark (``stage_times_ns``)
        m["QLIB_STAGE_TIMES"] = 1
    m.update(given)  # experiments: any of persistent.cu's macros
    # the MLP tasks' sums in two copies of the counted words (half the atomics an address)
    m.setdefault("DOWN_COPIES", 2 if m["XRES"] else 1)
    # T_X8 blocks that all come from Q8_0 (offset b = 0): their dots skip b * sum(x)
    m.setdefault("X8_NO_B", int({name for name, t in kinds if t == X8} == {"Q8_0"}))
    # a Q8_0 output layer as int8 rows and float32 scales (the kernel's output_rows_q8x)
    q8_out = output.dtype.name == "Q8_0" and dim % 64 == 0
    m.setdefault("OUT_Q8X", int(q8_out))
    if m["OUT_Q8X"] and not q8_out:
        raise PersistentError("OUT_Q8X needs a Q8_0 output layer of rows a multiple of 64")
    # the MLP tasks in pairs on clusters of two blocks (Hopper on): where the counts allow
    if "MLP_PAIR" not in (given or {}):
        even = all(n % 2 == 0 for n in (blocks, mlp_blocks, n_ff // CHUNK))
        m["MLP_PAIR"] = int(major >= 9 and even and bool(m["XRES"]))
    return m, shared


class PersistentDecoder:
    """One decode step of a llama model in one kernel launch, on the buffers of a fast model.

    ``layers``: per layer the 7 matrices (``MATRICES``) and 2 norms (``NORMS``) as device
    tensors (GGUF block bytes; float32 norms) with their type names; the KV cache, RoPE
    tables, token / position / logits buffers are the fast engine's own. A step advances the
    position itself. ``threads`` (a block), ``split`` and ``min_split`` (positions per attention
    split) shape the launch (docs/gpu.md has the sweeps); ``kv_stage``: an attention split's
    cached keys and values staged into shared memory where they fit; ``stage_times``: the
    spans of a step (``stage_times_ns``); ``macros``: more of ``persistent.cu``'s macros, for
    experiments (``tools/persistent_probe.py``).
    """

    def __init__(self, config, layers: list[dict], tok_embd, output, out_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor,
                 device: torch.device, *, threads: int = THREADS, split: int = SPLIT,
                 min_split: int = MIN_SPLIT, kv_stage: bool = True,
                 stage_times: bool = False, macros: dict[str, int] | None = None):  # fmt: skip
        c = config
        dim = layers[0]["ffn_gate"].shape[1]
        hd, nh, nl = c.head_dim, c.head_count, c.block_count
        blocks = torch.cuda.get_device_properties(device).multi_processor_count
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
        # experiments: persistent.cu's macros (KV_STAGE, ...), from $QLIB_PERSISTENT_MACROS
        # (any command's kernel) and from the caller
        given = {**env_macros(os.environ.get("QLIB_PERSISTENT_MACROS", "")), **(macros or {})}
        optin = _device_attribute(device, _SHARED_OPTIN_ATTR)
        self.macros, shared = kernel_macros(
            config, layers, output, cache.shape[3], blocks=blocks, optin=optin, major=major,
            threads=threads, split=split, min_split=min_split, kv_stage=kv_stage,
            stage_times=stage_times, kv_half=cache.dtype == torch.float16, given=given)  # fmt: skip
        ns_max = self.macros["NSMAX"]
        pair_given = "MLP_PAIR" in given
        try:
            self.kernel = self._kernel(arch, shared, device, threads)
        except PersistentError:
            if pair_given or not self.macros["MLP_PAIR"]:
                raise
            self.macros["MLP_PAIR"] = 0  # (clusters of two that do not all fit at once)
            self.kernel = self._kernel(arch, shared, device, threads)
        self.keep: list[torch.Tensor] = []  # every tensor the kernel reads by address
        ptrs, types = [], []
        for ly in layers:
            for name in MATRICES:
                data, type_id = kernel_matrix(ly[name], bool(self.macros.get("Q8_AS_X8")))
                if name == "attn_output":
                    data = _slabs(data, ly[name].shape[1], hd)
                elif name == "ffn_down":
                    data = _slabs(data, ly[name].shape[1], 32)  # (an MLP task reads half a slab)
                ptrs.append(data.data_ptr())
                types.append(type_id)
                self.keep.append(data)
            for name in NORMS:
                ptrs.append(ly[name].data_ptr())
                self.keep.append(ly[name])
        self.weights = torch.tensor(ptrs, dtype=torch.int64, device=device)
        self.types = torch.tensor(types, dtype=torch.int32, device=device)
        self.tok_embd, self.emb_type = kernel_matrix(tok_embd)
        tied = output is tok_embd  # (one copy of a tied matrix)
        self.output, self.out_type = (
            (self.tok_embd, self.emb_type) if tied else kernel_matrix(output))  # fmt: skip
        self.out_scales = torch.empty(0, device=device)
        if self.macros["OUT_Q8X"]:  # (the embedding lookup keeps the blocks)
            self.output, self.out_scales = q8_rows(self.output, dim)
        self.keep += [self.tok_embd, self.output, self.out_scales, out_norm, cos, sin, cache]
        acc_n = (2 * nl + 1 + (self.macros["DOWN_COPIES"] - 1) * nl) * dim  # ACC_N
        n_counters = nl * (c.head_count_kv + 2 + nh) + 1
        # two sets, by the step's parity, of float32 sums or (XRES) 64-bit words
        words = 2 if self.macros["XRES"] else 1
        self.acc = torch.zeros(2 * words * acc_n, device=device)
        self.counters = torch.zeros(2 * n_counters, dtype=torch.int32, device=device)
        self.steps = torch.zeros(1, dtype=torch.int32, device=device)
        self.best = torch.zeros(2, dtype=torch.int64, device=device)
        self.out_tok = torch.zeros(1, dtype=torch.int64, device=device)
        # the splits' partials and q as plain floats: read only with XCHG=0 (the A/B macro)
        self.part = torch.empty(nh * ns_max * (hd + 2), device=device)
        self.q = torch.empty(nh * hd, device=device)
        # tagged words (XCHG): per layer q / new k, v, then per layer the splits' partials
        hpt = heads_per_task(c, self.macros)
        xchg = nl * (nh + 2 * c.head_count_kv) * hd + nl * nh * ns_max * hpt * (hd + 2)
        self.xchg = torch.zeros(xchg, dtype=torch.int64, device=device)
        # the layers' marks, the step's start and end, NBMARK a block, then the output layer's 3
        self._block_marks = N_MARKS * nl + 2
        self._out_marks = self._block_marks + len(BLOCK_POINTS) * blocks
        self.stage_times = torch.zeros(self._out_marks + 3, dtype=torch.int64, device=device)
        self.n_layers = nl
        self.out_norm, self.cos, self.sin, self.cache = out_norm, cos, sin, cache

    def _kernel(self, arch: str, shared: int, device: torch.device, threads: int) -> Kernel:
        cluster = 2 if self.macros["MLP_PAIR"] else 1
        return Kernel(cached_cubin(self.macros, arch), shared, device, threads, cluster)

    def step(self, tok: torch.Tensor, pos: torch.Tensor, logits: torch.Tensor,
             host_out: torch.Tensor | None = None,
             out_tok: torch.Tensor | None = None) -> None:  # fmt: skip
        """Enqueue one step: token ``tok`` (int64 [1]) at position ``pos`` (int32 [1]) ->
        ``logits`` (float32, vocab) and the argmax (into ``out_tok``, int64 [1], which may be
        ``tok`` itself: the greedy loop's next input; by default ``next_token``'s buffer); the
        cache gets the position, and ``pos`` moves to the next one. ``host_out``: pinned host
        memory (int64 [2], device-accessible), where the step also writes the count of steps
        done (mod 2^32) and its argmax as one word, ``count << 32 | token``, at its parity
        ``count - 1 & 1``."""
        out_tok = self.out_tok if out_tok is None else out_tok
        p = ctypes.c_uint64
        i = ctypes.c_int32
        args = [
            p(self.weights.data_ptr()), p(self.types.data_ptr()),
            p(self.tok_embd.data_ptr()), i(self.emb_type), p(self.output.data_ptr()),
            i(self.out_type),
            p(self.out_norm.data_ptr()), p(self.cos.data_ptr()), p(self.sin.data_ptr()),
            p(self.cache.data_ptr()), p(tok.data_ptr()), p(pos.data_ptr()),
            p(self.acc.data_ptr()), p(self.counters.data_ptr()), p(self.steps.data_ptr()),
            p(self.best.data_ptr()), p(out_tok.data_ptr()), p(self.part.data_ptr()),
            p(self.q.data_ptr()), p(logits.data_ptr()), p(self.stage_times.data_ptr()),
            p(self.xchg.data_ptr()), p(host_out.data_ptr() if host_out is not None else 0),
            p(self.out_scales.data_ptr()),
        ]  # fmt: skip
        self.kernel.launch(args)

    def stage_times_ns(self) -> dict[str, float]:
        """With ``stage_times=True``: the last step's ns, summed over the layers, as block 0 (a
        q/k/v and an attention task each layer) and the first MLP block (the ``mlp:`` marks) saw
        them (``MARKS``: each names the span that ends at its mark); ``output``: the output
        layer and argmax, and within it block 0's ``out: wait / norm / rows / argmax``;
        ``total``."""
        t = self.stage_times.cpu().double()
        nl = self.n_layers
        start, end = t[N_MARKS * nl], t[N_MARKS * nl + 1]
        m = t[: N_MARKS * nl].view(nl, N_MARKS)
        out = dict(zip(MARKS, self.layer_spans_ns().sum(0).tolist(), strict=True))
        o = t[self._out_marks :]  # block 0 in the output layer
        if bool((o > 0).all()):
            marks = {"out: wait": o[0] - m[-1, -1], "out: norm": o[1] - o[0],
                     "out: rows": o[2] - o[1], "out: argmax": end - o[2]}  # fmt: skip
            out.update({k: float(v) for k, v in marks.items()})
        out.update(output=float(end - m[-1, -1]), total=float(end - start))
        return out

    def layer_spans_ns(self) -> torch.Tensor:
        """With ``stage_times=True``: the last step's spans (``MARKS``) of every layer as block
        0 saw them, ns, [layers, len(MARKS)] (layer 0's first span from the step's start)."""
        t = self.stage_times.cpu().double()
        nl = self.n_layers
        m = t[: N_MARKS * nl].view(nl, N_MARKS)
        prev = torch.cat([t[N_MARKS * nl].view(1), m[:-1, -1]])
        return torch.cat([(m[:, 0] - prev).view(-1, 1), m[:, 1:] - m[:, :-1]], 1)

    def block_times_ns(self) -> torch.Tensor:
        """With ``stage_times=True``: per block, the ns at the ``BLOCK_POINTS`` of the last
        step's middle layer (0 where a block has no such point), from block 0's first point."""
        t = self.stage_times[self._block_marks : self._out_marks].view(-1, len(BLOCK_POINTS))
        t = t.cpu()
        return torch.where(t > 0, t - t[0, 0], torch.zeros_like(t))

    def next_token(self) -> torch.Tensor:
        """The argmax of the last step's logits (int64 [1], on the device; no read-back)."""
        return self.out_tok.clone()
