"""Notebook 2: where the time of one forward goes (seed: "one forward of quantized llama").

* ``profile_spans``: count, total and self time per span name for a prefill and
  for one decode step, after a warm-up; ``expected_counts`` gives the counts
  the model's structure implies, ``check_counts`` compares them.
* ``AttentionReplay``: one attention layer replayed op by op on random tensors
  of the model's shapes, following ``LayerWeights.forward_attn`` literally
  (cat KV, repeat_kv, q @ k^T, scale, mask, softmax, att @ v), or with a
  preallocated cache (the engine's ``kv_cache="static"``) and/or PyTorch's
  SDPA with GQA for contrast.
* ``forward_times`` / ``enqueue_vs_sync``: wall time of one forward (per
  thread count; on a GPU at return against after ``synchronize``).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...devices import synchronize
from ...generate import generate, greedy_id
from ...llama.config import MAX_SEQ_LEN, LlamaConfig
from ...llama.faithful import ModelWeights, broadcast_as, repeat_kv, sdpa_folded
from ...spans import SpanRecorder
from .common import restore_kv, snapshot_kv

SPAN_NAMES = ("model", "output", "attn", "attn-rot", "attn-mlp", "qmatmul", "rms-norm")


def expected_counts(config: LlamaConfig) -> dict[str, int]:
    """Span counts of one forward implied by the structure (any seq_len).

    Per block: 7 projections (q, k, v, o, gate, up, down), 2 RmsNorms, RoPE on
    q and k, one attention and one MLP span; plus the final norm, the output
    projection and the model span.
    """
    n = config.block_count
    return {
        "model": 1,
        "output": 1,
        "attn": n,
        "attn-mlp": n,
        "attn-rot": 2 * n,
        "rms-norm": 2 * n + 1,
        "qmatmul": 7 * n + 1,
    }


def check_counts(rows: list[dict], expected: dict[str, int]) -> list[dict]:
    """One row per span name: observed count, expected count, whether they agree."""
    observed = {r["name"]: r["count"] for r in rows}
    names = list(expected) + [n for n in observed if n not in expected]
    return [
        {
            "name": n,
            "observed": observed.get(n, 0),
            "expected": expected.get(n, 0),
            "ok": observed.get(n, 0) == expected.get(n, 0),
        }
        for n in names
    ]


@dataclass
class SpanProfile:
    """Spans of one recorded forward."""

    pass_name: str
    seq_len: int
    index_pos: int
    wall_ms: float  # forward until its logits are done (synchronized)
    rows: list[dict]  # name, count, total_ms, self_ms

    def table(self) -> list[dict]:
        return [
            {"pass": self.pass_name, "seq_len": self.seq_len, "index_pos": self.index_pos, **r}
            for r in self.rows
        ]


def _recorded(
    model: ModelWeights, ids: list[int], index_pos: int, name: str, sync_spans: bool
) -> tuple[SpanProfile, int]:
    x = torch.tensor([ids], device=model.device)
    sync = (lambda: synchronize(model.device)) if sync_spans else None
    with torch.inference_mode(), SpanRecorder(sync=sync) as rec:
        start = time.perf_counter()
        logits = model.forward(x, index_pos)
        synchronize(model.device)
        wall = (time.perf_counter() - start) * 1e3
    return SpanProfile(name, len(ids), index_pos, wall, rec.table()), greedy_id(logits)


def profile_spans(
    model: ModelWeights,
    prompt_ids: list[int],
    decode_step: int = 20,
    *,
    warmup: int = 2,
    sync_spans: bool = False,
) -> tuple[SpanProfile, SpanProfile]:
    """Spans of the prefill and of decode step ``decode_step`` (1-based), greedy.

    ``warmup`` full generations run first. Decode step k runs at index_pos
    ``len(prompt_ids) + k - 1`` (step 20 after a 13-token prompt: 32).
    ``sync_spans=True`` synchronizes the device at every span exit, so on a
    GPU spans measure execution instead of enqueueing.
    """
    if decode_step < 1:
        raise ValueError(f"decode_step must be >= 1, got {decode_step}")
    for _ in range(warmup):
        model.clear_kv_cache()
        generate(model, prompt_ids, decode_step + 1)
    model.clear_kv_cache()
    prefill, token = _recorded(model, prompt_ids, 0, "prefill", sync_spans)
    pos = len(prompt_ids)
    with torch.inference_mode():
        for _ in range(decode_step - 1):
            token = greedy_id(model.forward(torch.tensor([[token]], device=model.device), pos))
            pos += 1
    decode, _ = _recorded(model, [token], pos, f"decode step {decode_step}", sync_spans)
    return prefill, decode


# -- one attention layer, op by op ---------------------------------------------------

ATTENTION_CORES = ("naive", "sdpa", "fold")


class AttentionReplay:
    """One layer's attention core for ``seq_len`` new positions after ``context`` cached ones.

    ``cache="cat"`` grows the cache as ``forward_attn`` does (``torch.cat``, a
    copy of the whole cache every step); ``"prealloc"`` writes the new keys and
    values into buffers of ``max_len`` positions allocated once (default: the
    engine's ``MAX_SEQ_LEN``) and attends to a view of their first positions,
    as ``kv_cache="static"`` does.
    ``attention="naive"`` is forward_attn's path (repeat_kv copies, two
    matmuls, scale, mask via ``where``, softmax); ``"sdpa"`` is
    ``F.scaled_dot_product_attention`` with ``enable_gqa`` (no copies);
    ``"fold"`` is ``faithful.sdpa_folded`` (plain SDPA over the query heads
    folded onto their KV head, no copies either).
    The causal mask is applied only when ``seq_len > 1``, as in the forward;
    ``mask_op=True`` also times the ``where`` on a decode step, marked
    ``in_forward=False``. Inputs are random (the cost does not depend on values).
    """

    def __init__(
        self,
        n_head: int,
        n_kv_head: int,
        head_dim: int,
        context: int,
        *,
        seq_len: int = 1,
        cache: str = "cat",
        attention: str = "naive",
        device: str | torch.device = "cpu",
        mask_op: bool = True,
        max_len: int | None = None,
        seed: int = 0,
    ):
        if cache not in ("cat", "prealloc") or attention not in ATTENTION_CORES:
            raise ValueError(f"cache {cache!r} / attention {attention!r}")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, head_dim
        self.context, self.seq_len = context, seq_len
        self.cache, self.attention = cache, attention
        self.device = torch.device(device)
        self.mask_op = mask_op
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(self.device)

        t, kv_len = seq_len, context + seq_len
        self.q = rand(1, n_head, t, head_dim)
        self.k_new = rand(1, n_kv_head, t, head_dim)
        self.v_new = rand(1, n_kv_head, t, head_dim)
        self.k_cache = rand(1, n_kv_head, context, head_dim)
        self.v_cache = rand(1, n_kv_head, context, head_dim)
        if cache == "prealloc":
            max_len = max(max_len or MAX_SEQ_LEN, kv_len)
            self.k_buf = torch.zeros(1, n_kv_head, max_len, head_dim, device=self.device)
            self.v_buf = torch.zeros_like(self.k_buf)
            self.k_buf[:, :, :context] = self.k_cache
            self.v_buf[:, :, :context] = self.v_cache
        rows = torch.arange(t).reshape(-1, 1) + context
        self.mask = (torch.arange(kv_len).reshape(1, -1) > rows).to(torch.uint8).to(self.device)

    @classmethod
    def for_model(cls, config: LlamaConfig, context: int, **kwargs) -> AttentionReplay:
        """A replay with the attention shapes of ``config`` (SmolLM2: 9 / 3 heads of 64)."""
        return cls(config.head_count, config.head_count_kv, config.head_dim, context, **kwargs)

    def ops(self) -> list[tuple[str, Callable[[], None], bool]]:
        """(name, step, in_forward) in execution order; steps share intermediate state."""
        s: dict[str, torch.Tensor] = {}
        ctx, t = self.context, self.seq_len
        n_rep = self.n_head // self.n_kv_head
        scale = 1.0 / math.sqrt(self.head_dim)
        ops: list[tuple[str, Callable[[], None], bool]] = []

        def add(name: str, in_forward: bool = True):
            def register(fn: Callable[[], None]) -> Callable[[], None]:
                ops.append((name, fn, in_forward))
                return fn

            return register

        if self.cache == "cat":

            @add("cat k")
            def cat_k():
                s["k"] = torch.cat((self.k_cache, self.k_new), dim=2)

            @add("cat v")
            def cat_v():
                s["v"] = torch.cat((self.v_cache, self.v_new), dim=2)

        else:

            @add("write k")
            def write_k():
                self.k_buf[:, :, ctx : ctx + t] = self.k_new

            @add("write v")
            def write_v():
                self.v_buf[:, :, ctx : ctx + t] = self.v_new

            @add("narrow k, v")
            def narrow_kv():
                s["k"], s["v"] = self.k_buf[:, :, : ctx + t], self.v_buf[:, :, : ctx + t]

        if self.attention == "naive":

            @add("repeat_kv k")
            def repeat_k():
                s["k"] = repeat_kv(s["k"], n_rep)

            @add("repeat_kv v")
            def repeat_v():
                s["v"] = repeat_kv(s["v"], n_rep)

            @add("q @ k^T")
            def qk():
                s["att"] = self.q @ s["k"].transpose(-2, -1)

            @add("scale")
            def scale_att():
                s["att"] = s["att"] * scale

            if t > 1 or self.mask_op:

                @add("mask (where)", in_forward=t > 1)
                def mask_where():
                    mask = broadcast_as(self.mask, s["att"].shape)
                    masked = torch.where(mask.bool(), float("-inf"), s["att"])
                    if t > 1:
                        s["att"] = masked

            @add("softmax")
            def softmax():
                s["att"] = torch.softmax(s["att"], dim=-1)

            @add("att @ v")
            def att_v():
                s["y"] = s["att"] @ s["v"].contiguous()

        elif self.attention == "sdpa":

            @add("sdpa (gqa)")
            def sdpa():
                attn_mask = (self.mask == 0) if t > 1 else None
                s["y"] = F.scaled_dot_product_attention(
                    self.q, s["k"], s["v"], attn_mask=attn_mask, scale=scale, enable_gqa=True
                )

        else:

            @add("sdpa (folded gqa)")
            def sdpa_fold():
                s["y"] = sdpa_folded(self.q, s["k"], s["v"], self.mask if t > 1 else None, scale)

        @add("transpose, reshape")
        def merge_heads():
            s["out"] = s["y"].transpose(1, 2).reshape(1, t, self.n_head * self.head_dim)

        self._state = s
        return ops

    def output(self) -> torch.Tensor:
        """Run the ops once; the attention output (1, seq_len, n_head * head_dim)."""
        for _, fn, _ in self.ops():
            fn()
        return self._state["out"]

    def run(self, reps: int = 300, warmup: int = 10) -> list[dict]:
        """Time every op over ``reps`` passes (after ``warmup``): one row per op, in µs.

        On a GPU each op is followed by a synchronize, so its time is its execution.
        """
        ops = self.ops()
        sync = self.device.type != "cpu"
        samples: list[list[int]] = [[] for _ in ops]
        with torch.inference_mode():
            for rep in range(warmup + reps):
                for i, (_, fn, _) in enumerate(ops):
                    start = time.perf_counter_ns()
                    fn()
                    if sync:
                        synchronize(self.device)
                    if rep >= warmup:
                        samples[i].append(time.perf_counter_ns() - start)
        return [
            {
                "context": self.context,
                "seq_len": self.seq_len,
                "cache": self.cache,
                "attention": self.attention,
                "op": name,
                "in_forward": in_forward,
                "mean_us": statistics.fmean(ns) / 1e3,
                "median_us": statistics.median(ns) / 1e3,
                "min_us": min(ns) / 1e3,
            }
            for (name, _, in_forward), ns in zip(ops, samples, strict=True)
        ]


def replay_totals(rows: list[dict], stat: str = "mean_us") -> list[dict]:
    """Sum of ``stat`` over the ops that run in the forward, per (context, cache, attention)."""
    keys = ("threads", "device", "context", "seq_len", "cache", "attention")
    totals: dict[tuple, dict] = {}
    for r in rows:
        if not r["in_forward"]:
            continue
        key = tuple(r.get(k) for k in keys)
        entry = totals.setdefault(key, {k: r.get(k) for k in keys if k in r} | {"total_us": 0.0})
        entry["total_us"] += r[stat]
    return list(totals.values())


# -- whole forwards -------------------------------------------------------------------


def prepare_decode(model: ModelWeights, prompt_ids: list[int], context: int) -> tuple[list, int]:
    """Fill the cache to ``context`` positions (prompt, then greedy tokens).

    Returns the cache snapshot and the token to feed at index_pos ``context``;
    the cache is left filled.
    """
    if context < len(prompt_ids):
        raise ValueError(f"context {context} is shorter than the {len(prompt_ids)}-token prompt")
    model.clear_kv_cache()
    with torch.inference_mode():
        token = greedy_id(model.forward(torch.tensor([prompt_ids], device=model.device), 0))
        for pos in range(len(prompt_ids), context):
            token = greedy_id(model.forward(torch.tensor([[token]], device=model.device), pos))
    return snapshot_kv(model), token


def forward_times(
    model: ModelWeights,
    prompt_ids: list[int],
    context: int = 32,
    reps: int = 5,
    prepared: tuple[list, int] | None = None,
) -> dict:
    """Best and median wall ms of the prefill and of a decode step at ``context``.

    Each rep ends with the argmax read back; one untimed rep goes first. The
    decode step restarts from the same cache snapshot every rep (``prepared``,
    from ``prepare_decode``, or made here).
    """
    dev = model.device
    x = torch.tensor([prompt_ids], device=dev)
    prefill, decode = [], []
    snap, token = prepared or prepare_decode(model, prompt_ids, context)
    with torch.inference_mode():
        for rep in range(reps + 1):
            model.clear_kv_cache()
            start = time.perf_counter()
            greedy_id(model.forward(x, 0))
            p = (time.perf_counter() - start) * 1e3
            restore_kv(model, snap)
            start = time.perf_counter()
            greedy_id(model.forward(torch.tensor([[token]], device=dev), context))
            d = (time.perf_counter() - start) * 1e3
            if rep:  # the first rep warms up
                prefill.append(p)
                decode.append(d)
    return {
        "prefill_tokens": len(prompt_ids),
        "prefill_min_ms": min(prefill),
        "prefill_median_ms": statistics.median(prefill),
        "decode_context": context,
        "decode_min_ms": min(decode),
        "decode_median_ms": statistics.median(decode),
    }


def with_threads(n: int, fn: Callable[[], object]) -> object:
    """Run ``fn`` with ``torch.set_num_threads(n)``, then restore the thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def thread_counts(available: int | None = None) -> list[int]:
    """1, 2, then doubling up to the cores available (at least [1, 2])."""
    import os

    n = available or os.cpu_count() or 1
    counts, c = [1, 2], 4
    while c <= n:
        counts.append(c)
        c *= 2
    if n > 2 and n not in counts:
        counts.append(n)
    return counts


def enqueue_vs_sync(
    model: ModelWeights, prompt_ids: list[int], context: int = 32, reps: int = 20
) -> list[dict]:
    """Per pass (prefill, decode at ``context``): ms when ``forward`` returns and after sync.

    On a CPU both are the same; on a GPU ``forward`` returns once the kernels
    are queued. Medians over ``reps`` (after one warm-up).
    """
    dev = model.device
    snap, token = prepare_decode(model, prompt_ids, context)
    out = []
    for name, ids, pos in (("prefill", prompt_ids, 0), (f"decode at {context}", [token], context)):
        x = torch.tensor([ids], device=dev)
        returned, synced = [], []
        with torch.inference_mode():
            for rep in range(reps + 1):
                if pos:
                    restore_kv(model, snap)
                synchronize(dev)
                start = time.perf_counter()
                model.forward(x, pos)
                r = (time.perf_counter() - start) * 1e3
                synchronize(dev)
                s = (time.perf_counter() - start) * 1e3
                if rep:
                    returned.append(r)
                    synced.append(s)
        out.append(
            {
                "device": str(dev),
                "pass": name,
                "seq_len": len(ids),
                "at_return_ms": statistics.median(returned),
                "after_sync_ms": statistics.median(synced),
                "enqueue_share": statistics.median(returned) / statistics.median(synced),
            }
        )
    return out
