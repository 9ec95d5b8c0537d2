"""Which projections the fast engines stack into one matrix (they read the same input), and
their biases where a file has them."""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable

import torch

# The fast engines (fast_cpu, fast_cuda) stack a layer's projections that read the
# same input into one matrix: attribute -> the GGUF tensors (blk.N.<name>.weight), by rows.
FUSED_STACKS: dict[str, tuple[str, ...]] = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w13": ("ffn_gate", "ffn_up"),
    "w2": ("ffn_down",),
}


Read = Callable[[str], torch.Tensor]  # a tensor of the file by name, as float32 values


def layer_biases(names: Container[str], read: Read, rows: Callable[[str], int], p: str,
                 attrs: Iterable[str]) -> dict[str, torch.Tensor]:  # fmt: skip
    """The biases of layer ``p``'s stacked projections ``attrs`` (llama.cpp's optional
    ``blk.N.<name>.bias`` of a llama file; ``names`` holds the file's tensors, ``read`` gives
    one as float32, ``rows`` a weight's row count), each over its projections in row order,
    zeros where one has none; only the projections where one has a bias."""
    out = {}
    for attr in attrs:
        biases = [f"{p}.{n}.bias" for n in FUSED_STACKS[attr]]
        if not any(b in names for b in biases):
            continue
        parts = [read(b).float().reshape(-1) if b in names else None for b in biases]
        device = next(t for t in parts if t is not None).device
        out[attr] = torch.cat([
            t if t is not None else torch.zeros(rows(f"{p}.{n}.weight"), device=device)
            for t, n in zip(parts, FUSED_STACKS[attr], strict=True)
        ])  # fmt: skip
    return out


class Biased:
    """A layer with ``biases`` (``layer_biases``: by stacked projection) that adds them."""

    biases: dict[str, torch.Tensor]

    def add_bias(self, attr: str, y: torch.Tensor) -> torch.Tensor:
        """``y += `` the bias of projection ``attr`` where the file has one (rows ``y``)."""
        b = self.biases.get(attr)
        return y if b is None else y.add_(b)
