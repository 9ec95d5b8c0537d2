"""Sweep the launch configurations of the fused decode kernels on SmolLM2's shapes (GPU machine).

python tools/gpu_tune.py [--out DIR]: each kernel, each config, microseconds per call replayed
in a CUDA graph (triton.testing.do_bench_cudagraph); the best per shape is printed last.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

from qlib import models
from qlib.llama.engine import load
from qlib.quants.cuda import fused


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--pos", type=int, default=330)
    args = ap.parse_args()
    model, _ = load(models.path(), "cuda", engine="fast")
    ly, c = model.layers[0], model.config
    dev = "cuda"
    h = torch.randn(1, c.embedding_length, device=dev)
    g = torch.randn(ly.w13.out_features // 2, device=dev)
    att = torch.randn(c.head_count * c.head_dim, device=dev)
    q = torch.randn(c.head_count * c.head_dim, device=dev)
    kc, vc = model.cache[0, 0], model.cache[0, 1]
    kc.normal_()
    vc.normal_()
    pos = torch.tensor([args.pos], dtype=torch.int32, device=dev)
    logits = torch.empty(1, model.output.n, device=dev)
    eps = c.rms_norm_eps
    gemv_grid = list(itertools.product((2, 4, 8, 16), (8, 16, 32), (1, 2, 4)))
    cases = {
        "wo (add)": (
            gemv_grid,
            lambda bn, ng, w: fused.norm_gemv(
                att, ly.wo.parts[0], h, epilogue=fused.EPI_ADD, bn=bn, ng=ng, num_warps=w
            ),
        ),
        "w13 (swiglu)": (
            gemv_grid,
            lambda bn, ng, w: fused.norm_gemv(
                h,
                ly.w13.parts[0],
                g,
                norm=ly.ffn_norm,
                eps=eps,
                epilogue=fused.EPI_SWIGLU,
                bn=bn,
                ng=ng,
                num_warps=w,
            ),
        ),
        "w2 (add)": (
            gemv_grid,
            lambda bn, ng, w: fused.norm_gemv(
                g, ly.w2.parts[0], h, epilogue=fused.EPI_ADD, bn=bn, ng=ng, num_warps=w
            ),
        ),
        "output": (
            list(itertools.product((8, 16, 32, 64), (8, 16, 32), (2, 4, 8))),
            lambda bn, ng, w: fused.norm_gemv(
                h, model.output, logits, norm=model.norm, eps=eps, bn=bn, ng=ng, num_warps=w
            ),
        ),
        "qkv_rope": (
            gemv_grid,
            lambda bn, ng, w: fused.qkv_rope(
                h,
                ly.attn_norm,
                eps,
                ly.wqkv.parts[0],
                q,
                kc,
                vc,
                pos,
                model.cos,
                model.sin,
                heads=model.heads,
                neox=c.rope_is_neox,
                bp=bn,
                ng=ng,
                num_warps=w,
            ),
        ),
        "attn single": (
            list(itertools.product((32, 64, 128, 256), (0,), (2, 4, 8))),
            lambda bl, _, w: fused.attn_decode(
                q, kc, vc, att, pos, heads=model.heads, bl=bl, num_warps=w
            ),
        ),
    }
    for bl in (32, 64, 128):
        split = fused.SplitAttention(model.heads, model.max_seq_len, dev, bl=bl)
        cases[f"attn split bl={bl}"] = (
            list(itertools.product((0,), (8, 16, 64), (1, 2, 4))),
            lambda _, nsb, w, split=split: split(q, kc, vc, att, pos, num_warps=w, nsb=nsb),
        )
    results = {}
    for name, (grid, fn) in cases.items():
        rows = []
        for cfg in grid:
            try:
                fn(*cfg)
                torch.cuda.synchronize()
                us = do_bench_cudagraph(lambda cfg=cfg, fn=fn: fn(*cfg), rep=20) * 1e3
            except Exception as e:  # noqa: BLE001 (a config that does not compile)
                us = float("nan")
                print(name, cfg, "failed:", str(e).splitlines()[0][:120])
            rows.append((cfg, us))
        rows.sort(key=lambda r: (r[1] != r[1], r[1]))
        results[name] = rows
        print(
            f"{name}: best {rows[0][0]} {rows[0][1]:.2f} us; next "
            + ", ".join(f"{c} {u:.2f}" for c, u in rows[1:5]),
            flush=True,
        )
    (args.out / "gpu_tune.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
