"""A/B: the fast CPU engine with its layers' Q4_0 / Q4_1 / Q8_0 / Q4_K weights as 16-row panels
(the default) against per-row planes, or for Q4_K the GGUF blocks (``panels=False``). Two
engines in one process, each prefilled with the same N random tokens, then decode steps at
position N alternating between them (each round the min of 8 steps); the prefill's time (one
run each) and the two steps' logits compared. docs/performance.md ("Q4_0 / Q4_1 as 16-row
panels", "Q4_K as 16-row panels, without the prefetch") has the figures.

    PYTHONPATH=. .venv/bin/python tools/panels_ab.py FILE [--context 256 1024 ...] [--rounds 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlib.llama import engine as engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a GGUF file with Q4_0 / Q4_1 / Q8_0 / Q4_K layers")
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024, 2800, 4096])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {}
    for name, panels in (("planes", False), ("panels", True)):
        m = engines.load(args.model, engine="fast", panels=panels)[0]
        models[name] = getattr(m, "model", m)
    g = torch.Generator().manual_seed(0)
    for n in args.context:
        ids = torch.randint(0, 1000, (1, n), generator=g)
        prefill, logits, steps = {}, {}, {name: [] for name in models}
        for name, m in models.items():
            m._kv_len = 0
            t0 = time.perf_counter()
            m.forward(ids, 0)
            prefill[name] = (time.perf_counter() - t0) * 1e3
        for r in range(args.rounds):
            for name in list(models) if r % 2 == 0 else list(models)[::-1]:
                m, best = models[name], float("inf")
                for _ in range(8):
                    m._kv_len = n  # position n again
                    t0 = time.perf_counter()
                    logits[name] = m.forward(ids[:, -1:], n).reshape(-1)
                    best = min(best, time.perf_counter() - t0)
                steps[name].append(best * 1e3)
        a, b = logits["planes"], logits["panels"]
        med = {name: statistics.median(t) for name, t in steps.items()}
        print(
            f"context {n}: decode ms min / median: planes {min(steps['planes']):.3f} / "
            f"{med['planes']:.3f}, panels {min(steps['panels']):.3f} / {med['panels']:.3f} "
            f"(x{med['panels'] / med['planes']:.3f}); prefill planes {prefill['planes']:.0f}, "
            f"panels {prefill['panels']:.0f} ms; logits max |diff| {(a - b).abs().max():.3g} "
            f"of {a.abs().max():.3g}, argmax {'equal' if a.argmax() == b.argmax() else 'DIFFERS'}",
            flush=True,
        )


if __name__ == "__main__":
    main()
