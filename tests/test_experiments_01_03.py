"""Experiment modules of notebooks 1-3 on a tiny synthetic llama (fast, CPU only)."""

from __future__ import annotations

import pytest
import torch
from synthetic import write_tiny_llama

from qlib.llama.engine import load
from qlib.llama.faithful import ModelWeights
from qlib.suite.experiments import common, phases, span_study, throughput

N_LAYER, N_HEAD, N_KV, N_EMBD = 3, 4, 2, 64
PROMPT = [3, 1, 4, 1, 5]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("exp") / "tiny.gguf"
    return write_tiny_llama(path, n_layer=N_LAYER, n_head=N_HEAD, n_kv_head=N_KV, n_embd=N_EMBD)


@pytest.fixture()
def model(tiny_path) -> ModelWeights:
    return load(tiny_path, "cpu")[0]


# -- notebook 1 -------------------------------------------------------------------------


def test_rounds_time_every_phase(tiny_path):
    rounds = phases.run_rounds(tiny_path, PROMPT, steps=4, rounds=2)
    rows = [r.row() for r in rounds]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert r["decode_steps"] == 4
        for phase in ("read_unbuffered_ms", "read_buffered_ms", "build_ms", "prefill_ms"):
            assert r[phase] > 0
    assert rounds[0].ids == rounds[1].ids  # greedy: the same tokens every round
    assert len(rounds[0].ids) == 5  # prefill token + 4 decode steps
    steps = phases.step_rows(rounds)
    assert len(steps) == 8 and steps[0]["step"] == 1
    fl = phases.first_vs_later(rows, "build_ms")
    assert fl["ratio"] == pytest.approx(fl["first"] / fl["later"])


def test_header_reads_are_many_small_ones(tiny_path):
    info = phases.header_reads(tiny_path)
    assert info["tensors"] == 2 + 9 * N_LAYER
    assert info["reads"] > info["metadata_keys"] * 2  # key length, key, type, value...
    _, ms = phases.read_header(tiny_path, buffered=False)
    assert ms > 0


class ChatStub:
    chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}...{% endfor %}"

    def encode(self, text, add_special_tokens=False):
        assert not add_special_tokens  # no BOS: the template writes its own specials
        return list(text.encode())

    def chat_prompt(self, text):
        return "SYSTEM " + text


def test_chat_ids_user_turn_alone_on_chatml():
    """system=False (notebooks 1, 2 by default): the seed's user turn alone on ChatML."""
    ids = common.chat_ids(ChatStub(), "What is Rust?", system=False)
    assert bytes(ids).decode().startswith("<|im_start|>user\nWhat is Rust?<|im_end|>")
    other = ChatStub()
    other.chat_template = "[INST] {{ messages[0].content }} [/INST]"  # not ChatML
    assert bytes(common.chat_ids(other, "x", system=False)).decode() == "SYSTEM x"


def test_chat_ids_default_renders_the_template():
    """The default (notebooks 4-6): the template as is, with its default system message."""
    assert bytes(common.chat_ids(ChatStub(), "x")).decode() == "SYSTEM x"
    assert common.chat_ids(ChatStub(), "x") == common.chat_ids(ChatStub(), "x", system=True)


# -- notebook 2 -------------------------------------------------------------------------


def test_span_counts_equal_the_structure(model):
    expected = span_study.expected_counts(model.config)
    assert expected["qmatmul"] == 7 * N_LAYER + 1 and expected["rms-norm"] == 2 * N_LAYER + 1
    prefill, decode = span_study.profile_spans(model, PROMPT, decode_step=3, warmup=1)
    assert (prefill.seq_len, prefill.index_pos) == (len(PROMPT), 0)
    assert (decode.seq_len, decode.index_pos) == (1, len(PROMPT) + 2)
    for prof in (prefill, decode):
        check = span_study.check_counts(prof.rows, expected)
        assert all(r["ok"] for r in check), check
        assert {r["name"] for r in prof.rows} == set(span_study.SPAN_NAMES)
        assert prof.wall_ms > 0
        model_row = next(r for r in prof.rows if r["name"] == "model")
        assert sum(r["self_ms"] for r in prof.rows) == pytest.approx(model_row["total_ms"])


def test_check_counts_flags_a_mismatch():
    rows = [{"name": "qmatmul", "count": 3}, {"name": "extra", "count": 1}]
    check = {r["name"]: r for r in span_study.check_counts(rows, {"qmatmul": 4})}
    assert not check["qmatmul"]["ok"] and not check["extra"]["ok"]


@pytest.mark.parametrize("seq_len", [1, 3])
def test_replay_variants_agree_and_list_every_op(seq_len):
    outs, names = {}, {}
    for cache in ("cat", "prealloc"):
        for attention in ("naive", "sdpa", "fold"):
            replay = span_study.AttentionReplay(
                N_HEAD, N_KV, 16, 8, seq_len=seq_len, cache=cache, attention=attention
            )
            outs[cache, attention] = replay.output()
            rows = replay.run(reps=3, warmup=1)
            names[cache, attention] = [(r["op"], r["in_forward"]) for r in rows]
            assert all(r["mean_us"] >= r["min_us"] > 0 for r in rows)
    ref = outs["cat", "naive"]
    assert ref.shape == (1, seq_len, N_HEAD * 16)
    for out in outs.values():
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert names["cat", "naive"] == [
        ("cat k", True),
        ("cat v", True),
        ("repeat_kv k", True),
        ("repeat_kv v", True),
        ("q @ k^T", True),
        ("scale", True),
        ("mask (where)", seq_len > 1),  # no mask on a decode step, as in forward
        ("softmax", True),
        ("att @ v", True),
        ("transpose, reshape", True),
    ]
    assert names["prealloc", "fold"][-2][0] == "sdpa (folded gqa)"
    assert [n for n, _ in names["prealloc", "sdpa"]] == [
        "write k",
        "write v",
        "narrow k, v",
        "sdpa (gqa)",
        "transpose, reshape",
    ]


def test_replay_totals_skip_ops_outside_the_forward():
    replay = span_study.AttentionReplay(N_HEAD, N_KV, 16, 8)
    rows = replay.run(reps=2, warmup=0)
    (total,) = span_study.replay_totals(rows)
    assert total["total_us"] == pytest.approx(
        sum(r["mean_us"] for r in rows if r["op"] != "mask (where)")
    )


def test_forward_times_threads_and_enqueue(model):
    times = span_study.with_threads(1, lambda: span_study.forward_times(model, PROMPT, 8, reps=2))
    assert times["decode_context"] == 8 and times["prefill_min_ms"] > 0
    assert span_study.thread_counts(1) == [1, 2]
    assert span_study.thread_counts(8) == [1, 2, 4, 8]
    assert span_study.thread_counts(6) == [1, 2, 4, 6]
    rows = span_study.enqueue_vs_sync(model, PROMPT, 8, reps=2)
    assert [r["pass"] for r in rows] == ["prefill", "decode at 8"]
    assert all(r["at_return_ms"] <= r["after_sync_ms"] for r in rows)


# -- notebook 3 -------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "fold", "naive"])
def test_preallocated_cache_gives_the_engines_logits(model, attention):
    ids = [7, 8, 9, 10, 11, 12]

    def logits() -> list[torch.Tensor]:
        with torch.inference_mode():
            out = [model.forward(torch.tensor([ids[:4]]), 0)]
            out += [model.forward(torch.tensor([[t]]), 4 + i) for i, t in enumerate(ids[4:])]
        return out

    reference = logits()
    with throughput.decode_variant(model, "prealloc", attention, max_len=16):
        assert (model.kv_cache_mode, model.max_seq_len, model.attention) == (
            "static",
            16,
            attention,
        )
        static = logits()
        assert model.kv_len == len(ids)
        assert model.layers[0].kv_buffers[0].shape[2] == 16
    for a, b in zip(reference, static, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (model.kv_cache_mode, model.attention, model.kv_len) == ("cat", "auto", 0)
    with pytest.raises(ValueError, match="attention must be one of"):
        with throughput.decode_variant(model, "prealloc", "flash"):
            pass
    with pytest.raises(ValueError, match="cache must be"):
        with throughput.decode_variant(model, "ring", "naive"):
            pass


@pytest.mark.parametrize("kv_cache", ["cat", "static"])
def test_kv_snapshot_restores_the_cache(tiny_path, kv_cache):
    """One snapshot/restore pair for both caches: a static one's views are copied."""
    model, _ = load(tiny_path, "cpu", kv_cache=kv_cache)
    ids = list(range(5, 20))
    with torch.inference_mode():
        model.forward(torch.tensor([ids[:10]]), 0)
        snap = common.snapshot_kv(model)
        expected = model.forward(torch.tensor([[ids[10]]]), 10)
        model.forward(torch.tensor([ids[3:14]]), 0)  # another sequence overwrites the cache
        common.restore_kv(model, snap)
        assert model.kv_len == 10
        again = model.forward(torch.tensor([[ids[10]]]), 10)
        common.restore_kv(model, snap, 6)  # the first 6 positions: a prefill of ids[:6]
        assert model.kv_len == 6
        cut = model.forward(torch.tensor([[ids[6]]]), 6)
        model.forward(torch.tensor([ids[:6]]), 0)
        prefilled = model.forward(torch.tensor([[ids[6]]]), 6)
    assert torch.equal(again, expected)
    torch.testing.assert_close(cut, prefilled, atol=1e-5, rtol=1e-5)


def test_teacher_forced_logits_are_every_position(model):
    ids = list(range(3, 12))
    model.forward(torch.tensor([[1, 2]]), 0)
    tf = common.teacher_forced_logits(model, ids)
    assert tf.shape == (len(ids), model.vocab_size) and tf.dtype == torch.float32
    assert model.kv_len == 0  # empty before and after
    with torch.inference_mode():
        last = model.forward(torch.tensor([ids]), 0)[0]
    torch.testing.assert_close(tf[-1], last, atol=1e-5, rtol=1e-5)


def test_throughput_rows_have_the_right_shape(model):
    ids = list(range(2, 40))
    pre = throughput.prefill_throughput(model, ids, sizes=(1, 4, 16), reps=1)
    assert [r["T"] for r in pre] == [1, 4, 16]
    assert all(r["tok_s"] == pytest.approx(r["T"] / r["min_ms"] * 1e3) for r in pre)
    rows = throughput.decode_comparison(model, ids, contexts=(4, 16), steps={4: 3, 16: 2}, reps=1)
    assert len(rows) == 2 * len(throughput.DECODE_VARIANTS)
    assert {(r["cache"], r["attention"]) for r in rows} == set(throughput.DECODE_VARIANTS)
    assert [(r["context"], r["steps"]) for r in rows[:2]] == [(4, 3), (16, 2)]
    assert all(r["ms_per_token"] > 0 for r in rows)
    assert model.attention == "auto" and model.kv_len == 0
    assert model.kv_cache_mode == "cat" and model.max_seq_len is None
    core = throughput.attention_core_by_context(model, contexts=(4, 16), reps=2)
    assert len(core) == 6
    assert all(r["all_layers_ms"] == pytest.approx(r["layer_us"] * N_LAYER / 1e3) for r in core)


def test_long_context_configs_cover_each_cache_type():
    """Notebook 03's long-context runtimes: each KV type on both devices, with the default and
    the fastest prefill (CUDA bf16, CPU int8-attn), llama.cpp last when installed; every argv
    flag-value pairs."""
    cpu = throughput.long_context_configs("cpu", ("f32", "f16"), llama_cpp=True)
    assert [label for label, _ in cpu] == [
        "qlib fast cpu, f32 KV", "qlib fast cpu, f16 KV",
        "qlib fast cpu, f32 KV, int8-attn prefill", "qlib fast cpu, f16 KV, int8-attn prefill",
        "llama.cpp cpu, f16 KV"]  # fmt: skip
    assert cpu[3][1][-2:] == ["--prefill", "int8-attn"]
    cuda = throughput.long_context_configs("cuda", ("f32", "f16"), llama_cpp=False)
    flags = [dict(zip(argv[::2], argv[1::2], strict=True)) for _, argv in cuda]
    assert {(f["--kv-type"], f.get("--prefill")) for f in flags} == {
        ("f32", None), ("f16", None), ("f32", "bf16"), ("f16", "bf16")}  # fmt: skip
    assert all(f["--device"] == "cuda" and f["--engine"] == "fast" for f in flags)


def test_long_context_points_carry_their_own_memory_rate(tiny_path, monkeypatch):
    """Each point of the long-context curve takes the higher of the read passes just before and
    just after it (one pass between two points serves both), so that its floor is of its own
    minute. The bench process is stubbed: the rows' rates and bytes are checked, not timings."""
    from qlib.suite import bench

    rates = iter([50e9, 60e9, 55e9, 48e9, 50e9])  # bytes/s: before point 1, after each point
    monkeypatch.setattr(common, "copy_bandwidth", lambda *a, **k: next(rates))
    argvs = []

    def fake_bench(argv):
        argvs.append(argv)
        return {"prefill_ms": {"min": 1.0}, "decode_ms_per_token": {"min": 2.0, "median": 2.5},
                "peak_rss_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(bench, "run_in_subprocess", fake_bench)
    configs = [("f32", ["--kv-type", "f32"]), ("f16", ["--kv-type", "f16"])]
    rows = throughput.long_context_curve(
        str(tiny_path), [8, 16], steps=2, reps=1, threads=1, configs=configs, progress=False
    )
    assert [(r["context"], r["runtime"]) for r in rows] == [
        (8, "f32"), (8, "f16"), (16, "f32"), (16, "f16")]  # fmt: skip
    assert [r["read_gbs"] for r in rows] == [60.0, 60.0, 55.0, 50.0]
    assert [r["attempts"] for r in rows] == [1, 1, 1, 1]
    assert rows[0]["kv_bytes"] == 2 * rows[1]["kv_bytes"] == rows[3]["kv_bytes"]
    assert all("--context" in a and "--no-floor" in a for a in argvs)


def test_a_long_context_point_across_a_change_of_memory_speed_is_measured_again(
        tiny_path, monkeypatch):  # fmt: skip
    """A point whose read passes before and after differ by more than ``MEMORY_STEADY`` (the
    memory changed speed while it ran) is run again, up to ``LONG_CONTEXT_ATTEMPTS`` times, and
    the last attempt is kept with its own passes."""
    from qlib.suite import bench

    # point 1: 30 -> 60 (unsteady), 60 -> 58 (steady: kept); point 2: 58 -> 20 -> 40 -> 25
    # (never steady: the third attempt is kept)
    rates = iter([30e9, 60e9, 58e9, 20e9, 40e9, 25e9])
    monkeypatch.setattr(common, "copy_bandwidth", lambda *a, **k: next(rates))
    decode = iter([9.0, 4.0, 8.0, 5.0, 7.0])  # each run's decode ms/token

    def fake_bench(argv):
        return {"prefill_ms": {"min": 1.0}, "decode_ms_per_token": {"min": next(decode),
                "median": 1.0}, "peak_rss_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(bench, "run_in_subprocess", fake_bench)
    rows = throughput.long_context_curve(str(tiny_path), [8, 16], steps=2, reps=1, threads=1,
                                         configs=[("f32", ["--kv-type", "f32"])],
                                         progress=False)  # fmt: skip
    assert throughput.MEMORY_STEADY == 1.25 and throughput.LONG_CONTEXT_ATTEMPTS == 3
    assert [(r["attempts"], r["read_gbs"], r["decode_ms"]) for r in rows] == [
        (2, 60.0, 4.0), (3, 40.0, 7.0)]  # fmt: skip


@pytest.mark.parametrize("cache, attention", throughput.DECODE_VARIANTS)
def test_a_sliced_snapshot_is_a_prefill_of_the_context(model, cache, attention):
    ids = list(range(5, 25))
    snap, ms = throughput.prefill_snapshot(model, ids)
    assert ms > 0 and model.kv_len == 0
    with torch.inference_mode():
        model.forward(torch.tensor([ids[:7]]), 0)
        expected = model.forward(torch.tensor([[ids[7]]]), 7)
        with throughput.decode_variant(model, cache, attention, max_len=32):
            common.restore_kv(model, snap, 7)
            assert model.kv_len == 7
            got = model.forward(torch.tensor([[ids[7]]]), 7)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_text_agreement_names_the_first_differing_token():
    def rnd(dev, i, ids):
        return phases.Round(dev, i, 1.0, 1.0, 1.0, phases.Timings(), ids)

    rounds = [rnd("cpu", 1, [1, 2, 3]), rnd("cpu", 2, [1, 2, 3]), rnd("cuda", 1, [1, 2, 4])]
    agree = phases.text_agreement(rounds)
    assert agree == {"same_within_device": True, "first_difference": {"cpu": None, "cuda": 2}}
    rounds.append(rnd("cuda", 2, [9]))
    assert not phases.text_agreement(rounds)["same_within_device"]
