"""The persistent decode kernel (``qlib.quants.cuda.persistent``, ``decode="persistent"`` of the
fast CUDA engine) against the f32 form and the fused kernels. Needs CUDA and NVRTC: skipped
elsewhere (the module still imports).

Tolerance: the kernel dequantizes the same blocks exactly and accumulates in float32, in
another order than the f32 form's cuBLAS products: ``TOL`` x max |logit| per decode step, as
``tests/test_fast_cuda.py``; on SmolLM2 (30 layers) 1e-3 absolute, as the fused path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import greedy, write_tiny_llama

from qlib import models
from qlib.gguf import Content
from qlib.llama.errors import ModelError
from qlib.llama.faithful import ModelWeights
from qlib.quants.cuda import persistent

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = 1e-5
TYPES = ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def load(path, **options):
    from qlib.llama.fast_cuda import CudaFastModel

    with open(path, "rb") as f:
        content = Content.read(f)
        ref = ModelWeights.from_gguf(content, f, "cuda", form="f32")
        fast = CudaFastModel.from_gguf(content, f, "cuda", decode="persistent", **options)
    return ref, fast


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    assert diff <= tol * scale, f"max |diff| {diff:.3g} > {tol} x {scale:.3g}"


def test_unsupported_reasons():
    assert persistent.unsupported({"w": "Q4_1"}, 64, 64) is None
    assert "Q4_K" in persistent.unsupported({"w": "Q4_K", "v": "Q6_K"}, 64, 64)
    assert "head_dim" in persistent.unsupported({"w": "Q8_0"}, 16, 16)
    assert "rope_dim" in persistent.unsupported({"w": "Q8_0"}, 64, 32)
    why = persistent.unsupported({"w": "Q2_K", "v": "Q3_K"}, 64, 64)  # Triton kernels only
    assert "Q2_K, Q3_K" in why


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K"])
def test_kquant_file_refused_before_any_kernel(tmp_path, type_name):
    """The fast engine keeps Q2_K/Q3_K packed for its Triton kernels, but ``decode="persistent"``
    refuses the file with the reason (on any device: nothing is compiled)."""
    from qlib.llama.fast_cuda import CudaFastModel

    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, n_embd=256, n_ff=512)
    with open(path, "rb") as f:
        content = Content.read(f)
        with pytest.raises(ModelError, match=f"no code for {type_name}"):
            CudaFastModel.from_gguf(content, f, "cpu", decode="persistent")


@needs_cuda
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("graphs", [False, True])
def test_decode_steps_match_f32_form(tmp_path, type_name, graphs):
    """Prefill by the fused path, then decode steps by the persistent kernel (eager and
    replayed from a CUDA graph), untied output, GQA 2:1, head_dim 32."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=256, tie_output=False)  # fmt: skip
    ref, fast = load(path, graphs=graphs)
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 2]])
    close(fast.forward(ids, 0), ref.forward(ids, 0))
    for step, token in enumerate((3, 44, 200, 17, 90)):
        x = torch.tensor([[token]])
        close(fast.forward(x, 7 + step), ref.forward(x, 7 + step))
    assert fast.kv_len == 12


@needs_cuda
@pytest.mark.parametrize("split", [persistent.SPLIT, 16])
def test_decode_from_position_zero_and_long_attention(tmp_path, split):
    """Every position decoded one token at a time (no prefill); MHA, tied output, head_dim 64.
    ``split=16``: past 16 positions the attention of a head runs in several blocks whose
    partial softmaxes the last one merges."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0", n_embd=128, n_head=2,
                            n_kv_head=2, n_ff=256)  # fmt: skip
    ref, fast = load(path, decode_options={"split": split})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 100), generator=gen)
    want = ref.forward(ids, 0, all_logits=True)[0]
    for pos in range(ids.shape[1]):
        close(fast.forward(ids[:, pos : pos + 1], pos)[0], want[pos], tol=1e-4)


@needs_cuda
def test_types_without_code_are_refused_clearly(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_K", n_embd=256, n_head=4,
                            n_kv_head=2, n_ff=256)  # fmt: skip
    with pytest.raises(ModelError, match="no code for Q4_K"):
        load(path)


@pytest.fixture(scope="module")
def smollm2():
    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


@needs_cuda
def test_smollm2_greedy_and_teacher_forced_equal_f32_form(smollm2):
    """The issue's numerics: greedy ids equal the f32 form's for 32 tokens after the benchmark
    prompt; teacher-forced (the 203 prompt tokens decoded one at a time by the kernel) the
    argmax equals the f32 form's at every position."""
    from qlib.suite.bench import prompt_ids
    from qlib.tokenizer import Tokenizer

    ref, fast = load(smollm2)
    with open(smollm2, "rb") as f:
        tokenizer = Tokenizer.from_metadata(Content.read(f).metadata)
    ids = prompt_ids(tokenizer.encode, 203, models.data_file("passage.txt"))

    with torch.inference_mode():
        assert greedy(fast, ids) == greedy(ref, ids)
        b = ref.forward(torch.tensor([ids]), 0, all_logits=True)[0]
        fast.clear_kv_cache()
        a = torch.cat([fast.forward(torch.tensor([[t]]), p) for p, t in enumerate(ids)])
        assert int(fast._persistent.next_token()) == int(a[-1].argmax())  # the fused argmax
    np.testing.assert_array_equal(a.argmax(-1).cpu(), b.argmax(-1).cpu())
    assert (a - b).abs().max().item() <= 1e-3
