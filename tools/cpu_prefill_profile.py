"""Where the CPU fast prefill's time goes (docs/performance.md, "Where the remaining time goes").

    python tools/cpu_prefill_profile.py [--model F] [--tokens 203] [--threads 2]

1. The AMX layer kernel's parts alone, over the model's real weights: each GEMM
   (``cpu.amx_gemm``'s C entry on the weights of all layers, as the model holds them:
   4/8-bit codes expanded in the GEMM, or bf16 tiles), the attention,
   the output GEMV, the embedding rows, and the whole prefill (min of 10).
2. The AMX path and the oneDNN path (``amx=False``) alternating in one process:
   a prefill after the other model ran, and a prefill after 64 decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qlib import models
from qlib.llama import engine as engines
from qlib.quants import cpu


def best_ms(f, n: int = 10) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def parts(m, t: int) -> None:
    lib, c = cpu.load(), m.config
    k, l0 = c.embedding_length, m.layers[0]
    n_ff, nd = l0.w13.out_features // 2, l0.wo.in_features
    bf = torch.bfloat16
    inputs = {w: torch.randn(t + 32, w).to(bf) for w in {k, nd, n_ff}}
    total = 0.0
    for name, kk, epi, width in (("wqkv", k, 0, l0.wqkv.out_features), ("wo", nd, 1, k),
                                 ("w13", k, 2, n_ff), ("w2", n_ff, 1, k)):  # fmt: skip
        n = getattr(l0, name).out_features
        out = torch.zeros(t, width) if epi == 1 else torch.empty(t, width, dtype=bf)
        a = inputs[kk]

        ws = [getattr(ly, name).amx.c_struct() for ly in m.layers]

        def run(kk=kk, n=n, epi=epi, out=out, a=a, width=width, ws=ws):
            for w in ws:
                lib.qlib_amx_gemm(a.data_ptr(), t, kk, w.kind, w.t, w.d, w.m, n, epi,
                                  out.data_ptr(), width)  # fmt: skip

        ms = best_ms(run)
        total += ms
        flops = 2 * t * kk * n * len(m.layers)
        print(f"  {name:5s} GEMM x{len(m.layers)}: {ms:6.2f} ms  {flops / ms / 1e9:.2f} TFLOP/s")
    print(f"  the four GEMMs: {total:.2f} ms")
    qkv = torch.randn(t, l0.wqkv.out_features).to(bf)
    y = torch.empty(t, nd, dtype=bf)

    def attention():
        for i in range(len(m.layers)):
            cpu.attn_prefill(qkv, m.cache[i, 0], m.cache[i, 1], 0, c.head_count, c.head_count_kv,
                             m.cos, m.sin, c.rope_is_neox, out=y, amx=True)  # fmt: skip

    print(f"  attention x{len(m.layers)}: {best_ms(attention):.2f} ms")
    ids = torch.randint(0, m.tok_embd.shape[0], (1, t))
    x1 = torch.randn(1, k)
    print(f"  output GEMV (last row): {best_ms(lambda: m.output.quantized(x1)):.2f} ms")
    print(f"  embedding rows: {best_ms(lambda: m.embed(ids)):.2f} ms")

    def prefill():
        m.clear_kv_cache()
        m.forward(ids, 0)

    print(f"  whole prefill: {best_ms(prefill):.2f} ms")


def alternating(path: str, t: int, reps: int = 8) -> None:
    ms = {"amx": engines.load(path, "cpu", engine="fast")[0],
          "oneDNN": engines.load(path, "cpu", engine="fast", amx=False)[0]}  # fmt: skip
    ids = torch.randint(0, ms["amx"].tok_embd.shape[0], (1, t))
    res: dict[str, list[float]] = {}
    for _ in range(reps):
        for name, m in ms.items():
            for when in ("after the other model", "after 64 decode steps"):
                if when.startswith("after 64"):
                    logits, pos = m.forward(ids, 0), t
                    for _ in range(64):
                        logits = m.forward(torch.tensor([[int(logits.argmax())]]), pos)
                        pos += 1
                m.clear_kv_cache()
                t0 = time.perf_counter()
                m.forward(ids, 0)
                res.setdefault(f"{name}, {when}", []).append((time.perf_counter() - t0) * 1e3)
    for key, v in res.items():
        print(f"  {key:36s} min {min(v):6.1f}  median {statistics.median(v):6.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=203)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(models.path())
    if not cpu.amx_available():
        raise SystemExit(f"AMX unavailable: {cpu.amx_unavailable_reason()}")
    m = engines.load(path, "cpu", engine="fast")[0]
    print(f"{path}, {args.tokens} tokens, {args.threads} threads")
    print("AMX layer kernel, parts alone:")
    with torch.inference_mode():
        parts(m, args.tokens)
        del m
        print("AMX vs oneDNN path, alternating in one process:")
        alternating(path, args.tokens)


if __name__ == "__main__":
    main()
