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
