"""``python -m qlib bench``: the benchmark protocol (``qlib.suite.bench``) from the command line."""

from __future__ import annotations

import argparse
import json

from .. import models
from ..suite.bench import (
    PROMPT_TOKENS,
    REPS,
    RUNTIMES,
    STEPS,
    peer_configs,
    protocol_argv,
    run_config,
    run_in_subprocess,
)
from .common import (
    add_engine_args,
    add_model_args,
    existing_file,
    positive_int,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="prefill / decode speed with the benchmark protocol (docs/design.md)"
    )
    add_model_args(p)
    p.add_argument(
        "--prompt-file", type=existing_file, default=None, help="default: data/passage.txt"
    )
    p.add_argument("--prompt-tokens", type=positive_int, default=PROMPT_TOKENS)
    p.add_argument("--steps", type=positive_int, default=STEPS, help="greedy decode steps")
    p.add_argument("--reps", type=positive_int, default=REPS, help="timed runs")

    add_engine_args(p)
    p.add_argument(
        "--prefill",
        default=None,
        choices=("bf16", "int8", "f32", "packed"),
        help="--engine fast: prefill matmuls (CPU: bf16 (default) or int8; CUDA: f32 (default) "
        "or packed)",
    )
    p.add_argument(
        "--runtime",
        default="qlib",
        choices=sorted(RUNTIMES),
        help="what runs the model: qlib (default), or a peer (transformers, llama.cpp)",
    )
    p.add_argument(
        "--dtype", default="f32", choices=("f32", "bf16", "f16"), help="transformers dtype"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run transformers and llama.cpp, each in its own process",
    )
    p.set_defaults(func=main)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{' '.join(r['argv'])}: FAILED {r['error']}"
    variant = "fast" if r.get("engine") == "fast" else r.get("form") or r.get("dtype", "")
    name = f"{r['runtime']} {variant}".rstrip()
    if r.get("prefill"):
        name += f" ({r['prefill']} prefill)"
    return (
        f"{name:<24} prefill {r['prefill_ms']['min']:8.1f} ms (median "
        f"{r['prefill_ms']['median']:.1f})  decode {r['decode_ms_per_token']['min']:7.2f} "
        f"ms/token (median {r['decode_ms_per_token']['median']:.2f})  "
        f"first run {r['first_run']['prefill_ms']:.1f} / "
        f"{r['first_run']['decode_ms_per_token']:.2f}  peak RSS {r['peak_rss_mb']:.0f} MB  "
        f"load {r['load_ms']:.0f} ms"
    )


def main(args: argparse.Namespace) -> int:
    args.model = args.model or models.path()
    args.prompt_file = args.prompt_file or models.data_file("passage.txt")
    if not args.peers:
        result = run_config(args)
        print(json.dumps(result) if args.json else _line(result))
        return 0
    own = protocol_argv(args)
    for flag, value in (
        ("--engine", args.engine),
        ("--form", args.form),
        ("--attention", args.attention),
        ("--prefill", args.prefill),
    ):
        if value:
            own += [flag, value]
    results = [run_in_subprocess(own)] + [run_in_subprocess(c) for c in peer_configs(args)]
    ours = results[0]
    ratios = {}
    for peer in results[1:]:
        if "error" in peer or "error" in ours:
            continue
        ratios[peer["runtime"]] = {
            "prefill": ours["prefill_ms"]["min"] / peer["prefill_ms"]["min"],
            "decode": ours["decode_ms_per_token"]["min"] / peer["decode_ms_per_token"]["min"],
            "peak_rss": ours["peak_rss_mb"] / peer["peak_rss_mb"],
        }
    if args.json:
        print(json.dumps({"qlib": ours, "peers": results[1:], "ratios": ratios}))
        return 0
    for r in results:
        print(_line(r))
    for peer, r in ratios.items():
        print(
            f"qlib / {peer}: prefill x{r['prefill']:.2f}, decode x{r['decode']:.2f}, "
            f"peak RSS x{r['peak_rss']:.2f} (below 1 = qlib faster / smaller)"
        )
    return 0
