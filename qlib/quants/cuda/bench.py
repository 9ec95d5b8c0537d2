"""Time ``qlib.quants.cuda.matmul.qmatmul`` on CUDA against torch's f16 ``x @ w.T`` (docs/gpu.md).

    python -m qlib.quants.cuda.bench [--out DIR] [--sections main,gemv,gemm,cross]

(default sections: main,gemv,cross)

Each weight is replicated into enough distinct copies (at least ``ROTATE``
bytes, several times the L2) and the calls cycle through them, as a model's
layers do, so weights come from device memory. Two times per call:
``graph`` (one pass over the copies captured in a CUDA graph, replayed: GPU
time) and ``eager`` (the same calls from Python, CUDA events around them:
includes launch overhead when the CPU is the bottleneck). Bytes counted: the
weight's GGUF bytes (f16: 2 per element) plus x and y, read/written once.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from ..bench import random_blocks
from ..types import ggml_type
from . import kernels, layout, matmul

ROTATE = 192 << 20
SMOLLM2 = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
BIG = (8192, 4096)
DT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _event_ms(fn) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = 1 << 30
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = statistics.median(_event_ms(lambda: b.copy_(a)) for _ in range(10))
    return 2 * n / (ms / 1e3)


def timed(calls: list, replays: int = 7) -> tuple[float, float]:
    """(graph, eager) microseconds per call for a list of zero-argument calls (one pass)."""
    for f in calls:
        f()
    torch.cuda.synchronize()
    passes = max(1, 128 // len(calls))

    def run():
        for _ in range(passes):
            for f in calls:
                f()

    run()
    eager = statistics.median(_event_ms(run) for _ in range(3)) / (passes * len(calls)) * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    graph = statistics.median(_event_ms(g.replay) for _ in range(replays)) / len(calls) * 1e3
    del g
    return graph, eager


class Copies:
    """``count`` distinct random weights of one shape and format, as views of one buffer."""

    def __init__(self, n: int, k: int, type_name: str, seed: int = 0):
        from ..qtensor import QTensor

        t = ggml_type(type_name)
        self.bytes_one = t.nbytes((n, k)) if type_name != "F16" else 2 * n * k
        self.count = max(1, min(1024, math.ceil(ROTATE / self.bytes_one)))
        if type_name == "F16":
            big = torch.randn(self.count * n, k, device="cuda", dtype=torch.float16) * 0.05
            self.items = list(big.view(self.count, n, k))
        else:
            big = random_blocks(self.count * n, k, type_name, device="cuda", seed=seed)
            rows = big.data.view(self.count, n, -1)
            self.items = [QTensor(rows[c], (n, k), t) for c in range(self.count)]
            for w in self.items:
                layout.prepare(w)


def measure(copies: Copies, m: int, dtype: torch.dtype, path: str = "auto", config=None) -> dict:
    """Time ``qmatmul`` (or torch f16 if the copies are dense) over the copies."""
    first = copies.items[0]
    dense = isinstance(first, torch.Tensor)
    n, k = (first.shape[0], first.shape[1])
    x = torch.randn(m, k, device="cuda").to(dtype)
    if dense:
        calls = [lambda w=w: x @ w.t() for w in copies.items]
    elif config is not None:
        run = {"gemv": kernels.gemv, "gemm": kernels.gemm}[path]
        y = torch.empty(m, n, device="cuda", dtype=dtype)
        calls = [lambda w=w: run(x, layout.prepare(w), y, config) for w in copies.items]
    else:
        calls = [lambda w=w: matmul.qmatmul(x, w, path=path) for w in copies.items]
        if path == "auto":
            path = matmul.choose_path(m, first, x.device, dtype)
    graph, eager = timed(calls)
    nbytes = copies.bytes_one + x.numel() * x.element_size() + m * n * x.element_size()
    return {
        "n": n, "k": k, "m": m, "dtype": str(dtype)[6:], "path": "torch" if dense else path,
        "config": config, "copies": copies.count, "bytes": nbytes,
        "graph_us": graph, "eager_us": eager,
        "GBps": nbytes / graph / 1e3, "TFLOPs": 2 * m * n * k / graph / 1e6,
    }  # fmt: skip


class Recorder:
    def __init__(self, out: Path | None, bw: float):
        self.rows: list[dict] = []
        self.bw = bw
        self.file = open(out / "bench.jsonl", "w") if out else None  # noqa: SIM115

    def add(self, section: str, fmt: str, fn) -> dict | None:
        try:
            row = {"section": section, "format": fmt, **fn()}
            row["floor_us"] = row["bytes"] / self.bw * 1e6
        except Exception as e:  # keep measuring; the error is in the log
            row = {"section": section, "format": fmt, "error": repr(e)[:300]}
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        if self.file:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sections", default="main,gemv,cross")
    args = ap.parse_args(argv)
    sections = args.sections.split(",")
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth()
    import triton

    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
    print(f"# copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rec = Recorder(args.out, bw)
    rec.rows.append({"section": "copy", "TBps": bw / 1e12})

    if "main" in sections:  # the brief's table: SmolLM2 shapes, Q4_1 / Q8_0, m = 1 and 203
        for n, k in [*SMOLLM2, BIG]:
            fmts = ["Q4_1", "Q8_0"] + (["Q4_0", "Q4_K"] if (n, k) == BIG else [])
            for fmt in [*fmts, "F16"]:
                c = Copies(n, k, fmt)
                for m in (1, 203):
                    for dt in ["f16"] if fmt == "F16" else ["f32", "f16"]:
                        rec.add("main", fmt, lambda c=c, m=m, dt=dt: measure(c, m, DT[dt]))
                    if m > 1 and fmt != "F16":  # the fused GEMM that auto does not pick for f16
                        rec.add("main", fmt, lambda c=c, m=m: measure(c, m, DT["f16"], "gemm"))
                del c
    if "gemv" in sections:  # GEMV tile sweep, m = 1, f32 x
        cfgs = [(16, 8, 4), (8, 8, 4), (8, 16, 4), (16, 16, 4), (4, 32, 4), (8, 32, 4),
                (16, 8, 8), (32, 8, 4)]  # fmt: skip
        for (n, k), fmt in [((49152, 576), "Q4_1"), ((49152, 576), "Q8_0"), (BIG, "Q8_0"),
                            (BIG, "Q4_K"), ((1536, 576), "Q4_1")]:  # fmt: skip
            c = Copies(n, k, fmt)
            for cfg in cfgs:
                rec.add("gemv", fmt, lambda c=c, cfg=cfg: measure(c, 1, torch.float32, "gemv", cfg))
    if "gemm" in sections:  # GEMM tile sweep, m = 203
        cfgs = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                (32, 64, 4, 3), (64, 64, 4, 5), (64, 128, 8, 4)]  # fmt: skip
        for (n, k), fmt in [((49152, 576), "Q4_1"), (BIG, "Q8_0"), (BIG, "Q4_K")]:
            c = Copies(n, k, fmt)
            for dt in ("f16", "f32"):
                for cfg in cfgs:
                    rec.add(
                        "gemm",
                        fmt,
                        lambda c=c, cfg=cfg, dt=dt: measure(c, 203, DT[dt], "gemm", cfg),
                    )
    if "cross" in sections:  # where the paths cross over, 8192 x 4096
        for fmt in ("Q8_0", "Q4_K", "F16"):
            c = Copies(*BIG, fmt)
            for m in (2, 4, 8, 16, 64, 203, 1024):
                if fmt == "F16":
                    rec.add("cross", fmt, lambda c=c, m=m: measure(c, m, torch.float16))
                    continue
                for dt in ("f16", "f32"):
                    paths = (["gemv"] if m <= 8 else []) + ["gemm"]
                    if m >= 8 and (dt == "f16" or m >= 203):
                        paths.append("dequant")
                    for p in paths:
                        rec.add("cross", fmt, lambda c=c, m=m, dt=dt, p=p: measure(c, m, DT[dt], p))
            del c
    print(f"# done in {time.time() - t0:.0f} s", file=sys.stderr)
    print(table(rec.rows))
    if args.out:
        (args.out / "bench.md").write_text(table(rec.rows))


def table(rows: list[dict]) -> str:
    """The main section as a markdown table (graph and eager microseconds per call)."""
    head = ("| shape (n x k) | weight | m | x | path | graph us | eager us | GB/s | floor us "
            "| TFLOP/s |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        if r.get("section") != "main" or "error" in r:
            continue
        lines.append(
            f"| {r['n']}x{r['k']} | {r['format']} | {r['m']} | {r['dtype']} | {r['path']} "
            f"| {r['graph_us']:.1f} | {r['eager_us']:.1f} | {r['GBps']:.0f} "
            f"| {r['floor_us']:.1f} | {r['TFLOPs']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
