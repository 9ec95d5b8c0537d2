"""``python -m qlib generate`` and ``python -m qlib logits``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from . import models
from .engines import ENGINE_FORMS, FAST


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps (default: cpu)")
    p.add_argument(
        "--form",
        choices=ENGINE_FORMS,
        default=None,
        help="QMatMul form for every projection (default: candle's rule), or fast: the "
        "fast path of the device (qlib.fast on CPU, qlib.fast_cuda on CUDA)",
    )
    p.add_argument("--attention", choices=("auto", "naive", "sdpa"), default="auto")


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text and print the phase timings")
    _model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--steps", type=int, default=20, help="new tokens to generate (default 20)")
    g.add_argument("--temperature", type=float, default=None, help="default: greedy")
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=299792458)
    g.add_argument("--stop-at-eos", action="store_true")
    g.add_argument("--unbuffered", action="store_true", help="read the GGUF unbuffered")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=run_generate)

    lg = sub.add_parser("logits", help="teacher-forced logits of a text, every position, as .npy")
    _model_args(lg)
    lg.add_argument("--text-file", required=True, type=Path)
    lg.add_argument("--out", required=True, type=Path)
    lg.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens")
    lg.set_defaults(func=run_logits)


def _model_path(arg: str | None) -> Path:
    return Path(arg) if arg else models.path()


def _engine_kwargs(args: argparse.Namespace) -> dict:
    """``--attention`` belongs to the faithful path; the fast paths have their own attention."""
    return {} if args.form == FAST else {"attention": args.attention}


def run_generate(args: argparse.Namespace) -> int:
    from .generate import LogitsProcessor, generate_timed

    processor = LogitsProcessor(args.seed, args.temperature, args.top_k, args.top_p)
    result = generate_timed(
        _model_path(args.model),
        args.prompt,
        args.steps,
        device=args.device,
        form=args.form,
        chat=args.chat,
        processor=processor,
        stop_at_eos=args.stop_at_eos,
        buffered=not args.unbuffered,
        **_engine_kwargs(args),
    )
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    t = result.timings
    print(result.text)
    print(
        f"\nread {t.read_ms:.1f} ms | build {t.build_ms:.1f} ms | "
        f"prefill {len(result.prompt_ids)} tok {t.prefill_ms:.1f} ms | "
        f"decode {len(t.decode_ms)} steps {t.decode_ms_per_token:.2f} ms/token",
        file=sys.stderr,
    )
    return 0


def run_logits(args: argparse.Namespace) -> int:
    from .engines import load
    from .tokenizer import Tokenizer

    model, content = load(_model_path(args.model), args.device, args.form, **_engine_kwargs(args))
    tokenizer = Tokenizer.from_metadata(content.metadata)
    ids = tokenizer.encode(args.text_file.read_text(), add_special_tokens=False)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if not ids:
        print(f"{args.text_file}: no tokens", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids], device=model.device), 0, all_logits=True)
    logits = logits[0].float().cpu().numpy().astype(np.float32)
    elapsed = time.perf_counter() - start
    np.save(args.out, logits)
    print(
        f"{args.out}: logits {list(logits.shape)} for {len(ids)} tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0
