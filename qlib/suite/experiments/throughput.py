"""Notebook 3: prefill and decode throughput against context length (seed: speed, "throughput").

* ``prefill_throughput``: tokens/s for a prompt of T tokens at index_pos 0,
  timed until the argmax is back on the host.
* ``decode_comparison``: fill the KV cache with a context, then N greedy
  decode steps; ms per token, for the engine's cat KV cache (naive or SDPA
  attention) and for its preallocated one (``prealloc``: the faithful
  engine's ``kv_cache="static"``, buffers of ``max_len`` positions written in
  place, attended to through a view, with SDPA-GQA, folded SDPA or naive
  attention).
* ``decode_variant``: a context manager that switches a built model to one
  (cache, attention) variant (``ModelWeights.set_kv_cache``, ``attention``)
  and back.
* ``attention_core_by_context``: the one-layer op replay of notebook 2 across
  contexts, scaled to the model's block count.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ... import models
from ...generate import greedy_id
from ...llama.config import MAX_SEQ_LEN
from ...llama.faithful import ModelWeights
from ...tokenizer import Tokenizer
from .common import restore_kv, snapshot_kv
from .span_study import ATTENTION_CORES, AttentionReplay, replay_totals

PREFILL_SIZES = (1, 4, 16, 64, 128, 256, 512)
DECODE_CONTEXTS = (16, 64, 256, 512, 1024)
# (cache, attention) for the decode comparison; the first is the engine on a CPU
DECODE_VARIANTS = (("cat", "naive"), ("cat", "sdpa"), ("prealloc", "sdpa"), ("prealloc", "fold"))


def passage_ids(tokenizer: Tokenizer, n: int, file: str | Path | None = None) -> list[int]:
    """The first ``n`` tokens of the shipped passage (no special tokens), cycled if short."""
    text = Path(file or models.data_file("passage.txt")).read_text()
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError("the passage encodes to no tokens")
    return (ids * (n // len(ids) + 1))[:n]


def prefill_throughput(
    model: ModelWeights, ids: list[int], sizes=PREFILL_SIZES, reps: int = 3
) -> list[dict]:
    """One row per prompt length T: first (warm-up) ms, min and median ms, tok/s at the min."""
    rows = []
    with torch.inference_mode():
        for t in sizes:
            if t > len(ids):
                raise ValueError(f"prompt of {t} tokens asked, only {len(ids)} ids given")
            x = torch.tensor([ids[:t]], device=model.device)
            times = []
            for _ in range(reps + 1):
                model.clear_kv_cache()
                start = time.perf_counter()
                greedy_id(model.forward(x, 0))
                times.append((time.perf_counter() - start) * 1e3)
            best = min(times[1:])
            rows.append(
                {
                    "T": t,
                    "first_ms": times[0],
                    "min_ms": best,
                    "median_ms": statistics.median(times[1:]),
                    "tok_s": t / best * 1e3,
                }
            )
    model.clear_kv_cache()
    return rows


CACHES = {"cat": "cat", "prealloc": "static"}  # the experiment's cache name -> kv_cache


@contextlib.contextmanager
def decode_variant(
    model: ModelWeights, cache: str, attention: str, max_len: int = MAX_SEQ_LEN
) -> Iterator[ModelWeights]:
    """The model with a (cache, attention) variant; yields it, then puts its own back.

    ``cat`` is the engine's own cache with its ``attention`` option ("naive",
    or "sdpa", which the engine allows for single-token steps only);
    ``prealloc`` is the engine's ``kv_cache="static"`` with ``max_len``
    positions per layer and ``attention`` "sdpa" (GQA in the kernel), "fold"
    (``sdpa_folded``: query heads folded onto their KV head, plain SDPA) or
    "naive" (repeat_kv). The cache is empty before and after; fill it with
    ``common.restore_kv``.
    """
    if cache not in CACHES:
        raise ValueError(f"cache must be 'cat' or 'prealloc', got {cache!r}")
    if cache == "prealloc" and attention not in ATTENTION_CORES:
        raise ValueError(f"attention must be one of {ATTENTION_CORES}, got {attention!r}")
    before = model.attention, model.kv_cache_mode, model.max_seq_len
    model.set_kv_cache(CACHES[cache], max_len if cache == "prealloc" else None)
    model.attention = attention
    try:
        yield model
    finally:
        model.attention = before[0]
        model.set_kv_cache(before[1], before[2])


def prefill_snapshot(model: ModelWeights, ids: list[int]) -> tuple[list, float]:
    """Prefill ``ids`` at 0 with the engine; (per-layer K/V snapshot, ms until the argmax)."""
    model.clear_kv_cache()
    with torch.inference_mode():
        start = time.perf_counter()
        greedy_id(model.forward(torch.tensor([ids], device=model.device), 0))
        ms = (time.perf_counter() - start) * 1e3
    snap = snapshot_kv(model)
    model.clear_kv_cache()
    return snap, ms


def _decode_steps(model: ModelWeights, token: int, pos: int, steps: int) -> float:
    """``steps`` greedy decode steps from ``pos``, the first one fed ``token``; total ms."""
    dev = model.device
    start = time.perf_counter()
    for _ in range(steps):
        token = greedy_id(model.forward(torch.tensor([[token]], device=dev), pos))
        pos += 1
    return (time.perf_counter() - start) * 1e3


def decode_comparison(
    model: ModelWeights,
    ids: list[int],
    contexts=DECODE_CONTEXTS,
    steps: int | dict[int, int] = 16,
    reps: int = 2,
    variants=DECODE_VARIANTS,
    snapshot: list | None = None,
) -> list[dict]:
    """One row per (variant, context): decode ms per token, mean over the steps.

    The context is prefilled once, at the longest one (``ids[:max(contexts)]``,
    or a given ``snapshot``); a context of c positions is the first c positions
    of that cache, exactly what a prefill of ``ids[:c]`` leaves (causal
    attention). Each of ``reps + 1`` runs (the first is a warm-up, reported as
    ``first_ms_per_token``) loads that cache and decodes ``steps`` tokens from
    index_pos c, fed ``ids[c]`` and then greedily. ``steps`` may map
    context -> steps. Min and median over the reps.
    """
    longest = max(contexts)
    if len(ids) <= longest:
        raise ValueError(f"context {longest} needs {longest + 1} ids, {len(ids)} given")
    if snapshot is None:
        snapshot, _ = prefill_snapshot(model, ids[:longest])
    n_steps = {c: steps[c] if isinstance(steps, dict) else steps for c in contexts}
    max_len = max(c + n_steps[c] for c in contexts)
    rows = []
    for cache, attention in variants:
        with torch.inference_mode(), decode_variant(model, cache, attention, max_len):
            for ctx in contexts:
                n = n_steps[ctx]
                per_token = []
                for _ in range(reps + 1):
                    restore_kv(model, snapshot, ctx)
                    per_token.append(_decode_steps(model, ids[ctx], ctx, n) / n)
                best = min(per_token[1:])
                rows.append(
                    {
                        "cache": cache,
                        "attention": attention,
                        "variant": f"{cache} + {attention}",
                        "context": ctx,
                        "steps": n,
                        "first_ms_per_token": per_token[0],
                        "ms_per_token": best,
                        "median_ms_per_token": statistics.median(per_token[1:]),
                        "tok_s": 1e3 / best,
                    }
                )
    return rows


def attention_core_by_context(
    model: ModelWeights,
    contexts=DECODE_CONTEXTS,
    variants=(("cat", "naive"), ("prealloc", "sdpa"), ("prealloc", "fold")),
    reps: int = 200,
) -> list[dict]:
    """One decode step's attention core per layer (op replay), and times the block count.

    Rows: context, cache, attention, total µs per layer, ms per token for all
    layers, and the µs spent copying (cat + repeat_kv / writes).
    """
    cfg = model.config
    rows = []
    for ctx in contexts:
        for cache, attention in variants:
            replay = AttentionReplay.for_model(
                cfg, ctx, cache=cache, attention=attention, device=model.device, mask_op=False
            )
            ops = replay.run(reps=reps)
            (total,) = replay_totals(ops, "median_us")
            copy = sum(
                r["median_us"]
                for r in ops
                if r["op"].startswith(("cat", "repeat_kv", "write", "narrow"))
            )
            rows.append(
                {
                    "context": ctx,
                    "cache": cache,
                    "attention": attention,
                    "layer_us": total["total_us"],
                    "copy_us": copy,
                    "all_layers_ms": total["total_us"] * cfg.block_count / 1e3,
                }
            )
    return rows


# -- the fast engines and llama.cpp at long context ------------------------------------------

LONG_CONTEXTS = (256, 1024, 2048)


def long_context_configs(device: str, kv_types: tuple[str, ...], llama_cpp: bool) -> list[tuple]:
    """(label, bench argv) per runtime of the long-context curve: qlib's fast engine with each
    KV type, each with its default prefill and with its fastest one (CUDA: bf16 matmuls and
    attention; CPU: int8 attention products, ``int8-attn``), and llama.cpp (CPU, its default
    f16 cache) when installed."""
    configs = [(f"qlib fast {device}, {kv} KV", ["--runtime", "qlib", "--engine", "fast",
                                                  "--device", device, "--kv-type", kv])
               for kv in kv_types]  # fmt: skip
    fastest = "bf16" if device == "cuda" else "int8-attn"
    configs += [(f"{label}, {fastest} prefill", [*argv, "--prefill", fastest])
                for label, argv in list(configs)]  # fmt: skip
    if llama_cpp:
        configs.append(("llama.cpp cpu, f16 KV", ["--runtime", "llama.cpp", "--device", "cpu"]))
    return configs


# A long-context point whose read passes before and after differ by more than this factor ran
# while the memory changed speed, so its floor is not of its own minute: it is measured again
# (LONG_CONTEXT_ATTEMPTS in all at most; the last attempt is kept either way)
MEMORY_STEADY = 1.25
LONG_CONTEXT_ATTEMPTS = 3


def long_context_curve(model: str, contexts: tuple[int, ...] | list[int], *, steps: int,
                       reps: int, threads: int | None, configs: list[tuple],
                       device: str = "cpu", progress: bool = True) -> list[dict]:  # fmt: skip
    """The benchmark protocol at each context (``qlib bench --context N``: the passage's tokens
    repeated to N, prefilled, then ``steps`` greedy steps from position N), one process per
    point and runtime, with the bytes a step must read there (weights + KV cache) and the
    memory's rate beside it (``read_gbs``: the higher of the ``copy_bandwidth`` passes on
    ``device`` just before and just after the point, so that each point's floor is of its own
    minute: this VM's memory moves by up to 2x from minute to minute). A point whose two passes
    differ by more than ``MEMORY_STEADY`` is measured again, up to ``LONG_CONTEXT_ATTEMPTS``
    times (``attempts``; the last is kept): once, a decode measured in a slow stretch between
    two fast passes read 2.4x its "floor". A context whose steps would pass the file's
    ``llama.context_length`` runs at that length less the steps (the row's ``context``;
    ``requested`` keeps the asked one)."""
    from tqdm.auto import tqdm

    from ...gguf import read_content
    from ...llama.checks import context_length
    from ..bench import run_in_subprocess
    from .common import bytes_per_step, copy_bandwidth

    content = read_content(model)
    limit = context_length(content.metadata) - steps

    def rate() -> float:  # GB/s; ~0.5 s on the CPU
        return copy_bandwidth(device, mib=256, reps=3, threads=threads) / 1e9

    rows = []
    points = [(c, label, argv) for c in contexts for label, argv in configs]
    before = rate()
    for requested, label, argv in tqdm(points, desc="context points", disable=not progress):
        context = min(requested, limit)
        common = ["--model", str(model), "--context", str(context), "--steps", str(steps),
                  "--reps", str(reps), "--no-floor"]  # fmt: skip
        common += ["--threads", str(threads)] if threads else []
        attempts = 0
        while True:
            attempts += 1
            r = run_in_subprocess(common + argv)
            after = rate()
            passes, before = (before, after), after  # one pass serves the next point too
            steady = max(passes) <= MEMORY_STEADY * min(passes)
            if steady or attempts == LONG_CONTEXT_ATTEMPTS:
                break
        kv_type = argv[argv.index("--kv-type") + 1] if "--kv-type" in argv else "f16"  # llama.cpp
        kv = 2 if kv_type == "f16" else 4
        row = {"runtime": label, "context": context, "requested": requested,
               **bytes_per_step(content, context, kv), "read_gbs": max(passes),
               "attempts": attempts}  # fmt: skip
        if "error" in r:
            row["error"] = r["error"]
        else:
            row.update(prefill_ms=r["prefill_ms"]["min"], decode_ms=r["decode_ms_per_token"]["min"],
                       decode_ms_median=r["decode_ms_per_token"]["median"],
                       peak_rss_mb=r["peak_rss_mb"], error="")  # fmt: skip
        rows.append(row)
    return rows
