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
    (["generate", "-p", "hi", "-t", "100000"], "this machine's CPUs"),
    (["bench", "-t", "0"], "at least 1"),
    (["generate", "-p", ""], "must not be empty"),
    (["generate", "-p", "hi", "--device", "foo"], "unknown device 'foo'"),
    (["generate", "-p", "hi", "-n", "5000"], "--engine fast holds the file's 8192"),
    (["generate", "-p", "hi", "-n", "9000", "--engine", "fast"], "position limit (8192"),
    (["bench", "--context", "5000"], "--engine fast holds the file's 8192"),
    (["bench", "--engine", "fast", "--context", "256,8100"], "--context 8100 and 128 steps"),
    (["bench", "--prompt-tokens", "4000", "--steps", "200"], "lower --prompt-tokens or --steps"),
    (["generate", "-p", "hi", "--engine", "fast", "--form", "f32"], "keeps the weights quantized"),
    (["generate", "-p", "hi", "--max-seq-len", "64"], "--max-seq-len sizes the fast engine"),
    (
        ["generate", "-p", "hi", "-n", "70", "--engine", "fast", "--max-seq-len", "64"],
        "position limit (64: --max-seq-len)",
    ),
    (["generate", "-p", "hi", "--engine", "fast", "--max-seq-len", "0"], "at least 1"),
    (["bench", "--engine", "fast", "--decode", "fused"], "takes no option 'decode'"),
    (["logits", "--text-file", "{d}/missing.txt", "--out", "{d}/x.npy"], "no such file"),
    (["logits", "--text-file", "", "--out", "{d}/x.npy"], "must not be empty"),
    (["quantize", "--in", "{d}/good.gguf", "--out", "{d}/q.gguf", "--type", "Q9"], "'Q9'"),
    (["convert", "--in", "{d}/missing", "--out", "{d}/o"], "no such file"),
    (["bench", "-m", "{d}/text.gguf"], "not a GGUF file"),
    (["bench", "--steps", "0"], "at least 1"),
    (["bench", "--context", "256,256"], "a value repeats"),
    (["bench", "--context", "256,x"], "comma-separated list"),
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


def test_models_synthetic_writes_a_listed_llama(capsys, tmp_path, monkeypatch):
    """``models synthetic SHAPE TYPE`` writes data/models/synthetic-SHAPE.TYPE.gguf (here a
    temporary models dir holding the embedded file for its tokenizer), listed as synthetic,
    with the shape's tensors in the asked type; an existing file is kept."""
    from qlib import models
    from qlib.gguf import Content

    (tmp_path / models.DEFAULT_MODEL).symlink_to(models.path())
    monkeypatch.setenv("QLIB_MODELS_DIR", str(tmp_path))
    assert main(["models", "synthetic", "tiny", "Q8_0"]) == 0
    made = tmp_path / "synthetic-tiny.Q8_0.gguf"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(made)
    infos = Content.read_path(made).tensor_infos
    assert infos["blk.0.ffn_down.weight"].dtype.name == "Q8_0"
    assert len([n for n in infos if n.endswith(".ffn_down.weight")]) == 2  # the tiny shape
    mtime = made.stat().st_mtime_ns
    assert main(["models", "synthetic", "tiny", "Q8_0"]) == 0
    assert made.stat().st_mtime_ns == mtime
    assert main(["models", "list"]) == 0
    line = next(r for r in capsys.readouterr().out.splitlines() if r.startswith(made.name))
    assert line.split()[1] == "Q8_0" and "synthetic" in line.split()[5:]


# -- the flags every model command shares, and what the commands print ------------------


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """A tiny random llama with SmolLM2's tokenizer and chat template (fast to run)."""
    from synthetic import write_tiny_llama

    from qlib import models
    from qlib.tokenizer import read_metadata

    md = read_metadata(models.path())
    return write_tiny_llama(
        tmp_path_factory.mktemp("tok") / "tiny.gguf",
        vocab=len(md["tokenizer.ggml.tokens"]),
        extra_metadata={k: v for k, v in md.items() if k.startswith("tokenizer.")},
    )


@pytest.mark.parametrize("command", ["generate", "logits", "bench", "chat"])
def test_seed_and_threads_everywhere(command):
    from qlib.cli import build_parser

    extra = {"generate": ["-p", "hi"], "logits": ["--text-file", __file__, "--out", "x.npy"]}
    args = build_parser().parse_args([command, "-s", "7", "-t", "1", *extra.get(command, [])])
    assert (args.seed, args.threads) == (7, 1)
    long = build_parser().parse_args([command, "--seed", "8", "--threads", "2",
                                      *extra.get(command, [])])  # fmt: skip
    assert (long.seed, long.threads) == (8, 2)


def test_steps_are_new_tokens_in_generate(tiny_chat_model, capsys):
    assert main(["generate", "-m", str(tiny_chat_model), "-p", "hi", "-n", "3", "-s", "1"]) == 0
    err = capsys.readouterr().err
    assert "3 new tokens (1 from the prefill + 2 decode steps)" in err, err
    assert "tok/s" in err


def test_logits_with_a_seed(tiny_chat_model, tmp_path, capsys):
    import numpy as np

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.")
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"l{seed}.npy"
        argv = ["logits", "-m", str(tiny_chat_model), "--text-file", str(text), "--out", str(out)]
        assert main([*argv, "-s", seed, "-t", "1"]) == 0
        outs.append(np.load(out))
    assert outs[0].shape[0] > 5 and np.array_equal(outs[0], outs[1])  # nothing is sampled


BENCH = ["bench", "--steps", "2", "--reps", "1", "--prompt-tokens", "8", "-t", "1", "-s", "3"]


def test_bench_formats(tiny_chat_model, capsys):
    import csv
    import io
    import json

    argv = [*BENCH, "-m", str(tiny_chat_model)]
    assert main([*argv, "--format", "json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["steps"] == 2 and r["prompt_tokens"] == 8 and r["threads"] == 1
    for kind, ms, n in (("prefill", "prefill_ms", 8), ("decode", "decode_ms_per_token", 1)):
        assert r[f"{kind}_tok_s"]["median"] == pytest.approx(n * 1e3 / r[ms]["median"])
        assert r[f"{kind}_tok_s"]["max"] == pytest.approx(n * 1e3 / r[ms]["min"])
    assert main([*argv, "--json"]) == 0  # the old spelling
    assert set(json.loads(capsys.readouterr().out)) == set(r)

    assert main([*argv, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [row["test"] for row in rows] == ["pp8", "tg2"]
    assert rows[0]["model"] == "tiny" and rows[0]["runtime"] == "qlib"
    assert int(rows[0]["params"]) > 49152 * 64 and int(rows[0]["threads"]) == 1
    assert float(rows[1]["tok_s_median"]) == pytest.approx(1e3 / float(rows[1]["ms_median"]))

    assert main(argv) == 0  # md, the default
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("| model | size | params | runtime | variant |")
    assert "t/s median" in lines[0] and "peak RSS" in lines[0]
    assert set(lines[1]) <= set("|-:")
    assert "| pp8 |" in lines[2] and "| tg2 |" in lines[3] and "faithful default" in lines[2]

    rc, err = run([*argv, "--json", "--format", "csv"], capsys)
    assert rc == 1 and "--json is --format json" in err


def test_bench_steps_are_decode_steps(tiny_chat_model, capsys):
    """bench --steps counts decode steps after the prefill (the protocol's 128), not new tokens:
    the table's test is tg<steps>, and the help says so."""
    import json

    assert main([*BENCH, "-m", str(tiny_chat_model), "--steps", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["steps"] == 3
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "decode steps after the prefill" in " ".join(capsys.readouterr().out.split())


def test_only_lab_takes_unknown_arguments(capsys):
    rc, err = run(["generate", "-p", "hi", "--no-browser"], capsys)
    assert rc == 2 and "unrecognized arguments: --no-browser" in err


def test_lab_command_line():
    import importlib.util

    from qlib.cli.lab import NOTEBOOKS_DIR, command

    if importlib.util.find_spec("jupyterlab") is None:
        pytest.skip("jupyterlab is not installed (the lab extra)")
    argv = command(["--no-browser", "--port", "8899"])
    assert argv[:5] == [sys.executable, "-m", "jupyterlab", "--notebook-dir", str(NOTEBOOKS_DIR)]
    assert argv[-3:] == ["--no-browser", "--port", "8899"]
    assert (NOTEBOOKS_DIR / "00_smoke.ipynb").is_file()


def test_lab_without_jupyterlab_names_the_fix(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jupyterlab" else real(name)
    )
    rc, err = run(["lab", "--no-browser"], capsys)
    assert rc == 1 and "JupyterLab is not installed" in err and "pip install -e .[lab]" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_lab_serves_the_notebooks(tmp_path):
    """`python -m qlib lab` starts JupyterLab on notebooks/ (about 15 s on 2 busy cores)."""
    import json
    import os
    import socket
    import time
    import urllib.request

    pytest.importorskip("jupyterlab")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "qlab-test"
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "qlib", "lab", "--no-browser", "--port", str(port),
         f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def get(path: str):
        with urllib.request.urlopen(f"{base}{path}?token={token}", timeout=5) as r:
            return r.status, r.read()

    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            try:
                status, body = get("/api/contents")
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer in 120 s"
                time.sleep(0.5)
        names = {c["name"] for c in json.loads(body)["content"]}
        assert {"00_smoke.ipynb", "00_smoke.py", "09_speed_vs_pytorch.ipynb"} <= names
        specs = json.loads(get("/api/kernelspecs")[1])
        assert specs["default"] == "python3" and "python3" in specs["kernelspecs"]
        assert get("/lab")[0] == 200
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_position_limit_is_the_chosen_engines():
    """The faithful engine holds candle's 4,096 positions, the fast engines the file's
    ``llama.context_length`` (8,192 for the embedded model): a prompt of ~4,200 tokens passes
    ``generate``'s check with ``--engine fast`` and not without; the limit itself fits."""
    from qlib import models
    from qlib.cli.generate import preflight

    path, prompt = models.path(), "word " * 4200
    with pytest.raises(ValueError, match=r"position limit \(4096"):
        preflight(path, prompt, False, 2, None, None)
    preflight(path, prompt, False, 2, "fast", None)
    with pytest.raises(ValueError, match=r"position limit \(8192"):
        preflight(path, prompt, False, 4000, "fast", None)


def test_models_info_counts_every_type(tmp_path, capsys):
    """``models info``: the shape, then per type its tensors, weights, bytes and bits a
    weight, from the file's own tensor directory; a non-llama file is one line."""
    from synthetic import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m.gguf", weight_type="Q4_0", n_embd=256, n_ff=512,
                            weight_types={"*ffn_down*": "Q8_0"}, tie_output=False)  # fmt: skip
    assert main(["models", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "llama: 2 layers, hidden 256, 4 query / 2 KV heads (head_dim 64), vocabulary 256" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[4:]}
    # Q4_0: q, k, v, o, gate, up of 2 layers, the embedding and the output (18 bytes / 32)
    weights = 2 * (256 * 256 * 2 + 128 * 256 * 2 + 512 * 256 * 2) + 2 * 256 * 256
    assert rows["Q4_0"][:3] == ["Q4_0", "14", f"{weights:,}"] and rows["Q4_0"][4] == "4.50"
    assert rows["Q8_0"][:3] == ["Q8_0", "2", f"{2 * 256 * 512:,}"] and rows["Q8_0"][4] == "8.50"
    assert rows["F32"][1] == "5"  # the norms
    bad = write_tiny_llama(tmp_path / "gpt2.gguf", arch="gpt2",
                           drop_keys=("llama.attention.head_count",))  # fmt: skip
    rc, err = run(["models", "info", str(bad)], capsys)
    assert rc == 1 and "general.architecture is 'gpt2'" in err


def test_models_info_names_biases_and_rope_scaling(tmp_path, capsys):
    from synthetic import write_tiny_llama

    from qlib.gguf import GGUFValueType, Typed

    path = write_tiny_llama(tmp_path / "m.gguf", biases=("attn_q", "attn_k", "attn_v"),
                            extra_metadata={"llama.rope.scaling.type": "yarn",
                                            "llama.rope.scaling.factor":
                                                Typed(GGUFValueType.FLOAT32, 4.0)})  # fmt: skip
    assert main(["models", "info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "projection biases: attn_q, attn_k, attn_v (the fast engines add them" in out
    assert "RoPE scaling: yarn scaling x4 (the fast engines apply it" in out


def test_a_warning_is_one_line(tmp_path, capsys, monkeypatch):
    """A library warning on the command line: ``qlib COMMAND: warning: ...``, no file:line."""
    import warnings

    from qlib.cli import models as models_cli

    def info(_args) -> int:
        warnings.warn("something to know", stacklevel=1)
        return 0

    monkeypatch.setattr(models_cli, "_info", info)
    rc, err = run(["models", "info", "x.gguf"], capsys)
    assert rc == 0 and err.strip() == "qlib models: warning: something to know"
