"""Every type llama.cpp writes, and mixes of them within a layer, on the fast engines.

Files: tiny synthetic llamas (``synthetic.write_tiny_llama``, ``n_embd=256``,
``n_ff=512`` so that K-quant rows divide 256) in each of the 13 types, and mixes as
llama.cpp's recipes make them (Q4_K_M: Q6_K on some ``attn_v`` / ``ffn_down``, a
32-block fallback tensor; float mixes; K-quant mixes; mixes of the C-kernel types).
The fast engines must build every one and never raise.

CPU (``FastModel``), with what each comparison allows and why:

* ``prefill="int8"`` (ggml semantics for every row) against the faithful ``quantized``
  form with SDPA attention (``attention="sdpa", kv_cache="static"``, the attention op of
  the fast engine's torch prefill): the C kernels and the torch fallback
  (``qlib.quants.cpu.matmul``) quantize the activations as ggml does and sum exact integer
  block dots, so the prefill logits agree to float rounding: ``PREFILL_TOL`` = 1e-5 x the
  largest logit (observed 0 to 2e-7) with the torch prefill. The C int8 prefill (the
  default where the kernels are: C RmsNorm, SwiGLU and tiled attention between the int8
  GEMMs) and decode run another float order (another exp, sums in other orders; observed
  0 to 2.6e-3 x, the larger ones on Q5_1, F16 and the legacy / float mixes: flipped codes,
  as below). The C prefill is bounded by ``C_PREFILL_TOL`` = 3e-2 x: on the Q5_K_M mix the
  logits from position 5 on differ by up to 1.34e-2 x, the first row untouched (seen once
  Q5_1's prefill took the tiled GEMM, and with every GEMM forced onto the GEMV loops: both
  engines call the same kernels, so what differs is the C RmsNorm / SwiGLU / attention's last
  bits, which round Q8 activation codes the other way; the kernels' own outputs agree to 3e-7
  x, ``tests/test_gemm_paths.py``). A wiring error is far above it
  (the Q5_1 part's first minimum zeroed in each row: 0.36 x); a single wrong code in every
  row (1.9e-2 x) is the kernel tests' to catch (1e-5 x of their outputs). The decode steps
  after it attend over its cache and share its bound. Decode runs the C attention kernel
  (another float order, another exp): one ulp of difference in an activation can flip one
  Q8 code (or one F16 / BF16 rounding of a float type's activations) and move a logit by
  ~1e-3 of the scale on these 3-layer random models (observed up to 3e-3; the faithful engine's
  own naive and SDPA attention differ by 2e-2 on the Q5_K_M mix): ``DECODE_TOL`` = 1e-2 x.
* the default engine (bf16 prefill matmuls, then the ggml-semantics decode) against the
  ``f32`` form: bf16 rounding of matmul inputs and Q8 activations, observed 2e-3 to
  6e-3 x the largest logit: ``F32_TOL`` = 0.05 x (as ``test_bf16_prefill_close_to_f32``),
  and >= 90% argmax agreement over the prefilled positions.

CUDA (``CudaFastModel``): the grouping into parts is checked on CPU (building needs no
kernel); with CUDA and Triton the logits are compared with the ``f32`` form as in
``test_fast_cuda`` (float32 values and accumulation everywhere: ``CUDA_TOL`` = 1e-5 x).
"""

from __future__ import annotations

import os

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import Content
from qlib.llama import engine, fast_cuda
from qlib.llama import fast_cpu as fast
from qlib.llama.faithful import ModelWeights
from qlib.quants import cpu
from qlib.quants.cpu.matmul import prepare, qmatmul_prepared
from qlib.quants.cuda import layout
from qlib.quants.cuda import matmul as gpu
from qlib.quants.forms import KERNEL_TYPE
from qlib.quants.qtensor import QTensor

TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
         "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # fmt: skip
SIZES = dict(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_kv_head=2)
# name -> (weight_type, weight_types, tie_output)
MIXES: dict[str, tuple[str, dict[str, str], bool]] = {
    # Q4_K_M as llama.cpp makes it: Q6_K on some attn_v / ffn_down, a 32-block fallback
    # (Q5_0 for Q4_K, Q8_0 for Q6_K where rows do not divide 256), Q6_K output
    "Q4_K_M": (
        "Q4_K",
        {
            "blk.0.attn_v.weight": "Q6_K",
            "blk.2.attn_v.weight": "Q8_0",
            "blk.[02].ffn_down.weight": "Q6_K",
            "blk.1.attn_q.weight": "Q5_0",
            "token_embd.weight": "Q6_K",
        },
        True,
    ),
    # every part of a stack in another type, an untied output
    "Q5_K_M": (
        "Q5_K",
        {
            "*.attn_k.weight": "Q5_1",
            "*.attn_v.weight": "Q6_K",
            "*.ffn_up.weight": "Q8_0",
            "output.weight": "Q6_K",
            "token_embd.weight": "Q4_K",
        },
        False,
    ),
    # the C-kernel types mixed with Q5_x and a float embedding
    "legacy": (
        "Q4_0",
        {
            "*.attn_k.weight": "Q8_0",
            "*.ffn_up.weight": "Q4_1",
            "blk.1.ffn_gate.weight": "Q5_1",
            "*.attn_output.weight": "Q5_0",
            "token_embd.weight": "F16",
        },
        True,
    ),
    "float": (
        "BF16",
        {"*.attn_q.weight": "F16", "*.ffn_up.weight": "F32", "token_embd.weight": "Q2_K"},
        True,
    ),
    "K": (
        "Q3_K",
        {
            "*.attn_k.weight": "Q2_K",
            "*.ffn_up.weight": "Q5_K",
            "*.ffn_down.weight": "Q4_K",
            "token_embd.weight": "Q6_K",
        },
        True,
    ),
    # the non-linear 4-bit types (IQ4_XS, its IQ4_NL fallback) with an untied output
    "IQ4_XS": (
        "IQ4_XS",
        {
            "*.attn_k.weight": "IQ4_NL",
            "blk.1.ffn_down.weight": "IQ4_NL",
            "token_embd.weight": "IQ4_NL",
        },
        False,
    ),
}
FILES = [*TYPES, *MIXES]
PREFILL_TOL = 1e-5  # x max |logit|: float rounding (the same semantics, the same attention)
# With more threads torch blocks the two engines' float32 matmuls (stacked q/k/v or separate)
# differently: one ulp can then flip a 16-bit rounding of a float type's activations in the
# prefill too (observed on the 16-core H200 host: 1.2e-4 x on F16); bounded as a decode step.
MANY_THREADS = torch.get_num_threads() > 2
DECODE_TOL = 1e-2  # x max |logit|: float rounding, plus a rare flipped activation code
C_PREFILL_TOL = 3e-2  # x max |logit|: the C int8 prefill, a flipped code's reach (see above)
F32_TOL = 0.05  # x max |logit|: bf16 prefill and Q8 activations against float32
CUDA_TOL = 1e-5

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)


def _write(path, name: str):
    if name in MIXES:
        wt, wts, tie = MIXES[name]
        return write_tiny_llama(path, weight_type=wt, weight_types=wts, tie_output=tie, **SIZES)
    return write_tiny_llama(path, weight_type=name, **SIZES)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    return {name: _write(d / f"{name}.gguf", name) for name in FILES}


def _build(path, cls=ModelWeights, device="cpu", **kw):
    with open(path, "rb") as f:
        content = Content.read(f)
        return cls.from_gguf(content, f, device, **kw)


def _script(a_model, b_model, tol: float, decode_tol: float | None = None, t: int = 20,
            steps: int = 4, seed: int = 3) -> float:  # fmt: skip
    """Prefill of ``t`` tokens (every position), then ``steps`` decode steps: the largest
    |difference| of each forward at most ``tol`` (``decode_tol`` for the decode steps) x
    ``b``'s largest prefill logit; returns the argmax agreement over the prefilled positions."""
    decode_tol = tol if decode_tol is None else decode_tol
    ids = torch.randint(0, 256, (1, t + steps), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        a = a_model.forward(ids[:, :t], 0, all_logits=True)[0]
        b = b_model.forward(ids[:, :t], 0, all_logits=True)[0]
        scale = b.abs().max()
        assert (a - b).abs().max() <= tol * scale, "prefill"
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        for pos in range(t, t + steps):
            x = ids[:, pos : pos + 1]
            a, b = a_model.forward(x, pos), b_model.forward(x, pos)
            assert (a - b).abs().max() <= decode_tol * scale, f"decode at {pos}"
    return agree


def _stacks(name: str, layer: int) -> dict[str, list[str]]:
    """The types of a layer's q/k/v and gate/up, as the file has them."""
    from synthetic import tensor_type

    wt, wts, _ = MIXES.get(name, (name, {}, True))

    def types(*names):
        return [tensor_type(f"blk.{layer}.{n}.weight", wt, wts) for n in names]

    return {"wqkv": types("attn_q", "attn_k", "attn_v"), "w13": types("ffn_gate", "ffn_up")}


def _runs(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


# -- CPU -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_fast_int8_matches_quantized_form(files, name):
    """ggml semantics on both sides, every projection C kernel or torch fallback."""
    fm = _build(files[name], fast.FastModel, prefill="int8")
    if cpu.available():
        assert fm._plan is not None  # the C decode step, with torch calls where needed
    for i, ly in enumerate(fm.layers):
        for attr, types in _stacks(name, i).items():
            assert getattr(ly, attr).types == _runs(types)  # one part per run of one type
    ref = _build(files[name], form="quantized", attention="sdpa", kv_cache="static")
    # the C int8 prefill (C RmsNorm, SwiGLU and attention between the GEMMs; where the
    # kernels are) is a decode step's float order: bounded as a decode step; the torch
    # prefill (the same ops as the reference) to float rounding
    c_prefill = fm._c_int8_prefill
    if c_prefill:  # the decode steps attend over the C prefill's cache: its bound too
        _script(fm, ref, C_PREFILL_TOL, C_PREFILL_TOL)
    else:
        _script(fm, ref, DECODE_TOL if MANY_THREADS else PREFILL_TOL, DECODE_TOL)
    if c_prefill:
        fm = _build(files[name], fast.FastModel, prefill="int8")
        fm._c_int8_prefill = False
        ref = _build(files[name], form="quantized", attention="sdpa", kv_cache="static")
        _script(fm, ref, DECODE_TOL if MANY_THREADS else PREFILL_TOL, DECODE_TOL)


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("name", FILES)
def test_fast_default_close_to_f32_form(files, name, amx):
    """The engine as ``engine.load(engine="fast")`` builds it (the prefill of
    ``default_prefill()``: bf16 with AMX layers (or oneDNN where the AMX layer kernels do not
    run) on a CPU with AMX, else int8), against float32."""
    if not amx and not cpu.amx_available():
        pytest.skip("no AMX here: the default (amx=True) is the oneDNN path already")
    if amx:
        fm, _ = engine.load(files[name], "cpu", engine="fast")
    else:
        fm = _build(files[name], fast.FastModel, amx=False)
    assert fm.prefill == fast.default_prefill()
    if cpu.available() and fm.prefill == "bf16":
        assert fm._fused_prefill and fm.amx_layers == (amx and cpu.amx_available())
    agree = _script(fm, _build(files[name], form="f32"), F32_TOL)
    assert agree >= 0.9


@needs_kernels
def test_uniform_kernel_types_keep_one_fused_weight(files):
    """Q4_0 / Q4_1 / Q8_0 stacks stay one packed weight and one kernel call (today's path)."""
    for name in ("Q4_0", "Q4_1", "Q8_0"):
        fm = _build(files[name], fast.FastModel)
        for ly in fm.layers:
            for lin in (ly.wqkv, ly.wo, ly.w13, ly.w2):
                assert len(lin.parts) == 1 and lin.packed is not None
                assert lin.packed.type_name == name
        assert fm.output.packed is not None


@needs_kernels
def test_mixed_stack_parts(files):
    """Q4_K_M's layer 0: q, k Q4_K, v Q6_K (two ``kquants.c`` calls on the GGUF blocks);
    layer 1: q Q5_0 (planes: the C kernel), k, v Q4_K; rows of the parts
    follow each other."""
    fm = _build(files["Q4_K_M"], fast.FastModel)
    wqkv0, wqkv1 = fm.layers[0].wqkv, fm.layers[1].wqkv
    assert wqkv0.packed is None and wqkv0.prepared is None  # a mixed stack
    assert [(p.r0, p.n) for p in wqkv0.parts] == [(0, 384), (384, 128)]
    assert [p.packed.type_name for p in wqkv0.parts] == ["Q4_K", "Q6_K"]
    assert all(p.packed.blocks for p in wqkv0.parts)
    q = wqkv1.parts[0]
    assert wqkv1.types == ["Q5_0", "Q4_K"] and q.packed is not None
    assert q.packed.type_name == "Q5_0" and not q.packed.blocks and q.n == 256
    legacy = _build(files["legacy"], fast.FastModel)
    assert legacy.layers[0].wqkv.types == ["Q4_0", "Q8_0", "Q4_0"]
    assert all(p.packed is not None for p in legacy.layers[0].wqkv.parts)  # three C calls


def test_mixed_files_without_kernels(files, monkeypatch):
    """No C kernels (no compiler, no AVX-512): the torch decode path takes every mix."""
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setattr(cpu.build, "_reason", "disabled by the test")
    for name in ("Q4_K_M", "legacy"):
        fm = _build(files[name], fast.FastModel, prefill="int8")
        assert fm._plan is None
        assert all(p.packed is None for ly in fm.layers for p in ly.wqkv.parts)
        ref = _build(files[name], form="quantized", attention="sdpa", kv_cache="static")
        _script(fm, ref, PREFILL_TOL, DECODE_TOL, t=8, steps=2)  # torch ops, SDPA prefill


def _as_q8_0(w: QTensor) -> QTensor:
    """The Q8_0 weight of a Q5_0 weight's values: each block's ``d`` and int8 codes ``q - 16``
    (ggml's Q5_0 x Q8_0 dot is Q8_0 x Q8_0's formula on them)."""
    from qlib.quants.legacy import Q5_0

    b = w.data.reshape(-1, 22)
    q, _, _ = Q5_0.unpack(b)  # int8 codes - 16, element order
    out = torch.cat([b[:, :2], q.view(torch.uint8)], dim=1)
    return QTensor(out.reshape(-1), w.shape, "Q8_0")


@needs_kernels
@pytest.mark.parametrize("m", [1, 5])
def test_q5_0_planes_as_the_q8_0_kernel(m, monkeypatch):
    """Q5_0 as planes (its low 4 bits as Q4_0's nibbles, its qh words; the GEMV and the tiled
    GEMM from 4 rows): the sums of the Q8_0 kernel on the same values bit for bit (the lanes
    start at -16 x their activation codes' sum as the Q8_0 planes' start at -128 x it; until
    2026-12-04 Q5_0 was widened into those planes), ggml's sums (the torch fallback) to float
    rounding; the bf16 copy, the rows looked up and the torch repack as the C one."""
    g = torch.Generator().manual_seed(7)
    w = QTensor.quantize(torch.randn(40, 192, generator=g), "Q5_0")
    assert cpu.supports("Q5_0", 192) and not cpu.supports("Q5_0", 160)
    pw = cpu.pack(w)
    assert pw.type_name == "Q5_0" and not pw.blocks
    assert pw.codes.shape == (40, 96) and pw.m.shape == (40, 12)
    w8 = _as_q8_0(w)
    assert torch.equal(w8.dequantize(), w.dequantize())
    x = torch.randn(m, 192, generator=g) * 3
    assert torch.equal(cpu.qgemm(x, pw), cpu.qgemm(x, cpu.pack(w8)))
    ref = qmatmul_prepared(x, prepare(w))
    torch.testing.assert_close(cpu.qgemm(x, pw), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())
    assert torch.equal(cpu.dequantize_bf16(pw), w.dequantize().to(torch.bfloat16))
    ids = torch.tensor([0, 39, 7, 7])
    assert torch.equal(cpu.dequantize_rows(pw, ids), w.dequantize()[ids])
    monkeypatch.setattr(cpu.build, "_lib", None)
    monkeypatch.setattr(cpu.build, "_reason", "disabled by the test")
    pt = cpu.pack(w)
    assert all(torch.equal(a, b) for a, b in ((pt.codes, pw.codes), (pt.d, pw.d), (pt.m, pw.m)))


# -- CUDA: the grouping, checked on CPU ----------------------------------------------------


def test_cuda_stack_runs():
    assert fast_cuda.stack_runs(["Q4_K", "Q4_K", "Q6_K"]) == [("Q4_K", 0, 2), ("Q6_K", 2, 3)]
    assert fast_cuda.stack_runs(["Q4_0", "Q8_0", "Q4_0"]) == [
        ("Q4_0", 0, 1), ("Q8_0", 1, 2), ("Q4_0", 2, 3),
    ]  # fmt: skip
    assert fast_cuda.stack_runs(["F16"]) == [("F16", 0, 1)]


@pytest.mark.parametrize("prefill", ["f32", "packed"])
@pytest.mark.parametrize("name", FILES)
def test_cuda_parts_built_on_cpu(files, name, prefill):
    """Every file builds (no type refused): one part per run of one type, Triton planes for the
    ``NATIVE`` types, float32 ``DenseWeight`` values (rows of the prefill copy when there is
    one) for the others, equal to the dequantized weights."""
    fm = _build(files[name], fast_cuda.CudaFastModel, prefill=prefill)
    ref = _build(files[name], form="f32")
    for i, (ly, rl) in enumerate(zip(fm.layers, ref.layers, strict=True)):
        stacks = _stacks(name, i)
        for attr, types in stacks.items():
            lin = getattr(ly, attr)
            want = [t if t in layout.NATIVE else KERNEL_TYPE.get(t, t) for t in types]
            assert lin.types == _runs(want)  # (forms.kernel_form(keep=NATIVE))
            for p in lin.parts:
                native = p.type_name in layout.NATIVE
                assert isinstance(p, layout.Prepared if native else fast_cuda.DenseWeight)
        want = torch.cat([rl.attention_wq.weight, rl.attention_wk.weight, rl.attention_wv.weight])
        got = torch.cat([
            p.w if isinstance(p, fast_cuda.DenseWeight) else layout.dequantize_prepared(p)
            for p in ly.wqkv.parts
        ])  # fmt: skip
        assert torch.equal(got, want)
        if prefill == "f32":
            assert torch.equal(ly.wqkv.dense, want)
            for p in ly.wqkv.parts:
                if isinstance(p, fast_cuda.DenseWeight):  # a view of the prefill copy
                    assert p.w.untyped_storage().data_ptr() == ly.wqkv.dense.data_ptr()
    assert fm.nbytes() > 0
    tok = fm.tok_embd
    assert isinstance(tok, layout.Prepared) == (tok.type_name in layout.NATIVE)


# -- CUDA: the logits (needs CUDA and Triton) ----------------------------------------------

CUDA = torch.cuda.is_available() and gpu.triton_available()
INTERPRET = os.environ.get("QLIB_TRITON_INTERPRET") == "1" and gpu.triton_available()
needs_cuda = pytest.mark.skipif(
    not (CUDA or INTERPRET), reason="needs CUDA and Triton (or QLIB_TRITON_INTERPRET=1)"
)


@needs_cuda
@pytest.mark.parametrize("name", FILES)
def test_cuda_matches_f32_form(files, name):
    device = "cuda" if CUDA else "cpu"
    fm = _build(files[name], fast_cuda.CudaFastModel, device)
    ref = _build(files[name], device=device, form="f32")
    _script(fm, ref, CUDA_TOL, t=9, steps=4)
    # the CUDA graph of the decode step (captured on the second step) replays the same kernels
    fm2 = _build(files[name], fast_cuda.CudaFastModel, device, graphs=False)
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    with torch.inference_mode():
        a, b = fm.forward(ids, 0), fm2.forward(ids, 0)
        for pos in range(5, 9):
            tok = torch.tensor([[int(b[0].argmax())]])
            a, b = fm.forward(tok, pos), fm2.forward(tok, pos)
            assert torch.equal(a, b)
