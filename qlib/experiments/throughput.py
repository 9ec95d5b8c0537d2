"""Notebook 3: prefill and decode throughput against context length (seed: speed, "throughput").

* ``prefill_throughput``: tokens/s for a prompt of T tokens at index_pos 0,
  timed until the argmax is back on the host.
* ``decode_comparison``: fill the KV cache with a context, then N greedy
  decode steps; ms per token, for the engine's cat KV cache (naive or SDPA
  attention) and for a preallocated cache.
* ``preallocated_kv``: a context manager that gives a built model a static
  KV cache (buffers of ``max_len`` positions written in place, attended to
  through a view), without touching the engine: it replaces each layer's
  ``forward_attn`` on the instance while active.
* ``attention_core_by_context``: the one-layer op replay of notebook 2 across
  contexts, scaled to the model's block count.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
import types
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import models
from ..quantized_llama import (
    MAX_SEQ_LEN,
    LayerWeights,
    ModelError,
    ModelWeights,
    broadcast_as,
    repeat_kv,
)
from ..spans import span
from ..tokenizer import Tokenizer
from .span_study import (
    ATTENTION_CORES,
    AttentionReplay,
    replay_totals,
    restore_kv,
    sdpa_folded,
    snapshot_kv,
)

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


def _argmax(logits: torch.Tensor) -> int:
    return int(logits[0].argmax())  # reads back to the host: a GPU has finished


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
                _argmax(model.forward(x, 0))
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


# -- a preallocated KV cache, outside the engine ------------------------------------


def _static_forward_attn(
    layer: LayerWeights,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    index_pos: int,
    use_sdpa: bool,
    *,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    attention: str,
) -> torch.Tensor:
    """``LayerWeights.forward_attn`` with the cat replaced by writes into ``k_buf``/``v_buf``."""
    with span("attn"):
        b, seq_len, n_embd = x.shape
        q = layer.attention_wq.forward(x)
        k = layer.attention_wk.forward(x)
        v = layer.attention_wv.forward(x)
        q = q.reshape(b, seq_len, layer.n_head, layer.head_dim).transpose(1, 2)
        k = k.reshape(b, seq_len, layer.n_kv_head, layer.head_dim).transpose(1, 2)
        v = v.reshape(b, seq_len, layer.n_kv_head, layer.head_dim).transpose(1, 2)
        q = layer.apply_rotary_emb(q, index_pos)
        k = layer.apply_rotary_emb(k, index_pos)

        end = index_pos + seq_len
        if end > k_buf.shape[2]:
            raise ModelError(f"preallocated KV cache holds {k_buf.shape[2]} positions, {end} asked")
        k_buf[:, :, index_pos:end] = k
        v_buf[:, :, index_pos:end] = v
        k, v = k_buf[:, :, :end], v_buf[:, :, :end]
        layer.kv_cache = (k, v)  # views, so ModelWeights.kv_len still answers

        scale = 1.0 / math.sqrt(layer.head_dim)
        if attention == "sdpa":
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask == 0, scale=scale, enable_gqa=True
            )
        elif attention == "fold":
            y = sdpa_folded(q, k, v, mask, scale)
        else:
            n_rep = layer.n_head // layer.n_kv_head
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            att = (q @ k.transpose(-2, -1)) * scale
            if mask is not None:
                att = torch.where(broadcast_as(mask, att.shape).bool(), float("-inf"), att)
            y = torch.softmax(att, dim=-1) @ v.contiguous()
        y = y.transpose(1, 2).reshape(b, seq_len, n_embd)
        return layer.attention_wo.forward(y)


class CatKV:
    """The engine's own cache (``torch.cat`` every step), loaded from a snapshot."""

    def __init__(self, model: ModelWeights):
        self.model = model

    def load(self, snapshot: list, length: int) -> None:
        """Cache = the first ``length`` positions of ``snapshot`` (as a prefill would leave)."""
        restore_kv(
            self.model,
            [(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in snapshot],
        )


class StaticKV:
    """Per-layer K and V buffers of ``max_len`` positions (see ``preallocated_kv``)."""

    def __init__(self, model: ModelWeights, max_len: int):
        self.model = model
        self.buffers = []
        for layer in model.layers:
            shape = (1, layer.n_kv_head, max_len, layer.head_dim)
            self.buffers.append(
                (torch.zeros(shape, device=model.device), torch.zeros(shape, device=model.device))
            )

    def load(self, snapshot: list, length: int) -> None:
        """Write the first ``length`` positions of ``snapshot`` into the buffers."""
        for layer, (kb, vb), (k, v) in zip(self.model.layers, self.buffers, snapshot, strict=True):
            kb[:, :, :length] = k[:, :, :length]
            vb[:, :, :length] = v[:, :, :length]
            layer.kv_cache = (kb[:, :, :length], vb[:, :, :length])


@contextlib.contextmanager
def preallocated_kv(
    model: ModelWeights, max_len: int = MAX_SEQ_LEN, attention: str = "sdpa"
) -> Iterator[StaticKV]:
    """While active, ``model`` keeps K and V in buffers of ``max_len`` positions per layer.

    The new positions are written in place (no cat, no copy of the cache) and
    attention reads a view of the first ``index_pos + seq_len`` positions,
    with ``attention="sdpa"`` (GQA in the kernel), ``"fold"`` (``sdpa_folded``:
    query heads folded onto their KV head, plain SDPA) or ``"naive"`` (the
    engine's repeat_kv path). Yields the ``StaticKV``; afterwards the model is
    as before, with an empty cache.
    """
    if attention not in ATTENTION_CORES:
        raise ValueError(f"attention must be one of {ATTENTION_CORES}, got {attention!r}")
    model.clear_kv_cache()
    cache = StaticKV(model, max_len)
    for layer, (k_buf, v_buf) in zip(model.layers, cache.buffers, strict=True):

        def forward_attn(self, x, mask, index_pos, use_sdpa, _k=k_buf, _v=v_buf):
            return _static_forward_attn(
                self, x, mask, index_pos, use_sdpa, k_buf=_k, v_buf=_v, attention=attention
            )

        layer.forward_attn = types.MethodType(forward_attn, layer)
    try:
        yield cache
    finally:
        for layer in model.layers:
            layer.__dict__.pop("forward_attn", None)
        model.clear_kv_cache()


@contextlib.contextmanager
def decode_variant(
    model: ModelWeights, cache: str, attention: str, max_len: int = MAX_SEQ_LEN
) -> Iterator[CatKV | StaticKV]:
    """The model with a (cache, attention) variant; yields its cache (``load``-able).

    ``cat`` is the engine's own cache with its ``attention`` option ("naive",
    or "sdpa", which the engine allows for single-token steps only);
    ``prealloc`` is ``preallocated_kv``.
    """
    if cache == "prealloc":
        with preallocated_kv(model, max_len, attention) as kv:
            yield kv
        return
    if cache != "cat":
        raise ValueError(f"cache must be 'cat' or 'prealloc', got {cache!r}")
    before = model.attention
    model.attention = attention
    try:
        yield CatKV(model)
    finally:
        model.attention = before
        model.clear_kv_cache()


def prefill_snapshot(model: ModelWeights, ids: list[int]) -> tuple[list, float]:
    """Prefill ``ids`` at 0 with the engine; (per-layer K/V snapshot, ms until the argmax)."""
    model.clear_kv_cache()
    with torch.inference_mode():
        start = time.perf_counter()
        _argmax(model.forward(torch.tensor([ids], device=model.device), 0))
        ms = (time.perf_counter() - start) * 1e3
    snap = snapshot_kv(model)
    model.clear_kv_cache()
    return snap, ms


def _decode_steps(model: ModelWeights, token: int, pos: int, steps: int) -> float:
    """``steps`` greedy decode steps from ``pos``, the first one fed ``token``; total ms."""
    dev = model.device
    start = time.perf_counter()
    for _ in range(steps):
        token = _argmax(model.forward(torch.tensor([[token]], device=dev), pos))
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
        with torch.inference_mode(), decode_variant(model, cache, attention, max_len) as kv:
            for ctx in contexts:
                n = n_steps[ctx]
                per_token = []
                for _ in range(reps + 1):
                    kv.load(snapshot, ctx)
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
