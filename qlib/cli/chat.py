"""``python -m qlib chat``: talk to a model in the terminal (the loop around ``qlib.chat.Chat``)."""

from __future__ import annotations

import argparse
import sys

from .. import models
from .common import (
    add_engine_args,
    add_model_args,
    add_seed_arg,
    engine_options,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)

COMMANDS = {
    "/exit": "leave (also /quit, Ctrl-D, or Ctrl-C at the prompt)",
    "/reset": "forget the conversation and clear the KV cache",
    "/help": "this list",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="talk to the model with its chat template; the KV cache is kept between turns",
        description="An interactive conversation using the GGUF file's chat template. Each "
        "turn feeds only its new tokens (the KV cache holds the conversation so far). "
        "Commands: /exit (or Ctrl-D) leaves, /reset clears the history and the cache; "
        "Ctrl-C stops a reply and keeps the conversation, Ctrl-C at the prompt leaves. "
        "Reads lines from stdin, so it can be scripted: printf 'hello\\n/exit\\n' | "
        "python -m qlib chat",
    )
    add_model_args(p)
    add_engine_args(p)
    p.add_argument(
        "-n",
        "--max-new-tokens",
        type=positive_int,
        default=256,
        help="most new tokens per reply (default: 256); a reply also stops at EOS",
    )
    p.add_argument(
        "--system", default=None, help="system message (default: the template's own, if it has one)"
    )
    p.add_argument(
        "--temperature",
        type=non_negative_float,
        default=None,
        help="sampling temperature (default: unset = greedy; 0 is greedy too)",
    )
    p.add_argument(
        "--top-k",
        type=non_negative_int,
        default=None,
        help="sample from the k most likely tokens (default: unset = all)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=None,
        help="nucleus sampling, in (0, 1] (default: unset = 1)",
    )
    add_seed_arg(p, "the sampling seed (default: %(default)s); greedy replies do not depend on it")
    p.set_defaults(func=run_chat)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_chat(args: argparse.Namespace) -> int:
    from ..chat import INTERRUPTED, MAX_NEW_TOKENS, POSITION_LIMIT, Chat
    from ..generate import LogitsProcessor
    from ..llama.engine import load
    from ..tokenizer import Tokenizer
    from .common import apply_seed_and_threads

    apply_seed_and_threads(args)
    path = args.model or models.path()
    model, content = load(
        path, args.device, engine=args.engine, form=args.form, **engine_options(args)
    )
    tokenizer = Tokenizer.from_metadata(content.metadata)
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: no tokenizer.chat_template in the file: qlib chat needs one")
    processor = LogitsProcessor(args.seed, args.temperature, args.top_k, args.top_p)
    chat = Chat(
        model, tokenizer, processor=processor, max_new_tokens=args.max_new_tokens,
        system=args.system,
    )  # fmt: skip
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        _say(
            f"qlib chat: {path.name}, {chat.max_positions} positions; /exit or Ctrl-D "
            "leaves, /reset clears the history, Ctrl-C stops a reply"
        )
    prompt = "> " if interactive else ""
    while True:
        try:
            line = input(prompt)
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            chat.reset()
            _say("(history and KV cache cleared)")
            continue
        if text == "/help":
            _say("\n".join(f"{k:<8} {v}" for k, v in COMMANDS.items()))
            continue
        if text.startswith("/") and " " not in text:
            _say(f"unknown command {text} (/help lists them)")
            continue
        try:
            reply = chat.send(text)
        except ValueError as e:
            _say(f"error: {e}")
            continue
        if chat.notice:
            _say(f"({chat.notice})")
        try:
            for piece in reply:
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C while the text was being written
            reply.close()
        print(flush=True)
        if chat.stop_reason == INTERRUPTED:
            _say("(reply stopped)")
        elif chat.stop_reason == POSITION_LIMIT:
            _say(
                f"(the conversation filled the {chat.max_positions} positions: the next "
                "message starts a new one)"
            )
        elif chat.stop_reason == MAX_NEW_TOKENS and interactive:
            _say(f"(stopped at {chat.max_new_tokens} new tokens: -n sets the limit)")
