"""What the experiments share: the loader, the chat prompt, one greedy step, teacher-forced
logits, KV cache snapshots, and the bytes a decode step reads against the memory's speed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ...generate import greedy_id
from ...llama.config import LlamaConfig
from ...llama.engine import load
from ...llama.faithful import ModelWeights
from ...quants import cpu
from ...tokenizer import Tokenizer


def build(path: str | Path, device: str = "cpu", **options: Any) -> tuple[Any, Tokenizer]:
    """``qlib.llama.engine.load(path, device, **options)`` and the file's tokenizer.

    ``options`` are ``load``'s: ``engine``, ``form``, ``metadata_overrides`` /
    ``drop_keys`` (the metadata edited in memory, the tokenizer built from the
    edited one), and the engine's own (``attention``, ``strict``, ``kv_cache``...).
    """
    model, content = load(path, device, **options)
    return model, Tokenizer.from_metadata(content.metadata)


def chat_ids(tokenizer: Any, text: str, system: bool = True) -> list[int]:
    """Token ids of ``text`` as one chat turn, ready for the assistant's reply (no BOS added).

    ``system=True`` renders the file's chat template as it is, with its own
    default system message where it has one (SmolLM2's: "You are a helpful AI
    assistant named SmolLM, trained by Hugging Face"). ``system=False`` on a
    ChatML template (SmolLM2's) writes the user turn alone, as the seed's
    program does (13 tokens for "What is Rust?"); other templates render as
    with ``system=True``.
    """
    template = tokenizer.chat_template or ""
    if not system and "<|im_start|>" in template:
        prompt = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    else:
        prompt = tokenizer.chat_prompt(text)
    return tokenizer.encode(prompt, add_special_tokens=False)


def next_token(model: Any, ids: list[int], index_pos: int) -> int:
    """One forward of ``ids`` at ``index_pos``; the argmax of the last position."""
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids], device=model.device), index_pos)
    return greedy_id(logits)


def teacher_forced_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids`` (one prefill at 0), (T, vocab) float32 on the CPU.

    The KV cache is empty before and after.
    """
    model.clear_kv_cache()
    with torch.inference_mode():
        x = torch.tensor([ids], device=model.device)
        out = model.forward(x, 0, all_logits=True)[0].float().cpu()
    model.clear_kv_cache()
    return out


def snapshot_kv(model: ModelWeights) -> list:
    """Every layer's KV cache, as ``restore_kv`` puts it back.

    The cat cache is never written in place (each step makes new tensors), so
    its tensors themselves are the snapshot; a static cache's are views of
    buffers that later steps overwrite, so those are copied.
    """
    static = model.kv_cache_mode == "static"
    return [
        None if kv is None else (kv[0].clone(), kv[1].clone()) if static else kv
        for kv in (layer.kv_cache for layer in model.layers)
    ]


def restore_kv(model: ModelWeights, snapshot: list, length: int | None = None) -> None:
    """Put a ``snapshot_kv`` back, or only its first ``length`` positions.

    Cut to ``length``, the cache is what a prefill of those positions leaves
    (causal attention: the first positions do not depend on later ones), as
    new contiguous tensors. A static cache gets the positions written into its
    buffers.
    """
    for layer, kv in zip(model.layers, snapshot, strict=True):
        layer.kv_cache = None
        if kv is None:
            continue
        k, v = kv
        if length is not None:
            k, v = k[:, :, :length].clone(), v[:, :, :length].clone()
        layer.put_kv(k, v, 0, model.max_seq_len)


def copy_bandwidth(device: torch.device | str, mib: int = 512, reps: int = 5,
                   threads: int | None = None) -> float:  # fmt: skip
    """Memory bandwidth in bytes/s for a decode step's reads, measured here.

    On a GPU: the best of ``reps`` device copies of ``mib`` MiB, counted as read + write. On a
    CPU a copy also reads every destination line before writing it (write-allocate), so the
    figure is a read-only pass instead: the best of ``reps`` sums over ``mib`` MiB on the
    threads torch uses (or ``threads``), which is what streaming weights does, on 2 MB pages
    as the fast engine's weights are (on 4 KB pages the same sum read 8-30% slower here)."""
    device = torch.device(device)
    before = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    n = mib * (1 << 20) // 4
    if device.type == "cpu":
        with cpu.hugepage_weights():
            a = cpu.weights_empty((n,), torch.float32)
        a.fill_(1.0)
    else:
        a = torch.ones(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a) if device.type != "cpu" else None

    def once() -> None:
        if b is None:
            a.sum()
        else:
            b.copy_(a)
            torch.cuda.synchronize(device)

    try:
        once()
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return (1 if b is None else 2) * a.numel() * 4 / best


def bytes_per_step(content: Any, context: int, kv_bytes_per_value: int = 4) -> dict[str, float]:
    """Bytes a decode step must read: every matmul weight once (the output layer, tied or
    not; of a mixture of experts' expert tensors the share a token uses,
    ``llama.expert_used_count / llama.expert_count``), plus the KV cache over ``context``
    positions (float32: 4 bytes a value)."""
    infos = content.tensor_infos
    md = content.metadata
    n_expert = md.get("llama.expert_count", 0) or 0
    used = md.get("llama.expert_used_count", 0) / n_expert if n_expert > 1 else 1.0
    weights = 0.0
    for n, i in infos.items():
        if n.startswith("blk.") and len(i.shape) >= 2:
            expert = len(i.shape) == 3 or (n.count(".") == 4 and n.split(".")[3].isdigit())
            weights += i.nbytes * (used if expert else 1.0)
    weights += infos.get("output.weight", infos["token_embd.weight"]).nbytes
    c = LlamaConfig.from_metadata(md)
    kv = 2 * c.block_count * c.head_count_kv * c.head_dim * kv_bytes_per_value * context
    return {"weight_bytes": float(weights), "kv_bytes": float(kv)}
