"""The llama forward pass of candle 0.11.0's ``quantized_llama.rs``, in torch.

``ModelWeights.from_gguf(content, f, device)`` reads the ``llama.*`` keys and
the tensors by name; ``forward(x, index_pos)`` runs embedding -> 30 x
(RmsNorm, attention with a per-layer KV cache, RmsNorm, SiLU MLP) -> RmsNorm
-> logits of the last position. Everything candle does is kept, including its
sharp edges, because the experiments measure them:

* a missing required key fails with ``cannot find <key> in metadata``, a
  missing ``llama.rope.freq_base`` silently becomes 10000;
* the RoPE variant is picked from ``general.architecture`` (NEOX list);
* cos/sin tables hold ``MAX_SEQ_LEN = 4096`` positions, beyond that the
  narrow fails;
* the causal mask is built on the host only for ``seq_len > 1`` and cached
  forever in a dict keyed by ``(seq_len, kv_len = index_pos + seq_len)``;
* the KV cache of each layer is dropped when ``index_pos == 0``, otherwise the
  new keys/values are concatenated; ``index_pos`` is never checked against
  the cache (``strict=True`` adds that check, with a clear error).

``strict=True`` also refuses, with a clear error, a forward call whose
``index_pos + seq_len`` passes the RoPE table (candle: the narrow error) and an
input that is not a 1 x T integer tensor of token ids in the vocabulary.

Unlike candle, ``from_gguf`` checks the file before it reads any tensor data or
builds the RoPE tables: metadata types and ranges, that every tensor exists
with the shape the configuration implies and a type qlib can compute with. A
file that fails raises ``ModelFileError`` (a ``GGUFError`` too), naming the key
or tensor; a model that loads runs.

Options that go beyond candle are explicit: ``all_logits`` (every position,
for teacher forcing), ``attention`` ("auto" as candle, "naive", "sdpa"),
``form`` (QMatMul form for every projection) and ``strict``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import torch.nn.functional as F

from .devices import DeviceLike, as_device
from .gguf_file import GGUFError
from .qtensor import FORMS, QMatMul, QTensor, default_form
from .spans import span

MAX_SEQ_LEN = 4096

# candle 0.11.0 (after llama.cpp's llama_model_rope_type): these architectures
# use the NEOX convention (pairs i, i + d/2); every other name uses rope_i.
NEOX_ARCHITECTURES = frozenset(
    "qwen qwen2 qwen2moe qwen3 qwen3moe falcon grok dbrx phi2 phi3 phimoe stablelm "
    "starcoder2 bert nomic-bert jina-bert-v2 olmo2 olmoe codeshell plamo".split()
)

ATTENTION_MODES = ("auto", "naive", "sdpa")
# The fast paths (qlib.fast, qlib.fast_cuda) stack a layer's projections that read the
# same input into one matrix: attribute -> the GGUF tensors (blk.N.<name>.weight), by rows.
FUSED_STACKS: dict[str, tuple[str, ...]] = {
    "wqkv": ("attn_q", "attn_k", "attn_v"),
    "wo": ("attn_output",),
    "w13": ("ffn_gate", "ffn_up"),
    "w2": ("ffn_down",),
}


class ModelError(ValueError):
    """A GGUF file that cannot be built into a llama model, or a bad forward call."""


class ModelFileError(ModelError, GGUFError):
    """The file cannot be built into a llama model: missing or ill-typed metadata,
    a missing tensor, or a shape or type that does not fit the configuration.

    Also a ``GGUFError``: one ``except GGUFError`` covers every bad file.
    """


class ShapeError(ModelError):
    """A shape mismatch inside the forward pass, worded like candle's errors."""


class IndexPosError(ModelError):
    """``strict=True``: index_pos disagrees with the KV cache, or passes the RoPE table."""


class InputError(ModelError):
    """``strict=True``: the input is not a 1 x T integer tensor of token ids."""


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

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> LlamaConfig:
        def md_get(key: str) -> Any:
            if key not in metadata:
                raise ModelFileError(f"cannot find {key} in metadata")
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
        rope_dim = md_int("llama.rope.dimension_count", 0)
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
        if embedding_length % head_count:
            raise ModelFileError(
                f"embedding_length {embedding_length} is not divisible by head_count {head_count}"
            )
        if rope_dim != embedding_length // head_count:
            raise ModelFileError(
                f"llama.rope.dimension_count {rope_dim} differs from head_dim "
                f"{embedding_length // head_count}; partial RoPE is not supported"
            )
        if rope_dim % 2:
            raise ModelFileError(f"head_dim {rope_dim} is odd; RoPE rotates pairs")
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
    from .quants import SUPPORTED
    from .quants.activations import VEC_DOT_TYPE

    infos = content.tensor_infos
    e, kv = config.embedding_length, config.head_count_kv * config.head_dim

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
        expect(f"{p}.attn_q.weight", (e, e), f"embedding_length {e}")
        kv_why = f"head_count_kv {config.head_count_kv} x head_dim {config.head_dim}"
        expect(f"{p}.attn_k.weight", (kv, e), kv_why)
        expect(f"{p}.attn_v.weight", (kv, e), kv_why)
        expect(f"{p}.attn_output.weight", (e, e), f"embedding_length {e}")
        gate = get(f"{p}.ffn_gate.weight", True)
        if len(gate.shape) != 2 or gate.shape[1] != e:
            raise _shape_error(f"{p}.ffn_gate.weight", gate, ("n_ff", e), f"embedding_length {e}")
        n_ff = gate.shape[0]
        expect(f"{p}.ffn_up.weight", (n_ff, e), f"n_ff {n_ff} from ffn_gate")
        expect(f"{p}.ffn_down.weight", (e, n_ff), f"n_ff {n_ff} from ffn_gate")
    return vocab


def dequantize_rows(q: QTensor, max_floats: int = 1 << 22) -> torch.Tensor:
    """``q.dequantize()`` a few rows at a time into one float32 tensor (no full-size temps)."""
    from .quants import dequantize_torch

    if len(q.shape) != 2:
        return q.dequantize()
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float32, device=q.device)
    step = max(1, max_floats // max(k, 1))
    for i in range(0, n, step):
        j = min(n, i + step)
        out[i:j] = dequantize_torch(q.data[i:j], q.dtype.name, (j - i, k))
    return out


def precompute_freqs_cis(
    rope_dim: int, freq_base: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (MAX_SEQ_LEN, rope_dim / 2), in float32 as candle."""
    i = torch.arange(0, rope_dim, 2, dtype=torch.float32)
    theta = 1.0 / torch.pow(torch.tensor(freq_base, dtype=torch.float32), i / rope_dim)
    positions = torch.arange(MAX_SEQ_LEN, dtype=torch.float32).reshape(MAX_SEQ_LEN, 1)
    idx_theta = positions @ theta.reshape(1, -1)
    return idx_theta.cos().to(device), idx_theta.sin().to(device)


def narrow(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``Tensor::narrow`` with candle's bounds check and message."""
    size = t.shape[dim]
    if start < 0 or start + length > size:
        raise ShapeError(
            f"narrow invalid args start + len > dim_len: {list(t.shape)}, dim: {dim}, "
            f"start: {start}, len:{length}"
        )
    return t.narrow(dim, start, length)


def rope_i(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE (llama): rotate the pairs (2i, 2i+1). x: (b, h, t, d)."""
    b, h, t, d = x.shape
    pairs = x.reshape(b, h, t, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.reshape(b, h, t, d)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NEOX RoPE: rotate the pairs (i, i + d/2). x: (b, h, t, d)."""
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


def build_causal_mask(seq_len: int, index_pos: int) -> torch.Tensor:
    """(seq_len, index_pos + seq_len) uint8 on the host, 1 = may not attend."""
    kv_len = index_pos + seq_len
    rows = torch.arange(seq_len).reshape(-1, 1) + index_pos
    cols = torch.arange(kv_len).reshape(1, -1)
    return (cols > rows).to(torch.uint8)


def broadcast_as(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``broadcast_as`` with candle's error text (never mentions index_pos)."""
    try:
        return t.expand(shape)
    except RuntimeError:
        raise ShapeError(f"cannot broadcast {list(t.shape)} to {list(shape)}") from None


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """candle's ``repeat_kv``: cat on the sequence axis, then reshape (a copy)."""
    if n_rep == 1:
        return x
    b, n_kv, t, d = x.shape
    return torch.cat([x] * n_rep, dim=2).reshape(b, n_kv * n_rep, t, d)


class RmsNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with span("rms-norm"):
            variance = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(variance + self.eps) * self.weight


class Mlp:
    def __init__(self, w1: QMatMul, w2: QMatMul, w3: QMatMul):
        self.feed_forward_w1, self.feed_forward_w2, self.feed_forward_w3 = w1, w2, w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w1 = self.feed_forward_w1.forward(x)
        w3 = self.feed_forward_w3.forward(x)
        return self.feed_forward_w2.forward(F.silu(w1) * w3)


class LayerWeights:
    """One transformer block: attention with its KV cache, and the MLP."""

    def __init__(
        self,
        wq: QMatMul,
        wk: QMatMul,
        wv: QMatMul,
        wo: QMatMul,
        attention_norm: RmsNorm,
        mlp: Mlp,
        ffn_norm: RmsNorm,
        config: LlamaConfig,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ):
        self.attention_wq, self.attention_wk = wq, wk
        self.attention_wv, self.attention_wo = wv, wo
        self.attention_norm, self.ffn_norm = attention_norm, ffn_norm
        self.mlp = mlp
        self.n_head = config.head_count
        self.n_kv_head = config.head_count_kv
        self.head_dim = config.head_dim
        self.rope_is_neox = config.rope_is_neox
        self.cos, self.sin = cos, sin
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_rotary_emb(self, x: torch.Tensor, index_pos: int) -> torch.Tensor:
        with span("attn-rot"):
            seq_len = x.shape[2]
            cos = narrow(self.cos, 0, index_pos, seq_len)
            sin = narrow(self.sin, 0, index_pos, seq_len)
            x = x.contiguous()
            return rope_neox(x, cos, sin) if self.rope_is_neox else rope_i(x, cos, sin)

    def forward_attn(
        self, x: torch.Tensor, mask: torch.Tensor | None, index_pos: int, use_sdpa: bool
    ) -> torch.Tensor:
        with span("attn"):
            b, seq_len, n_embd = x.shape
            q = self.attention_wq.forward(x)
            k = self.attention_wk.forward(x)
            v = self.attention_wv.forward(x)
            q = q.reshape(b, seq_len, self.n_head, self.head_dim).transpose(1, 2)
            k = k.reshape(b, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
            v = v.reshape(b, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2).contiguous()

            q = self.apply_rotary_emb(q, index_pos)
            k = self.apply_rotary_emb(k, index_pos)

            if self.kv_cache is not None and index_pos != 0:
                k_cache, v_cache = self.kv_cache
                k = torch.cat((k_cache, k), dim=2)
                v = torch.cat((v_cache, v), dim=2)
            self.kv_cache = (k, v)

            if use_sdpa:
                # GQA inside the kernel: no repeat_kv copies. Only used without a mask.
                y = F.scaled_dot_product_attention(
                    q, k, v, scale=1.0 / math.sqrt(self.head_dim), enable_gqa=True
                )
            else:
                n_rep = self.n_head // self.n_kv_head
                k = repeat_kv(k, n_rep)
                v = repeat_kv(v, n_rep)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
                if mask is not None:
                    mask = broadcast_as(mask, att.shape)
                    att = torch.where(mask.bool(), float("-inf"), att)
                att = torch.softmax(att, dim=-1)
                y = att @ v.contiguous()
            y = y.transpose(1, 2).reshape(b, seq_len, n_embd)
            return self.attention_wo.forward(y)


class ModelWeights:
    """A llama model built from a GGUF file, with a per-layer KV cache."""

    def __init__(
        self,
        config: LlamaConfig,
        tok_embeddings: torch.Tensor,
        layers: list[LayerWeights],
        norm: RmsNorm,
        output: QMatMul,
        device: torch.device,
        attention: str = "auto",
        strict: bool = False,
    ):
        if attention not in ATTENTION_MODES:
            raise ModelError(f"unknown attention mode {attention!r}: {', '.join(ATTENTION_MODES)}")
        self.config = config
        self.tok_embeddings = tok_embeddings
        self.layers = layers
        self.norm = norm
        self.output = output
        self.device = device
        self.attention = attention
        self.strict = strict
        self.vocab_size = int(tok_embeddings.shape[0])
        # (seq_len, kv_len) -> mask; grows forever, clear_kv_cache leaves it (as candle).
        self.masks: dict[tuple[int, int], torch.Tensor] = {}

    @classmethod
    def from_gguf(
        cls,
        content,
        f: BinaryIO,
        device: DeviceLike = "cpu",
        *,
        form: str | None = None,
        attention: str = "auto",
        strict: bool = False,
    ) -> ModelWeights:
        """Build from a parsed ``gguf_file.Content`` and its open file.

        ``form`` picks the QMatMul form for every projection and the output
        ("quantized", "f32", "f16"; default: candle's rule, see ``qtensor``).
        """
        device = as_device(device)
        if form is not None and form not in FORMS:
            raise ModelError(f"unknown QMatMul form {form!r}; choose one of {', '.join(FORMS)}")
        config = LlamaConfig.from_metadata(content.metadata)
        vocab = check_tensors(content, config, form)
        cos, sin = precompute_freqs_cis(config.rope_dim, config.rope_freq_base, device)

        def tensor(name: str) -> QTensor:
            return content.tensor(f, name, device)

        def qmatmul(name: str) -> QMatMul:
            return QMatMul(tensor(name), form)

        def rms_norm(name: str) -> RmsNorm:
            return RmsNorm(tensor(name).dequantize(), config.rms_norm_eps)

        tok_embeddings_q = tensor("token_embd.weight")
        tok_embeddings = dequantize_rows(tok_embeddings_q)
        norm = rms_norm("output_norm.weight")
        if "output.weight" in content.tensor_infos:
            output = qmatmul("output.weight")
        else:  # tied embeddings: the output layer shares token_embd.weight
            output = QMatMul(tok_embeddings_q, form)
        layers = []
        for i in range(config.block_count):
            p = f"blk.{i}"
            mlp = Mlp(
                qmatmul(f"{p}.ffn_gate.weight"),
                qmatmul(f"{p}.ffn_down.weight"),
                qmatmul(f"{p}.ffn_up.weight"),
            )
            layers.append(
                LayerWeights(
                    qmatmul(f"{p}.attn_q.weight"),
                    qmatmul(f"{p}.attn_k.weight"),
                    qmatmul(f"{p}.attn_v.weight"),
                    qmatmul(f"{p}.attn_output.weight"),
                    rms_norm(f"{p}.attn_norm.weight"),
                    mlp,
                    rms_norm(f"{p}.ffn_norm.weight"),
                    config,
                    cos,
                    sin,
                )
            )
        model = cls(config, tok_embeddings, layers, norm, output, device, attention, strict)
        model.vocab_size = vocab
        return model

    # -- the forward pass -------------------------------------------------

    def mask(self, seq_len: int, index_pos: int) -> torch.Tensor:
        key = (seq_len, index_pos + seq_len)
        mask = self.masks.get(key)
        if mask is None:
            mask = build_causal_mask(seq_len, index_pos).to(self.device)
            self.masks[key] = mask
        return mask

    def clear_kv_cache(self) -> None:
        """Drop every layer's KV cache (the mask cache stays, as in candle)."""
        for layer in self.layers:
            layer.kv_cache = None

    @property
    def kv_len(self) -> int:
        """Positions held in the KV cache (0 when empty)."""
        cache = self.layers[0].kv_cache if self.layers else None
        return 0 if cache is None else cache[0].shape[2]

    def _check_index_pos(self, index_pos: int) -> None:
        cached = self.kv_len
        if index_pos != 0 and index_pos != cached:
            raise IndexPosError(
                f"index_pos {index_pos} disagrees with the KV cache, which holds {cached} "
                f"positions: pass index_pos={cached} to continue, or 0 to start over"
            )

    def _check_input(self, x: Any) -> None:
        what = "strict=True: the input must be a 1 x T integer tensor of token ids"
        if not isinstance(x, torch.Tensor):
            raise InputError(f"{what}, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] < 1:
            raise InputError(f"{what}, got shape {list(x.shape)}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise InputError(f"{what}, got dtype {x.dtype}")
        lo, hi = int(x.min()), int(x.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"strict=True: token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )

    def _check_rope_range(self, index_pos: int, seq_len: int) -> None:
        rows = self.layers[0].cos.shape[0] if self.layers else MAX_SEQ_LEN
        if index_pos + seq_len > rows:
            raise IndexPosError(
                f"index_pos {index_pos} + seq_len {seq_len} = {index_pos + seq_len} passes "
                f"the RoPE table of {rows} positions (MAX_SEQ_LEN)"
            )

    def forward(self, x: torch.Tensor, index_pos: int, *, all_logits: bool = False) -> torch.Tensor:
        """Logits for token ids ``x`` of shape (batch, seq_len) starting at ``index_pos``.

        Returns (batch, vocab) for the last position, or (batch, seq_len, vocab)
        with ``all_logits=True``. ``strict=True`` first checks the input, ``index_pos``
        against the KV cache and ``index_pos + seq_len`` against the RoPE table.
        """
        if self.strict:
            self._check_input(x)
        if x.dim() != 2:
            raise ShapeError(f"unexpected rank, expected: 2, got: {x.dim()} ({list(x.shape)})")
        if index_pos < 0:
            raise ModelError(f"index_pos must be >= 0, got {index_pos}")
        _, seq_len = x.shape
        if self.strict:
            self._check_index_pos(index_pos)
            self._check_rope_range(index_pos, seq_len)
        mask = None if seq_len == 1 else self.mask(seq_len, index_pos)
        use_sdpa = self.attention == "sdpa" or (
            self.attention == "auto" and seq_len == 1 and self.device.type != "cpu"
        )
        if use_sdpa and mask is not None:
            raise ModelError("attention='sdpa' is only for single-token decode (no mask)")
        with span("model"):
            layer_in = F.embedding(x.to(self.device), self.tok_embeddings)
            for layer in self.layers:
                residual = layer_in
                h = layer.attention_norm.forward(layer_in)
                h = layer.forward_attn(h, mask, index_pos, use_sdpa) + residual
                with span("attn-mlp"):
                    residual = h
                    h = layer.ffn_norm.forward(h)
                    layer_in = layer.mlp.forward(h) + residual
            h = self.norm.forward(layer_in)
            if not all_logits:
                h = h[:, seq_len - 1, :]
            with span("output"):
                return self.output.forward(h)

    __call__ = forward


def load(path, device: DeviceLike = "cpu", **kwargs) -> tuple[ModelWeights, Any]:
    """Read a GGUF file and build the model: returns ``(model, content)``."""
    from .gguf_file import Content

    with open(path, "rb") as f:
        content = Content.read(f)
        model = ModelWeights.from_gguf(content, f, device, **kwargs)
    return model, content
