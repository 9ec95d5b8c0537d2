"""A/B of the fast CUDA decode variants in one process (run on the GPU machine).

python tools/persistent_probe.py [--model PATH | --synthetic PATH [--synthetic-type Q8_0]]
    --variants V [V ...] [--prompt-tokens 203 [N ...]] [--steps 128] [--rounds 3]
    [--stage-times] [--json FILE]

A variant is ``fused``, ``merged`` or ``persistent``, optionally with ``PersistentDecoder``
options and (upper case) ``persistent.cu`` macros: ``persistent:kv_stage=0,OUT_PREFETCH=1``
(``kv=16``: a float16 KV cache, ``kv_type="f16"``; any decode). Every variant is loaded once;
then, for each prompt length in turn (``--json``: the results by length), each round runs them
one after the other (alternating): prefill the prompt, a greedy loop of ``--steps`` steps that
reads every token back to the host (the benchmark protocol's decode, ms/token: forward +
argmax, then ``qlib.generate.generate``, whose greedy steps take the argmax on the device), and
100 replays of the decode graph timed with CUDA events (GPU us per step). The greedy ids and the
first step's logits of every variant are compared with the first variant's. ``--synthetic
PATH`` writes a SmolLM2-shaped file (30 layers, 576 wide, 9 / 3 heads, Q4_1 matrices, a tied
Q8_0 embedding: the real file's types; ``--synthetic-type`` another type for the matrices) with
seeded random weights there first, in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from qlib.llama.engine import load
from qlib.quants.cuda.persistent import BLOCK_POINTS, MARKS


def parse_variant(spec: str) -> tuple[str, dict]:
    """``persistent:kv_stage=0,split=128`` -> (``persistent``, {kv_stage: 0, split: 128})."""
    decode, _, rest = spec.partition(":")
    options: dict = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key.isupper():  # a macro of persistent.cu
            options.setdefault("macros", {})[key] = int(value)
        else:
            options[key] = int(value)
    return decode, options


def write_synthetic(path: Path, weight_type: str = "Q4_1") -> Path:
    from tests.synthetic import write_tiny_llama

    if not path.exists():
        write_tiny_llama(path, n_layer=30, n_embd=576, n_head=9, n_kv_head=3, n_ff=1536,
                         vocab=49152, weight_type=weight_type,
                         weight_types={"token_embd.weight": "Q8_0"})  # fmt: skip
    return path


def greedy(model, prompt: torch.Tensor, steps: int) -> tuple[float, list[int], torch.Tensor]:
    """Prefill, then ``steps`` greedy steps each read back to the host: ms per step, the ids,
    the first step's logits."""
    model.clear_kv_cache()
    logits = model.forward(prompt, 0)
    token = int(logits[0].argmax())
    ids, pos, first = [token], prompt.shape[1], None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        logits = model.forward(torch.tensor([[token]], device="cuda"), pos)
        token = int(logits[0].argmax())
        first = logits[0].cpu() if first is None else first
        ids.append(token)
        pos += 1
    return (time.perf_counter() - start) * 1e3 / steps, ids, first


def generate_ms(model, prompt: torch.Tensor, steps: int) -> tuple[float, list[int]]:
    """``qlib.generate.generate`` (greedy: each step's argmax on the device where the engine
    offers it): decode ms per step, the ids."""
    from qlib.generate import Timings, generate

    timings = Timings()
    model.clear_kv_cache()
    ids = generate(model, prompt[0].tolist(), steps + 1, timings=timings)
    return timings.decode_ms_per_token, ids


def graph_us(model, n: int = 100, graph=None) -> float:
    """GPU us per replay of the decode graph, or of ``graph`` (the position advances; the
    cache past the greedy run's end is scratch)."""
    graph = graph or model._decode_graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def print_stage_times(model) -> None:
    """The persistent kernel's spans of the last step: summed over the layers, layer 0 against
    the median layer, every block's points of the middle layer, its values done by block kind."""
    spans = model._persistent.stage_times_ns()
    print("   ", "  ".join(f"{k} {v / 1e3:.0f}" for k, v in spans.items()))
    per_layer = model._persistent.layer_spans_ns() / 1e3
    rest = per_layer[1:].median(0).values
    print("    layer 0 against the median layer, us:", "  ".join(
        f"{k} {a:.2f}/{b:.2f}" for k, a, b in zip(
            MARKS, per_layer[0].tolist(), rest.tolist(), strict=True)))  # fmt: skip
    blocks = model._persistent.block_times_ns().double() / 1e3

    def spread(col: torch.Tensor) -> str:
        return f"{col.min():.1f} / {col.median():.1f} / {col.max():.1f} ({col.numel()})"

    cols = []
    for name, col in zip(BLOCK_POINTS, blocks.T, strict=True):
        seen = col[col != 0] if name != "residual in" else col
        if seen.numel():
            cols.append(f"{name} {spread(seen)}")
    print("    middle layer, us from block 0's residual (min / median / max, blocks):",
          "; ".join(cols))  # fmt: skip
    macros = model._persistent.macros
    mlp_first = macros["GRID"] - macros["MLP_BLOCKS"]
    done = blocks[:, BLOCK_POINTS.index("values done")]
    parts = []
    for name, sel in (("attention only", done[:mlp_first]), ("attention + MLP", done[mlp_first:])):
        sel = sel[sel != 0]
        if sel.numel():
            parts.append(f"{name} {spread(sel)}")
    print("    values done, by block kind:", "; ".join(parts))


def run_point(models: dict, prompt: torch.Tensor, steps: int, rounds: int,
              stage_times: bool) -> dict[str, dict[str, list]]:  # fmt: skip
    """``rounds`` rounds of every variant in turn after ``prompt``: ms/token, ``generate``
    ms/token and graph us a step per variant (one value a round)."""
    results: dict[str, dict[str, list]] = {
        s: {"ms_per_token": [], "generate_ms_per_token": [], "graph_us": []} for s in models
    }
    ids0 = logits0 = None
    for r in range(rounds):
        for spec, model in models.items():
            ms, ids, logits = greedy(model, prompt, steps)
            gen_ms, gen_ids = generate_ms(model, prompt, steps)
            us = graph_us(model)
            results[spec]["ms_per_token"].append(ms)
            results[spec]["generate_ms_per_token"].append(gen_ms)
            results[spec]["graph_us"].append(us)
            if ids0 is None:
                ids0, logits0 = ids, logits
            same = sum(a == b for a, b in zip(ids, ids0, strict=True))
            diff = float((logits - logits0).abs().max()) / float(logits0.abs().max())
            print(f"round {r} {spec:36s} {ms:.3f} ms/token (generate {gen_ms:.3f}, ids "
                  f"{'equal' if gen_ids == ids else 'DIFFER'})  graph {us:.1f} us/step  "
                  f"ids as the first variant's {same}/{len(ids)}, first step's logits "
                  f"{diff:.1e} of the scale", flush=True)  # fmt: skip
            if stage_times and model.decode == "persistent":
                print_stage_times(model)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--synthetic", type=Path)
    ap.add_argument("--synthetic-type", default="Q4_1", help="the synthetic file's layer type")
    ap.add_argument("--variants", nargs="+", default=["fused", "persistent"])
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[203],
        help="prompt lengths, each measured in turn with the variants loaded once",
    )
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stage-times", action="store_true", help="persistent: spans of a step")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (args.model or args.synthetic):
        ap.error("give --model PATH or --synthetic PATH")
    path = args.model or write_synthetic(args.synthetic, args.synthetic_type)
    # positions: the longest prompt, the greedy steps, then 101 graph replays past them
    max_seq_len = max(4096, max(args.prompt_tokens) + args.steps + 128)
    models = {}
    for spec in args.variants:
        decode, options = parse_variant(spec)
        kv_type = "f16" if options.pop("kv", 32) == 16 else "f32"
        if args.stage_times and decode == "persistent":
            options["stage_times"] = 1
        t0 = time.perf_counter()
        models[spec], _ = load(path, "cuda", engine="fast", decode=decode, kv_type=kv_type,
                               max_seq_len=max_seq_len, decode_options=options or None)  # fmt: skip
        print(f"{spec}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    every = {}
    with torch.inference_mode():
        for n in args.prompt_tokens:
            print(f"\n{n} prompt tokens", flush=True)
            prompt = torch.randint(100, 40000, (1, n), generator=gen).cuda()
            every[n] = run_point(models, prompt, args.steps, args.rounds, args.stage_times)
    for n, results in every.items():
        print(f"\n{n} prompt tokens; variant: forward + argmax ms/token, generate ms/token, "
              "graph us/step: min / median")  # fmt: skip
        for spec, res in results.items():
            print(f"{spec:40s}", "   ".join(
                f"{min(v):.3f} / {statistics.median(v):.3f}" for v in res.values()))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({str(n): r for n, r in every.items()}, indent=1))


if __name__ == "__main__":
    main()
