"""Arguments and helpers every command shares."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..llama.engine import ENGINES, FAST, resolve
from ..llama.errors import ModelError
from ..quants.qtensor import FORMS

# -- argument types: a bad value ends in argparse's one-line usage error, before any work


def at_least(lo: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``lo``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            bound = "0 or more" if lo == 0 else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def positive_ints(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, each once (``256,1024``)."""
    try:
        values = [positive_int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"a value repeats in {text!r}")
    return values


def thread_count(text: str) -> int:
    """An argparse type: CPU threads, 1 up to the CPUs this process may run on (more would
    only share them: slower, and no longer the measurement asked for)."""
    value = positive_int(text)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cpus and value > cpus:
        raise argparse.ArgumentTypeError(
            f"must be at most {cpus} (this machine's CPUs), got {value}"
        )
    return value


thread_count.__name__ = "int"


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def existing_file(text: str) -> Path:
    if not text.strip():  # (Path("") is ".", a directory)
        raise argparse.ArgumentTypeError("must not be empty")
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text}: not a file (a directory?)")
    return path


def available_device(text: str) -> str:
    """A torch device name that exists and is available on this machine."""
    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (cpu, cuda, mps)") from None
    if dev.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"qlib runs on cpu, cuda or mps, not {text!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: MPS is not available on this machine")
    return text


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``-m/--model``, ``--device`` and ``-t/--threads``, the same in every command."""
    p.add_argument(
        "-m",
        "--model",
        type=existing_file,
        default=None,
        help="GGUF file (default: the embedded SmolLM2)",
    )
    p.add_argument(
        "--device", type=available_device, default="cpu", help="cpu, cuda or mps (default: cpu)"
    )
    p.add_argument("-t", "--threads", type=thread_count, default=None,
                   help="CPU threads (default: torch's, one per core)")  # fmt: skip


DEFAULT_SEED = 299792458  # LogitsProcessor's, as candle's examples


def add_seed_arg(p: argparse.ArgumentParser, help: str) -> None:
    """``-s/--seed``: seeds torch (and the sampler, where the command samples)."""
    p.add_argument("-s", "--seed", type=int, default=DEFAULT_SEED, help=help)


def apply_seed_and_threads(args: argparse.Namespace) -> None:
    """Seed torch with ``--seed`` and set its CPU threads from ``--threads``, before any work."""
    if getattr(args, "seed", None) is not None:
        torch.manual_seed(args.seed)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """``--engine``, ``--form`` and ``--attention``, the same in every command."""
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="faithful: candle's quantized_llama as it is (default); fast: the device's fast "
        "engine (qlib.llama.fast_cpu on CPU, qlib.llama.fast_cuda on CUDA)",
    )
    p.add_argument(
        "--form",
        choices=(*FORMS, FAST),
        default=None,
        help="how the faithful engine's projections multiply (default: candle's rule); "
        "'fast' is the old spelling of --engine fast",
    )
    p.add_argument(
        "--attention",
        choices=("auto", "naive", "sdpa"),
        default=None,
        help="the faithful engine's attention (default: auto, as candle)",
    )
    p.add_argument(
        "--kv-type",
        choices=("f32", "f16"),
        default=None,
        help="--engine fast (CPU and CUDA): the KV cache's element type (default: f32; f16 "
        "halves the bytes each decode step reads at long context)",
    )
    p.add_argument(
        "--max-seq-len",
        type=at_least(1),
        default=None,
        metavar="N",
        help="--engine fast: the positions its KV cache can hold (default: the file's "
        "llama.context_length; the CUDA engine allocates them all at load, so a long-context "
        "file may need fewer)",
    )
    p.add_argument(
        "--decode",
        choices=("auto", "fused", "merged", "persistent"),
        default=None,
        help="--engine fast on CUDA: auto (default: persistent where it was measured faster, "
        "i.e. a Hopper GPU and a model up to 768 wide; else fused), six fused "
        "kernels per layer, five (merged: the attention's combine in the output projection's "
        "kernel, the heads' shares summed with float atomics) or the whole decode step in one "
        "persistent kernel",
    )


def check_position_limit(metadata: dict, engine: str | None, form: str | None, need: int,
                         what: str, fix: str, max_seq_len: int | None = None) -> None:  # fmt: skip
    """``need`` positions (``what``, e.g. "the prompt (N tokens) and S new tokens") fit the
    engine chosen for a file with ``metadata``, else ``ValueError`` saying how to fit: the
    faithful engine holds candle's RoPE table (``MAX_SEQ_LEN``), the fast engines the file's
    ``llama.context_length`` (or ``max_seq_len``, ``--max-seq-len``)."""
    from ..llama.checks import context_length
    from ..llama.config import MAX_SEQ_LEN

    held = context_length(metadata)
    fast = resolve(engine, form)[0] == FAST
    limit = (max_seq_len or held) if fast else MAX_SEQ_LEN
    if need <= limit:
        return
    whose = ("--max-seq-len" if max_seq_len else "the file's context length") if fast else \
        "the faithful engine's, candle's RoPE table"  # fmt: skip
    other = f"; --engine fast holds the file's {held}" if not fast and held > limit else ""
    raise ValueError(f"{what} pass the position limit ({limit}: {whose}){other}: {fix}")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the command line gave (``--attention``: the faithful engine's;
    ``--kv-type``, ``--decode``, ``--max-seq-len``: the fast engines')."""
    options = {} if args.attention is None else {"attention": args.attention}
    if getattr(args, "kv_type", None):
        if resolve(args.engine, args.form)[0] != FAST:
            raise ModelError("--kv-type sizes the fast engine's KV cache: add --engine fast")
        options["kv_type"] = args.kv_type
    if getattr(args, "decode", None):
        if resolve(args.engine, args.form)[0] != FAST:
            raise ModelError("--decode picks the fast CUDA engine's decode: add --engine fast")
        options["decode"] = args.decode
    if getattr(args, "max_seq_len", None):
        if resolve(args.engine, args.form)[0] != FAST:
            raise ModelError("--max-seq-len sizes the fast engine's KV cache: add --engine fast")
        options["max_seq_len"] = args.max_seq_len
    return options
