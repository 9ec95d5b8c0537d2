"""A/B: the fast CPU engine's decode step at N positions with its KV cache on 2 MB pages (the
default since the twenty-ninth session: the buffer made for the positions in use, grown as
needed) against the same cache on 4 KB pages (``kv_hugepages=False``). Two engines in one
process, prefilled with the same N tokens, then decode steps alternating between them (a round:
the median of ``--steps`` steps from position N). docs/performance.md ("The KV cache grown on
2 MB pages") has the figures; the measurement before that change (three engines: 8,192
positions reserved, N reserved, N on 2 MB pages) is in "2 MB pages under the GEMV and the
cache".

    PYTHONPATH=. .venv/bin/python tools/kv_hugepages.py FILE N ROUNDS [--kv-type f16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlib.llama import engine as engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("positions", type=int)
    ap.add_argument("rounds", type=int)
    ap.add_argument("--kv-type", default="f32", choices=["f32", "f16"])
    ap.add_argument("--steps", type=int, default=12, help="decode steps a round (default 12)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = args.positions
    models = {}
    for name, huge in (("2 MB pages", True), ("4 KB pages", False)):
        models[name] = engines.load(args.file, "cpu", engine="fast", prefill="int8-attn",
                                    kv_type=args.kv_type, kv_hugepages=huge)[0]  # fmt: skip
    ids = torch.randint(0, 4000, (1, n), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, m in models.items() if r % 2 == 0 else reversed(models.items()):
                m.forward(ids, 0)  # start over: the same N positions again
                tok, steps = ids[:, -1:], []
                for pos in range(n, n + args.steps):
                    t0 = time.perf_counter()
                    logits = m.forward(tok, pos)
                    steps.append(time.perf_counter() - t0)
                    tok = logits.reshape(-1).argmax().view(1, 1)
                times[name].append(statistics.median(steps) * 1e3)
                if r == 0:
                    print(f"{name}: KV MiB", {k: v and v >> 20 for k, v in m.kv_bytes().items()})
    for name, v in times.items():
        print(f"{name:12s} ms a step min {min(v):.2f} median {statistics.median(v):.2f}  "
              f"rounds {[round(x, 2) for x in v]}")  # fmt: skip


if __name__ == "__main__":
    main()
