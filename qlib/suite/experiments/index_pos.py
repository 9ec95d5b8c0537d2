"""Notebook 4: what a wrong ``index_pos`` does (seed: quantized llama forward, "index_pos").

``forward(x, index_pos)`` trusts the caller: ``index_pos`` picks the RoPE rows,
sizes the causal mask (``kv_len = index_pos + seq_len``) and, when 0, drops the
KV cache. Nothing checks it against what the cache holds. The functions here
run the seed's misuses and return plain rows for the notebook's tables.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ...llama.faithful import ModelWeights
from .common import next_token, restore_kv, snapshot_kv


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


# decode-time index_pos as a function of the correct one
DECODE_VARIANTS: dict[str, Callable[[int], int]] = {
    "correct": lambda pos: pos,
    "+100": lambda pos: pos + 100,
    "-3": lambda pos: pos - 3,
    "always 0": lambda pos: 0,
}


def decode_with(
    model: ModelWeights, prompt_ids: list[int], steps: int, wrong: Callable[[int], int]
) -> list[int]:
    """Prefill correctly at 0, then pass ``wrong(pos)`` instead of pos at every decode step."""
    model.clear_kv_cache()
    token = next_token(model, prompt_ids, 0)
    ids, pos = [token], len(prompt_ids)
    for _ in range(steps - 1):
        token = next_token(model, [token], wrong(pos))
        ids.append(token)
        pos += 1
    return ids


def repetition(ids: list[int]) -> float:
    """Share of generated tokens that repeat an earlier one (1 - distinct / total)."""
    return 1.0 - len(set(ids)) / len(ids) if ids else 0.0


def longest_run(ids: list[int]) -> int:
    """Length of the longest run of one token repeated back to back."""
    best = run = 0
    for i, t in enumerate(ids):
        run = run + 1 if i and t == ids[i - 1] else 1
        best = max(best, run)
    return best


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (None: equal up to the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def text_stats(ids: list[int]) -> dict[str, Any]:
    """Degeneration measures of a generated id sequence."""
    return {
        "tokens": len(ids),
        "distinct_tokens": len(set(ids)),
        "repetition": repetition(ids),
        "longest_run": longest_run(ids),
    }


def decode_variants(
    model: ModelWeights, tok: Decoder, prompt_ids: list[int], steps: int
) -> list[dict]:
    """One row per variant: text, degeneration measures, agreement with the correct run."""
    rows: list[dict] = []
    correct: list[int] | None = None
    for name, fn in DECODE_VARIANTS.items():
        ids = decode_with(model, prompt_ids, steps, fn)
        if correct is None:
            correct = ids
        first = first_difference(ids, correct)
        rows.append(
            {
                "variant": name,
                "text": tok.decode(ids),
                **text_stats(ids),
                "agrees_with_correct_for": len(ids) if first is None else first,
                "identical_to_correct": ids == correct,
                "ids": ids,
            }
        )
    return rows


def attempt(fn: Callable[[], object]) -> dict:
    """Run ``fn``; return ``{"ok": True, "value": ...}`` or the error type and message."""
    try:
        return {"ok": True, "value": fn(), "error": ""}
    except Exception as e:  # the experiment records the error text itself
        return {"ok": False, "value": None, "error": f"{type(e).__name__}: {e}"}


@contextmanager
def strict_mode(model: ModelWeights, strict: bool = True) -> Iterator[ModelWeights]:
    """Temporarily switch the model's ``strict`` index_pos check on (or off)."""
    before = model.strict
    model.strict = strict
    try:
        yield model
    finally:
        model.strict = before


def chunked_prefill(
    model: ModelWeights,
    tok: Decoder,
    prompt_ids: list[int],
    split: int,
    index_pos: int,
    *,
    strict: bool = False,
) -> dict:
    """Prefill ``prompt_ids[:split]`` at 0, then the rest at ``index_pos`` (correct: split).

    The row gives the mask's kv_len (``index_pos + len(chunk 2)``) beside the
    cache's real length after the cat (``split + len(chunk 2)``).
    """
    second = len(prompt_ids) - split
    if not 0 < split < len(prompt_ids):
        raise ValueError(f"split {split} must cut the {len(prompt_ids)}-token prompt in two")
    with strict_mode(model, strict):
        model.clear_kv_cache()
        next_token(model, prompt_ids[:split], 0)
        r = attempt(lambda: next_token(model, prompt_ids[split:], index_pos))
    return {
        "first_chunk": split,
        "second_chunk": second,
        "index_pos": index_pos,
        "correct_index_pos": split,
        "strict": strict,
        "mask_kv_len": index_pos + second,
        "cache_kv_len": split + second,
        "ok": r["ok"],
        "next_token": tok.decode([r["value"]]) if r["ok"] else "",
        "error": r["error"],
        "error_mentions_index_pos": "index_pos" in r["error"],
    }


def clear_kv_cases(
    model: ModelWeights, tok: Decoder, prompt1: list[int], prompt2: list[int], steps: int
) -> list[dict]:
    """The seed's four cases of changing prompts with and without ``clear_kv_cache``.

    1. a fresh model answers prompt 2 at 0; 2. after answering prompt 1, prompt 2
    at 0 without clearing; 3. prompt 2 continued after prompt 1 at the cached
    length; 4. ``clear_kv_cache`` but index_pos kept at that length (the error).
    Prompt 1 is answered (``steps`` tokens) once; its cache is put back before
    cases 2 to 4, as if it had just been answered again.
    """

    def generate_from(pos: int) -> list[int]:
        token = next_token(model, prompt2, pos)
        ids, pos = [token], pos + len(prompt2)
        for _ in range(steps - 1):
            token = next_token(model, [token], pos)
            ids.append(token)
            pos += 1
        return ids

    model.clear_kv_cache()
    token = next_token(model, prompt1, 0)
    cached = len(prompt1)
    for _ in range(steps - 1):
        token = next_token(model, [token], cached)
        cached += 1
    after_prompt1 = snapshot_kv(model)

    model.clear_kv_cache()
    cases = [("fresh model, prompt 2 at 0", 0, 0, attempt(lambda: generate_from(0)))]
    restore_kv(model, after_prompt1)
    cases.append(
        ("after prompt 1, no clear, index_pos 0", 0, cached, attempt(lambda: generate_from(0)))
    )
    restore_kv(model, after_prompt1)
    cases.append(
        (
            f"after prompt 1, continue at {cached}",
            cached,
            cached,
            attempt(lambda: generate_from(cached)),
        )
    )
    restore_kv(model, after_prompt1)
    model.clear_kv_cache()
    cases.append(
        (
            f"clear_kv_cache, keep index_pos {cached}",
            cached,
            0,
            attempt(lambda: generate_from(cached)),
        )
    )
    model.clear_kv_cache()
    fresh = cases[0][3]["value"]
    return [
        {
            "case": name,
            "index_pos": pos,
            "kv_len_before": kv_len,
            "ok": r["ok"],
            "text": tok.decode(r["value"]) if r["ok"] else "",
            "same_as_fresh": bool(r["ok"] and r["value"] == fresh),
            "error": r["error"],
        }
        for name, pos, kv_len, r in cases
    ]
