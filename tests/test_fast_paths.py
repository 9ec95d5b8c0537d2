"""The fast CPU path (qlib.fast, qlib.quants.cpu) against the faithful one.

Kernels: ``qlib.quants.cpu.qgemm`` equals the literal ggml transcription
(``qlib.quants.reference.matmul``) to float rounding (rtol 1e-5: only the
order of the float32 block sums differs); the repacked bf16 weights equal the
float32 dequantized values rounded to bf16, bit for bit.

Models: with ``prefill="int8"`` FastModel has ggml semantics everywhere, as the
faithful ``quantized`` form, so logits agree to float rounding (2e-5 x the
logit scale). One caveat: a one-ulp difference in an activation (another float
order in RmsNorm, RoPE or attention) can flip one Q8 code and move a logit by
~1e-3 of its scale, so quantized tiny models allow that (5e-3 x scale). The
bf16 prefill is compared with the f32 form by teacher-forced argmax agreement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib import fast, models
from qlib.gguf_file import Content
from qlib.qtensor import QTensor
from qlib.quantized_llama import IndexPosError, ModelWeights
from qlib.quants import cpu, reference

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)
KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@needs_kernels
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
@pytest.mark.parametrize("m", [1, 3])
def test_qgemm_matches_ggml_reference(type_name, m):
    g = torch.Generator().manual_seed(1)
    w = QTensor.quantize(torch.randn(37, 192, generator=g), type_name)
    x = torch.randn(m, 192, generator=g) * 3
    y = cpu.qgemm(x, cpu.pack(w))
    ref = reference.matmul(w.data.numpy(), x.numpy(), type_name)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@needs_kernels
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_pack_stacked_and_bf16(type_name):
    g = torch.Generator().manual_seed(2)
    a = QTensor.quantize(torch.randn(8, 128, generator=g), type_name)
    b = QTensor.quantize(torch.randn(5, 128, generator=g), type_name)
    pw = cpu.pack([a, b])
    both = torch.cat([a.dequantize(), b.dequantize()])
    assert torch.equal(cpu.dequantize_bf16(pw), both.to(torch.bfloat16))
    x = torch.randn(2, 128, generator=g)
    y = cpu.qgemm(x, pw)
    assert torch.allclose(y[:, :8], cpu.qgemm(x, cpu.pack(a)), rtol=1e-6, atol=1e-6)


def test_unsupported_shapes_are_refused():
    w = QTensor.quantize(torch.randn(4, 96), "Q8_0")  # k % 64 != 0
    assert not cpu.supports("Q8_0", 96) and not cpu.supports("Q4_K", 256)
    with pytest.raises(ValueError):
        cpu.pack(w)


def _build(path, cls=ModelWeights, **kw):
    with open(path, "rb") as f:
        content = Content.read(f)
        return cls.from_gguf(content, f, "cpu", **kw)


@pytest.fixture(params=["F32", "Q8_0", "Q4_1", "Q4_0"])
def tiny(request, tmp_path):
    wt = request.param
    path = write_tiny_llama(tmp_path / f"tiny_{wt}.gguf", weight_type=wt, n_embd=128, n_ff=256)
    return wt, path


def _check_against_faithful(path, wt, fm):
    ref = _build(path)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    tol = 2e-5 if wt == "F32" else 5e-3
    with torch.inference_mode():
        a = fm.forward(ids[:, :9], 0, all_logits=True)
        b = ref.forward(ids[:, :9], 0, all_logits=True)
        scale = b.abs().max()
        assert (a - b).abs().max() <= tol * scale
        for pos in range(9, 12):  # decode steps
            a = fm.forward(ids[:, pos : pos + 1], pos)
            b = ref.forward(ids[:, pos : pos + 1], pos)
            assert (a - b).abs().max() <= tol * scale, pos


def test_fast_model_matches_faithful(tiny):
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="int8")
    if cpu.available() and wt != "F32":
        assert fm._plan is not None  # the fused C decode step is what is tested
    _check_against_faithful(path, wt, fm)


def test_fast_model_without_kernels(tiny, monkeypatch):
    wt, path = tiny
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_reason", "disabled by the test")
    fm = _build(path, fast.FastModel, prefill="int8")
    assert fm._plan is None and all(ly.wqkv.packed is None for ly in fm.layers)
    _check_against_faithful(path, wt, fm)


def test_bf16_prefill_close_to_f32(tiny):
    wt, path = tiny
    fm = _build(path, fast.FastModel, prefill="bf16", bf16_min_rows=2)
    ref = _build(path, form="f32")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a = fm.forward(ids, 0, all_logits=True)[0]
        b = ref.forward(ids, 0, all_logits=True)[0]
    assert (a - b).abs().max() <= 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_index_pos_is_checked(tiny):
    _, path = tiny
    fm = _build(path, fast.FastModel)
    with torch.inference_mode():
        fm.forward(torch.tensor([[1, 2, 3]]), 0)
        with pytest.raises(IndexPosError):
            fm.forward(torch.tensor([[4]]), 5)
        fm.forward(torch.tensor([[4]]), 3)
        assert fm.kv_len == 4
        fm.forward(torch.tensor([[5, 6]]), 4)  # a chunk after a prefix (masked SDPA)
        fm.forward(torch.tensor([[1]]), 0)  # 0 starts over
        assert fm.kv_len == 1


# -- SmolLM2 -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    try:
        path = models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    from qlib.tokenizer import Tokenizer

    with open(path, "rb") as f:
        content = Content.read(f)
    ids = Tokenizer.from_metadata(content.metadata).encode(
        models.data_file("passage.txt").read_text()
    )[:203]
    return path, torch.tensor([ids])


@pytest.mark.slow
def test_smollm2_bf16_prefill_argmax_agreement(smollm2):
    """Teacher forcing over the 203-token benchmark prompt: >= 95% argmax agreement."""
    path, ids = smollm2
    fm = _build(path, fast.FastModel)
    ref = _build(path, form="f32")
    with torch.inference_mode():
        a = fm.forward(ids, 0, all_logits=True)[0]
        b = ref.forward(ids, 0, all_logits=True)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95


@pytest.mark.slow
def test_smollm2_decode_matches_quantized_form(smollm2):
    """int8 prefill + C decode vs the faithful quantized form: same greedy tokens."""
    path, ids = smollm2
    fm = _build(path, fast.FastModel, prefill="int8")
    ref = _build(path)
    prompt = ids[:, :40]
    with torch.inference_mode():
        a, b = fm.forward(prompt, 0), ref.forward(prompt, 0)
        pos = prompt.shape[1]
        for _ in range(8):
            assert int(a.argmax()) == int(b.argmax())
            # ggml semantics on both sides; rare Q8 code flips stay well below 5% of scale
            assert (a - b).abs().max() <= 0.05 * b.abs().max()
            tok = torch.tensor([[int(b.argmax())]])
            a, b = fm.forward(tok, pos), ref.forward(tok, pos)
            pos += 1
