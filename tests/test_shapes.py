"""Model shapes people download, on every engine (issue 13, item 4): MHA and GQA ratios of 2 to
8, head_dim 32 to 256, tied and untied output, a 128k vocabulary, and heads of another size
than embedding_length / head_count (``llama.attention.key_length``: Mistral NeMo and Mistral
Small, 5120 wide with 32 heads of 128, queries narrower than the model; and wider).

Each shape is a small synthetic file (2 layers, seeded random weights, Q8_0 matrices). The
f32 form is held to transformers loading the same weights (the file exported by
``qlib.convert.gguf_to_hf``), the fast CPU engine to the faithful quantized form (both quantize
activations to int8 as ggml does) and the fast CUDA engine to the f32 form (weights dequantized
exactly, float32 activations), over a prefill of every position and three decode steps.
Tolerances: transformers 1e-3 absolute (float32 both sides, other summation orders: as
tests/test_convert.py); fast CPU 5e-3 x max |logit| (as tests/test_engines.py: the int8 rows of
another kernel, rounding ties apart); fast CUDA 1e-5 x max |logit| (as tests/test_fast_cuda.py).
"""

from __future__ import annotations

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.convert import gguf_to_hf
from qlib.llama.engine import load

SHAPES = {  # name: (n_embd, n_head, n_kv_head, vocab, tie_output[, head_dim])
    "mha-hd64": (256, 4, 4, 256, True),
    "gqa3-hd64-untied": (384, 6, 2, 256, False),
    "gqa8-hd64": (512, 8, 1, 256, True),
    "gqa2-hd32": (128, 4, 2, 256, True),
    "hd128-untied": (256, 2, 1, 256, False),
    "hd256": (512, 2, 1, 256, True),
    "vocab128k": (128, 2, 1, 131072, True),
    "narrow-heads-nemo": (256, 4, 1, 256, False, 32),  # q 128 of 256 (NeMo: 4096 of 5120)
    "wide-heads": (128, 4, 1, 256, True, 64),  # q 256 of 128
}
IDS = [1, 7, 33, 100, 5, 250, 17, 2, 99, 64, 128, 3]
STEPS = (11, 200, 42)
TRANSFORMERS_TOL = 1e-3
FAST_CPU_TOL = 5e-3
FAST_CUDA_TOL = 1e-5


@pytest.fixture(scope="module", params=list(SHAPES))
def shape_file(request, tmp_path_factory):
    n_embd, n_head, n_kv, vocab, tie, *head_dim = SHAPES[request.param]
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    write_tiny_llama(path, n_layer=2, n_embd=n_embd, n_head=n_head, n_kv_head=n_kv, n_ff=256,
                     vocab=vocab, weight_type="Q8_0", tie_output=tie,
                     head_dim=head_dim[0] if head_dim else None)  # fmt: skip
    return path


def run(model) -> list[torch.Tensor]:
    """Every position's logits of a prefill of IDS, then the logits of each decode step."""
    with torch.inference_mode():
        out = [model.forward(torch.tensor([IDS]), 0, all_logits=True)[0].float().cpu()]
        for i, token in enumerate(STEPS):
            out.append(model.forward(torch.tensor([[token]]), len(IDS) + i)[0].float().cpu())
    return out


def assert_close(got: list[torch.Tensor], ref: list[torch.Tensor], tol: float) -> None:
    for a, b in zip(got, ref, strict=True):
        diff = (a - b).abs().max().item()
        assert diff <= tol, f"max |logit diff| {diff:.3g} > {tol:.3g}"
        assert torch.equal(a.argmax(-1), b.argmax(-1)) or diff <= 1e-6 * b.abs().max()


def test_f32_form_matches_transformers(shape_file, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = gguf_to_hf(shape_file, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf.path, dtype=torch.float32).eval()
    ids = torch.tensor([IDS + list(STEPS)])
    with torch.inference_mode():
        ref = model(ids).logits[0]
    f32, _ = load(shape_file, "cpu", form="f32")
    got = run(f32)
    n = len(IDS)
    assert_close([got[0], *got[1:]], [ref[:n], *ref[n:]], TRANSFORMERS_TOL)


def test_fast_cpu_engine_matches_quantized_form(shape_file):
    ref = run(load(shape_file, "cpu", form="quantized")[0])
    got = run(load(shape_file, "cpu", engine="fast")[0])
    scale = max(r.abs().max().item() for r in ref)
    assert_close(got, ref, FAST_CPU_TOL * scale)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_cuda_engine_matches_f32_form(shape_file):
    ref = run(load(shape_file, "cuda", form="f32")[0])
    got = run(load(shape_file, "cuda", engine="fast")[0])
    scale = max(r.abs().max().item() for r in ref)
    assert_close(got, ref, FAST_CUDA_TOL * scale)


@pytest.mark.peers
@pytest.mark.parametrize("name", [name for name, shape in SHAPES.items() if len(shape) > 5])
def test_head_size_from_key_length_is_llama_cpp(name, tmp_path):
    """llama.cpp takes the head size from ``llama.attention.key_length`` too: on the same file
    the faithful quantized form's logits at every position of a prompt (attention mixing
    included) are llama.cpp's to 1e-4 of their scale (f32 KV cache both sides; measured
    1.3e-7 and 8e-8 of it)."""
    pytest.importorskip("llama_cpp")
    import numpy as np
    import test_position0 as pos0

    from qlib.gguf import GGUFValueType, Typed

    n_embd, n_head, n_kv, vocab, tie, head_dim = SHAPES[name]
    path = write_tiny_llama(tmp_path / "m.gguf", n_layer=2, n_embd=n_embd, n_head=n_head,
                            n_kv_head=n_kv, n_ff=256, vocab=vocab, weight_type="Q8_0",
                            tie_output=tie, head_dim=head_dim,
                            extra_metadata={"tokenizer.ggml.model": "none",
                                            "llama.vocab_size": Typed(GGUFValueType.UINT32,
                                                                      vocab)})  # fmt: skip
    llm = pos0.llama_cpp_model(path)
    try:
        llm.eval(IDS)
        ref = np.array(llm.scores[: len(IDS)], dtype=np.float32)
    finally:
        llm.close()
    model, _ = load(path, "cpu", form="quantized")
    with torch.inference_mode():
        got = model.forward(torch.tensor([IDS]), 0, all_logits=True)[0].numpy()
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_a_value_length_unlike_the_key_length_is_named(tmp_path):
    from qlib.gguf import GGUFValueType, Typed
    from qlib.llama.errors import ModelError

    path = write_tiny_llama(tmp_path / "m.gguf", head_dim=32, extra_metadata={
        "llama.attention.value_length": Typed(GGUFValueType.UINT32, 16)})  # fmt: skip
    with pytest.raises(ModelError, match="value_length 16 differs from the key length 32"):
        load(path, "cpu")
