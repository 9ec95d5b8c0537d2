"""Tensor names (transformers <-> llama.cpp) and the q/k row permutation.

transformers' Llama rotates the pairs (i, i + d/2) of each head (``rotate_half``);
llama.cpp's llama architecture rotates adjacent pairs (2i, 2i + 1). Its
``convert_hf_to_gguf.py`` therefore reorders the output rows of ``q_proj`` and
``k_proj`` within each head so that both conventions compute the same thing;
transformers' GGUF loader undoes it (``_reverse_permute_weights``). The rows
move whole, so quantization blocks (cut along a row) are unaffected.
"""

from __future__ import annotations

import re

import torch

# transformers name -> llama.cpp name, outside the blocks
GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# inside block i: "model.layers.{i}.<key>" -> "blk.{i}.<value>"
LAYER_NAMES: dict[str, str] = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias",
    "mlp.down_proj.bias": "ffn_down.bias",
}
# transformers buffers that some checkpoints carry and GGUF does not need
IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

_GGUF_GLOBAL = {v: k for k, v in GLOBAL_NAMES.items()}
_GGUF_LAYER = {v: k for k, v in LAYER_NAMES.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_name(hf: str) -> str | None:
    """llama.cpp name of a transformers tensor (``None``: not a llama tensor)."""
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m and m.group(2) in LAYER_NAMES:
        return f"blk.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    return None


def hf_name(gguf: str) -> str | None:
    """transformers name of a llama.cpp tensor (``None``: not a llama tensor)."""
    if gguf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf]
    m = _GGUF_BLOCK.fullmatch(gguf)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
    return None


def layer_index(gguf: str) -> int | None:
    """Block index of ``blk.{i}.*`` names, else ``None``."""
    m = _GGUF_BLOCK.fullmatch(gguf)
    return int(m.group(1)) if m else None


def permuted_heads(gguf: str, n_head: int, n_kv_head: int) -> int | None:
    """Heads to permute a tensor by: ``n_head`` for attn_q, ``n_kv_head`` for attn_k, else None."""
    if gguf.endswith((".attn_q.weight", ".attn_q.bias")):
        return n_head
    if gguf.endswith((".attn_k.weight", ".attn_k.bias")):
        return n_kv_head
    return None


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """transformers -> llama.cpp row order (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``).

    Within each head, rows (0..d/2-1 | d/2..d-1) become interleaved (0, d/2, 1, d/2+1, ...).
    """
    rows = w.shape[0]
    _check_rows(rows, n_head)
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp -> transformers row order (transformers' ``_reverse_permute_weights``)."""
    rows = w.shape[0]
    _check_rows(rows, n_head)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_rows(rows: int, n_head: int) -> None:
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot permute {rows} rows over {n_head} heads: need 2 * heads | rows")
