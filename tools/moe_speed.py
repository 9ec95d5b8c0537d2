"""Decode speed of a Mixtral-style mixture of experts: a synthetic file (random seeded weights,
``tests/synthetic.write_tiny_moe``; no tokenizer needed) or a given one, on each engine named,
rounds alternating in one process, llama.cpp beside them where it is installed (CPU).

    python tools/moe_speed.py [--model PATH | --out PATH --type Q8_0 --layers 8 --hidden 512
        --ff 1024 --experts 8 --used 2] [--device cpu|cuda] [--engines fast,faithful]
        [--steps 32] [--rounds 2] [--llama-cpp] [--torch-routing]

Per round and engine: a 32-token prompt, then ``--steps`` greedy steps; ms a token, min and
median of the steps, and how many leading greedy ids agree with the first engine's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from synthetic import write_tiny_moe  # noqa: E402

from qlib.gguf import GGUFValueType, Typed  # noqa: E402
from qlib.llama.engine import load  # noqa: E402

PROMPT = list(range(1, 33))


def same_prefix(a: list[int], b: list[int]) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return f"{n} of {len(a)}"


def decode_ms(model, steps: int, sync) -> tuple[float, float, list[int]]:
    model.clear_kv_cache()
    model.forward(torch.tensor([PROMPT]), 0)
    tok, times, ids = 5, [], []
    for i in range(steps):
        t = time.perf_counter()
        if hasattr(model, "greedy_step"):
            tok = model.greedy_step(tok, len(PROMPT) + i)
        else:  # the faithful engine
            tok = int(model.forward(torch.tensor([[tok]]), len(PROMPT) + i).argmax())
        sync()
        times.append(time.perf_counter() - t)
        ids.append(tok)
    return min(times) * 1e3, statistics.median(times) * 1e3, ids


def llama_cpp_ms(path: Path, steps: int, threads: int) -> tuple[float, float, list[int]]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(str(path), n_ctx=512, n_threads=threads, logits_all=True, verbose=False)
    try:
        llm.eval(PROMPT)
        tok, times, ids = 5, [], []
        for _ in range(steps):
            t = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            times.append(time.perf_counter() - t)
            ids.append(tok)
    finally:
        llm.close()
    return min(times) * 1e3, statistics.median(times) * 1e3, ids


def torch_routing(path: Path, device: str):
    """The fast engine with each layer's routing in torch, as before the routing in C (CPU)
    or on the device (CUDA, then without CUDA graphs)."""
    from qlib.llama import fast_cpu

    if device.startswith("cuda"):
        model, _ = load(path, device, engine="fast")
        for layer in model.layers:
            layer.expert_stacks = None
        model.graphs = False
        return model
    real = fast_cpu.cpu.moe_decode_plan
    fast_cpu.cpu.moe_decode_plan = lambda *a, **k: None
    try:
        return load(path, device, engine="fast")[0]
    finally:
        fast_cpu.cpu.moe_decode_plan = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a mixture-of-experts GGUF (else synthetic)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe_speed.gguf"))
    ap.add_argument("--type", default="Q8_0")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--used", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engines", default="fast,faithful")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", action="store_true", help="time llama.cpp too (CPU)")
    ap.add_argument("--torch-routing", action="store_true",
                    help="also the fast engine with the routing in torch (the A/B)")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        extra = {"tokenizer.ggml.model": "none",
                 "llama.vocab_size": Typed(GGUFValueType.UINT32, args.vocab),
                 "llama.context_length": Typed(GGUFValueType.UINT32, 512)}  # fmt: skip
        path, _ = write_tiny_moe(args.out, weight_type=args.type, n_expert=args.experts,
                                 n_expert_used=args.used, n_layer=args.layers,
                                 n_embd=args.hidden, n_head=args.hidden // 64,
                                 n_kv_head=max(1, args.hidden // 128), n_ff=args.ff,
                                 vocab=args.vocab, extra_metadata=extra)  # fmt: skip
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    models = {}
    for name in args.engines.split(","):
        models[name], _ = load(path, args.device, engine=name)
        print(name, getattr(models[name], "decode_note", ""))
    if args.torch_routing:
        models["fast/torch"] = torch_routing(path, args.device)
    first_ids = None
    for r in range(args.rounds):
        order = list(models.items())
        for name, model in order if r % 2 == 0 else reversed(order):
            lo, med, ids = decode_ms(model, args.steps, sync)
            first_ids = first_ids or ids
            print(f"round {r} {name:9s} {lo:8.3f} / {med:8.3f} ms/token, "
                  f"leading ids as the first engine's: {same_prefix(ids, first_ids)}")  # fmt: skip
        if args.llama_cpp:
            lo, med, ids = llama_cpp_ms(path, args.steps, args.threads)
            print(f"round {r} llama.cpp {lo:8.3f} / {med:8.3f} ms/token, "
                  f"leading ids as the first engine's: {same_prefix(ids, first_ids)}")  # fmt: skip


if __name__ == "__main__":
    main()
