"""The AMX prefill's weights as 4/8-bit codes against a bf16 tile copy, file by file.

    python tools/amx_codes_bench.py FILE [FILE ...] [--tokens 256] [--rounds 5] [--threads N]

For each file two fast CPU models with ``prefill="bf16"`` (needs AMX): ``amx_packed=True``
(quantized weights kept as codes, expanded to bf16 tiles inside the GEMM: every legacy and
K-quant type, mixes too) and ``amx_packed=False`` (a bf16 tile copy). Prints the bytes each
holds for prefill, whether their logits are identical, and the prefill of ``--tokens``
tokens, the two alternating in one process (min and median of ``--rounds``). Files of
several types show whether the K-quants' codes run at the legacy types' speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from qlib.llama import engine as engines
from qlib.quants import cpu


def prefill_copy_mib(model) -> float:
    lins = [getattr(ly, n) for ly in model.layers for n in ("wqkv", "wo", "w13", "w2")]
    return sum(lin.amx.nbytes() for lin in lins) / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if not cpu.amx_available():
        print(f"AMX unavailable: {cpu.amx_unavailable_reason()}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}, {args.tokens} tokens, {args.rounds} rounds")
    print("| file | weights | prefill copy MiB | identical logits | prefill ms min | median |")
    print("|---|---|---:|---|---:|---:|")
    for path in args.files:
        built = {}
        for packed in (True, False):
            model, _ = engines.load(path, engine="fast", prefill="bf16", amx_packed=packed)
            built[packed] = model
        ids = torch.randint(0, 1000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            logits = {}
            for packed, m in built.items():
                m.clear_kv_cache()
                logits[packed] = m.forward(ids, 0)
            same = torch.equal(logits[True], logits[False])
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for packed, m in built.items():
                    m.clear_kv_cache()
                    t0 = time.perf_counter()
                    m.forward(ids, 0)
                    times[packed].append((time.perf_counter() - t0) * 1e3)
        name = path.rsplit("/", 1)[-1]
        for packed, m in built.items():
            stacks = ("wqkv", "wo", "w13", "w2")
            kinds = sorted({getattr(ly, s).amx.kind for ly in m.layers for s in stacks})
            t = times[packed]
            print(f"| {name} | {'codes' if packed else 'bf16 copy'} ({', '.join(kinds)}) | "
                  f"{prefill_copy_mib(m):.1f} | {same} | {min(t):.1f} | "
                  f"{statistics.median(t):.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
