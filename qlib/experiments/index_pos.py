"""Notebook 4: what a wrong ``index_pos`` does (seed: quantized llama forward, "index_pos")."""

from __future__ import annotations

from collections.abc import Callable

from ..quantized_llama import ModelWeights
from ..tokenizer import Tokenizer
from .common import next_token

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


def decode_variants(
    model: ModelWeights, tok: Tokenizer, prompt_ids: list[int], steps: int
) -> list[dict]:
    """One row per variant: text, ids, repetition, tokens equal to the correct run."""
    rows, correct = [], None
    for name, fn in DECODE_VARIANTS.items():
        ids = decode_with(model, prompt_ids, steps, fn)
        correct = correct or ids
        same_prefix = next((i for i, (a, b) in enumerate(zip(ids, correct)) if a != b), len(ids))
        rows.append(
            {
                "variant": name,
                "text": tok.decode(ids),
                "repetition": repetition(ids),
                "distinct_tokens": len(set(ids)),
                "agrees_with_correct_for": same_prefix,
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


def chunked_prefill(
    model: ModelWeights, tok: Tokenizer, prompt_ids: list[int], split: int, index_pos: int
) -> dict:
    """Prefill ``prompt_ids[:split]`` at 0, then the rest at ``index_pos`` (correct: split)."""
    model.clear_kv_cache()
    next_token(model, prompt_ids[:split], 0)
    r = attempt(lambda: next_token(model, prompt_ids[split:], index_pos))
    return {
        "first_chunk": split,
        "second_chunk": len(prompt_ids) - split,
        "index_pos": index_pos,
        "correct_index_pos": split,
        "ok": r["ok"],
        "next_token": tok.decode([r["value"]]) if r["ok"] else "",
        "error": r["error"],
    }


def clear_kv_cases(
    model: ModelWeights, tok: Tokenizer, prompt1: list[int], prompt2: list[int], steps: int
) -> list[dict]:
    """The seed's four cases of changing prompts with and without ``clear_kv_cache``."""

    def generate_from(pos: int) -> str:
        token = next_token(model, prompt2, pos)
        ids, pos = [token], pos + len(prompt2)
        for _ in range(steps - 1):
            token = next_token(model, [token], pos)
            ids.append(token)
            pos += 1
        return tok.decode(ids)

    def run_prompt1() -> int:
        """Answer prompt 1 for ``steps`` tokens; returns the positions now in the cache."""
        model.clear_kv_cache()
        token = next_token(model, prompt1, 0)
        pos = len(prompt1)
        for _ in range(steps - 1):
            token = next_token(model, [token], pos)
            pos += 1
        return pos

    cases = []
    model.clear_kv_cache()
    cases.append(("fresh model, prompt 2", attempt(lambda: generate_from(0))))
    run_prompt1()
    cases.append(("after prompt 1, no clear, index_pos 0", attempt(lambda: generate_from(0))))
    cached = run_prompt1()
    cases.append(
        (f"after prompt 1, continue at index_pos {cached}", attempt(lambda: generate_from(cached)))
    )
    cached = run_prompt1()
    model.clear_kv_cache()
    cases.append(
        (f"clear_kv_cache, keep index_pos {cached}", attempt(lambda: generate_from(cached)))
    )
    return [
        {"case": name, "ok": r["ok"], "text": r["value"] or "", "error": r["error"]}
        for name, r in cases
    ]
