"""Projection biases (llama.cpp's optional ``blk.N.attn_q.bias`` ... ``ffn_down.bias`` of a
llama file: "llamafied" models carry them): the fast engines add them as llama.cpp does; the
faithful engine ignores them as candle's quantized_llama does, with a warning (``strict``
refuses the file).

Tolerances: llama.cpp's logits on the same Q8_0 file to 1e-4 of their scale (both quantize
the activations to Q8_0 blocks and sum exact integer dots; measured 1.1e-7 and 1.2e-7 of it);
the fast CUDA engine (float32 activations, weights dequantized exactly) against the fast CPU
engine: the CPU's int8 activations' drift, 2e-2 of the scale (measured 5.7e-3 to 9.2e-3 on an
H100)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import GGUFValueType, Typed
from qlib.llama.engine import load
from qlib.llama.errors import ModelError, ModelFileError

ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QKV = ("attn_q", "attn_k", "attn_v")  # Qwen's, llamafied
IDS = [1, 7, 33, 100, 5, 250, 17, 2, 99, 64, 128, 3]
STEPS = (11, 200, 42)
FOR_LLAMA_CPP = {"tokenizer.ggml.model": "none",
                 "llama.vocab_size": Typed(GGUFValueType.UINT32, 256)}  # fmt: skip


def write(path, biases, **kw):
    return write_tiny_llama(path, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, n_ff=256,
                            vocab=256, weight_type="Q8_0", tie_output=False, biases=biases,
                            extra_metadata=FOR_LLAMA_CPP, **kw)  # fmt: skip


def run(model) -> list[np.ndarray]:
    """Every position's logits of a prefill of IDS, then each decode step's."""
    with torch.inference_mode():
        out = [model.forward(torch.tensor([IDS]), 0, all_logits=True)[0].float().cpu().numpy()]
        for i, token in enumerate(STEPS):
            out.append(model.forward(torch.tensor([[token]]), len(IDS) + i).float().cpu().numpy())
    return out


@pytest.fixture(scope="module", params=[ALL, QKV], ids=["all", "qkv"])
def biased(request, tmp_path_factory):
    """(path, llama.cpp's logits of ``run``'s positions) of a file with biases."""
    pytest.importorskip("llama_cpp")
    import test_position0 as pos0

    path = write(tmp_path_factory.mktemp("bias") / "m.gguf", request.param)
    llm = pos0.llama_cpp_model(path)
    try:
        llm.eval(IDS + list(STEPS))
        scores = np.array(llm.scores[: len(IDS) + len(STEPS)], dtype=np.float32)
    finally:
        llm.close()
    n = len(IDS)
    return path, [scores[:n], *(scores[n + i][None] for i in range(len(STEPS)))]


@pytest.mark.peers
@pytest.mark.parametrize("prefill", ["int8", "bf16"])
def test_the_fast_cpu_engine_adds_them_as_llama_cpp(biased, prefill):
    """Prefill (the int8 C path, or the torch path where the bf16 one has no bias epilogue)
    and the C decode chain (its add steps) against llama.cpp."""
    path, ref = biased
    model, _ = load(path, "cpu", engine="fast", prefill=prefill)
    assert model.decode_chained and any(ly.biases for ly in model.layers)
    scale = max(np.abs(r).max() for r in ref)
    for got, want in zip(run(model), ref, strict=True):
        assert np.abs(got - want).max() <= 1e-4 * scale


@pytest.mark.peers
def test_without_them_the_logits_are_others(biased):
    """The biases matter: the faithful engine (which ignores them, as candle) is far off."""
    path, ref = biased
    with pytest.warns(UserWarning, match="projection biases"):
        model, _ = load(path, "cpu", form="quantized")
    assert np.abs(run(model)[0] - ref[0]).max() > 1e-2 * np.abs(ref[0]).max()


def test_the_faithful_engine_warns_and_strict_refuses(tmp_path):
    path = write(tmp_path / "m.gguf", QKV)
    with pytest.warns(UserWarning, match=r"blk\.0\.attn_q\.bias and 5 more.*candle"):
        load(path, "cpu")
    with pytest.raises(ModelError, match="strict=True: this file has projection biases"):
        load(path, "cpu", strict=True)


def test_a_bias_of_the_wrong_length_is_named(tmp_path):
    from qlib.gguf import Content, write_path

    path = write(tmp_path / "m.gguf", ("attn_k",))
    with open(path, "rb") as f:
        content = Content.read(f)
        tensors = {n: content.tensor(f, n) for n in content.tensor_infos}
        tensors["blk.1.attn_k.bias"] = np.zeros(7, dtype=np.float32)
        write_path(tmp_path / "bad.gguf", content.metadata, tensors)
    with pytest.raises(ModelFileError, match=r"attn_k\.bias has shape \[7\], expected \[64\]"):
        load(tmp_path / "bad.gguf", "cpu", engine="fast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("biases", [ALL, QKV], ids=["all", "qkv"])
def test_the_fast_cuda_engine_adds_them(tmp_path, biases):
    """Prefill, the eager first decode step and the graph's: the fast CPU engine's logits
    (llama.cpp's, above) to the int8 activations' drift."""
    path = write(tmp_path / "m.gguf", biases)
    ref = run(load(path, "cpu", engine="fast")[0])
    model, _ = load(path, "cuda", engine="fast")
    assert model.decode == "fused" and model.graphs  # (the persistent kernel has no biases)
    got = run(model)
    scale = max(np.abs(r).max() for r in ref)
    for g, w in zip(got, ref, strict=True):
        assert np.abs(g - w).max() <= 2e-2 * scale
    with pytest.raises(ModelError, match="no projection biases"):
        load(path, "cuda", engine="fast", decode="persistent")


@pytest.mark.parametrize("biases", [ALL, QKV], ids=["all", "qkv"])
def test_the_fast_cpu_engine_adds_them_as_transformers(tmp_path, biases):
    """The same F32 file exported to transformers (``gguf_to_hf``: ``attention_bias`` /
    ``mlp_bias`` on, zeros where the file has none): its logits of the prompt and the decode
    steps to 1e-3 (float32 both sides, other summation orders, as tests/test_shapes.py)."""
    transformers = pytest.importorskip("transformers")
    from qlib.convert import gguf_to_hf

    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=4, n_kv_head=2,
                            n_ff=256, vocab=256, weight_type="F32", tie_output=False,
                            biases=biases)  # fmt: skip
    hf = gguf_to_hf(path, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf.path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([IDS + list(STEPS)])).logits[0].numpy()
    got = run(load(path, "cpu", engine="fast")[0])
    n = len(IDS)
    for g, w in zip(got, [ref[:n], *(ref[n + i][None] for i in range(len(STEPS)))], strict=True):
        assert np.abs(g - w).max() <= 1e-3


def test_biases_round_trip_through_transformers(tmp_path):
    """GGUF -> transformers -> GGUF keeps every bias byte for byte (q and k permuted to
    transformers' row order and back, as their weights)."""
    pytest.importorskip("safetensors")
    from qlib.convert import gguf_to_hf, hf_to_gguf
    from qlib.gguf import Content

    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=4, n_kv_head=2,
                            n_ff=256, vocab=256, weight_type="F32", biases=ALL)  # fmt: skip
    hf = gguf_to_hf(path, tmp_path / "hf")
    back = hf_to_gguf(hf.path, tmp_path / "back.gguf", "F32").path
    with open(path, "rb") as f, open(back, "rb") as g:
        a, b = Content.read(f), Content.read(g)
        names = [n for n in a.tensor_infos if n.endswith(".bias")]
        assert len(names) == 14 and set(names) <= set(b.tensor_infos)
        for n in names:
            assert torch.equal(a.tensor(f, n).dequantize(), b.tensor(g, n).dequantize()), n
