"""The f16 KV cache against the f32 one (SmolLM2 Q4_1, a fast engine): teacher-forced argmax
agreement and |logit diff| over the passage (decode steps: the C kernels on CPU, the fused
kernels on CUDA), a prefill of the passage repeated to N tokens (all logits, default 2048) and
64 decode steps after it.

    python tools/kv_drift.py [N] [--device cuda]
"""

import argparse

import torch

from qlib import models
from qlib.llama.checks import KV_TYPES
from qlib.llama.engine import load
from qlib.tokenizer import Tokenizer


def run(kv: str, n_long: int, device: str) -> tuple[torch.Tensor, ...]:
    model, content = load(models.path(), device, engine="fast", kv_type=kv)
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
    args = parser.parse_args()
    torch.set_num_threads(2)
    n_long = args.n_long
    f32, f16 = (run(kv, n_long, args.device) for kv in KV_TYPES)
    names = (f"decode steps over the passage ({f32[0].shape[0]})",
             f"prefill of {n_long} (passage repeated)",
             f"64 decode steps after {n_long}")  # fmt: skip
    for name, b, a in zip(names, f32, f16, strict=True):
        same = a.argmax(-1) == b.argmax(-1)
        d = (a - b).abs()
        print(f"{name}: argmax agreement {100 * same.float().mean():.2f}% "
              f"({int(same.sum())}/{a.shape[0]}), mean |diff| {d.mean():.3f}, "
              f"max |diff| {d.max():.3f}, logit scale {b.abs().max():.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
