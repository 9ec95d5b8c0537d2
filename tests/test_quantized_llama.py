"""ModelWeights on tiny synthetic llama GGUFs: candle's behaviour, against a hand-written reference.

The reference below is written independently of qlib.llama.faithful: RoPE
through complex multiplication (as Meta's original llama code), attention with
GQA by indexing, no KV cache. Agreement is to 2e-5 (float32 rounding of a
2-layer model of width 64, where values are O(1)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import Content, GGUFError, GGUFValueType, Typed, write
from qlib.llama.config import MAX_SEQ_LEN
from qlib.llama.errors import IndexPosError, InputError, ModelError, ModelFileError, ShapeError
from qlib.llama.faithful import ModelWeights, dequantize_rows
from qlib.quants.qtensor import QTensor

N_HEAD, N_KV, N_EMBD, VOCAB = 4, 2, 64, 256
VT = GGUFValueType
TOL = 2e-5


def build(path, **kw) -> ModelWeights:
    with open(path, "rb") as f:
        content = Content.read(f)
        return ModelWeights.from_gguf(content, f, "cpu", **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    path, weights = write_tiny_llama(path, return_weights=True)
    return path, {k: torch.from_numpy(v) for k, v in weights.items()}


def reference_logits(w, ids, n_layer=2, freq_base=10000.0, neox=False, eps=1e-5):
    """Every position's logits, straight from the weights (no cache, no qlib code)."""
    hd = N_EMBD // N_HEAD
    t = len(ids)
    x = w["token_embd.weight"][torch.tensor(ids)]
    freqs = 1.0 / freq_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(t, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)  # (t, hd/2)

    def rope(v):  # v: (t, heads, hd)
        if neox:
            pairs = torch.complex(v[..., : hd // 2].double(), v[..., hd // 2 :].double())
            out = pairs * rot[:, None, :]
            return torch.cat((out.real, out.imag), -1).float()
        pairs = torch.view_as_complex(v.double().reshape(*v.shape[:-1], hd // 2, 2).contiguous())
        return torch.view_as_real(pairs * rot[:, None, :]).reshape(v.shape).float()

    def norm(v, weight):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight

    causal = torch.ones(t, t).tril().bool()
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope((h @ w[p + "attn_q.weight"].T).reshape(t, N_HEAD, hd))
        k = rope((h @ w[p + "attn_k.weight"].T).reshape(t, N_KV, hd))
        v = (h @ w[p + "attn_v.weight"].T).reshape(t, N_KV, hd)
        heads = []
        for head in range(N_HEAD):
            kv = head // (N_HEAD // N_KV)
            s = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            s = s.masked_fill(~causal, float("-inf")).softmax(-1)
            heads.append(s @ v[:, kv])
        x = x + torch.cat(heads, -1) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "ffn_gate.weight"].T)
        x = x + (gate * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
    x = norm(x, w["output_norm.weight"])
    out = w.get("output.weight", w["token_embd.weight"])
    return x @ out.T


IDS = [3, 17, 42, 99, 5, 250, 7, 7, 128, 64, 1, 0, 33]


def test_prefill_matches_reference(tiny):
    path, w = tiny
    model = build(path, form="f32")
    got = model.forward(torch.tensor([IDS]), 0, all_logits=True)[0]
    ref = reference_logits(w, IDS)
    assert got.shape == (len(IDS), VOCAB)
    assert (got - ref).abs().max().item() < TOL


def test_last_position_only_by_default(tiny):
    model = build(tiny[0], form="f32")
    last = model.forward(torch.tensor([IDS]), 0)
    model.clear_kv_cache()
    every = model.forward(torch.tensor([IDS]), 0, all_logits=True)
    assert last.shape == (1, VOCAB)
    # one row vs a 13-row matmul: BLAS may round differently, nothing more
    assert (last[0] - every[0, -1]).abs().max().item() < 1e-5


def test_incremental_decode_matches_full_forward(tiny):
    path, w = tiny
    model = build(path, form="f32")
    ref = reference_logits(w, IDS)
    model.forward(torch.tensor([IDS[:5]]), 0)
    for pos in range(5, len(IDS)):
        logits = model.forward(torch.tensor([[IDS[pos]]]), pos)
        assert (logits[0] - ref[pos]).abs().max().item() < TOL
    assert model.kv_len == len(IDS)


def test_chunked_prefill_right_and_wrong_index_pos(tiny):
    path, w = tiny
    model = build(path, form="f32")
    ref = reference_logits(w, IDS)
    model.forward(torch.tensor([IDS[:8]]), 0)
    ok = model.forward(torch.tensor([IDS[8:]]), 8)
    assert (ok[0] - ref[-1]).abs().max().item() < TOL
    model.forward(torch.tensor([IDS[:8]]), 0)
    with pytest.raises(ShapeError) as err:
        model.forward(torch.tensor([IDS[8:]]), 5)
    # candle's words: a broadcast error that never mentions index_pos
    assert str(err.value) == f"cannot broadcast [5, 10] to [1, {N_HEAD}, 5, 13]"
    assert "index_pos" not in str(err.value)


def test_index_pos_zero_drops_the_cache(tiny):
    model = build(tiny[0], form="f32")
    model.forward(torch.tensor([IDS]), 0)
    fresh = model.forward(torch.tensor([IDS[:4]]), 0)
    assert model.kv_len == 4
    model2 = build(tiny[0], form="f32")
    assert torch.equal(fresh, model2.forward(torch.tensor([IDS[:4]]), 0))


def test_wrong_decode_index_pos_is_silent_unless_strict(tiny):
    model = build(tiny[0], form="f32")
    model.forward(torch.tensor([IDS]), 0)
    model.forward(torch.tensor([[5]]), len(IDS) + 100)  # faithful: no error
    strict = build(tiny[0], form="f32", strict=True)
    strict.forward(torch.tensor([IDS]), 0)
    strict.forward(torch.tensor([[5]]), len(IDS))
    with pytest.raises(IndexPosError, match="index_pos 113 disagrees with the KV cache"):
        strict.forward(torch.tensor([[5]]), len(IDS) + 100)


def test_mask_only_for_several_tokens_and_never_cleared(tiny):
    model = build(tiny[0], form="f32")
    model.forward(torch.tensor([IDS[:4]]), 0)
    model.forward(torch.tensor([[1]]), 4)
    assert set(model.masks) == {(4, 4)}
    model.forward(torch.tensor([IDS[:3]]), 5)
    assert set(model.masks) == {(4, 4), (3, 8)}
    mask = model.masks[(3, 8)]
    assert mask.dtype == torch.uint8 and mask.tolist() == [
        [0, 0, 0, 0, 0, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 1],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
    model.clear_kv_cache()
    assert model.kv_len == 0 and set(model.masks) == {(4, 4), (3, 8)}


def test_rope_table_limit(tiny):
    model = build(tiny[0], form="f32")
    model.forward(torch.tensor([[1]]), MAX_SEQ_LEN - 1)
    with pytest.raises(ShapeError) as err:
        model.forward(torch.tensor([[1]]), MAX_SEQ_LEN)
    hd2 = N_EMBD // N_HEAD // 2
    assert str(err.value) == (
        f"narrow invalid args start + len > dim_len: [4096, {hd2}], dim: 0, start: 4096, len:1"
    )


@pytest.mark.parametrize(
    "key",
    [
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.block_count",
        "llama.embedding_length",
        "llama.rope.dimension_count",
        "llama.attention.layer_norm_rms_epsilon",
    ],
)
def test_missing_required_key(tmp_path, key):
    path = write_tiny_llama(tmp_path / "m.gguf", drop_keys=[key])
    with pytest.raises(ModelError, match=f"^cannot find {key} in metadata$"):
        build(path)


def test_missing_freq_base_defaults_to_10000(tmp_path, tiny):
    _, w = tiny
    path = write_tiny_llama(tmp_path / "nofreq.gguf", drop_keys=["llama.rope.freq_base"])
    model = build(path, form="f32")
    assert model.config.rope_freq_base == 10000.0
    got = model.forward(torch.tensor([IDS]), 0, all_logits=True)[0]
    assert (got - reference_logits(w, IDS, freq_base=10000.0)).abs().max().item() < TOL


def test_architecture_selects_rope_variant(tmp_path, tiny):
    _, w = tiny
    path = write_tiny_llama(
        tmp_path / "q.gguf", arch="qwen2", extra_metadata={"general.architecture": "qwen2"}
    )
    model = build(path, form="f32")
    assert model.config.rope_is_neox
    got = model.forward(torch.tensor([IDS]), 0, all_logits=True)[0]
    assert (got - reference_logits(w, IDS, neox=True)).abs().max().item() < TOL
    assert (got - reference_logits(w, IDS, neox=False)).abs().max().item() > 1e-2


def test_separate_output_weight(tmp_path):
    path, w = write_tiny_llama(tmp_path / "o.gguf", tie_output=False, return_weights=True)
    w = {k: torch.from_numpy(v) for k, v in w.items()}
    got = build(path, form="f32").forward(torch.tensor([IDS]), 0, all_logits=True)[0]
    assert (got - reference_logits(w, IDS)).abs().max().item() < TOL


def test_sdpa_decode_equals_naive(tiny):
    naive = build(tiny[0], form="f32", attention="naive")
    sdpa = build(tiny[0], form="f32", attention="sdpa")
    naive.forward(torch.tensor([IDS]), 0)
    sdpa_model_prefill = build(tiny[0], form="f32", attention="naive")
    sdpa_model_prefill.forward(torch.tensor([IDS]), 0)
    sdpa.layers = sdpa_model_prefill.layers  # same cache, decode with SDPA
    a = naive.forward(torch.tensor([[9]]), len(IDS))
    b = sdpa.forward(torch.tensor([[9]]), len(IDS))
    assert (a - b).abs().max().item() < 1e-5


def test_f16_form_close_to_f32(tiny):
    a = build(tiny[0], form="f32").forward(torch.tensor([IDS]), 0)
    b = build(tiny[0], form="f16").forward(torch.tensor([IDS]), 0)
    # weights and inputs rounded to f16 (2^-11 relative) through 2 layers
    assert (a - b).abs().max().item() < 5e-2


def test_bad_calls(tiny):
    model = build(tiny[0], form="f32")
    with pytest.raises(ShapeError, match="expected: 2"):
        model.forward(torch.tensor(IDS), 0)
    with pytest.raises(ModelError, match="index_pos must be >= 0"):
        model.forward(torch.tensor([IDS]), -3)
    with pytest.raises(ModelError, match="unknown attention mode"):
        build(tiny[0], attention="flash")


# ----------------------------------------------------------------------------- kv_cache="static"


def _prefill_decode_chunk(model) -> torch.Tensor:
    """Every logit of: a 5-token prefill, 4 decode steps, a 4-token chunk (rows stacked)."""
    out = [model.forward(torch.tensor([IDS[:5]]), 0, all_logits=True)[0]]
    out += [model.forward(torch.tensor([[t]]), 5 + i) for i, t in enumerate(IDS[5:9])]
    out.append(model.forward(torch.tensor([IDS[9:]]), 9, all_logits=True)[0])
    return torch.cat(out)


@pytest.mark.parametrize("form", ["f32", "quantized"])
@pytest.mark.parametrize("attention", ["auto", "sdpa", "fold", "naive"])
def test_static_kv_cache_gives_the_default_logits(tiny, form, attention):
    """The preallocated cache against candle's cat cache, prefill, decode and a chunk.

    With naive attention the logits are bit-identical: the buffers' views hold
    the cat cache's values and repeat_kv (GQA 4/2 here) copies them into the
    same contiguous tensors. SDPA (auto, sdpa) and folded SDPA sum in another
    order than the naive matmuls: the logits here reach ~50, where a float32 ulp
    is 3.8e-6, and differ by ~1e-5 (a few ulps); 1e-4 (2e-6 relative) leaves
    margin for other CPUs and kernels, while a cache error (a position wrong or
    missing) moves them by more than 1e-2.
    """
    default = _prefill_decode_chunk(build(tiny[0], form=form))
    model = build(tiny[0], form=form, kv_cache="static", attention=attention, max_seq_len=32)
    assert (model.kv_cache_mode, model.max_seq_len) == ("static", 32)
    static = _prefill_decode_chunk(model)
    assert model.kv_len == len(IDS)
    assert model.layers[0].kv_buffers[0].shape == (1, N_KV, 32, N_EMBD // N_HEAD)
    if attention == "naive":
        assert torch.equal(static, default)
    else:
        torch.testing.assert_close(static, default, atol=1e-4, rtol=0)


def test_static_kv_cache_through_the_loader_and_set_kv_cache(tiny):
    from qlib.llama.engine import load

    model, _ = load(tiny[0], "cpu", form="f32", kv_cache="static")
    assert (model.kv_cache_mode, model.max_seq_len) == ("static", MAX_SEQ_LEN)
    static = _prefill_decode_chunk(model)
    model.clear_kv_cache()  # keeps the buffers, forgets the positions
    assert model.kv_len == 0 and model.layers[0].kv_buffers is not None
    model.set_kv_cache("cat")
    assert (model.kv_cache_mode, model.max_seq_len) == ("cat", None)
    assert model.layers[0].kv_buffers is None
    torch.testing.assert_close(_prefill_decode_chunk(model), static, atol=1e-4, rtol=0)
    assert model.layers[0].kv_buffers is None  # the cat cache allocates none


def test_bad_kv_cache_options_are_model_errors(tiny):
    from qlib.llama.engine import load

    with pytest.raises(ModelError, match=r"^unknown kv_cache 'ring'; choose one of cat, static$"):
        build(tiny[0], kv_cache="ring")
    with pytest.raises(ModelError, match="unknown kv_cache 'prealloc'"):
        load(tiny[0], "cpu", kv_cache="prealloc")
    with pytest.raises(ModelError, match="max_seq_len sizes the static KV cache"):
        build(tiny[0], max_seq_len=64)
    for bad in (0, MAX_SEQ_LEN + 1, 8.0, True):
        with pytest.raises(ModelError, match="max_seq_len must be an int in 1..4096"):
            build(tiny[0], kv_cache="static", max_seq_len=bad)
    with pytest.raises(ModelError, match="attention 'fold' needs kv_cache='static'"):
        build(tiny[0], attention="fold")
    model = build(tiny[0], form="f32")
    with pytest.raises(ModelError, match="unknown kv_cache"):
        model.set_kv_cache("static ")
    assert model.kv_cache_mode == "cat"
    static = build(tiny[0], form="f32", kv_cache="static", max_seq_len=8)
    static.forward(torch.tensor([IDS[:6]]), 0)
    with pytest.raises(ModelError, match=r"holds 8 positions \(max_seq_len\); index_pos 6 \+"):
        static.forward(torch.tensor([IDS[6:9]]), 6)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1"])
def test_quantized_file_dequantized_form(tmp_path, weight_type):
    path, w = write_tiny_llama(tmp_path / "q.gguf", weight_type=weight_type, return_weights=True)
    w = {k: torch.from_numpy(np.asarray(v)) for k, v in w.items()}
    got = build(path, form="f32").forward(torch.tensor([IDS]), 0, all_logits=True)[0]
    assert (got - reference_logits(w, IDS)).abs().max().item() < TOL


# ----------------------------------------------------------------------------- strict mode


def test_strict_rope_table_limit(tiny):
    """strict names index_pos + seq_len past the table; the default keeps candle's narrow error."""
    strict = build(tiny[0], form="f32", strict=True)
    strict.forward(torch.tensor([[1]]), 0)
    full = MAX_SEQ_LEN - 2  # a cache this long, as if filled token by token
    for layer in strict.layers:
        k, v = layer.kv_cache
        layer.kv_cache = (k.expand(-1, -1, full, -1), v.expand(-1, -1, full, -1))
    with pytest.raises(IndexPosError) as err:
        strict.forward(torch.tensor([[1, 2, 3]]), full)
    assert str(err.value) == (
        f"index_pos {full} + seq_len 3 = {MAX_SEQ_LEN + 1} passes the RoPE table "
        f"of {MAX_SEQ_LEN} positions (MAX_SEQ_LEN)"
    )
    strict.forward(torch.tensor([[1, 2]]), full)  # the last two positions fit
    strict.forward(torch.tensor([IDS[:4]]), 0)  # a fresh start that fits is fine
    with pytest.raises(IndexPosError, match=r"index_pos 0 \+ seq_len 4097 = 4097 passes"):
        strict.forward(torch.zeros(1, MAX_SEQ_LEN + 1, dtype=torch.long), 0)

    faithful = build(tiny[0], form="f32")
    faithful.forward(torch.tensor([IDS[:4]]), 0)
    with pytest.raises(ShapeError, match="^narrow invalid args start \\+ len > dim_len"):
        faithful.forward(torch.tensor([[1, 2, 3]]), MAX_SEQ_LEN - 1)


@pytest.mark.parametrize(
    "x, expect",
    [
        ([[1, 2]], "got list"),
        (torch.tensor(IDS), "got shape [13]"),
        (torch.tensor([IDS, IDS]), "got shape [2, 13]"),
        (torch.zeros(1, 0, dtype=torch.long), "got shape [1, 0]"),
        (torch.tensor([[[1, 2]]]), "got shape [1, 1, 2]"),
        (torch.tensor([[1.0, 2.0]]), "got dtype torch.float32"),
        (torch.tensor([[True, False]]), "got dtype torch.bool"),
    ],
)
def test_strict_input_must_be_1_by_t_integers(tiny, x, expect):
    strict = build(tiny[0], form="f32", strict=True)
    with pytest.raises(InputError) as err:
        strict.forward(x, 0)
    msg = str(err.value)
    assert msg.startswith("strict=True: the input must be a 1 x T integer tensor of token ids")
    assert msg.endswith(expect)


def test_strict_token_ids_in_vocabulary(tiny):
    strict = build(tiny[0], form="f32", strict=True)
    with pytest.raises(InputError, match=r"token id 256 is outside the vocabulary \(0\.\.255\)"):
        strict.forward(torch.tensor([[1, VOCAB]]), 0)
    with pytest.raises(InputError, match="token id -1 is outside"):
        strict.forward(torch.tensor([[-1, 3]]), 0)
    assert strict.forward(torch.tensor([[0, VOCAB - 1]], dtype=torch.int32), 0).shape == (1, VOCAB)


def test_faithful_default_keeps_candle_behaviour_on_inputs(tiny):
    """No strict: batches run, a rank error is candle's, bad ids fail in torch's embedding."""
    model = build(tiny[0], form="f32")
    assert model.forward(torch.tensor([IDS[:4], IDS[4:8]]), 0).shape == (2, VOCAB)
    with pytest.raises(ShapeError, match="^unexpected rank, expected: 2, got: 1"):
        model.forward(torch.tensor(IDS), 0)
    with pytest.raises(IndexError):
        model.forward(torch.tensor([[VOCAB]]), 0)


# ----------------------------------------------------------------------------- the file checks


def test_model_file_errors_are_gguf_errors(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", drop_keys=["llama.block_count"])
    with pytest.raises(GGUFError) as err:
        build(path)
    assert isinstance(err.value, ModelFileError) and isinstance(err.value, ModelError)
    assert str(err.value) == "cannot find llama.block_count in metadata"


@pytest.mark.parametrize(
    "extra, expect",
    [
        ({"llama.block_count": "two"}, "metadata key llama.block_count is str 'two', expected an"),
        ({"llama.block_count": [1, 2]}, "llama.block_count is an array of 2 items, expected an"),
        ({"llama.block_count": Typed(VT.INT32, -1)}, "llama.block_count = -1 must be >= 1"),
        ({"llama.block_count": Typed(VT.UINT32, 0)}, "llama.block_count = 0 must be >= 1"),
        ({"llama.attention.head_count": Typed(VT.BOOL, True)}, "head_count is bool True"),
        ({"llama.attention.head_count_kv": Typed(VT.UINT32, 0)}, "head_count_kv = 0 must be"),
        ({"llama.attention.head_count_kv": Typed(VT.UINT32, 3)}, "positive multiple of"),
        ({"llama.rope.freq_base": "fast"}, "llama.rope.freq_base is str 'fast', expected a number"),
        ({"llama.attention.layer_norm_rms_epsilon": [1.0]}, "epsilon is an array of 1 items"),
        ({"general.architecture": Typed(VT.UINT32, 7)}, "general.architecture is int 7, expected"),
        ({"llama.block_count": Typed(VT.UINT32, 3)}, "cannot find tensor blk.2.attn_q.weight in"),
        (
            {"llama.block_count": Typed(VT.UINT32, 2**32 - 1)},
            "cannot find tensor blk.2.attn_q.weight in the file (llama.block_count = 4294967295)",
        ),
        (
            {
                "llama.embedding_length": Typed(VT.UINT32, 48),
                "llama.attention.head_count": Typed(VT.UINT32, 8),
                "llama.attention.head_count_kv": Typed(VT.UINT32, 1),
                "llama.rope.dimension_count": Typed(VT.UINT32, 6),
            },
            "tensor token_embd.weight has shape [256, 64], expected ['n_vocab', 48]",
        ),
        (
            {
                "llama.attention.head_count": Typed(VT.UINT32, 8),
                "llama.attention.head_count_kv": Typed(VT.UINT32, 8),
                "llama.rope.dimension_count": Typed(VT.UINT32, 8),
            },
            "tensor blk.0.attn_k.weight has shape [32, 64], expected [64, 64] "
            "(head_count_kv 8 x head_dim 8)",
        ),
        (
            {
                "llama.attention.head_count": Typed(VT.UINT32, 64),
                "llama.attention.head_count_kv": Typed(VT.UINT32, 64),
                "llama.rope.dimension_count": Typed(VT.UINT32, 1),
            },
            "head_dim 1 is odd; RoPE rotates pairs",
        ),
    ],
)
def test_bad_metadata_is_named(tmp_path, extra, expect):
    path = write_tiny_llama(tmp_path / "m.gguf", extra_metadata=extra)
    with pytest.raises(ModelFileError) as err:
        build(path)
    assert expect in str(err.value)


def _rewrite(path, out, change):
    content = Content.read_path(path)
    with open(path, "rb") as f:
        tensors = {n: content.tensor(f, n) for n in content.tensor_infos}
    change(tensors)
    with open(out, "wb") as f:
        write(f, content.metadata, tensors, types=content.metadata_types)
    return out


@pytest.mark.parametrize(
    "change, expect",
    [
        (lambda t: t.pop("blk.1.ffn_up.weight"), "cannot find tensor blk.1.ffn_up.weight in"),
        (
            lambda t: t.update({"blk.0.attn_q.weight": t["blk.0.attn_k.weight"]}),
            "tensor blk.0.attn_q.weight has shape [32, 64], expected [64, 64]",
        ),
        (
            lambda t: t.update({"blk.1.ffn_down.weight": t["blk.1.ffn_up.weight"]}),
            "tensor blk.1.ffn_down.weight has shape [128, 64], expected [64, 128] (n_ff 128",
        ),
        (
            lambda t: t.update({"output_norm.weight": t["token_embd.weight"]}),
            "tensor output_norm.weight has shape [256, 64], expected [64]",
        ),
        (
            lambda t: t.update({"output.weight": t["blk.0.attn_q.weight"]}),
            "tensor output.weight has shape [64, 64], expected [256, 64]",
        ),
        (
            lambda t: t.update({"blk.0.attn_q.weight": (bytes(64 * 64), (64, 64), "I8")}),
            "tensor blk.0.attn_q.weight has ggml type I8, which qlib cannot compute with",
        ),
        (
            lambda t: t.update(
                {"blk.0.attn_q.weight": QTensor.quantize(torch.ones(64, 64), "Q8_1")}
            ),
            "tensor blk.0.attn_q.weight has ggml type Q8_1, which has no quantized matmul",
        ),
    ],
)
def test_tensors_that_do_not_fit_are_named_before_any_data_is_read(tmp_path, tiny, change, expect):
    out = _rewrite(tiny[0], tmp_path / "bad.gguf", change)
    with pytest.raises(ModelFileError) as err:
        build(out)
    assert expect in str(err.value)


def test_q8_1_weights_load_in_a_dequantized_form(tmp_path, tiny):
    def change(t):
        t["blk.0.attn_q.weight"] = QTensor.quantize(t["blk.0.attn_q.weight"].dequantize(), "Q8_1")

    out = _rewrite(tiny[0], tmp_path / "q81.gguf", change)
    assert build(out, form="f32").forward(torch.tensor([IDS]), 0).shape == (1, VOCAB)


def test_embedding_dequantized_in_row_chunks_is_identical(tmp_path):
    path = write_tiny_llama(tmp_path / "q.gguf", weight_type="Q4_1")
    content = Content.read_path(path)
    with open(path, "rb") as f:
        q = content.tensor(f, "token_embd.weight")
    assert torch.equal(dequantize_rows(q, max_floats=3 * 64), q.dequantize())
