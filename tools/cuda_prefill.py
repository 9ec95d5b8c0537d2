"""The fast CUDA engine's prefill modes side by side (f32, tf32, bf16; one process, alternating):
prefill time of the passage's first N tokens (one CUDA graph per length, as ``bench``), and the
drift of each mode from ``f32``: teacher-forced argmax agreement and |logit diff| over every
position of an N-token prefill (the passage repeated), and greedy ids after the benchmark prompt.

    python tools/cuda_prefill.py [--model PATH] [--sizes 203 2800] [--reps 5] [--greedy 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from qlib import models
from qlib.llama.engine import load
from qlib.suite.bench import prompt_ids
from qlib.tokenizer import Tokenizer

MODES = ("f32", "tf32", "bf16")


def prefill_ms(model, ids: list[int], reps: int) -> float:
    """Min over ``reps`` of one prefill from position 0 (two untimed runs first: eager, capture)."""
    x = torch.tensor([ids])
    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.forward(x, 0)
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def greedy(model, ids: list[int], n: int) -> list[int]:
    logits = model.forward(torch.tensor([ids]), 0)
    out = [int(logits.argmax())]
    for i in range(n - 1):
        logits = model.forward(torch.tensor([[out[-1]]]), len(ids) + i)
        out.append(int(logits.argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[203, 2800])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--greedy", type=int, default=32)
    args = ap.parse_args()
    path = args.model or models.path()
    engines = {}
    for mode in MODES:
        engines[mode], content = load(path, "cuda", engine="fast", prefill=mode)
    tok = Tokenizer.from_metadata(content.metadata)
    passage = models.data_file("passage.txt")
    encode = tok.encode
    with torch.inference_mode():
        for n in args.sizes:
            ids = prompt_ids(encode, n, passage, repeat=True)
            best = {m: float("inf") for m in MODES}
            for _ in range(3):  # alternate the modes, min of all rounds
                for m in MODES:
                    best[m] = min(best[m], prefill_ms(engines[m], ids, args.reps))
            print(f"prefill {n} tokens: " + ", ".join(f"{m} {best[m]:.2f} ms" for m in MODES)
                  + f" (bf16 / f32 x{best['bf16'] / best['f32']:.2f}, "
                  f"tf32 / f32 x{best['tf32'] / best['f32']:.2f})")  # fmt: skip
            ref = engines["f32"].forward(torch.tensor([ids]), 0, all_logits=True)[0]
            for m in MODES[1:]:
                got = engines[m].forward(torch.tensor([ids]), 0, all_logits=True)[0]
                same = got.argmax(-1) == ref.argmax(-1)
                d = (got - ref).abs()
                print(f"  {m} vs f32, teacher-forced over {n} positions: argmax agreement "
                      f"{100 * same.float().mean():.2f}% ({int(same.sum())}/{n}), mean |diff| "
                      f"{d.mean():.4f}, max |diff| {d.max():.4f}, logit scale "
                      f"{ref.abs().max():.1f}")  # fmt: skip
        bench_ids = prompt_ids(encode, 203, passage)
        ref_ids = greedy(engines["f32"], bench_ids, args.greedy)
        for m in MODES[1:]:
            got = greedy(engines[m], bench_ids, args.greedy)
            pairs = enumerate(zip(got, ref_ids, strict=True))
            agree = next((i for i, (a, b) in pairs if a != b), len(got))
            print(f"greedy after the 203-token prompt, {m} prefill: first {agree} of "
                  f"{args.greedy} ids equal to the f32 prefill's")  # fmt: skip


if __name__ == "__main__":
    main()
