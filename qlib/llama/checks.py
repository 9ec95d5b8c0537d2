"""What the fast engines share: the forward-input contract, the static KV cache state, its
default length (the file's ``llama.context_length``) and its element types."""

from __future__ import annotations

import torch

from .config import MAX_SEQ_LEN
from .errors import IndexPosError, InputError, ModelError, ShapeError


def context_length(metadata: dict) -> int:
    """The positions a fast engine holds by default: the file's ``llama.context_length`` (a
    positive integer), else ``MAX_SEQ_LEN`` (candle's RoPE table, the faithful engine's)."""
    n = metadata.get("llama.context_length")
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    return MAX_SEQ_LEN


KV_TYPES = {"f32": torch.float32, "f16": torch.float16}  # the KV cache's element type
DEFAULT_KV_TYPE = "f32"


def check_kv_type(kv_type: str | None) -> str:
    """``kv_type`` of a fast engine: a key of ``KV_TYPES`` (None: ``DEFAULT_KV_TYPE``)."""
    kv_type = kv_type or DEFAULT_KV_TYPE
    if kv_type not in KV_TYPES:
        raise ModelError(f"unknown kv_type {kv_type!r}: {', '.join(KV_TYPES)}")
    return kv_type


def check_max_seq_len(n) -> int:
    """``max_seq_len`` of a fast engine: a positive int."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelError(f"max_seq_len must be a positive int, got {n!r}")
    return n


def check_token_ids(lo: int, hi: int, vocab: int) -> None:
    """Token ids from ``lo`` to ``hi`` are in a vocabulary of ``vocab``, or ``InputError``."""
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")


def check_positions(index_pos: int, t: int, kv_len: int, max_seq_len: int) -> None:
    """``t`` tokens from ``index_pos``: equal to the cache length or 0 (start over), and
    ``index_pos + t <= max_seq_len``."""
    if index_pos != 0 and index_pos != kv_len:
        raise IndexPosError(
            f"index_pos {index_pos} disagrees with the KV cache, which holds "
            f"{kv_len} positions: pass index_pos={kv_len} or 0"
        )
    if index_pos + t > max_seq_len:
        raise ModelError(f"{index_pos + t} positions exceed max_seq_len {max_seq_len}")


def check_input(
    x: torch.Tensor, index_pos: int, kv_len: int, max_seq_len: int, vocab: int | None = None
) -> int:
    """The fast paths' contract for ``forward``: one ``(1, t)`` sequence of integer token ids,
    ``index_pos`` equal to the cache length or 0 (start over), ``index_pos + t <=
    max_seq_len``; with ``vocab``, ids inside it (checked where that costs no device round
    trip: ids on the CPU, or a prompt of several tokens). Returns ``t``."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ShapeError(f"the fast path takes one sequence (1, seq_len), got {list(x.shape)}")
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise InputError(f"token ids must be integers, got a {x.dtype} tensor")
    t = x.shape[1]
    check_positions(index_pos, t, kv_len, max_seq_len)
    if vocab is not None and t and (x.device.type == "cpu" or t > 1):
        if t == 1:  # (a decode step's token: 0.3 us where aminmax takes 5)
            lo = hi = x.item()
        else:
            lo, hi = (int(v) for v in torch.aminmax(x))
        check_token_ids(lo, hi, vocab)
    return t


class StaticKVState:
    """A KV cache preallocated for ``max_seq_len`` positions, the first ``kv_len`` filled."""

    max_seq_len: int
    vocab_size: int | None = None  # token ids must be below it (set by the engine)
    _kv_len: int = 0

    @property
    def kv_len(self) -> int:
        return self._kv_len

    def clear_kv_cache(self) -> None:
        self._kv_len = 0

    def check_input(self, x: torch.Tensor, index_pos: int) -> int:
        """``check_input`` against this cache; returns the sequence length."""
        return check_input(x, index_pos, self._kv_len, self.max_seq_len, self.vocab_size)
