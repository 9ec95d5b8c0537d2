"""Input checks shared by the fast engines."""

from __future__ import annotations

import torch

from .errors import IndexPosError, ModelError, ShapeError


def check_input(x: torch.Tensor, index_pos: int, kv_len: int, max_seq_len: int) -> int:
    """The fast paths' contract for ``forward``: one ``(1, t)`` sequence, ``index_pos`` equal to
    the cache length or 0 (start over), ``index_pos + t <= max_seq_len``. Returns ``t``."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ShapeError(f"the fast path takes one sequence (1, seq_len), got {list(x.shape)}")
    if index_pos != 0 and index_pos != kv_len:
        raise IndexPosError(
            f"index_pos {index_pos} disagrees with the KV cache, which holds "
            f"{kv_len} positions: pass index_pos={kv_len} or 0"
        )
    t = x.shape[1]
    if index_pos + t > max_seq_len:
        raise ModelError(f"{index_pos + t} positions exceed max_seq_len {max_seq_len}")
    return t
