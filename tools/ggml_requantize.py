"""Write a GGUF whose matrices are all one ggml type, quantized by ggml itself.

    python tools/ggml_requantize.py IN.gguf OUT.gguf TYPE [--threads N]

For the types qlib reads but does not write (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, TQ1_0, TQ2_0): llama.cpp's ``llama_model_quantize`` refuses most of them
without an importance matrix, and its file types mix them with others. Here every matrix whose
rows divide the type's block is dequantized (qlib) and quantized with ``ggml_quantize_chunk``
(llama-cpp-python's libggml; an importance matrix of ones where ggml requires one: the plain
least-squares weights), the others kept as they are: ``llama-quantize --pure`` with a flat
importance matrix. Benchmark and test files, not a converter (``qlib quantize`` is that).
Needs the peers extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # quants_ggml: ctypes access to llama-cpp-python's ggml

import quants_ggml  # noqa: E402

from qlib import progress  # noqa: E402
from qlib.gguf import Content, write  # noqa: E402
from qlib.quants.qtensor import QTensor  # noqa: E402
from qlib.quants.types import ggml_type  # noqa: E402

ROWS = 64  # rows per ggml call (the calls run on ``--threads`` threads; ctypes drops the GIL)


def requantize(q: QTensor, type_name: str, ggml, threads: int) -> QTensor:
    """Matrix ``q`` in ``type_name``, quantized by ggml (row chunks on ``threads`` threads)."""
    x = q.dequantize().numpy().reshape(-1, q.shape[-1])
    imatrix = np.ones(x.shape[1], np.float32) if ggml.requires_imatrix(type_name) else None
    chunks = [x[i : i + ROWS] for i in range(0, x.shape[0], ROWS)]
    with ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda c: ggml.quantize(c, type_name, imatrix), chunks))
    return QTensor.from_bytes(np.concatenate(parts).reshape(-1), q.shape, type_name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("type", help="a ggml type, e.g. IQ2_XS")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    t = ggml_type(args.type)
    ggml = quants_ggml.load()
    if ggml is None:
        sys.exit("ggml_requantize: needs llama-cpp-python (the peers extra)")
    start = time.perf_counter()
    with open(args.src, "rb") as f:
        content = Content.read(f)
        tensors, changed = {}, 0
        names = list(content.tensor_infos)
        for name in progress.bar(names, len(names), "quantize", "tensor"):
            q = content.tensor(f, name, "cpu")
            if len(q.shape) == 2 and q.shape[-1] % t.block_size == 0:
                q, changed = requantize(q, t.name, ggml, args.threads), changed + 1
            tensors[name] = q
        with open(args.dst, "wb") as out:
            write(out, content.metadata, tensors, types=content.metadata_types)
    print(f"{args.dst}: {changed} of {len(tensors)} tensors as {t.name}, "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
