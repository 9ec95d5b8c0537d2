"""The notebook suite: runner, results writer, report (papermill on small made-up notebooks)."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from qlib import models
from qlib.cli import main
from qlib.suite import report
from qlib.suite.catalogue import discover
from qlib.suite.cli import parse_value
from qlib.suite.params import check_type
from qlib.suite.results import ResultWriter, atomic_write_text
from qlib.suite.runner import NotebookResult, resume_check, run_suite

GOOD = """
from qlib.suite.results import ResultWriter
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

w = ResultWriter("01_good", params=dict(device=device, n=n, label=label, flag=flag, ratio=ratio))
df = w.save_table([dict(i=i, sq=i * i) for i in range(n)], "squares", key=True,
                  caption="i and its square")
w.save_json(dict(n=n, n_type=type(n).__name__, label=label, label_type=type(label).__name__,
                 flag=flag, ratio=ratio), "params")
fig, ax = plt.subplots(figsize=(2, 2))
ax.plot(df.i, df.sq)
w.save_plot(fig, "squares", caption="squares")
w.finding("largest", "The largest square is {v}.", table="squares", v=int(df.sq.max()))
w.seed_reference("sq", "a square", 4, ours=int(df.sq.iloc[2]), unit="", source="chapter 0")
w.skipped("GPU part", "no GPU here")
"""

BAD = """
from qlib.suite.results import ResultWriter
w = ResultWriter("02_bad", params=dict(device=device))
w.save_table([dict(a=1)], "before_failure", key=True)
raise ValueError("deliberate failure 42")
"""


def _notebook(path: Path, params: str, code: str, title: str) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell(params, metadata={"tags": ["parameters"]}),
            new_markdown_cell(f"# {title}\n\nThe intro of {path.stem}."),
            new_code_cell(code),
        ]
    )
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("notebooks")
    good_params = 'device = "cpu"\nn = 3\nlabel = "x"\nflag = False\nratio = 0.5'
    _notebook(d / "01_good.ipynb", good_params, GOOD, "Good notebook")
    _notebook(d / "02_bad.ipynb", 'device = "cpu"', BAD, "Bad notebook")
    _notebook(d / "03_other.ipynb", 'device = "cpu"', "x = 1", "Other notebook")
    return d


@pytest.fixture(scope="module")
def first_run(notebooks, tmp_path_factory):
    """`suite run --only 01 02 -p ...` into a folder that already holds results."""
    out = tmp_path_factory.mktemp("results")
    atomic_write_text(out / "keep.txt", "earlier\n")
    atomic_write_text(out / "02_bad" / "old_cpu.csv", "a\n1\n")
    capture = pytest.MonkeyPatch()
    argv = ["suite", "run", "--notebooks", str(notebooks), "--output-dir", str(out)]
    argv += ["--only", "01", "02_bad", "-p", "n", "5", "-p", "label", "'7'", "-p", "flag", "true"]
    argv += ["-p", "ratio", "1e-3"]
    err, stdout = io.StringIO(), io.StringIO()
    capture.setattr(sys, "stderr", err)
    capture.setattr(sys, "stdout", stdout)
    try:
        rc = main(argv)
    finally:
        capture.undo()
    return rc, out, stdout.getvalue(), err.getvalue()


def test_failure_listed_and_exit_code(first_run):
    rc, out, stdout, stderr = first_run
    assert rc == 1
    assert "[2/2] 02_bad FAILED" in stdout and "[1/2] 01_good ok" in stdout
    assert "1 notebook(s) failed" in stderr
    assert "02_bad: cell In [2]: ValueError: deliberate failure 42" in stderr


def test_failing_notebook_kept_with_error(first_run):
    _, out, _, _ = first_run
    nb = nbformat.read(str(out / "02_bad.ipynb"), as_version=4)
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "error"
    ]
    assert errors and errors[0].ename == "ValueError"
    status = json.loads((out / "02_bad" / "status_cpu.json").read_text())
    assert not status["ok"] and status["cell"] == 2
    # what it saved before failing is there, and no temporary file is left
    assert (out / "02_bad" / "before_failure_cpu.csv").is_file()
    assert not list(out.rglob(".*"))


def test_good_notebook_ran_with_parsed_parameters(first_run):
    _, out, _, _ = first_run
    assert (out / "01_good.ipynb").is_file()
    d = out / "01_good"
    assert len(pd.read_csv(d / "squares_cpu.csv")) == 5
    assert len(json.loads((d / "squares_cpu.json").read_text())) == 5
    assert (d / "squares_cpu.png").stat().st_size > 0
    p = json.loads((d / "params_cpu.json").read_text())
    assert p == dict(n=5, n_type="int", label="7", label_type="str", flag=True, ratio=0.001)
    meta = json.loads((d / "meta_cpu.json").read_text())
    assert meta["params"]["n"] == 5 and meta["machine"]["python"]
    assert meta["run_id"] == json.loads((d / "status_cpu.json").read_text())["run_id"]
    assert meta["findings"][0]["sentence"] == "The largest square is 16."


def test_preexisting_results_kept_and_only_selects(first_run):
    _, out, _, _ = first_run
    assert (out / "keep.txt").read_text() == "earlier\n"
    assert (out / "02_bad" / "old_cpu.csv").is_file()
    assert not (out / "03_other.ipynb").exists() and not (out / "03_other").exists()


def test_report_sections(first_run):
    _, out, _, _ = first_run
    md = (out / "REPORT.md").read_text()
    assert "## 01_good: Good notebook" in md and "> The intro of 01_good." in md
    assert "- The largest square is 16. *(table `squares`)*" in md
    assert "| i | sq |" in md and "![squares](01_good/squares_cpu.png)" in md
    assert "seed (candle 0.11.0, M2 Max)" in md and "*Skipped* GPU part: no GPU here" in md
    assert "## 02_bad: Bad notebook" in md
    assert "**Failed** (error at cell In [2]: `ValueError: deliberate failure 42`)" in md
    assert "- [02_bad](#02-bad) on cpu: error at cell In [2]: `ValueError: deliberate" in md
    assert "before_failure" in md  # what the failed run saved still shows
    assert "## 03_other" in md and "**Not run**" in md
    assert md.index("## 01_good") < md.index("## 02_bad") < md.index("## 03_other")
    html = (out / "REPORT.html").read_text()
    assert '<img alt="squares" src="01_good/squares_cpu.png"' in html and "<table>" in html
    assert '<div class="table-scroll" style="overflow-x:auto"><table>' in html
    assert '<th class="num">sq</th>' in html and "| i | sq |\n| ---: | ---: |" in md
    # the executed notebooks as HTML pages beside them, linked; every run in index.json
    assert (out / "01_good.html").is_file() and (out / "02_bad.html").is_file()
    assert "[executed notebook](01_good.html) ([.ipynb](01_good.ipynb))" in md
    index = json.loads((out / "index.json").read_text())
    runs = {r["notebook"]: r for r in index["runs"]}
    assert runs["01_good"]["state"] == "ok" and runs["02_bad"]["state"] == "error"
    assert runs["01_good"]["files"]["html"] == "01_good.html"
    assert runs["01_good"]["parameters"] == {"n": 5, "label": "7", "flag": True, "ratio": 0.001}
    assert "03_other" in index["not_run"]


def test_parallel_run_on_another_device_sits_beside(first_run, notebooks):
    """--workers 2 --device cuda (the made-up notebooks never touch a GPU): files carry the tag."""
    _, out, _, _ = first_run
    cpu_table = (out / "01_good" / "squares_cpu.csv").read_bytes()
    argv = ["suite", "run", "--notebooks", str(notebooks), "--output-dir", str(out)]
    rc = main([*argv, "--only", "01", "02", "--device", "cuda", "--workers", "2"])
    assert rc == 1
    assert (out / "01_good_cuda.ipynb").is_file() and (out / "02_bad_cuda.ipynb").is_file()
    assert len(pd.read_csv(out / "01_good" / "squares_cuda.csv")) == 3
    assert (out / "01_good" / "squares_cpu.csv").read_bytes() == cpu_table
    md = (out / "REPORT.md").read_text()
    assert "### 01_good on cpu" in md and "### 01_good on cuda" in md
    assert md.index("### 01_good on cpu") < md.index("### 01_good on cuda")


def test_run_without_device_files_under_cpu_whatever_the_default(tmp_path):
    """A notebook whose own `device` default is "cuda" (as notebook 11), run with no --device:
    it gets device="cpu", the run's tag, so results of an earlier cuda run stay untouched."""
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    code = (
        "from qlib.suite.results import ResultWriter\n"
        'w = ResultWriter("01_gpu", params=dict(device=device))\n'
        'w.skipped("x", f"ran with {device}")'
    )
    _notebook(nbs / "01_gpu.ipynb", 'device = "cuda"', code, "GPU only")
    argv = ["suite", "run", "--notebooks", str(nbs), "--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--device", "cuda"]) == 0  # (the notebook never touches a GPU)
    out = tmp_path / "out"
    cuda_meta = (out / "01_gpu" / "meta_cuda.json").read_bytes()
    assert main(argv) == 0
    assert (out / "01_gpu" / "meta_cuda.json").read_bytes() == cuda_meta
    meta = json.loads((out / "01_gpu" / "meta_cpu.json").read_text())
    assert meta["params"]["device"] == "cpu"
    assert _status(out, "01_gpu")["parameters"] == {"device": "cpu"}


def test_parse_value():
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("2.5") == 2.5 and parse_value("1e3") == 1000.0
    assert parse_value("true") is True and parse_value("False") is False
    assert parse_value("null") is None and parse_value("None") is None
    assert parse_value("'42'") == "42" and parse_value('"a b"') == "a b"
    assert parse_value("[1, 2]") == [1, 2] and parse_value("[a, b]") == ["a", "b"]
    assert parse_value('{"k": 1}') == {"k": 1}
    assert parse_value("hello world") == "hello world"
    assert parse_value("cuda:0") == "cuda:0"


def test_discover_only(notebooks):
    assert [p.stem for p in discover(notebooks)] == ["01_good", "02_bad", "03_other"]
    assert [p.stem for p in discover(notebooks, ["03", "01_good"])] == ["01_good", "03_other"]
    with pytest.raises(SystemExit, match="no notebook matches 9"):
        discover(notebooks, ["9"])


def test_unknown_parameter_rejected(notebooks, tmp_path):
    with pytest.raises(SystemExit, match="nope"):
        run_suite(discover(notebooks, ["03"]), tmp_path, {"nope": 1})


@pytest.mark.parametrize(
    ("name", "value", "words"),
    [
        ("n", "x", "01_good's n: 'x' is not of its default's type (int: 3)"),
        ("n", 2.5, "(int: 3)"),
        ("n", True, "(int: 3)"),
        ("flag", 1, "(bool: False)"),
        ("label", 7, "quote it"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_before_any_run(notebooks, tmp_path, name, value,
                                                             words):  # fmt: skip
    """``-p n x`` for an int parameter (and a float, a bool for it; a number for a bool or a
    string) stops before a kernel starts, so the last good results stay: nothing is written."""
    with pytest.raises(ValueError, match=re.escape(words)):
        run_suite(discover(notebooks, ["01"]), tmp_path, {name: value})
    assert not any(tmp_path.iterdir())


def test_values_that_fit_their_defaults_pass():
    """An int for a float, a list for a tuple, None anywhere, anything for a default of
    None or one that is not a literal."""
    for value, default in ((3, "0.5"), ([1], "(1, 2)"), (None, "3"), ("x", "None"),
                           (4, "os.cpu_count()"), ("cuda", '"cpu"'), (False, "True")):  # fmt: skip
        check_type(value, default, "t")


def test_list(notebooks, capsys):
    assert main(["suite", "list", "--notebooks", str(notebooks), "--only", "01"]) == 0
    out = capsys.readouterr().out
    assert "01_good  Good notebook" in out and "n = 3" in out and "02_bad" not in out


def test_result_writer_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("QLIB_RESULTS_DIR", str(tmp_path))
    monkeypatch.delenv("QLIB_NOTEBOOK", raising=False)
    w = ResultWriter("99_by_hand", params={"device": "cuda:1"})
    assert w.dir == tmp_path / "99_by_hand" and w.device == "cuda"
    df = w.save_table(pd.DataFrame({"x": [1.5, float("nan")]}).set_index("x"), "t", key=True)
    assert list(df.columns) == ["x"]
    assert json.loads((w.dir / "t_cuda.json").read_text()) == [{"x": 1.5}, {"x": None}]
    with pytest.raises(ValueError, match="not saved"):
        w.finding("k", "s", table="missing")
    with pytest.raises(ValueError, match="bad result name"):
        w.save_json({}, "../escape")
    for reserved in ("meta", "status", "status_x"):  # the meta and the runner's status files
        with pytest.raises(ValueError, match="reserved"):
            w.save_table({"a": [1]}, reserved)
    md = report.build(tmp_path, notebooks_dir=tmp_path)
    assert "Run by hand" in md.read_text()
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.slow
def test_smoke_notebook(tmp_path):
    """The real notebooks/00_smoke.ipynb on the embedded model."""
    try:
        models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))
    nbdir = tmp_path / "nb"
    nbdir.mkdir()
    shutil.copy(Path(__file__).parent.parent / "notebooks" / "00_smoke.ipynb", nbdir)
    out = tmp_path / "out"
    assert main(["suite", "run", "-q", "--notebooks", str(nbdir), "--output-dir", str(out)]) == 0
    types = pd.read_csv(out / "00_smoke" / "tensor_types_cpu.csv")
    assert types.tensors.sum() == 272 and "Q4_1" in set(types.type)
    assert "tensors are Q4_1" in (out / "REPORT.md").read_text()


def test_kernel_that_did_not_start_is_started_again(tmp_path, monkeypatch):
    """A kernel that ends before replying to kernel_info (a port another kernel took between
    jupyter_client choosing it and the kernel binding it) never ran a cell: ``run_notebook``
    starts it again, up to ``KERNEL_START_TRIES`` in all; any other failure is recorded at
    once. papermill is a stand-in here that fails the first ``fails`` calls."""
    import papermill

    from qlib.suite import runner

    nb = tmp_path / "01_x.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("x = 1")]), nb)
    calls = []

    def stand_in(fails: int, error: str):
        def execute_notebook(src, dst, **kw):
            calls.append(dst)
            if len(calls) <= fails:
                raise RuntimeError(error)
            shutil.copy(src, dst)

        return execute_notebook

    started = "Kernel died before replying to kernel_info"
    for fails, error, ok, tries in ((2, started, True, 3), (5, started, False, 3),
                                    (1, "an error in cell 1", False, 1)):  # fmt: skip
        calls.clear()
        monkeypatch.setattr(papermill, "execute_notebook", stand_in(fails, error))
        result = runner.run_notebook(nb, tmp_path / f"out{fails}", {}, progress=False)
        assert (result.ok, len(calls)) == (ok, tries), (fails, error)
        if not ok:
            assert error in result.error and result.state == runner.ERROR


def test_stale_results_marked():
    status = {"run_id": "B", "started": "2026-01-02T00:00:00+00:00", "ok": False}
    earlier = {"run_id": "A", "started": "2026-01-01T00:00:00+00:00"}
    by_hand_later = {"run_id": None, "started": "2026-01-03T00:00:00+00:00"}
    assert report.DeviceRun("cpu", earlier, status).stale
    assert not report.DeviceRun("cpu", by_hand_later, status).stale
    assert not report.DeviceRun("cpu", {**earlier, "run_id": "B"}, status).stale


# -- a suite that loses nothing: kill, timeout, resume -------------------------

SAVE = """
from qlib.suite.results import ResultWriter
w = ResultWriter("x", params=dict(device=device, n=n))
w.save_table([dict(i=i) for i in range(n)], "before", key=True)
"""
# each crashes unless the file `fixed` (next to the notebooks) exists
KILL = "import os\nif not os.path.exists('fixed'):\n    os.kill(os.getpid(), 9)"
SLEEP = "import os, time\nif not os.path.exists('fixed'):\n    time.sleep(120)"
AFTER = 'w.save_table([dict(a=2)], "after", key=True)'
SEE_STATUS = """
import json, os
status = os.path.join(os.environ["QLIB_RESULTS_DIR"], "01_first", "status_cpu.json")
w.save_json(json.load(open(status)), "seen_status")
"""
CODE = {"commit": "abc1234", "dirty": False, "diff": None}  # the code_version of these runs


def _cells_notebook(path: Path, cells: list[str]) -> None:
    params = new_code_cell('device = "cpu"\nn = 2', metadata={"tags": ["parameters"]})
    nb = new_notebook(cells=[params, *[new_code_cell(c) for c in cells]])
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nbformat.write(nb, str(path))


def _run(argv: list[str]) -> tuple[int, str]:
    """main(argv) with its stdout captured."""
    out = io.StringIO()
    mp = pytest.MonkeyPatch()
    mp.setattr(sys, "stdout", out)
    try:
        rc = main(argv)
    finally:
        mp.undo()
    return rc, out.getvalue()


def _status(out: Path, name: str) -> dict:
    return json.loads((out / name / "status_cpu.json").read_text())


@pytest.fixture(scope="module")
def crashes(tmp_path_factory):
    """Run 1 of four notebooks: ok, SIGKILLed kernel, cell timeout, ok; then --resume."""
    nbdir = tmp_path_factory.mktemp("crash_notebooks")
    _cells_notebook(nbdir / "01_first.ipynb", [SAVE, SEE_STATUS])
    _cells_notebook(nbdir / "02_killed.ipynb", [SAVE, KILL, AFTER])
    _cells_notebook(nbdir / "03_slow.ipynb", [SAVE, SLEEP, AFTER])
    _cells_notebook(nbdir / "04_last.ipynb", [SAVE])
    out = tmp_path_factory.mktemp("crash_results")
    # an earlier complete run of 02_killed, by hand: its "after" table must survive run 1
    w = ResultWriter("02_killed", params={"device": "cpu"}, output_dir=out)
    w.save_table([dict(a=1)], "after", key=True)
    earlier_after = (out / "02_killed" / "after_cpu.csv").read_bytes()
    mp = pytest.MonkeyPatch()
    mp.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    argv = ["suite", "run", "-q", "--notebooks", str(nbdir), "--output-dir", str(out)]
    try:
        rc1, log1 = _run([*argv, "--timeout", "6"])
        first = {n: _status(out, n) for n in ("01_first", "02_killed", "03_slow", "04_last")}
        report1 = (out / "REPORT.md").read_text()
        meta1 = json.loads((out / "02_killed" / "meta_cpu.json").read_text())
        killed_nb = nbformat.read(str(out / "02_killed.ipynb"), as_version=4)
        mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
        (nbdir / "fixed").write_text("")
        rc2, log2 = _run([*argv, "--timeout", "6", "--resume"])
    finally:
        mp.undo()
    return dict(
        nbdir=nbdir,
        out=out,
        argv=argv,
        rc1=rc1,
        log1=log1,
        first=first,
        report1=report1,
        meta1=meta1,
        killed_nb=killed_nb,
        earlier_after=earlier_after,
        mtimes=mtimes,
        rc2=rc2,
        log2=log2,
    )


def test_killed_and_timed_out_notebooks_recorded(crashes):
    assert crashes["rc1"] == 1
    log, first = crashes["log1"], crashes["first"]
    assert "[2/4] 02_killed FAILED (cell #3: DeadKernelError" in log
    assert "[3/4] 03_slow FAILED (cell #3: CellTimeoutError" in log
    killed, slow = first["02_killed"], first["03_slow"]
    assert not killed["ok"] and killed["state"] == "kernel died" and killed["cell_index"] == 3
    assert not slow["ok"] and slow["state"] == "timeout" and slow["cell_index"] == 3
    assert "after 6 seconds" in slow["error"]
    # the executed notebooks are kept, up to the cell that failed
    nb = crashes["killed_nb"]
    assert nb.cells[1].outputs and nb.cells[3].metadata.papermill.start_time is None


def test_other_notebooks_ran(crashes):
    first, out = crashes["first"], crashes["out"]
    assert first["01_first"]["ok"] and first["04_last"]["ok"]  # 04 runs after both failures
    assert first["04_last"]["run_id"] == first["02_killed"]["run_id"]
    assert "2 of 4 notebooks ok" in crashes["log1"]
    # the status said "running" while the notebook ran, so a killed runner leaves a failure
    seen = json.loads((out / "01_first" / "seen_status_cpu.json").read_text())
    assert seen["state"] == "running" and not seen["ok"] and "did not finish" in seen["error"]


def test_earlier_results_survive_a_crash(crashes):
    meta1 = crashes["meta1"]
    # what the killed run saved before dying, and the earlier run's table it never reached
    assert [t["stem"] for t in meta1["tables"]] == ["before"]
    assert [t["stem"] for t in meta1["earlier"]["tables"]] == ["after"]
    assert meta1["earlier"]["tables"][0]["run_id"] is None  # the earlier run was by hand
    report = crashes["report1"]
    assert "| [02_killed](#02-killed) | **failed** (kernel died) |" in report
    assert "| [03_slow](#03-slow) | **failed** (timeout) |" in report
    assert "**Failed** (2):" in report
    assert "- [02_killed](#02-killed) on cpu: kernel died at cell #3: `DeadKernelError" in report
    assert "- [03_slow](#03-slow) on cpu: timeout at cell #3: `CellTimeoutError" in report
    assert "Still there from an earlier run (not saved again by this one): [after]" in report
    # files untouched by run 1: the earlier "after" table and every earlier cell's table
    mtimes = crashes["mtimes"]
    out = crashes["out"]
    assert (
        mtimes[out / "02_killed" / "after_cpu.csv"] < mtimes[out / "02_killed" / "before_cpu.csv"]
    )
    for name in ("01_first", "02_killed", "03_slow", "04_last"):
        assert len(pd.read_csv(out / name / "before_cpu.csv")) == 2
        assert (out / f"{name}.ipynb").is_file()
    assert not [p for p in out.rglob(".*")]  # no temporary file left behind


def test_resume_skips_done_and_reruns_failed(crashes):
    out, log, first = crashes["out"], crashes["log2"], crashes["first"]
    assert crashes["rc2"] == 0
    assert "01_first skipped: done in run " in log and "04_last skipped: done in run " in log
    assert "02_killed: to run (last run kernel died)" in log
    assert "03_slow: to run (last run timeout)" in log
    assert "4 of 4 notebooks ok (2 skipped: done before)" in log
    for name in ("01_first", "04_last"):  # untouched
        assert _status(out, name) == first[name]
        for p in (out / name).iterdir():
            assert p.stat().st_mtime_ns == crashes["mtimes"][p]
    for name in ("02_killed", "03_slow"):  # ran again, in another run, and finished
        st = _status(out, name)
        assert st["ok"] and st["state"] == "ok" and st["run_id"] != first[name]["run_id"]
        assert st["code"] == CODE and st["parameters"] == {}
        assert pd.read_csv(out / name / "after_cpu.csv").a.tolist() == [2]
    # a finished run forgets the earlier run's entries; the report lists no failure
    assert json.loads((out / "02_killed" / "meta_cpu.json").read_text())["earlier"] == {}
    report = (out / "REPORT.md").read_text()
    assert "**failed**" not in report and "Still there" not in report


def test_resume_reruns_on_other_commit_or_parameters(crashes, monkeypatch):
    out, argv = crashes["out"], crashes["argv"]
    before = {n: _status(out, n) for n in ("01_first", "04_last")}
    monkeypatch.setattr("qlib.suite.runner.code_version", lambda: {**CODE, "commit": "def5678"})
    rc, log = _run([*argv, "--resume", "--only", "01"])
    assert rc == 0 and "01_first: to run (other commit or uncommitted changes)" in log
    assert _status(out, "01_first")["run_id"] != before["01_first"]["run_id"]
    monkeypatch.setattr("qlib.suite.runner.code_version", lambda: dict(CODE))
    rc, log = _run([*argv, "--resume", "--only", "04", "-p", "n", "3"])
    assert rc == 0 and "04_last: to run (other parameters)" in log
    st = _status(out, "04_last")
    assert st["parameters"] == {"n": 3} and st["run_id"] != before["04_last"]["run_id"]
    assert len(pd.read_csv(out / "04_last" / "before_cpu.csv")) == 3


def test_resume_check(tmp_path):
    nb = tmp_path / "05_x.ipynb"
    _cells_notebook(nb, ["x = 1"])
    out = tmp_path / "out"
    params = {"n": 1}
    assert resume_check(nb, out, params, CODE) == (False, "no earlier run")
    from qlib.suite.runner import file_sha256

    r = NotebookResult("05_x", "cpu", True, 1.0, "05_x.ipynb", run_id="R", parameters=params)
    r.state, r.notebook_sha256, r.code = "ok", file_sha256(nb), dict(CODE)
    atomic_write_text(out / "05_x" / "status_cpu.json", json.dumps(r.status()))
    assert resume_check(nb, out, params, CODE) == (False, "executed notebook missing")
    (out / "05_x.ipynb").write_text("{}")
    assert resume_check(nb, out, params, CODE) == (True, "done in run R")
    assert resume_check(nb, out, {"n": 2}, CODE) == (False, "other parameters")
    assert resume_check(nb, out, {"n": 1, "device": "cuda"}, CODE)[1] == "no earlier run"
    assert resume_check(nb, out, params, {**CODE, "dirty": True, "diff": "1"})[0] is False
    assert resume_check(nb, out, params, None) == (False, "commit unknown")
    _cells_notebook(nb, ["x = 2"])
    assert resume_check(nb, out, params, CODE) == (False, "notebook changed")
    r.ok, r.state = False, "running"
    atomic_write_text(out / "05_x" / "status_cpu.json", json.dumps(r.status()))
    assert resume_check(nb, out, params, CODE) == (False, "last run running")


def test_code_version_names_the_checkout():
    from qlib.suite.machine import git_commit
    from qlib.suite.runner import code_version

    info, code = git_commit(), code_version()
    if info is None:
        pytest.skip("not a git checkout and no $QLIB_COMMIT")
    assert code["commit"] == info["commit"] and code["dirty"] == info["dirty"]
    assert (code["diff"] is not None) == bool(info["dirty"])


def test_qlib_commit_names_the_code_of_a_copied_tree(monkeypatch):
    """On the GPU machine the tree is a copy whose .git (if any) is stale: $QLIB_COMMIT wins."""
    from qlib.suite.machine import git_commit

    monkeypatch.setenv("QLIB_COMMIT", "68804f18f0f52c94578c8fb83d27df304bfd65cb")
    assert git_commit() == {"commit": "68804f1", "dirty": None}
