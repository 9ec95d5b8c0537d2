"""Generation: sampling (candle's LogitsProcessor) and a timed generation loop.

``generate_timed`` times the phases the seed's "generate one token" chapter
measures: read the GGUF header, build the model, prefill, and every decode
step. Each step ends by reading the chosen token id back to the host, so on a
GPU the time includes the work actually finishing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .devices import DeviceLike


def greedy_id(logits: torch.Tensor) -> int:
    """The argmax of a logits vector (any shape, flattened; the first of equal maxima, NaN
    the largest, as ``torch.argmax``), read back to the host. A float32 vector on the CPU goes
    through numpy: torch's argmax took ~90 us for SmolLM2's 49,152 logits on the 2-core VM,
    numpy's ~5 (2% of a 4 ms decode step)."""
    flat = logits.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        return int(flat.numpy().argmax())
    return int(flat.argmax())


class LogitsProcessor:
    """Greedy (temperature None or <= 0), or sampling with temperature, top-k and top-p.

    As candle's ``LogitsProcessor``: top-k keeps the k most likely tokens, top-p
    the smallest set whose probability reaches p, both applied to the
    temperature-scaled softmax; the random stream is seeded, so a seed gives
    the same tokens on every run.
    """

    def __init__(
        self,
        seed: int = 299792458,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
    ):
        if top_k is not None and top_k <= 0:
            raise ValueError(f"top_k must be positive, got {top_k}")
        if top_p is not None and not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.temperature is None or self.temperature <= 0

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token id from a 1-D logits vector (reads it back to the host)."""
        if self.greedy:
            return greedy_id(logits)
        logits = logits.reshape(-1)
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_k is not None and self.top_k < probs.numel():
            kth = torch.topk(probs, self.top_k).values[-1]
            probs = torch.where(probs < kth, 0.0, probs)
        if self.top_p is not None and self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, 0)
            # keep tokens until the cumulative probability first reaches top_p
            drop = cumulative - sorted_probs >= self.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


@dataclass
class Timings:
    """Milliseconds per phase of one generation."""

    read_ms: float = 0.0
    build_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: list[float] = field(default_factory=list)

    @property
    def decode_ms_per_token(self) -> float:
        return sum(self.decode_ms) / len(self.decode_ms) if self.decode_ms else float("nan")

    def as_dict(self) -> dict:
        return {
            "read_ms": self.read_ms,
            "build_ms": self.build_ms,
            "prefill_ms": self.prefill_ms,
            "decode_ms": list(self.decode_ms),
            "decode_ms_per_token": self.decode_ms_per_token,
        }


def generate(
    model,
    prompt_ids: list[int],
    steps: int,
    processor: LogitsProcessor | None = None,
    *,
    eos_token_id: int | None = None,
    timings: Timings | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Prefill ``prompt_ids`` at position 0, then decode until ``steps`` new tokens.

    Stops early at ``eos_token_id`` when one is given (the EOS id is kept).
    Step times go into ``timings`` when given: the prefill (which yields the
    first new token) and each later decode step. Greedy decoding on an engine
    that offers it (``GreedyOnDevice``: the fast engines) takes each step's argmax
    there and hands back only the id (on CUDA the logits stay on the device).
    """
    from .llama.engine import GreedyOnDevice

    if not prompt_ids:
        raise ValueError("the prompt is empty: nothing to prefill")
    if steps <= 0:
        return []
    processor = processor or LogitsProcessor()
    on_device = processor.greedy and isinstance(model, GreedyOnDevice)
    timings = timings if timings is not None else Timings()
    device = model.device
    new_ids: list[int] = []
    inputs, index_pos = list(prompt_ids), 0
    with torch.inference_mode():
        for step in range(steps):
            start = time.perf_counter()
            if on_device and step > 0:
                token = model.greedy_step(inputs[0], index_pos)  # (the id read back)
            else:
                x = torch.tensor([inputs], dtype=torch.long, device=device)
                logits = model.forward(x, index_pos)
                token = processor.sample(logits[0])  # host read-back: the GPU work is done
            elapsed = (time.perf_counter() - start) * 1e3
            if step == 0:
                timings.prefill_ms = elapsed
            else:
                timings.decode_ms.append(elapsed)
            index_pos += len(inputs)
            new_ids.append(token)
            if on_token is not None:
                on_token(token)
            if eos_token_id is not None and token == eos_token_id:
                break
            inputs = [token]
    return new_ids


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]
    text: str
    timings: Timings

    def as_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "ids": self.ids,
            "text": self.text,
            "timings": self.timings.as_dict(),
        }


def generate_timed(
    path: str | Path,
    prompt: str,
    steps: int,
    *,
    device: DeviceLike = "cpu",
    engine: str | None = None,
    form: str | None = None,
    chat: bool = False,
    processor: LogitsProcessor | None = None,
    stop_at_eos: bool = False,
    buffered: bool = True,
    on_token: Callable[[int], None] | None = None,
    **model_kwargs,
) -> GenerationResult:
    """Read, build and generate from ``path``, timing each phase.

    ``buffered=False`` opens the file unbuffered, as the seed's Rust program
    does (one system call per read).
    """
    from .llama.engine import load
    from .tokenizer import Tokenizer

    timings = Timings()
    times: dict[str, float] = {}
    model, content = load(
        path, device, engine=engine, form=form, buffered=buffered, times=times, **model_kwargs
    )
    timings.read_ms, timings.build_ms = times["read_ms"], times["build_ms"]
    tokenizer = Tokenizer.from_metadata(content.metadata)
    text = tokenizer.chat_prompt(prompt) if chat else prompt
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    ids = generate(
        model,
        prompt_ids,
        steps,
        processor,
        eos_token_id=tokenizer.eos_token_id if stop_at_eos else None,
        timings=timings,
        on_token=on_token,
    )
    return GenerationResult(prompt_ids, ids, tokenizer.decode(ids), timings)
