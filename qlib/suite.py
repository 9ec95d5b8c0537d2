"""``python -m qlib suite run|report|list``: run the experiment notebooks headless.

Each ``notebooks/NN_name.ipynb`` is executed by papermill, on a Jupyter kernel
that runs this interpreter (``sys.executable``), into ``DIR/NN_name.ipynb``
(``DIR/NN_name_<device>.ipynb`` for a device other than cpu); its tables and
plots go to ``DIR/NN_name/`` through ``qlib.results``. The executed notebook is
written to a hidden temporary file and renamed at the end, so a failure or an
interrupt never truncates an earlier result; a failing notebook is kept with
its error cell, and the run goes on with the others. Then ``qlib.report.build``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .machine import REPO_ROOT
from .results import (
    NOTEBOOK_ENV,
    RESULTS_ENV,
    RUN_ID_ENV,
    atomic_write_text,
    device_tag,
    dump_json,
    now,
    results_dir,
)

NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
KERNEL_NAME = "python3"


# -- parameters -------------------------------------------------------------


def parse_value(text: str) -> Any:
    """A command-line value as a scalar: int, float, bool, None, JSON list/dict, or string.

    Quote a value to keep it a string: ``-p tag "'42'"``.
    """
    s = text.strip()
    low = s.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null", "~"):
        return None
    for conv in (int, float):
        try:
            return conv(s)
        except ValueError:
            pass
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        return s[1:-1]
    if s[:1] in "[{":
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            import yaml  # flow style: [a, b], {k: v}

            try:
                return yaml.safe_load(s)
            except yaml.YAMLError:
                pass
    return text


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


# -- selection --------------------------------------------------------------


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


# -- running ----------------------------------------------------------------


@dataclass
class NotebookResult:
    """How one notebook run went."""

    name: str
    device: str
    ok: bool
    seconds: float
    output: str  # executed notebook, relative to the output dir ("" if none was written)
    error: str | None = None  # "ValueError: ..." (first line)
    cell: int | None = None  # execution count of the failing cell
    run_id: str | None = None
    started: str | None = None
    parameters: dict[str, Any] | None = None

    def error_line(self) -> str:
        where = f"cell In [{self.cell}]: " if self.cell is not None else ""
        return f"{where}{self.error}"


@contextlib.contextmanager
def kernel_spec() -> Iterator[None]:
    """A private ``python3`` kernelspec that runs ``sys.executable``, first on JUPYTER_PATH.

    So notebooks run on this interpreter even where a user-level ``python3``
    kernel points at another one.
    """
    tmp = Path(tempfile.mkdtemp(prefix="qlib-kernel-"))
    spec_dir = tmp / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
        "metadata": {"debugger": True, "supported_encryption": ["curve"]},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(tmp)] + ([old] if old else []))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables (inherited by the kernel) for the duration."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine_config() -> dict[str, Any]:
    """CurveZMQ keys for the kernel's sockets where supported (else ipykernel warns on stderr)."""
    import zmq
    from jupyter_client.manager import KernelManager
    from traitlets.config import Config

    if not (zmq.has("curve") and "transport_encryption" in KernelManager.class_trait_names()):
        return {}
    auto = {"transport_encryption": "auto"}
    return {"config": Config({"KernelManager": auto, "AsyncKernelManager": auto})}


def _error_of(exc: BaseException) -> tuple[str, int | None]:
    """(first line of the error, failing cell's execution count) for any run failure."""
    from papermill.exceptions import PapermillExecutionError

    if isinstance(exc, PapermillExecutionError):
        lines = str(exc.evalue).strip().splitlines() or [""]
        return f"{exc.ename}: {lines[0]}".rstrip(": "), exc.exec_count
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}".rstrip(": "), None


def run_notebook(
    path: Path,
    output_dir: Path,
    parameters: dict[str, Any],
    *,
    timeout: float | None = None,
    progress: bool = True,
    run_id: str | None = None,
) -> NotebookResult:
    """Execute one notebook into ``output_dir``; never raises for a notebook's failure."""
    import papermill

    path, output_dir = Path(path), Path(output_dir)
    device = device_tag(parameters.get("device", "cpu"))
    final = output_dir / output_name(path.stem, device)
    partial = output_dir / f".{final.stem}.partial.ipynb"
    output_dir.mkdir(parents=True, exist_ok=True)
    result = NotebookResult(
        path.stem, device, False, 0.0, "", run_id=run_id, started=now(), parameters=parameters
    )
    env = {
        RESULTS_ENV: str(output_dir.resolve()),
        NOTEBOOK_ENV: path.stem,
        RUN_ID_ENV: run_id or "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    try:
        with _environ(**env):
            papermill.execute_notebook(
                str(path),
                str(partial),
                parameters=parameters,
                kernel_name=KERNEL_NAME,
                progress_bar=progress,
                cwd=str(path.parent),
                execution_timeout=timeout,
                **_engine_config(),
            )
        result.ok = True
    except Exception as exc:  # the notebook failed: record it, keep going
        result.error, result.cell = _error_of(exc)
    except BaseException:  # interrupted: leave the earlier executed notebook as it was
        partial.unlink(missing_ok=True)
        raise
    result.seconds = round(time.perf_counter() - t0, 2)
    if partial.exists():
        os.replace(partial, final)
        result.output = final.name
    status = output_dir / path.stem / f"status_{device}.json"
    atomic_write_text(status, dump_json({**asdict(result), "finished": now()}))
    return result


def _run_in_worker(args: tuple) -> NotebookResult:
    path, output_dir, parameters, timeout, run_id = args
    with kernel_spec():
        return run_notebook(
            path, output_dir, parameters, timeout=timeout, progress=False, run_id=run_id
        )


def select_parameters(path: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The ``given`` parameters that the notebook declares (all of them if it declares none)."""
    declared = notebook_parameters(path)
    if not declared:
        return dict(given)
    return {k: v for k, v in given.items() if k in declared}


def run_suite(
    notebooks: list[Path],
    output_dir: Path,
    parameters: dict[str, Any] | None = None,
    *,
    workers: int = 1,
    timeout: float | None = None,
    progress: bool = True,
    log=print,
) -> list[NotebookResult]:
    """Run ``notebooks`` (each with the parameters it declares) and return how each went."""
    parameters = dict(parameters or {})
    output_dir = Path(output_dir)
    run_id = datetime.now().strftime("%Y%m%dT%H%M%S-") + secrets.token_hex(3)
    per_nb = [select_parameters(p, parameters) for p in notebooks]
    unused = set(parameters) - {k for ps in per_nb for k in ps} - {"device"}
    if unused:
        raise SystemExit(f"parameter(s) {', '.join(sorted(unused))} declared by no notebook run")
    n = len(notebooks)
    results: list[NotebookResult] = []

    def report(i: int, r: NotebookResult) -> None:
        state = "ok" if r.ok else f"FAILED ({r.error_line()})"
        log(f"[{i}/{n}] {r.name} {state} {r.seconds:.1f} s", flush=True)

    if workers <= 1:
        with kernel_spec():
            for i, (path, params) in enumerate(zip(notebooks, per_nb, strict=True), 1):
                if progress:
                    log(f"[{i}/{n}] {path.stem} ...", flush=True)
                r = run_notebook(
                    path, output_dir, params, timeout=timeout, progress=progress, run_id=run_id
                )
                results.append(r)
                report(i, r)
        return results

    ctx = multiprocessing.get_context("spawn")  # no fork of zmq/asyncio state
    jobs = [(p, output_dir, ps, timeout, run_id) for p, ps in zip(notebooks, per_nb, strict=True)]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(_run_in_worker, j): j[0] for j in jobs}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            try:
                r = fut.result()
            except Exception as exc:  # the worker itself died
                path = futures[fut]
                err, _ = _error_of(exc)
                r = NotebookResult(path.stem, "?", False, 0.0, "", error=err, run_id=run_id)
            results.append(r)
            report(i, r)
    order = {p.stem: k for k, p in enumerate(notebooks)}
    return sorted(results, key=lambda r: order[r.name])


# -- command line -----------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    from . import report

    params = {k: parse_value(v) for k, v in (args.param or [])}
    if args.device:
        params["device"] = args.device
    notebooks = discover(args.notebooks, args.only)
    if not notebooks:
        print(f"no notebooks in {args.notebooks}", file=sys.stderr)
        return 2
    out = Path(args.output_dir)
    t0 = time.perf_counter()
    results = run_suite(
        notebooks,
        out,
        params,
        workers=args.workers,
        timeout=args.timeout,
        progress=args.workers <= 1 and not args.quiet,
    )
    failed = [r for r in results if not r.ok]
    print(
        f"{len(results) - len(failed)} of {len(results)} notebooks ok in "
        f"{time.perf_counter() - t0:.1f} s; results in {out}"
    )
    rc = 0
    try:
        md = report.build(out, notebooks_dir=args.notebooks)
        print(f"report: {md} and {md.with_suffix('.html')}")
    except Exception as exc:  # keep the run's verdict; say why the report is missing
        print(f"report failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        rc = 1
    if failed:
        print(f"{len(failed)} notebook(s) failed:", file=sys.stderr)
        for r in failed:
            where = f" ({out / r.output})" if r.output else ""
            print(f"  {r.name}: {r.error_line()}{where}", file=sys.stderr)
        rc = 1
    return rc


def _cmd_report(args: argparse.Namespace) -> int:
    from . import report

    md = report.build(Path(args.output_dir), notebooks_dir=args.notebooks)
    print(f"report: {md} and {md.with_suffix('.html')}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    for path in discover(args.notebooks, args.only):
        title, _ = notebook_intro(path)
        print(f"{path.stem}  {title}")
        for name, p in notebook_parameters(path).items():
            default = p.get("default")
            hint = f"  # {p['help']}" if p.get("help") else ""
            print(f"    {name} = {default}{hint}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("suite", help="run the experiment notebooks, build the report")
    ssub = p.add_subparsers(dest="suite_command", required=True, metavar="ACTION")

    def common(q: argparse.ArgumentParser, output: bool = True) -> None:
        q.add_argument(
            "--notebooks",
            type=Path,
            default=NOTEBOOKS_DIR,
            metavar="DIR",
            help="where the notebooks are (default: notebooks/)",
        )
        if output:
            q.add_argument(
                "--output-dir",
                default=str(results_dir()),
                metavar="DIR",
                help="where results go (default: $QLIB_RESULTS_DIR or results/)",
            )

    r = ssub.add_parser("run", help="execute notebooks with papermill, then build the report")
    common(r)
    r.add_argument(
        "--only",
        nargs="+",
        action="extend",
        metavar="NAME",
        help="notebook stems or prefixes (e.g. 04 or 04_index_pos_misuse)",
    )
    r.add_argument(
        "--device", choices=("cpu", "cuda", "mps"), help="the notebooks' `device` parameter"
    )
    r.add_argument(
        "-p",
        "--param",
        nargs=2,
        action="append",
        metavar=("KEY", "VALUE"),
        help="set a parameter (value parsed as int/float/bool/None/JSON, else string)",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="run N notebooks in parallel processes (no per-cell progress bars)",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="fail a cell that runs longer than S seconds",
    )
    r.add_argument("-q", "--quiet", action="store_true", help="no per-notebook progress bars")
    r.set_defaults(func=_cmd_run)

    rep = ssub.add_parser("report", help="rebuild REPORT.md and REPORT.html from saved results")
    common(rep)
    rep.set_defaults(func=_cmd_report)

    ls = ssub.add_parser("list", help="list the notebooks and their parameters")
    common(ls, output=False)
    ls.add_argument("--only", nargs="+", action="extend", metavar="NAME")
    ls.set_defaults(func=_cmd_list)
