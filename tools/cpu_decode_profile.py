"""Where a CPU fast decode step's time goes, against its bytes (docs/performance.md, "A decode
step by its calls").

    python tools/cpu_decode_profile.py [--model F] [--context 256 1024 ...] [--threads 2]
        [--rounds 8] [--kv-type f32|f16]

At each context N (the passage's tokens repeated to N, prefilled once), ``--rounds`` decode
steps at position N, each twice: as the engine runs it (``forward``: ``decode_mode`` "region",
one C call, one parallel region), then its chain with the steps' times kept by the region
itself (``FastModel.decode_step_times``), the steps of one kind summed over the layers: the
RmsNorm + qkv GEMV, the RoPE + KV write + attention, wo, RmsNorm + gate/up, SwiGLU + down, and
the output layer. Min over the rounds. Beside each kind the bytes it reads (packed
weights; the KV cache over N positions) and their GB/s, and notebook 03's read-only pass
(``copy_bandwidth``: 512 MiB on 2 MB pages, the weights' pages) as this minute's memory rate,
so the step's floor is of this run.
"""

from __future__ import annotations

import argparse
import time

import torch

from qlib import models
from qlib.llama import engine as engines
from qlib.suite.experiments.common import copy_bandwidth
from qlib.suite.experiments.throughput import passage_ids
from qlib.tokenizer import Tokenizer

KINDS = ("qkv", "attention", "wo", "gate/up", "down")


def step_bytes(m, n: int) -> dict[str, float]:
    """Bytes each kind of call reads in one step at context ``n`` (all layers)."""
    c = m.config
    kv = 2 * c.head_count_kv * n * c.head_dim * m.cache.element_size()  # K and V rows
    out = {kind: 0.0 for kind in (*KINDS, "output")}
    for ly in m.layers:
        out["qkv"] += ly.wqkv.nbytes()
        out["attention"] += kv
        out["wo"] += ly.wo.nbytes()
        out["gate/up"] += ly.w13.nbytes()
        out["down"] += ly.w2.nbytes()
    out["output"] = m.output.nbytes()
    return out


def profile(m, ids: torch.Tensor, rounds: int) -> tuple[float, dict[str, float]]:
    """Min over ``rounds`` decode steps at position ``n`` (after one prefill of ``ids``, each
    step writes the same cache row again) of the step as ``forward`` runs it (ms), and of each
    kind's time in the same step run with its region's clock (``decode_step_times``)."""
    n = ids.shape[1]
    tok = ids[:, -1:]
    m.decode_mode = "region"
    kinds = [*KINDS, "output"]
    whole, parts = float("inf"), dict.fromkeys(kinds, float("inf"))
    m.forward(ids, 0)
    for _ in range(rounds):
        m._kv_len = n  # position n again
        t0 = time.perf_counter()
        m.forward(tok, n)
        whole = min(whole, (time.perf_counter() - t0) * 1e3)
        sums = dict.fromkeys(kinds, 0.0)
        for call, seconds in m.decode_step_times(tok, n)[1]:
            kind = "output" if call >= len(KINDS) * len(m.layers) else KINDS[call % len(KINDS)]
            sums[kind] += seconds * 1e3
        parts = {k: min(parts[k], sums[k]) for k in kinds}
    return whole, parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--context", type=int, nargs="+", default=[256, 1024, 2800])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--kv-type", default="f32", choices=["f32", "f16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or models.path()
    m, content = engines.load(path, "cpu", engine="fast", kv_type=args.kv_type)
    if not hasattr(m, "decode_step_times") or m._plan is None:
        raise SystemExit("this model has no C decode step (the fast CPU engine's kernels)")
    tokenizer = Tokenizer.from_metadata(content.metadata)

    rate = copy_bandwidth("cpu", threads=args.threads)
    print(f"{path}, {args.threads} threads, {args.kv_type} KV; read pass {rate / 1e9:.1f} GB/s")
    for n in args.context:
        ids = torch.tensor([passage_ids(tokenizer, n)])
        with torch.inference_mode():
            whole, parts = profile(m, ids, args.rounds)
        nbytes = step_bytes(m, n)
        total_bytes = sum(nbytes.values())
        print(f"\ncontext {n}: step (one region) {whole:.2f} ms; the floor "
              f"{total_bytes / rate * 1e3:.2f} ms ({total_bytes / 1e6:.1f} MB at the read pass's "
              f"rate): {whole / (total_bytes / rate * 1e3):.2f}x")  # fmt: skip
        for kind, ms in parts.items():
            gbs = nbytes[kind] / ms / 1e6 if ms else 0.0
            print(f"  {kind:10s} {ms:7.3f} ms  {nbytes[kind] / 1e6:7.1f} MB  {gbs:6.1f} GB/s")
        print(f"  {'sum':10s} {sum(parts.values()):7.3f} ms (the region's steps; the rest of the "
              f"step: the embedding row, the call, the logits' tensor)")  # fmt: skip


if __name__ == "__main__":
    main()
