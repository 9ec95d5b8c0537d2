"""The notebook suite: runner, results writer, report (papermill on small made-up notebooks)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from qlib import models, report
from qlib.__main__ import main
from qlib.results import ResultWriter, atomic_write_text
from qlib.suite import discover, parse_value, run_suite

GOOD = """
from qlib.results import ResultWriter
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
from qlib.results import ResultWriter
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
    assert "**Failed** at cell In [2]: `ValueError: deliberate failure 42`" in md
    assert "before_failure" in md  # what the failed run saved still shows
    assert "## 03_other" in md and "**Not run**" in md
    assert md.index("## 01_good") < md.index("## 02_bad") < md.index("## 03_other")
    html = (out / "REPORT.html").read_text()
    assert '<img alt="squares" src="01_good/squares_cpu.png"' in html and "<table>" in html


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


def test_stale_results_marked():
    status = {"run_id": "B", "started": "2026-01-02T00:00:00+00:00", "ok": False}
    earlier = {"run_id": "A", "started": "2026-01-01T00:00:00+00:00"}
    by_hand_later = {"run_id": None, "started": "2026-01-03T00:00:00+00:00"}
    assert report.DeviceRun("cpu", earlier, status).stale
    assert not report.DeviceRun("cpu", by_hand_later, status).stale
    assert not report.DeviceRun("cpu", {**earlier, "run_id": "B"}, status).stale
