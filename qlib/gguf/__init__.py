"""GGUF files, as candle's ``quantized::gguf_file``: ``Content.read`` parses the header,
metadata and tensor directory; ``Content.tensor`` loads one tensor as a ``QTensor``;
``write`` produces a file that llama.cpp and gguf-py read. Limits and value types:
``constants``."""

from .constants import GGUFError, GGUFValueType, TensorNotFoundError, Typed
from .reader import Content, MappedFile, TensorInfo, release_pages
from .writer import write, write_path

__all__ = [
    "Content", "GGUFError", "GGUFValueType", "MappedFile", "TensorInfo", "TensorNotFoundError",
    "Typed", "release_pages", "write", "write_path",
]  # fmt: skip
