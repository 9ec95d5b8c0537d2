"""Which projections the fast engines stack into one matrix (they read the same input)."""

from __future__ import annotations

# The fast engines (fast_cpu, fast_cuda) stack a layer's projections that read the
# same input into one matrix: attribute -> the GGUF tensors (blk.N.<name>.weight), by rows.
FUSED_STACKS: dict[str, tuple[str, ...]] = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w13": ("ffn_gate", "ffn_up"),
    "w2": ("ffn_down",),
}
