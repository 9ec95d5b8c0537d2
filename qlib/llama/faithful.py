"""The llama forward pass of candle 0.11.0's ``quantized_llama.rs``, in torch.

``ModelWeights.from_gguf(content, f, device)`` reads the ``llama.*`` keys and
the tensors by name; ``forward(x, index_pos)`` runs embedding -> 30 x
(RmsNorm, attention with a per-layer KV cache, RmsNorm, SiLU MLP) -> RmsNorm
-> logits of the last position. Everything candle does is kept, including its
sharp edges, because the experiments measure them:

* a missing required key fails with ``cannot find <key> in metadata``, a
  missing ``llama.rope.freq_base`` silently becomes 10000;
* the RoPE variant is picked from ``general.architecture`` (NEOX list); RoPE
  scaling (``rope_freqs.weight``, ``llama.rope.scaling.*``) is ignored, as candle
  does (``strict=True`` refuses such a file, saying so; the fast engines honour it);
  so are the projections' optional biases (``blk.N.attn_q.bias``, ...: a warning;
  ``strict=True`` refuses; the fast engines add them, as llama.cpp);
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

Unlike candle, the head size is ``llama.attention.key_length`` where the file gives one
(Mistral NeMo's and Mistral Small's 128 in 5120-wide models, as llama.cpp reads them; candle
takes ``embedding_length / head_count`` and cannot run those files); elsewhere the same.

Unlike candle, ``from_gguf`` checks the file before it reads any tensor data or
builds the RoPE tables: metadata types and ranges, that every tensor exists
with the shape the configuration implies and a type qlib can compute with. A
file that fails raises ``ModelFileError`` (a ``GGUFError`` too), naming the key
or tensor; a model that loads runs.

Options that go beyond candle are explicit, and their defaults are candle:

* ``all_logits`` (``forward``): every position's logits, for teacher forcing;
* ``attention``: "auto" (candle: naive, SDPA for single-token steps off the
  CPU, as candle's Metal path), "naive" (repeat_kv, two matmuls, mask, softmax),
  "sdpa" (torch's SDPA with GQA in the kernel; with the cat cache only for
  single-token steps), "fold" (``sdpa_folded``: plain SDPA over the query heads
  folded onto their KV head; static cache only);
* ``form``: the QMatMul form of every projection;
* ``strict``: the input, index_pos and RoPE-range checks above;
* ``kv_cache``: "cat" (candle: each step ``torch.cat``s the new keys and values
  onto a copy of the cache) or "static": per layer, K and V buffers of
  ``max_seq_len`` positions (default ``MAX_SEQ_LEN``) allocated at the first
  forward and kept by ``clear_kv_cache``; a forward writes its positions in
  place at ``index_pos .. index_pos + seq_len - 1`` and attends to a view of
  the first ``index_pos + seq_len`` (no cat, no copy of the cache). With it
  ``attention="auto"`` is SDPA with GQA for every step (the causal mask as a
  boolean ``attn_mask``), and "sdpa" may take a mask; "naive" and "fold" run
  on the views. Since ``index_pos`` places the writes, a wrong one reads
  positions never written (zeros or an older sequence's) instead of failing
  like candle's broadcast; a forward past ``max_seq_len`` raises ``ModelError``.
  ``set_kv_cache`` switches a built model between the two (the cache is dropped).
  The logits equal the cat cache's up to float rounding (SDPA vs the naive
  matmuls), not bit for bit.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, BinaryIO

import torch
import torch.nn.functional as F

from .. import progress
from ..devices import DeviceLike, as_device
from ..quants.api import dequantize_torch
from ..quants.qtensor import FORMS, QMatMul, QTensor
from ..spans import span
from . import moe
from .config import (
    MAX_SEQ_LEN,
    LlamaConfig,
    bias_names,
    check_tensors,
    precompute_freqs_cis,
    scaling_ignored,
)
from .errors import IndexPosError, InputError, ModelError, ShapeError

ATTENTION_MODES = ("auto", "naive", "sdpa", "fold")
KV_CACHES = ("cat", "static")


def dequantize_rows(q: QTensor, max_floats: int = 1 << 22) -> torch.Tensor:
    """``q.dequantize()`` a few rows at a time into one float32 tensor (no full-size temps)."""
    if len(q.shape) != 2:
        return q.dequantize()
    n, k = q.shape
    out = torch.empty(n, k, dtype=torch.float32, device=q.device)
    step = max(1, max_floats // max(k, 1))
    for i in range(0, n, step):
        j = min(n, i + step)
        out[i:j] = dequantize_torch(q.data[i:j], q.dtype.name, (j - i, k))
    return out


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


def sdpa_folded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Grouped-query attention as plain SDPA: each KV head's query heads become rows.

    q (b, n_head, t, d) is viewed as (b, n_kv_head, n_rep * t, d) (query head
    ``h = kv * n_rep + r``, the order of ``repeat_kv``), so K and V need no
    copies and no GQA support from the kernel; ``mask`` (t, kv_len), 1 = may
    not attend, is repeated for the n_rep row blocks. Returns (b, n_head, t, d).
    """
    b, n_head, t, d = q.shape
    n_kv = k.shape[1]
    qf = q.reshape(b, n_kv, (n_head // n_kv) * t, d)
    attn_mask = None if mask is None else (mask == 0).repeat(n_head // n_kv, 1)
    y = F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask, scale=scale)
    return y.reshape(b, n_head, t, d)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    core: str,
    scale: float,
) -> torch.Tensor:
    """Attention of q (b, n_head, t, d) over k, v (b, n_kv_head, kv_len, d): (b, n_head, t, d).

    ``core`` "naive" is candle's (repeat_kv copies, q @ k^T, scale, ``mask`` via
    ``where`` with candle's broadcast error, softmax, att @ v); "sdpa" is torch's
    SDPA with GQA in the kernel (``mask``, 1 = may not attend, as a boolean
    ``attn_mask``); "fold" is ``sdpa_folded``.
    """
    if core == "sdpa":
        attn_mask = None if mask is None else mask == 0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=True
        )
    if core == "fold":
        return sdpa_folded(q, k, v, mask, scale)
    n_rep = q.shape[1] // k.shape[1]
    k = repeat_kv(k, n_rep)
    v = repeat_kv(v, n_rep)
    att = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        mask = broadcast_as(mask, att.shape)
        att = torch.where(mask.bool(), float("-inf"), att)
    att = torch.softmax(att, dim=-1)
    return att @ v.contiguous()


def check_options(attention: str, kv_cache: str, max_seq_len: int | None) -> int | None:
    """``check_kv_cache``, and that ``attention`` is a mode that goes with ``kv_cache``."""
    if attention not in ATTENTION_MODES:
        raise ModelError(f"unknown attention mode {attention!r}: {', '.join(ATTENTION_MODES)}")
    static_len = check_kv_cache(kv_cache, max_seq_len)
    if attention == "fold" and static_len is None:
        raise ModelError("attention 'fold' needs kv_cache='static'")
    return static_len


def check_kv_cache(kv_cache: str, max_seq_len: int | None) -> int | None:
    """Positions of the static cache (None for "cat"); a clear ``ModelError`` for bad values."""
    if kv_cache not in KV_CACHES:
        raise ModelError(f"unknown kv_cache {kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
    if kv_cache == "cat":
        if max_seq_len is not None:
            raise ModelError("max_seq_len sizes the static KV cache; kv_cache='cat' has none")
        return None
    n = MAX_SEQ_LEN if max_seq_len is None else max_seq_len
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SEQ_LEN:
        raise ModelError(
            f"max_seq_len must be an int in 1..{MAX_SEQ_LEN} (the RoPE table), got {n!r}"
        )
    return n


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


class MoE:
    """candle's ``MlpOrMoe::MoE`` (a Mixtral-style llama: ``llama.expert_count`` > 1): the
    router's ``moe.route`` of each token, each expert's MLP run on the tokens that chose it
    and added in, expert by expert (``moe.combine``)."""

    def __init__(self, gate_inp: QMatMul, experts: list[Mlp], n_expert_used: int):
        self.feed_forward_gate_inp, self.experts = gate_inp, experts
        self.n_expert_used = n_expert_used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b_size, seq_len, hidden = x.shape
        xs = x.reshape(-1, hidden)
        ys = moe.ffn(xs, self.feed_forward_gate_inp.forward, [e.forward for e in self.experts],
                     self.n_expert_used)  # fmt: skip
        return ys.reshape(b_size, seq_len, hidden)


class LayerWeights:
    """One transformer block: attention with its KV cache, and the MLP (or the experts)."""

    def __init__(
        self,
        wq: QMatMul,
        wk: QMatMul,
        wv: QMatMul,
        wo: QMatMul,
        attention_norm: RmsNorm,
        mlp: Mlp | MoE,
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
        # kv_cache="static" only: the (K, V) buffers of max_seq_len positions
        self.kv_buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_rotary_emb(self, x: torch.Tensor, index_pos: int) -> torch.Tensor:
        with span("attn-rot"):
            seq_len = x.shape[2]
            cos = narrow(self.cos, 0, index_pos, seq_len)
            sin = narrow(self.sin, 0, index_pos, seq_len)
            x = x.contiguous()
            return rope_neox(x, cos, sin) if self.rope_is_neox else rope_i(x, cos, sin)

    def put_kv(
        self, k: torch.Tensor, v: torch.Tensor, index_pos: int, static_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache the new keys and values (b, n_kv_head, t, d); return every cached one.

        ``static_len`` None: candle's cache, dropped when ``index_pos == 0``, else
        the new positions are concatenated (``index_pos`` is not used otherwise).
        A number: the static cache, buffers of that many positions (allocated on
        first use, again if the batch, dtype or device changes) written at
        ``index_pos``; ``kv_cache`` is then views of their first ``index_pos + t``.
        """
        if static_len is None:
            if self.kv_cache is not None and index_pos != 0:
                k_cache, v_cache = self.kv_cache
                k = torch.cat((k_cache, k), dim=2)
                v = torch.cat((v_cache, v), dim=2)
            self.kv_cache = (k, v)
            return k, v
        end = index_pos + k.shape[2]
        if end > static_len:
            raise ModelError(
                f"the static KV cache holds {static_len} positions (max_seq_len); index_pos "
                f"{index_pos} + seq_len {k.shape[2]} = {end} does not fit"
            )
        want = ((k.shape[0], k.shape[1], static_len, k.shape[3]), k.dtype, k.device)
        bufs = self.kv_buffers
        if bufs is None or (bufs[0].shape, bufs[0].dtype, bufs[0].device) != want:
            shape = want[0]
            with torch.inference_mode(False):  # plain tensors: writable in and out of it
                bufs = tuple(torch.zeros(shape, dtype=k.dtype, device=k.device) for _ in "kv")
            self.kv_buffers = bufs
        k_buf, v_buf = bufs
        k_buf[:, :, index_pos:end] = k
        v_buf[:, :, index_pos:end] = v
        self.kv_cache = (k_buf[:, :, :end], v_buf[:, :, :end])
        return self.kv_cache

    def forward_attn(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None,
        index_pos: int,
        core: str = "naive",
        static_len: int | None = None,
    ) -> torch.Tensor:
        """Attention block: q, k, v projections, RoPE, the KV cache (``put_kv``), ``attend``."""
        with span("attn"):
            b, seq_len, _ = x.shape
            q = self.attention_wq.forward(x)
            k = self.attention_wk.forward(x)
            v = self.attention_wv.forward(x)
            q = q.reshape(b, seq_len, self.n_head, self.head_dim).transpose(1, 2)
            k = k.reshape(b, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2)
            v = v.reshape(b, seq_len, self.n_kv_head, self.head_dim).transpose(1, 2).contiguous()

            q = self.apply_rotary_emb(q, index_pos)
            k = self.apply_rotary_emb(k, index_pos)

            k, v = self.put_kv(k, v, index_pos, static_len)
            y = attend(q, k, v, mask, core, 1.0 / math.sqrt(self.head_dim))
            y = y.transpose(1, 2).reshape(b, seq_len, self.n_head * self.head_dim)
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
        kv_cache: str = "cat",
        max_seq_len: int | None = None,
    ):
        check_options(attention, kv_cache, max_seq_len)
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
        self._kv_cache_mode = "cat"
        self._static_len: int | None = None  # positions of the static cache; None: cat
        self.set_kv_cache(kv_cache, max_seq_len)

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
        kv_cache: str = "cat",
        max_seq_len: int | None = None,
    ) -> ModelWeights:
        """Build from a parsed ``gguf.Content`` and its open file.

        ``form`` picks the QMatMul form for every projection and the output
        ("quantized", "f32", "f16"; default: candle's rule, see ``qtensor``).
        ``kv_cache`` "cat" (candle's) or "static" (buffers of ``max_seq_len``
        positions, default ``MAX_SEQ_LEN``; see the module docstring).
        """
        device = as_device(device)
        if form is not None and form not in FORMS:
            raise ModelError(f"unknown QMatMul form {form!r}; choose one of {', '.join(FORMS)}")
        check_options(attention, kv_cache, max_seq_len)  # before any tensor is read
        config = LlamaConfig.from_metadata(content.metadata)
        vocab = check_tensors(content, config, form)
        ignored = scaling_ignored(config, "rope_freqs.weight" in content.tensor_infos)
        if strict and ignored:
            raise ModelError(
                f"strict=True: this file asks for RoPE {ignored}, which candle's quantized_llama "
                "(this engine) ignores; the fast engine (engine='fast') applies it"
            )
        biases = bias_names(content.tensor_infos)
        if biases:
            why = (f"this file has projection biases ({biases[0]} and {len(biases) - 1} more), "
                   "which candle's quantized_llama (this engine) ignores; the fast engine "
                   "(engine='fast') adds them, as llama.cpp does")  # fmt: skip
            if strict:
                raise ModelError(f"strict=True: {why}")
            warnings.warn(why, stacklevel=2)
        cos, sin = precompute_freqs_cis(config.rope_dim, config.rope_freq_base, device)

        def tensor(name: str) -> QTensor:
            return content.tensor(f, name, device)

        def qmatmul(name: str) -> QMatMul:
            return QMatMul(tensor(name), form)

        def rms_norm(name: str) -> RmsNorm:
            return RmsNorm(tensor(name).dequantize(), config.rms_norm_eps)

        def experts(p: str) -> list[Mlp]:
            return [Mlp(QMatMul(g, form), QMatMul(d, form), QMatMul(u, form))
                    for g, u, d in moe.expert_matrices(tensor, p, config.expert_count,
                                                       content.tensor_infos)]  # fmt: skip

        tok_embeddings_q = tensor("token_embd.weight")
        tok_embeddings = dequantize_rows(tok_embeddings_q)
        norm = rms_norm("output_norm.weight")
        if "output.weight" in content.tensor_infos:
            output = qmatmul("output.weight")
        else:  # tied embeddings: the output layer shares token_embd.weight
            output = QMatMul(tok_embeddings_q, form)
        layers = []
        for i in progress.layers(range(config.block_count), config.block_count):
            p = f"blk.{i}"
            if config.expert_count > 1:
                mlp = MoE(qmatmul(f"{p}.ffn_gate_inp.weight"), experts(p), config.expert_used_count)
            else:
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
        model = cls(
            config,
            tok_embeddings,
            layers,
            norm,
            output,
            device,
            attention,
            strict,
            kv_cache,
            max_seq_len,
        )
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
        """Drop every layer's KV cache (the mask cache stays, as in candle).

        A static cache keeps its buffers; only the positions held are forgotten.
        """
        for layer in self.layers:
            layer.kv_cache = None

    @property
    def kv_cache_mode(self) -> str:
        """The KV cache: "cat" (candle's) or "static" (preallocated buffers)."""
        return self._kv_cache_mode

    @property
    def max_seq_len(self) -> int | None:
        """Positions the static cache holds (None with the cat cache)."""
        return self._static_len

    def set_kv_cache(self, kv_cache: str, max_seq_len: int | None = None) -> None:
        """Switch to the "cat" or the "static" KV cache (``max_seq_len`` positions, static only).

        What is cached is dropped; static buffers are allocated at the next forward.
        """
        self._static_len = check_kv_cache(kv_cache, max_seq_len)
        self._kv_cache_mode = kv_cache
        for layer in self.layers:
            layer.kv_cache = None
            layer.kv_buffers = None

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

    def _attention_core(self, seq_len: int) -> str:
        """``attend``'s core for ``seq_len`` new tokens, from ``attention`` and the cache."""
        attention = self.attention
        if attention not in ATTENTION_MODES:
            raise ModelError(f"unknown attention mode {attention!r}: {', '.join(ATTENTION_MODES)}")
        if self._static_len is not None:  # static cache: SDPA unless asked otherwise
            return "sdpa" if attention == "auto" else attention
        if attention == "fold":
            raise ModelError("attention 'fold' needs kv_cache='static'")
        use_sdpa = attention == "sdpa" or (
            attention == "auto" and seq_len == 1 and self.device.type != "cpu"
        )
        if use_sdpa and seq_len > 1:
            raise ModelError("attention='sdpa' is only for single-token decode (no mask)")
        return "sdpa" if use_sdpa else "naive"

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
        core = self._attention_core(seq_len)
        static_len = self._static_len
        with span("model"):
            layer_in = F.embedding(x.to(self.device), self.tok_embeddings)
            for layer in self.layers:
                residual = layer_in
                h = layer.attention_norm.forward(layer_in)
                h = layer.forward_attn(h, mask, index_pos, core, static_len) + residual
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
