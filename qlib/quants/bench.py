"""Benchmark weights and timing: ``random_qtensor`` (quantized normals), ``random_blocks``
(random valid blocks, made on the device), ``bench_qmatmul`` (one QMatMul form, notebook 7)."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ..devices import as_device, synchronize
from .api import quantize
from .qtensor import QMatMul, QTensor
from .types import ggml_type


def random_qtensor(n: int, k: int, type_name: str, device="cpu", seed: int = 0, rows: int = 512):
    """A QTensor of random normal weights (``rows`` distinct rows quantized, tiled to ``n``)."""
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


# Byte offsets of the float16 scale fields, which random bytes would fill with inf/NaN.
_SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q8_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "Q1_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,),
    "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ1_S": (0,), "TQ1_0": (52,), "TQ2_0": (64,),
}  # fmt: skip


def random_blocks(n: int, k: int, type_name: str, device="cpu", seed: int = 0) -> QTensor:
    """A QTensor ``(n, k)`` of random but valid blocks: random codes, scales about 1e-2.

    Much faster than quantizing random floats (no scale search), so large test
    weights can be made on the device.
    """
    t = ggml_type(type_name)
    g = torch.Generator(device=device).manual_seed(seed)
    if not t.is_quantized:
        x = torch.randn(n, k, generator=g, device=device) * 0.05
        dt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t.name]
        return QTensor(x.to(dt).contiguous().view(torch.uint8).reshape(-1), (n, k), t)
    nb = n * k // t.block_size
    raw = torch.randint(0, 256, (nb, t.type_size), generator=g, device=device, dtype=torch.uint8)
    for off in _SCALE_FIELDS.get(t.name, ()):
        s = (torch.rand(nb, generator=g, device=device) + 0.5) * 0.01
        raw[:, off : off + 2] = s.half().view(torch.uint8).reshape(nb, 2)
    if t.name == "MXFP4":  # the E8M0 exponent: scales 2^-10 .. 2^-7 (any byte is valid, but
        # 2^127 times the codes overflows float32)
        e = torch.randint(118, 122, (nb,), generator=g, device=device)
        raw[:, 0] = e.to(torch.uint8)
    if t.name == "NVFP4":  # the four UE4M3 scales: exponents 1..2, values 2^-6 .. 2^-4 (halved
        # by the doubled table); a random byte reaches 480, and 12 x 240 x 4096 sums overflow f16
        raw[:, :4] = torch.randint(8, 24, (nb, 4), generator=g, device=device).to(torch.uint8)
    if t.name == "IQ1_M":  # its f16 d: the top nibbles of the four scale words (bytes 48..55)
        s = ((torch.rand(nb, generator=g, device=device) + 0.5) * 0.01).half()
        bits = s.view(torch.int16).int() & 0xFFFF
        for i in range(4):
            hi = raw[:, 49 + 2 * i].int()
            raw[:, 49 + 2 * i] = ((hi & 0x0F) | (((bits >> (4 * i)) & 0xF) << 4)).to(torch.uint8)
    if t.name == "Q8_K":
        s = (torch.rand(nb, generator=g, device=device) + 0.5) * 0.01
        raw[:, 0:4] = s.view(torch.uint8).reshape(nb, 4)
    return QTensor(raw.reshape(-1), (n, k), t)
