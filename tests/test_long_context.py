"""Long context in the fast CPU engine (issue 17).

* the decode attention kernel (``attn.c``: positions cut into pieces, spread over the
  threads, combined as in flash-decoding) against a float64 torch reference at lengths
  around and between the piece sizes, float32 and float16 caches: 2e-5 absolute on outputs
  of magnitude ~1 (float32 arithmetic, another summation order);
* chunked prefill equals whole prefill (logits to 1e-4 of their scale, the KV cache rows to
  float rounding): the same row-independent matmuls, only the attention's mask differs;
* positions past 4096 up to ``llama.context_length``: a tiny model of context 8192 decodes
  at position 4100+ and its C decode step equals its torch decode (the reference path);
  the cache reserves address space and takes memory only for the positions written;
* the float16 KV cache against the float32 one: teacher-forced logits within 2e-2 of their
  scale (the keys and values rounded to 11 bits), argmax agreement >= 95% on random weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import Typed
from qlib.gguf.constants import GGUFValueType
from qlib.llama import fast_cpu as fast
from qlib.llama.engine import load
from qlib.llama.errors import ModelError
from qlib.quants import cpu

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)


def _reference(qkv, kc, vc, pos, n_head, n_kv, d, cos, sin):
    """RoPE (pairs 2i, 2i+1) of q and k; softmax(q k^T / sqrt d) v over the cache's rows
    0..pos as they are (row pos: the one the kernel wrote); the k and v rows, exact."""
    x = qkv.view(-1, d).double().clone()
    c, s = cos[pos].double(), sin[pos].double()
    r = slice(0, n_head + n_kv)
    x0, x1 = x[r, 0::2].clone(), x[r, 1::2].clone()
    x[r, 0::2], x[r, 1::2] = x0 * c - x1 * s, x0 * s + x1 * c
    q, k, v = x[:n_head], x[n_head : n_head + n_kv], x[n_head + n_kv :]
    K, V = kc[:, : pos + 1].double(), vc[:, : pos + 1].double()
    qg = q.view(n_kv, -1, d) / math.sqrt(d)
    return (torch.softmax(qg @ K.transpose(1, 2), -1) @ V).reshape(-1), k, v


@needs_kernels
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 1, 16)])
def test_split_attention_matches_reference(kv, heads):
    n_head, n_kv, d = heads
    g = torch.Generator().manual_seed(n_head * d)
    ms = 700
    dtype = fast.KV_TYPES[kv]
    cos, sin = torch.randn(ms, d // 2, generator=g), torch.randn(ms, d // 2, generator=g)
    position = cpu.DecodePosition(cos, sin)
    kc = torch.randn(n_kv, ms, d, generator=g).to(dtype)
    vc = torch.randn(n_kv, ms, d, generator=g).to(dtype)
    out = torch.empty(n_head * d)
    for pos in (0, 15, 16, 47, 100, 255, 256, 699):
        for split in (0, 16, 48, 100):  # 0: pieces that fill the threads
            qkv = torch.randn((n_head + 2 * n_kv) * d, generator=g) * 2
            x = qkv.clone()
            call = cpu.attn_decode_plan(qkv, kc, vc, position, out, n_head=n_head, n_kv=n_kv,
                                        neox=False, split=split)  # fmt: skip
            position.at(pos)
            assert call() == 0
            ref, k_row, v_row = _reference(x, kc, vc, pos, n_head, n_kv, d, cos, sin)
            err = (out.double() - ref).abs().max().item()
            assert err < 2e-5, (pos, split, err)
            # the rows written: the float32 RoPE's, rounded once to the cache's type
            rtol = 1e-6 if kv == "f32" else 2**-10
            torch.testing.assert_close(kc[:, pos].double(), k_row, rtol=rtol, atol=1e-6)
            torch.testing.assert_close(vc[:, pos].double(), v_row, rtol=rtol, atol=1e-6)


@pytest.fixture(scope="module")
def long_file(tmp_path_factory):
    """A tiny llama (head_dim 64, 4 query / 2 KV heads) of context length 8192, Q8_0."""
    path = tmp_path_factory.mktemp("long") / "tiny-8k.gguf"
    ctx = {"llama.context_length": Typed(GGUFValueType.UINT32, 8192)}
    return write_tiny_llama(path, n_embd=256, n_head=4, n_kv_head=2, n_ff=512, vocab=256,
                            weight_type="Q8_0", extra_metadata=ctx)  # fmt: skip


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _scale(x: torch.Tensor) -> float:
    return x.abs().max().item()


def test_chunked_prefill_equals_whole(long_file):
    model, _ = load(long_file, engine="fast", prefill="int8")
    ids = _ids(300)
    whole = model.forward(ids, 0, all_logits=True)[0]
    cache_whole = model.cache[:, :, :, :300].clone()
    model.clear_kv_cache()
    parts, pos = [], 0
    for n in (1, 63, 64, 100, 72):  # one token, odd sizes, 300 in all
        parts.append(model.forward(ids[:, pos : pos + n], pos, all_logits=True)[0])
        pos += n
    chunked = torch.cat(parts)
    assert model.kv_len == 300
    assert (chunked - whole).abs().max() <= 1e-4 * _scale(whole)
    assert torch.allclose(model.cache[:, :, :, :300], cache_whole, rtol=1e-5, atol=1e-5)


def test_ffn_row_chunks_equal_whole(long_file):
    """The int8 prefill runs the FFN over ``mlp_rows`` rows at a time: rows are independent in
    every part of it, so any chunking gives the same logits and cache, bit for bit."""
    model, _ = load(long_file, engine="fast", prefill="int8")
    ids = _ids(300)
    runs = []
    for rows in (100_000, 64, 37):  # one chunk; equal chunks and a short last one
        model.mlp_rows = rows
        model.clear_kv_cache()
        runs.append((model.forward(ids, 0, all_logits=True), model.cache[:, :, :, :300].clone()))
    for logits, cache in runs[1:]:
        assert torch.equal(logits, runs[0][0]) and torch.equal(cache, runs[0][1])


def test_positions_past_4096(long_file):
    model, _ = load(long_file, engine="fast", prefill="int8")
    assert model.max_seq_len == 8192  # the file's llama.context_length
    assert model.cos.shape[0] == 4096  # the RoPE tables grow with the cache
    per_pos = 2 * 2 * 2 * 64 * 4  # layers, k / v, KV heads, d, float32
    rsv = model.kv_bytes()  # the cache holds kv_first positions at first, not 8192
    assert rsv["used"] == 0 and rsv["reserved"] == model.kv_first * per_pos
    n = 4100
    ids = _ids(n + 8, seed=1)
    model.forward(ids[:, :n], 0)
    kv = model.kv_bytes()  # grown to 1.25x what the prompt needs (steps of 256), not to 8192
    assert kv["used"] == n * per_pos and kv["reserved"] == 5376 * per_pos
    assert model.cos.shape[0] == 5376
    if kv["resident"] is not None:
        assert kv["resident"] <= kv["reserved"]
    state = model.cache[:, :, :, : n + 8].clone()
    c_logits = [model.forward(ids[:, n + i : n + i + 1], n + i) for i in range(8)]
    assert model.kv_len == n + 8
    # the same steps through the torch decode path (no C plan): the reference
    model.cache[:, :, :, : n + 8].copy_(state)
    model._kv_len, plan = n, model._plan
    model._plan = None
    try:
        t_logits = [model.forward(ids[:, n + i : n + i + 1], n + i) for i in range(8)]
    finally:
        model._plan = plan
    for a, b in zip(c_logits, t_logits, strict=True):
        assert (a - b).abs().max() <= 5e-3 * _scale(b)
    with pytest.raises(ModelError, match="exceed max_seq_len 8192"):
        model.forward(_ids(8192 - n - 7), n + 8)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_cache_growth_changes_nothing(long_file, monkeypatch, kv_type):
    """The KV cache holds ``kv_first`` positions at first and is made again, 1.5 times as
    large, when a forward needs more: the positions held are copied, the one-call decode step is
    prepared again on the new buffer, and logits and cache are bit for bit those of a cache
    made for every position at once (a prefill of 250, decode steps across 256 and 512), on
    2 MB pages or 4 KB ones (``kv_hugepages``)."""
    runs = []
    for first, huge in (
        (fast.FastModel.kv_first, True),
        (8192, True),
        (fast.FastModel.kv_first, False),
    ):
        monkeypatch.setattr(fast.FastModel, "kv_first", first)
        model, _ = load(long_file, engine="fast", prefill="int8", kv_type=kv_type,
                        kv_hugepages=huge)  # fmt: skip
        ids = _ids(250, seed=3)
        logits = [model.forward(ids, 0)]
        for pos in range(250, 520):
            logits.append(model.forward(logits[-1].argmax(-1).view(1, 1), pos))
        assert model.decode_chained and model.kv_len == 520
        runs.append((model.cache.shape[3], torch.stack(logits), model.cache[:, :, :, :520]))
    (grown, a, cache_a), (whole, b, cache_b), (small_pages, c, cache_c) = runs
    assert grown == small_pages == 768 and whole == 8192  # 256 -> 512 (257 rounded up) -> 768
    assert torch.equal(a, b) and torch.equal(cache_a, cache_b)
    assert torch.equal(a, c) and torch.equal(cache_a, cache_c)  # 4 KB pages: the same


def test_a_prompt_filling_the_cache_leaves_room_for_the_next_token(long_file):
    """A prompt of exactly ``kv_first`` positions grows the cache in its own forward (nothing to
    copy yet), so the first decode step runs on the same buffer and decode plan."""
    model, _ = load(long_file, engine="fast", prefill="int8")
    n = model.kv_first
    logits = model.forward(_ids(n, seed=4), 0)
    cache, plan = model.cache, model._plan
    assert cache.shape[3] > n
    model.forward(logits.argmax(-1).view(1, 1), n)
    assert model.cache is cache and model._plan is plan and model.kv_len == n + 1


def test_max_seq_len_option(long_file):
    model, _ = load(long_file, engine="fast", prefill="int8", max_seq_len=5000)
    assert model.max_seq_len == 5000
    with pytest.raises(ModelError, match="max_seq_len"):
        load(long_file, engine="fast", prefill="int8", max_seq_len=0)
    with pytest.raises(ModelError, match="kv_type"):
        load(long_file, engine="fast", prefill="int8", kv_type="int4")


@pytest.mark.parametrize("c_kernels", [True, False])
def test_f16_cache_against_f32(long_file, c_kernels):
    if c_kernels and not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    ids = _ids(200, seed=2)
    logits = {}
    for kv in ("f32", "f16"):
        model, _ = load(long_file, engine="fast", prefill="int8", kv_type=kv, max_seq_len=512)
        assert model.cache.dtype == fast.KV_TYPES[kv]
        if not c_kernels:
            model._plan = None
        model.forward(ids[:, :100], 0)  # prefill, then 100 decode steps (teacher forced)
        logits[kv] = torch.cat([model.forward(ids[:, i : i + 1], i) for i in range(100, 200)])
    a, b = logits["f16"], logits["f32"]
    assert (a - b).abs().max() <= 2e-2 * _scale(b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


def test_f16_cache_prefill_in_c(long_file):
    """A float16 cache keeps the int8 prefill in C (its attention storing and reading the
    half rows): against the torch prefill on the same cache type, logits within the bound
    of the C and torch decode paths (5e-3 x max: int8 codes that flip with the float32
    order), the cache rows likewise (layer 0's within one half ulp); chunked equals whole."""
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    ids = _ids(300, seed=3)
    model, _ = load(long_file, engine="fast", prefill="int8", kv_type="f16")
    assert model._c_path(300) is not None
    c_logits = model.forward(ids, 0, all_logits=True)[0]
    c_cache = model.cache[:, :, :, :300].clone()
    ref, _ = load(long_file, engine="fast", prefill="int8", kv_type="f16")
    ref._c_int8_prefill = False
    assert ref._c_path(300) is None
    t_logits = ref.forward(ids, 0, all_logits=True)[0]
    assert (c_logits - t_logits).abs().max() <= 5e-3 * _scale(t_logits)
    t_cache = ref.cache[:, :, :, :300].float()
    # layer 0's rows: the same float32 values up to rounding, one half ulp apart at most;
    # later layers' rows carry the earlier layers' differences, bounded like the logits
    torch.testing.assert_close(c_cache[0].float(), t_cache[0], rtol=2**-10, atol=1e-3)
    assert (c_cache.float() - t_cache).abs().max() <= 5e-3 * _scale(t_cache)
    model.clear_kv_cache()
    parts, pos = [], 0
    for n in (100, 1, 127, 72):
        parts.append(model.forward(ids[:, pos : pos + n], pos, all_logits=True)[0])
        pos += n
    assert (torch.cat(parts) - c_logits).abs().max() <= 1e-4 * _scale(c_logits)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_int8_attention_prefill(long_file, kv_type):
    """``prefill="int8-attn"`` (int8 attention products) against ``prefill="int8"`` (float32
    attention) on the same cache type: the same C path, logits within 3e-2 of their scale
    (the kernel test bounds one attention at 3e-2; 2 layers here), argmax agreement >= 95%
    over all 300 positions; chunked equals whole (each row's rounding is its own)."""
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    ids = _ids(300, seed=5)
    model, _ = load(long_file, engine="fast", prefill="int8-attn", kv_type=kv_type)
    assert model._c_path(300) == model._prefill_int8
    a = model.forward(ids, 0, all_logits=True)[0]
    ref, _ = load(long_file, engine="fast", prefill="int8", kv_type=kv_type)
    b = ref.forward(ids, 0, all_logits=True)[0]
    assert (a - b).abs().max() <= 3e-2 * _scale(b)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
    assert not torch.equal(a, b)  # the int8 products did run
    model.clear_kv_cache()
    parts, pos = [], 0
    for n in (100, 127, 73):  # (a chunk of 1 is a decode step: float32 attention)
        parts.append(model.forward(ids[:, pos : pos + n], pos, all_logits=True)[0])
        pos += n
    assert (torch.cat(parts) - a).abs().max() <= 1e-4 * _scale(a)


def test_f16_cache_bf16_prefill_in_c(long_file):
    """The bf16 prefill (oneDNN matmuls, C calls between them) with a float16 cache: its
    attention is the flash kernel on bf16 rows; against the torch bf16 prefill on the same
    cache type within the bf16 bound (2 x 2^-8 x max)."""
    if not cpu.available():
        pytest.skip(f"C kernels unavailable: {cpu.unavailable_reason()}")
    ids = _ids(200, seed=4)
    model, _ = load(long_file, engine="fast", prefill="bf16", kv_type="f16", amx=False)
    assert model._c_path(200) == model._prefill_fused
    ref, _ = load(long_file, engine="fast", prefill="bf16", kv_type="f16", amx=False)
    ref._fused_prefill = False
    a, b = (m.forward(ids, 0, all_logits=True)[0] for m in (model, ref))
    assert (a - b).abs().max() <= 2 * 2**-8 * _scale(b)


def test_prompt_ids_repeat(tmp_path):
    from qlib.suite.bench import prompt_ids

    f = tmp_path / "p.txt"
    f.write_text("abc")
    enc = lambda text: [ord(ch) for ch in text]  # noqa: E731
    assert prompt_ids(enc, 7, f, repeat=True) == [97, 98, 99, 97, 98, 99, 97]
    with pytest.raises(ValueError, match="only 3 tokens"):
        prompt_ids(enc, 7, f)


@needs_kernels
def test_bench_context_point(smollm2_path):
    """``bench --context N``: N prompt tokens (the passage repeated), decode from there."""
    from qlib.suite.bench import run_in_subprocess

    r = run_in_subprocess(["--engine", "fast", "--context", "750", "--steps", "2", "--reps", "1",
                           "--kv-type", "f16", "--threads", "2"])  # fmt: skip
    assert "error" not in r, r
    assert r["prompt_tokens"] == 750 and r["context"] == 750  # the passage has ~720 tokens
    assert r["kv_type"] == "f16" and r["engine"] == "fast"


def test_the_cuda_cache_that_does_not_fit_is_named():
    """The fast CUDA engine's static KV cache for a file's (long or corrupt) context: a
    ``ModelError`` naming the positions and the GiB before any allocation, when it would not
    fit the device's free memory (checked without a GPU: the sizes are arithmetic)."""
    from qlib.llama.config import LlamaConfig
    from qlib.llama.errors import ModelError
    from qlib.llama.fast_cuda import check_cache_fits

    md = {"llama.attention.head_count": 32, "llama.attention.head_count_kv": 8,
          "llama.block_count": 16, "llama.embedding_length": 2048,
          "llama.rope.dimension_count": 64,
          "llama.attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip
    c = LlamaConfig.from_metadata(md)
    check_cache_fits(c, 131072, torch.float32, 80 << 30, "cuda:0")  # 8 GiB of 80: fits
    check_cache_fits(c, 1 << 31, torch.float32, None, "cpu")  # no device limit known
    with pytest.raises(ModelError, match=r"2147483648 positions needs 131584\.0 GiB, more than "
                                         r"the 80\.0 GiB free on cuda:0"):  # fmt: skip
        check_cache_fits(c, 1 << 31, torch.float32, 80 << 30, "cuda:0")


def test_the_cuda_prefill_copies_only_where_they_fit(tmp_path):
    """The fast CUDA engine's default prefill (``default_prefill``): float32 copies of the
    layers' weights for cuBLAS where they take at most half the GPU's free memory, else the
    packed weights' GEMM, saying why (sizes only: no GPU needed)."""
    from synthetic import write_tiny_llama

    from qlib.gguf import Content
    from qlib.llama.fast_cuda import default_prefill

    content = Content.read_path(write_tiny_llama(tmp_path / "m.gguf", n_embd=256, n_ff=512))
    layers = sum(i.n_elements for n, i in content.tensor_infos.items()
                 if n.startswith("blk.") and len(i.shape) == 2)  # fmt: skip
    assert default_prefill(content, None)[0] == "f32"
    assert default_prefill(content, 8 * layers)[0] == "f32"  # 4 bytes a weight: half of it
    mode, why = default_prefill(content, 8 * layers - 1)
    assert mode == "packed" and "float32 copies of the weights would take" in why
