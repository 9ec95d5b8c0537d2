"""Mixtral-style llama files (``llama.expert_count`` > 1): the faithful engine runs them as
candle's quantized_llama (``faithful.MoE``, ``llama.moe``), from llama.cpp's stacked
``ffn_*_exps`` tensors or the older one tensor an expert, and so do the fast CPU engine (its
C matmuls, the routing in torch) and the fast CUDA engine (its fused kernels, no graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import write_tiny_moe

from qlib.gguf import Content, GGUFValueType, Typed, write_path
from qlib.llama.engine import load
from qlib.llama.errors import ModelError, ModelFileError
from qlib.llama.faithful import MoE
from qlib.llama.moe import combine, route
from qlib.quants import cpu

needs_c = pytest.mark.skipif(not cpu.available(), reason=f"C: {cpu.unavailable_reason()}")

FOR_LLAMA_CPP = {"tokenizer.ggml.model": "none",
                 "llama.vocab_size": Typed(GGUFValueType.UINT32, 256)}  # fmt: skip
PROMPT = [[1, 5, 9, 200, 3, 77, 12]]


class _Const:
    """An 'expert' whose output is its index + 1 times the input's first feature."""

    def __init__(self, value: float):
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full_like(x, self.value) * x[:, :1]


class _Router:
    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_routing_takes_the_largest_and_normalizes_them():
    """Two tokens, four experts, two used: the chosen experts' softmax weights over their
    sum, the lower index first on a tie; every other expert left out (worked by hand)."""
    logits = torch.tensor([[2.0, 0.0, 1.0, 2.0], [0.0, 3.0, 3.0, 3.0]])
    moe = MoE(_Router(logits), [_Const(float(i + 1)) for i in range(4)], n_expert_used=2)
    x = torch.ones(1, 2, 3)
    y = moe.forward(x)[0, :, 0]
    p = torch.softmax(logits, -1)
    want0 = (p[0, 0] * 1 + p[0, 3] * 4) / (p[0, 0] + p[0, 3])  # experts 0 and 3 (tied at 2)
    want1 = (p[1, 1] * 2 + p[1, 2] * 3) / (p[1, 1] + p[1, 2])  # experts 1 and 2 (of three tied)
    assert torch.allclose(y, torch.stack([want0, want1]), rtol=1e-6)


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_stacked_and_one_tensor_an_expert_give_the_same_logits(tmp_path, weight_type):
    logits = []
    for stacked in (True, False):
        path, _ = write_tiny_moe(tmp_path / f"{stacked}.gguf", stacked=stacked,
                                 weight_type=weight_type)  # fmt: skip
        model, _ = load(path)
        logits.append(model.forward(torch.tensor(PROMPT), 0))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.peers
@pytest.mark.parametrize(("weight_type", "how"), [("F32", dict(form="f32")),
                                                  ("Q8_0", dict(form="quantized")),
                                                  ("Q8_0", dict(engine="fast"))])  # fmt: skip
def test_logits_match_llama_cpp(tmp_path, weight_type, how):
    """Against llama.cpp on the same file (stacked experts): each token alone at position 0
    (measured <= 1.2e-6 of logits up to 3.7) and a whole prompt's last logits, then one
    decode step (attention over the prompt too); 1e-4 of the logits' scale."""
    pytest.importorskip("llama_cpp")
    import test_position0 as pos0

    path, _ = write_tiny_moe(tmp_path / "moe.gguf", weight_type=weight_type,
                             extra_metadata=FOR_LLAMA_CPP)  # fmt: skip
    tokens = range(0, 256, 8)
    llm = pos0.llama_cpp_model(path)
    try:
        ref = pos0.llama_cpp_pos0(llm, tokens)
        llm.reset()
        llm.eval(PROMPT[0] + [44])
        ref_prompt = np.array(llm.scores[len(PROMPT[0]) - 1])
        ref_step = np.array(llm.scores[len(PROMPT[0])])
    finally:
        llm.close()
    model, _ = load(path, **how)
    scale = np.abs(ref).max()
    assert np.abs(pos0.qlib_pos0(model, tokens) - ref).max() <= 1e-4 * scale
    with torch.inference_mode():
        got = model.forward(torch.tensor(PROMPT), 0)[0].numpy()
        step = model.forward(torch.tensor([[44]]), len(PROMPT[0]))[0].numpy()
    assert np.abs(got - ref_prompt).max() <= 1e-4 * scale
    assert np.abs(step - ref_step).max() <= 1e-4 * scale


@pytest.mark.parametrize("stacked", [True, False])
def test_the_fast_cpu_engine_runs_them_as_the_quantized_form(tmp_path, stacked):
    """The fast CPU engine (each expert's gate | up and down as C weights, ggml's semantics)
    against the faithful quantized form: a prompt and a decode step within 1e-6 of the
    logits' scale (measured 7e-8 to 2e-7: float32 order), and its greedy step."""
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", weight_type="Q8_0", stacked=stacked)
    ref, _ = load(path, form="quantized")
    fast, _ = load(path, engine="fast")
    assert fast.moe
    for ids, pos in ((torch.tensor(PROMPT), 0), (torch.tensor([[44]]), len(PROMPT[0]))):
        want, got = ref.forward(ids, pos), fast.forward(ids, pos)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    step = ref.forward(torch.tensor([[3]]), len(PROMPT[0]) + 1)
    assert fast.greedy_step(3, len(PROMPT[0]) + 1) == int(step.argmax())


@needs_c
@pytest.mark.parametrize(("logits", "n_used"), [
    ([2.0, 0.0, 1.0, 2.0], 2),  # a tie: the lower index first
    ([0.0, 3.0, 3.0, 3.0], 2),  # three tied, two taken
    ([0.5, -1.0, 4.0, 0.25, 4.0, -3.0, 1.0, 2.0], 2),
    ([0.5, -1.0, 4.0, 0.25, 4.0, -3.0, 1.0, 2.0], 3),
    ([1.0, 2.0, 3.0], 1),
    ([1.0, 2.0, 3.0], 3),
])  # fmt: skip
def test_the_c_routing_is_moe_route_and_combine(logits, n_used):
    """decode.c's MoE step (experts without GEMVs: constant outputs) chooses the experts of
    ``moe.route`` with its weights (to 2 ulp: its own softmax) and adds them to h as
    ``moe.combine`` does (to 1e-6 relative: the same order, the weights' last bits)."""
    n, k = len(logits), 40
    router = torch.tensor([logits])
    outs = [torch.randn(1, k, generator=torch.Generator().manual_seed(e)) for e in range(n)]
    h = torch.randn(1, k, generator=torch.Generator().manual_seed(99))
    want_chosen, want_weights = route(router, n_used)
    want = h + combine(h, want_chosen, want_weights, [lambda _x, o=o: o for o in outs])
    call = cpu.moe_decode_plan(router, h, [[] for _ in range(n)], outs, n_used)
    assert call() == 0
    order = torch.argsort(want_chosen[0])
    assert call.chosen.tolist() == want_chosen[0, order].tolist()
    assert torch.allclose(call.weights, want_weights[0, order], rtol=2.5e-7, atol=0)
    assert torch.allclose(h, want, rtol=1e-6, atol=1e-6)


@needs_c
def test_the_c_routing_refuses_bad_counts():
    h = torch.zeros(1, 8)
    with pytest.raises(ValueError, match="3 of 2 experts"):
        cpu.moe_decode_plan(torch.zeros(1, 2), h, [[], []], [h.clone(), h.clone()], 3)
    with pytest.raises(ValueError, match="like h"):
        cpu.moe_decode_plan(torch.zeros(1, 2), h, [[], []], [h.clone(), torch.zeros(4)], 1)


@needs_c
@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_K"])
def test_the_fast_cpu_decode_step_is_one_c_call(tmp_path, weight_type):
    """With the routing in C the fast CPU engine's decode step is one C call (a
    ``DecodeChain``): its logits, by every decode mode, are those of the same engine with
    the routing in torch (measured equal bit for bit; held to 1e-6 of their scale, as the
    two softmaxes may differ in a last bit), and each layer's routing is ``moe.route``'s."""
    from qlib.llama import fast_cpu

    sizes = dict(n_embd=256, n_ff=256) if weight_type == "Q4_K" else {}
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", weight_type=weight_type, **sizes)
    real = fast_cpu.cpu.moe_decode_plan
    try:
        fast_cpu.cpu.moe_decode_plan = lambda *a, **k: None  # the routing in torch
        in_torch, _ = load(path, engine="fast")
    finally:
        fast_cpu.cpu.moe_decode_plan = real
    fast, _ = load(path, engine="fast")
    assert fast.decode_chained and not in_torch.decode_chained
    prompt = torch.tensor(PROMPT)
    want = [in_torch.forward(prompt, 0), in_torch.forward(torch.tensor([[44]]), 7)]
    for mode in ("region", "c", "python"):
        fast.decode_mode = mode
        got = [fast.forward(prompt, 0), fast.forward(torch.tensor([[44]]), 7)]
        for g, w in zip(got, want, strict=True):
            assert (g - w).abs().max() <= 1e-6 * w.abs().max(), mode
    for layer in fast._plan:
        routed = layer[-1].routed
        chosen, weights = route(routed.router_logits, fast.config.expert_used_count)
        order = torch.argsort(chosen[0])
        assert routed.chosen.tolist() == chosen[0, order].tolist()
        assert torch.allclose(routed.weights, weights[0, order], rtol=2.5e-7, atol=0)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize(("weight_type", "stacked", "on_device"), [
    ("Q8_0", True, True), ("Q8_0", False, True), ("Q4_K", True, True), ("F32", True, False),
])  # fmt: skip
def test_the_fast_cuda_engine_runs_them_as_the_f32_form(tmp_path, weight_type, stacked,
                                                         on_device):  # fmt: skip
    """The fast CUDA engine (its fused kernels; experts of one packed type routed on the
    device and replayed from a CUDA graph, else routed in torch without graphs; weights
    dequantized exactly, float32 activations): the CPU's f32 form to 1e-4 of its logits'
    scale, a prompt and four decode steps (the first eager, the rest the graph's), and a
    greedy step; a persistent decode is refused."""
    sizes = dict(n_embd=256, n_ff=256) if weight_type == "Q4_K" else {}
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", weight_type=weight_type, stacked=stacked,
                             **sizes)  # fmt: skip
    ref, _ = load(path, form="f32")
    fast, _ = load(path, "cuda", engine="fast")
    assert fast.graphs == on_device
    assert ("routed on the device" if on_device else "routes in torch") in fast.decode_note
    fast_prompt = fast.forward(torch.tensor(PROMPT), 0).cpu()
    want = ref.forward(torch.tensor(PROMPT), 0)
    assert (fast_prompt - want).abs().max() <= 1e-4 * want.abs().max()
    for pos, token in enumerate((44, 3, 250, 9), start=len(PROMPT[0])):
        want, got = (
            ref.forward(torch.tensor([[token]]), pos),
            fast.forward(torch.tensor([[token]]), pos),
        )
        assert (got.cpu() - want).abs().max() <= 1e-4 * want.abs().max(), pos
    step = ref.forward(torch.tensor([[3]]), 11)
    assert fast.greedy_step(3, 11) == int(step.argmax())
    fast.clear_kv_cache()  # the prompt again: its prefill is not captured (torch's routing)
    assert torch.equal(fast.forward(torch.tensor(PROMPT), 0).cpu(), fast_prompt)
    with pytest.raises(ModelError, match="no routing for a mixture of experts"):
        load(path, "cuda", engine="fast", decode="persistent")


@needs_cuda
@pytest.mark.parametrize(("logits", "n_used"), [
    ([2.0, 0.0, 1.0, 2.0], 2), ([0.0, 3.0, 3.0, 3.0], 2),
    ([0.5, -1.0, 4.0, 0.25, 4.0, -3.0, 1.0, 2.0], 3), ([1.0, 2.0, 3.0], 3),
])  # fmt: skip
def test_the_device_routing_is_moe_route(logits, n_used):
    """``fused.moe_route`` chooses ``moe.route``'s experts (ties: the lower index) with its
    weights to 1e-6 (its own exp), in ascending expert order."""
    from qlib.quants.cuda import fused

    router = torch.tensor([logits])
    want_chosen, want_weights = route(router, n_used)
    order = torch.argsort(want_chosen[0])
    chosen = torch.zeros(n_used, dtype=torch.int32, device="cuda")
    weights = torch.zeros(n_used, device="cuda")
    fused.moe_route(router[0].cuda(), chosen, weights)
    assert chosen.tolist() == want_chosen[0, order].tolist()
    assert torch.allclose(weights.cpu(), want_weights[0, order], rtol=1e-6, atol=0)


def test_a_missing_expert_or_a_wrong_router_is_named(tmp_path):
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", stacked=False)
    with open(path, "rb") as f:  # the same file without one expert's gate
        content = Content.read(f)
        tensors = {n: content.tensor(f, n) for n in content.tensor_infos
                   if n != "blk.1.ffn_gate.3.weight"}  # fmt: skip
        write_path(tmp_path / "missing.gguf", content.metadata, tensors)
    with pytest.raises(ModelFileError, match=r"cannot find tensor blk.1.ffn_gate.3.weight"):
        load(tmp_path / "missing.gguf")
    path, _ = write_tiny_moe(tmp_path / "moe3.gguf", n_expert=3, extra_metadata={
        "llama.expert_count": Typed(GGUFValueType.UINT32, 4)})  # fmt: skip
    with pytest.raises(ModelFileError, match=r"ffn_gate_inp.weight has shape \[3, 64\], "
                                             r"expected \[4, 64\]"):  # fmt: skip
        load(path)


def test_more_experts_used_than_there_are_is_refused(tmp_path):
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", n_expert=2, n_expert_used=3)
    with pytest.raises(ModelFileError, match="expert_used_count 3 exceeds llama.expert_count 2"):
        load(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["f32", "quantized"])
def test_the_faithful_engine_runs_them_on_cuda(tmp_path, form):
    """The same engine on the GPU (torch ops; the quantized form's Triton kernels, which
    dequantize the weights exactly and keep the activations float32): the CPU's f32 form to
    1e-4 of its logits' scale, a prompt and a decode step."""
    path, _ = write_tiny_moe(tmp_path / "moe.gguf", weight_type="Q8_0")
    cpu_model, _ = load(path, form="f32")
    gpu_model, _ = load(path, "cuda", form=form)
    for ids, pos in ((torch.tensor(PROMPT), 0), (torch.tensor([[44]]), len(PROMPT[0]))):
        want = cpu_model.forward(ids, pos)
        got = gpu_model.forward(ids, pos).cpu()
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_the_bytes_floor_counts_the_experts_a_token_uses(tmp_path):
    """``bytes_per_step``: the attention and router weights whole, the experts' at the share a
    token runs (2 of 4), the same for both layouts."""
    from qlib.gguf import read_content
    from qlib.suite.experiments.common import bytes_per_step

    floors = []
    for stacked in (True, False):
        path, _ = write_tiny_moe(tmp_path / f"{stacked}.gguf", stacked=stacked, weight_type="Q8_0")
        content = read_content(path)
        infos = content.tensor_infos
        expert = sum(i.nbytes for n, i in infos.items() if "_exps" in n or n.count(".") == 4)
        dense = sum(i.nbytes for n, i in infos.items()
                    if n.startswith("blk.") and len(i.shape) >= 2) - expert  # fmt: skip
        assert expert > 0
        floor = bytes_per_step(content, 16)["weight_bytes"]
        assert floor == dense + expert / 2 + infos["output.weight"].nbytes
        floors.append(floor)
    assert floors[0] == floors[1]
