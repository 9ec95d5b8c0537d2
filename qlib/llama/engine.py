"""One interface for the three llama engines, and the one loader every caller uses.

``engine`` picks the implementation, ``form`` how its projections multiply:

* ``engine="faithful"``: ``faithful.ModelWeights``, candle 0.11.0's ``quantized_llama`` as it
  is, on any device; ``form`` is ``quantized``, ``f32`` or ``f16`` (None: candle's rule).
* ``engine="fast"``: ``fast_cpu.FastModel`` on CPU, ``fast_cuda.CudaFastModel`` on CUDA; the
  weights stay quantized, so ``form`` is ``quantized`` (or None).

``form="fast"`` (with no engine) is the older spelling of ``engine="fast"`` and still works.
Every engine satisfies ``Engine``, checked in ``tests/test_engines.py``.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any, BinaryIO, Protocol, runtime_checkable

import torch

from ..devices import DeviceLike, as_device, synchronize
from ..gguf import Content, open_model
from ..quants.qtensor import FORMS
from .config import LlamaConfig
from .errors import ModelError

ENGINES: tuple[str, ...] = ("faithful", "fast")
FAST = "fast"  # the engine name, and the old form alias for it


@runtime_checkable
class Engine(Protocol):
    """What every llama engine offers its callers."""

    config: LlamaConfig
    device: torch.device

    def forward(self, x: torch.Tensor, index_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """Logits ``(1, vocab)`` of the last position (``(1, T, vocab)`` with ``all_logits``)
        for token ids ``x`` ``(1, T)`` at positions ``index_pos .. index_pos + T - 1``."""
        ...

    def clear_kv_cache(self) -> None:
        """Forget every cached position."""
        ...

    @property
    def kv_len(self) -> int:
        """Positions held in the KV cache."""
        ...


@runtime_checkable
class GreedyOnDevice(Protocol):
    """An engine that also decodes greedily without handing out the logits (the fast CUDA
    engine: they stay on the device; the fast CPU engine: no tensor made per token):
    ``generate`` and ``bench`` use it for greedy decoding."""

    def greedy_step(self, token: int, index_pos: int) -> int:
        """``forward`` of ``token`` at ``index_pos``; returns the argmax of its logits."""
        ...


def resolve(engine: str | None, form: str | None) -> tuple[str, str | None]:
    """``(engine, form)`` from what a caller gave, the ``form="fast"`` alias included."""
    if form == FAST:
        if engine not in (None, FAST):
            raise ModelError(f"form 'fast' is the fast engine; it cannot go with engine {engine!r}")
        engine, form = FAST, None
    engine = engine or "faithful"
    if engine not in ENGINES:
        raise ModelError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if form is not None and form not in FORMS:
        raise ModelError(f"unknown form {form!r}; choose one of {', '.join(FORMS)}")
    if engine == FAST and form not in (None, "quantized"):
        raise ModelError(
            f"the fast engine keeps the weights quantized (form quantized), not {form}: "
            "use engine faithful for the f32 and f16 forms"
        )
    return engine, form


def from_gguf(
    content: Content,
    f: BinaryIO,
    device: DeviceLike = "cpu",
    *,
    engine: str | None = None,
    form: str | None = None,
    **options: Any,
) -> Engine:
    """Build an engine from a parsed ``Content`` and its open file.

    ``options`` go to the engine's own ``from_gguf`` (``attention=``, ``strict=``,
    ``kv_cache=`` for the faithful engine; ``prefill=``, ``max_seq_len=``, ... for the fast ones).
    """
    engine, form = resolve(engine, form)
    if engine == "faithful":
        from .faithful import ModelWeights

        check_options(ModelWeights.from_gguf, options, "the faithful engine")
        return ModelWeights.from_gguf(content, f, device, form=form, **options)
    dev = as_device(device)
    if dev.type == "cuda":
        from .fast_cuda import CudaFastModel

        check_options(CudaFastModel.from_gguf, options, "the fast CUDA engine")
        return CudaFastModel.from_gguf(content, f, dev, **options)
    if dev.type == "cpu":
        from .fast_cpu import FastModel

        check_options(FastModel.from_gguf, options, "the fast CPU engine")
        return FastModel.from_gguf(content, f, dev, **options)
    raise ModelError(f"no fast engine on {dev.type}: use engine faithful there")


def check_options(build, options: dict[str, Any], engine: str) -> None:
    """``options`` that ``build`` (an engine's ``from_gguf``) does not take: a ``ModelError``
    naming them and the ones it does take (``decode=`` on the CPU, say), not a ``TypeError``."""
    params = inspect.signature(build).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        known = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
        raise ModelError(f"{engine} takes no option {', '.join(map(repr, unknown))} "
                         f"(its options: {', '.join(known)})")  # fmt: skip


def load(
    path: str | Path,
    device: DeviceLike = "cpu",
    *,
    engine: str | None = None,
    form: str | None = None,
    buffered: bool = True,
    mmap: bool = True,
    metadata_overrides: dict[str, Any] | None = None,
    drop_keys: tuple[str, ...] = (),
    times: dict[str, float] | None = None,
    **options: Any,
) -> tuple[Engine, Content]:
    """Read a GGUF file (a split model: its first shard) and build an engine on ``device``:
    returns ``(model, content)``.

    ``buffered=False`` opens the file unbuffered (one system call per read, as the seed's
    Rust program) and does not map it. ``mmap`` (default): tensors are views of the mapped
    file (``gguf.MappedFile``), so nothing is read twice and no second full copy is held;
    the fast engines drop the mapped pages once they have repacked them.
    ``metadata_overrides`` / ``drop_keys`` edit the metadata in memory before the engine
    sees it (the file is untouched). ``times``, if given, receives
    ``read_ms`` (header, metadata, directory) and ``build_ms`` (tensors, tables; synchronized).
    """
    start = time.perf_counter()
    with open_model(path, buffered=buffered, mmap=mmap) as (content, f):
        content.metadata.update(metadata_overrides or {})
        for key in drop_keys:
            content.metadata.pop(key, None)
        read_done = time.perf_counter()
        model = from_gguf(content, f, device, engine=engine, form=form, **options)
        synchronize(model.device)
    if times is not None:
        times["read_ms"] = (read_done - start) * 1e3
        times["build_ms"] = (time.perf_counter() - read_done) * 1e3
    return model, content
