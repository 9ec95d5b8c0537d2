"""Llama GGUF files of a given shape with seeded random weights, for benchmarks and tests.

No machine here reaches a model hub, so the larger shapes people download (a
Llama-3.2-1B-shaped file, a head_dim-128 file) are made locally: random normal
weights (seeded), quantized by qlib's own quantizer with the same type rules as
``quantize`` (``recipes.plan``), the tokenizer and chat template copied from a
source GGUF (the embedded SmolLM2 by default, so the vocabulary has 49,152 tokens).

The weights are scaled so that a forward pass neither collapses nor explodes and the
logits have spread: projections with std ``1 / sqrt(fan_in)`` (unit-variance outputs),
the attention and MLP output projections further by ``1 / sqrt(2 * n_layer)`` (the
residual stream grows slowly), the embedding and output matrices with std ``1/8``: the
logits ``h @ W.T`` of a normalized ``h`` then have a spread of ``sqrt(n_embd) / 8``
(5.7 for 2048), so greedy argmax is not decided by rounding.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..gguf import Content, Typed
from ..gguf.constants import GGUFValueType
from . import recipes
from .to_gguf import _atomic_write, quantize_tensor


@dataclass(frozen=True)
class Shape:
    n_embd: int
    n_layer: int
    n_head: int
    n_kv_head: int
    n_ff: int
    rope_freq_base: float = 500000.0
    tie_output: bool = True
    n_expert: int = 0  # > 1: a Mixtral-style mixture of experts (n_ff: each expert's units)
    n_expert_used: int = 0


SHAPES: dict[str, Shape] = {
    "1b": Shape(n_embd=2048, n_layer=16, n_head=32, n_kv_head=8, n_ff=8192),  # Llama-3.2-1B
    "hd128": Shape(n_embd=1024, n_layer=8, n_head=8, n_kv_head=2, n_ff=2816, tie_output=False),
    "mha": Shape(n_embd=768, n_layer=8, n_head=12, n_kv_head=12, n_ff=2048, tie_output=False),
    "tiny": Shape(n_embd=256, n_layer=2, n_head=4, n_kv_head=2, n_ff=512),  # tests
    # a small Mixtral-style model: 8 experts a layer, 2 a token, llama.cpp's stacked tensors
    "moe": Shape(
        n_embd=1024, n_layer=8, n_head=16, n_kv_head=4, n_ff=1408, n_expert=8, n_expert_used=2
    ),
    "tiny-moe": Shape(
        n_embd=256, n_layer=2, n_head=4, n_kv_head=2, n_ff=256, n_expert=4, n_expert_used=2
    ),  # tests
}


def synthesize(
    out: str | Path,
    source: str | Path,
    shape: str = "1b",
    spec: str = "Q8_0",
    *,
    seed: int = 0,
    log=None,
) -> Path:
    """Write a ``shape`` llama GGUF of type or recipe ``spec`` to ``out``; returns ``out``.

    ``source`` gives the tokenizer (every ``tokenizer.*`` key). Tensors are made and
    quantized one at a time, so memory holds the quantized file plus one float tensor.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: {', '.join(SHAPES)}")
    spec = recipes.normalize_spec(spec)
    s = SHAPES[shape]
    t0 = time.perf_counter()
    src = Content.read_path(source)
    tok_md = {k: v for k, v in src.metadata.items() if k.startswith("tokenizer.")}
    vocab = len(src.metadata["tokenizer.ggml.tokens"])
    head_dim = s.n_embd // s.n_head
    kv = s.n_kv_head * head_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, s.n_embd)}
    for i in range(s.n_layer):
        p = f"blk.{i}"
        shapes |= {
            f"{p}.attn_norm.weight": (s.n_embd,),
            f"{p}.attn_q.weight": (s.n_embd, s.n_embd),
            f"{p}.attn_k.weight": (kv, s.n_embd),
            f"{p}.attn_v.weight": (kv, s.n_embd),
            f"{p}.attn_output.weight": (s.n_embd, s.n_embd),
            f"{p}.ffn_norm.weight": (s.n_embd,),
        }
        if s.n_expert > 1:  # the router and the experts, stacked as llama.cpp writes them
            e = s.n_expert
            shapes |= {
                f"{p}.ffn_gate_inp.weight": (e, s.n_embd),
                f"{p}.ffn_gate_exps.weight": (e, s.n_ff, s.n_embd),
                f"{p}.ffn_up_exps.weight": (e, s.n_ff, s.n_embd),
                f"{p}.ffn_down_exps.weight": (e, s.n_embd, s.n_ff),
            }
        else:
            shapes |= {
                f"{p}.ffn_gate.weight": (s.n_ff, s.n_embd),
                f"{p}.ffn_up.weight": (s.n_ff, s.n_embd),
                f"{p}.ffn_down.weight": (s.n_embd, s.n_ff),
            }
    shapes["output_norm.weight"] = (s.n_embd,)
    if not s.tie_output:
        shapes["output.weight"] = (vocab, s.n_embd)
    choices = recipes.plan(shapes, spec, s.n_layer)
    rng = np.random.default_rng(seed)
    residual_scale = 1.0 / math.sqrt(2 * s.n_layer)
    tensors: dict[str, Any] = {}
    for k, c in enumerate(choices):
        dims = shapes[c.name]
        if len(dims) == 1:
            w = np.ones(dims, dtype=np.float32)
        else:
            std = 1.0 / math.sqrt(dims[-1])
            if c.name in ("token_embd.weight", "output.weight"):
                std = 1.0 / 8
            elif c.name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight")):
                std *= residual_scale
            elif c.name.endswith("ffn_gate_inp.weight"):
                std *= 4  # the router's logits with spread: the experts' choice not a near tie
            w = rng.standard_normal(dims, dtype=np.float32) * np.float32(std)
        tensors[c.name] = quantize_tensor(w, c.type)
        if log and (k % 20 == 0 or k == len(choices) - 1):
            log(
                f"{shape} {spec}: {k + 1}/{len(choices)} tensors ({time.perf_counter() - t0:.0f} s)"
            )
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    md: dict[str, Any] = {
        "general.architecture": "llama",
        "general.name": f"qlab synthetic {shape} (seed {seed})",
        "general.file_type": Typed(u32, recipes.file_type(spec)),
        "general.quantization_version": Typed(u32, 2),
        "llama.block_count": Typed(u32, s.n_layer),
        "llama.context_length": Typed(u32, 8192),
        "llama.embedding_length": Typed(u32, s.n_embd),
        "llama.feed_forward_length": Typed(u32, s.n_ff),
        "llama.attention.head_count": Typed(u32, s.n_head),
        "llama.attention.head_count_kv": Typed(u32, s.n_kv_head),
        "llama.rope.freq_base": Typed(f32, s.rope_freq_base),
        "llama.rope.dimension_count": Typed(u32, head_dim),
        "llama.attention.layer_norm_rms_epsilon": Typed(f32, 1e-5),
        "llama.vocab_size": Typed(u32, vocab),
        **tok_md,
    }
    if s.n_expert > 1:
        md["llama.expert_count"] = Typed(u32, s.n_expert)
        md["llama.expert_used_count"] = Typed(u32, s.n_expert_used)
    types = {k: v for k, v in src.metadata_types.items() if k in tok_md}
    out = Path(out)
    _atomic_write(out, md, tensors, types)
    if log:
        log(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.0f} s")
    return out
