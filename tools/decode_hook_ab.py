"""A/B of one of the CPU decode's hooks (``qlib.quants.cpu.ops.set_*``) in one process.

    PYTHONPATH=. .venv/bin/python tools/decode_hook_ab.py MODEL --hook set_kpanel_prefetch \
        --values 0,2368,4736 [--prompt-tokens 128] [--rounds 6] [--steps 8] [--threads 2]

The fast engine prefills ``--prompt-tokens`` seeded random tokens, then each round sets every
value in turn (the order reversed every other round) and takes ``--steps`` decode steps with
it, keeping the fastest; the positions advance as the steps go, so a round's values see
neighbouring positions. Prints each value's min and median over the rounds (ms a step). The
hooks change no result (tests/test_decode_chain.py), only the time; the hook is restored to
its default afterwards. docs/performance.md ("Software prefetch by the CPU's vendor") has runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlib.llama import engine as engines
from qlib.quants.cpu import ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF file")
    ap.add_argument("--hook", required=True, help="a setter of qlib.quants.cpu.ops")
    ap.add_argument("--values", required=True, help="comma-separated integers")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not args.hook.startswith("set_") or not callable(getattr(ops, args.hook, None)):
        raise SystemExit(f"no hook {args.hook!r} in qlib.quants.cpu.ops")
    setter = getattr(ops, args.hook)
    values = [int(v) for v in args.values.split(",")]
    torch.set_num_threads(args.threads)
    model = engines.load(args.model, "cpu", engine="fast")[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.vocab_size, (1, args.prompt_tokens), generator=g)
    best: dict[int, list[float]] = {v: [] for v in values}
    try:
        with torch.inference_mode():
            token, pos = int(model.forward(ids, 0).argmax()), args.prompt_tokens
            for r in range(args.rounds):
                for v in values if r % 2 == 0 else values[::-1]:
                    setter(v)
                    times = []
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        token = model.greedy_step(token, pos)
                        times.append(time.perf_counter() - t0)
                        pos += 1
                    best[v].append(min(times) * 1e3)
    finally:
        setter()
    print(f"{args.model}: {args.hook}, {args.rounds} rounds of min-of-{args.steps} steps")
    for v in values:
        mid = statistics.median(best[v])
        print(f"  {v:>8}: min {min(best[v]):.2f}  median {mid:.2f} ms a step")


if __name__ == "__main__":
    main()
