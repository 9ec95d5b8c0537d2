"""Notebook 7: QMatMul's three forms on one large weight (seed: "QTensor and QMatMul").

For a weight of N x K in a block format, time ``y = x @ w.T`` for m input
rows in the quantized form (blocks kept; on CPU activations quantized as
ggml does) and the dequantized f32 and f16 forms, and check that f16/bf16
inputs give correct results (or a clear error) on every path.
"""

from __future__ import annotations

import torch

from ...quants.bench import bench_qmatmul, random_qtensor
from ...quants.qtensor import QMatMul

FORMS = ("quantized", "f32", "f16")


def run_grid(
    types: list[str],
    ms: list[int],
    forms: tuple[str, ...] = FORMS,
    *,
    n: int = 8192,
    k: int = 4096,
    device: str = "cpu",
    repeats: int = 3,
    progress: bool = True,
) -> list[dict]:
    """One row per (type, form, m): min time, GB/s of the weight bytes the form reads."""
    from tqdm.auto import tqdm

    grid = [(t, f, m) for t in types for f in forms for m in ms]
    rows = []
    for type_name, form, m in tqdm(grid, desc=f"qmatmul {device}", disable=not progress):
        r = bench_qmatmul(n, k, type_name, m, form, device, repeats)
        r["ms"] = r["time_s"] * 1e3
        r["us_per_row"] = r["time_s"] * 1e6 / m
        rows.append(r)
    return rows


def crossover(rows: list[dict], type_name: str, slow: str = "quantized", fast: str = "f32"):
    """Smallest m at which the ``fast`` form beats the ``slow`` one (None if never)."""
    times = {(r["form"], r["m"]): r["time_s"] for r in rows if r["type"] == type_name}
    for m in sorted({m for _, m in times}):
        if (slow, m) in times and (fast, m) in times and times[(fast, m)] < times[(slow, m)]:
            return m
    return None


def dtype_check(
    types: list[str],
    ms: list[int],
    forms: tuple[str, ...] = FORMS,
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16),
    *,
    n: int = 1024,
    k: int = 4096,
    device: str = "cpu",
) -> list[dict]:
    """f16/bf16 inputs on every form: relative error against the f32 input, or the error raised.

    The reference is the same form with the input in f32, so the only change
    is the input dtype; an error below a few units of the dtype's rounding
    (2^-11 for f16, 2^-8 for bf16) is correct.
    """
    rows = []
    for type_name in types:
        w = random_qtensor(n, k, type_name, device)
        for form in forms:
            mm = QMatMul(w, form)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
                ref = mm(x).float()
                for dtype in dtypes:
                    row = {
                        "type": type_name,
                        "form": form,
                        "m": m,
                        "dtype": str(dtype)[6:],
                        "device": device,
                    }
                    try:
                        y = mm(x.to(dtype))
                        rel = float((y.float() - ref).norm() / ref.norm())
                        eps = torch.finfo(dtype).eps
                        row.update(
                            ok=True,
                            out_dtype=str(y.dtype)[6:],
                            rel_error=rel,
                            rel_error_in_eps=rel / eps,
                            correct=rel < 8 * eps,
                            error="",
                        )
                    except Exception as e:  # a clear error is an accepted outcome
                        row.update(
                            ok=False,
                            out_dtype="",
                            rel_error=float("nan"),
                            rel_error_in_eps=float("nan"),
                            correct=False,
                            error=f"{type(e).__name__}: {e}",
                        )
                    rows.append(row)
    return rows
