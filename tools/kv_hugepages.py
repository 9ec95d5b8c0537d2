"""A/B: the fast CPU engine's decode step at N positions with the KV cache reserved for 8,192
positions (4 KB pages: the engine's default), for N rounded up (4 KB pages), and for N rounded
up on 2 MB pages (``madvise(MADV_HUGEPAGE)`` before the prefill writes it). Three engines in
one process, prefilled with the same N tokens, then decode steps alternating between them.
docs/performance.md ("2 MB pages under the GEMV and the cache") has the figures.

    PYTHONPATH=. .venv/bin/python tools/kv_hugepages.py FILE N ROUNDS [--kv-type f16]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time

import torch

from qlib.llama import engine as engines

_MADV_HUGEPAGE, _HUGE = 14, 2 << 20


def advise_hugepages(t: torch.Tensor) -> int:
    """``madvise(MADV_HUGEPAGE)`` over the 2 MB-aligned part of ``t``'s storage: 0 on success."""
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = t.untyped_storage().data_ptr()
    lo = (start + _HUGE - 1) & ~(_HUGE - 1)
    hi = (start + t.untyped_storage().nbytes()) & ~(_HUGE - 1)
    return libc.madvise(lo, max(hi - lo, 0), _MADV_HUGEPAGE)


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
    cap = (n + args.steps + 255) // 256 * 256
    models = {}
    for name, reserved, huge in [("8192, 4 KB", 8192, False), (f"{cap}, 4 KB", cap, False),
                                 (f"{cap}, 2 MB", cap, True)]:  # fmt: skip
        m = engines.load(args.file, "cpu", engine="fast", max_seq_len=reserved,
                         prefill="int8-attn", kv_type=args.kv_type)[0]  # fmt: skip
        if huge and advise_hugepages(m.cache) != 0:
            raise SystemExit("madvise(MADV_HUGEPAGE) failed")
        models[name] = m
    ids = torch.randint(0, 4000, (1, n), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, m in models.items():
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
