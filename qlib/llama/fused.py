"""Which projections the fast engines stack into one matrix (they read the same input), and
their biases where a file has them."""

from __future__ import annotations

from collections.abc import Callable, Container

import torch

# The fast engines (fast_cpu, fast_cuda) stack a layer's projections that read the
# same input into one matrix: attribute -> the GGUF tensors (blk.N.<name>.weight), by rows.
FUSED_STACKS: dict[str, tuple[str, ...]] = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w13": ("ffn_gate", "ffn_up"),
    "w2": ("ffn_down",),
}


def stacked_bias(names: Container[str], read: Callable[[str], torch.Tensor], p: str, attr: str,
                 rows: list[int]) -> torch.Tensor | None:  # fmt: skip
    """The bias of layer ``p``'s stacked projection ``attr`` (llama.cpp's optional
    ``blk.N.<name>.bias`` of a llama file: ``names`` holds the file's tensors, ``read`` gives
    one as float32), its projections' in row order (``rows`` each), zeros where one has none;
    None where none has one."""
    biases = [f"{p}.{n}.bias" for n in FUSED_STACKS[attr]]
    if not any(b in names for b in biases):
        return None
    parts = [read(b).float().reshape(-1) if b in names else torch.zeros(n)
             for b, n in zip(biases, rows, strict=True)]  # fmt: skip
    return torch.cat([t.to(parts[0].device) for t in parts])
