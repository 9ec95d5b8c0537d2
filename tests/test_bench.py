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
