"""Tiny random llama GGUF files for tests, written with ``qlib.gguf.write``.

``write_tiny_llama`` writes every ``llama.*`` key candle's ``from_gguf`` reads and
the usual llama.cpp tensor names and shapes (torch order: (out, in)).
``tiny_llama_weights`` gives, for the same arguments, the float32 values the file
holds (after rounding to F16 or quantizing), so an engine can be compared against
a hand-written torch reference. ``weight_types`` mixes types within a file, as
llama.cpp's recipes do: ``{"*.attn_v.weight": "Q6_K", "blk.0.*": "Q8_0"}`` (``fnmatch``
patterns over tensor names; the first that matches wins, else ``weight_type``).
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np

from qlib.gguf import GGUFValueType, Typed, write
from qlib.quants.api import READ_ONLY
from qlib.quants.types import ggml_type

U32, F32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32

BLOCK_TENSORS = (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
    "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
)  # fmt: skip


def tiny_llama_metadata(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_ff: int = 128,
    arch: str = "llama",
    context_length: int = 256,
    rope_freq_base: float = 10000.0,
    rms_eps: float = 1e-5,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """The metadata of a tiny llama, typed as llama.cpp expects (UINT32 counts, FLOAT32);
    ``head_dim`` other than ``n_embd / n_head`` is written as ``llama.attention.key_length``
    and ``value_length`` (Mistral NeMo's layout)."""
    hd = head_dim or n_embd // n_head
    extra = {}
    if head_dim is not None:
        extra = {f"llama.attention.{n}_length": Typed(U32, hd) for n in ("key", "value")}
    return extra | {
        "general.architecture": arch,
        "general.name": "tiny-llama",
        "llama.context_length": Typed(U32, context_length),
        "llama.embedding_length": Typed(U32, n_embd),
        "llama.block_count": Typed(U32, n_layer),
        "llama.feed_forward_length": Typed(U32, n_ff),
        "llama.rope.dimension_count": Typed(U32, hd),
        "llama.attention.head_count": Typed(U32, n_head),
        "llama.attention.head_count_kv": Typed(U32, n_kv_head),
        "llama.attention.layer_norm_rms_epsilon": Typed(F32, rms_eps),
        "llama.rope.freq_base": Typed(F32, rope_freq_base),
    }


def tiny_llama_float_weights(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_ff: int = 128,
    vocab: int = 256,
    seed: int = 0,
    tie_output: bool = True,
    head_dim: int | None = None,
    biases: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """Random float32 weights (before any rounding), llama.cpp names, torch shapes; ``biases``:
    the projections (``attn_q``, ``ffn_down``, ...) that get a random bias, as some llama
    files have."""
    if (head_dim is None and n_embd % n_head) or n_head % n_kv_head:
        raise ValueError(f"n_embd {n_embd}, n_head {n_head}, n_kv_head {n_kv_head} do not divide")
    rng = np.random.default_rng(seed)
    hd = head_dim or n_embd // n_head
    q_dim, kv_dim = n_head * hd, n_kv_head * hd

    def linear(out_f: int, in_f: int) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) / np.sqrt(in_f)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": rng.standard_normal((vocab, n_embd)).astype(np.float32)}
    for i in range(n_layer):
        p = f"blk.{i}."
        w[p + "attn_norm.weight"] = norm(n_embd)
        w[p + "attn_q.weight"] = linear(q_dim, n_embd)
        w[p + "attn_k.weight"] = linear(kv_dim, n_embd)
        w[p + "attn_v.weight"] = linear(kv_dim, n_embd)
        w[p + "attn_output.weight"] = linear(n_embd, q_dim)
        w[p + "ffn_norm.weight"] = norm(n_embd)
        w[p + "ffn_gate.weight"] = linear(n_ff, n_embd)
        w[p + "ffn_up.weight"] = linear(n_ff, n_embd)
        w[p + "ffn_down.weight"] = linear(n_embd, n_ff)
        for name in biases:
            rows = w[p + name + ".weight"].shape[0]
            w[p + name + ".bias"] = (0.5 * rng.standard_normal(rows)).astype(np.float32)
    w["output_norm.weight"] = norm(n_embd)
    if not tie_output:
        w["output.weight"] = linear(vocab, n_embd)
    return w


def _encode(name: str, w: np.ndarray, weight_type: str) -> tuple[Any, np.ndarray]:
    """(tensor to write, float32 values it holds) for one weight."""
    t = ggml_type(weight_type)
    if w.ndim == 1 or t.name == "F32":  # norms stay F32, as in llama.cpp files
        return w, w
    if t.name == "F16":
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    from qlib.quants.qtensor import QTensor  # needs qlib.quants' quantize / dequantize

    if w.shape[-1] % t.block_size:
        raise ValueError(
            f"{name}: last dim {w.shape[-1]} is not a multiple of the {t.name} block size "
            f"{t.block_size}; choose larger sizes"
        )
    if t.name in READ_ONLY:
        q = random_blocks(w, t.name, seed=sum(name.encode()))
    else:
        q = QTensor.quantize(w, t.name, device="cpu")
    return q, q.dequantize().numpy().astype(np.float32)


def random_blocks(w: np.ndarray, type_name: str, seed: int = 0):
    """A QTensor of ``w``'s shape in a type qlib reads but does not write (``READ_ONLY``):
    random bytes (every pattern is a valid block of these types) with one f16 ``d`` for all
    blocks, chosen so that the values' rms is ``w``'s: a random weight like ``w``."""
    import torch

    from qlib.quants.qtensor import QTensor

    t = ggml_type(type_name)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (w.size // t.block_size, t.type_size), dtype=np.uint8)

    def with_d(d: float) -> QTensor:
        bits = int(np.float16(d).view(np.uint16))
        if t.name == "IQ1_M":  # d's four nibbles are the top nibbles of the 4 scale words
            sc = raw[:, 48:56].view("<u2")
            for i in range(4):
                sc[:, i] = (sc[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        else:
            at = {"TQ1_0": 52, "TQ2_0": 64}.get(t.name, 0)
            raw[:, at : at + 2] = np.frombuffer(np.uint16(bits).tobytes(), np.uint8)
        return QTensor(torch.from_numpy(raw.copy().reshape(-1)), w.shape, t.name)

    unit = with_d(1.0).dequantize().numpy()
    rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
    return with_d(rms / float(np.sqrt(np.mean(np.square(unit, dtype=np.float64)))))


def tensor_type(name: str, weight_type: str, weight_types: Mapping[str, str] | None) -> str:
    """The type of tensor ``name``: the first pattern of ``weight_types`` it matches, else
    ``weight_type``."""
    for pattern, type_name in (weight_types or {}).items():
        if fnmatchcase(name, pattern):
            return type_name
    return weight_type


def _build(weight_type: str, tie_output: bool, seed: int, sizes: dict,
           weight_types: Mapping[str, str] | None = None):  # fmt: skip
    floats = tiny_llama_float_weights(**sizes, seed=seed, tie_output=tie_output)
    tensors, held = {}, {}
    for name, w in floats.items():
        wt = tensor_type(name, weight_type, weight_types)
        tensors[name], held[name] = _encode(name, w, wt)
    return tensors, held


def tiny_llama_weights(
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_ff: int = 128,
    vocab: int = 256,
    weight_type: str = "F32",
    seed: int = 0,
    tie_output: bool = True,
    weight_types: Mapping[str, str] | None = None,
    head_dim: int | None = None,
    biases: tuple[str, ...] = (),
) -> dict[str, np.ndarray]:
    """The float32 values ``write_tiny_llama`` with the same arguments stores."""
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, n_ff=n_ff,
                 vocab=vocab, head_dim=head_dim, biases=biases)  # fmt: skip
    return _build(weight_type, tie_output, seed, sizes, weight_types)[1]


def write_tiny_llama(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_kv_head: int = 2,
    n_ff: int = 128,
    vocab: int = 256,
    weight_type: str = "F32",
    arch: str = "llama",
    seed: int = 0,
    drop_keys: tuple[str, ...] | list[str] = (),
    extra_metadata: dict[str, Any] | None = None,
    tie_output: bool = True,
    return_weights: bool = False,
    weight_types: Mapping[str, str] | None = None,
    head_dim: int | None = None,
    biases: tuple[str, ...] = (),
) -> Path | tuple[Path, dict[str, np.ndarray]]:
    """Write a small random llama GGUF to ``path``; returns the path (and weights if asked).

    Matrices use ``weight_type`` (F32/F16 always work; quantized types need
    ``qlib.quants``), or the type of the first ``weight_types`` pattern their name matches
    (``fnmatch``); norms are F32. ``drop_keys`` removes metadata keys,
    ``extra_metadata`` adds or overrides some (values may be ``Typed``).
    ``tie_output=True`` writes no ``output.weight`` (the embedding is shared). ``head_dim``:
    heads of another size than ``n_embd / n_head`` (``llama.attention.key_length``);
    ``biases``: the projections with a bias (``attn_q``, ..., ``ffn_down``).
    """
    sizes = dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv_head, n_ff=n_ff,
                 vocab=vocab, head_dim=head_dim, biases=biases)  # fmt: skip
    metadata = tiny_llama_metadata(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                                   n_kv_head=n_kv_head, n_ff=n_ff, arch=arch,
                                   head_dim=head_dim)  # fmt: skip
    metadata.update(extra_metadata or {})
    for key in drop_keys:
        metadata.pop(key, None)
    tensors, held = _build(weight_type, tie_output, seed, sizes, weight_types)
    path = Path(path)
    with open(path, "wb") as f:
        write(f, metadata, tensors)
    return (path, held) if return_weights else path


def greedy(model, prompt: list[int], n: int = 32) -> list[int]:
    """``n`` greedy ids after a prefill of ``prompt`` (any engine; ids as plain ints)."""
    import torch

    logits = model.forward(torch.tensor([prompt]), 0)
    out: list[int] = []
    for pos in range(len(prompt), len(prompt) + n):
        out.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor([[out[-1]]]), pos)
    return out


def write_tiny_moe(
    path: str | Path,
    *,
    n_expert: int = 4,
    n_expert_used: int = 2,
    stacked: bool = True,
    weight_type: str = "F32",
    seed: int = 0,
    extra_metadata: dict[str, Any] | None = None,
    **sizes: int,
) -> tuple[Path, dict[str, np.ndarray]]:
    """A small random Mixtral-style llama (``llama.expert_count`` experts, ``n_expert_used``
    a token) written to ``path``: the router ``ffn_gate_inp`` (F32, as llama.cpp keeps it; its
    rows scaled up so that the routing has spread) and each layer's experts as llama.cpp's
    stacked ``ffn_*_exps`` (``stacked``) or one tensor an expert (``ffn_gate.{i}``, the older
    files candle reads). Returns the path and the float32 values it holds."""
    sizes = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, n_ff=64, vocab=256) | sizes
    floats = tiny_llama_float_weights(**sizes, seed=seed, tie_output=False)
    rng = np.random.default_rng(seed + 1)
    e, ff = sizes["n_embd"], sizes["n_ff"]
    for i in range(sizes["n_layer"]):
        p = f"blk.{i}."
        for n in ("ffn_gate", "ffn_up", "ffn_down"):
            del floats[f"{p}{n}.weight"]
        floats[f"{p}ffn_gate_inp.weight"] = (rng.standard_normal((n_expert, e)) * 4 / np.sqrt(e)
                                             ).astype(np.float32)  # fmt: skip
        experts = {
            "gate": rng.standard_normal((n_expert, ff, e)) / np.sqrt(e),
            "up": rng.standard_normal((n_expert, ff, e)) / np.sqrt(e),
            "down": rng.standard_normal((n_expert, e, ff)) / np.sqrt(ff),
        }
        for n, w in experts.items():
            w = w.astype(np.float32)
            if stacked:
                floats[f"{p}ffn_{n}_exps.weight"] = w
            else:
                for x in range(n_expert):
                    floats[f"{p}ffn_{n}.{x}.weight"] = w[x]
    tensors, held = {}, {}
    for name, w in floats.items():
        wt = "F32" if "gate_inp" in name else weight_type
        if w.ndim == 3:  # a stacked tensor: its rows encoded as one matrix
            q, v = _encode(name, w.reshape(-1, w.shape[-1]), wt)
            tensors[name] = q.reshape(w.shape) if isinstance(q, np.ndarray) else \
                type(q)(q.data, w.shape, q.dtype)  # fmt: skip
            held[name] = v.reshape(w.shape)
        else:
            tensors[name], held[name] = _encode(name, w, wt)
    metadata = tiny_llama_metadata(**{k: v for k, v in sizes.items() if k != "vocab"})
    metadata["llama.expert_count"] = Typed(U32, n_expert)
    metadata["llama.expert_used_count"] = Typed(U32, n_expert_used)
    metadata.update(extra_metadata or {})
    path = Path(path)
    with open(path, "wb") as f:
        write(f, metadata, tensors)
    return path, held


# the shapes of the tiny files of one weight type each (rows of 256: one super-block)
TYPE_SIZES = dict(n_embd=256, n_head=4, n_kv_head=2, n_ff=512, vocab=256)


def type_files(d: Path, types) -> dict[str, Path]:
    """One tiny untied llama of ``TYPE_SIZES`` a weight type (a Q8_0 embedding), with the keys
    llama.cpp needs to read a file without a tokenizer."""
    extra = {"tokenizer.ggml.model": "none",
             "llama.vocab_size": Typed(U32, TYPE_SIZES["vocab"])}  # fmt: skip
    return {t: write_tiny_llama(d / f"{t}.gguf", weight_type=t, tie_output=False, **TYPE_SIZES,
                                weight_types={"token_embd.weight": "Q8_0"},
                                extra_metadata=extra)
            for t in types}  # fmt: skip


def first_logits(path: str | Path, **kw):
    """The logits of a fixed 5-token prompt from ``load(path, "cpu", **kw)``."""
    import torch

    from qlib.llama.engine import load

    model, _ = load(path, "cpu", **kw)
    with torch.inference_mode():
        return model.forward(torch.tensor([[1, 5, 9, 33, 7]]), 0)[0].float()


def fused_kernels_skip():
    """A skip mark unless the fused CUDA kernels can run: on a GPU, or on the CPU through
    Triton's interpreter (``QLIB_TRITON_INTERPRET=1 TRITON_INTERPRET=1``, slow)."""
    import os

    import pytest
    import torch

    from qlib.quants.cuda import matmul as gpu

    interpret = os.environ.get("QLIB_TRITON_INTERPRET") == "1" and gpu.triton_available()
    return pytest.mark.skipif(not (torch.cuda.is_available() or interpret),
                              reason="needs CUDA (or QLIB_TRITON_INTERPRET=1)")  # fmt: skip


def fused_cuda_gap(path: str | Path) -> float:
    """The fast CUDA engine's fused kernels against the f32 form on the GPU (else on the CPU
    through Triton's interpreter), largest |logit difference| over their scale: the prompt of
    ``first_logits``, then a step."""
    import torch

    from qlib.gguf import Content
    from qlib.llama.faithful import ModelWeights
    from qlib.llama.fast_cuda import CudaFastModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    with open(path, "rb") as f:
        content = Content.read(f)
        ref = ModelWeights.from_gguf(content, f, device, form="f32")
        fast = CudaFastModel.from_gguf(content, f, device, decode="fused")
    gap = 0.0
    for pos, x in ((0, torch.tensor([[1, 5, 9, 33, 7]])), (5, torch.tensor([[44]]))):
        want, got = ref.forward(x, pos)[0], fast.forward(x, pos)[0]
        gap = max(gap, ((got - want).abs().max() / want.abs().max()).item())
    return gap
