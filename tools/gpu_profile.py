"""Where the time of one fast CUDA decode step and prefill goes (run on the GPU machine).

python tools/gpu_profile.py [--model PATH] [--out DIR]: kernel count and GPU time per
kernel (torch profiler over eager steps), graph replay time (CUDA events), host time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qlib import models
from qlib.llama.engine import load


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompt-tokens", type=int, default=203)
    ap.add_argument("--attention", default="split", help="CudaFastModel's decode attention")
    args = ap.parse_args()
    model, _ = load(args.model or models.path(), "cuda", engine="fast", attention=args.attention)
    ids = torch.arange(100, 100 + args.prompt_tokens, device="cuda")[None]
    report: dict = {}
    with torch.inference_mode():
        model.forward(ids, 0)
        tok = torch.tensor([[5]], device="cuda")
        for pos in range(args.prompt_tokens, args.prompt_tokens + 3):
            model.forward(tok, pos)  # compile, capture
        # graph replay: GPU time per step from CUDA events, host time per forward
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 100
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for i in range(n):
            model.forward(tok, args.prompt_tokens + 3 + i)
        end.record()
        torch.cuda.synchronize()
        report["decode_graph_ms_per_step_gpu"] = start.elapsed_time(end) / n
        report["decode_graph_ms_per_step_wall"] = (time.perf_counter() - t0) * 1e3 / n
        g = model._decode_graph
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        report["decode_graph_replay_only_ms"] = start.elapsed_time(end) / n
        # prefill graph
        model.forward(ids, 0)
        model.forward(ids, 0)
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            model.forward(ids, 0)
        end.record()
        torch.cuda.synchronize()
        report["prefill_graph_ms_gpu"] = start.elapsed_time(end) / 10
        # kernel breakdown of eager steps
        model.graphs = False
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                model.forward(tok, args.prompt_tokens + i)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        with profile(activities=[ProfilerActivity.CUDA]) as prof2:
            model.forward(ids, 0)
            torch.cuda.synchronize()
        table2 = prof2.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    (args.out / "gpu_profile.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu_profile.txt").write_text(
        "decode, 5 eager steps\n" + table + "\n\nprefill, eager\n" + table2
    )
    print(json.dumps(report, indent=1))
    print(table)
    print(table2)


if __name__ == "__main__":
    main()
