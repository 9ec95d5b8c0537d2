"""The experiment notebooks: where they are, their parameters, titles and output names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .machine import REPO_ROOT

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
KERNEL_NAME = "python3"  # the Jupyter kernel the suite runs them on


def notebook_parameters(path: Path) -> dict[str, dict[str, Any]]:
    """The ``parameters``-tagged cell's names -> {default, inferred_type_name, help}."""
    import papermill

    return papermill.inspect_notebook(str(path))


def notebook_intro(path: Path) -> tuple[str, str]:
    """(title, one-line intro) from the notebook's first markdown cell."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        title, intro = "", ""
        for line in cell.source.splitlines():
            line = line.strip()
            if not line:
                if intro:
                    break
                continue
            if line.startswith("#") and not title:
                title = line.lstrip("#").strip()
            elif not line.startswith("#"):
                intro = f"{intro} {line}".strip()
        return title or path.stem, intro
    return path.stem, ""


def discover(notebooks_dir: Path = NOTEBOOKS_DIR, only: list[str] | None = None) -> list[Path]:
    """``notebooks_dir/*.ipynb`` sorted; ``only`` keeps stems equal to or starting with a name."""
    paths = sorted(p for p in Path(notebooks_dir).glob("*.ipynb") if not p.name.startswith("."))
    if not only:
        return paths
    chosen = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in only)]
    unmatched = [n for n in only if not any(p.stem == n or p.stem.startswith(n) for p in paths)]
    if unmatched:
        names = ", ".join(p.stem for p in paths) or "none"
        raise SystemExit(f"no notebook matches {', '.join(unmatched)} (notebooks: {names})")
    return chosen


def output_name(stem: str, device: str) -> str:
    """Executed notebook's file name: ``stem.ipynb`` on cpu, ``stem_<device>.ipynb`` otherwise."""
    return f"{stem}.ipynb" if device == "cpu" else f"{stem}_{device}.ipynb"
