"""A llama model's hyper-parameters from the GGUF metadata, and the checks of its tensors
that every engine runs before reading any data."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..quants.activations import VEC_DOT_TYPE
from ..quants.api import SUPPORTED
from ..quants.qtensor import default_form
from .errors import ModelFileError

MAX_SEQ_LEN = 4096

# candle 0.11.0 (after llama.cpp's llama_model_rope_type): these architectures
# use the NEOX convention (pairs i, i + d/2); every other name uses rope_i.
NEOX_ARCHITECTURES = frozenset(
    "qwen qwen2 qwen2moe qwen3 qwen3moe falcon grok dbrx phi2 phi3 phimoe stablelm "
    "starcoder2 bert nomic-bert jina-bert-v2 olmo2 olmoe codeshell plamo".split()
)


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters read from the ``llama.*`` metadata keys."""

    head_count: int
    head_count_kv: int
    block_count: int
    embedding_length: int
    rope_dim: int
    rms_norm_eps: float
    rope_freq_base: float
    architecture: str
    rope_is_neox: bool
    rope_scaling: str = "none"  # llama.rope.scaling.type: none, linear, yarn, longrope, ...
    rope_scaling_factor: float = 1.0  # llama.rope.scaling.factor (linear: positions / factor)
    expert_count: int = 0  # llama.expert_count: > 1, a mixture of experts (Mixtral-style)
    expert_used_count: int = 0  # llama.expert_used_count: the experts each token runs
    # YaRN scaling (llama.rope.scaling.type "yarn"): the context the model was trained with
    # (llama.rope.scaling.original_context_length, else llama.context_length) and the
    # magnitude factor (llama.rope.scaling.attn_factor, 1 when absent)
    rope_orig_ctx: int = 0
    rope_attn_factor: float = 1.0
    # llama.attention.key_length where the head size is not embedding_length / head_count
    # (Mistral NeMo, Mistral Small: 5120 wide, 32 heads of 128); 0: that quotient
    key_length: int = 0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.embedding_length // self.head_count

    @property
    def q_dim(self) -> int:
        """The width of the queries and of the attention's output: head_count x head_dim."""
        return self.head_count * self.head_dim

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> LlamaConfig:
        def md_get(key: str) -> Any:
            if key not in metadata:
                arch = metadata.get("general.architecture")
                why = (f": general.architecture is {arch!r}, and qlib reads llama-architecture "
                       "files (llama.* keys)" if arch != "llama" else "")  # fmt: skip
                raise ModelFileError(f"cannot find {key} in metadata{why}")
            return metadata[key]

        def md_int(key: str, lo: int) -> int:
            v = md_get(key)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):
                raise ModelFileError(f"metadata key {key} is {_describe(v)}, expected an integer")
            if v < lo:
                raise ModelFileError(f"metadata key {key} = {v} must be >= {lo}")
            return int(v)

        def md_float(key: str, value: Any) -> float:
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ModelFileError(f"metadata key {key} is {_describe(value)}, expected a number")
            return float(value)

        head_count = md_int("llama.attention.head_count", 1)
        head_count_kv = md_int("llama.attention.head_count_kv", 1)
        block_count = md_int("llama.block_count", 1)
        embedding_length = md_int("llama.embedding_length", 1)
        eps_key = "llama.attention.layer_norm_rms_epsilon"
        rms_norm_eps = md_float(eps_key, md_get(eps_key))
        freq_key = "llama.rope.freq_base"
        rope_freq_base = md_float(freq_key, metadata.get(freq_key, 10000.0))
        arch = metadata.get("general.architecture", "")
        if not isinstance(arch, str):
            raise ModelFileError(
                f"metadata key general.architecture is {_describe(arch)}, expected a string"
            )
        if head_count % head_count_kv:
            raise ModelFileError(
                f"head_count {head_count} must be a positive multiple of head_count_kv "
                f"{head_count_kv}"
            )
        key_length = 0  # the head size, where the file gives one (llama.cpp's n_embd_head_k)
        if "llama.attention.key_length" in metadata:
            key_length = md_int("llama.attention.key_length", 1)
        elif embedding_length % head_count:
            raise ModelFileError(
                f"embedding_length {embedding_length} is not divisible by head_count {head_count}"
            )
        head_dim = key_length or embedding_length // head_count
        if key_length == embedding_length / head_count:
            key_length = 0  # the usual shape: nothing to remember
        if "llama.attention.value_length" in metadata:
            value_length = md_int("llama.attention.value_length", 1)
            if value_length != head_dim:
                raise ModelFileError(
                    f"llama.attention.value_length {value_length} differs from the key length "
                    f"{head_dim}: llama's attention has one head size (llama.cpp asserts it too)"
                )
        rope_dim = md_int("llama.rope.dimension_count", 0)  # (required, as candle has it)
        if rope_dim != head_dim:
            raise ModelFileError(
                f"llama.rope.dimension_count {rope_dim} differs from head_dim "
                f"{head_dim}: a llama model rotates whole heads (llama.cpp "
                f"refuses this file too: 'invalid n_rot')"
            )
        if rope_dim % 2:
            raise ModelFileError(f"head_dim {rope_dim} is odd; RoPE rotates pairs")
        scaling = metadata.get("llama.rope.scaling.type", "none")
        if not isinstance(scaling, str):
            raise ModelFileError(
                f"metadata key llama.rope.scaling.type is {_describe(scaling)}, expected a string"
            )
        factor_key = "llama.rope.scaling.factor"
        factor = md_float(factor_key, metadata.get(factor_key, 1.0))
        if "llama.rope.scale_linear" in metadata and scaling == "none":  # the older key
            scaling = "linear"
            factor = md_float("llama.rope.scale_linear", metadata["llama.rope.scale_linear"])
        if factor <= 0:
            raise ModelFileError(f"metadata key {factor_key} = {factor} must be > 0")
        orig_key = "llama.rope.scaling.original_context_length"
        orig_ctx = 0
        if orig_key in metadata:
            orig_ctx = md_int(orig_key, 1)
        elif "llama.context_length" in metadata:
            orig_ctx = md_int("llama.context_length", 1)
        attn_key = "llama.rope.scaling.attn_factor"
        attn_factor = md_float(attn_key, metadata.get(attn_key, 1.0))
        n_expert = md_int("llama.expert_count", 0) if "llama.expert_count" in metadata else 0
        n_used = 0
        if n_expert > 1:
            n_used = md_int("llama.expert_used_count", 1)
            if n_used > n_expert:
                raise ModelFileError(f"llama.expert_used_count {n_used} exceeds llama.expert_count "
                                     f"{n_expert}")  # fmt: skip
        return cls(
            head_count=head_count,
            head_count_kv=head_count_kv,
            block_count=block_count,
            embedding_length=embedding_length,
            rope_dim=rope_dim,
            rms_norm_eps=rms_norm_eps,
            rope_freq_base=rope_freq_base,
            architecture=arch,
            rope_is_neox=arch in NEOX_ARCHITECTURES,
            rope_scaling=scaling,
            rope_scaling_factor=factor,
            rope_orig_ctx=orig_ctx,
            rope_attn_factor=attn_factor,
            expert_count=n_expert,
            expert_used_count=n_used,
            key_length=key_length,
        )


def _describe(v: Any) -> str:
    """A short description of a metadata value for error messages."""
    if isinstance(v, (list, tuple)):
        return f"an array of {len(v)} items"
    text = repr(v)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(v).__name__} {text}"


def _shape_error(name: str, info, expected: tuple, why: str) -> ModelFileError:
    return ModelFileError(
        f"tensor {name} has shape {list(info.shape)}, expected {list(expected)} ({why})"
    )


def check_tensors(content, config: LlamaConfig, form: str | None = None) -> int:
    """Check, before reading any data, that ``content`` holds every tensor ``config`` needs,
    with the shape it implies and a type qlib computes with; returns the vocabulary size.
    """
    infos = content.tensor_infos
    e, q, kv = config.embedding_length, config.q_dim, config.head_count_kv * config.head_dim

    def get(name: str, matmul: bool):
        info = infos.get(name)
        if info is None:
            raise ModelFileError(f"cannot find tensor {name} in the file")
        t = info.dtype.name
        if t not in SUPPORTED:
            raise ModelFileError(
                f"tensor {name} has ggml type {t}, which qlib cannot compute with "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        if matmul and (form or default_form(info.dtype)) == "quantized" and t not in VEC_DOT_TYPE:
            raise ModelFileError(
                f"tensor {name} has ggml type {t}, which has no quantized matmul "
                f"(ggml has no vec_dot for it); load with form='f32'"
            )
        return info

    def expect(name: str, shape: tuple, why: str, matmul: bool = True) -> None:
        info = get(name, matmul)
        if info.shape != shape:
            raise _shape_error(name, info, shape, why)

    emb = get("token_embd.weight", True)
    if len(emb.shape) != 2 or emb.shape[1] != e:
        raise _shape_error("token_embd.weight", emb, ("n_vocab", e), f"embedding_length {e}")
    vocab = emb.shape[0]
    expect("output_norm.weight", (e,), f"embedding_length {e}", matmul=False)
    if "output.weight" in infos:
        expect("output.weight", (vocab, e), f"n_vocab {vocab}, embedding_length {e}")
    for i in range(config.block_count):
        p = f"blk.{i}"
        if f"{p}.attn_q.weight" not in infos:
            raise ModelFileError(
                f"cannot find tensor {p}.attn_q.weight in the file "
                f"(llama.block_count = {config.block_count})"
            )
        expect(f"{p}.attn_norm.weight", (e,), f"embedding_length {e}", matmul=False)
        expect(f"{p}.ffn_norm.weight", (e,), f"embedding_length {e}", matmul=False)
        q_why = f"head_count {config.head_count} x head_dim {config.head_dim}, embedding_length {e}"
        expect(f"{p}.attn_q.weight", (q, e), q_why)
        kv_why = f"head_count_kv {config.head_count_kv} x head_dim {config.head_dim}"
        expect(f"{p}.attn_k.weight", (kv, e), kv_why)
        expect(f"{p}.attn_v.weight", (kv, e), kv_why)
        expect(f"{p}.attn_output.weight", (e, q), q_why)
        for name, width in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", e)):
            if f"{p}.{name}.bias" in infos:  # optional, as in llama.cpp's llama graph
                expect(f"{p}.{name}.bias", (width,), f"the rows of {p}.{name}", matmul=False)
        if config.expert_count > 1:
            n = config.expert_count
            expect(f"{p}.ffn_gate_inp.weight", (n, e), f"expert_count {n}, embedding_length {e}")
            for gate_name, up, down, lead in _expert_names(p, n, infos):
                _check_ffn(gate_name, up, down, lead, e, get, expect)
            continue
        _check_ffn(f"{p}.ffn_gate.weight", f"{p}.ffn_up.weight", f"{p}.ffn_down.weight", (), e,
                   get, expect)  # fmt: skip
        n_ff = infos[f"{p}.ffn_gate.weight"].shape[0]
        for name, width in (("ffn_gate", n_ff), ("ffn_up", n_ff), ("ffn_down", e)):
            if f"{p}.{name}.bias" in infos:
                expect(f"{p}.{name}.bias", (width,), f"the rows of {p}.{name}", matmul=False)
    return vocab


def bias_names(infos) -> list[str]:
    """The file's optional projection biases (``blk.N.attn_q.bias``, ...), which the fast
    engines add as llama.cpp does and candle's quantized_llama (the faithful engine) ignores."""
    return [n for n in infos if n.startswith("blk.") and n.endswith(".bias")]


def _expert_names(p: str, n: int, infos) -> list[tuple[str, str, str, tuple]]:
    """The (gate, up, down, leading dims) tensor names of layer ``p``'s experts: llama.cpp's
    stacked ``ffn_*_exps`` (one 3-D tensor each, ``(n, ...)``), or the older files' one tensor
    an expert (``ffn_gate.{i}``, as candle's quantized_llama reads them)."""
    if f"{p}.ffn_gate_exps.weight" in infos:
        return [(f"{p}.ffn_gate_exps.weight", f"{p}.ffn_up_exps.weight",
                 f"{p}.ffn_down_exps.weight", (n,))]  # fmt: skip
    return [(f"{p}.ffn_gate.{i}.weight", f"{p}.ffn_up.{i}.weight", f"{p}.ffn_down.{i}.weight", ())
            for i in range(n)]  # fmt: skip


def _check_ffn(gate_name: str, up: str, down: str, lead: tuple, e: int, get, expect) -> None:
    """A SwiGLU MLP's three matrices (``lead``: their leading expert dimension, if stacked)."""
    gate = get(gate_name, True)
    if len(gate.shape) != len(lead) + 2 or gate.shape[: len(lead)] != lead or gate.shape[-1] != e:
        raise _shape_error(gate_name, gate, (*lead, "n_ff", e), f"embedding_length {e}")
    n_ff = gate.shape[-2]
    expect(up, (*lead, n_ff, e), f"n_ff {n_ff} from {gate_name}")
    expect(down, (*lead, e, n_ff), f"n_ff {n_ff} from {gate_name}")


def precompute_freqs_cis(
    rope_dim: int,
    freq_base: float,
    device: torch.device,
    length: int = MAX_SEQ_LEN,
    *,
    freq_factors: torch.Tensor | None = None,
    position_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (length, rope_dim / 2), in float32 as candle (whose tables
    hold MAX_SEQ_LEN positions, the default; the fast engines ask for their context).

    ``freq_factors`` (``rope_freqs.weight``, rope_dim / 2 values) divide each frequency and
    ``position_scale`` multiplies the positions, as ggml's ``rope_ext`` does with its
    ``freq_factors`` and ``freq_scale``; candle (the faithful engine) uses neither."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float32)
    theta = 1.0 / torch.pow(torch.tensor(freq_base, dtype=torch.float32), i / rope_dim)
    if freq_factors is not None:
        theta = theta / freq_factors.reshape(-1).float().cpu()
    positions = torch.arange(length, dtype=torch.float32).reshape(length, 1)
    if position_scale != 1.0:
        positions = positions * position_scale
    idx_theta = positions @ theta.reshape(1, -1)
    return idx_theta.cos().to(device), idx_theta.sin().to(device)


HONOURED_SCALING = ("none", "linear", "yarn")  # the rope scaling types the fast engines apply
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # llama.cpp's defaults: the ramp's ends (rotations)


def yarn_tables(config: LlamaConfig, length: int, freq_factors: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """YaRN's RoPE tables as ggml's ``rope_yarn`` makes them (llama.cpp's YaRN for a llama
    file: extrapolation factor 1, ``beta_fast`` 32, ``beta_slow`` 1): each pair's angle is
    the interpolated one (``position / factor``) for the low frequencies, the original one
    for the high, a linear ramp between the pairs ``config.rope_orig_ctx`` makes the
    boundaries of; cos and sin both times ``attn_factor * (1 + 0.1 ln(factor))``."""
    d, base = config.rope_dim, config.rope_freq_base
    scale = 1.0 / config.rope_scaling_factor
    if config.rope_orig_ctx < 1:
        raise ModelFileError("YaRN scaling needs llama.rope.scaling.original_context_length "
                             "(or llama.context_length)")  # fmt: skip

    def corr_dim(rotations: float) -> float:  # ggml_rope_yarn_corr_dim
        return d * math.log(config.rope_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(YARN_BETA_FAST)))
    high = min(d - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))
    pair = torch.arange(d // 2, dtype=torch.float32)
    ramp = 1.0 - ((pair - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # 1: extrapolate
    theta = 1.0 / torch.pow(torch.tensor(base, dtype=torch.float32), 2 * pair / d)
    if freq_factors is not None:
        theta = theta / freq_factors.reshape(-1).float().cpu()
    extrap = torch.arange(length, dtype=torch.float32).reshape(length, 1) @ theta.reshape(1, -1)
    interp = extrap * scale
    angle = interp * (1 - ramp) + extrap * ramp
    mscale = config.rope_attn_factor * (1.0 + 0.1 * math.log(1.0 / scale))
    return angle.cos() * mscale, angle.sin() * mscale


def rope_tables(
    config: LlamaConfig, device: torch.device, length: int, freq_factors: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast engines' RoPE tables: the file's scaling honoured, as llama.cpp does.

    ``freq_factors``: the file's ``rope_freqs.weight`` (Llama 3.1+ "llama3" scaling, stored by
    the converter as one factor per frequency); linear scaling divides positions by
    ``rope_scaling_factor``; YaRN as ``yarn_tables``. Other scaling types (longrope, ...) are
    not applied: a warning says so."""
    if freq_factors is not None and freq_factors.numel() != config.rope_dim // 2:
        raise ModelFileError(
            f"tensor rope_freqs.weight has {freq_factors.numel()} values, expected "
            f"rope_dim / 2 = {config.rope_dim // 2}"
        )
    if config.rope_scaling == "yarn":
        cos, sin = yarn_tables(config, length, freq_factors)
        return cos.to(device), sin.to(device)
    if config.rope_scaling not in HONOURED_SCALING:
        warnings.warn(
            f"rope scaling {config.rope_scaling!r} is not implemented in qlib: positions are "
            "not scaled (results past the original context will differ from llama.cpp)",
            stacklevel=2,
        )
    scale = 1.0 / config.rope_scaling_factor if config.rope_scaling == "linear" else 1.0
    return precompute_freqs_cis(config.rope_dim, config.rope_freq_base, device, length,
                                freq_factors=freq_factors, position_scale=scale)  # fmt: skip


def scaling_ignored(config: LlamaConfig, has_freq_factors: bool) -> str | None:
    """What RoPE scaling a file asks for that candle's forward (the faithful engine) ignores."""
    parts = []
    if has_freq_factors:
        parts.append("per-frequency factors (rope_freqs.weight)")
    if config.rope_scaling != "none":
        parts.append(f"{config.rope_scaling} scaling x{config.rope_scaling_factor:g}")
    return " and ".join(parts) or None
