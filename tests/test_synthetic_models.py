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
