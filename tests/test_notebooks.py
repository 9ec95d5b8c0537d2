"""The notebooks in notebooks/ are jupytext pairs: NAME.ipynb (what papermill runs and JupyterLab
opens) and NAME.py in the py:percent format (what is reviewed and linted), kept in step by the
pairing in jupytext.toml. Each opens on its title, then the `parameters` cell, and has no
outputs (the executed copies go to results/, which is not paired)."""

import json
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
NAMES = sorted(
    {p.stem for p in NOTEBOOKS.glob("*.ipynb")} | {p.stem for p in NOTEBOOKS.glob("*.py")}
)


def sync_hint(name: str) -> str:
    return f"run `jupytext --sync notebooks/{name}.ipynb` (the newer of the two files wins)"


def cells(path: Path) -> list[tuple[str, str, list[str]]]:
    nb = jupytext.read(path)
    return [(c.cell_type, c.source, list(c.metadata.get("tags", []))) for c in nb.cells]


def test_there_are_notebooks():
    assert NAMES, f"no notebook in {NOTEBOOKS}"


def test_every_notebook_is_paired():
    ipynb = {p.stem for p in NOTEBOOKS.glob("*.ipynb")}
    py = {p.stem for p in NOTEBOOKS.glob("*.py")}
    problems = [
        f"notebooks/{n}.ipynb has no notebooks/{n}.py: {sync_hint(n)}" for n in sorted(ipynb - py)
    ]
    problems += [
        f"notebooks/{n}.py has no notebooks/{n}.ipynb: run `jupytext --sync notebooks/{n}.py`"
        for n in sorted(py - ipynb)
    ]
    assert not problems, "\n".join(problems)


def test_config_pairs_notebooks_only():
    from jupytext.config import load_jupytext_configuration_file

    config = load_jupytext_configuration_file(str(ROOT / "jupytext.toml"))
    for name in NAMES:
        for ext in ("ipynb", "py"):
            path = str(NOTEBOOKS / f"{name}.{ext}")
            assert config.default_formats(path), f"jupytext.toml does not pair {path}"
    for path in [ROOT / "results" / "00_smoke.ipynb", ROOT / "results" / "00_smoke_cuda.ipynb"]:
        formats = config.default_formats(str(path))
        assert formats is None, f"jupytext.toml pairs the executed copy {path} ({formats})"


@pytest.mark.parametrize("name", NAMES)
def test_pair_in_sync(name):
    ipynb, py = NOTEBOOKS / f"{name}.ipynb", NOTEBOOKS / f"{name}.py"
    if not (ipynb.exists() and py.exists()):
        pytest.skip("not paired (test_every_notebook_is_paired fails)")
    a, b = cells(ipynb), cells(py)
    where = f"notebooks/{name}.ipynb and notebooks/{name}.py are out of sync"
    assert len(a) == len(b), f"{where}: {len(a)} cells against {len(b)}; {sync_hint(name)}"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x == y, f"{where}: cell {i} differs ({x[0]}: {x[1][:60]!r}...); {sync_hint(name)}"


@pytest.mark.parametrize("name", NAMES)
def test_title_then_parameters(name):
    path = NOTEBOOKS / f"{name}.ipynb"
    if not path.exists():
        pytest.skip("no .ipynb (test_every_notebook_is_paired fails)")
    nb = cells(path)
    assert len(nb) >= 2, f"{path.name}: fewer than two cells"
    kind, source, _ = nb[0]
    assert kind == "markdown" and source.startswith("# "), (
        f"{path.name}: the first cell must be the title, a markdown cell starting with '# '"
    )
    kind, _, tags = nb[1]
    assert kind == "code" and "parameters" in tags, (
        f"{path.name}: the second cell must be the code cell tagged 'parameters' (papermill)"
    )
    tagged = [i for i, (_, _, t) in enumerate(nb) if "parameters" in t]
    assert tagged == [1], f"{path.name}: cells {tagged} are tagged 'parameters', only cell 1 may be"


@pytest.mark.parametrize("name", NAMES)
def test_no_outputs(name):
    path = NOTEBOOKS / f"{name}.ipynb"
    if not path.exists():
        pytest.skip("no .ipynb (test_every_notebook_is_paired fails)")
    nb = json.loads(path.read_text(encoding="utf-8"))
    dirty = [
        i
        for i, c in enumerate(nb["cells"])
        if c["cell_type"] == "code" and (c.get("outputs") or c.get("execution_count") is not None)
    ]
    assert not dirty, (
        f"notebooks/{name}.ipynb has outputs or execution counts in cells {dirty}: clear them "
        f"(`jupyter nbconvert --clear-output --inplace notebooks/{name}.ipynb`); executed copies "
        "belong in results/"
    )
