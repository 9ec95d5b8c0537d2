"""transformers folder -> GGUF, and GGUF -> GGUF at another type or recipe.

``hf_to_gguf`` renames the tensors to llama.cpp's names, permutes q/k rows,
quantizes each tensor to the type ``recipes.plan`` picks (logging the K-quant
fallbacks) and writes the metadata ``from_gguf`` and llama.cpp need, built
from ``config.json`` and the tokenizer files. ``quantize_gguf`` re-quantizes
an existing GGUF (dequantize -> quantize; a tensor already of its target type
is copied, as llama-quantize does) and keeps its metadata.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..gguf import Content, GGUFValueType, Typed, open_model, shards, write
from ..quants.types import ggml_type
from . import recipes
from .names import IGNORED_HF, gguf_name, layer_index, permute, permuted_heads
from .recipes import TensorChoice

VT = GGUFValueType
U32, F32 = VT.UINT32, VT.FLOAT32
Log = Callable[[str], None] | None

# the keys candle's (and qlib's) from_gguf reads; rope.freq_base defaults to 10000 when absent
FROM_GGUF_KEYS = (
    "general.architecture",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.block_count",
    "llama.embedding_length",
    "llama.rope.dimension_count",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.freq_base",
)
_BLOCK_ORDER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip


@dataclass
class ConvertReport:
    """What a conversion wrote: the type of every tensor, the metadata keys, the size."""

    path: Path
    spec: str
    choices: list[TensorChoice]
    metadata_keys: list[str]
    nbytes: int
    seconds: float
    permuted: bool = True
    copied: int = 0  # tensors copied byte for byte (already of the target type)

    @property
    def fallbacks(self) -> list[TensorChoice]:
        return [c for c in self.choices if c.fell_back]

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(c.type for c in self.choices).most_common())

    def summary(self) -> str:
        types = ", ".join(f"{t} {n}" for t, n in self.type_counts().items())
        return (
            f"{self.path.name}: {len(self.choices)} tensors [{types}], "
            f"{len(self.metadata_keys)} metadata keys, {self.nbytes:,} bytes, {self.seconds:.1f} s"
        )

    def fallback_lines(self) -> list[str]:
        """One line per (wanted -> type): the tensor kinds that fell back, with counts."""
        groups: dict[tuple[str, str, int], Counter] = defaultdict(Counter)
        for c in self.fallbacks:
            kind = re.sub(r"^blk\.\d+\.", "blk.*.", c.name)
            groups[(c.wanted, c.type, c.shape[-1])][kind] += 1
        lines = []
        for (wanted, got, row), kinds in groups.items():
            block = ggml_type(wanted).block_size
            what = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())
            lines.append(f"fallback {wanted} -> {got} (rows of {row} % {block} != 0): {what}")
        return lines


def sort_key(name: str) -> tuple:
    """token_embd, then each block in llama.cpp's order, then output_norm and output."""
    i = layer_index(name)
    if i is not None:
        part = name.split(".")[2]
        return (1, i, _BLOCK_ORDER.index(part) if part in _BLOCK_ORDER else 99, name)
    order = {"token_embd.weight": 0, "output_norm.weight": 2, "output.weight": 3}
    return (order.get(name, 4), 0, 0, name)


def quantize_tensor(w: torch.Tensor | np.ndarray, type_name: str) -> Any:
    """A float tensor as something ``gguf_file.write`` takes, in ``type_name``."""
    from .. import quants

    x = w.detach().float().cpu().numpy() if isinstance(w, torch.Tensor) else np.asarray(w)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if type_name == "F32":
        return x
    packed = quants.quantize(x.reshape(-1, x.shape[-1]), type_name)
    return (packed, x.shape, type_name)


def _atomic_write(out: Path, metadata: Mapping[str, Any], tensors: Mapping[str, Any], types=None):
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f, metadata, tensors, types=types)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _edit_metadata(
    md: dict[str, Any], metadata: bool, drop_keys: Iterable[str], log: Log
) -> dict[str, Any]:
    if not metadata:
        return {}
    md = dict(md)
    for key in drop_keys:
        if key not in md:
            raise KeyError(f"--drop-key {key}: not in the metadata")
        del md[key]
        if log:
            log(f"dropped metadata key {key}")
    return md


# ---------------------------------------------------------------------------- HF -> GGUF


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a transformers folder, checked to be a llama model."""
    cfg = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    if cfg.get("model_type") != "llama":
        raise NotImplementedError(f"only llama models convert, not {cfg.get('model_type')!r}")
    return cfg


def read_hf_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``model.safetensors`` (or the shards an index names)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors (or its index)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors


ROPE_TYPES = ("default", "linear", "llama3")  # the RoPE scalings hf_to_gguf converts


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a transformers config, ``rope_parameters`` (transformers 5) over
    ``rope_scaling`` and the top level: ``rope_type`` (one of ``ROPE_TYPES``), ``rope_theta``
    (10000 if absent) and the scaling's own keys."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise NotImplementedError(f"rope type {kind!r} is not supported (qlib converts "
                                  f"{', '.join(ROPE_TYPES)})")  # fmt: skip
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return {**params, "rope_type": kind, "rope_theta": theta}


def llama3_rope_factors(params: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling as llama.cpp stores it (``rope_freqs.weight``, one divisor per
    frequency, as its converter computes them): 1 for wavelengths shorter than
    ``original_max_position_embeddings / high_freq_factor``, ``factor`` for those longer than
    ``... / low_freq_factor``, and between them ``1 / ((1 - s) / factor + s)`` with ``s`` the
    smooth ramp transformers uses."""
    factor = float(params.get("factor", 8.0))
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    old_len = float(params.get("original_max_position_embeddings", 8192))
    i = torch.arange(0, head_dim, 2, dtype=torch.float64)
    wavelen = 2 * math.pi * params["rope_theta"] ** (i / head_dim)  # 2 pi / frequency
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen > old_len / low, factor, mid)
    out = torch.where(wavelen < old_len / high, 1.0, out)
    return out.float()


def hf_metadata(
    folder: str | Path, cfg: dict[str, Any], n_vocab: int, spec: str, pre: str | None = None
) -> dict[str, Any]:
    """GGUF metadata for a llama model: general.*, llama.* and tokenizer.* keys."""
    from .tokenizer_meta import tokenizer_metadata

    n_head = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    rope = rope_parameters(cfg)
    name = cfg.get("_name_or_path") or Path(folder).resolve().name
    md: dict[str, Any] = {
        "general.architecture": "llama",
        "general.name": str(name),
        "general.file_type": Typed(U32, recipes.file_type(spec)),
        "general.quantization_version": Typed(U32, 2),
        "llama.vocab_size": Typed(U32, n_vocab),
        "llama.context_length": Typed(U32, int(cfg.get("max_position_embeddings", 2048))),
        "llama.embedding_length": Typed(U32, hidden),
        "llama.block_count": Typed(U32, int(cfg["num_hidden_layers"])),
        "llama.feed_forward_length": Typed(U32, int(cfg["intermediate_size"])),
        "llama.rope.dimension_count": Typed(U32, head_dim),
        "llama.attention.head_count": Typed(U32, n_head),
        "llama.attention.head_count_kv": Typed(U32, int(cfg.get("num_key_value_heads") or n_head)),
        "llama.attention.layer_norm_rms_epsilon": Typed(F32, float(cfg.get("rms_norm_eps", 1e-6))),
        "llama.rope.freq_base": Typed(F32, rope["rope_theta"]),
    }
    if rope["rope_type"] == "linear":
        md["llama.rope.scaling.type"] = "linear"
        md["llama.rope.scaling.factor"] = Typed(F32, float(rope["factor"]))
    if head_dim * n_head != hidden:
        md["llama.attention.key_length"] = Typed(U32, head_dim)
        md["llama.attention.value_length"] = Typed(U32, head_dim)
    if (Path(folder) / "tokenizer.json").is_file():
        md.update(tokenizer_metadata(folder, n_vocab, cfg, pre))
    return md


def hf_to_gguf(
    src: str | os.PathLike,
    out: str | os.PathLike,
    spec: str = "F32",
    *,
    permute_qk: bool = True,
    metadata: bool = True,
    drop_keys: Iterable[str] = (),
    pre: str | None = None,
    log: Log = None,
) -> ConvertReport:
    """Convert a transformers llama folder to a GGUF file of type or recipe ``spec``.

    ``permute_qk=False`` skips the q/k row permutation, ``metadata=False`` writes
    only tensors, ``drop_keys`` removes metadata keys: the failure cases.
    ``pre`` forces ``tokenizer.ggml.pre`` (default: detected).
    """
    t0 = time.perf_counter()
    spec = recipes.normalize_spec(spec)
    folder, out = Path(src), Path(out)
    cfg = read_hf_config(folder)
    n_head = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_head)
    n_layer = int(cfg["num_hidden_layers"])
    floats: dict[str, torch.Tensor] = {}
    for hf, w in read_hf_tensors(folder).items():
        name = gguf_name(hf)
        if name is None:
            if IGNORED_HF.fullmatch(hf):
                continue
            raise ValueError(f"cannot map tensor {hf!r} to a llama.cpp name")
        if name == "output.weight" and cfg.get("tie_word_embeddings", False):
            continue  # tied: the output layer shares token_embd.weight
        w = w.float()
        heads = permuted_heads(name, n_head, n_kv)
        if permute_qk and heads is not None:
            w = permute(w, heads)
        floats[name] = w
    rope = rope_parameters(cfg)
    if rope["rope_type"] == "llama3":  # as llama.cpp's converter: the factors as a tensor
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
        floats["rope_freqs.weight"] = llama3_rope_factors(rope, head_dim)
    floats = {k: floats[k] for k in sorted(floats, key=sort_key)}
    md = hf_metadata(folder, cfg, floats["token_embd.weight"].shape[0], spec, pre)
    md = _edit_metadata(md, metadata, drop_keys, log)
    shapes = {n: tuple(w.shape) for n, w in floats.items()}
    choices = recipes.plan(shapes, spec, n_layer)
    tensors = {c.name: quantize_tensor(floats[c.name], c.type) for c in choices}
    _atomic_write(out, md, tensors)
    report = ConvertReport(
        out, spec, choices, list(md), out.stat().st_size, time.perf_counter() - t0, permute_qk
    )
    _log_report(report, log)
    return report


def _log_report(report: ConvertReport, log: Log) -> None:
    if log:
        for line in report.fallback_lines():
            log(line)
        log(report.summary())


# ---------------------------------------------------------------------------- GGUF -> GGUF


def requantize_plan(content: Content, spec: str) -> list[recipes.TensorChoice]:
    """The type ``quantize_gguf`` gives each tensor of a file (its header, ``content``)."""
    arch = content.metadata.get("general.architecture", "llama")
    n_layer = int(content.metadata.get(f"{arch}.block_count", 0)) or 1 + max(
        (layer_index(n) or 0) for n in content.tensor_infos
    )
    shapes = {n: i.shape for n, i in content.tensor_infos.items()}
    return recipes.plan(shapes, recipes.normalize_spec(spec), n_layer)


def quantize_gguf(
    src: str | os.PathLike,
    out: str | os.PathLike,
    spec: str,
    *,
    metadata: bool = True,
    drop_keys: Iterable[str] = (),
    split_max_bytes: int | None = None,
    log: Log = None,
) -> ConvertReport:
    """Re-quantize a llama GGUF file (a split model: its first shard) to type or recipe
    ``spec`` (metadata kept).

    Each tensor is dequantized to float32 and quantized to its chosen type; one
    already of that type is copied byte for byte. ``general.file_type`` is
    updated and ``quantize.imatrix.*`` keys (they described the source) dropped.
    ``split_max_bytes``: files of at most that much tensor data each, llama.cpp's split
    layout (``gguf.shards``; ``out`` names the first's prefix) where one file would hold more.
    """
    t0 = time.perf_counter()
    spec = recipes.normalize_spec(spec)
    out = Path(out)
    if Path(src).resolve() == out.resolve():
        raise ValueError(f"--out {out} is the input file")
    with open_model(src) as (content, f):
        choices = requantize_plan(content, spec)
        tensors: dict[str, Any] = {}
        copied = 0
        for c in choices:
            q = content.tensor(f, c.name)
            if q.dtype.name == c.type:
                tensors[c.name] = q
                copied += 1
            else:
                tensors[c.name] = quantize_tensor(q.dequantize(), c.type)
    md = {k: v for k, v in content.metadata.items()
          if not k.startswith(("quantize.imatrix.", "split."))}  # fmt: skip
    md["general.file_type"] = Typed(U32, recipes.file_type(spec))
    md.setdefault("general.quantization_version", Typed(U32, 2))
    md = _edit_metadata(md, metadata, drop_keys, log)
    files = shards(out, md, tensors, split_max_bytes) if split_max_bytes else [(out, md, tensors)]
    for path, shard_md, shard_tensors in files:
        _atomic_write(path, shard_md, shard_tensors, types=content.metadata_types)
        if log and len(files) > 1:
            log(f"wrote {path} ({len(shard_tensors)} tensors)")
    out = files[0][0]
    report = ConvertReport(out, spec, choices, list(md), sum(p.stat().st_size for p, _, _ in files),
                           time.perf_counter() - t0, copied=copied)  # fmt: skip
    _log_report(report, log)
    return report
