"""Notebook 1: the phases of generating a few tokens (seed: "generate one token").

One *round* does what the seed's program does from opening the file on: read
the GGUF header (here twice, through an unbuffered and a buffered file), build
the model, prefill the prompt at position 0, then decode ``steps`` tokens
greedily, one ``forward`` per token, each ending with the argmax read back to
the host. Several rounds run in one process, so the first round (cold
allocator, kernels, caches) can be told apart from the later ones.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ...generate import Timings, generate
from ...gguf import Content
from ...llama.engine import load

PHASES = ("read_unbuffered_ms", "read_buffered_ms", "build_ms", "prefill_ms", "decode_ms")


class CountingFile(io.RawIOBase):
    """A read-only file wrapper that counts the ``read``/``readinto`` calls made on it."""

    def __init__(self, f: BinaryIO):
        super().__init__()
        self.f = f
        self.reads = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.f.fileno()

    def read(self, n: int = -1) -> bytes:
        self.reads += 1
        return self.f.read(n)

    def readinto(self, b) -> int:
        self.reads += 1
        return self.f.readinto(b)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()


def header_reads(path: str | Path) -> dict:
    """How many reads ``Content.read`` issues, and how many bytes the header spans.

    Unbuffered, every one of those reads is a system call; a buffered file
    turns them into a few large ones.
    """
    with open(path, "rb", buffering=0) as raw:
        counting = CountingFile(raw)
        content = Content.read(counting)
    return {
        "reads": counting.reads,
        "header_bytes": content.tensor_data_offset,
        "metadata_keys": len(content.metadata),
        "tensors": len(content.tensor_infos),
        "bytes_per_read": content.tensor_data_offset / max(counting.reads, 1),
    }


def read_header(path: str | Path, buffered: bool) -> tuple[Content, float]:
    """``Content.read`` through a buffered or an unbuffered file: (content, ms)."""
    start = time.perf_counter()
    with open(path, "rb", buffering=-1 if buffered else 0) as f:
        content = Content.read(f)
    return content, (time.perf_counter() - start) * 1e3


@dataclass
class Round:
    """One round's phase times (ms) and generated ids."""

    device: str
    round: int
    read_unbuffered_ms: float
    read_buffered_ms: float
    build_ms: float
    timings: Timings
    ids: list[int] = field(default_factory=list)

    def row(self) -> dict:
        """One table row: the phases, decode total and mean, and the total."""
        decode = self.timings.decode_ms
        return {
            "device": self.device,
            "round": self.round,
            "read_unbuffered_ms": self.read_unbuffered_ms,
            "read_buffered_ms": self.read_buffered_ms,
            "build_ms": self.build_ms,
            "prefill_ms": self.timings.prefill_ms,
            "decode_steps": len(decode),
            "decode_total_ms": sum(decode),
            "decode_mean_ms": self.timings.decode_ms_per_token,
            "first_decode_ms": decode[0] if decode else float("nan"),
            "generate_ms": self.timings.prefill_ms + sum(decode),
        }


def run_round(
    path: str | Path,
    prompt_ids: list[int],
    steps: int = 20,
    *,
    device: str = "cpu",
    form: str | None = None,
    round_index: int = 1,
) -> Round:
    """Read (unbuffered, then buffered), build, prefill and decode ``steps`` tokens.

    The model is built from the buffered read, as a program would
    (``engine.load``: its ``read_ms`` and synchronized ``build_ms``). Decode
    steps are greedy and do not stop at EOS, so every round times the same
    number of steps.
    """
    _, unbuffered_ms = read_header(path, buffered=False)
    times: dict[str, float] = {}
    model, _ = load(path, device, engine="faithful", form=form, times=times)
    timings = Timings()
    ids = generate(model, prompt_ids, steps + 1, timings=timings)  # prefill + steps
    return Round(
        device, round_index, unbuffered_ms, times["read_ms"], times["build_ms"], timings, ids
    )


def run_rounds(
    path: str | Path,
    prompt_ids: list[int],
    steps: int = 20,
    rounds: int = 3,
    *,
    device: str = "cpu",
    form: str | None = None,
) -> list[Round]:
    """``rounds`` rounds in this process, the first one first."""
    return [
        run_round(path, prompt_ids, steps, device=device, form=form, round_index=i + 1)
        for i in range(rounds)
    ]


def step_rows(rounds: list[Round]) -> list[dict]:
    """One row per decode step: device, round, step (1-based), ms."""
    return [
        {"device": r.device, "round": r.round, "step": i + 1, "ms": ms}
        for r in rounds
        for i, ms in enumerate(r.timings.decode_ms)
    ]


def first_vs_later(rows: list[dict], phase: str) -> dict:
    """``phase`` in round 1 against the mean of the later rounds (per device rows)."""
    first = [r[phase] for r in rows if r["round"] == 1]
    later = [r[phase] for r in rows if r["round"] > 1]
    f = first[0] if first else float("nan")
    mean_later = sum(later) / len(later) if later else float("nan")
    return {"first": f, "later": mean_later, "ratio": f / mean_later if later else float("nan")}


def text_agreement(rounds: list[Round]) -> dict:
    """Do the rounds of each device agree, and where does each device first differ from the CPU?

    Returns ``same_within_device`` (every device's rounds generated the same
    ids) and ``first_difference``: device -> index of the first generated
    token that differs from the first CPU round (None: identical).
    """
    by_device: dict[str, list[list[int]]] = {}
    for r in rounds:
        by_device.setdefault(r.device, []).append(r.ids)
    same = all(all(ids == runs[0] for ids in runs) for runs in by_device.values())
    ref = by_device.get("cpu", next(iter(by_device.values()), [[]]))[0]
    diff = {}
    for dev, runs in by_device.items():
        ids = runs[0]
        diff[dev] = next(
            (i for i, (a, b) in enumerate(zip(ids, ref, strict=False)) if a != b),
            None if len(ids) == len(ref) else min(len(ids), len(ref)),
        )
    return {"same_within_device": same, "first_difference": diff}
