"""The CPU fast engine's int8 attention (``prefill="int8-attn"``) against its float32 attention
(``prefill="int8"``), both against the f32 form (SmolLM2 Q4_1, the passage repeated to N
tokens, all logits of one prefill): argmax agreement, |logit diff|, and the prefill's time,
the two engines alternating in one process (min of the rounds).

    python tools/prefill_drift.py [N] [--kv-type f16] [--rounds 3]
"""

import argparse
import time

import torch

from qlib import models
from qlib.llama.engine import load
from qlib.suite.bench import prompt_ids
from qlib.tokenizer import Tokenizer


def compare(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    same = a.argmax(-1) == b.argmax(-1)
    d = (a - b).abs()
    print(f"{name}: argmax agreement {100 * same.float().mean():.2f}% "
          f"({int(same.sum())}/{a.shape[0]}), mean |diff| {d.mean():.4f}, "
          f"max |diff| {d.max():.3f}, logit scale {b.abs().max():.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", nargs="?", type=int, default=2800)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = models.path()
    engines = {mode: load(path, "cpu", engine="fast", prefill=mode, kv_type=args.kv_type)[0]
               for mode in ("int8", "int8-attn")}  # fmt: skip
    ref, content = load(path, "cpu", form="f32")
    encode = Tokenizer.from_metadata(content.metadata).encode
    ids = torch.tensor([prompt_ids(encode, args.n, models.data_file("passage.txt"), repeat=True)])
    with torch.inference_mode():
        ref.clear_kv_cache()
        f32 = ref.forward(ids, 0, all_logits=True)[0]
        logits, best = {}, {}
        for _ in range(args.rounds):
            for mode, model in engines.items():
                model.clear_kv_cache()
                t0 = time.perf_counter()
                logits[mode] = model.forward(ids, 0, all_logits=True)[0]
                best[mode] = min(best.get(mode, 1e9), time.perf_counter() - t0)
        chunked = engines["int8-attn"]
        chunked.clear_kv_cache()
        parts = [chunked.forward(ids[:, c : c + 512], c, all_logits=True)[0]
                 for c in range(0, args.n, 512)]  # fmt: skip
    print(f"prefill of {args.n} tokens, {args.kv_type} cache, all logits, min of {args.rounds}: "
          f"int8 {best['int8'] * 1e3:.0f} ms, int8-attn {best['int8-attn'] * 1e3:.0f} ms "
          f"({best['int8-attn'] / best['int8']:.2f}x)")  # fmt: skip
    compare("int8 (float32 attention) vs the f32 form", logits["int8"], f32)
    compare("int8-attn vs the f32 form", logits["int8-attn"], f32)
    compare("int8-attn vs int8", logits["int8-attn"], logits["int8"])
    print(
        f"int8-attn chunks of 512 equal the whole prefill: "
        f"{torch.equal(torch.cat(parts), logits['int8-attn'])}"
    )


if __name__ == "__main__":
    main()
