"""The CPU decode attention alone against a plain read of memory, in one process, alternating:
SmolLM2's shape (30 layers, 9 query / 3 KV heads of 64), random caches of N positions, one
decode step's 30 attention calls (``attn_decode_plan``, the C kernel the fast engine runs),
min of ``--reps`` steps per round; beside each round the bandwidth of a read-only pass
(``copy_bandwidth``, the floor's figure in notebook 03). The rate of this shared VM's memory
moves from run to run; the ratio of the two in one round says how far the kernel is from it.
``--huge``: a second set of caches on 2 MB pages (``madvise(MADV_HUGEPAGE)`` before the first
write), timed alternating with the first.

    python tools/attn_bandwidth.py [--contexts 256 1024 2048 4096] [--kv-type f32|f16]
        [--rounds 3] [--reps 10] [--threads 2] [--huge]
"""

import argparse
import ctypes
import mmap
import time

import torch

from qlib.llama.checks import KV_TYPES
from qlib.quants import cpu
from qlib.suite.experiments.common import copy_bandwidth

N_LAYER, N_HEAD, N_KV, HEAD_DIM = 30, 9, 3, 64


HUGE = 2 << 20


def huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor on anonymous memory advised for 2 MB pages (Linux)."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE
    libc = ctypes.CDLL(None)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(raw.data_ptr() + start, n, 14)  # MADV_HUGEPAGE (a hint)
    return raw[start : start + n].view(dtype).view(shape)


def attention_step(n: int, dtype: torch.dtype, gen: torch.Generator, huge: bool = False):
    """A function running one decode step's 30 attention calls at position n - 1 (caches on
    2 MB pages with ``huge``), and the bytes of K and V they read."""
    max_seq = n + 16
    half = HEAD_DIM // 2
    position = cpu.DecodePosition(torch.randn(max_seq, half, generator=gen),
                                  torch.randn(max_seq, half, generator=gen))  # fmt: skip
    calls = []
    for _ in range(N_LAYER):
        kc, vc = (torch.randn(N_KV, max_seq, HEAD_DIM, generator=gen).to(dtype) for _ in "kv")
        if huge:
            kc, vc = (huge_pages(t.shape, dtype).copy_(t) for t in (kc, vc))
        qkv = torch.randn((N_HEAD + 2 * N_KV) * HEAD_DIM, generator=gen)
        out = torch.empty(N_HEAD * HEAD_DIM)
        calls.append(cpu.attn_decode_plan(qkv, kc, vc, position, out, n_head=N_HEAD,
                                          n_kv=N_KV, neox=True))  # fmt: skip
    position.at(n - 1)

    def step() -> None:
        for call in calls:
            call()

    return step, N_LAYER * 2 * N_KV * n * HEAD_DIM * torch.empty((), dtype=dtype).element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    ap.add_argument("--kv-type", choices=sorted(KV_TYPES), default="f32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--huge", action="store_true", help="also caches on 2 MB pages, alternating")
    args = ap.parse_args()
    if not cpu.available():
        raise SystemExit(f"the C kernels are unavailable: {cpu.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    pages = ["4k", "2m"] if args.huge else ["4k"]
    steps = {(n, p): attention_step(n, KV_TYPES[args.kv_type], gen, p == "2m")
             for n in args.contexts for p in pages}  # fmt: skip
    if args.huge:
        rollup = open("/proc/self/smaps_rollup").read().splitlines()
        print(*[line for line in rollup if line.startswith("AnonHugePages")])
    print(f"{args.kv_type} cache, {args.threads} threads: attention ms a step (GB/s) | read pass")
    for r in range(args.rounds):
        cells = []
        for (n, p), (step, nbytes) in steps.items():
            step()
            best = float("inf")
            for _ in range(args.reps):
                t = time.perf_counter()
                step()
                best = min(best, time.perf_counter() - t)
            label = f"{n}/{p}" if args.huge else f"{n}"
            cells.append(f"{label}: {best * 1e3:.2f} ({nbytes / best / 1e9:.1f})")
        read = copy_bandwidth("cpu", threads=args.threads) / 1e9
        print(f"round {r}  " + "  ".join(cells) + f"  | read {read:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
