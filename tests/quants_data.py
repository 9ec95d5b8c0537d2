"""Varied float32 test rows for the block-format tests (rows of 512 = two K-quant super-blocks)."""

from __future__ import annotations

import numpy as np

K = 512


def kinds(rows: int = 4, k: int = K, seed: int = 0) -> dict[str, np.ndarray]:
    """Named ``[rows, k]`` float32 arrays: the cases every format must handle."""
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal((rows, k))
    outliers = rng.standard_normal((rows, k))
    outliers[:, rng.integers(0, k, 3)] = [1e4, -3e3, 50.0]
    data = {
        "normal": normal,
        "wide_range": normal * np.exp(rng.uniform(-12, 12, (rows, 1))),
        "all_equal": np.full((rows, k), 0.7) * np.resize([1, -1, 3e-3, 250.0], rows)[:, None],
        "zeros": np.zeros((rows, k)),
        "outliers": outliers,
        "tiny": rng.standard_normal((rows, k)) * 1e-30,
        "negative_only": -np.abs(rng.standard_normal((rows, k))) - 0.5,
        "positive_skewed": rng.exponential(1.0, (rows, k)),
        "ties": np.round(rng.standard_normal((rows, k)) * 4) / 4,
        "sparse": np.where(rng.uniform(size=(rows, k)) < 0.9, 0, rng.standard_normal((rows, k))),
        "heavy_tail": rng.standard_t(1.5, (rows, k)),
    }
    return {name: a.astype(np.float32) for name, a in data.items()}


def stacked(rows: int = 4, k: int = K, seed: int = 0) -> np.ndarray:
    return np.concatenate(list(kinds(rows, k, seed).values()))
