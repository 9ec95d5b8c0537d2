"""The persistent decode kernel (``qlib.quants.cuda.persistent``, ``decode="persistent"`` of the
fast CUDA engine) against the f32 form and the fused kernels. Needs CUDA and NVRTC: skipped
elsewhere (the module still imports); the layouts' checks run on the CPU, and the kernel's build
wherever nvcc is (no GPU needed).

Tolerance: the kernel dequantizes the same blocks exactly and accumulates in float32, in
another order than the f32 form's cuBLAS products: ``TOL`` x max |logit| per decode step, as
``tests/test_fast_cuda.py``; on SmolLM2 (30 layers) 1e-3 absolute, as the fused path.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import greedy, random_blocks, write_tiny_llama

from qlib import models
from qlib.gguf import Content, GGUFValueType, Typed
from qlib.llama.faithful import ModelWeights
from qlib.quants.api import READ_ONLY
from qlib.quants.cuda import persistent
from qlib.quants.qtensor import QTensor

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TOL = 1e-5
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


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


def steps_match_f32(path, options: dict, steps: int, seed: int) -> None:
    """Every position of ``steps`` random ids decoded one token at a time by the persistent
    kernel (``decode_options=options``) equals the f32 form's teacher-forced logits (1e-4 of
    the scale)."""
    ref, fast = load(path, decode_options=options)
    ids = torch.randint(0, 256, (1, steps), generator=torch.Generator().manual_seed(seed))
    want = ref.forward(ids, 0, all_logits=True)[0]
    for pos in range(steps):
        close(fast.forward(ids[:, pos : pos + 1], pos)[0], want[pos], tol=1e-4)


def test_unsupported_reasons():
    assert persistent.unsupported({"w": "Q4_1"}, 64, 64) is None
    assert persistent.unsupported({"w": "Q4_K", "v": "Q6_K", "o": "BF16"}, 64, 64) is None
    assert "head_dim" in persistent.unsupported({"w": "Q8_0"}, 16, 16)
    assert "rope_dim" in persistent.unsupported({"w": "Q8_0"}, 64, 32)
    why = persistent.unsupported({"w": "IQ4_NL", "v": "Q8_1", "o": "Q4_K"}, 64, 64)
    assert "no code for IQ4_NL, Q8_1 " in why
    assert persistent.unsupported({"w": "Q8_0"}, 64, 64, 256, 256) is None
    assert "as wide as the model" in persistent.unsupported({"w": "Q8_0"}, 32, 32, 128, 256)
    assert "biases" in persistent.unsupported({"w": "Q8_0"}, 64, 64, 256, 256, biases=True)


def test_auto_decode_choice():
    """``decode="auto"`` (the fast CUDA engine's default) picks the persistent kernel only where
    it was measured faster: Hopper, a float32 or float16 cache, up to 768 wide (K-quant mixes
    included); else the fused kernels, with the reason."""
    from qlib.llama.config import LlamaConfig
    from qlib.llama.fast_cuda import auto_decode

    c = LlamaConfig(head_count=4, head_count_kv=2, block_count=1, embedding_length=256,
                    rope_dim=64, rms_norm_eps=1e-5, rope_freq_base=1e4, architecture="llama",
                    rope_is_neox=False)  # fmt: skip
    legacy = {"blk.0.attn_q.weight": "Q4_1", "token_embd.weight": "Q8_0"}
    assert auto_decode(legacy, c, (9, 0))[0] == "persistent"
    assert auto_decode(legacy, c, (10, 0))[0] == "fused"  # (not measured there)
    choice, why = auto_decode(legacy, c, (8, 0))
    assert choice == "fused" and "Hopper" in why
    assert auto_decode(legacy | {"blk.0.ffn_down.weight": "Q6_K"}, c, (9, 0))[0] == "persistent"
    wide = dataclasses.replace(c, embedding_length=2048, head_count=32, head_count_kv=8)
    choice, why = auto_decode(legacy, wide, (9, 0))
    assert choice == "fused" and "2048" in why
    choice, why = auto_decode(legacy | {"output.weight": "IQ4_NL"}, c, (9, 0))
    assert choice == "fused" and "no code for IQ4_NL" in why


def decode_x8(data: torch.Tensor) -> torch.Tensor:
    """The weights of ``T_X8`` bytes ``[rows, k / 32 * 48]`` as the kernel computes them:
    a * q + b with the float32 scale and offset of each half of 32."""
    blocks = data.reshape(data.shape[0], -1, 48)
    ab = blocks[..., :16].contiguous().view(torch.float32).reshape(*blocks.shape[:2], 2, 1, 2)
    q = blocks[..., 16:].contiguous().view(torch.int8).reshape(*blocks.shape[:2], 2, 16).float()
    return (ab[..., 0] * q + ab[..., 1]).reshape(data.shape[0], -1)


@pytest.mark.skipif(not shutil.which("nvcc"), reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("types", ["Q4_1", "Q4_K_M", "Q8_0"])
def test_kernel_builds_without_spills(tmp_path, types):
    """The kernel compiles with nvcc for sm_90 (as NVRTC builds it on the GPU machine) with no
    stack frame and no spills, for a Q4_1 model with a Q8_0 output layer (the output as int8
    rows), a K-quant mix (T_X8 layers) and Q8_0 layers, its default macros and the A/B ones
    of each: a kernel edit that does not build fails here, on a machine without a GPU."""
    mix = {"*attn_v*": "Q6_K", "*ffn_down*": "Q6_K", "token_embd*": "Q8_0", "output*": "Q6_K"}
    weight_types = mix if types == "Q4_K_M" else {"token_embd.weight": "Q8_0"}
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_K" if types == "Q4_K_M" else
                            types, n_embd=256, n_head=4, n_kv_head=2, n_ff=512,
                            weight_types=weight_types)  # fmt: skip
    variants = {"Q4_1": ["default", "OUT_Q8X=0", "Q41_WIDE=0,MLP_PAIR=0", "KV_GROUP=0",
                         "ATT_SPREAD=0", "KV_HALF=1",
                         "SUM_LATE=0,EXP_VALUES=0,MERGE_DIRECT=12,MAX_REDUX=0"],
                "Q4_K_M": ["default", "X8_WIDE=0"],
                "Q8_0": ["default", "Q8_AS_X8=0,X8_WIDE=0", "X8_NO_B=0"]}[types]  # fmt: skip
    tool = Path(__file__).parents[1] / "tools" / "persistent_compile.py"
    run = subprocess.run([sys.executable, str(tool), "--model", str(path), "--variants", *variants],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok: ") == len(variants)


def test_q8_as_x8_exactly():
    """A Q8_0 matrix as ``T_X8`` blocks (``Q8_AS_X8``) gives every weight bit for bit as the
    blocks' dequantization (CPU)."""
    t = QTensor.quantize(torch.randn(5, 256, generator=torch.Generator().manual_seed(6)), "Q8_0")
    data, type_id = persistent.kernel_matrix(t, q8_as_x8=True)
    assert type_id == persistent.X8 and data.shape == (5, 256 // 32 * 48)
    assert torch.equal(decode_x8(data), t.dequantize())
    assert persistent.kernel_matrix(t)[1] == persistent.TYPE_IDS["Q8_0"]


def test_q8_output_rows_exactly():
    """The Q8_0 output layer re-laid for ``OUT_Q8X`` (int8 codes, float32 scales) gives every
    weight bit for bit as the blocks' dequantization, and the kernel's ``code_float`` (the
    float with the bits ``0x4B000000 | (c ^ 0x80)``, minus 2^23 + 128) is each code exactly."""
    gen = torch.Generator().manual_seed(5)
    t = QTensor.quantize(torch.randn(7, 576, generator=gen), "Q8_0")
    codes, scales = persistent.q8_rows(t.data.reshape(7, -1), 576)
    assert codes.shape == (7, 576) and scales.shape == (7, 18)
    c = codes.contiguous().view(torch.int8)
    assert torch.equal(c.float() * scales.repeat_interleave(32, dim=1), t.dequantize())
    bits = (codes.numpy().astype(np.uint32) ^ 0x80) | np.uint32(0x4B000000)
    assert np.array_equal(bits.view(np.float32) - np.float32(8388736.0), c.numpy())


@pytest.mark.parametrize("type_name", persistent.EXPANDED)
def test_kquants_expand_exactly(type_name):
    """The K-quant blocks expanded for the kernel give every weight bit for bit as ggml's
    dequantization (``QTensor.dequantize``), on the CPU: no GPU needed."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 512, generator=gen) * 0.1
    if type_name in READ_ONLY:  # (types qlib does not write: random blocks)
        t = random_blocks(w.numpy(), type_name)
    else:
        t = QTensor.quantize(w, type_name)
    data, type_id = persistent.kernel_matrix(t)
    assert type_id == persistent.X8 and data.shape == (6, 512 // 32 * 48)
    assert torch.equal(decode_x8(data), t.dequantize())


def test_macros_from_the_environment():
    """``$QLIB_PERSISTENT_MACROS`` items become macros; one that is not NAME=integer is
    refused with its text in the message (on any machine)."""
    assert persistent.env_macros("") == {}
    assert persistent.env_macros("MLP_PAIR=0, NORM_FAST = 1,") == {"MLP_PAIR": 0, "NORM_FAST": 1}
    for bad in ("MLP_PAIR", "MLP_PAIR=on", "1X=2", "=3"):
        with pytest.raises(persistent.PersistentError, match="is not NAME=integer"):
            persistent.env_macros(bad)


def test_compiled_kernels_are_cached(tmp_path, monkeypatch):
    """``cached_cubin`` compiles once per source, macros, options, architecture and NVRTC
    version and reads the cache after that; an unwritable cache only means compiling again
    (NVRTC replaced by a counting stand-in: any machine)."""
    builds = []

    def fake_compile(macros, arch):
        builds.append((dict(macros), arch))
        return f"cubin {sorted(macros.items())} {arch}".encode()

    monkeypatch.setattr(persistent, "compile_cubin", fake_compile)
    monkeypatch.setattr(persistent, "_nvrtc_version", lambda: "13.0")
    monkeypatch.setenv("QLIB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("QLIB_NVRTC_OPTIONS", raising=False)
    first = persistent.cached_cubin({"DIM": 576}, "sm_90")
    assert persistent.cached_cubin({"DIM": 576}, "sm_90") == first and len(builds) == 1
    assert len(list((tmp_path / "persistent").glob("*.cubin"))) == 1
    persistent.cached_cubin({"DIM": 512}, "sm_90")
    persistent.cached_cubin({"DIM": 576}, "sm_100")
    monkeypatch.setenv("QLIB_NVRTC_OPTIONS", "-lineinfo")
    persistent.cached_cubin({"DIM": 576}, "sm_90")
    monkeypatch.setattr(persistent, "_nvrtc_version", lambda: "13.1")
    persistent.cached_cubin({"DIM": 576}, "sm_90")
    assert len(builds) == 5
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory should be
    monkeypatch.setenv("QLIB_CACHE_DIR", str(blocked))
    assert persistent.cached_cubin({"DIM": 576}, "sm_90") == first and len(builds) == 6


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
def test_default_decode_is_the_auto_choice(tmp_path):
    """With no ``decode`` given the engine runs what ``auto_decode`` picks for this device and
    says why: on Hopper the persistent kernel for a Q4_1 file (its logits the same bits as
    ``decode="persistent"``'s), and the same choice with a float16 KV cache."""
    from qlib.llama.fast_cuda import CudaFastModel

    hopper = torch.cuda.get_device_capability()[0] == 9
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=256)  # fmt: skip
    ref, explicit = load(path)
    with open(path, "rb") as f:
        default = CudaFastModel.from_gguf(Content.read(f), f, "cuda")
    assert default.decode == ("persistent" if hopper else "fused"), default.decode_note
    ids = torch.tensor([[1, 5, 9, 33]])
    ref.forward(ids, 0), default.forward(ids, 0), explicit.forward(ids, 0)
    for pos, token in enumerate((3, 44, 200), start=4):
        x = torch.tensor([[token]])
        got = default.forward(x, pos)
        close(got, ref.forward(x, pos))
        if hopper:
            assert torch.equal(got, explicit.forward(x, pos))
    with open(path, "rb") as f:
        half = CudaFastModel.from_gguf(Content.read(f), f, "cuda", kv_type="f16")
    assert half.decode == default.decode, half.decode_note


@needs_cuda
@pytest.mark.parametrize("decode", ["persistent", "fused"])
def test_greedy_steps_launched_ahead(tmp_path, decode):
    """``greedy_step`` with the next step queued before this one's id is read (``launch_ahead``,
    the default with CUDA graphs; the persistent kernel writes the id to the host, the fused
    path's graphs copy it): the ids of 40 steps equal the step-by-step loop's and those of
    ``forward`` + argmax; a chain broken by another token at the next position, by ``forward``
    or by a new sequence from position 0 gives what the same calls give without launch-ahead
    (the step queued ahead ran unused; its KV row is rewritten)."""
    from qlib.llama.fast_cuda import CudaFastModel

    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=256, tie_output=False)  # fmt: skip
    with open(path, "rb") as f:
        fast = CudaFastModel.from_gguf(Content.read(f), f, "cuda", decode=decode)
    prompt = torch.tensor([[1, 5, 9, 33, 7]])

    def run(ahead: bool) -> list:
        fast.launch_ahead = ahead
        fast.clear_kv_cache()
        token = int(fast.forward(prompt, 0)[0].argmax())
        out, pos = [], 5
        for _ in range(40):
            token = fast.greedy_step(token, pos)
            out.append(token)
            pos += 1
        out.append(fast.greedy_step(7, pos))  # another token than the one fed back
        out.append(fast.greedy_step(out[-1], pos + 1))
        out.append(fast.forward(torch.tensor([[9]]), pos + 2).clone())  # forward after a chain
        out.append(fast.greedy_step(3, pos + 3))
        out.append(fast.greedy_step(11, 0))  # a new sequence from position 0
        out.append(fast.greedy_step(out[-1], 1))
        return out

    ahead, step_by_step = run(True), run(False)
    logits_a, logits_s = ahead.pop(42), step_by_step.pop(42)
    assert ahead == step_by_step
    torch.testing.assert_close(logits_a, logits_s, rtol=0, atol=0)
    fast.launch_ahead = False
    assert ahead[:40] == greedy(fast, prompt[0].tolist(), 41)[1:]


@needs_cuda
@pytest.mark.parametrize("xres", [0, 1])
def test_residual_sums_float_atomics_or_counted_words(tmp_path, xres):
    """The residual sums as float atomics (``XRES=0``, kept for models whose sums have 1024
    or more addends) and as counted fixed-point words (``XRES=1``, the default): both decode as
    the f32 form; the words' integer sums make a step's logits the same bit for bit when the
    same steps run again (float atomics land in any order)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=512)  # fmt: skip
    ref, fast = load(path, decode_options={"macros": {"XRES": xres}})
    assert fast._persistent.macros["XRES"] == xres
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    runs = []
    for _ in range(2):
        fast.forward(ids, 0)
        steps = enumerate((3, 44, 200))
        runs.append([fast.forward(torch.tensor([[t]]), 5 + i).clone() for i, t in steps])
    ref.forward(ids, 0)
    for step, token in enumerate((3, 44, 200)):
        close(runs[1][step], ref.forward(torch.tensor([[token]]), 5 + step))
    if xres:
        assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@needs_cuda
def test_copies_of_the_mlp_sums_give_the_same_bits(tmp_path):
    """``DOWN_COPIES=2`` (the default) or 4: the MLP tasks add into several copies of the next
    residual's counted words (fewer atomics on each address), which the readers add as
    integers, so a step's logits are the same bit for bit as with one copy."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=512)  # fmt: skip
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    runs = []
    for copies in (1, 2, 4):
        _, fast = load(path, decode_options={"macros": {"DOWN_COPIES": copies}})
        assert fast._persistent.macros["DOWN_COPIES"] == copies
        fast.forward(ids, 0)
        runs.append(
            [fast.forward(torch.tensor([[t]]), 5 + i).clone() for i, t in enumerate((3, 44))]
        )
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


@needs_cuda
def test_latency_macros_give_the_same_bits(tmp_path):
    """``LATE_EARLY``, ``MERGE_DIRECT``, ``SUM_LATE`` and ``MAX_REDUX`` shorten the critical
    path (the norm's factor read before the dots, the splits' merge without a pass through
    shared memory, the softmax's sum reduced behind the values, a warp's max in one
    ``redux.sync``) and change no result: the logits are the same bit for bit either way, with
    several splits a head (``split=16``). ``SUM_LATE`` is compared without ``EXP_VALUES``
    (which needs it and changes the order of the sum's adds)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=128, n_head=4,
                            n_kv_head=2, n_ff=512)  # fmt: skip
    prompt = torch.tensor([list(range(1, 41))])
    groups = [
        [{}, {"LATE_EARLY": 0, "MERGE_DIRECT": 0}, {"MAX_REDUX": 0}],
        [{"EXP_VALUES": 0}, {"EXP_VALUES": 0, "SUM_LATE": 0}],
    ]
    for group in groups:
        runs = []
        for macros in group:
            _, fast = load(path, decode_options={"macros": macros, "split": 16})
            fast.forward(prompt, 0)
            steps = enumerate((3, 44, 9))
            runs.append([fast.forward(torch.tensor([[t]]), 40 + i).clone() for i, t in steps])
        for macros, run in zip(group[1:], runs[1:], strict=True):
            same = all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))
            assert same, (group[0], macros)


@needs_cuda
@pytest.mark.parametrize(
    "macros",
    [
        {"WHERE_SHARED": 0},
        {"FLAT_DOTS": 0},
        {"ROWB_CONST": 0},
        {"DOWN_COPIES": 1},
        {"FLAT_SHFL": 0},
        {"OUT_LANES": 0},
        {"DOWN_COPIES": 4},
        {"NORM_FAST": 0},
        {"MLP_PAIR": 0},
        {"MLP_PAIR": 1, "DOWN_COPIES": 1},
        {"GU_JOINT": 0},
        {"NORM_LATE": 0},
        {"OUT_Q8X": 0},
        {"Q41_WIDE": 0},
        {"KV_GROUP": 0},
        {"GROUP_FROM": 0},
        {"STAGE0_SPLIT": 0},
        {"RES_LEAD": 0},
        {"RES_LEAD": 8},
        {"WO_G": 1},
        {"WO_G": 4},
        {"OUT_STAGE": 0},
        {"LATE_EARLY": 0},
        {"MERGE_DIRECT": 0},
        {"MERGE_DIRECT": 8},
        {"EXP_VALUES": 0},
        {"SUM_LATE": 0, "EXP_VALUES": 0},
        {"MAX_REDUX": 0},
    ],
    ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()),
)
@pytest.mark.parametrize("shape", [(4, 2, 128, None), (2, 2, 128, 16)])
def test_ab_variants_decode_as_the_default(tmp_path, shape, macros):
    """The A/B macros that ``tools/persistent_probe.py`` compares against the default (the
    staged pieces' addresses in a local array; a warp a row instead of ``flat_dots``; types
    and row sizes read at run time; the MLP's sums in one copy; ``flat_dots``' partial sums
    through shared memory only; a warp an output row; the MLP's sums in four copies; the
    norm's factor in IEEE division and square root; the MLP tasks one a block, not in
    clusters of two; gate and up rows dotted apart; the normalized input made before the
    dots; the Q8_0 output layer read as its blocks, not as int8 rows and scales; Q4_1 parts
    by 16-bit loads; Q4_1 codes made floats by their bits; each query head's attention
    reading its KV head's rows itself; a KV head's query heads scored together from position
    0 on, not from ``GROUP_FROM``; layer 0's staging in one piece; the residual's words read
    once the last word is complete, or polled by every thread from the start; one or four
    threads a ``wo`` row, not two; no output rows staged into shared memory; the norm's factor
    read after the dots; the splits' partials merged through shared memory, or directly up to
    eight splits; the softmax's weights in a pass of their own, its sum reduced behind the
    values or before them; a warp's max by five shuffles)
    stay correct:
    decode steps from position 0 as the f32 form, GQA 2:1 and MHA with ``split=16`` (several
    blocks a head past 16 positions); a Q8_0 output layer, as SmolLM2's."""
    n_head, n_kv, n_embd, split = shape
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=n_embd,
                            n_head=n_head, n_kv_head=n_kv, n_ff=256,
                            weight_types={"token_embd.weight": "Q8_0"})  # fmt: skip
    steps_match_f32(path, {"macros": macros, **({"split": split} if split else {})}, 40, seed=1)


@needs_cuda
@pytest.mark.parametrize("heads", [(2, 2, 1024), (6, 2, 1024), (6, 2, 0), (6, 2, 40)])
@pytest.mark.parametrize("split", [persistent.SPLIT, 16])
def test_decode_from_position_zero_and_long_attention(tmp_path, split, heads):
    """Every position decoded one token at a time (no prefill); tied output, head_dim 64; MHA,
    and GQA 3:1, whose attention tasks score a KV head's three query heads together from
    ``GROUP_FROM`` positions on (0: from the first; 40: switching at the 40th step; 1024:
    never here). ``split=16``: past 16 positions the attention of a head (or of a KV head's
    group) runs in several blocks whose partial softmaxes are merged, some of them empty at
    first (grouped: 3 x the splits over the same positions)."""
    n_head, n_kv, group_from = heads
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0", n_embd=64 * n_head,
                            n_head=n_head, n_kv_head=n_kv, n_ff=256)  # fmt: skip
    steps_match_f32(path, {"split": split, "macros": {"GROUP_FROM": group_from}}, 100, seed=0)


@needs_cuda
@pytest.mark.parametrize("spread", [6, 8, 0])
def test_longer_splits_on_blocks_without_mlp_tasks(tmp_path, spread):
    """``ATT_SPREAD``: once the attention splits run on MLP blocks too (here from ~305
    positions: ``split=16``, 6 query heads, 16 MLP blocks), the KV heads' groups are dealt the
    blocks in turn and the blocks without an MLP task take ``spread / 4`` times longer splits
    (0: equal splits); every position decoded one token at a time against the f32 form."""
    context = {"llama.context_length": Typed(GGUFValueType.UINT32, 512)}
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0", n_embd=384, n_head=6,
                            n_kv_head=2, n_ff=256, extra_metadata=context)  # fmt: skip
    steps_match_f32(path, {"split": 16, "macros": {"GROUP_FROM": 0, "ATT_SPREAD": spread}}, 340,
                    seed=3)  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("group_from", [1024, 0])
def test_half_cache_decodes_as_the_fused_kernels(tmp_path, group_from):
    """A float16 KV cache (``KV_HALF``: keys and values rounded to half when written, the new
    position's too, as torch's float16 cache holds them): decode steps from position 0 with
    ``split=16`` (several splits a head), GQA 3:1 with the KV head's query heads scored
    together from the first position (``GROUP_FROM=0``) or not, against the fused kernels on
    the same half cache."""
    from qlib.llama.fast_cuda import CudaFastModel

    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_1", n_embd=384, n_head=6,
                            n_kv_head=2, n_ff=256,
                            weight_types={"token_embd.weight": "Q8_0"})  # fmt: skip
    options = {"split": 16, "macros": {"GROUP_FROM": group_from}}
    with open(path, "rb") as f:
        content = Content.read(f)
        fused = CudaFastModel.from_gguf(content, f, "cuda", decode="fused", kv_type="f16")
        fast = CudaFastModel.from_gguf(content, f, "cuda", decode="persistent", kv_type="f16",
                                       decode_options=options)  # fmt: skip
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(2))
    for pos in range(ids.shape[1]):
        x = ids[:, pos : pos + 1]
        close(fast.forward(x, pos)[0], fused.forward(x, pos)[0])


@needs_cuda
@pytest.mark.parametrize("macros", [{}, {"X8_WIDE": 0}, {"X8_NO_B": 0}])
@pytest.mark.parametrize("type_name", [*persistent.EXPANDED, "IQ4_NL", "Q4_K_M", "Q8_0"])
def test_kquants_and_mixes_decode_as_f32_form(tmp_path, type_name, macros):
    """K-quant files (expanded for the kernel), a Q4_K_M-like mix (Q6_K on v and down, Q8_0
    embedding, Q4_K elsewhere) and Q8_0 layers, their ``T_X8`` blocks read by whole words
    (``X8_WIDE``, the default: Q8_0 layers as ``T_X8`` too, ``Q8_AS_X8``) or 16 bits at a
    time (``X8_WIDE=0``: Q8_0 blocks as in the file), the offsets' term kept where every
    ``T_X8`` block came from Q8_0 (``X8_NO_B=0``; the default there drops it): decode steps as
    the f32 form, untied output, head_dim 64."""
    mix = {"*attn_v*": "Q6_K", "*ffn_down*": "Q6_K", "token_embd*": "Q8_0", "output*": "Q6_K"}
    types = mix if type_name == "Q4_K_M" else None
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_K" if types else type_name,
                            weight_types=types, n_embd=256, n_head=4, n_kv_head=2, n_ff=512,
                            tie_output=False)  # fmt: skip
    ref, fast = load(path, decode_options={"macros": macros})
    from_q8 = type_name in ("Q8_0", "IQ4_NL") and not macros  # (the T_X8 blocks all Q8_0's)
    assert fast._persistent.macros["X8_NO_B"] == int(from_q8)
    ids = torch.tensor([[1, 5, 9, 33, 7]])
    close(fast.forward(ids, 0), ref.forward(ids, 0))
    for step, token in enumerate((3, 44, 200)):
        x = torch.tensor([[token]])
        close(fast.forward(x, 5 + step), ref.forward(x, 5 + step))


@pytest.fixture(scope="module", params=[models.DEFAULT_MODEL, "Q4_K_M"])
def smollm2(request):
    """The embedded SmolLM2 (Q4_1) and its Q4_K_M variant (Q4_K / Q6_K on the down
    projections, Q5_0 where rows of 576 do not divide 256), where derived."""
    try:
        return models.path(request.param)
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
