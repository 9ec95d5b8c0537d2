"""The real SmolLM2-135M-Instruct Q4_1 file against transformers loading the same GGUF in f32.

transformers dequantizes the GGUF to float32 and un-permutes q/k for its NEOX
RoPE, so with qlib's dequantized f32 form the two compute the same function
by different routes; differences are float32 rounding, amplified through 30
layers to ~1e-4 on logits of magnitude ~30. The bar is 1e-3 (issue 2).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from qlib import models
from qlib.llama.engine import load
from qlib.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEACHER_FORCED_TOKENS = 300
LOGIT_TOL = 1e-3


@pytest.fixture(scope="module")
def model_path():
    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf(model_path):
    transformers = pytest.importorskip("transformers")
    kw = dict(gguf_file=model_path.name)
    tok = transformers.AutoTokenizer.from_pretrained(model_path.parent, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path.parent, dtype=torch.float32, **kw
    ).eval()
    return tok, model


@pytest.fixture(scope="module")
def qlib_f32(model_path):
    model, content = load(model_path, "cpu", form="f32")
    return model, Tokenizer.from_metadata(content.metadata)


@pytest.fixture(scope="module")
def passage_ids(qlib_f32):
    text = models.data_file("passage.txt").read_text()
    ids = qlib_f32[1].encode(text, add_special_tokens=False)
    assert len(ids) >= TEACHER_FORCED_TOKENS
    return ids[:TEACHER_FORCED_TOKENS]


def test_teacher_forced_logits_match_transformers(hf, qlib_f32, passage_ids):
    model, _ = qlib_f32
    model.clear_kv_cache()
    with torch.inference_mode():
        ours = model.forward(torch.tensor([passage_ids]), 0, all_logits=True)[0]
        ref = hf[1](torch.tensor([passage_ids])).logits[0].float()
    diff = (ours - ref).abs()
    print(
        f"\nteacher forcing {len(passage_ids)} tokens: max|diff| {diff.max():.3g}, "
        f"mean {diff.mean():.3g}, max|ref| {ref.abs().max():.1f}"
    )
    assert diff.max().item() <= LOGIT_TOL
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_chat_matches_transformers(hf, qlib_f32):
    from qlib.generate import generate

    tok, hf_model = hf
    model, tokenizer = qlib_f32
    messages = [{"role": "user", "content": "What is Rust?"}]
    prompt = tokenizer.chat_prompt("What is Rust?")
    assert prompt == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt)
    assert prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
    model.clear_kv_cache()
    ours = generate(model, prompt_ids, 20)
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=20, do_sample=False)
    theirs = out[0, len(prompt_ids) :].tolist()
    print(f"\n{tokenizer.decode(ours)!r}")
    assert ours == theirs


def test_cli_generate_json(model_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "qlib",
            "generate",
            "--model",
            str(model_path),
            "--prompt",
            "What is Rust?",
            "--chat",
            "--steps",
            "5",
            "--form",
            "f32",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout)
    assert len(result["ids"]) == 5 and len(result["prompt_ids"]) > 20
    assert result["text"] and result["timings"]["prefill_ms"] > 0
    assert len(result["timings"]["decode_ms"]) == 4


def test_cli_logits(model_path, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The lighthouse at the end of the northern breakwater")
    out = tmp_path / "l.npy"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qlib",
            "logits",
            "--model",
            str(model_path),
            "--text-file",
            str(text),
            "--out",
            str(out),
            "--form",
            "f32",
        ],
        check=True,
        capture_output=True,
    )
    logits = np.load(out)
    assert logits.dtype == np.float32 and logits.shape[1] == 49152 and logits.shape[0] > 5
