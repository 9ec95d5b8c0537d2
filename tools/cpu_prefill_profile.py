"""Where the CPU fast prefill's time goes (docs/performance.md, "Where the remaining time goes").

    python tools/cpu_prefill_profile.py [--model F] [--tokens 203] [--threads 2]
        [--int8 | --int8-attn]

``--int8`` (the default where the CPU has no AMX): the int8 prefill's parts, each over the
30 layers' real weights and buffers as ``FastModel._prefill_int8`` runs them (each GEMM's C
call, the RmsNorms, the attention with its RoPE + KV write, SwiGLU, the embedding rows, the
output GEMV of the last row; the FFN's GEMMs over ``mlp_rows`` rows at a time), min of 5, and
the whole prefill; the GEMMs' GOP/s are 2 x m x k x n x layers integer ops. ``--int8-attn``:
the same with the attention's products in int8 (``prefill="int8-attn"``).

0. The AMX layer kernel in place (``FastModel.prefill_phase_times``: the kernel's own clock,
   thread by thread): each phase's work and its wait at the barrier that closes it, summed
   over the layers, median of 20 prefills, beside the whole prefill's wall time.
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


def int8_parts(m, t: int, reps: int = 5, int8_attention: bool = False) -> None:
    c, layers = m.config, m.layers
    k, l0 = c.embedding_length, layers[0]
    n_ff, nd = l0.w13.out_features // 2, c.head_count * c.head_dim
    g = torch.Generator().manual_seed(0)
    h = torch.randn(t, k, generator=g)
    a = torch.empty(t, k)
    chunk = min(t, max(1, m.mlp_rows))  # the FFN's GEMMs run over chunks of rows
    bufs = {"wqkv": (torch.randn(t, k, generator=g), torch.empty(t, l0.wqkv.out_features)),
            "wo": (torch.randn(t, nd, generator=g), torch.zeros(t, k)),
            "w13": (torch.randn(t, k, generator=g), torch.empty(chunk, 2 * n_ff)),
            "w2": (torch.randn(t, n_ff, generator=g), torch.zeros(t, k))}  # fmt: skip
    rows: list[tuple[str, float, str]] = []
    for name, (x, out) in bufs.items():
        lins = [getattr(ly, name) for ly in layers]
        acc = name in ("wo", "w2")
        step = chunk if name in ("w13", "w2") else t

        def run(x=x, out=out, lins=lins, acc=acc, step=step):
            for lin in lins:
                for s0 in range(0, t, step):
                    n = min(step, t - s0)
                    dst = out[:n] if out.shape[0] < t else out[s0 : s0 + n]
                    lin.quantized_into(x[s0 : s0 + n], dst, accumulate=acc)

        ms = best_ms(run, reps)
        ops = 2 * t * lins[0].in_features * lins[0].out_features * len(layers)
        rows.append((f"{name} GEMM {lins[0].in_features}->{lins[0].out_features}", ms,
                     f"{ops / ms / 1e6:.0f} GOP/s"))  # fmt: skip
    eps = c.rms_norm_eps

    def norms():
        for ly in layers:
            cpu.add_rmsnorm(h, None, ly.attn_norm, eps, a)
            cpu.add_rmsnorm(h, None, ly.ffn_norm, eps, a)

    rows.append(("RmsNorm x2", best_ms(norms, reps), ""))
    qkv = torch.randn(t, l0.wqkv.out_features, generator=g)
    y = torch.empty(t, nd)
    m._grow_cache(t, 0)  # the cache holds what a forward of t tokens would make it hold

    def attention():
        for i in range(len(layers)):
            cpu.attn_prefill(qkv, m.cache[i, 0], m.cache[i, 1], 0, c.head_count, c.head_count_kv,
                             m.cos, m.sin, c.rope_is_neox, out=y, int8=int8_attention)  # fmt: skip

    ms = best_ms(attention, reps)
    flops = 4 * c.head_count * c.head_dim * t * t / 2 * len(layers)
    name = "RoPE + KV + attention" + (" (int8)" if int8_attention else "")
    rows.append((name, ms, f"{flops / ms / 1e6:.0f} GFLOP/s (causal)"))
    gu, gg = torch.randn(t, 2 * n_ff, generator=g), torch.empty(t, n_ff)
    rows.append(("SwiGLU", best_ms(lambda: [cpu.swiglu(gu, out=gg) for _ in layers], reps), ""))
    ids = torch.randint(0, m.tok_embd.shape[0], (1, t), generator=g)
    rows.append(("embedding rows", best_ms(lambda: m.embed(ids.reshape(-1)), reps), ""))
    x1 = torch.randn(1, k, generator=g)
    rows.append(("output GEMV (last row)", best_ms(lambda: m.output.quantized(x1), reps), ""))
    total = sum(ms for _, ms, _ in rows)
    for name, ms, rate in rows:
        print(f"  {name:28s} {ms:8.2f} ms  {100 * ms / total:5.1f}%  {rate}")
    print(f"  {'sum of the parts':28s} {total:8.2f} ms")

    def prefill():
        m.clear_kv_cache()
        m.forward(ids, 0)

    print(f"  {'whole prefill':28s} {best_ms(prefill, reps):8.2f} ms")


def in_place(m, t: int, reps: int = 20) -> None:
    ids = torch.randint(0, m.tok_embd.shape[0], (1, t), generator=torch.Generator().manual_seed(0))
    runs, walls = [], []
    for _ in range(reps + 2):
        m.clear_kv_cache()
        t0 = time.perf_counter()
        _, times = m.prefill_phase_times(ids)
        walls.append(time.perf_counter() - t0)
        runs.append(times)
    runs, walls = torch.stack(runs[2:]) * 1e3, walls[2:]  # [reps, threads, phases, 2], ms
    med = runs.median(dim=0).values

    def row(name: str, x: torch.Tensor) -> None:  # x: [threads, 2]
        cols = "  ".join(f"{x[i, 0]:8.2f} / {x[i, 1]:5.2f}   " for i in range(x.shape[0]))
        print(f"  {name:20s} {cols}")

    heads = "  ".join(f"thread {i} work / wait" for i in range(med.shape[0]))
    print(f"  {'phase':20s} {heads}   (ms a prefill, median of {reps})")
    for p, name in enumerate(cpu.PREFILL_PHASES):
        row(name, med[:, p])
    row("all layers", runs.sum(dim=2).median(dim=0).values)
    print(
        f"  whole prefill (wall): median {statistics.median(walls) * 1e3:.2f} ms, min "
        f"{min(walls) * 1e3:.2f}"
    )


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
    ap.add_argument("--int8", action="store_true", help="the int8 prefill's parts (no AMX)")
    ap.add_argument("--int8-attn", action="store_true", help="the int8-attn prefill's parts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(models.path())
    if args.int8 or args.int8_attn or not cpu.amx_available():
        prefill = "int8-attn" if args.int8_attn else "int8"
        m = engines.load(path, "cpu", engine="fast", prefill=prefill)[0]
        print(f"{path}, {args.tokens} tokens, {args.threads} threads, {prefill} prefill")
        with torch.inference_mode():
            int8_parts(m, args.tokens, 5 if args.tokens < 1000 else 2, args.int8_attn)
        return
    if not cpu.amx_available():
        raise SystemExit(f"AMX unavailable: {cpu.amx_unavailable_reason()}")
    m = engines.load(path, "cpu", engine="fast")[0]
    print(f"{path}, {args.tokens} tokens, {args.threads} threads")
    with torch.inference_mode():
        print("AMX layer kernel in place, by its own clock:")
        in_place(m, args.tokens)
        print("AMX layer kernel, parts alone:")
        parts(m, args.tokens)
        del m
        print("AMX vs oneDNN path, alternating in one process:")
        alternating(path, args.tokens)


if __name__ == "__main__":
    main()
