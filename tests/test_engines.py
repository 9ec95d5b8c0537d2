"""``qlib.llama.engine``: one entry point for the faithful path and the fast path of each device."""

from __future__ import annotations

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.llama import engine as engines
from qlib.llama.errors import ModelError
from qlib.llama.faithful import ModelWeights
from qlib.llama.fast_cpu import FastModel
from qlib.llama.fast_cuda import CudaFastModel


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("m") / "m.gguf", weight_type="Q8_0")


@pytest.mark.parametrize("form", [None, "quantized", "f32", "f16"])
def test_faithful_forms_build_model_weights(tiny, form):
    model, _ = engines.load(tiny, "cpu", form=form)
    assert isinstance(model, ModelWeights)


def test_fast_on_cpu_is_fast_model_and_agrees_with_the_quantized_form(tiny):
    fast, _ = engines.load(tiny, "cpu", engine="fast", prefill="int8")
    ref, _ = engines.load(tiny, "cpu", form="quantized")
    assert isinstance(fast, FastModel)
    x = torch.tensor([[1, 2, 3, 4]])
    a, b = fast.forward(x, 0), ref.forward(x, 0)
    assert (a - b).abs().max() <= 5e-3 * b.abs().max()  # as tests/test_fast_paths.py


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fast_on_cuda_is_cuda_fast_model(tiny):
    model, _ = engines.load(tiny, "cuda", engine="fast")
    assert isinstance(model, CudaFastModel)


@pytest.mark.parametrize("ids", [[[1, 256]], [[-2]], [[7, 1.0]]])
def test_fast_cpu_engine_refuses_ids_outside_the_vocabulary(tiny, ids):
    """A token id outside the vocabulary (or not an integer) is a clear error, not a wrapped
    negative index or a read past the embedding."""
    from qlib.llama.errors import InputError

    fast, _ = engines.load(tiny, "cpu", engine="fast")
    with pytest.raises(InputError, match="outside the vocabulary|must be integers"):
        fast.forward(torch.tensor(ids), 0)


class _TableModel:
    """An engine whose logits depend only on the last token (a fixed random table)."""

    def __init__(self, vocab: int = 50):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0))
        self.device, self.config, self.kv_len = torch.device("cpu"), None, 0

    def forward(self, x, index_pos, *, all_logits=False):
        self.kv_len = index_pos + x.shape[1]
        return self.table[x[0, -1]][None]

    def clear_kv_cache(self):
        self.kv_len = 0


class _OnDevice(_TableModel):
    steps = 0

    def greedy_step(self, token, index_pos):
        self.steps += 1
        return int(self.forward(torch.tensor([[token]]), index_pos)[0].argmax())


def test_generate_takes_greedy_steps_on_the_device_when_offered():
    """Greedy ``generate`` on an engine that offers ``greedy_step`` (``GreedyOnDevice``: the
    fast CUDA engine) uses it for every step after the prefill, with the ids of forward +
    argmax; sampling keeps forward and the logits."""
    from qlib.generate import LogitsProcessor, generate

    plain, on_device = _TableModel(), _OnDevice()
    assert isinstance(on_device, engines.GreedyOnDevice) and isinstance(plain, engines.Engine)
    assert not isinstance(plain, engines.GreedyOnDevice)
    ids = generate(on_device, [3, 4, 5], 10)
    assert ids == generate(plain, [3, 4, 5], 10)
    assert on_device.steps == 9 and on_device.kv_len == 3 + 9
    sampled = _OnDevice()
    generate(sampled, [3, 4, 5], 10, LogitsProcessor(temperature=0.8))
    assert sampled.steps == 0


def test_fast_elsewhere_is_a_clear_error(tiny, monkeypatch):
    monkeypatch.setattr(engines, "as_device", lambda d: torch.device("mps"))
    with pytest.raises(ModelError, match="no fast engine on mps"):
        engines.load(tiny, "mps", engine="fast")


@pytest.mark.parametrize(
    ("engine", "option", "words"),
    [
        ("fast", {"decode": "fused"}, "the fast CPU engine takes no option 'decode'"),
        ("faithful", {"kv_type": "f16"}, "the faithful engine takes no option 'kv_type'"),
        ("fast", {"kv_cache": "static"}, "its options: prefill"),
    ],
)
def test_an_option_the_engine_does_not_take_is_named(tiny, engine, option, words):
    """Another engine's option (the CUDA decode on the CPU, the fast engines' KV type on the
    faithful engine) is a ``ModelError`` naming it and the options there are, not a
    ``TypeError`` from deep inside."""
    with pytest.raises(ModelError, match=words):
        engines.load(tiny, "cpu", engine=engine, **option)


def test_generate_cli_takes_the_fast_form(capsys, smollm2_path):
    import json

    from qlib.cli import main

    path = smollm2_path
    argv = ["generate", "--model", str(path), "--prompt", "What is Rust?", "--chat", "--steps", "8",
            "--json", "--form"]  # fmt: skip
    assert main([*argv, "fast"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert main([*argv, "f32"]) == 0
    f32 = json.loads(capsys.readouterr().out)
    assert fast["prompt_ids"] == f32["prompt_ids"] and len(fast["ids"]) == 8
    # bf16 prefill + Q8 activations vs float32: the first greedy tokens agree on this prompt
    assert fast["ids"][:4] == f32["ids"][:4]


def test_load_progress_bar_over_layers(monkeypatch, capsys):
    """Loads longer than ``progress.DELAY_S`` show a bar over the layers (forced on here)."""
    from qlib import progress

    monkeypatch.setenv("QLIB_PROGRESS", "1")
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    assert list(progress.layers(range(3), 3)) == [0, 1, 2]
    assert "loading layers" in capsys.readouterr().err
    monkeypatch.setenv("QLIB_PROGRESS", "0")
    assert list(progress.layers(range(3), 3)) == [0, 1, 2]
    assert "loading layers" not in capsys.readouterr().err


def test_waiting_notice(monkeypatch, capsys):
    """A single long step (the persistent kernel's compile) says so on stderr once it has
    taken ``progress.DELAY_S``, then its time; a short one, or with the switch off, says
    nothing."""
    import time

    from qlib import progress

    monkeypatch.setenv("QLIB_PROGRESS", "1")
    monkeypatch.setattr(progress, "DELAY_S", 0.01)
    with progress.waiting("compiling"):
        time.sleep(0.2)
    err = capsys.readouterr().err
    assert "compiling ..." in err and "compiling: 0." in err
    monkeypatch.setattr(progress, "DELAY_S", 5.0)
    with progress.waiting("compiling"):
        pass
    monkeypatch.setenv("QLIB_PROGRESS", "0")
    monkeypatch.setattr(progress, "DELAY_S", 0.0)
    with progress.waiting("compiling"):
        time.sleep(0.05)
    assert capsys.readouterr().err == ""


def test_greedy_id_is_torch_argmax():
    """``greedy_id`` (numpy's argmax for float32 on the CPU, torch's elsewhere) picks what
    ``torch.argmax`` picks: the first of equal maxima, a NaN over any number, any shape."""
    from qlib.generate import LogitsProcessor, greedy_id

    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(1, 49152, generator=g), torch.tensor([[1.0, 3.0, 2.0, 3.0]]),
             torch.tensor([1.0, float("nan"), 3.0, float("nan")]),
             torch.full((5,), float("-inf")), torch.randn(7, generator=g).to(torch.float16),
             torch.randn(3, 4, generator=g)[:, 1]]  # fmt: skip
    for x in cases:
        assert greedy_id(x) == int(x.reshape(-1).argmax()), x
    assert LogitsProcessor().sample(cases[1][0]) == 1
