"""The greedy loop's host time on the GPU machine: the launch-ahead of
``CudaFastModel.greedy_step`` on and off, alternating in one process, against the greedy graph
replayed back to back (the GPU's own time a step).

    python tools/greedy_ahead.py [--model PATH | --synthetic PATH [--synthetic-type Q8_0]]
        [--decode persistent|fused] [--steps 200] [--rounds 5]

Per round and mode: prefill a 203-token prompt, then ``--steps`` greedy steps each read back
to the host, timed up to a synchronize (a step launched ahead counts); us a step, min and
median over the rounds, and whether both modes gave the same ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from persistent_probe import graph_us, write_synthetic  # noqa: E402

from qlib.llama.engine import load  # noqa: E402


def greedy_us(model, prompt: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    model.clear_kv_cache()
    token = int(model.forward(prompt, 0)[0].argmax())
    pos, ids = prompt.shape[1], []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        token = model.greedy_step(token, pos)
        ids.append(token)
        pos += 1
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / steps, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--synthetic", type=Path, default=Path("/tmp/syn.gguf"))
    ap.add_argument("--synthetic-type", default="Q4_1", help="the synthetic file's layer type")
    ap.add_argument("--decode", default="persistent", choices=("persistent", "fused"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    path = args.model or write_synthetic(args.synthetic, args.synthetic_type)
    model, _ = load(path, "cuda", engine="fast", decode=args.decode, max_seq_len=4096)
    prompt = (torch.arange(1, 204) % 1000 + 5).view(1, -1).cuda()
    times: dict[str, list[float]] = {"ahead": [], "no ahead": [], "graph replays": []}
    ids: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode, ahead in (("ahead", True), ("no ahead", False)):
            model.launch_ahead = ahead
            us, ids[mode] = greedy_us(model, prompt, args.steps)
            times[mode].append(us)
        times["graph replays"].append(graph_us(model, 200, model._greedy_graph))
    for mode, ts in times.items():
        print(f"{mode:14s} us a step: min {min(ts):6.1f}  median {statistics.median(ts):6.1f}")
    print("same ids:", ids["ahead"] == ids["no ahead"], f"({len(ids['ahead'])} steps)")


if __name__ == "__main__":
    main()
