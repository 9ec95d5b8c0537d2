"""``convert.synthetic``: llama files of a given shape with random weights (benchmark models)."""

from __future__ import annotations

import torch

from qlib import models
from qlib.convert.synthetic import SHAPES, synthesize
from qlib.gguf import Content
from qlib.llama.engine import load
from qlib.tokenizer import Tokenizer


def test_synthetic_file_has_its_shape_types_and_logit_spread(tmp_path):
    path = synthesize(tmp_path / "t.gguf", models.path(), "tiny", "Q4_K_M", seed=1)
    content = Content.read_path(path)
    shape = SHAPES["tiny"]
    assert content.metadata["llama.embedding_length"] == shape.n_embd
    assert content.metadata["llama.attention.head_count_kv"] == shape.n_kv_head
    types = {i.dtype.name for i in content.tensor_infos.values()}
    assert {"Q4_K", "Q6_K", "F32"} <= types  # the recipe's mix (Q6_K on the tied embedding)
    model, content = load(path, "cpu")
    tok = Tokenizer.from_metadata(content.metadata)  # the source's tokenizer came along
    ids = tok.encode("The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    logits = model.forward(torch.tensor([ids]), 0, all_logits=True)[0]
    assert torch.isfinite(logits).all()
    # spread: sqrt(256) / 8 = 2 by construction; a collapsed model would be near 0
    assert logits.std(dim=-1).min() > 0.5


def test_same_seed_same_file(tmp_path):
    a = synthesize(tmp_path / "a.gguf", models.path(), "tiny", "Q8_0", seed=3)
    b = synthesize(tmp_path / "b.gguf", models.path(), "tiny", "Q8_0", seed=3)
    assert a.read_bytes() == b.read_bytes()


def test_a_synthetic_mixture_of_experts(tmp_path):
    """The ``moe`` shapes: llama.cpp's stacked experts and an F32 router (as its quantize
    keeps it), the expert keys; the faithful and fast CPU engines run it, the fast one as
    the quantized form (1e-6 of the logits' scale), with logits that have spread."""
    path = synthesize(tmp_path / "m.gguf", models.path(), "tiny-moe", "Q8_0", seed=2)
    content = Content.read_path(path)
    shape = SHAPES["tiny-moe"]
    assert content.metadata["llama.expert_count"] == shape.n_expert
    infos = content.tensor_infos
    assert infos["blk.0.ffn_gate_inp.weight"].dtype.name == "F32"
    assert infos["blk.1.ffn_down_exps.weight"].shape == (shape.n_expert, shape.n_embd, shape.n_ff)
    ids = torch.tensor([[1, 400, 9000, 17, 5]])
    ref, _ = load(path, "cpu", form="quantized")
    fast, _ = load(path, "cpu", engine="fast")
    want, got = ref.forward(ids, 0), fast.forward(ids, 0)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()
    assert want.std() > 0.5
