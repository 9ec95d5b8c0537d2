"""``bench_qmatmul``: time one QMatMul form on one weight shape (used by notebook 7)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..devices import as_device, synchronize
from .api import quantize
from .types import ggml_type


def random_qtensor(n: int, k: int, type_name: str, device="cpu", seed: int = 0, rows: int = 512):
    """A QTensor of random normal weights (``rows`` distinct rows quantized, tiled to ``n``)."""
    from ..qtensor import QTensor

    rng = np.random.default_rng(seed)
    base = quantize(rng.standard_normal((min(n, rows), k), dtype=np.float32), type_name)
    data = np.resize(base, (n, base.shape[1]))
    return QTensor.from_bytes(data, (n, k), type_name, device)


def bench_qmatmul(
    n: int,
    k: int,
    type_name: str,
    m: int = 1,
    form: str = "quantized",
    device="cpu",
    repeats: int = 10,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """Time ``QMatMul(w, form)(x)`` for ``x`` ``[m, k]`` and ``w`` ``[n, k]`` of ``type_name``.

    One untimed call first (it builds caches), then ``repeats`` timed calls, each
    synchronized on GPUs. ``gbps`` is the weight bytes the form reads per call
    (GGUF blocks for "quantized", the dense f32/f16 matrix otherwise) over the
    minimum time; ``gbps_gguf`` uses the GGUF size for every form.
    """
    from ..qtensor import QMatMul

    dev = as_device(device)
    w = random_qtensor(n, k, type_name, dev, seed)
    mm = QMatMul(w, form)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dev, dtype)
    mm(x)
    synchronize(dev)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mm(x)
        synchronize(dev)
        times.append(time.perf_counter() - t0)
    best = min(times)
    gguf_bytes = ggml_type(type_name).nbytes((n, k))
    dense = {"f32": 4, "f16": 2}.get(form)
    weight_bytes = n * k * dense if dense else gguf_bytes
    return {
        "n": n,
        "k": k,
        "type": ggml_type(type_name).name,
        "m": m,
        "form": form,
        "device": str(dev),
        "dtype": str(dtype).replace("torch.", ""),
        "repeats": repeats,
        "time_s": best,
        "median_s": statistics.median(times),
        "weight_bytes": weight_bytes,
        "gbps": weight_bytes / best / 1e9,
        "gbps_gguf": gguf_bytes / best / 1e9,
    }
