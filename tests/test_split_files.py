"""Split GGUF models (``PREFIX-00001-of-0000N.gguf``): written by gguf-py's writer (the
independent reference, as llama.cpp's converter uses it with ``--split-max-size``), opened by
their first shard as one model on every CPU engine, with the same logits as the unsplit file."""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib.convert.to_gguf import quantize_gguf
from qlib.gguf import (
    Content,
    GGUFError,
    GGUFValueType,
    SplitContent,
    Typed,
    open_model,
    read_content,
)
from qlib.llama.engine import load

gguf = pytest.importorskip("gguf")
VT = GGUFValueType
PROMPT = [1, 5, 9, 200, 3, 77]


def split_with_gguf_py(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """``src`` rewritten by gguf-py's ``GGUFWriter`` in shards of ``max_tensors`` tensors: the
    shards' paths (``OUT-00001-of-0000N.gguf`` ...)."""
    content = Content.read_path(src)
    w = gguf.GGUFWriter(out, content.get("general.architecture"), split_max_tensors=max_tensors)
    for key, value in content.metadata.items():
        if key in ("general.architecture", "general.alignment"):
            continue
        spec = content.metadata_types[key]
        if isinstance(spec, tuple):
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType(int(spec[1])))
        else:
            w.add_key_value(key, value, gguf.GGUFValueType(int(spec)))
    with open(src, "rb") as f:
        for name, info in content.tensor_infos.items():
            raw = np.frombuffer(content.tensor_bytes(f, name), dtype=np.uint8)
            w.add_tensor(name, raw.reshape(*info.shape[:-1], -1),  # the byte shape
                         raw_dtype=gguf.GGMLQuantizationType(info.dtype.id))  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    paths = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    assert len(paths) > 1
    return paths


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, list[Path]]:
    d = tmp_path_factory.mktemp("split")
    src = write_tiny_llama(d / "whole.gguf", n_layer=3, weight_type="Q8_0",
                           weight_types={"*ffn_down*": "Q4_K", "*attn_v*": "Q6_K"},
                           tie_output=False, n_embd=256, n_ff=512,
                           extra_metadata={"tokenizer.ggml.model": "none",  # for llama.cpp
                                           "llama.vocab_size": Typed(VT.UINT32, 256)})  # fmt: skip
    return src, split_with_gguf_py(src, d / "model.gguf", max_tensors=8)


def test_the_shards_read_as_one_directory(files):
    src, shards = files
    whole, split = Content.read_path(src), read_content(shards[0])
    assert isinstance(split, SplitContent) and split.paths == shards
    assert split.tensor_infos.keys() == whole.tensor_infos.keys()
    for name, info in whole.tensor_infos.items():
        assert (split.tensor_infos[name].dtype, split.tensor_infos[name].shape) == (
            info.dtype, info.shape)  # fmt: skip
    assert split.get("llama.block_count") == 3
    with open(src, "rb") as a, open_model(shards[0]) as (c, f):
        for name in whole.tensor_infos:  # every tensor's bytes from its own shard
            assert bytes(c.tensor(f, name).data.numpy()) == bytes(whole.tensor_bytes(a, name))


@pytest.mark.parametrize(("engine", "form"), [("faithful", None), ("faithful", "f32"),
                                              ("fast", None)])  # fmt: skip
def test_a_split_model_gives_the_unsplit_files_logits(files, engine, form):
    src, shards = files
    logits = []
    for path in (src, shards[0]):
        model, _ = load(path, engine=engine, form=form)
        logits.append(model.forward(torch.tensor([PROMPT]), 0)[0, -1].float())
    assert torch.equal(logits[0], logits[1])  # the same bytes: bit for bit


def test_a_later_shard_names_the_first(files):
    with pytest.raises(GGUFError, match=r"shard 2 of \d+ of a split model: open the first one, "
                                        r"model-00001-of-"):  # fmt: skip
        read_content(files[1][1])


def test_a_missing_shard_is_named(files, tmp_path):
    shards = files[1]
    for p in shards:
        if p != shards[-1]:
            (tmp_path / p.name).write_bytes(p.read_bytes())
    with pytest.raises(GGUFError, match=rf"shard is missing: .*{shards[-1].name}"):
        load(tmp_path / shards[0].name)


def test_shards_of_two_models_are_refused(files, tmp_path):
    """A shard whose ``split.no`` is not its place (another split's file renamed)."""
    shards = files[1]
    for i, p in enumerate(shards):
        (tmp_path / p.name).write_bytes(shards[1 if i == 2 else i].read_bytes())
    with pytest.raises(GGUFError, match="not one split model"):
        read_content(tmp_path / shards[0].name)


def test_requantizing_a_split_model_writes_one_file(files, tmp_path):
    out = tmp_path / "one.gguf"
    quantize_gguf(files[1][0], out, "Q8_0")
    content = Content.read_path(out)
    assert not any(k.startswith("split.") for k in content.metadata)
    assert content.tensor_infos.keys() == Content.read_path(files[0]).tensor_infos.keys()


def test_models_info_lists_the_shards(files):
    shards = files[1]
    r = subprocess.run([sys.executable, "-m", "qlib", "models", "info", str(shards[0])],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert f"split model: {len(shards)} shards" in r.stdout and shards[-1].name in r.stdout
    r = subprocess.run([sys.executable, "-m", "qlib", "models", "info", str(shards[1])],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode != 0 and "open the first one" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.peers
def test_llama_cpp_reads_the_same_split(files):
    """llama.cpp (peers extra) opens the same shards by the first one's path, as qlib does:
    its last-token logits from the split and from the whole file are identical."""
    pytest.importorskip("llama_cpp")
    assert np.array_equal(*(llama_cpp_last_logits(p) for p in (files[0], files[1][0])))


def llama_cpp_last_logits(path) -> np.ndarray:
    """llama.cpp's logits of the last token of ``PROMPT`` on the file (a split: its first
    shard) at ``path``."""
    import test_position0 as pos0

    llm = pos0.llama_cpp_model(path)
    try:
        llm.eval(PROMPT)
        return np.array(llm.scores[len(PROMPT) - 1])
    finally:
        llm.close()


def test_quantize_writes_a_split_that_gguf_py_and_llama_cpp_read(files, tmp_path):
    """``quantize_gguf(split_max_bytes=)`` (``qlib quantize --split-max-size``): llama.cpp's
    layout, each shard a GGUF file gguf-py reads with the split keys typed as llama.cpp
    writes them; qlib opens it as one model with the unsplit file's logits, and so does
    llama.cpp (peers)."""
    src = files[0]
    whole = quantize_gguf(src, tmp_path / "whole.gguf", "Q8_0").path
    report = quantize_gguf(src, tmp_path / "m.gguf", "Q8_0", split_max_bytes=200_000)
    paths = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(paths) > 2 and report.path == paths[0]
    total = 0
    for i, p in enumerate(paths):
        reader = gguf.GGUFReader(p)
        fields = {k: reader.fields[k] for k in ("split.no", "split.count", "split.tensors.count")}
        assert [int(f.parts[f.data[0]][0]) for f in fields.values()][:2] == [i, len(paths)]
        assert fields["split.no"].types[0] == gguf.GGUFValueType.UINT16
        assert fields["split.tensors.count"].types[0] == gguf.GGUFValueType.INT32
        assert ("llama.block_count" in reader.fields) == (i == 0)
        total += len(reader.tensors)
    assert total == len(Content.read_path(whole).tensor_infos)
    logits = []
    for path in (whole, paths[0]):
        model, _ = load(path)
        logits.append(model.forward(torch.tensor([PROMPT]), 0))
    assert torch.equal(logits[0], logits[1])
    if importlib.util.find_spec("llama_cpp") is not None:
        assert np.array_equal(*(llama_cpp_last_logits(p) for p in (whole, paths[0])))


def test_split_sizes_are_parsed_as_llama_cpp_does():
    from qlib.convert.cli import parse_size

    assert [parse_size(s) for s in ("2G", "500M", "64k", "1.5G", "1000")] == [
        2 * 10**9, 500 * 10**6, 64 * 10**3, 1_500_000_000, 1000]  # fmt: skip
    for bad in ("5Q", "-1G", "0", "G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
