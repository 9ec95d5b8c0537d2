"""Loading helpers shared by the experiments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..gguf_file import Content
from ..quantized_llama import ModelWeights
from ..tokenizer import Tokenizer


def read_content(path: str | Path) -> Content:
    with open(path, "rb") as f:
        return Content.read(f)


def build(
    path: str | Path,
    device: str = "cpu",
    metadata_overrides: dict[str, Any] | None = None,
    drop_keys: tuple[str, ...] = (),
    **kwargs,
) -> tuple[ModelWeights, Tokenizer]:
    """Model and tokenizer from ``path``, with metadata edited in memory first.

    ``metadata_overrides`` / ``drop_keys`` change what ``from_gguf`` sees
    (e.g. relabel ``general.architecture``) without touching the file.
    """
    with open(path, "rb") as f:
        content = Content.read(f)
        content.metadata.update(metadata_overrides or {})
        for key in drop_keys:
            content.metadata.pop(key, None)
        model = ModelWeights.from_gguf(content, f, device, **kwargs)
    return model, Tokenizer.from_metadata(content.metadata)


def greedy_ids(model: ModelWeights, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy generation with the correct index_pos (fresh cache)."""
    from ..generate import generate

    model.clear_kv_cache()
    return generate(model, prompt_ids, steps)


def next_token(model: ModelWeights, ids: list[int], index_pos: int) -> int:
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids], device=model.device), index_pos)
    return int(logits[0].argmax())
