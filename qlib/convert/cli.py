"""``python -m qlib convert`` and ``python -m qlib quantize``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .recipes import PLAIN_TYPES, RECIPES

TYPES_HELP = f"a type ({', '.join(PLAIN_TYPES)}) or a recipe ({', '.join(RECIPES)})"


def _is_gguf(path: Path) -> bool:
    if path.is_dir():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def convert(
    inp: str | os.PathLike,
    out: str | os.PathLike,
    to: str | None = None,
    spec: str | None = None,
    *,
    permute_qk: bool = True,
    metadata: bool = True,
    drop_keys: tuple[str, ...] = (),
    pre: str | None = None,
    log=print,
):
    """GGUF -> safetensors folder, safetensors folder -> GGUF, or GGUF -> GGUF.

    ``to`` defaults from ``out`` (``*.gguf``: gguf, else safetensors); ``spec`` is
    the GGUF type or recipe (default F32), or the safetensors dtype (F32, BF16, F16).
    """
    from .to_gguf import hf_to_gguf, quantize_gguf
    from .to_hf import gguf_to_hf

    inp, out = Path(inp), Path(out)
    if not inp.exists():
        raise FileNotFoundError(f"--in {inp}: no such file or folder")
    to = (to or ("gguf" if out.suffix == ".gguf" else "safetensors")).lower()
    if to == "safetensors":
        if not _is_gguf(inp):
            raise ValueError(f"--to safetensors needs a GGUF file as --in, got {inp}")
        if not metadata or drop_keys:
            raise ValueError("--no-metadata / --drop-key apply to GGUF outputs")
        return gguf_to_hf(inp, out, dtype=spec or "F32", permute=permute_qk, log=log)
    if to != "gguf":
        raise ValueError(f"--to must be safetensors or gguf, not {to!r}")
    if _is_gguf(inp):
        if not permute_qk:
            raise ValueError("--no-permute applies to safetensors -> GGUF (GGUF rows are permuted)")
        return quantize_gguf(
            inp, out, spec or "F32", metadata=metadata, drop_keys=drop_keys, log=log
        )
    return hf_to_gguf(
        inp, out, spec or "F32", permute_qk=permute_qk, metadata=metadata,
        drop_keys=drop_keys, pre=pre, log=log,
    )  # fmt: skip


def _failure_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-metadata", action="store_true", help="write only tensors, no metadata")
    p.add_argument(
        "--drop-key", action="append", default=[], metavar="KEY",
        help="leave KEY out of the metadata (repeatable), e.g. llama.rope.freq_base",
    )  # fmt: skip


def _run_convert(a: argparse.Namespace) -> int:
    convert(
        a.inp, a.out, a.to, a.type, permute_qk=not a.no_permute, metadata=not a.no_metadata,
        drop_keys=tuple(a.drop_key), pre=a.pre,
    )  # fmt: skip
    return 0


def parse_size(text: str) -> int:
    """``"2G"``, ``"500M"``, ``"64K"``, ``"1.5G"`` or a count of bytes -> bytes (powers of 1000, as
    llama.cpp's ``--split-max-size``)."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    t = text.strip().upper().removesuffix("B")
    scale = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale != 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2G, 500M)") from None
    if not value > 0 or value * scale != value * scale:  # (NaN)
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return int(value * scale)


def _run_quantize(a: argparse.Namespace) -> int:
    from .to_gguf import quantize_gguf

    quantize_gguf(
        a.inp, a.out, a.type, metadata=not a.no_metadata, drop_keys=tuple(a.drop_key),
        split_max_bytes=a.split_max_size, log=print,
    )  # fmt: skip
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "convert",
        help="GGUF <-> safetensors folder (names, q/k permutation, types, metadata)",
        description="GGUF -> transformers folder, or transformers folder (or GGUF) -> GGUF.",
    )
    c.add_argument(
        "--in",
        dest="inp",
        required=True,
        metavar="PATH",
        help="a GGUF file or a transformers folder with model.safetensors",
    )
    c.add_argument("--out", required=True, metavar="PATH", help="output GGUF file or folder")
    c.add_argument(
        "--to",
        choices=("safetensors", "gguf"),
        help="output kind (default: gguf when --out ends in .gguf)",
    )
    c.add_argument(
        "--type",
        metavar="TYPE",
        help=f"GGUF: {TYPES_HELP}; safetensors: F32, BF16 or F16 (default F32)",
    )
    c.add_argument(
        "--no-permute",
        action="store_true",
        help="skip the q/k row permutation (the output computes nonsense)",
    )
    c.add_argument(
        "--pre",
        metavar="NAME",
        help="tokenizer.ggml.pre to write (default: detected from tokenizer.json)",
    )
    _failure_options(c)
    c.set_defaults(func=_run_convert)

    q = sub.add_parser(
        "quantize",
        help="re-quantize a GGUF file to a type or recipe",
        description="Dequantize every tensor and quantize it to the type the type or recipe "
        "picks (K-quants fall back to 32-block types where rows are not divisible by 256).",
    )
    q.add_argument("--in", dest="inp", required=True, metavar="GGUF")
    q.add_argument("--out", required=True, metavar="GGUF")
    q.add_argument("--type", required=True, metavar="TYPE", help=TYPES_HELP)
    q.add_argument(
        "--split-max-size", type=parse_size, default=None, metavar="SIZE",
        help="write files of at most SIZE of tensor data each (2G, 500M: powers of 1000), named "
        "OUT-00001-of-0000N.gguf ... as llama.cpp's gguf-split does, where one would hold more",
    )  # fmt: skip
    _failure_options(q)
    q.set_defaults(func=_run_quantize)
