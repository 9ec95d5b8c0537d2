"""Parameter sweeps: grids, point folders, the local and Dask executors, the host rule, resume.

The Dask tests start a real ``distributed.LocalCluster`` (processes, two workers) on
made-up notebooks, and one on notebook 04 with a short grid.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from qlib import models
from qlib.cli import main
from qlib.suite.hostslot import host_slot, is_timing
from qlib.suite.params import combine, load_params_file, parse_grid, split_values
from qlib.suite.sweep import plan, point_id

REPO = Path(__file__).resolve().parent.parent
CODE = {"commit": "abc1234", "dirty": False, "diff": None}  # the code_version of these runs

# -- grids, parameter files, point ids -------------------------------------------


def test_parse_grid():
    assert parse_grid("steps=4,6") == ("steps", [4, 6])
    assert parse_grid("form=quantized,f32,None") == ("form", ["quantized", "f32", None])
    assert parse_grid("variants=[Q4_1],[Q8_0, Q5_0]") == ("variants", [["Q4_1"], ["Q8_0", "Q5_0"]])
    assert parse_grid("prompt=\"a, b\",c,'7'") == ("prompt", ["a, b", "c", "7"])
    assert split_values('{"a": 1, "b": 2},x') == ['{"a": 1, "b": 2}', "x"]
    for bad in ("steps", "=4,6", "2x=1", "steps=4,,6"):
        with pytest.raises(ValueError):
            parse_grid(bad)


def test_params_file_and_precedence(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("n: 3\nlabel: from file\nsizes: [1, 2]\ngrid:\n  form: [quantized, f32]\n  m: 5\n")
    fixed, grid = load_params_file(f)
    assert fixed == {"n": 3, "label": "from file", "sizes": [1, 2]}  # a list stays a value
    assert grid == {"form": ["quantized", "f32"], "m": [5]}
    # the command line wins, name by name: -p replaces an axis, --grid a fixed value
    fixed2, grid2 = combine(fixed, grid, {"form": "f16"}, {"n": [1, 2]})
    assert fixed2 == {"label": "from file", "sizes": [1, 2], "form": "f16"}
    assert grid2 == {"m": [5], "n": [1, 2]}
    with pytest.raises(ValueError, match="both -p and --grid"):
        combine({}, {}, {"n": 1}, {"n": [2]})
    f.write_text("n: 1\ngrid:\n  n: [1, 2]\n")
    with pytest.raises(ValueError, match="both fixed and under"):
        load_params_file(f)
    f.write_text("grid:\n  n: [1, 1]\n")
    with pytest.raises(ValueError, match="repeats"):
        load_params_file(f)


def test_point_ids_name_the_point_and_never_collide():
    assert point_id({"steps": 4}) == "steps=4"
    assert point_id({"form": "f32", "steps": 4}) == "form=f32,steps=4"
    assert point_id({"form": None}) == "form=None"
    # values that do not read back from their text get a hash: no two points share a folder
    as_text, as_int = point_id({"n": "4"}), point_id({"n": 4})
    assert as_text != as_int and as_text.startswith("n=4~")
    a = point_id({"model_path": "/a/x.gguf"})
    b = point_id({"model_path": "/b/x.gguf"})
    assert a.startswith("model_path=x.gguf~") and a != b
    assert point_id({"variants": ["Q4_1", "Q8_0"]}).startswith("variants=Q4_1+Q8_0~")
    long = point_id({"prompt": "x" * 300})
    assert len(long) < 120 and "~" in long
    assert point_id({"steps": 4}) == point_id({"steps": 4})  # stable: --resume finds it


# -- made-up notebooks -----------------------------------------------------------

# records when it ran (wall clock), to check that a timing point ran alone
WHEN = """
import json, os, time
t0 = time.time()
time.sleep(0.5)
folder = os.path.join(os.environ["QLIB_RESULTS_DIR"], os.environ["QLIB_NOTEBOOK"])
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "when.json"), "w") as f:
    json.dump(dict(t0=t0, t1=time.time()), f)
"""
SAVE = """
from qlib.suite.results import ResultWriter
w = ResultWriter("x", params=dict(device=device, k=k))
w.save_table([dict(i=i, sq=i * i) for i in range(k)], "squares", key=True)
"""
# fails by raising or by killing its kernel unless the file `fixed` (beside it) exists
FAILS = """
import os
if not os.path.exists("fixed"):
    if mode == "raise":
        raise ValueError("deliberate failure 42")
    if mode == "kill":
        os.kill(os.getpid(), 9)
"""


def _notebook(path: Path, params: str, cells: list[str], timing: bool | None = None) -> None:
    nb = new_notebook(
        cells=[new_code_cell(params, metadata={"tags": ["parameters"]})]
        + [new_code_cell(c) for c in cells]
    )
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    if timing is not None:
        nb.metadata["qlib"] = {"timing": timing}
    nbformat.write(nb, str(path))


def _run(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) with its stdout and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    mp = pytest.MonkeyPatch()
    mp.setattr(sys, "stdout", out)
    mp.setattr(sys, "stderr", err)
    try:
        rc = main(argv)
    finally:
        mp.undo()
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def lock_dir(tmp_path_factory):
    """A host lock of the tests' own (workers inherit the variable when they start)."""
    d = tmp_path_factory.mktemp("locks")
    mp = pytest.MonkeyPatch()
    mp.setenv("QLIB_LOCK_DIR", str(d))
    yield d
    mp.undo()


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sweep_notebooks")
    _notebook(d / "01_timed.ipynb", 'device = "cpu"\nn = 2', [WHEN], timing=True)
    _notebook(d / "02_plain.ipynb", 'device = "cpu"\nk = 2\nlabel = "x"', [SAVE, WHEN])
    _notebook(d / "03_fails.ipynb", 'device = "cpu"\nmode = "ok"', [FAILS])
    return d


def test_plan_points_and_unknown_names(notebooks, tmp_path):
    nbs = sorted(notebooks.glob("*.ipynb"))
    grid = {"n": [1, 2], "k": [3], "mode": ["ok", "raise"]}
    points, notes = plan(nbs, tmp_path, {"label": "y"}, grid)
    ids = [(p.notebook.stem, p.id) for p in points]
    assert ids == [
        ("01_timed", "n=1"),
        ("01_timed", "n=2"),
        ("02_plain", "k=3"),
        ("03_fails", "mode=ok"),
        ("03_fails", "mode=raise"),
    ]
    assert not notes
    assert [p.timing for p in points] == [True, True, False, False, False]
    assert points[2].parameters == {"label": "y", "k": 3}  # only what it declares
    assert points[0].dir == tmp_path / "sweeps" / "01_timed" / "n=1"
    with pytest.raises(SystemExit, match="nope"):
        plan(nbs, tmp_path, {}, {"nope": [1]})
    _, notes = plan(nbs, tmp_path, {}, {"mode": ["ok"]})
    assert notes == [
        "01_timed: declares none of mode; left out",
        "02_plain: declares none of mode; left out",
    ]
    for stem in ("03_throughput_vs_context", "10_format_zoo", "11_gpu_decode_ladder"):
        assert is_timing(REPO / "notebooks" / f"{stem}.ipynb")
    assert not is_timing(REPO / "notebooks" / "04_index_pos_misuse.ipynb")


def test_host_slot_timing_point_runs_alone(lock_dir):
    """Exclusive (a timing point) waits for shared ones and blocks them; shared ones share."""
    events: list[tuple[str, float]] = []

    def hold(name: str, exclusive: bool, seconds: float) -> None:
        with host_slot(exclusive) as waited:
            events.append((name, waited))
            time.sleep(seconds)

    with host_slot(False) as w0:  # a plain point holds the host
        assert w0 < 0.5
        other = threading.Thread(target=hold, args=("shared", False, 0))
        other.start()
        other.join(5)
        assert events == [("shared", pytest.approx(0, abs=0.5))]  # plain points share
        timed = threading.Thread(target=hold, args=("timing", True, 0.6))
        timed.start()
        time.sleep(0.6)
        assert len(events) == 1  # the timing point waits for the plain one
    timed.join(5)
    assert events[1][0] == "timing" and events[1][1] >= 0.5
    late = threading.Thread(target=hold, args=("late", False, 0))
    t0 = time.perf_counter()
    with host_slot(True):  # a timing point holds the host: a plain one waits
        late.start()
        time.sleep(0.5)
        assert len(events) == 2
    late.join(5)
    assert events[2][0] == "late" and time.perf_counter() - t0 >= 0.5


# -- a sweep on Dask: failures, the host rule, resume -----------------------------


def _status(out: Path, stem: str, point: str) -> dict:
    return json.loads((out / "sweeps" / stem / point / stem / "status_cpu.json").read_text())


@pytest.fixture(scope="module")
def dask_sweep(notebooks, lock_dir, tmp_path_factory):
    """5 points on a LocalCluster of 2 processes: 2 timing, 1 plain, one raises, one is killed."""
    out = tmp_path_factory.mktemp("sweep_results")
    mp = pytest.MonkeyPatch()
    mp.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    argv = ["suite", "run", "-q", "--notebooks", str(notebooks), "--output-dir", str(out)]
    argv += ["--grid", "n=1,2", "--grid", "k=3", "--grid", "mode=raise,kill"]
    try:
        rc, log, err = _run([*argv, "--executor", "dask", "--workers", "2"])
        summary = json.loads((out / "sweep.json").read_text())
    finally:
        mp.undo()
    return dict(out=out, argv=argv, rc=rc, log=log, err=err, summary=summary)


def test_failed_and_killed_points_marked_others_complete(dask_sweep):
    out, s = dask_sweep["out"], dask_sweep["summary"]
    assert dask_sweep["rc"] == 1
    states = {(e["notebook"], e["point"]): e["state"] for e in s["points"]}
    assert states == {
        ("01_timed", "n=1"): "ok",
        ("01_timed", "n=2"): "ok",
        ("02_plain", "k=3"): "ok",
        ("03_fails", "mode=raise"): "error",
        ("03_fails", "mode=kill"): "kernel died",
    }
    assert s["counts"] == {"points": 5, "ok": 3, "failed": 2, "skipped": 0, "pending": 0}
    by_point = {e["point"]: e for e in s["points"] if e["notebook"] == "03_fails"}
    assert "ValueError: deliberate failure 42" in by_point["mode=raise"]["failure"]
    assert by_point["mode=kill"]["failure"].startswith("kernel died at cell #3: DeadKernelError")
    assert all(e["seconds"] > 0 for e in s["points"])
    log, err = dask_sweep["log"], dask_sweep["err"]
    assert "3 of 5 points ok" in log and re.search(r"03_fails +mode=kill +kernel died", log)
    assert "03_fails mode=raise: error at cell In [3]: ValueError: deliberate failure 42" in err
    assert (out / "sweeps/03_fails/mode=kill/03_fails.ipynb").is_file()  # kept, with its error


def test_points_record_where_they_ran(dask_sweep):
    out, s = dask_sweep["out"], dask_sweep["summary"]
    assert s["executor"]["executor"] == "dask" and s["executor"]["workers"] == 2
    assert s["executor"]["cluster"] == "LocalCluster" and s["executor"]["hosts"]
    st = _status(out, "02_plain", "k=3")
    assert st["ok"] and st["parameters"] == {"k": 3} and st["code"] == CODE
    assert st["executor"] == "dask" and st["host"] == s["executor"]["hosts"][0]
    assert st["worker"].startswith("tcp://") and "cores" in st["machine"]
    assert st["point"] == "k=3" and st["waited_s"] is not None
    assert len({e["worker"] for e in s["points"]}) == 2  # both workers took points
    index = json.loads((out / "sweeps" / "01_timed" / "points.json").read_text())
    assert index["points"]["n=1"] == {"values": {"n": 1}, "parameters": {"n": 1}, "timing": True}
    assert len(pd.read_csv(out / "sweeps/02_plain/k=3/02_plain/squares_cpu.csv")) == 3


def test_timing_points_ran_alone_on_the_host(dask_sweep):
    out = dask_sweep["out"]
    spans = {}
    for stem, point in [("01_timed", "n=1"), ("01_timed", "n=2"), ("02_plain", "k=3")]:
        when = json.loads((out / "sweeps" / stem / point / stem / "when.json").read_text())
        spans[(stem, point)] = (when["t0"], when["t1"])
    for key, (a0, a1) in spans.items():
        if key[0] != "01_timed":
            continue
        for other, (b0, b1) in spans.items():
            if other != key:
                assert a1 <= b0 or b1 <= a0, f"{key} overlapped {other}"


def test_report_lists_the_sweep(dask_sweep):
    out = dask_sweep["out"]
    md = (out / "REPORT.md").read_text()
    assert "## Sweeps" in md and "### 03_fails" in md
    assert "- `mode=kill` on cpu: kernel died at cell #3: `DeadKernelError" in md
    assert "**Sweeps:** [01_timed](#sweep-01-timed) 2 points (2 ok)" in md
    index = json.loads((out / "index.json").read_text())
    entries = {(e["notebook"], e["point"]): e for e in index["sweeps"]}
    assert len(entries) == 5
    e = entries[("01_timed", "n=1")]
    assert e["executor"] == "dask" and e["host"] and e["ok"] and e["values"] == {"n": 1}
    assert entries[("03_fails", "mode=raise")]["failure"].startswith("error at cell In [3]")


def test_resume_reruns_failed_points_then_nothing(dask_sweep, notebooks, lock_dir):
    """--resume on an existing cluster (--scheduler): only the failed points run again."""
    from distributed import LocalCluster

    out, argv = dask_sweep["out"], dask_sweep["argv"]
    before = {(e["notebook"], e["point"]): e for e in dask_sweep["summary"]["points"]}
    (notebooks / "fixed").write_text("")
    mp = pytest.MonkeyPatch()
    mp.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    try:
        with LocalCluster(
            n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None
        ) as cluster:
            rc, log, _ = _run([*argv, "--resume", "--scheduler", cluster.scheduler_address])
        s = json.loads((out / "sweep.json").read_text())
        rc3, log3, _ = _run([*argv, "--resume", "--executor", "dask"])
    finally:
        mp.undo()
        (notebooks / "fixed").unlink()
    assert rc == 0, log
    assert "03_fails mode=raise: to run (last run error)" in log
    assert "03_fails mode=kill: to run (last run kernel died)" in log
    assert "5 of 5 points ok (3 skipped: done before)" in log
    assert s["executor"]["cluster"] == "external"
    for e in s["points"]:
        key = (e["notebook"], e["point"])
        if e["notebook"] == "03_fails":
            assert not e["skipped"] and e["run_id"] != before[key]["run_id"]
        else:
            assert e["skipped"] and e["run_id"] == before[key]["run_id"]
    assert rc3 == 0 and "5 of 5 points ok (5 skipped: done before)" in log3
    assert "dask:" not in log3  # nothing to run: no cluster started


def test_view_of_notebook_06_across_quantization_types(tmp_path):
    """The report concatenates each point's vs_reference and plots it against the type."""
    from qlib.suite import report
    from qlib.suite.results import ResultWriter, atomic_write_text
    from qlib.suite.runner import NotebookResult

    stem = "06_device_logit_drift"
    index = {}
    for t, diff in (("Q4_1", 1.07), ("Q8_0", 0.31)):
        pid = point_id({"variants": [t]})
        folder = tmp_path / "sweeps" / stem / pid
        w = ResultWriter(stem, params={"variants": [t]}, output_dir=folder)
        rows = [
            dict(variant=t, source="qlib cpu quantized", max_abs_diff=diff, mean_abs_diff=0.1),
            dict(variant=t, source="qlib cpu f32", max_abs_diff=6e-5, mean_abs_diff=6e-6),
        ]
        w.save_table(rows, "vs_reference", key=True)
        r = NotebookResult(stem, "cpu", True, 1.5, "", parameters={"variants": [t]}, state="ok")
        r.executor, r.host = "dask", "node-a"
        atomic_write_text(folder / stem / "status_cpu.json", json.dumps(r.status()))
        index[pid] = {"values": {"variants": [t]}}
    atomic_write_text(tmp_path / "sweeps" / stem / "points.json", json.dumps({"points": index}))
    md = report.build(tmp_path, notebooks_dir=tmp_path).read_text()
    df = pd.read_csv(tmp_path / "sweeps" / stem / "sweep_vs_reference.csv")
    assert list(df.columns[:4]) == ["point", "variants", "device", "variant"]
    assert df.variant.tolist() == ["Q4_1", "Q4_1", "Q8_0", "Q8_0"]
    assert (tmp_path / "sweeps" / stem / "sweep_vs_reference.png").is_file()
    assert "**vs_reference across the points**" in md and "4 rows of 2 points" in md
    views = json.loads((tmp_path / "index.json").read_text())["sweep_views"]
    assert views[stem]["x"] == "variant" and views[stem]["rows"] == 4


# -- the local executor, -f params.yaml ---------------------------------------------


def test_local_sweep_from_a_params_file(notebooks, lock_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    f = tmp_path / "params.yaml"
    f.write_text("label: from file\ngrid:\n  k: [1, 2]\n")
    out = tmp_path / "out"
    argv = ["suite", "run", "-q", "--notebooks", str(notebooks), "--output-dir", str(out)]
    rc, log, err = _run([*argv, "--only", "02", "-f", str(f), "--grid", "k=3"])
    assert rc == 0, err
    assert "on local" in log and "1 of 1 points ok" in log
    st = _status(out, "02_plain", "k=3")
    assert st["parameters"] == {"label": "from file", "k": 3} and st["executor"] == "local"
    assert st["worker"] is None and st["host"]
    s = json.loads((out / "sweep.json").read_text())
    assert s["executor"] == {"executor": "local", "workers": 1} and s["grid"] == {"k": [3]}
    # -f without a grid is a plain run with the file's parameters
    f.write_text("k: 1\n")
    rc, log, _ = _run([*argv, "--only", "02", "-f", str(f)])
    assert rc == 0 and "1 of 1 notebooks ok" in log
    assert json.loads((out / "02_plain" / "status_cpu.json").read_text())["parameters"] == {"k": 1}
    rc, _, err = _run([*argv, "--only", "02", "--grid", "k=1", "-p", "k", "2"])
    assert rc == 2 and "both -p and --grid" in err
    rc, _, err = _run([*argv, "--only", "02", "--executor", "dask"])
    assert rc == 2 and "give --grid" in err


# -- a real notebook -----------------------------------------------------------------


@pytest.mark.slow
def test_notebook_04_short_grid_on_dask(lock_dir, tmp_path, monkeypatch):
    """`suite run --only 04 --grid steps=4,6 --executor dask --workers 2`, then --resume."""
    try:
        models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    out = tmp_path / "sw"
    argv = ["suite", "run", "--notebooks", str(REPO / "notebooks"), "--output-dir", str(out)]
    argv += ["--only", "04", "--grid", "steps=4,6", "--executor", "dask", "--workers", "2"]
    rc, log, err = _run(argv)
    assert rc == 0, err
    assert "2 of 2 points ok" in log
    s = json.loads((out / "sweep.json").read_text())
    for e in s["points"]:
        assert e["state"] == "ok" and e["executor"] == "dask" and e["host"]
        nb = out / e["executed_notebook"]
        assert nb.is_file() and nb.parent == out / "sweeps" / "04_index_pos_misuse" / e["point"]
    view = pd.read_csv(out / "sweeps" / "04_index_pos_misuse" / "sweep_decode_variants.csv")
    assert sorted(view.steps.unique()) == [4, 6]
    assert set(view.tokens) == {4, 6}  # each point generated its own number of tokens
    assert (out / "sweeps" / "04_index_pos_misuse" / "sweep_decode_variants.png").is_file()
    index = json.loads((out / "index.json").read_text())
    assert {(e["point"], e["executor"]) for e in index["sweeps"]} == {
        ("steps=4", "dask"),
        ("steps=6", "dask"),
    }
    assert "decode_variants across the points" in (out / "REPORT.md").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in (out / "sweeps").rglob("status_*.json")}
    rc, log, _ = _run([*argv, "--resume"])
    assert rc == 0 and "2 of 2 points ok (2 skipped: done before)" in log
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes


def test_plain_run_keeps_timing_notebooks_alone(notebooks, lock_dir, tmp_path):
    """``suite run`` (no grid), one at a time or with workers: while another run's plain
    notebook holds the host, a timing notebook waits and a plain one does not; the wait is
    recorded and shown."""
    from qlib.suite.runner import run_suite

    timed, plain = notebooks / "01_timed.ipynb", notebooks / "02_plain.ipynb"

    def run_beside_other(nbs: list[Path], workers: int, out: str):
        def other_notebook() -> None:  # a plain notebook of another run holds the host 3 s
            with host_slot(False):
                time.sleep(3.0)

        holder = threading.Thread(target=other_notebook)
        holder.start()
        time.sleep(0.2)
        lines: list[str] = []
        results = run_suite(
            nbs,
            tmp_path / out,
            {},
            workers=workers,
            progress=False,
            log=lambda m, **_: lines.append(m),
        )
        holder.join(5)
        assert all(r.ok for r in results)
        return results, lines

    (r,), _ = run_beside_other([plain], 1, "plain")
    assert r.waited_s < 1.0
    (r,), lines = run_beside_other([timed], 1, "timed")
    assert r.waited_s >= 1.0
    assert any("01_timed ok" in m and "s for the host" in m for m in lines), lines
    (r, _), _ = run_beside_other([timed, plain], 2, "workers")
    assert r.name == "01_timed" and r.waited_s >= 1.0


def test_no_leftover_lock_holders(lock_dir):
    """Every point released the host: a timing slot is free at once."""
    with host_slot(True) as waited:
        assert waited < 1.0
    assert os.listdir(lock_dir)
