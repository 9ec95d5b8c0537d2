"""Command line: ``python -m qlib <command> ...``.

Each command lives in the module that does the work; that module exposes
``add_parser(subparsers)`` which registers its sub-command and sets ``func``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command modules, in the order `--help` lists them
COMMAND_MODULES = ("models_cli", "generate_cli", "bench", "convert", "suite")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m qlib",
        description="qlib: read, run, measure and convert quantized Llama models in GGUF files.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"qlib.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"qlib.{name}":
                continue  # command not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
