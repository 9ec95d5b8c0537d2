"""The report: per-column number formats, alignment, scroll boxes, notebook pages, index.json.

On a small results folder made here in the suite's own file formats (``ResultWriter``'s
``meta_<device>.json`` and tables, the runner's ``status_<device>.json``); no notebook runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from qlib.suite import report
from qlib.suite.report import column_format, markdown_table, to_html
from qlib.suite.results import ResultWriter, atomic_write_text, dump_json
from qlib.suite.runner import NotebookResult

REPO = Path(__file__).resolve().parent.parent


def _cells(values):
    f = column_format(values)
    return [f(v) for v in values]


# -- number formats ---------------------------------------------------------------


def test_ints_thousands_for_all_or_none():
    # one column used to mix 35136 and 140,544
    assert _cells([66_355_200, 140_544, 30_081_024]) == ["66,355,200", "140,544", "30,081,024"]
    assert _cells([106_168_320, 35136, 28_311_552]) == ["106,168,320", "35,136", "28,311,552"]
    assert _cells([210, 61, 1]) == ["210", "61", "1"]
    assert _cells([1.0, 20.0, 3.0]) == ["1", "20", "3"]  # whole floats (CSV) are integers
    assert column_format([1, 2]).numeric


def test_floats_same_decimals_in_a_column():
    assert _cells([96.81178, 101.18660, 93.0]) == ["96.8", "101.2", "93.0"]
    assert _cells([0.56201171875, 0.5]) == ["0.5620", "0.5000"]
    # enough decimals for the smallest value too, the same for every row
    assert _cells([209.2941, 0.0052]) == ["209.2941", "0.0052"]
    assert _cells([1377.46, 45.1]) == ["1377.5", "45.1"]  # at least one decimal
    assert _cells([12345.67, 2.5]) == ["12,345.7", "2.5"]
    # too small for fixed decimals: scientific notation for the whole column
    assert _cells([0.0, 1.2e-7, 3.4e-5]) == ["0.000e+00", "1.200e-07", "3.400e-05"]


def test_empty_text_and_mixed_columns():
    nan = float("nan")
    assert _cells([1.5, None, nan, 2.25]) == ["1.500", "", "", "2.250"]
    assert column_format([1.5, None, nan]).numeric  # empty cells do not make it text
    assert not column_format(["a", "b"]).numeric
    assert not column_format([True, False]).numeric and _cells([True]) == ["True"]
    mixed = column_format([1, "n/a", 12_000])
    assert not mixed.numeric and [mixed(v) for v in (1, "n/a", 12_000)] == ["1", "n/a", "12,000"]
    assert _cells(["a|b", "x\ny"]) == ["a\\|b", "x y"]
    np = pytest.importorskip("numpy")
    assert _cells([np.int64(140_544), np.float64(35136.0)]) == ["140,544", "35,136"]


# -- markdown and HTML ------------------------------------------------------------


ROWS = [
    {"type": "Q4_1", "elements": 106_168_320, "ms": 96.81178},
    {"type": "F32", "elements": 35136, "ms": 101.1866},
]


def test_markdown_table_alignment_and_formats():
    md = markdown_table(ROWS)
    assert md.splitlines() == [
        "| type | elements | ms |",
        "| :--- | ---: | ---: |",
        "| Q4_1 | 106,168,320 | 96.8 |",
        "| F32 | 35,136 | 101.2 |",
    ]


def test_html_tables_scroll_and_alignment_classes():
    page = to_html("# t\n\n" + markdown_table(ROWS) + "\n\nafter\n\n" + markdown_table(ROWS))
    assert page.count('<div class="table-scroll" style="overflow-x:auto"><table>') == 2
    assert page.count("</table></div>") == 2
    assert '<th class="text">type</th>' in page and '<th class="num">elements</th>' in page
    assert '<td class="text">F32</td>' in page and '<td class="num">35,136</td>' in page
    assert 'style="text-align' not in page
    assert ".table-scroll { overflow-x: auto" in page and "td.num { text-align: right" in page


# -- a results folder -------------------------------------------------------------


def _executed_notebook(path: Path, title: str) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("n = 3", metadata={"tags": ["parameters"]}, execution_count=1),
            new_markdown_cell(f"# {title}\n\nWhat it shows."),
            new_code_cell(
                "print(n)",
                execution_count=2,
                outputs=[new_output("stream", name="stdout", text="3\n")],
            ),
        ]
    )
    nbformat.write(nb, str(path))


def _status(out: Path, name: str, device: str, **kw) -> dict:
    r = NotebookResult(
        name,
        device,
        kw.pop("ok", True),
        kw.pop("seconds", 1.25),
        kw.pop("output", ""),
        error=None,
        run_id="20260101T000000-abcdef",
        started="2026-01-01T00:00:00+00:00",
        parameters={"n": 3},
        state="ok",
        notebook_sha256="0" * 64,
        code={"commit": "abc1234", "dirty": False, "diff": None},
    )
    for k, v in kw.items():
        setattr(r, k, v)
    status = {**r.status(), "finished": "2026-01-01T00:00:02+00:00"}
    atomic_write_text(out / name / f"status_{device}.json", dump_json(status))
    return status


@pytest.fixture()
def results(tmp_path, monkeypatch) -> Path:
    """01_demo ran ok on cpu (with its executed notebook) and timed out on cuda; 02_hand by hand."""
    monkeypatch.setenv("QLIB_RUN_ID", "20260101T000000-abcdef")
    monkeypatch.delenv("QLIB_NOTEBOOK", raising=False)
    out = tmp_path / "results"
    for device in ("cpu", "cuda"):
        w = ResultWriter("01_demo", params={"device": device, "n": 3}, output_dir=out)
        w.save_table(
            [
                {"name": "a", "count": 140_544, "ms": 1.5},
                {"name": "b", "count": 35136, "ms": 22.25},
            ],
            "counts",
            key=True,
            caption="counts",
        )
        w.save_table([{"x": 1}], "extra")
        w.save_json({"k": 1}, "raw")
        w.finding("most", "a has {c} of them.", table="counts", c=140_544)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1])
    w.save_plot(fig, "line", caption="a line")  # on cuda
    plt.close(fig)
    _executed_notebook(out / "01_demo.ipynb", "Demo")
    _executed_notebook(out / "01_demo_cuda.ipynb", "Demo")
    _status(out, "01_demo", "cpu", output="01_demo.ipynb")
    _status(
        out,
        "01_demo",
        "cuda",
        ok=False,
        output="01_demo_cuda.ipynb",
        state="timeout",
        error="CellTimeoutError: A cell timed out",
        cell_index=3,
    )
    ResultWriter("02_hand", params={"device": "cpu"}, output_dir=out).save_table(
        [{"v": 0.5}], "v", key=True
    )
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "03_never.ipynb").write_text(
        nbformat.writes(new_notebook(cells=[new_markdown_cell("# Never run")]))
    )
    return out


def _build(out: Path) -> Path:
    return report.build(out, notebooks_dir=out.parent / "notebooks")


def test_build_renders_notebook_pages_and_links_them(results):
    md = _build(results).read_text()
    page = results / "01_demo.html"
    assert page.is_file() and (results / "01_demo_cuda.html").is_file()
    text = page.read_text()
    assert text.lower().startswith("<!doctype html>") and "print" in text and "Demo" in text
    assert "[executed notebook](01_demo.html) ([.ipynb](01_demo.ipynb))" in md
    assert "[executed notebook](01_demo_cuda.html) ([.ipynb](01_demo_cuda.ipynb))" in md
    html = (results / "REPORT.html").read_text()
    assert '<a href="01_demo.html">executed notebook</a>' in html
    assert '<a href="01_demo.ipynb">.ipynb</a>' in html
    # the key table, formatted per column and aligned
    assert "| name | count | ms |\n| :--- | ---: | ---: |" in md
    assert "| a | 140,544 | 1.50 |" in md and "| b | 35,136 | 22.25 |" in md
    assert '<td class="num">35,136</td>' in html and "table-scroll" in html
    assert "[index.json](index.json)" in md


def test_notebook_pages_rendered_once_and_failures_noted(results, monkeypatch):
    _build(results)
    page = results / "01_demo.html"
    before = page.read_bytes()

    def boom():
        raise RuntimeError("no exporter")

    monkeypatch.setattr(report, "_exporter", boom)
    md = _build(results).read_text()  # up to date: not rendered again
    assert page.read_bytes() == before and "[executed notebook](01_demo.html)" in md
    # a changed notebook that nbconvert cannot render: a note, the old page gone, a report
    _executed_notebook(results / "01_demo.ipynb", "Demo, changed")
    md = _build(results).read_text()
    assert not page.exists()
    assert (
        "[executed notebook (.ipynb)](01_demo.ipynb) (no HTML page: nbconvert failed: "
        "RuntimeError: no exporter)"
    ) in md
    entry = json.loads((results / "index.json").read_text())["runs"][0]
    assert entry["files"]["html"] is None and "RuntimeError" in entry["files"]["html_note"]
    monkeypatch.undo()
    (results / "01_demo_cuda.ipynb").write_text("{not json")  # unreadable: noted, no failure
    md = _build(results).read_text()
    assert page.is_file() and "[executed notebook](01_demo.html)" in md
    assert "[executed notebook (.ipynb)](01_demo_cuda.ipynb) (no HTML page: nbconvert" in md


def test_index_json_entries(results):
    _build(results)
    index = json.loads((results / "index.json").read_text())
    assert index["schema"] == report.INDEX_SCHEMA and index["report"]["html"] == "REPORT.html"
    runs = {(r["notebook"], r["device"]): r for r in index["runs"]}
    assert list(runs) == [("01_demo", "cpu"), ("01_demo", "cuda"), ("02_hand", "cpu")]
    assert index["not_run"] == ["03_never"]

    cpu = runs["01_demo", "cpu"]
    assert cpu["state"] == "ok" and cpu["ok"] is True and cpu["seconds"] == 1.25
    assert cpu["title"] == "Demo" and cpu["failure"] is None and not cpu["stale"]
    assert cpu["parameters"] == {"n": 3} and cpu["notebook_params"] == {"device": "cpu", "n": 3}
    assert cpu["commit"] == "abc1234" and cpu["code"]["dirty"] is False
    assert cpu["run_id"] == "20260101T000000-abcdef" and cpu["finished"]
    assert cpu["findings"] == [
        {"key": "most", "sentence": "a has 140544 of them.", "table": "counts"}
    ]
    files = cpu["files"]
    assert files["executed_notebook"] == "01_demo.ipynb" and files["html"] == "01_demo.html"
    assert files["status"] == "01_demo/status_cpu.json" and files["meta"] == "01_demo/meta_cpu.json"
    assert [(t["stem"], t["csv"], t["key"]) for t in files["tables"]] == [
        ("counts", "01_demo/counts_cpu.csv", True),
        ("extra", "01_demo/extra_cpu.csv", False),
    ]
    assert files["json"] == [{"stem": "raw", "json": "01_demo/raw_cpu.json"}]
    assert files["plots"] == []
    for rel in [files["executed_notebook"], files["html"], files["status"], files["meta"]]:
        assert (results / rel).is_file(), rel
    for t in files["tables"]:
        assert (results / t["csv"]).is_file() and (results / t["json"]).is_file()

    cuda = runs["01_demo", "cuda"]
    assert cuda["state"] == "timeout" and cuda["ok"] is False
    assert cuda["error"].startswith("CellTimeoutError")
    assert cuda["failure"].startswith("timeout at cell #3")
    assert cuda["files"]["plots"] == [
        {"stem": "line", "png": "01_demo/line_cuda.png", "caption": "a line"}
    ]
    assert (results / cuda["files"]["plots"][0]["png"]).is_file()

    hand = runs["02_hand", "cpu"]
    assert hand["state"] == "by hand" and hand["ok"] is None and hand["seconds"] is None
    assert hand["files"]["status"] is None and hand["files"]["executed_notebook"] is None
    assert hand["commit"] == (hand["code"] or {}).get("commit")


# -- make clean-results -----------------------------------------------------------


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


@pytest.mark.skipif(not (shutil.which("make") and shutil.which("git")), reason="needs make, git")
def test_make_clean_results_keeps_committed_results_unless_forced(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    _git(tmp_path, "init", "-q")
    atomic_write_text(tmp_path / "results" / "01_x" / "t_cpu.csv", "a\n1\n")
    atomic_write_text(tmp_path / "results" / "REPORT.md", "# r\n")
    _git(tmp_path, "add", "results/01_x/t_cpu.csv")
    atomic_write_text(tmp_path / "results" / "new.txt", "untracked\n")

    def make(*args: str) -> subprocess.CompletedProcess:
        cmd = ["make", "--no-print-directory", "clean-results", *args]
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)

    r = make()
    assert r.returncode != 0
    assert "would delete 3 file(s)" in r.stdout and "results/01_x/t_cpu.csv" in r.stdout
    assert "FORCE=1" in r.stdout
    assert sorted(p.name for p in (tmp_path / "results").rglob("*") if p.is_file()) == [
        "REPORT.md",
        "new.txt",
        "t_cpu.csv",
    ]
    r = make("FORCE=1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "results").is_dir() and not list((tmp_path / "results").iterdir())
    # untracked results only: deleted without FORCE
    _git(tmp_path, "rm", "-q", "--cached", "results/01_x/t_cpu.csv")
    atomic_write_text(tmp_path / "results" / "02_y" / "u_cpu.csv", "a\n")
    atomic_write_text(tmp_path / "results" / ".hidden.partial.ipynb", "{}")
    r = make()
    assert r.returncode == 0, r.stdout + r.stderr
    assert not list((tmp_path / "results").iterdir())
