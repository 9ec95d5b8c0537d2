"""The benchmark harness's own measurements."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from qlib.suite.bench import peak_rss_mb, run_in_subprocess


@pytest.mark.skipif(sys.platform != "linux", reason="VmHWM is Linux's")
def test_peak_rss_is_the_configurations_own():
    """A configuration started from a big process reports its own peak, not the parent's
    (Linux's ru_maxrss keeps the parent's peak across fork + exec)."""
    big = np.ones(1_500_000_000, dtype=np.uint8)  # 1.5 GB held by this process
    parent = peak_rss_mb()
    r = run_in_subprocess(["--steps", "2", "--reps", "1", "--prompt-tokens", "8"])
    assert "error" not in r, r
    # with the parent's peak the child would report >= parent; its own is far below
    assert r["peak_rss_mb"] < parent - big.nbytes / 2**21, (r["peak_rss_mb"], parent)
    del big
    # the model's own share: the peak above the RSS the child had before loading it (its
    # imports); it holds the weights, so more than half the file's size (a loose bound)
    from qlib import models
    from qlib.cli.bench import markdown

    added = r["peak_rss_mb"] - r["rss_before_load_mb"]
    assert 0 < r["rss_before_load_mb"] < r["peak_rss_mb"]
    assert added > models.path().stat().st_size / 2**20 / 2, added
    assert f"peak RSS above the RSS before loading the model: qlib {added:.0f} MB" in markdown([r])


def test_variant_names_the_engine_options():
    """The bench table's variant column: the fast engine's prefill, KV type and a non-default
    CUDA decode; the faithful form; a peer's version and cache."""
    from qlib.cli.bench import variant

    fast = {"runtime": "qlib", "engine": "fast", "prefill": "int8", "kv_type": "f32"}
    assert variant({**fast, "decode": "fused"}) == "fast (int8 prefill)"
    assert variant({**fast, "kv_type": "f16"}) == "fast (int8 prefill, f16 KV)"
    assert variant({**fast, "decode": "merged"}) == "fast (int8 prefill, merged decode)"
    assert variant({**fast, "decode": "persistent"}) == "fast (int8 prefill, persistent decode)"
    assert variant({"runtime": "qlib", "form": "quantized"}) == "faithful quantized"
    assert variant({"runtime": "llama.cpp", "version": "0.3.36", "kv_type": "f16"}) == (
        "v0.3.36, f16 KV"
    )


def test_auto_decode_note_in_the_table():
    """The fast CUDA engine's ``decode="auto"`` choice and its reason follow the table; a
    decode given on the command line ("as asked") and the CPU engine (no note) add nothing."""
    from qlib.cli.bench import decode_notes

    why = "the persistent kernel is tuned for models up to 768 wide, not 2048"
    r = {"runtime": "qlib", "engine": "fast", "decode": "fused"}
    assert decode_notes([r | {"decode_note": why}]) == [f"qlib decode: fused: {why}"]
    assert decode_notes([r | {"decode_note": "as asked"}, r | {"decode_note": None}, r]) == []


def test_several_contexts_run_in_one_process():
    """``--context 8,16``: both points measured in one process (a curve, the first point's
    statistics at the top), two rows each, and their decode ratio in the table's notes."""
    from qlib.cli.bench import markdown, rows

    r = run_in_subprocess(["--context", "8,16", "--steps", "2", "--reps", "2", "-t", "1"])
    assert "error" not in r, r
    assert [p["context"] for p in r["curve"]] == [8, 16]
    assert r["prefill_ms"] == r["curve"][0]["prefill_ms"] and r["context"] == 8
    for p in r["curve"]:
        assert len(p["runs"]) == 2 and p["decode_ms_per_token"]["min"] > 0
    assert [rw["test"] for rw in rows([r])] == ["pp8", "tg2 @ d8", "pp16", "tg2 @ d16"]
    ratio = (
        r["curve"][1]["decode_ms_per_token"]["min"] / r["curve"][0]["decode_ms_per_token"]["min"]
    )
    assert f"d16 / d8 x{ratio:.3f}" in markdown([r])


def test_decode_against_its_bytes_floor():
    """qlib's result carries its decode's bytes floor: the file's matmul weights and the f32 KV
    cache at the timed steps' mean position (here 8 prompt tokens + 4 / 2), over the memory
    rate measured after the runs (after the peak RSS was read: the read pass's buffer is not
    counted); the table's notes give the ratio; ``--no-floor`` leaves it out; rounds keep the
    most demanding floor."""
    from qlib import models
    from qlib.cli.bench import markdown
    from qlib.gguf import Content
    from qlib.suite.bench import merge_rounds

    r = run_in_subprocess(["--steps", "4", "--reps", "1", "--prompt-tokens", "8", "-t", "1"])
    assert "error" not in r, r
    with open(models.path(), "rb") as f:
        content = Content.read(f)
    infos, md = content.tensor_infos, content.metadata
    weights = sum(i.nbytes for n, i in infos.items() if n.startswith("blk.") and len(i.shape) == 2)
    weights += infos.get("output.weight", infos["token_embd.weight"]).nbytes
    head_dim = md["llama.embedding_length"] // md["llama.attention.head_count"]
    kv = 2 * md["llama.block_count"] * md["llama.attention.head_count_kv"] * head_dim * 4 * 10
    f = r["floor"]
    assert f["bytes"] == weights + kv and f["read_gbs"] > 0
    assert f["ms"] == pytest.approx(f["bytes"] / (f["read_gbs"] * 1e9) * 1e3)
    ratio = r["decode_ms_per_token"]["median"] / f["ms"]
    assert f"qlib decode: {ratio:.2f}x its bytes floor" in markdown([r])
    faster = {**r, "floor": {**f, "ms": f["ms"] / 2}}
    assert merge_rounds([r, faster])["floor"]["ms"] == f["ms"] / 2
    plain = run_in_subprocess(["--steps", "4", "--reps", "1", "--prompt-tokens", "8", "-t", "1",
                               "--no-floor"])  # fmt: skip
    assert "error" not in plain and "floor" not in plain
    assert "bytes floor" not in markdown([plain])
    # the read pass's 256 MiB are not in the peak (read before it): the same as without
    assert abs(r["peak_rss_mb"] - plain["peak_rss_mb"]) < 128, (r["peak_rss_mb"], plain)


def _result(prefill: list[float], decode: list[float], rss: float, load: float) -> dict:
    pairs = zip(prefill, decode, strict=True)
    runs = [{"prefill_ms": p, "decode_ms_per_token": d} for p, d in pairs]
    return {"runtime": "qlib", "prompt_tokens": 8, "peak_rss_mb": rss, "load_ms": load,
            "first_run": {"prefill_ms": 99.0, "decode_ms_per_token": 9.0}, "runs": runs,
            "prefill_ms": {"min": min(prefill)},
            "decode_ms_per_token": {"min": min(decode)}}  # fmt: skip


def test_rounds_pool_their_runs():
    """``--rounds``: a runtime's rounds become one result over all their timed runs, with the
    first round's untimed run, the largest peak RSS and the shortest load; a failed round is
    the result."""
    from qlib.suite.bench import merge_rounds

    a = _result([10.0, 12.0], [2.0, 3.0], rss=500, load=40)
    b = _result([8.0, 14.0], [4.0, 2.5], rss=520, load=30)
    m = merge_rounds([a, b])
    assert m["prefill_ms"] == {"min": 8.0, "median": 11.0}
    assert m["decode_ms_per_token"] == {"min": 2.0, "median": 2.75}
    assert len(m["runs"]) == 4 and m["rounds"] == 2 and m["first_run"] == a["first_run"]
    assert (m["peak_rss_mb"], m["load_ms"]) == (520, 30)
    assert m["decode_tok_s"]["max"] == 500.0 and m["prefill_tok_s"]["max"] == 1000.0
    assert merge_rounds([a]) is a
    failed = {"error": "boom", "argv": []}
    assert merge_rounds([a, failed]) is failed


def test_peers_by_name(capsys):
    """``--peers llama.cpp --rounds 2``: only that peer, qlib and it alternating in two rounds,
    the pooled ratio and each round's own in the notes; an unknown name is refused."""
    import importlib.util

    from qlib.__main__ import main

    with pytest.raises(SystemExit) as bad:
        main(["bench", "--peers", "vllm"])
    assert bad.value.code == 2 and "unknown peer vllm" in capsys.readouterr().err
    assert main(["bench", "--rounds", "2"]) != 0
    assert "--rounds alternates qlib with its peers" in capsys.readouterr().err
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (the peers extra) is not installed")
    argv = ["bench", "--peers", "llama.cpp", "--rounds", "2", "--steps", "2", "--reps", "1",
            "--prompt-tokens", "8", "-t", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    import json

    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [p["runtime"] for p in out["peers"]] == ["llama.cpp"]
    assert out["qlib"]["rounds"] == 2 and len(out["qlib"]["runs"]) == 2
    ratio = out["ratios"]["llama.cpp"]
    assert len(ratio["rounds"]["decode"]) == 2
    assert ratio["decode"] == pytest.approx(
        out["qlib"]["decode_ms_per_token"]["min"] / out["peers"][0]["decode_ms_per_token"]["min"]
    )
