"""Where a result was measured: CPU, GPU, memory, software versions, git commit.

``machine_info()`` is cheap (tens of milliseconds once torch is imported): it
reads ``/proc`` or ``sysctl`` rather than running py-cpuinfo's probe, and reads
package versions from their metadata without importing them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # qlib/suite/machine.py -> the checkout
# name in the record -> distribution name
PACKAGES = {
    "torch": "torch",
    "numpy": "numpy",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "gguf": "gguf",
    "llama_cpp": "llama-cpp-python",
}
# environment variables that change what the engine does, recorded when set
ENV_VARS = (
    "QLIB_DEQUANTIZE_ALL",
    "QLIB_DEQUANTIZE_ALL_F16",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's marketing name, e.g. 'Intel(R) Xeon(R) Platinum 8480+'."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        name = _run(["sysctl", "-n", "machdep.cpu.brand_string"])
        if name:
            return name
    try:  # slow (it probes in a subprocess): last resort
        import cpuinfo

        return cpuinfo.get_cpu_info().get("brand_raw") or platform.processor()
    except Exception:
        return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages results depend on (None: not installed)."""
    out: dict[str, str | None] = {}
    for name, dist in PACKAGES.items():
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_commit(repo: Path = REPO_ROOT) -> dict[str, object] | None:
    """Short sha of the checkout and whether tracked files outside ``results/`` differ from it.

    ``$QLIB_COMMIT``, when set, names the commit instead (dirty unknown): a copy of
    the tree on a GPU machine may carry no ``.git``, or a stale one (the device
    tool's copy had the session's first commit under a newer tree). None when
    neither is there.
    """
    env = os.environ.get("QLIB_COMMIT")
    if env:
        return {"commit": env[:7] if len(env) == 40 else env, "dirty": None}
    sha = _run(["git", "rev-parse", "--short", "HEAD"], cwd=repo)
    if sha is None:
        return None
    # the suite's own outputs (results/, tracked) change while it runs: not the code's state
    status = _run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                   ":(exclude)results"], cwd=repo)  # fmt: skip
    return {"commit": sha, "dirty": bool(status)}


@functools.lru_cache(maxsize=1)
def cpu_features() -> list[str]:
    """The SIMD features that matter to quantized kernels, as /proc/cpuinfo names them."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "neon")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [w for w in wanted if w in have]
    except OSError:
        pass
    return []


def _ram_gb() -> float | None:
    try:
        import psutil

        return round(psutil.virtual_memory().total / 2**30, 1)
    except Exception:
        return None


def _gpus() -> list[dict[str, object]]:
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return []
    import torch

    gpus: list[dict[str, object]] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "device": f"cuda:{i}",
                    "name": p.name,
                    "memory_gb": round(p.total_memory / 2**30, 1),
                    "capability": f"{p.major}.{p.minor}",
                    "cuda": torch.version.cuda,
                }
            )
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        gpus.append({"device": "mps", "name": f"Apple GPU ({cpu_model()})", "memory_gb": None})
    return gpus


def _torch_threads() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.get_num_threads()


def machine_info() -> dict[str, object]:
    """Provenance of a measurement: hardware, software, checkout and time, JSON-ready."""
    try:
        import psutil

        physical = psutil.cpu_count(logical=False)
    except Exception:
        physical = None
    return {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "logical_cores": os.cpu_count(),
        "physical_cores": physical,
        "torch_threads": _torch_threads(),
        "ram_gb": _ram_gb(),
        "gpus": _gpus(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "git": git_commit(),
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def summary(info: dict[str, object]) -> str:
    """One line for a report: 'Intel Xeon, 2 cores (2 torch threads), 24 GiB; torch 2.13.0'."""
    parts = [f"{info.get('cpu')}, {info.get('logical_cores')} cores"]
    if info.get("torch_threads"):
        parts[0] += f" ({info['torch_threads']} torch threads)"
    if info.get("ram_gb"):
        parts[0] += f", {info['ram_gb']:g} GiB"
    for g in info.get("gpus") or []:
        mem = f" {g['memory_gb']:g} GiB" if g.get("memory_gb") else ""
        parts.append(f"{g['name']}{mem}")
    pk = info.get("packages") or {}
    if pk.get("torch"):
        parts.append(f"torch {pk['torch']}")
    parts.append(f"Python {info.get('python')}")
    return "; ".join(parts)
