"""The f16 KV cache against the f32 one (SmolLM2 Q4_1, a fast engine): teacher-forced argmax
agreement and |logit diff| over the passage (decode steps: the C kernels on CPU, the fused
kernels on CUDA), a prefill of the passage repeated to N tokens (all logits, default 2048) and
64 decode steps after it.

``--q8`` adds an int8 cache, emulated: the float32 cache's new rows are rounded after each
forward call to what ggml's ``q8_0`` cache type would hold (blocks of 32 along the head
dimension, scale ``f16(amax / 127)``, codes ``round(x 127 / amax)``), so later calls read them
as an int8 cache dequantized exactly would. A row is rounded only after the call that wrote
it (its own step, or its prefill chunk, still sees it unrounded): an estimate of the drift
from below.

    python tools/kv_drift.py [N] [--device cuda] [--q8]
"""

import argparse

import torch

from qlib import models
from qlib.llama.checks import KV_TYPES
from qlib.llama.engine import load
from qlib.tokenizer import Tokenizer


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """``x`` (last dimension a multiple of 32) as ggml's q8_0 blocks hold it, dequantized."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(b * inv).clamp(-127, 127)  # (ggml: roundf, ties away from zero: no ties here)
    return (q * d.half().float()).reshape(x.shape).to(x.dtype)


def run(kv: str, n_long: int, device: str) -> tuple[torch.Tensor, ...]:
    q8 = kv == "q8_0"
    model, content = load(models.path(), device, engine="fast", kv_type="f32" if q8 else kv)
    if q8:  # each call's new rows rounded after it: [layers, 2, n_kv, positions, d]
        forward = model.forward

        def rounded(x, index_pos, **kw):
            out = forward(x, index_pos, **kw)
            rows = model.cache[:, :, :, index_pos : index_pos + x.shape[1]]
            rows.copy_(round_q8_0(rows))
            return out

        model.forward = rounded
    ids = Tokenizer.from_metadata(content.metadata).encode(
        models.data_file("passage.txt").read_text()
    )
    with torch.inference_mode():
        model.clear_kv_cache()  # decode steps over the passage, teacher forced
        out = [model.forward(torch.tensor([ids[:1]]), 0)]
        out += [model.forward(torch.tensor([[t]]), i) for i, t in enumerate(ids) if i]
        full = (ids * (n_long // len(ids) + 2))[: n_long + 64]
        model.clear_kv_cache()  # the passage repeated: prefill in chunks of 512, all logits
        pre = []
        for c in range(0, n_long, 512):
            chunk = full[c : min(c + 512, n_long)]
            pre.append(model.forward(torch.tensor([chunk]), c, all_logits=True)[0])
        steps = [model.forward(torch.tensor([[t]]), n_long + j)
                 for j, t in enumerate(full[n_long:])]  # fmt: skip
    return tuple(torch.cat(x).cpu() for x in (out, pre, steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n_long", nargs="?", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--q8", action="store_true", help="an emulated int8 (q8_0) cache too")
    args = parser.parse_args()
    torch.set_num_threads(2)
    n_long = args.n_long
    kinds = [*KV_TYPES, *(["q8_0"] if args.q8 else [])]
    f32, *others = (run(kv, n_long, args.device) for kv in kinds)
    names = (f"decode steps over the passage ({f32[0].shape[0]})",
             f"prefill of {n_long} (passage repeated)",
             f"64 decode steps after {n_long}")  # fmt: skip
    for kind, runs in zip(kinds[1:], others, strict=True):
        for name, b, a in zip(names, f32, runs, strict=True):
            same = a.argmax(-1) == b.argmax(-1)
            d = (a - b).abs()
            print(f"{kind} cache, {name}: argmax agreement {100 * same.float().mean():.2f}% "
                  f"({int(same.sum())}/{a.shape[0]}), mean |diff| {d.mean():.3f}, "
                  f"max |diff| {d.max():.3f}, logit scale {b.abs().max():.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
