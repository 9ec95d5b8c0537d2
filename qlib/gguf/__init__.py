"""GGUF files, as candle's ``quantized::gguf_file``: ``Content.read`` parses the header,
metadata and tensor directory; ``Content.tensor`` loads one tensor as a ``QTensor``;
``write`` produces a file that llama.cpp and gguf-py read; ``open_model`` opens a model
file, split over shards or not (``split``). Limits and value types: ``constants``."""

from .constants import GGUFError, GGUFValueType, TensorNotFoundError, Typed
from .reader import Content, MappedFile, TensorInfo
from .split import ShardFiles, SplitContent, open_model, read_content, release_pages, shards
from .writer import write, write_path

__all__ = [
    "Content", "GGUFError", "GGUFValueType", "MappedFile", "ShardFiles", "SplitContent",
    "TensorInfo", "TensorNotFoundError", "Typed", "open_model", "read_content", "release_pages",
    "shards", "write", "write_path",
]  # fmt: skip
