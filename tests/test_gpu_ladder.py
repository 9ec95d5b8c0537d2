"""Notebook 11's measurements (qlib.suite.experiments.gpu_ladder): the byte count of a step
on CPU, the rungs themselves on CUDA (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from qlib import models
from qlib.gguf import Content
from qlib.suite.experiments import common, gpu_ladder


@pytest.fixture(scope="module")
def model_path():
    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


def test_bytes_per_step_counts_every_matmul_weight_once(model_path):
    content = Content.read_path(model_path)
    got = common.bytes_per_step(content, context=100)
    infos = content.tensor_infos
    mats = [i for n, i in infos.items() if n.startswith("blk.") and len(i.shape) == 2]
    assert len(mats) == 7 * content.metadata["llama.block_count"]
    out = infos.get("output.weight", infos["token_embd.weight"])  # tied: the embedding
    assert got["weight_bytes"] == sum(i.nbytes for i in mats) + out.nbytes
    md = content.metadata
    d = md["llama.embedding_length"] // md["llama.attention.head_count"]
    per_pos = 2 * md["llama.block_count"] * md["llama.attention.head_count_kv"] * d * 4
    assert got["kv_bytes"] == per_pos * 100


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the ladder needs a CUDA device")
def test_ladder_rungs_agree_and_order(model_path):
    from qlib.suite.experiments.drift import passage_ids
    from qlib.tokenizer import Tokenizer

    ids = passage_ids(Tokenizer.from_gguf(model_path), 32)
    rows = gpu_ladder.ladder(str(model_path), ids, steps=16, reps=1)
    built = {r["rung"]: r for r in rows if "missing" not in r}
    assert list(built) == [r.name for r in gpu_ladder.LADDER]  # SmolLM2 Q4_1 runs every rung
    assert len({tuple(r["ids"]) for r in built.values()}) == 1  # the same greedy ids
    graph, eager = built["fused, CUDA graph"], built["fused, one by one"]
    assert graph["kernels_per_token"] > 0 and graph["gpu_busy_ms"] > 0
    assert graph["ms_per_token"] < built["per-op"]["ms_per_token"]
    assert graph["launches_per_token"] < eager["launches_per_token"]
    assert built["persistent"]["kernels_per_token"] < graph["kernels_per_token"]
    # the argmax in the step's graph: no separate argmax kernels or logits copy, no host time
    on_device = built["persistent + argmax on device"]
    assert on_device["kernels_per_token"] < built["persistent"]["kernels_per_token"]
    assert on_device["host_ms_per_step"] is None
