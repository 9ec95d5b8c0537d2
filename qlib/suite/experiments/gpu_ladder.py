"""Notebook 11: one decode step on CUDA, from per-op launches to one graph, rung by rung.

Each rung is the same greedy decode (the benchmark prompt, then ``steps`` steps, the next
token read back to the host every step) on a different way of driving the GPU:

* ``per-op``: the faithful engine (candle's forward, one torch op after the other);
* ``fused, one by one``: the fast CUDA engine's fused Triton kernels launched from Python
  every step (``graphs=False``);
* ``fused, CUDA graph``: the same kernels captured once and replayed (one launch a token);
* ``fused, CUDA graph + PDL``: the same graph with programmatic dependent launch (Hopper+:
  each kernel's blocks are resident and wait on the device while the previous one finishes);
  where the device or Triton lacks it the rung says so;
* ``merged, CUDA graph + PDL``: five kernels a layer instead of six (the attention's combine
  in the output projection's kernel, the heads' shares summed with float atomics:
  ``decode="merged"``), in the same PDL graph;
* ``persistent``: one resident kernel walking the layers, its blocks waiting only on counters
  of the work they read, no grid-wide barrier (``qlib.quants.cuda.persistent``), in a CUDA
  graph too; where it cannot run (a type it has no code for, no NVRTC) the rung reports why
  instead of a time;
* ``... + argmax on device``: the PDL graph and the persistent kernel again, each greedy step
  taken as ``qlib.generate`` takes it (``CudaFastModel.greedy_step``): the argmax inside the
  step's graph, only the id read back, and kept on the device as the next input, where the
  rungs above run ``forward``, copy the token in, clone the logits and run the argmax apart.

Per rung: kernels executed per token and the host's launches per token (torch profiler over
a few steps), host time per step (the ``forward`` call returning: the enqueueing; none for
the argmax-on-device rungs, whose call returns with the id), GPU busy
time per step (the kernels' summed durations), ms/token (wall, min over reps) and the share of
the bandwidth floor (the weight + KV bytes a step reads / this GPU's measured copy bandwidth).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .common import bytes_per_step, copy_bandwidth


@dataclass(frozen=True)
class Rung:
    name: str
    engine: str  # faithful | fast
    options: tuple[tuple[str, Any], ...] = ()  # for ``load``
    argmax_on_device: bool = False  # greedy steps through ``greedy_step``


LADDER = (
    Rung("per-op", "faithful"),
    Rung("fused, one by one", "fast", (("decode", "fused"), ("graphs", False))),
    Rung("fused, CUDA graph", "fast", (("decode", "fused"), ("graphs", True), ("pdl", False))),
    Rung("fused, CUDA graph + PDL", "fast", (("decode", "fused"), ("graphs", True), ("pdl", True))),
    Rung(
        "merged, CUDA graph + PDL", "fast", (("decode", "merged"), ("graphs", True), ("pdl", True))
    ),  # fmt: skip
    Rung("persistent", "fast", (("decode", "persistent"), ("graphs", True))),
    Rung(
        "fused, CUDA graph + PDL + argmax on device",
        "fast",
        (("decode", "fused"), ("graphs", True), ("pdl", True)),
        argmax_on_device=True,
    ),
    Rung(
        "persistent + argmax on device",
        "fast",
        (("decode", "persistent"), ("graphs", True)),
        argmax_on_device=True,
    ),
)


def _stepper(model, on_device: bool):
    """``step(token, pos) -> next token``: ``forward`` and the argmax of its logits read back,
    or ``greedy_step`` (the argmax in the step's graph) when ``on_device``."""
    if on_device:
        return model.greedy_step

    def step(token: int, pos: int) -> int:
        logits = model.forward(torch.tensor([[token]], device=model.device), pos)
        return int(logits.argmax(-1).item())  # the step's one read-back

    return step


def _greedy(model, prompt: torch.Tensor, steps: int,
            on_device: bool = False) -> tuple[float, float | None, list[int]]:  # fmt: skip
    """One greedy run after a fresh prefill: (wall ms/token, host ms per forward call, ids);
    the host time is None when ``on_device`` (``greedy_step`` returns with the id)."""
    model.clear_kv_cache()
    logits = model.forward(prompt, 0)
    token = int(logits.argmax(-1).item())
    pos = prompt.shape[1]
    ids, host = [], 0.0
    if on_device:
        start = time.perf_counter()
        for _ in range(steps):
            token = model.greedy_step(token, pos)
            ids.append(token)
            pos += 1
        return (time.perf_counter() - start) / steps * 1e3, None, ids
    start = time.perf_counter()
    for _ in range(steps):
        x = torch.tensor([[token]], device=model.device)
        t0 = time.perf_counter()
        logits = model.forward(x, pos)
        host += time.perf_counter() - t0
        token = int(logits.argmax(-1).item())  # the step's one read-back
        ids.append(token)
        pos += 1
    wall = time.perf_counter() - start
    return wall / steps * 1e3, host / steps * 1e3, ids


def _profile(model, prompt: torch.Tensor, steps: int, on_device: bool = False) -> dict[str, float]:
    """Kernels executed per step, host launches per step and GPU busy ms per step."""
    from torch.profiler import ProfilerActivity, profile

    model.clear_kv_cache()
    logits = model.forward(prompt, 0)
    token, pos = int(logits.argmax(-1).item()), prompt.shape[1]
    step = _stepper(model, on_device)
    torch.cuda.synchronize(model.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(token, pos)
            pos += 1
        torch.cuda.synchronize(model.device)
    kernels, busy_us, launches = 0, 0.0, 0
    for e in prof.events():
        kind = str(getattr(e, "device_type", "")).lower()
        if "cuda" in kind and e.name not in ("", "[memory]"):
            kernels += 1
            busy_us += e.device_time if hasattr(e, "device_time") else e.cuda_time
        elif "Launch" in e.name:  # cudaLaunchKernel, cuLaunchKernel(Ex), cudaGraphLaunch
            launches += 1
    return {
        "kernels_per_token": kernels / steps,
        "launches_per_token": launches / steps,
        "gpu_busy_ms": busy_us / steps / 1e3,
    }


def run_rung(rung: Rung, path: str, prompt_ids: list[int], *, steps: int, reps: int,
             profile_steps: int = 16, device: str = "cuda") -> dict[str, Any]:  # fmt: skip
    """Load the engine of ``rung``, time ``reps`` greedy runs and profile a few steps."""
    from ...llama.engine import load
    from ...llama.errors import ModelError
    from ...quants.cuda import fused

    if dict(rung.options).get("pdl") and not fused.pdl_available():
        raise ModelError("no programmatic dependent launch here (it needs a GPU of compute "
                         "capability 9.0+ and Triton >= 3.4)")  # fmt: skip
    model, content = load(path, device, engine=rung.engine, **dict(rung.options))
    prompt = torch.tensor([prompt_ids], device=model.device)
    with torch.inference_mode():
        on_device = rung.argmax_on_device
        _greedy(model, prompt, min(steps, 8), on_device)  # warm-up: compiles, captures graphs
        runs = [_greedy(model, prompt, steps, on_device) for _ in range(reps)]
        prof = _profile(model, prompt, profile_steps, on_device)
    best = min(runs, key=lambda r: r[0])
    row: dict[str, Any] = {
        "rung": rung.name, "engine": rung.engine, "ms_per_token": best[0],
        "ms_per_token_median": sorted(r[0] for r in runs)[len(runs) // 2],
        "host_ms_per_step": None if on_device else min(r[1] for r in runs), **prof,
        "ids": best[2],
    }  # fmt: skip
    row.update(bytes_per_step(content, len(prompt_ids) + steps // 2))
    del model
    torch.cuda.empty_cache()
    return row


def ladder(path: str, prompt_ids: list[int], *, steps: int, reps: int,
           device: str = "cuda") -> list[dict[str, Any]]:  # fmt: skip
    """Every rung's row; a rung that cannot run here has ``missing`` (why) instead of times."""
    from ...llama.errors import ModelError

    bandwidth = copy_bandwidth(torch.device(device))
    rows = []
    for rung in LADDER:
        try:
            row = run_rung(rung, path, prompt_ids, steps=steps, reps=reps, device=device)
        except ModelError as e:  # e.g. the persistent kernel has no code for a type
            rows.append({"rung": rung.name, "engine": rung.engine, "missing": str(e)})
            continue
        row["bandwidth_gb_s"] = bandwidth / 1e9
        floor_ms = (row["weight_bytes"] + row["kv_bytes"]) / bandwidth * 1e3
        row["floor_ms"] = floor_ms
        row["floor_pct"] = 100 * floor_ms / row["ms_per_token"]
        rows.append(row)
    return rows
