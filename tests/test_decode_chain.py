"""The fast CPU decode step in one C call (``cpu.DecodeChain``, ``qlib/quants/cpu/decode.c``).

``FastModel.decode_mode``: "python" runs the prepared calls of the step one ctypes call each;
"c" runs the same calls from one C call; "region" runs each kernel's in-region twin inside ONE
OpenMP parallel region. All three compute every output element with the same code in the same
order, so the logits and the KV cache must be equal bit for bit (``torch.equal``), on tied and
untied files, on mixes of C types (several C parts in one stack), with a float16 cache, and
past the positions from which the attention splits into pieces over the threads. A step with
a torch part (a type without a kernel) falls back to the Python loop; without the C kernels
(``QLIB_NO_CKERNELS=1``) the torch decode runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.gguf import Content
from qlib.llama import fast_cpu as fast
from qlib.quants import cpu
from qlib.quants.cpu import ops
from qlib.quants.qtensor import QTensor

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)
SIZES = dict(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_kv_head=2)
# name -> (write_tiny_llama options, whether the layers chain, whether the logits join them[,
# types whose kernel is taken away])
FILES = {
    "Q4_1 tied": (dict(weight_type="Q4_1"), True, True),
    "Q8_0 untied": (dict(weight_type="Q8_0", tie_output=False), True, True),
    # K-quants with Q6_K / Q8_0 / Q5_0 parts in the stacks (several C calls into one buffer)
    "Q4_K_M mix": (dict(weight_type="Q4_K", weight_types={
        "blk.0.attn_v.weight": "Q6_K", "blk.2.attn_v.weight": "Q8_0",
        "blk.[02].ffn_down.weight": "Q6_K", "blk.1.attn_q.weight": "Q5_0",
        "token_embd.weight": "Q6_K"}), True, True),
    # C types mixed, a Q5_1 part, an F16 tied output (floats.c's rows, in the chain too)
    "legacy mix": (dict(weight_type="Q4_0", weight_types={
        "*.attn_k.weight": "Q8_0", "*.ffn_up.weight": "Q4_1", "blk.1.ffn_gate.weight": "Q5_1",
        "*.attn_output.weight": "Q5_0", "token_embd.weight": "F16"}), True, True),
    # a float part in the stacks (floats.c) and a BF16 tied output
    "float mix": (dict(weight_type="Q8_0", weight_types={
        "*.ffn_up.weight": "F16", "*.attn_output.weight": "F32",
        "token_embd.weight": "BF16"}), True, True),
    # the same with the F16 kernel taken away (a part without a kernel): those layers are
    # torch, the step stays the Python loop; the logits too (BF16 still C) follow it
    "torch part": (dict(weight_type="Q8_0", weight_types={"*.ffn_up.weight": "F16"}), False,
                   False, ("F16",)),
}  # fmt: skip


def _build(path, **kw) -> fast.FastModel:
    with open(path, "rb") as f:
        return fast.FastModel.from_gguf(Content.read(f), f, "cpu", prefill="int8", **kw)


def _decode(model: fast.FastModel, mode: str, t: int, steps: int) -> tuple[list, torch.Tensor]:
    """Prefill ``t`` tokens, then ``steps`` greedy decode steps in ``mode``: the decode logits
    and the cache."""
    ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(5))
    model.decode_mode = mode
    with torch.inference_mode():
        logits = model.forward(ids, 0)
        out = []
        for pos in range(t, t + steps):
            logits = model.forward(logits.argmax(-1).view(1, 1), pos)
            out.append(logits.clone())
    return out, model.cache[:, :, :, : t + steps].clone()


@needs_kernels
@pytest.mark.parametrize("name", list(FILES))
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_one_call_step_is_bit_identical(tmp_path, monkeypatch, name, kv_type):
    options, chains, with_logits, *lacking = FILES[name]
    for type_name in lacking[0] if lacking else ():  # no kernel for this type here
        monkeypatch.delitem(cpu.layout.ROW_MULTIPLE, type_name)
    path = write_tiny_llama(tmp_path / "m.gguf", **SIZES, **options)
    model = _build(path, kv_type=kv_type, max_seq_len=256)
    assert model._chainable() == chains
    if name == "Q4_1 tied":  # the GEMVs over 16-row panels, the embedding's rows read from them
        assert model.output.packed.panels and all(
            getattr(ly, a).packed.panels for ly in model.layers for a in ("wqkv", "wo", "w13", "w2")
        )
    runs = {}
    # 70 positions: past 64 * n_head / 4 the attention's tasks are spread over the threads
    for mode in ("python", "c", "region"):
        runs[mode] = _decode(model, mode, 60, 12)
        assert model.decode_chained == (chains and mode != "python")
        if model.decode_chained:
            # one step per C part of each stack, one attention step per layer, the logits
            parts = sum(len(getattr(ly, a).parts) for ly in model.layers
                        for a in ("wqkv", "wo", "w13", "w2"))  # fmt: skip
            assert len(model._chains[mode]) == parts + SIZES["n_layer"] + with_logits
    ref_logits, ref_cache = runs["python"]
    for mode in ("c", "region"):
        logits, cache = runs[mode]
        assert all(torch.equal(a, b) for a, b in zip(ref_logits, logits, strict=True)), mode
        assert torch.equal(ref_cache, cache), mode


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K_M mix", "legacy mix"])
def test_next_step_prefetch_changes_nothing(tmp_path, name):
    """The one-region step's prefetch of the next GEMV's first rows (``set_decode_prefetch``:
    none, the default 8 groups, more groups than a thread's share) leaves the logits and the
    cache equal bit for bit."""
    path = write_tiny_llama(tmp_path / "m.gguf", **SIZES, **FILES[name][0])
    model = _build(path, max_seq_len=256)
    runs = []
    try:
        for groups in (0, 8, 1000):
            ops.set_decode_prefetch(groups)
            runs.append(_decode(model, "region", 20, 6))
    finally:
        ops.set_decode_prefetch(8)
    for logits, cache in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], logits, strict=True))
        assert torch.equal(runs[0][1], cache)


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K_M mix", "legacy mix"])
def test_panel_prefetch_changes_nothing(tmp_path, name):
    """The panels' GEMVs prefetching their weights ahead (``set_panel_prefetch``,
    ``set_kpanel_prefetch``: none, the vendor's default, 64 KB, past a thread's share) leave
    the logits and the cache equal bit for bit."""
    path = write_tiny_llama(tmp_path / "m.gguf", **SIZES, **FILES[name][0])
    model = _build(path, max_seq_len=256)
    runs = []
    try:
        for distance in (0, -1, 1 << 16):
            ops.set_panel_prefetch(distance)
            ops.set_kpanel_prefetch(distance)
            runs.append(_decode(model, "region", 20, 6))
    finally:
        ops.set_panel_prefetch()
        ops.set_kpanel_prefetch()
    for logits, cache in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][0], logits, strict=True))
        assert torch.equal(runs[0][1], cache)


@needs_kernels
def test_step_times_time_the_same_step(tmp_path):
    """``FastModel.decode_step_times`` (``DecodeChain.step_seconds``: the region's own clock
    after each step's barrier, for tools/cpu_decode_profile.py) runs the same step: the logits
    of a decode step at a position, then of the timed step at the same position again, are
    equal bit for bit; one time per step, each >= 0, their sum within the wall time of the
    call; each step names its call (5 a layer, then the logits'); a chain of another mode is
    refused."""
    path = write_tiny_llama(tmp_path / "m.gguf", **SIZES, **FILES["Q4_K_M mix"][0])
    model = _build(path, max_seq_len=256)
    model.decode_mode = "region"
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    model.forward(ids, 0)
    want = model.forward(ids[:, -1:], 12)[0]
    t0 = time.perf_counter()
    logits, steps = model.decode_step_times(ids[:, -1:], 12)
    wall = time.perf_counter() - t0
    assert torch.equal(logits[0], want)
    chain = model._chains["region"]
    assert len(steps) == len(chain) and all(s >= 0 for _, s in steps)
    assert 0 < sum(s for _, s in steps) <= wall
    calls = [c for c, _ in steps]
    assert sorted(set(calls)) == list(range(5 * len(model.layers) + 1)) and calls == sorted(calls)
    with pytest.raises(ValueError, match="region"):
        cpu.DecodeChain(chain.keep[0], "c").step_seconds()


@needs_kernels
@pytest.mark.parametrize("split", [0, 16])
@pytest.mark.parametrize("pos", [5, 200])
def test_chain_attention_pieces(split, pos):
    """Attention alone in a chain, with the positions cut into pieces (``split``, and the
    threads' pieces at 200 positions with one KV head) against its prepared call."""
    g = torch.Generator().manual_seed(2)
    n_head, n_kv, d, max_seq = 8, 1, 64, 256
    cos, sin = torch.rand(max_seq, d // 2, generator=g), torch.rand(max_seq, d // 2, generator=g)
    position = cpu.DecodePosition(cos, sin)
    qkv0 = torch.randn((n_head + 2 * n_kv) * d, generator=g)
    caches = torch.randn(2, n_kv, max_seq, d, generator=g)
    outs = []
    for mode in ("python", "c", "region"):
        qkv, out = qkv0.clone(), torch.empty(n_head * d)
        kc, vc = caches[0].clone(), caches[1].clone()
        call = cpu.attn_decode_plan(qkv, kc, vc, position, out, n_head=n_head, n_kv=n_kv,
                                    neox=True, split=split)  # fmt: skip
        position.at(pos)
        if mode == "python":
            assert call() == 0
        else:
            assert cpu.DecodeChain([call], mode)() is None
        outs.append((out, qkv, kc, vc))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_1"])
def test_chain_gemv_flags(type_name):
    """One GEMV per flag (RmsNorm, SwiGLU, accumulate) and the logits step: a chain of them
    equals the calls one by one."""
    g = torch.Generator().manual_seed(3)
    k, n = 512, 77  # n % 4 != 0: the last group of rows is partial
    w = cpu.pack(QTensor.quantize(torch.randn(n, k, generator=g), type_name))
    x, gu = torch.randn(1, k, generator=g), torch.randn(2 * k, generator=g)
    norm = torch.rand(k, generator=g) + 0.5
    results = []
    for mode in ("python", "c", "region"):
        y1, y2 = torch.empty(n), torch.full((n,), 0.25)
        calls = [cpu.qgemm_plan(w, x, y1, norm=norm, eps=1e-5),
                 cpu.qgemm_plan(w, gu, y2, swiglu=True, accumulate=True)]  # fmt: skip
        logits = cpu.qgemm_alloc_plan(w, x, norm=norm, eps=1e-5)
        if mode == "python":
            assert all(c() == 0 for c in calls)
            y3 = logits()
        else:
            y3 = cpu.DecodeChain(calls, mode, output=logits)()
        results.append((y1, y2, y3))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@needs_kernels
def test_decode_mode_is_checked(tmp_path):
    model = _build(write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0"))
    with pytest.raises(fast.ModelError):
        model.decode_mode = "fortran"
    with pytest.raises(ValueError):
        cpu.DecodeChain([lambda: 0], "region")  # a call without C steps


def test_torch_decode_without_kernels(tmp_path):
    """QLIB_NO_CKERNELS=1: no C plan, the torch decode, the same greedy tokens as with them
    (to float rounding: argmax over a few steps)."""
    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q8_0", **SIZES)
    script = (
        "import sys, torch\n"
        "from qlib.gguf import Content\n"
        "from qlib.llama.fast_cpu import FastModel\n"
        "f = open(sys.argv[1], 'rb')\n"
        "m = FastModel.from_gguf(Content.read(f), f, 'cpu', prefill='int8')\n"
        "assert m._plan is None and not m.decode_chained\n"
        "ids = torch.arange(10, 30).view(1, -1)\n"
        "out = [int(m.forward(ids, 0).argmax())]\n"
        "for pos in range(20, 24):\n"
        "    out.append(int(m.forward(torch.tensor([[out[-1]]]), pos).argmax()))\n"
        "print(out)\n"
    )  # fmt: skip
    env = {**os.environ, "QLIB_NO_CKERNELS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith("[")
