"""The logic of notebooks 4-6 (index_pos misuse, RoPE mismatch, logit drift) on tiny llamas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from synthetic import write_tiny_llama

from qlib.generate import generate
from qlib.gguf import Content, GGUFValueType, Typed
from qlib.llama.config import MAX_SEQ_LEN
from qlib.llama.engine import load
from qlib.quants.qtensor import QMatMul
from qlib.suite.experiments import drift, rope
from qlib.suite.experiments import index_pos as ip
from qlib.suite.experiments.common import next_token

PROMPT = [1, 7, 42, 9, 100, 3, 77, 12, 5, 60, 61, 8, 250]  # 13 tokens, as the seed's prompt
PROMPT2 = [1, 30, 31, 32, 33, 34]


class Ids:
    """A stand-in tokenizer: the tiny files have no vocabulary."""

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


TOK = Ids()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("x") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_q8_path(tmp_path_factory):
    # freq_base 100000 as SmolLM2's, so removing the key changes something
    extra = {"llama.rope.freq_base": Typed(GGUFValueType.FLOAT32, 100000.0)}
    path = tmp_path_factory.mktemp("q") / "tiny.Q8_0.gguf"
    return write_tiny_llama(path, weight_type="Q8_0", extra_metadata=extra)


@pytest.fixture()
def model(tiny_path):
    m, _ = load(tiny_path)
    return m


# -- notebook 4 -------------------------------------------------------------


def test_degeneration_measures():
    assert ip.repetition([5, 5, 5, 5]) == 0.75
    assert ip.repetition([]) == 0.0
    assert ip.longest_run([1, 2, 2, 2, 3, 3]) == 3
    assert ip.longest_run([]) == 0
    assert ip.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert ip.first_difference([1, 2], [1, 2, 3]) is None
    assert ip.text_stats([4, 4, 6]) == {
        "tokens": 3,
        "distinct_tokens": 2,
        "repetition": pytest.approx(1 / 3),
        "longest_run": 2,
    }


def test_decode_variants(model):
    rows = ip.decode_variants(model, TOK, PROMPT, 6)
    assert [r["variant"] for r in rows] == list(ip.DECODE_VARIANTS)
    correct = rows[0]
    assert correct["identical_to_correct"] and correct["agrees_with_correct_for"] == 6
    assert correct["ids"] == ip.decode_with(model, PROMPT, 6, lambda p: p)
    # every variant shares the prefill's first token
    assert len({r["ids"][0] for r in rows}) == 1
    # "always 0" drops the cache each step: each token is the next token of the previous alone
    always0 = rows[3]["ids"]
    for prev, nxt in zip(always0, always0[1:], strict=False):
        model.clear_kv_cache()
        assert next_token(model, [prev], 0) == nxt


def test_chunked_prefill_wrong_index_pos_is_a_broadcast_error(model):
    wrong = ip.chunked_prefill(model, TOK, PROMPT, 8, 5)
    assert not wrong["ok"]
    assert "cannot broadcast [5, 10] to [1, 4, 5, 13]" in wrong["error"]
    assert not wrong["error_mentions_index_pos"]
    assert (wrong["mask_kv_len"], wrong["cache_kv_len"]) == (10, 13)
    right = ip.chunked_prefill(model, TOK, PROMPT, 8, 8)
    assert right["ok"] and right["error"] == ""
    model.clear_kv_cache()
    full = next_token(model, PROMPT, 0)
    assert right["next_token"] == TOK.decode([full])
    strict = ip.chunked_prefill(model, TOK, PROMPT, 8, 5, strict=True)
    assert "IndexPosError" in strict["error"] and strict["error_mentions_index_pos"]
    assert model.strict is False  # strict mode was temporary
    with pytest.raises(ValueError, match="split"):
        ip.chunked_prefill(model, TOK, PROMPT, 0, 0)


def test_clear_kv_cases(model):
    rows = ip.clear_kv_cases(model, TOK, PROMPT, PROMPT2, 4)
    assert len(rows) == 4
    assert [r["ok"] for r in rows] == [True, True, True, False]
    assert rows[1]["same_as_fresh"]  # index_pos 0 drops the old cache by itself
    cached = len(PROMPT) + 4 - 1
    assert rows[2]["index_pos"] == cached == rows[3]["index_pos"]
    kv = cached + len(PROMPT2)
    assert f"cannot broadcast [{len(PROMPT2)}, {kv}]" in rows[3]["error"]
    assert rows[3]["text"] == ""


# -- notebook 5 -------------------------------------------------------------


def test_rope_variants_build_silently(tiny_q8_path):
    models, rows = rope.load_variants(tiny_q8_path, form="f32")
    assert [r["from_gguf_ok"] for r in rows] == [True, True, True]
    by = {r["variant"]: r for r in rows}
    assert by["relabelled qwen2"]["rope"].startswith("rope (NEOX")
    assert by["file as is"]["rope"].startswith("rope_i")
    assert by["file as is"]["freq_base_used"] == 100000.0
    assert by["freq_base removed"]["freq_base_in_metadata"] is None
    assert by["freq_base removed"]["freq_base_used"] == 10000.0
    assert models["relabelled qwen2"].config.rope_is_neox


def test_relabelled_rope_changes_logits_but_not_position_0(tiny_q8_path):
    models, _ = rope.load_variants(tiny_q8_path, form="f32")
    ids = list(range(1, 33))
    rows, curves = rope.teacher_forced_rows(models, ids)
    assert [r["variant"] for r in rows] == ["relabelled qwen2", "freq_base removed"]
    for r in rows:
        assert r["max_abs_diff_pos0"] == 0.0  # angle 0 at position 0, whatever the convention
        assert r["max_abs_diff"] > 1e-3
        assert curves[r["variant"]]["max_abs_diff"].shape == (len(ids),)
    gen = rope.generation_rows(models, TOK, PROMPT, 5)
    assert gen[0]["first_token_unlike_file"] is None
    assert all(len(g["ids"]) == 5 for g in gen)


def test_context_limit(model):
    rows = rope.context_limit(model)
    assert [r["ok"] for r in rows] == [True, False, False]
    assert rows[0]["index_pos"] == MAX_SEQ_LEN - 1
    assert "narrow invalid args" in rows[1]["error"] and f"start: {MAX_SEQ_LEN}" in rows[1]["error"]
    assert model.kv_len == 0


# -- notebook 6 -------------------------------------------------------------


def test_drift_matrix_symmetric_zero_diagonal():
    rng = np.random.default_rng(0)
    logits = {n: rng.standard_normal((5, 11)).astype(np.float32) for n in "abc"}
    mx, mean = drift.drift_matrix(logits)
    for m in (mx, mean):
        v = m.to_numpy()
        assert np.array_equal(v, v.T) and np.all(np.diag(v) == 0)
        assert np.all(v[~np.eye(3, dtype=bool)] > 0)
    assert mx.loc["a", "b"] == np.abs(logits["a"] - logits["b"]).max()
    pairs = drift.long_pairs(mx, mean, variant="x")
    assert [(p["a"], p["b"]) for p in pairs] == [("a", "b"), ("a", "c"), ("b", "c")]


def test_nudge_wraps_every_qmatmul_and_restores(tiny_q8_path):
    src = drift.QlibSource(tiny_q8_path, "cpu", "f32")
    before = [q for _, _, q in drift.qmatmuls(src.model)]
    assert len(before) == 7 * len(src.model.layers) + 1
    ids = list(range(1, 17))
    plain = src.teacher_forced(ids)
    with drift.nudged(src.model) as stats:
        nudged = src.teacher_forced(ids)
    assert stats.calls == len(before)
    assert [q for _, _, q in drift.qmatmuls(src.model)] == before
    assert all(isinstance(q, QMatMul) for q in before)
    d = np.abs(nudged - plain)
    assert 0 < d.max() < 1e-4  # one ulp in float: float-sized drift
    assert np.array_equal(src.teacher_forced(ids), plain)


def test_nudge_counts_flipped_activation_codes(tiny_q8_path):
    src = drift.QlibSource(tiny_q8_path, "cpu", "quantized")
    ids = list(range(1, 17))
    with drift.nudged(src.model, count=True) as stats:
        src.teacher_forced(ids)
    assert stats.counted and stats.counted_values > 0
    assert 0 <= stats.codes_changed_share < 0.5


def test_qlib_source_greedy_matches_generate(tiny_path):
    src = drift.QlibSource(tiny_path, "cpu", "f32")
    assert src.name == "qlib cpu f32"
    ids, step0 = src.greedy(PROMPT, 5)
    src.model.clear_kv_cache()
    assert ids == generate(src.model, PROMPT, 5)
    assert int(step0.argmax()) == ids[0]
    tf = src.teacher_forced(PROMPT)
    np.testing.assert_allclose(tf[-1], step0, atol=1e-5)


def _run(name, logits, greedy, nudged=None):
    return drift.Run(name, logits, logits[-1], greedy, 0.1, nudged_logits=nudged)


def test_versus_reference_and_ulp_rows():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((6, 9)).astype(np.float32)
    q = ref + 0.5 * rng.standard_normal(ref.shape).astype(np.float32)
    runs = {
        drift.REFERENCE: _run(drift.REFERENCE, ref, [1, 2, 3, 4]),
        "qlib cpu quantized": _run("qlib cpu quantized", q, [1, 2, 5, 4], nudged=q + 0.25),
        "qlib cpu f32": _run("qlib cpu f32", ref + 1e-6, [1, 2, 3, 4], nudged=ref),
    }
    rows = {r["source"]: r for r in drift.versus_reference(runs, drift.REFERENCE, TOK)}
    assert set(rows) == {"qlib cpu quantized", "qlib cpu f32"}
    assert rows["qlib cpu quantized"]["first_diverging_token"] == 3  # counted from 1
    assert (rows["qlib cpu quantized"]["reference_token"], rows["qlib cpu quantized"]["token"]) == (
        "3",
        "5",
    )
    assert rows["qlib cpu f32"]["first_diverging_token"] is None
    assert rows["qlib cpu f32"]["argmax_agree"] == 6
    ulp = {r["comparison"]: r for r in drift.ulp_sensitivity(runs)}
    assert ulp["qlib cpu quantized: nudged by 1 ulp vs not"]["max_abs_diff"] == pytest.approx(0.25)
    assert "qlib cpu quantized vs qlib cpu f32" in ulp
    assert drift.position_drift(runs, drift.REFERENCE).shape == (6, 2)
    pairs = [("qlib cpu quantized", drift.REFERENCE), ("qlib cpu f32", "qlib cpu f32"),
             ("llama.cpp cpu", drift.REFERENCE)]  # fmt: skip
    (p0,) = drift.at_position(runs, pairs, 0, variant="Q4_1")  # same-source and absent: left out
    assert (p0["a"], p0["variant"], p0["position"]) == ("qlib cpu quantized", "Q4_1", 0)
    assert p0["max_abs_diff"] == pytest.approx(float(np.abs(q[0] - ref[0]).max()))


def test_variant_path_derives_once(tiny_path, tmp_path):
    with open(tiny_path, "rb") as f:
        src = Content.read(f)
    assert drift.main_type(src) == "F32"
    dst = drift.variant_path(tiny_path, "Q8_0", tmp_path)
    assert dst == tmp_path / "tiny.Q8_0.gguf"
    assert drift.variant_path(tiny_path, "F32", tmp_path) == tiny_path  # its own type
    with open(dst, "rb") as f:
        out = Content.read(f)
    assert drift.main_type(out) == "Q8_0"
    for name, info in out.tensor_infos.items():
        expected = "F32" if len(info.shape) == 1 else "Q8_0"
        assert info.dtype.name == expected and info.shape == src.tensor_infos[name].shape
    from qlib.convert.recipes import FILE_TYPES

    assert out.metadata.pop("general.file_type") == FILE_TYPES["Q8_0"]
    assert out.metadata.pop("general.quantization_version") == 2  # as llama.cpp writes
    assert out.metadata == src.metadata  # everything else copied (tokenizer, template, ...)
    mtime = dst.stat().st_mtime_ns
    drift.variant_path(tiny_path, "Q8_0", tmp_path)  # cached
    assert dst.stat().st_mtime_ns == mtime
    # the derived file runs, close to the float original
    a = drift.QlibSource(tiny_path, "cpu", "f32").teacher_forced(PROMPT)
    b = drift.QlibSource(dst, "cpu", "f32").teacher_forced(PROMPT)
    assert 0 < np.abs(a - b).max() < 0.5


def test_source_specs_without_gpu(tiny_path):
    specs, skipped = drift.source_specs(tiny_path, None, llama_cpp=False, transformers=False)
    assert [s.name for s in specs] == ["qlib cpu quantized", "qlib cpu f32"]
    assert all(s.nudge for s in specs)
    parts = [p for p, _ in skipped]
    assert drift.REFERENCE in parts and "llama.cpp cpu" in parts
    assert any("GPU" in p for p in parts)


def test_run_sources_reports_failures(tiny_path):
    def broken():
        raise NotImplementedError("no kernel here")

    specs = [
        drift.SourceSpec("qlib cpu f32", lambda: drift.QlibSource(tiny_path, "cpu", "f32")),
        drift.SourceSpec("broken", broken),
    ]
    runs, failed = drift.run_sources(specs, [1, 2, 3, 4], PROMPT, 3, log=lambda s: None)
    assert list(runs) == ["qlib cpu f32"]
    assert failed == [("broken", "NotImplementedError: no kernel here")]
    assert runs["qlib cpu f32"].logits.shape == (4, 256)
    assert torch.get_num_threads() >= 1
