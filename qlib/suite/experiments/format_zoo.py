"""Notebook 10: one model in every GGUF type and K-quant mix, side by side.

For each variant of a model file (SmolLM2 re-quantized by qlib's quantizer to a plain
type or a llama.cpp-style recipe, or any file given): its size and bits per weight,
its speed under the benchmark protocol (one process per configuration: the faithful
and the fast engine on CPU, the fast engine on CUDA where there is one, llama.cpp),
and its drift from the F32 variant over a passage, teacher-forced: mean and max
|logit diff|, argmax agreement, perplexity. llama.cpp's own drift from its F32 run is
measured the same way beside ours, so "how much does this type cost" is answered for
both engines on the same files.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ... import models
from ...gguf import Content
from ..bench import run_in_subprocess

TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_1", "Q5_K_M", "Q5_0", "Q5_K_S", "Q5_K",
    "Q4_1", "Q4_K_M", "Q4_K_S", "Q4_K", "Q4_0", "Q3_K", "Q2_K",
)  # fmt: skip
REFERENCE = "F32"


@dataclass(frozen=True)
class Variant:
    name: str  # the type or recipe
    path: Path


def variants(types: tuple[str, ...] | list[str], source: str | Path | None = None,
             log=None) -> list[Variant]:  # fmt: skip
    """Each type or recipe of ``source`` (default: the embedded model), derived on first use."""
    source = str(source or models.path())
    return [Variant(t, models.derive(t, source, log=log)) for t in types]


def file_facts(v: Variant) -> dict[str, Any]:
    """Size, bits per weight over every tensor, the types of the matrices (count each)."""
    content = Content.read_path(v.path)
    infos = content.tensor_infos.values()
    n = sum(i.n_elements for i in infos)
    data = sum(i.nbytes for i in infos)
    mix = Counter(i.dtype.name for i in infos if len(i.shape) == 2)
    return {
        "variant": v.name,
        "file_mb": v.path.stat().st_size / 1e6,
        "bits_per_weight": 8 * data / n,
        "matrix_types": ", ".join(f"{t} x{c}" for t, c in mix.most_common()),
    }


def speed(v: Variant, runtime: str, *, engine: str | None = None, device: str = "cpu",
          threads: int | None = None, prompt_tokens: int = 64, steps: int = 32,
          reps: int = 1) -> dict[str, Any]:  # fmt: skip
    """One benchmark configuration on ``v`` in its own process; one flat row."""
    argv = ["--model", str(v.path), "--runtime", runtime, "--device", device, "--prompt-tokens",
            str(prompt_tokens), "--steps", str(steps), "--reps", str(reps),
            "--no-floor"]  # fmt: skip
    if engine:
        argv += ["--engine", engine]
    if threads:
        argv += ["--threads", str(threads)]
    r = run_in_subprocess(argv)
    label = runtime if runtime != "qlib" else f"qlib {engine or 'faithful'}"
    row: dict[str, Any] = {"variant": v.name, "runner": f"{label} {device}"}
    if "error" in r:
        return {**row, "error": r["error"]}
    return {
        **row,
        "prefill_ms": r["prefill_ms"]["min"],
        "decode_ms": r["decode_ms_per_token"]["min"],
        "peak_rss_mb": r["peak_rss_mb"],
        "error": "",
    }


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def drift(logits: np.ndarray, reference: np.ndarray, ids: list[int]) -> dict[str, float]:
    """How ``logits`` (T, vocab) of a passage depart from ``reference``'s, teacher-forced.

    Perplexity is of the passage itself: position t predicts token t + 1.
    """
    diff = np.abs(logits.astype(np.float64) - reference.astype(np.float64))
    nll = -log_softmax(logits[:-1])[np.arange(len(ids) - 1), ids[1:]]
    return {
        "mean_abs_diff": float(diff.mean()),
        "max_abs_diff": float(diff.max()),
        "argmax_agreement": float((logits.argmax(-1) == reference.argmax(-1)).mean()),
        "perplexity": float(math.exp(nll.mean())),
    }
