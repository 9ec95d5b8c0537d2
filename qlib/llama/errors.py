"""The llama engines' error types: a file that cannot be built into a model, a bad call."""

from __future__ import annotations

from ..gguf import GGUFError


class ModelError(ValueError):
    """A GGUF file that cannot be built into a llama model, or a bad forward call."""


class ModelFileError(ModelError, GGUFError):
    """The file cannot be built into a llama model: missing or ill-typed metadata,
    a missing tensor, or a shape or type that does not fit the configuration.

    Also a ``GGUFError``: one ``except GGUFError`` covers every bad file.
    """


class ShapeError(ModelError):
    """A shape mismatch inside the forward pass, worded like candle's errors."""


class IndexPosError(ModelError):
    """``strict=True``: index_pos disagrees with the KV cache, or passes the RoPE table."""


class InputError(ModelError):
    """The input is not a 1 x T integer tensor of token ids in the vocabulary (the faithful
    engine checks with ``strict=True``, the fast engines always)."""
