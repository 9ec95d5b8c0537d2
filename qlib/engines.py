"""One entry point for every engine: the faithful ``ModelWeights`` or the fast path of a device.

``form`` picks: ``quantized``, ``f32``, ``f16`` (or None: candle's rule) build
``qlib.quantized_llama.ModelWeights``; ``fast`` builds ``qlib.fast.FastModel`` on
CPU and ``qlib.fast_cuda.CudaFastModel`` on CUDA. All have ``forward(x, index_pos,
all_logits=)``, ``clear_kv_cache()``, ``kv_len`` and ``device``.
"""

from __future__ import annotations

from typing import Any, BinaryIO

from .devices import DeviceLike, as_device
from .qtensor import FORMS
from .quantized_llama import ModelError, ModelWeights

FAST = "fast"
ENGINE_FORMS: tuple[str, ...] = (*FORMS, FAST)


def from_gguf(
    content, f: BinaryIO, device: DeviceLike = "cpu", form: str | None = None, **kwargs: Any
):
    """Build a model from a parsed ``gguf_file.Content`` and its open file.

    ``kwargs`` go to the engine's ``from_gguf`` (``attention=`` for ModelWeights,
    ``prefill=`` for the fast paths, ...).
    """
    if form != FAST:
        return ModelWeights.from_gguf(content, f, device, form=form, **kwargs)
    dev = as_device(device)
    if dev.type == "cuda":
        from .fast_cuda import CudaFastModel

        return CudaFastModel.from_gguf(content, f, dev, **kwargs)
    if dev.type == "cpu":
        from .fast import FastModel

        return FastModel.from_gguf(content, f, dev, **kwargs)
    raise ModelError(f"no fast path on {dev.type}: use form quantized, f32 or f16 there")


def load(path, device: DeviceLike = "cpu", form: str | None = None, **kwargs: Any):
    """Read a GGUF file and build the model: returns ``(model, content)``."""
    from .gguf_file import Content

    with open(path, "rb") as f:
        content = Content.read(f)
        model = from_gguf(content, f, device, form, **kwargs)
    return model, content
