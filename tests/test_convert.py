"""qlib.convert: names, q/k permutation, recipes, GGUF <-> safetensors round trips, failure options.

The tiny synthetic model covers the mechanics in milliseconds; the slow tests run
the real SmolLM2 through GGUF -> safetensors -> GGUF and compare with transformers,
gguf-py and llama.cpp (fixtures shared at module scope: one export, one F32 file).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib import models
from qlib.convert import (
    FROM_GGUF_KEYS,
    gguf_name,
    gguf_to_hf,
    hf_name,
    hf_to_gguf,
    permute,
    plan,
    quantize_gguf,
    unpermute,
)
from qlib.convert.recipes import use_more_bits
from qlib.gguf import Content
from qlib.llama.engine import load
from qlib.llama.errors import ModelError
from qlib.llama.faithful import rope_i

LOGIT_TOL_SAME_ENGINE = 1e-4
LOGIT_TOL_TRANSFORMERS = 1e-3
TINY = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, n_ff=128, vocab=256)


def logits(path, ids, form="f32"):
    model, _ = load(path, "cpu", form=form)
    with torch.inference_mode():
        return model.forward(torch.tensor([ids]), 0, all_logits=True)[0]


def tensor_bytes(path) -> dict[str, bytes]:
    with open(path, "rb") as f:
        c = Content.read(f)
        return {n: bytes(c.tensor_bytes(f, n)) for n in c.tensor_infos}


# ----------------------------------------------------------------------------- names, permutation


def test_names_map_both_ways():
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_name("model.layers.7.self_attn.q_proj.weight") == "blk.7.attn_q.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("model.layers.3.post_attention_layernorm.weight") == "blk.3.ffn_norm.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    assert gguf_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    for n in [
        "token_embd.weight",
        "output_norm.weight",
        "output.weight",
        "blk.12.attn_k.weight",
        "blk.0.attn_output.weight",
        "blk.29.ffn_gate.weight",
        "blk.1.attn_norm.weight",
    ]:
        assert gguf_name(hf_name(n)) == n
    assert hf_name("blk.0.attn_qkv.weight") is None


@pytest.mark.parametrize("heads,rows", [(4, 64), (3, 192), (9, 576), (1, 2)])
def test_permute_inverse(heads, rows):
    w = torch.randn(rows, 8)
    p = permute(w, heads)
    assert not torch.equal(p, w) or rows == 2
    assert torch.equal(unpermute(p, heads), w)
    assert torch.equal(permute(unpermute(w, heads), heads), w)
    b = torch.randn(rows)  # biases permute the same way
    assert torch.equal(unpermute(permute(b, heads), heads), b)
    with pytest.raises(ValueError, match="cannot permute"):
        permute(torch.randn(rows + 1, 8), heads)


def test_permutation_turns_rotate_half_into_interleaved_rope():
    """transformers' rotate_half on q equals llama.cpp's rope_i on the permuted q."""
    n_head, d, t = 3, 16, 5
    x = torch.randn(t, 24)
    wq = torch.randn(n_head * d, 24)
    theta = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    ang = torch.arange(t).float()[:, None] * theta[None]
    cos, sin = ang.cos(), ang.sin()

    q = (x @ wq.T).reshape(t, n_head, d).transpose(0, 1)  # (h, t, d)
    c2, s2 = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    rot = torch.cat([-q[..., d // 2 :], q[..., : d // 2]], -1)
    hf = q * c2 + rot * s2

    qp = (x @ permute(wq, n_head).T).reshape(t, n_head, d).transpose(0, 1)
    ours = rope_i(qp[None], cos, sin)[0]
    torch.testing.assert_close(
        unpermute(ours.transpose(0, 1).reshape(t, -1).T, n_head).T,
        hf.transpose(0, 1).reshape(t, -1),
    )


# ----------------------------------------------------------------------------- recipes


SMOL_SHAPES = {"token_embd.weight": (49152, 576), "output_norm.weight": (576,)}
for _i in range(30):
    for _n, _s in [
        ("attn_norm", (576,)),
        ("attn_q", (576, 576)),
        ("attn_k", (192, 576)),
        ("attn_v", (192, 576)),
        ("attn_output", (576, 576)),
        ("ffn_norm", (576,)),
        ("ffn_gate", (1536, 576)),
        ("ffn_up", (1536, 576)),
        ("ffn_down", (576, 1536)),
    ]:
        SMOL_SHAPES[f"blk.{_i}.{_n}.weight"] = _s


def counts(choices):
    out: dict[str, int] = {}
    for c in choices:
        out[c.type] = out.get(c.type, 0) + 1
    return out


def test_plain_q4_k_falls_back_on_576_rows():
    p = plan(SMOL_SHAPES, "Q4_K", 30)
    assert counts(p) == {"F32": 61, "Q4_K": 30, "Q5_0": 181}
    assert {c.name.split(".")[-2] for c in p if c.type == "Q4_K"} == {"ffn_down"}
    assert all(c.fell_back == (c.type == "Q5_0") for c in p)


def test_q4_k_m_recipe_as_llama_cpp():
    p = {c.name: c for c in plan(SMOL_SHAPES, "Q4_K_M", 30)}
    more = [i for i in range(30) if use_more_bits(i, 30)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert p["token_embd.weight"].type == "Q8_0"  # tied output, rows 576 % 256 != 0
    for i in range(30):
        assert p[f"blk.{i}.ffn_down.weight"].type == ("Q6_K" if i in more else "Q4_K")
        assert p[f"blk.{i}.attn_v.weight"].type == ("Q8_0" if i in more else "Q5_0")
        assert p[f"blk.{i}.attn_q.weight"].type == "Q5_0"
    assert counts(p.values()) == {"F32": 61, "Q5_0": 166, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}
    untied = plan({**SMOL_SHAPES, "output.weight": (49152, 576)}, "Q4_K_M", 30)
    assert {c.name: c.type for c in untied}["token_embd.weight"] == "Q5_0"


@pytest.mark.parametrize(
    "expected,pre",
    [
        ("smollm", ["Digits", "ByteLevel"]),  # the original SmolLM2 tokenizer.json
        ("gpt-2", ["ByteLevel"]),
        ("llama3", ["Split:_LLAMA3", "ByteLevel:no-regex"]),
        ("qwen2", ["Split:_QWEN2", "ByteLevel:no-regex"]),
    ],
)
def test_detect_pre_by_behaviour(expected, pre):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from qlib import tokenizer as qtok
    from qlib.convert.tokenizer_meta import detect_pre

    steps = []
    for p in pre:
        kind, _, arg = p.partition(":")
        if kind == "Digits":
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        elif kind == "Split":
            steps.append(pre_tokenizers.Split(Regex(getattr(qtok, arg)), behavior="isolated"))
        else:
            regex = arg != "no-regex"
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex))
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence(steps)
    assert detect_pre(t.to_str()) == expected


def test_unknown_spec():
    with pytest.raises(ValueError, match="unknown type or recipe 'Q7_K'"):
        plan(SMOL_SHAPES, "Q7_K", 30)
    with pytest.raises(ValueError, match="qlib reads IQ2_XS but does not write it"):
        plan(SMOL_SHAPES, "iq2_xs", 30)


# ----------------------------------------------------------------------------- tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    src = write_tiny_llama(d / "tiny.gguf", **TINY, extra_metadata={})
    hf = gguf_to_hf(src, d / "hf")
    return d, src, hf


def test_tiny_export_folder(tiny):
    d, src, hf = tiny
    cfg = json.loads((hf.path / "config.json").read_text())
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in hf.tensors
    assert hf.tensors["model.layers.0.self_attn.k_proj.weight"] == (32, 64)


def test_tiny_round_trip_is_exact(tiny):
    d, src, hf = tiny
    back = hf_to_gguf(hf.path, d / "back.gguf", "F32")
    a, b = tensor_bytes(src), tensor_bytes(back.path)
    assert set(a) == set(b) and all(a[n] == b[n] for n in a)
    md = Content.read_path(back.path).metadata
    assert all(k in md for k in FROM_GGUF_KEYS)
    ids = list(range(1, 40))
    torch.testing.assert_close(logits(src, ids), logits(back.path, ids), rtol=0, atol=0)


def test_tiny_transformers_matches_qlib(tiny):
    transformers = pytest.importorskip("transformers")
    d, src, hf = tiny
    model = transformers.AutoModelForCausalLM.from_pretrained(hf.path, dtype=torch.float32).eval()
    ids = list(range(3, 50))
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    assert (ref - logits(src, ids)).abs().max() <= LOGIT_TOL_SAME_ENGINE


def test_failure_options(tiny):
    d, src, hf = tiny
    ids = list(range(1, 30))
    good = logits(src, ids)

    noperm = hf_to_gguf(hf.path, d / "noperm.gguf", "F32", permute_qk=False)
    a, b = tensor_bytes(src), tensor_bytes(noperm.path)
    qk = {f"blk.{i}.attn_{x}.weight" for i in (0, 1) for x in "qk"}
    assert {n for n in a if a[n] != b[n]} == qk
    assert (logits(noperm.path, ids) - good).abs().max() > 1e-2

    nometa = hf_to_gguf(hf.path, d / "nometa.gguf", "F32", metadata=False)
    assert Content.read_path(nometa.path).metadata == {}
    with pytest.raises(ModelError, match="cannot find llama.attention.head_count in metadata"):
        load(nometa.path)

    norope = hf_to_gguf(hf.path, d / "norope.gguf", "F32", drop_keys=["llama.rope.freq_base"])
    assert "llama.rope.freq_base" not in norope.metadata_keys
    model, _ = load(norope.path)
    assert model.config.rope_freq_base == 10000.0  # silently, no error

    with pytest.raises(KeyError, match="not in the metadata"):
        hf_to_gguf(hf.path, d / "x.gguf", "F32", drop_keys=["llama.nope"])


def test_cli(tiny):
    from qlib.cli import main

    d, src, hf = tiny
    hf_dir = d / "cli_hf"
    assert main(["convert", "--in", str(src), "--out", str(hf_dir), "--to", "safetensors"]) == 0
    assert (d / "cli_hf" / "model.safetensors").is_file()
    out = d / "cli.gguf"
    assert (
        main(
            [
                "convert",
                "--in",
                str(d / "cli_hf"),
                "--out",
                str(out),
                "--type",
                "q8_0",
                "--drop-key",
                "llama.rope.freq_base",
            ]
        )
        == 0
    )
    c = Content.read_path(out)
    assert "llama.rope.freq_base" not in c.metadata
    assert {i.dtype.name for i in c.tensor_infos.values()} == {"F32", "Q8_0"}
    q4k = d / "cli_q4k.gguf"
    assert main(["quantize", "--in", str(out), "--out", str(q4k), "--type", "Q4_K"]) == 0
    types = {i.dtype.name for i in Content.read_path(q4k).tensor_infos.values()}
    assert types == {"F32", "Q5_0"}  # 64-wide rows: every K-quant falls back


def test_derive_caches(tiny, tmp_path, monkeypatch):
    d, src, hf = tiny
    monkeypatch.setenv("QLIB_MODELS_DIR", str(tmp_path))
    assert models.derived_name("SmolLM2-135M-Instruct.Q4_1.gguf", "Q8_0") == (
        "SmolLM2-135M-Instruct.Q8_0.gguf"
    )
    assert models.derived_name("tiny.gguf", "Q4_K_M") == "tiny.Q4_K_M.gguf"
    p = models.derive("q8_0", str(src))
    assert p == tmp_path / "tiny.Q8_0.gguf"
    mtime = p.stat().st_mtime_ns
    assert models.derive("Q8_0", str(src)) == p and p.stat().st_mtime_ns == mtime
    c = Content.read_path(p)
    assert c.metadata["general.file_type"] == 7
    # a file made when qlib chose other types (here: Q4_0 where it now writes Q8_0) is stale:
    # derived again, not returned as it is
    stale = tmp_path / "tiny.Q8_0.gguf"
    stale.unlink()
    models.derive("Q4_0", str(src)).rename(stale)
    lines = []
    p = models.derive("Q8_0", str(src), log=lines.append)
    assert {i.dtype.name for i in Content.read_path(p).tensor_infos.values()} == {"F32", "Q8_0"}
    assert any("deriving it again" in line for line in lines)


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    try:
        src = models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("smol")
    hf = gguf_to_hf(src, d / "hf")
    f32 = hf_to_gguf(hf.path, d / "f32.gguf", "F32")
    from qlib.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(src)
    ids = tok.encode(models.data_file("passage.txt").read_text())[:96]
    return dict(dir=d, src=src, hf=hf, f32=f32.path, tok=tok, ids=ids, src_logits=logits(src, ids))


@pytest.mark.slow
def test_smollm2_f32_round_trip(smol):
    diff = (logits(smol["f32"], smol["ids"]) - smol["src_logits"]).abs().max()
    assert diff <= LOGIT_TOL_SAME_ENGINE
    a, b = Content.read_path(smol["src"]).metadata, Content.read_path(smol["f32"]).metadata
    for key in [
        *FROM_GGUF_KEYS,
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.chat_template",
        "llama.context_length",
        "llama.feed_forward_length",
        "llama.vocab_size",
    ]:
        assert a[key] == b[key], key


@pytest.mark.slow
def test_smollm2_transformers_loads_export(smol):
    transformers = pytest.importorskip("transformers")
    folder = smol["hf"].path
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = models.data_file("passage.txt").read_text()
    assert tok(text)["input_ids"][:96] == smol["ids"]
    chat = [{"role": "user", "content": "What is Rust?"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt == smol["tok"].chat_prompt("What is Rust?")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([smol["ids"]])).logits[0]
    assert (ref - smol["src_logits"]).abs().max() <= LOGIT_TOL_TRANSFORMERS


@pytest.mark.slow
def test_smollm2_q8_0_bytes_match_gguf_py(smol):
    gguf = pytest.importorskip("gguf")
    q8 = hf_to_gguf(smol["hf"].path, smol["dir"] / "q8.gguf", "Q8_0")
    ours = tensor_bytes(q8.path)
    with open(smol["f32"], "rb") as f:
        c = Content.read(f)
        n = 0
        for name, info in c.tensor_infos.items():
            if len(info.shape) != 2:
                assert ours[name] == bytes(c.tensor_bytes(f, name))  # norms stay F32
                continue
            x = c.tensor(f, name).dequantize().numpy()
            theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            assert ours[name] == np.ascontiguousarray(theirs).tobytes(), name
            n += 1
    assert n == 211


@pytest.mark.slow
@pytest.mark.peers
def test_llama_cpp_runs_our_q4_k(smol):
    llama_cpp = pytest.importorskip("llama_cpp")
    q4k = hf_to_gguf(smol["hf"].path, smol["dir"] / "q4k.gguf", "Q4_K")
    assert q4k.type_counts() == {"Q5_0": 181, "F32": 61, "Q4_K": 30}
    assert len(q4k.fallbacks) == 181
    llm = llama_cpp.Llama(model_path=str(q4k.path), n_ctx=128, n_threads=2, verbose=False)
    prompt = smol["tok"].chat_prompt("What is Rust?")
    toks = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert toks == smol["tok"].encode(prompt)  # our tokenizer metadata, read by llama.cpp
    out = llm.create_completion(prompt, max_tokens=8, temperature=0.0)
    assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["text"].strip()


@pytest.mark.slow
def test_smollm2_quantize_copies_same_type_tensors(smol):
    out = quantize_gguf(smol["src"], smol["dir"] / "q4_1.gguf", "Q4_1")
    assert out.copied == 271  # 210 Q4_1 + 61 F32; token_embd (Q8_0 in the source) becomes Q4_1
    ours, src = tensor_bytes(out.path), tensor_bytes(smol["src"])
    assert [n for n in src if ours[n] != src[n]] == ["token_embd.weight"]
    assert Content.read_path(out.path).metadata["general.file_type"] == 3
