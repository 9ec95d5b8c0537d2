"""The fast CUDA engine (``qlib.llama.fast_cuda``, ``quants.cuda.fused``) against the faithful one.

Reference: ``ModelWeights(form="f32")`` on the same device, which dequantizes
every weight to float32 and runs candle's forward op by op. The fast path reads
the same float32 weight values inside its kernels and accumulates in float32,
so the two differ only in the order of float32 sums: on the tiny models the
logits agree to ``TOL`` x the largest logit (observed ~4e-7 under the Triton
interpreter; float32 rounding through two layers is ~1e-6 at most, 10x margin).
Graph replay runs the very kernels of the eager step, so it is compared
bit for bit. The real SmolLM2 file: greedy output identical to the f32 form for
the first 32 tokens of the benchmark prompt (issue 6's criterion).

Without CUDA and Triton the kernel tests skip; ``QLIB_TRITON_INTERPRET=1`` with
``TRITON_INTERPRET=1`` runs them on the CPU through Triton's interpreter (slow).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from synthetic import (
    _encode,
    greedy,
    tiny_llama_float_weights,
    tiny_llama_metadata,
    write_tiny_llama,
)

from qlib import models
from qlib.gguf import Content, write
from qlib.llama.errors import IndexPosError, InputError, ModelError, ShapeError
from qlib.llama.faithful import ModelWeights
from qlib.llama.fast_cuda import CudaFastModel, DenseWeight
from qlib.quants.cuda import matmul as gpu

CUDA = torch.cuda.is_available() and gpu.triton_available()
INTERPRET = os.environ.get("QLIB_TRITON_INTERPRET") == "1" and gpu.triton_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_kernels = pytest.mark.skipif(
    not (CUDA or INTERPRET), reason="needs CUDA and Triton (or QLIB_TRITON_INTERPRET=1)"
)
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
TOL = 1e-5  # x max |logit|
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "NVFP4", "MXFP4", "Q1_0",
         "IQ4_NL", "IQ4_XS")  # fmt: skip
# every type of NATIVE and mixes: tests/test_mixed_types.py


def sizes(type_name: str) -> dict:
    """Rows of super-blocks (K-quants, IQ4_XS: 256 elements) or of Q1_0's 128: n_embd 256, n_ff
    512 (head dim 64)."""
    wide = type_name.endswith("_K") or type_name in ("Q1_0", "IQ4_XS")
    return dict(n_embd=256, n_ff=512) if wide else {}


def load_pair(path, **kwargs) -> tuple[ModelWeights, CudaFastModel]:
    """The f32 form and the fast CUDA engine with the fused kernels unless ``decode`` says
    otherwise (this module tests them; the default's choice, ``decode="auto"``:
    tests/test_persistent_cuda.py)."""
    kwargs.setdefault("decode", "fused")
    with open(path, "rb") as f:
        content = Content.read(f)
        ref = ModelWeights.from_gguf(content, f, DEVICE, form="f32")
        fast = CudaFastModel.from_gguf(content, f, DEVICE, **kwargs)
    return ref, fast


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    assert diff <= TOL * scale, f"max |diff| {diff:.3g} > {TOL} x {scale:.3g}"


def run_script(ref, fast) -> None:
    """Prefill (every position, then last only), three decode steps, a chunk after a prefix."""
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 2]])
    close(fast.forward(ids, 0, all_logits=True), ref.forward(ids, 0, all_logits=True))
    close(fast.forward(ids, 0), ref.forward(ids, 0))
    for step, token in enumerate((3, 44, 200)):
        x = torch.tensor([[token]])
        close(fast.forward(x, 7 + step), ref.forward(x, 7 + step))
    chunk = torch.tensor([[4, 8, 15]])
    close(fast.forward(chunk, 10, all_logits=True), ref.forward(chunk, 10, all_logits=True))
    assert fast.kv_len == 13


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_matches_f32_form(tmp_path, type_name):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, n_kv_head=2,
                            **sizes(type_name))  # fmt: skip
    run_script(*load_pair(path))


@needs_kernels
@pytest.mark.parametrize("n_kv_head", [1, 4])
def test_gqa_groups_and_untied_output(tmp_path, n_kv_head):
    path = write_tiny_llama(
        tmp_path / "m.gguf", weight_type="Q4_1", n_kv_head=n_kv_head, tie_output=False
    )
    run_script(*load_pair(path))


@needs_kernels
@pytest.mark.parametrize("attention", ["split", "single"])
@pytest.mark.parametrize(("n_embd", "n_head", "n_kv_head"), [(128, 4, 2), (192, 3, 1)])
def test_attention_paths(tmp_path, attention, n_embd, n_head, n_kv_head):
    """Head dims 32 and 64 (the tiny default is 16), a head count that is not a power of two,
    both decode attention kernels."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_0", n_embd=n_embd,
                            n_head=n_head, n_kv_head=n_kv_head)  # fmt: skip
    run_script(*load_pair(path, attention=attention))


@needs_kernels
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 32), (2, 1, 16)])
def test_split_attention_matches_reference(kv, heads):
    """The decode attention in blocks of 64 positions and their combine against
    softmax(q K^T / sqrt d) V in float64 over the cached rows as stored: 2e-5 absolute on
    outputs of magnitude ~1 (float32 arithmetic in another summation order), at lengths around
    the block size and past one combine step of 64 blocks."""
    from qlib.quants.cuda import fused

    nq, nkv, d = heads
    g = torch.Generator().manual_seed(nq * d)
    S = 4200
    dtype = torch.float16 if kv == "f16" else torch.float32
    kc = torch.randn(nkv, S, d, generator=g).to(dtype).to(DEVICE)
    vc = torch.randn(nkv, S, d, generator=g).to(dtype).to(DEVICE)
    q = torch.randn(nq * d, generator=g).to(DEVICE)
    attend = fused.SplitAttention(heads, S, DEVICE)
    out = torch.empty(nq * d, device=DEVICE)
    for pos in (0, 63, 64, 200, 4095, S - 1):
        attend(q, kc, vc, out, torch.tensor([pos], dtype=torch.int32, device=DEVICE))
        K = kc[:, : pos + 1].double().repeat_interleave(nq // nkv, 0)
        V = vc[:, : pos + 1].double().repeat_interleave(nq // nkv, 0)
        w = torch.softmax(q.double().view(nq, 1, d) @ K.transpose(1, 2) / d**0.5, -1)
        ref = (w @ V).reshape(-1)
        assert (out.double() - ref).abs().max().item() <= 2e-5, f"pos {pos}"


@needs_kernels
@pytest.mark.parametrize(
    ("attention", "decode"), [("split", "fused"), ("single", "fused"), ("split", "merged")]
)
def test_f16_cache_near_f32_cache(tmp_path, attention, decode):
    """``kv_type="f16"``: layer 0's cached rows are the float32 cache's rounded to half (same
    inputs; rounded to nearest even when stored), and the logits of a prefill and three decode
    steps stay within 5e-3 of their scale of the float32 cache's (keys and values rounded to
    11 bits, unit roundoff 2^-11 = 4.9e-4: ~10u through the two layers)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_0", n_embd=128, n_head=4,
                            n_kv_head=2)  # fmt: skip
    logits = {}
    with open(path, "rb") as f:
        content = Content.read(f)
        models_ = {kv: CudaFastModel.from_gguf(content, f, DEVICE, attention=attention,
                                               decode=decode, kv_type=kv)
                   for kv in ("f32", "f16")}  # fmt: skip
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 2]])
    for kv, fast in models_.items():
        rows = [fast.forward(ids, 0, all_logits=True)[0]]
        rows += [fast.forward(torch.tensor([[t]]), 7 + i) for i, t in enumerate((3, 44, 200))]
        logits[kv] = torch.cat(rows)
    half, full = models_["f16"].cache, models_["f32"].cache
    assert half.dtype == torch.float16
    assert torch.equal(half[0, :, :, :10], full[0, :, :, :10].half())
    scale = logits["f32"].abs().max().item()
    diff = (logits["f16"] - logits["f32"]).abs().max().item()
    assert 0 < diff <= 5e-3 * scale, f"max |diff| {diff:.3g} against scale {scale:.3g}"


@needs_kernels
def test_mixed_types_take_the_unfused_kernels(tmp_path):
    """attn_v and ffn_up in another type than their neighbours (as in Q4_K_M files)."""
    floats = tiny_llama_float_weights()
    tensors = {}
    for name, w in floats.items():
        kind = "Q8_0" if ("attn_v" in name or "ffn_up" in name) else "Q4_0"
        tensors[name] = _encode(name, w, kind)[0]
    path = tmp_path / "mixed.gguf"
    with open(path, "wb") as f:
        write(f, tiny_llama_metadata(), tensors)
    ref, fast = load_pair(path)
    assert len(fast.layers[0].wqkv.parts) == 2 and len(fast.layers[0].w13.parts) == 2
    run_script(ref, fast)


def merged_sizes(type_name: str) -> dict:
    """Shapes whose layers ``decode="merged"`` merges (head dim a multiple of 32): head dim 32,
    or 64 with ``sizes``' rows of 256 elements."""
    return sizes(type_name) or dict(n_embd=128)


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
def test_merged_decode_matches_f32_form(tmp_path, type_name):
    """``decode="merged"``: the attention's combine in the output projection's kernel, float
    atomics summing the heads' shares: the f32 form's logits to TOL."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, n_kv_head=2,
                            tie_output=type_name != "Q8_0", **merged_sizes(type_name))  # fmt: skip
    ref, fast = load_pair(path, decode="merged")
    assert fast.decode == "merged" and all(fast._mergeable(ly) for ly in fast.layers)
    run_script(ref, fast)


@needs_kernels
@pytest.mark.parametrize("n_kv_head", [1, 4])
def test_merged_decode_with_a_mixed_layer(tmp_path, n_kv_head):
    """A dense ``attn_output`` (F16) keeps its layer's combine and projection apart between
    merged layers; mixed q/k/v and gate/up types beside a merged combine."""
    mixed = {"blk.1.attn_output.*": "F16", "blk.0.ffn_up.*": "Q8_0", "blk.2.attn_v.*": "Q8_0"}
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_0", n_layer=3, n_embd=128,
                            n_kv_head=n_kv_head, weight_types=mixed)  # fmt: skip
    ref, fast = load_pair(path, decode="merged")
    assert [fast._mergeable(ly) for ly in fast.layers] == [True, False, True]
    run_script(ref, fast)


@needs_cuda  # the tensor-core GEMM's bf16 dots are not emulated faithfully by the interpreter
@pytest.mark.parametrize("type_name", ["Q5_1", "Q2_K", "Q3_K", "NVFP4", "MXFP4", "Q1_0", "IQ4_NL",
                                       "IQ4_XS"])  # fmt: skip
def test_packed_prefill_matches_dense(tmp_path, type_name):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, **sizes(type_name))
    ref, fast = load_pair(path, prefill="packed")
    assert fast.layers[0].wqkv.dense is None
    ids = torch.tensor([list(range(3, 40))])
    close(fast.forward(ids, 0, all_logits=True), ref.forward(ids, 0, all_logits=True))


# Tensor-core prefill modes against the f32 form. Unit roundoff: bf16 2^-9, tf32 2^-11; each
# product rounds both inputs (2u), and the errors of a dot's terms partly cancel; through two
# layers and the output a bound of ~12u of the largest logit: bf16 0.025, tf32 0.006.
PREFILL_TOL = {"bf16": 0.025, "tf32": 0.006}


@needs_cuda
@pytest.mark.parametrize("mode", sorted(PREFILL_TOL))
def test_tensor_core_prefill_near_f32(tmp_path, mode):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_kv_head=2)
    ref, fast = load_pair(path, prefill=mode)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    assert fast.layers[0].wqkv.dense.dtype == dtype
    ids = torch.tensor([list(range(3, 60))])
    tol = PREFILL_TOL[mode]

    def check(a: torch.Tensor, b: torch.Tensor) -> float:
        diff, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert diff <= tol * scale, f"{mode}: {diff:.3g} > {tol} x {scale:.3g}"
        return diff

    for all_logits in (True, False, False):  # eager, eager (first length), graph capture
        diff = check(fast.forward(ids, 0, all_logits=all_logits),
                     ref.forward(ids, 0, all_logits=all_logits))  # fmt: skip
        assert diff > 0  # the rounding shows: the tensor-core mode really ran
    assert torch.backends.cuda.matmul.fp32_precision != "tf32"  # restored after the prefill
    x = torch.tensor([[7]])  # a decode step after it: the f32 kernels on the prefilled cache
    check(fast.forward(x, ids.shape[1]), ref.forward(x, ids.shape[1]))


def greedy_logits(model, n=24) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    out, logits = [], []
    for _ in range(3):  # the second and third prefill replay the captured graph
        step = model.forward(ids, 0)
    pos = ids.shape[1]
    for _ in range(n):
        out.append(int(step[0].argmax()))
        logits.append(step)
        step = model.forward(torch.tensor([[out[-1]]]), pos)
        pos += 1
    return out, torch.cat(logits)


@needs_cuda
def test_graph_replay_equals_eager(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1")
    _, eager = load_pair(path, graphs=False)
    _, graphed = load_pair(path)
    (a, la), (b, lb) = greedy_logits(eager), greedy_logits(graphed)
    assert graphed._decode_graph is not None and graphed._prefill_graphs
    assert a == b
    assert torch.equal(la, lb)


@needs_cuda
def test_dependent_launch_changes_nothing(tmp_path):
    """Programmatic dependent launch only moves when the kernels start: the same kernels'
    results, bit for bit (each kernel waits for its predecessor before touching memory)."""
    from qlib.quants.cuda import fused

    if not fused.pdl_available():
        pytest.skip("no programmatic dependent launch here (needs sm90+ and Triton >= 3.4)")
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1")
    _, on = load_pair(path, pdl=True)
    _, off = load_pair(path, pdl=False)
    (a, la), (b, lb) = greedy_logits(on), greedy_logits(off)
    assert a == b
    assert torch.equal(la, lb)


@needs_kernels
@pytest.mark.parametrize("decode", ["fused", "persistent"])
def test_greedy_step_is_the_argmax_of_the_step(tmp_path, decode):
    """``greedy_step`` (the argmax taken in the step's graph, only the id read back) returns
    the argmax of the logits the same step wrote, step after step, in the graph or not; and
    ``generate`` takes that path, with the ids of forward + argmax (fused: deterministic)."""
    from qlib.generate import generate

    if decode == "persistent" and not CUDA:
        pytest.skip("the persistent kernel needs CUDA")
    # head_dim 32, as the persistent kernel needs
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=256)  # fmt: skip
    _, fast = load_pair(path, decode=decode)
    fast.launch_ahead = False  # (with it, _logits would hold the step queued ahead)
    prompt = [1, 5, 9, 33, 7]
    token = int(fast.forward(torch.tensor([prompt]), 0)[0].argmax())
    for pos in range(len(prompt), len(prompt) + 6):
        token_next = fast.greedy_step(token, pos)
        assert token_next == int(fast._logits[0].argmax())
        token = token_next
    assert fast.kv_len == len(prompt) + 6
    assert (fast._greedy_graph is not None) == CUDA
    if decode == "fused":
        fast.launch_ahead = True  # (generate's greedy steps launched ahead, as by default)
        ids = generate(fast, prompt, 8)
        fast.clear_kv_cache()
        with torch.inference_mode():  # (as generate)
            ref = [int(fast.forward(torch.tensor([prompt]), 0)[0].argmax())]
            for pos in range(len(prompt), len(prompt) + 7):
                ref.append(int(fast.forward(torch.tensor([[ref[-1]]]), pos)[0].argmax()))
        assert ids == ref


def test_index_pos_and_shape_errors(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0")
    with open(path, "rb") as f:
        content = Content.read(f)
        with pytest.raises(ModelError, match="unknown prefill mode"):
            CudaFastModel.from_gguf(content, f, "cpu", prefill="int8")  # a CPU engine's mode
        with pytest.raises(ModelError, match="unknown kv_type 'int8'"):
            CudaFastModel.from_gguf(content, f, "cpu", kv_type="int8")
        with pytest.raises(ModelError, match="persistent runs on a CUDA device, not cpu"):
            CudaFastModel.from_gguf(content, f, "cpu", decode="persistent")
        half = CudaFastModel.from_gguf(content, f, "cpu", kv_type="f16", max_seq_len=16)
        assert half.kv_type == "f16" and half.cache.dtype == torch.float16
        fast = CudaFastModel.from_gguf(content, f, "cpu", max_seq_len=16)
    with pytest.raises(IndexPosError, match="index_pos 3 disagrees"):
        fast.forward(torch.tensor([[1]]), 3)
    with pytest.raises(ShapeError):
        fast.forward(torch.tensor([1, 2]), 0)
    with pytest.raises(ModelError, match="exceed max_seq_len 16"):
        fast.forward(torch.tensor([list(range(17))]), 0)
    with pytest.raises(InputError, match=r"token id 256 is outside the vocabulary \(0..255\)"):
        fast.forward(torch.tensor([[1, 256]]), 0)
    with pytest.raises(InputError, match="token id -1 is outside"):
        fast.greedy_step(-1, 0)
    with pytest.raises(InputError, match="must be integers"):
        fast.forward(torch.tensor([[1.0]]), 0)


def test_types_without_kernels_are_dense_parts(tmp_path):
    """No type is refused: F16 (no Triton kernel) becomes float32 ``DenseWeight`` parts, the
    prefill copy's rows (every type and mix: ``tests/test_mixed_types.py``)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="F16")
    with open(path, "rb") as f:
        content = Content.read(f)
        fast = CudaFastModel.from_gguf(content, f, "cpu")
    lin = fast.layers[0].wqkv
    assert lin.types == ["F16"] and isinstance(lin.parts[0], DenseWeight)
    assert lin.parts[0].w.data_ptr() == lin.dense.data_ptr()
    assert isinstance(fast.tok_embd, DenseWeight)


@pytest.mark.parametrize(("type_name", "bits"), [("NVFP4", 5.0), ("MXFP4", 5.0), ("Q1_0", 1.125),
                                                 ("IQ4_NL", 4.5), ("IQ4_XS", 4.625)])  # fmt: skip
def test_planes_of_their_own(tmp_path, type_name, bits):
    """NVFP4, MXFP4, Q1_0, IQ4_NL and IQ4_XS (a table type) run as planes of their own
    (``layout``: bits a weight as given, and a table of 16 levels but for Q1_0), no float32
    copy of the weights (a CPU device: the planes only, no kernel runs)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type=type_name, n_embd=256, n_ff=512)
    with open(path, "rb") as f:
        content = Content.read(f)
        fast = CudaFastModel.from_gguf(content, f, "cpu", prefill="packed", decode="fused")
    for lin in (fast.layers[0].wqkv, fast.layers[0].w2):
        assert lin.types == [type_name] and lin.dense is None
        levels = 0 if type_name == "Q1_0" else 16
        assert 8 * (lin.parts[0].nbytes() - levels) / (lin.out_features * lin.in_features) == bits


# -- the real model ------------------------------------------------------------------------


@needs_cuda
def test_smollm2_greedy_equals_f32_form(smollm2_path):
    from qlib.suite.bench import prompt_ids
    from qlib.tokenizer import Tokenizer

    ref, fast = load_pair(smollm2_path)
    with open(smollm2_path, "rb") as f:
        tokenizer = Tokenizer.from_metadata(Content.read(f).metadata)
    ids = prompt_ids(tokenizer.encode, 203, models.data_file("passage.txt"))

    with torch.inference_mode():
        assert greedy(fast, ids) == greedy(ref, ids)
        tf = torch.tensor([ids])
        a = fast.forward(tf, 0, all_logits=True)[0]
        b = ref.forward(tf, 0, all_logits=True)[0]
    np.testing.assert_array_equal(a.argmax(-1).cpu(), b.argmax(-1).cpu())
    assert (a - b).abs().max().item() <= 1e-3  # float32 order over 30 layers (as test_smollm2)


@needs_cuda
def test_smollm2_merged_decode_greedy_equals_f32_form(smollm2_path):
    """``decode="merged"`` on the real model: its greedy ids are the f32 form's for 32 tokens."""
    from qlib.suite.bench import prompt_ids
    from qlib.tokenizer import Tokenizer

    ref, fast = load_pair(smollm2_path, decode="merged")
    with open(smollm2_path, "rb") as f:
        tokenizer = Tokenizer.from_metadata(Content.read(f).metadata)
    ids = prompt_ids(tokenizer.encode, 203, models.data_file("passage.txt"))
    with torch.inference_mode():
        assert greedy(fast, ids) == greedy(ref, ids)
