"""Notebook 5: RoPE mismatches (seed: quantized llama forward, "RoPE" and the 4096 limit).

Three silent or late failures of the metadata-driven RoPE:

* ``general.architecture`` relabelled ``qwen2`` (in memory): ``from_gguf``
  picks the NEOX pairing (i, i + d/2) for weights permuted for the
  interleaved one (2i, 2i + 1); no error, the text degenerates;
* ``index_pos + seq_len > 4096``: the cos/sin tables end, the narrow fails,
  whatever the model's ``context_length``;
* ``llama.rope.freq_base`` removed: ``from_gguf`` quietly uses 10000.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...generate import generate
from ...llama.config import MAX_SEQ_LEN
from ...llama.engine import load
from ...llama.faithful import ModelWeights
from .common import teacher_forced_logits
from .index_pos import Decoder, attempt, first_difference, text_stats

FREQ_BASE_KEY = "llama.rope.freq_base"

Variant = tuple[dict[str, Any], tuple[str, ...]]  # (metadata overrides, keys dropped)


def variants(relabel: str = "qwen2") -> dict[str, Variant]:
    """The file as is, relabelled ``relabel``, and without ``llama.rope.freq_base``."""
    return {
        "file as is": ({}, ()),
        f"relabelled {relabel}": ({"general.architecture": relabel}, ()),
        "freq_base removed": ({}, (FREQ_BASE_KEY,)),
    }


def load_variants(
    path: str | Path,
    device: str = "cpu",
    specs: dict[str, Variant] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, ModelWeights], list[dict]]:
    """Build each variant (default: ``variants()``); returns the models and a row per build.

    A row says what ``from_gguf`` was given and what it made of it (RoPE pairing,
    freq_base used) and whether it raised (it does not: that is the point).
    """
    models: dict[str, ModelWeights] = {}
    rows = []
    for name, (overrides, drop) in (specs or variants()).items():
        r = attempt(
            lambda o=overrides, d=drop: load(
                path, device, metadata_overrides=o, drop_keys=d, **kwargs
            )
        )
        row: dict[str, Any] = {"variant": name, "from_gguf_ok": r["ok"], "error": r["error"]}
        if r["ok"]:
            model, content = r["value"]
            metadata = content.metadata
            models[name] = model
            cfg = model.config
            row.update(
                architecture=cfg.architecture,
                rope="rope (NEOX: i, i+d/2)" if cfg.rope_is_neox else "rope_i (2i, 2i+1)",
                freq_base_in_metadata=metadata.get(FREQ_BASE_KEY),
                freq_base_used=cfg.rope_freq_base,
                context_length=metadata.get("llama.context_length"),
            )
        rows.append(row)
    return models, rows


def generation_rows(
    models: dict[str, ModelWeights], tok: Decoder, prompt_ids: list[int], steps: int
) -> list[dict]:
    """Greedy text per variant, degeneration measures, first token unlike the first variant.

    ``first_token_unlike_file`` counts from 1 (the first generated token); None: no difference.
    """
    rows, base = [], None
    for name, model in models.items():
        ids = generate(model, prompt_ids, steps)
        base = ids if base is None else base
        first = first_difference(ids, base)
        rows.append(
            {
                "variant": name,
                "text": tok.decode(ids),
                **text_stats(ids),
                "first_token_unlike_file": None if first is None else first + 1,
                "ids": ids,
            }
        )
    return rows


def position_drift(base: torch.Tensor, other: torch.Tensor) -> dict[str, np.ndarray]:
    """Per position: max|diff| of the logits and whether the argmax agrees."""
    diff = (base - other).abs()
    return {
        "position": np.arange(base.shape[0]),
        "max_abs_diff": diff.amax(-1).numpy(),
        "argmax_agrees": (base.argmax(-1) == other.argmax(-1)).numpy(),
    }


def teacher_forced_rows(
    models: dict[str, ModelWeights], ids: list[int]
) -> tuple[list[dict], dict[str, dict[str, np.ndarray]]]:
    """Each variant against the first one over the same teacher-forced tokens.

    Returns summary rows and, per variant, the per-position drift (for a plot).
    """
    names = list(models)
    base = teacher_forced_logits(models[names[0]], ids)
    rows, curves = [], {}
    for name in names[1:]:
        d = position_drift(base, teacher_forced_logits(models[name], ids))
        curves[name] = d
        agree = d["argmax_agrees"]
        rows.append(
            {
                "variant": name,
                "tokens": len(ids),
                "max_abs_diff_pos0": float(d["max_abs_diff"][0]),
                "max_abs_diff": float(d["max_abs_diff"].max()),
                "median_max_abs_diff": float(np.median(d["max_abs_diff"])),
                "argmax_agree": int(agree.sum()),
                "argmax_agree_share": float(agree.mean()),
                "first_argmax_difference_at": int(np.argmin(agree)) if not agree.all() else None,
            }
        )
    return rows, curves


def context_limit(model: ModelWeights, token_id: int = 0, chunk: int = 8) -> list[dict]:
    """Forwards around ``MAX_SEQ_LEN``: the last position that fits, then the narrow errors.

    Each call starts from an empty cache; RoPE's narrow runs before the mask is
    used, so a chunk that ends past the table fails there too.
    """
    cases = [(MAX_SEQ_LEN - 1, 1), (MAX_SEQ_LEN, 1), (MAX_SEQ_LEN - chunk // 2, chunk)]
    rows = []
    for index_pos, seq_len in cases:
        model.clear_kv_cache()

        def run(pos: int = index_pos, n: int = seq_len) -> int:
            with torch.inference_mode():
                x = torch.full((1, n), token_id, device=model.device)
                return int(model.forward(x, pos).argmax())

        r = attempt(run)
        rows.append(
            {
                "index_pos": index_pos,
                "seq_len": seq_len,
                "last_position": index_pos + seq_len - 1,
                "rope_table_rows": MAX_SEQ_LEN,
                "ok": r["ok"],
                "error": r["error"],
            }
        )
    model.clear_kv_cache()
    return rows
