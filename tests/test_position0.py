"""Position-0 logits of the faithful quantized form against llama.cpp (issue 13, item 7).

At position 0 nothing is mixed by attention (one key, softmax weight exactly 1), so the
logits there are a fixed function of the token: the place to compare the two engines op by
op. What was found (docs/design.md, "Position 0 against llama.cpp"; tools/position0.py):

* llama.cpp (llama-cpp-python, CPU, f32 KV cache, flash attention off) computes every
  weight matmul, the tied Q8_0 output included, with ggml's x86 ``from_float`` + ``vec_dot``
  of the weight's type, to the bit; no other kernel or buffer.
* qlib with each QMatMul replaced by that same ggml ``vec_dot`` gives llama.cpp's
  position-0 logits to the bit, on tied and untied files: the rest of the forward
  (embedding row, RMSNorm, RoPE, attention, SiLU, residuals) is bit-equal.
* qlib's own dot products equal ggml's to float rounding only (another float32 summation
  order of the same per-block terms). Activation quantization is discontinuous: when an
  activation block's ``amax / 127`` lies within those few ulps of an f16 rounding midpoint
  (or a code of one), the two engines store a different Q8 scale, one f16 step apart
  (2^-11 relative), and the step grows through the layers. SmolLM2's ``<|im_start|>`` at
  position 0 is such a case (an exact tie in layer 0, amplified by that token's large
  activations); ggml's own scalar reference dot (``*_generic``) lands off llama.cpp there
  too, by more (0.29 against qlib's 0.196).

So the tests hold: (1) bit-equality with ggml's dots, (2) the faithful form to 1e-5 on the
tokens where no such tie falls (nearly all: 252 and 254 of 256 measured), far below what a
different kernel gives (the dequantized f32 form is 0.02-0.4 away from llama.cpp), and (3)
on SmolLM2, token 1 within the measured effect of its tie, and bit-equal with ggml's dots.
A second ulp source, on some rows only: qlib's RMSNorm (candle's float32 mean and division)
against ggml's (double sum, float ``1/sqrt`` scale).
"""

from __future__ import annotations

import numpy as np
import pytest
import quants_ggml
import torch
from synthetic import write_tiny_llama

from qlib import models
from qlib.gguf import GGUFValueType, Typed
from qlib.llama.engine import load

pytestmark = pytest.mark.peers
llama_cpp = pytest.importorskip("llama_cpp")
GGML = quants_ggml.load()

VOCAB = 256
BIT_TOL = 1e-6  # measured 0.0: the same ops in the same order; 1e-6 leaves room for libm
FAITHFUL_TOL = 1e-5  # float32 rounding of the dot order through 2 layers (median ~1e-6)
FAITHFUL_SHARE = 0.9  # tokens within FAITHFUL_TOL (measured 252/256 tied, 254/256 untied)
KINDS = {
    # SmolLM2's kind: Q4_1 matrices, no output.weight (the output is the Q8_0 token_embd)
    "tied-q8_0": dict(weight_type="Q4_1", tie_output=True),
    # the 1B file's types, but with its own output.weight
    "untied": dict(weight_type="Q8_0", tie_output=False),
}


def llama_cpp_model(path):
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=16,
        n_batch=16,
        n_ubatch=16,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32: the default f16 cache rounds K and V
        type_v=0,
        flash_attn=False,  # with it on, an f32 cache is read as f16
        n_gpu_layers=0,
        n_threads=2,
        verbose=False,
    )


def llama_cpp_pos0(llm, tokens) -> np.ndarray:
    """[len(tokens), vocab]: each token alone at position 0."""
    out = []
    for t in tokens:
        llm.reset()
        llm.eval([int(t)])
        out.append(np.array(llm.scores[0], dtype=np.float32))
    return np.stack(out)


def qlib_pos0(model, tokens) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for t in tokens:
            model.clear_kv_cache()
            out.append(model.forward(torch.tensor([[int(t)]]), 0)[0].float().numpy())
    model.clear_kv_cache()
    return np.stack(out)


def quantized_and_llama_cpp(path, tokens):
    """(the faithful quantized form of the file at ``path``, llama.cpp's logits of each token
    alone at position 0)."""
    llm = llama_cpp_model(path)
    try:
        ref = llama_cpp_pos0(llm, tokens)
    finally:
        llm.close()
    return load(path, "cpu", form="quantized")[0], ref


def quantized_pos0_gap(path, tokens) -> np.ndarray:
    """Per token (each alone at position 0), the largest |logit difference| of the faithful
    quantized form from llama.cpp's on the file at ``path``."""
    model, ref = quantized_and_llama_cpp(path, tokens)
    return np.abs(qlib_pos0(model, tokens) - ref).max(axis=1)


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory):
    """(kind, path, llama.cpp's position-0 logits of every token) of a synthetic file."""
    kind = request.param
    path = tmp_path_factory.mktemp("pos0") / f"{kind}.gguf"
    write_tiny_llama(
        path,
        **KINDS[kind],
        weight_types={"token_embd.weight": "Q8_0"},
        n_embd=128,  # k % 64 == 0: qlib's C kernels take every matmul, as on real files
        n_ff=256,
        vocab=VOCAB,
        seed=0,
        # no tokenizer: llama.cpp reads the vocabulary size from the key
        extra_metadata={
            "tokenizer.ggml.model": "none",
            "llama.vocab_size": Typed(GGUFValueType.UINT32, VOCAB),
        },
    )
    llm = llama_cpp_model(path)
    try:
        ref = llama_cpp_pos0(llm, range(VOCAB))
    finally:
        llm.close()
    return kind, path, ref


def test_position0_with_ggml_dots_is_llama_cpp(tiny):
    """Everything but the dot products is bit-equal to llama.cpp, tied output included."""
    if GGML is None:
        pytest.skip("no libggml")
    kind, path, ref = tiny
    model, _ = load(path, "cpu", form="quantized")
    quants_ggml.with_ggml_dots(model, GGML)
    tokens = range(0, VOCAB, 4)
    diff = np.abs(qlib_pos0(model, tokens) - ref[list(tokens)]).max()
    assert diff <= BIT_TOL, f"{kind}: max |diff| {diff:.3g}"


def test_position0_faithful_quantized_matches_llama_cpp(tiny):
    kind, path, ref = tiny
    model, _ = load(path, "cpu", form="quantized")
    d = np.abs(qlib_pos0(model, range(VOCAB)) - ref).max(axis=1)
    share = float((d <= FAITHFUL_TOL).mean())
    assert share >= FAITHFUL_SHARE, (
        f"{kind}: {share:.1%} of tokens within {FAITHFUL_TOL} of llama.cpp (median "
        f"{np.median(d):.3g}, max {d.max():.3g})"
    )
    # the dequantized f32 form (no activation quantization) is farther than that on every
    # token: what a different output kernel would look like, so the bar above can tell
    f32, _ = load(path, "cpu", form="f32")
    assert np.abs(qlib_pos0(f32, range(0, VOCAB, 16)) - ref[::16]).max(axis=1).min() > 1e-3


@pytest.mark.slow
def test_smollm2_im_start_at_position0():
    """SmolLM2 Q4_1 (output tied to its Q8_0 token_embd), token 1 = <|im_start|> alone."""
    try:
        path = models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    if GGML is None:
        pytest.skip("no libggml")
    tokens = [1, 9690, 198, 28]
    model, ref = quantized_and_llama_cpp(path, tokens)
    d = np.abs(qlib_pos0(model, tokens[:1]) - ref[:1]).max()
    # token 1: blk.0 attn_output's Q8_1 input, block 12 (and 14, 16: the GQA copies), has
    # llama.cpp's amax / 127 exactly on an f16 midpoint and qlib's 1 ulp below it; measured
    # 0.196 on logits of magnitude ~23. Through 30 layers such flips are common at position 0
    # on this file (0.2-0.5 on the other tokens here; the f32 form is 0.35-0.7 away), so the
    # faithful form is held to that size only; the exact statement is the one below.
    assert d < 0.3, d
    # with ggml's dots the whole forward is llama.cpp's, to the bit, on these tokens (not on
    # every token: qlib's RMSNorm, candle's f32 mean and division, differs from ggml's
    # double sum and 1/sqrt scale by an ulp on some rows, e.g. token 3000's embedding)
    quants_ggml.with_ggml_dots(model, GGML)
    exact = np.abs(qlib_pos0(model, tokens) - ref).max(axis=1)
    assert (exact <= BIT_TOL).all(), f"with ggml's dots: max |diff| per token {exact}"
