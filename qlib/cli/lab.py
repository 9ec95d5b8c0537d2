"""``python -m qlib lab``: JupyterLab on the project's notebooks, with the project's kernel."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from .. import models

# the checkout's notebooks/ (data/ sits beside it: qlib.models.DATA_DIR)
NOTEBOOKS_DIR = models.DATA_DIR.parent / "notebooks"
FIX = "install it with `pip install -e .[lab]` (or `make setup`)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lab",
        usage="python -m qlib lab [-h] [JUPYTERLAB ARGS ...]",
        help="open the notebooks in JupyterLab (the venv's python3 kernel)",
        description="Start JupyterLab on notebooks/ with this Python (the venv that `make "
        "setup` builds, whose kernelspec python3 runs qlib). Every other argument goes to "
        "JupyterLab, e.g. --no-browser --port 8899. `make lab` runs this.",
        epilog="runs: python -m jupyterlab --notebook-dir notebooks [--allow-root, as root] "
        "[ARGS...]",
    )
    p.set_defaults(func=run_lab, passthrough=True)


def command(extra: list[str]) -> list[str]:
    """The command line ``lab`` executes (checks that JupyterLab and notebooks/ are there)."""
    if importlib.util.find_spec("jupyterlab") is None:
        raise ImportError(f"JupyterLab is not installed in {sys.prefix}: {FIX}")
    if not NOTEBOOKS_DIR.is_dir():
        raise FileNotFoundError(
            f"{NOTEBOOKS_DIR}: no notebooks folder (qlib lab runs from the project's checkout)"
        )
    argv = [sys.executable, "-m", "jupyterlab", "--notebook-dir", str(NOTEBOOKS_DIR)]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in extra:
        argv.append("--allow-root")  # containers run as root; JupyterLab refuses it otherwise
    return argv + extra


def kernel_note() -> str | None:
    """A hint when the venv lacks ipykernel or its own python3 kernelspec (`make setup`)."""
    if importlib.util.find_spec("ipykernel") is None:
        return f"note: ipykernel is not installed, the notebooks will have no kernel: {FIX}"
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
    if not spec.exists():
        return (
            f"note: no kernelspec python3 in {sys.prefix}; `{sys.executable} -m ipykernel "
            "install --sys-prefix --name python3` (or `make setup`) installs it"
        )
    return None


def run_lab(args: argparse.Namespace) -> int:
    extra = list(getattr(args, "extra", []))
    if extra[:1] == ["--"]:
        extra = extra[1:]
    argv = command(extra)
    if note := kernel_note():
        print(note, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)  # JupyterLab replaces this process; Ctrl-C stops it
    return 0  # not reached
