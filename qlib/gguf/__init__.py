"""GGUF files, as candle's ``quantized::gguf_file``: ``Content.read`` parses the header,
metadata and tensor directory; ``Content.tensor`` loads one tensor as a ``QTensor``;
``write`` produces a file that llama.cpp and gguf-py read. Limits and value types:
``constants``."""

from .constants import GGUFError, GGUFValueType, TensorNotFoundError, Typed
from .reader import Content, TensorInfo
from .writer import write, write_path

__all__ = [
    "Content", "GGUFError", "GGUFValueType", "TensorInfo", "TensorNotFoundError", "Typed",
    "write", "write_path",
]  # fmt: skip
