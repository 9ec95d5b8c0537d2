"""Reproducible runs: same parameters and seed -> same text and tables, timing columns aside.

Which columns are timing columns is not chosen here: ``ResultWriter.save_table``
records them in the table's meta entry (``qlib.suite.results.is_timing_column`` by name,
plus any the notebook declares), and ``qlib.suite.results.comparable`` leaves them out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qlib import models
from qlib.cli import main
from qlib.generate import LogitsProcessor, generate
from qlib.suite.machine import git_commit
from qlib.suite.results import ResultWriter, comparable, is_timing_column, timing_columns

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


def _model_path() -> str:
    try:
        return str(models.path())
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


def test_timing_columns_by_name():
    timing = ["prefill_ms", "decode_ms_median", "time_s", "tok_s", "gbps_gguf", "seconds"]
    timing += ["ctx 32, cat + naive (µs)", "us_per_row", "ms", "load_1min", "first_decode_ms"]
    other = ["tokens", "text", "max_abs_diff", "decode_steps", "loads", "weight_mb", "round"]
    other += ["step0_max_abs_diff", "bytes_per_read", "argmax_agree_share", "device"]
    assert [c for c in timing if not is_timing_column(c)] == []
    assert [c for c in other if is_timing_column(c)] == []
    assert timing_columns(["tokens", "ms", "ratio"], ["ratio"]) == ["ms", "ratio"]
    assert timing_columns(["a", "b"], True) == ["a", "b"]
    with pytest.raises(ValueError, match="not in the table"):
        timing_columns(["a"], ["b"])


def _fake_run(out: Path, ms: float, text: str, ratio: float) -> Path:
    w = ResultWriter("99_fake", params={"device": "cpu", "seed": 0}, output_dir=out)
    rows = [dict(step=1, text=text, prefill_ms=ms, speedup=ratio)]
    w.save_table(rows, "gen", key=True, timing=["speedup"])
    w.save_json({"ids": [1, 2]}, "ids")
    w.save_json({"ms": ms}, "raw_times", timing=True)
    w.finding("f", "prefill took {ms} ms", table="gen", ms=ms)
    return w.dir


def test_comparable_leaves_out_timing_columns_only(tmp_path):
    a = _fake_run(tmp_path / "a", 1.5, "Rust is", 2.0)
    meta = json.loads((a / "meta_cpu.json").read_text())
    assert meta["tables"][0]["timing_columns"] == ["prefill_ms", "speedup"]
    assert meta["files"] == [
        {"stem": "ids", "json": "ids_cpu.json", "timing": False},
        {"stem": "raw_times", "json": "raw_times_cpu.json", "timing": True},
    ]
    same = comparable(_fake_run(tmp_path / "b", 9.25, "Rust is", 3.0))
    assert comparable(a) == same
    assert comparable(a)["tables"]["gen"] == {
        "columns": ["step", "text"],
        "rows": [{"step": 1, "text": "Rust is"}],
    }
    assert comparable(_fake_run(tmp_path / "c", 1.5, "Rust was", 2.0)) != same


def test_sampling_is_seeded(request):
    """Temperature sampling draws from a seeded generator: same seed, same tokens."""
    import torch

    from qlib.llama.engine import load

    model, _ = load(_model_path(), "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a shared 2-core machine: ten times slower
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    prompt = [1, 504, 314, 253]

    def sample(seed: int) -> list[int]:
        model.clear_kv_cache()
        return generate(model, prompt, 12, LogitsProcessor(seed, temperature=1.5, top_p=0.95))

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first  # the seed is what decides
    model.clear_kv_cache()
    assert generate(model, prompt, 4) == generate(model, prompt, 4, LogitsProcessor(1))  # greedy


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Notebook 01 (read, build, prefill and decode the real model) run twice, same parameters."""
    _model_path()
    nbdir = tmp_path_factory.mktemp("nb")
    shutil.copy(NOTEBOOKS / "01_generate_one_token.ipynb", nbdir)
    outs = []
    for run in ("a", "b"):
        out = tmp_path_factory.mktemp(f"run_{run}")
        argv = ["suite", "run", "-q", "--notebooks", str(nbdir), "--output-dir", str(out)]
        assert main([*argv, "-p", "steps", "6", "-p", "rounds", "1", "-p", "seed", "3"]) == 0
        outs.append(out)
    return outs


def test_two_runs_give_the_same_results(two_runs):
    a, b = (out / "01_generate_one_token" for out in two_runs)
    ra, rb = comparable(a), comparable(b)
    assert ra == rb
    texts = ra["tables"]["text"]["rows"]
    assert len(texts) == 1 and texts[0]["tokens"] == 7 and texts[0]["text"].strip()
    meta = json.loads((a / "meta_cpu.json").read_text())
    assert meta["params"]["seed"] == 3 and meta["params"]["steps"] == 6
    timed = {t["stem"]: t["timing_columns"] for t in meta["tables"]}
    assert {"read_buffered_ms", "prefill_ms", "decode_mean_ms", "load_1min"} <= set(timed["rounds"])
    assert timed["text"] == [] and timed["decode_steps"] == ["ms"]
    # what was left out did vary: the comparison is not trivially equal
    rows_a = json.loads((a / "rounds_cpu.json").read_text())
    rows_b = json.loads((b / "rounds_cpu.json").read_text())
    assert rows_a != rows_b


def test_every_result_carries_provenance(two_runs):
    git = git_commit()
    metas = [p for out in two_runs for p in out.rglob("meta_*.json")]
    statuses = [p for out in two_runs for p in out.rglob("status_*.json")]
    assert metas and len(statuses) == len(metas)
    for p in metas:
        meta = json.loads(p.read_text())
        m = meta["machine"]
        assert m["cpu"] and m["logical_cores"] and m["os"] and m["python"]
        assert m["packages"]["torch"] and m["packages"]["numpy"]
        if git is not None:
            assert m["git"]["commit"] == git["commit"]
        assert meta["params"] and meta["run_id"] and meta["started"]
        # every saved file is listed in the meta that carries the provenance
        listed = {
            e.get(k)
            for kind in ("tables", "plots", "files")
            for e in meta[kind]
            for k in ("csv", "json", "png", "svg")
        }
        saved = {f.name for f in p.parent.iterdir()} - {p.name, "status_cpu.json"}
        assert saved <= listed
    for p in statuses:
        st = json.loads(p.read_text())
        assert st["ok"] and st["notebook_sha256"] and st["parameters"]["seed"] == 3
        if git is not None:
            assert st["code"]["commit"] == git["commit"]
