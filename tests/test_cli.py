"""The command line on bad input: a short message naming the problem, a non-zero exit, no
traceback (unless asked); and the conventions every command shares."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from qlib.cli import main


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own exit
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.gguf").write_bytes(b"")
    (d / "text.gguf").write_text("not a model\n")
    from synthetic import write_tiny_llama

    good = write_tiny_llama(d / "good.gguf", weight_type="Q8_0")
    (d / "trunc.gguf").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return d


CASES = [  # argv (with {d} for the folder of bad files), words the message must contain
    (["generate", "-m", "{d}/missing.gguf", "-p", "hi"], "no such file"),
    (["generate", "-m", "{d}", "-p", "hi"], "not a file"),
    (["generate", "-m", "{d}/empty.gguf", "-p", "hi"], "truncated header"),
    (["generate", "-m", "{d}/text.gguf", "-p", "hi"], "not a GGUF file"),
    (["generate", "-m", "{d}/trunc.gguf", "-p", "hi"], "tensor"),
    (["generate", "-p", "hi", "-n", "0"], "at least 1"),
    (["generate", "-p", "hi", "--steps", "-1"], "at least 1"),
    (["generate", "-p", "hi", "--temperature", "-1"], "0 or more"),
    (["generate", "-p", "hi", "--top-p", "5"], "(0, 1]"),
    (["generate", "-p", "hi", "--top-k", "-2"], "0 or more"),
    (["generate", "-p", ""], "must not be empty"),
    (["generate", "-p", "hi", "--device", "foo"], "unknown device 'foo'"),
    (["generate", "-p", "hi", "-n", "5000"], "position limit"),
    (["generate", "-p", "hi", "--engine", "fast", "--form", "f32"], "keeps the weights quantized"),
    (["logits", "--text-file", "{d}/missing.txt", "--out", "{d}/x.npy"], "no such file"),
    (["quantize", "--in", "{d}/good.gguf", "--out", "{d}/q.gguf", "--type", "Q9"], "'Q9'"),
    (["convert", "--in", "{d}/missing", "--out", "{d}/o"], "no such file"),
    (["bench", "-m", "{d}/text.gguf"], "not a GGUF file"),
    (["bench", "--steps", "0"], "at least 1"),
    (["models", "path", "nothing-here.gguf"], "not in"),
]
if not torch.cuda.is_available():
    CASES.append((["generate", "-p", "hi", "--device", "cuda"], "CUDA is not available"))


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(c[0][:4]) for c in CASES])
def test_bad_input_is_a_short_message(argv, words, bad_files, capsys):
    rc, err = run([a.format(d=bad_files) for a in argv], capsys)
    assert rc not in (0, None), err
    assert "Traceback" not in err
    assert words.lower() in err.lower(), err
    assert len(err.strip().splitlines()) <= 2, err


def test_non_llama_architecture_is_named(tmp_path, capsys):
    from synthetic import write_tiny_llama

    path = write_tiny_llama(
        tmp_path / "m.gguf", arch="gpt2", drop_keys=("llama.attention.head_count",)
    )
    rc, err = run(["generate", "-m", str(path), "-p", "hi", "-n", "1"], capsys)
    assert rc == 1 and "general.architecture is 'gpt2'" in err, err


def test_traceback_when_asked(bad_files, capsys):
    with pytest.raises(Exception, match="truncated header"):
        main(["generate", "-m", f"{bad_files}/empty.gguf", "-p", "hi", "--traceback"])


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "qlib", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("qlib ")


def test_models_list_and_path_by_type(capsys):
    from qlib import models

    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert models.DEFAULT_MODEL in out and "Q4_1" in out and "embedded" in out
    assert main(["models", "path", "Q4_1"]) == 0  # a type names the default model's variant
    assert capsys.readouterr().out.strip() == str(models.path())
