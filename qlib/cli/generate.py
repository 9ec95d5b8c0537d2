"""``python -m qlib generate`` and ``python -m qlib logits``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .. import models
from .common import (
    add_engine_args,
    add_model_args,
    add_seed_arg,
    apply_seed_and_threads,
    check_position_limit,
    engine_options,
    existing_file,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)


def _model_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_engine_args(p)


def add_parser(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text and print the phase timings",
        description="Prefill the prompt, then decode: -n N new tokens are the one the prefill "
        "yields and N-1 decode steps. The text streams to a terminal as it comes; the timings "
        "go to stderr (--json: one JSON object on stdout instead).",
    )
    _model_args(g)
    g.add_argument("-p", "--prompt", required=True, type=non_empty, help="the prompt text")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument(
        "-n",
        "--steps",
        type=positive_int,
        default=20,
        help="new tokens to generate: 1 from the prefill + N-1 decode steps (default: 20)",
    )
    g.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="sampling temperature (default: unset = greedy; 0 is greedy too)",
    )
    g.add_argument(
        "--top-k",
        type=non_negative_int,
        default=None,
        help="sample from the k most likely tokens (default: unset = all)",
    )
    g.add_argument(
        "--top-p",
        type=probability,
        default=None,
        help="nucleus sampling, in (0, 1] (default: unset = 1)",
    )
    add_seed_arg(g, "sampling seed, also seeds torch (default: %(default)s); greedy ignores it")
    g.add_argument("--stop-at-eos", action="store_true", help="stop at the EOS token")
    g.add_argument("--unbuffered", action="store_true", help="read the GGUF unbuffered")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=run_generate)

    lg = sub.add_parser("logits", help="teacher-forced logits of a text, every position, as .npy")
    _model_args(lg)
    lg.add_argument(
        "--text-file", required=True, type=existing_file, help="the text (no special tokens added)"
    )
    lg.add_argument(
        "--out", required=True, type=Path, help="the .npy file to write: float32 (tokens, vocab)"
    )
    lg.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="use only the first N tokens (default: all)",
    )
    add_seed_arg(
        lg, "seeds torch (default: %(default)s); the logits are deterministic, nothing is sampled"
    )
    lg.set_defaults(func=run_logits)


def _model_path(arg: str | None) -> Path:
    return Path(arg) if arg else models.path()


def preflight(path: Path, prompt: str, chat: bool, steps: int, engine: str | None,
              form: str | None, max_seq_len: int | None = None) -> None:  # fmt: skip
    """Check, before the model loads, the file's llama metadata and that the prompt plus the
    new tokens fit the chosen engine's position limit."""
    from ..gguf import Content
    from ..llama.config import LlamaConfig
    from ..tokenizer import Tokenizer

    metadata = Content.read_path(path).metadata
    LlamaConfig.from_metadata(metadata)
    tokenizer = Tokenizer.from_metadata(metadata)
    n = len(tokenizer.encode(tokenizer.chat_prompt(prompt) if chat else prompt,
                             add_special_tokens=False))  # fmt: skip
    check_position_limit(metadata, engine, form, n + steps,
                         f"the prompt ({n} tokens) and {steps} new tokens",
                         "shorten the prompt or lower --steps", max_seq_len)  # fmt: skip


class _Stream:
    """Print the text of the tokens generated so far, as they come (a terminal only)."""

    def __init__(self, path: Path):
        from ..tokenizer import Tokenizer

        self.tokenizer = Tokenizer.from_gguf(path)
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # whole characters
            sys.stdout.write(text[len(self.shown) :])
            sys.stdout.flush()
            self.shown = text


def run_generate(args: argparse.Namespace) -> int:
    from ..generate import LogitsProcessor, generate_timed

    path = _model_path(args.model)
    preflight(path, args.prompt, args.chat, args.steps, args.engine, args.form,
              args.max_seq_len)  # fmt: skip
    apply_seed_and_threads(args)
    stream = _Stream(path) if sys.stdout.isatty() and not args.json else None
    processor = LogitsProcessor(args.seed, args.temperature, args.top_k, args.top_p)
    result = generate_timed(
        path,
        args.prompt,
        args.steps,
        device=args.device,
        engine=args.engine,
        form=args.form,
        chat=args.chat,
        processor=processor,
        stop_at_eos=args.stop_at_eos,
        buffered=not args.unbuffered,
        on_token=stream,
        **engine_options(args),
    )
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    if stream is None:
        print(result.text)
    else:
        print(result.text[len(stream.shown) :])
    print(summary(result), file=sys.stderr)
    return 0


def summary(result) -> str:
    """The stderr line: new tokens = the prefill's one + the decode steps, and their speeds."""
    t, n_prompt, steps = result.timings, len(result.prompt_ids), len(result.timings.decode_ms)
    plural = "" if steps == 1 else "s"
    decode = (
        f"decode {steps} step{plural} {t.decode_ms_per_token:.2f} ms/token "
        f"({1e3 / t.decode_ms_per_token:.1f} tok/s)"
        if steps
        else "no decode step"
    )
    return (
        f"\n{len(result.ids)} new tokens (1 from the prefill + {steps} decode step{plural}) | "
        f"read {t.read_ms:.1f} ms | build {t.build_ms:.1f} ms | "
        f"prefill {n_prompt} prompt tokens {t.prefill_ms:.1f} ms "
        f"({n_prompt / t.prefill_ms * 1e3:.1f} tok/s) | {decode}"
    )


def run_logits(args: argparse.Namespace) -> int:
    from ..llama.engine import load
    from ..tokenizer import Tokenizer

    apply_seed_and_threads(args)
    model, content = load(
        _model_path(args.model),
        args.device,
        engine=args.engine,
        form=args.form,
        **engine_options(args),
    )
    tokenizer = Tokenizer.from_metadata(content.metadata)
    ids = tokenizer.encode(args.text_file.read_text(), add_special_tokens=False)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    if not ids:
        raise ValueError(f"{args.text_file}: no tokens in the text")
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
