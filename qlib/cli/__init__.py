"""The command line: ``python -m qlib <command> ...``.

Each command family has a module that exposes ``add_parser(subparsers)``, which registers
its sub-commands and sets ``func``. A bad input ends in a short message on stderr and a
non-zero exit: 2 for a bad argument (argparse), 1 for a file or call qlib refuses; a
traceback only with ``--traceback`` or ``QLIB_TRACEBACK=1``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

# command modules, in the order `--help` lists them
COMMAND_MODULES = (
    "cli.models", "cli.generate", "cli.chat", "cli.bench", "convert", "suite.cli", "cli.lab",
)  # fmt: skip


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument prints two lines (the error, where help is), not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m qlib",
        description="qlib: read, run, measure and convert quantized Llama models in GGUF files.",
    )
    parser.add_argument("--version", action="version", version=f"qlib {_version()}")
    parser.add_argument(
        "--traceback", action="store_true", help="show the Python traceback of an error"
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"qlib.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"qlib.{name}":
                continue  # command not built yet
            raise
        module.add_parser(sub)
    return parser


def _version() -> str:
    try:
        return version("qlib")
    except PackageNotFoundError:
        return "(not installed)"


def _message(exc: BaseException) -> str:
    """One line for the user: the error's own words (OSError: its strerror and file)."""
    if isinstance(exc, OSError) and exc.strerror:
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}"
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0] if text else type(exc).__name__


def _show_warning(command: str, message, category, *_args, **_kwargs) -> None:
    print(f"qlib {command}: warning: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    traceback = "--traceback" in argv or os.environ.get("QLIB_TRACEBACK", "") not in ("", "0")
    argv = [a for a in argv if a != "--traceback"]  # accepted anywhere on the line
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):  # only `lab` passes arguments on
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        with warnings.catch_warnings():
            if not traceback:  # a library warning as one line, not Python's file:line, source
                warnings.showwarning = functools.partial(_show_warning, args.command)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if traceback:
            raise
        known = isinstance(exc, (OSError, ValueError, RuntimeError, LookupError, ImportError))
        print(f"qlib {args.command}: error: {_message(exc)}", file=sys.stderr)
        if not known:
            print(f"({type(exc).__name__}; --traceback shows where)", file=sys.stderr)
        return 1
