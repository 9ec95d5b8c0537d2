"""Building and loading the C kernels: compile on first use, cache, load with ctypes.

``kernels.c``, ``kquants.c``, ``floats.c``, ``prefill.c``, ``attn.c``, ``decode.c`` and
``rows.c`` (with ``simd.h``), shipped as source, are compiled with the system C compiler
(``$CC`` or ``cc``; one compiler per source, as many at once as there are cores, with a
progress bar when it takes over two seconds) into a cache directory (``$QLIB_CACHE_DIR`` or
``~/.cache/qlib``), keyed by a hash of the sources and the flags (a failed build leaves its
message there, so it is not retried by every process), and loaded with ctypes.
``load_library()`` returns the bare ``CDLL`` (the C signatures are declared by
``ops.load()``, the only loader the rest of qlib uses).

The C kernels are unavailable (``available()`` False, ``unavailable_reason()``)
when the CPU lacks AVX-512 F/BW/VL/VNNI or F16C, no compiler works, or
``QLIB_NO_CKERNELS`` is set. The AMX kernels of ``prefill.c`` are built in when the
compiler takes ``AMX_CFLAGS`` (``amx_build_error()`` says why not); whether they
can run is ``ops.amx_available()``. The library is linked with ``-fopenmp``:
imported after torch it shares torch's ``libgomp`` (same soname), so its parallel
loops use torch's OpenMP thread pool and follow ``torch.set_num_threads``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from ... import progress

SOURCES = [
    Path(__file__).with_name(n)
    for n in (
        "kernels.c",
        "kquants.c",
        "floats.c",
        "prefill.c",
        "attn.c",
        "decode.c",
        "rows.c",
        "gridx4.c",
    )
]
HEADERS = [Path(__file__).with_name("simd.h")]  # included by all: part of the build's hash
CFLAGS = [
    "-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma",
    "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
]  # fmt: skip
AMX_CFLAGS = ["-mamx-tile", "-mamx-bf16", "-mavx512bf16"]  # prefill.c's AMX kernels only
REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")  # the CPU's, for the AMX kernels

_lib: ctypes.CDLL | None = None
_reason: str | None = None
_amx_build_error: str | None = None


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than "" or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def cache_dir() -> Path:
    return Path(os.environ.get("QLIB_CACHE_DIR") or Path.home() / ".cache" / "qlib")


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _compile(flags: list[str]) -> Path:
    cc = _compiler()
    if not cc:
        raise RuntimeError("no C compiler (set CC)")
    src = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    key = hashlib.sha256(src + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = cache_dir() / f"qlib_kernels_{key}.so"
    failed = out.with_suffix(".failed")  # a failed build's message: not retried every process
    if out.is_file():
        return out
    if failed.is_file():
        raise RuntimeError(failed.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        objects = [Path(tmp) / f"{i}_{p.stem}.o" for i, p in enumerate(SOURCES)]
        compile_flags = [f for f in flags if f != "-shared"]

        def compile_one(i: int) -> subprocess.CompletedProcess:
            argv = [cc, *compile_flags, "-c", "-o", str(objects[i]), str(SOURCES[i])]
            return subprocess.run(argv, capture_output=True, text=True)

        # one compiler per source, as many at once as there are cores (prefill.c alone takes
        # ~16 of the ~26 s a single call took on 2 cores), then one link
        workers = max(1, min(len(SOURCES), os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            runs = [pool.submit(compile_one, i) for i in range(len(SOURCES))]
            done = progress.bar(as_completed(runs), len(runs), "compiling qlib's C kernels "
                                "(once per version)", "file")  # fmt: skip
            procs = [run.result() for run in done]
        if not any(p.returncode for p in procs):
            argv = [cc, *flags, "-o", str(tmp_so), *map(str, objects)]
            procs = [subprocess.run(argv, capture_output=True, text=True)]
        failures = [p for p in procs if p.returncode]
        if failures:
            message = f"{cc} failed: {_first_error(failures[0].stderr)}"
            failed.write_text(message)
            raise RuntimeError(message)
        os.replace(tmp_so, out)  # atomic: concurrent first uses are safe
    return out


def _first_error(stderr: str) -> str:
    """The compiler's first error line (and the one after it), else the end of its output."""
    lines = stderr.strip().splitlines()
    for i, line in enumerate(lines):
        if "error" in line:
            return "\n".join(lines[i : i + 2])
    return stderr.strip()[-500:]


def compiler_knows_amx() -> bool:
    """Whether the C compiler compiles an AMX intrinsic (GCC 11+, clang 12+)."""
    probe = "#include <immintrin.h>\nvoid f(void) { _tile_zero(0); }\n"  # (AVX512-BF16: GCC 10+)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text(probe)
        proc = subprocess.run([_compiler(), *AMX_CFLAGS, "-c", "-o", str(Path(tmp) / "probe.o"),
                               str(src)], capture_output=True)  # fmt: skip
    return proc.returncode == 0


def load_library() -> ctypes.CDLL | None:
    """The compiled library without its C signatures (``ops.load()`` declares them), or
    None (see ``unavailable_reason``). Built once per process; later calls are cheap."""
    global _lib, _reason, _amx_build_error
    if _lib is not None or _reason is not None:
        return _lib
    try:
        if env_flag("QLIB_NO_CKERNELS"):
            raise RuntimeError("disabled by QLIB_NO_CKERNELS")
        missing = [f for f in REQUIRED_FLAGS if f not in cpu_flags()]
        if missing:
            raise RuntimeError(f"CPU lacks {', '.join(missing)}")
        try:  # with the AMX kernels when the compiler knows AMX (GCC 11+, clang 12+)
            so = _compile(CFLAGS + AMX_CFLAGS)
        except RuntimeError as e:
            _amx_build_error = (
                f"the AMX build failed: {str(e)[-300:]}"
                if compiler_knows_amx()
                else f"the compiler does not take {' '.join(AMX_CFLAGS)}"
            )
            so = _compile(CFLAGS)
        _lib = ctypes.CDLL(str(so))
    except (OSError, RuntimeError) as e:
        _reason = str(e)
    return _lib


def available() -> bool:
    """Whether the C kernels can run here."""
    return load_library() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    load_library()
    return _reason


def amx_build_error() -> str | None:
    """Why the library was built without its AMX kernels, when the AMX build failed."""
    load_library()
    return _amx_build_error
