"""``python -m qlib suite run|report|list``: run the experiment notebooks headless.

Each ``notebooks/NN_name.ipynb`` is executed by papermill, on a Jupyter kernel
that runs this interpreter (``sys.executable``), into ``DIR/NN_name.ipynb``
(``DIR/NN_name_<device>.ipynb`` for a device other than cpu); its tables and
plots go to ``DIR/NN_name/`` through ``qlib.suite.results``. The executed notebook is
written to a hidden temporary file and renamed at the end, so a failure or an
interrupt never truncates an earlier result; a failing notebook (an exception,
a cell past ``--timeout``, a kernel that dies, SIGKILL included) is kept with
its error cell, its ``DIR/NN_name/status_<device>.json`` says how it failed,
and the run goes on with the others. Then ``qlib.suite.report.build``.

``status_<device>.json`` is written when a notebook starts (state "running")
and when it ends; it records the parameters given, a hash of the notebook and
the code's commit (``code_version``). ``--resume`` skips a notebook whose last
run ended ok with the same three (``resume_check``) and runs the others.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .catalogue import KERNEL_NAME, notebook_parameters, output_name
from .hostslot import host_slot, is_timing
from .machine import REPO_ROOT, git_commit
from .params import check_type, default_value
from .results import (
    NOTEBOOK_ENV,
    RESULTS_ENV,
    RUN_ID_ENV,
    atomic_write_text,
    device_tag,
    drop_earlier,
    dump_json,
    now,
)

# -- running ----------------------------------------------------------------


# NotebookResult.state
RUNNING, OK, ERROR, TIMEOUT, DIED, INTERRUPTED = (
    "running",
    "ok",
    "error",
    "timeout",
    "kernel died",
    "interrupted",
)
NOT_FINISHED = "did not finish: the runner stopped (killed or crashed) while it ran"


@dataclass
class NotebookResult:
    """How one notebook run went (saved as ``DIR/NN_name/status_<device>.json``)."""

    name: str
    device: str
    ok: bool
    seconds: float
    output: str  # executed notebook, relative to the output dir ("" if none was written)
    error: str | None = None  # "ValueError: ..." (first line)
    cell: int | None = None  # execution count of the failing cell
    run_id: str | None = None
    started: str | None = None
    parameters: dict[str, Any] | None = None  # as given to papermill
    state: str = RUNNING  # running, ok, error, timeout, kernel died, interrupted
    cell_index: int | None = None  # 1-based position of the failing cell in the executed notebook
    notebook_sha256: str | None = None  # of the source notebook
    code: dict[str, Any] | None = None  # code_version() of the run
    # where it ran (a sweep's points; None for a plain run): "local" or "dask", the host's
    # name, the Dask worker's address, the machine's summary line, the sweep point's id; and,
    # for every run, the seconds spent waiting for the host (qlib.suite.hostslot.host_slot)
    executor: str | None = None
    host: str | None = None
    worker: str | None = None
    machine: str | None = None
    point: str | None = None
    waited_s: float | None = None
    skipped: bool = False  # --resume found it done: nothing ran (not saved in the status)

    def error_line(self) -> str:
        if self.cell is not None:
            where = f"cell In [{self.cell}]: "
        elif self.cell_index is not None:
            where = f"cell #{self.cell_index}: "
        else:
            where = ""
        return f"{where}{self.error}"

    def status(self) -> dict[str, Any]:
        d = asdict(self)
        del d["skipped"]
        return d


def failure_reason(status: dict[str, Any], quote: str = "") -> str:
    """'timeout at cell In [3]: CellTimeoutError: ...' for a failed run's saved status (its
    error between ``quote`` marks: the report's Markdown takes backticks)."""
    state = status.get("state")
    how = {"running": "did not finish", None: "error"}.get(state, state)
    if status.get("cell") is not None:
        how += f" at cell In [{status['cell']}]"
    elif status.get("cell_index") is not None:
        how += f" at cell #{status['cell_index']}"
    return f"{how}: {quote}{status.get('error')}{quote}"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def code_version(repo: Path = REPO_ROOT) -> dict[str, Any] | None:
    """The code a run used: ``{"commit", "dirty", "diff"}`` or None (no git, no $QLIB_COMMIT).

    ``diff``: for a dirty checkout, a hash of ``git diff HEAD`` (tracked files),
    so two runs on the same commit with different uncommitted changes differ.
    """
    info = git_commit(repo)
    if info is None or not info.get("commit"):
        return None
    diff = None
    if info.get("dirty"):
        try:
            out = subprocess.run(
                ["git", "diff", "HEAD", "--no-ext-diff", "--binary"],
                cwd=repo,
                capture_output=True,
                timeout=60,
            )
            diff = hashlib.sha256(out.stdout).hexdigest()[:16] if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            diff = None
        if diff is None:
            diff = "unknown"
    return {**info, "diff": diff}


def _same_json(a: Any, b: Any) -> bool:
    return json.loads(dump_json(a)) == json.loads(dump_json(b))


def resume_check(
    path: Path,
    output_dir: Path,
    parameters: dict[str, Any],
    code: dict[str, Any] | None,
) -> tuple[bool, str]:
    """(done, why): whether the notebook's last run in ``output_dir`` can stand for this one.

    Done means: its status says ok, with the same parameters, the same notebook
    (hash) and the same code (commit, and uncommitted diff), and the executed
    notebook is there. ``why`` says what differs, or which run it was.
    """
    path, output_dir = Path(path), Path(output_dir)
    device = device_tag(parameters.get("device", "cpu"))
    status_path = output_dir / path.stem / f"status_{device}.json"
    try:
        status = json.loads(status_path.read_text())
    except (OSError, ValueError):
        return False, "no earlier run"
    if not status.get("ok"):
        return False, f"last run {status.get('state') or 'failed'}"
    if not (output_dir / (status.get("output") or output_name(path.stem, device))).is_file():
        return False, "executed notebook missing"
    if not _same_json(status.get("parameters") or {}, parameters):
        return False, "other parameters"
    if status.get("notebook_sha256") != file_sha256(path):
        return False, "notebook changed"
    if code is None or code.get("diff") == "unknown":
        return False, "commit unknown"
    if not _same_json(status.get("code"), code):
        return False, "other commit or uncommitted changes"
    return True, f"done in run {status.get('run_id')}"


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
    error = f"{type(exc).__name__}: {lines[0]}".rstrip(": ")
    if _state_of(exc) == DIED:
        error += " (its process ended: killed by a signal, out of memory, or a crash)"
    return error, None


def _state_of(exc: BaseException) -> str:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    if isinstance(exc, CellTimeoutError):
        return TIMEOUT
    if isinstance(exc, DeadKernelError):
        return DIED
    return ERROR


def _last_started_cell(nb_path: Path) -> int | None:
    """1-based position of the last cell papermill started in ``nb_path``.

    (Its execution count is not reliable after a timeout or a dead kernel.)
    """
    import nbformat

    try:
        nb = nbformat.read(str(nb_path), as_version=4)
    except Exception:
        return None
    last = None
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "code" and (cell.metadata.get("papermill") or {}).get("start_time"):
            last = i
    return last


# A kernel that ends before it replies to kernel_info never ran a cell: jupyter_client picks
# free ports and the kernel binds them later, so kernels started side by side (a sweep's
# workers) can collide ("ZMQError: Address already in use"). Such a start is tried again.
KERNEL_START_TRIES = 3


def _kernel_did_not_start(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "before replying to kernel_info" in str(exc)


def _execute(path: Path, partial: Path, parameters: dict[str, Any], timeout: float | None,
             progress: bool) -> None:  # fmt: skip
    """papermill's run of ``path`` into ``partial``, a kernel that did not start started again
    (up to ``KERNEL_START_TRIES`` in all)."""
    import papermill

    for attempt in range(1, KERNEL_START_TRIES + 1):
        try:
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
            return
        except RuntimeError as exc:
            if attempt == KERNEL_START_TRIES or not _kernel_did_not_start(exc):
                raise


def run_notebook(
    path: Path,
    output_dir: Path,
    parameters: dict[str, Any],
    *,
    timeout: float | None = None,
    progress: bool = True,
    run_id: str | None = None,
    code: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
) -> NotebookResult:
    """Execute one notebook into ``output_dir``; never raises for a notebook's failure.

    ``code``: the ``code_version()`` to record (looked up when None). ``provenance``:
    where it runs (``executor``, ``host``, ``worker``, ``machine``, ``point``,
    ``waited_s``: fields of ``NotebookResult``), recorded in the status.
    """
    path, output_dir = Path(path), Path(output_dir)
    device = device_tag(parameters.get("device", "cpu"))
    final = output_dir / output_name(path.stem, device)
    partial = output_dir / f".{final.stem}.partial.ipynb"
    output_dir.mkdir(parents=True, exist_ok=True)
    result = NotebookResult(
        path.stem,
        device,
        False,
        0.0,
        "",
        error=NOT_FINISHED,
        run_id=run_id,
        started=now(),
        parameters=parameters,
        notebook_sha256=file_sha256(path),
        code=code if code is not None else code_version(),
        **(provenance or {}),
    )
    status = output_dir / path.stem / f"status_{device}.json"
    # "running" until it ends: a runner killed meanwhile leaves a failed status behind
    atomic_write_text(status, dump_json(result.status()))
    env = {
        RESULTS_ENV: str(output_dir.resolve()),
        NOTEBOOK_ENV: path.stem,
        RUN_ID_ENV: run_id or "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    t0 = time.perf_counter()
    try:
        with _environ(**env):
            _execute(path, partial, parameters, timeout, progress)
        result.ok, result.state, result.error = True, OK, None
    except Exception as exc:  # the notebook failed: record it, keep going
        result.error, result.cell = _error_of(exc)
        result.state = _state_of(exc)
        if result.cell is None and partial.exists():  # timeout, dead kernel: where it stopped
            result.cell_index = _last_started_cell(partial)
    except BaseException as exc:  # interrupted: leave the earlier executed notebook as it was
        partial.unlink(missing_ok=True)
        result.state = INTERRUPTED
        result.error = f"{type(exc).__name__}: the run was interrupted"
        result.seconds = round(time.perf_counter() - t0, 2)
        atomic_write_text(status, dump_json({**result.status(), "finished": now()}))
        raise
    result.seconds = round(time.perf_counter() - t0, 2)
    if partial.exists():
        os.replace(partial, final)
        result.output = final.name
    if result.ok:  # what an earlier run saved and this one did not is no longer current
        drop_earlier(output_dir / path.stem, device)
    atomic_write_text(status, dump_json({**result.status(), "finished": now()}))
    return result


def _run_alone_if_timing(
    path: Path, output_dir: Path, parameters: dict[str, Any], **kwargs: Any
) -> NotebookResult:
    """``run_notebook`` under the host rule (``hostslot``): a timing notebook alone on the host."""
    with host_slot(is_timing(path)) as waited:
        return run_notebook(path, output_dir, parameters, provenance={"waited_s": waited}, **kwargs)


def _run_in_worker(args: tuple) -> NotebookResult:
    path, output_dir, parameters, timeout, run_id, code = args
    with kernel_spec():
        return _run_alone_if_timing(
            path, output_dir, parameters, timeout=timeout, progress=False, run_id=run_id, code=code
        )


def select_parameters(path: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The ``given`` parameters that the notebook declares (all of them if it declares none).

    With no ``device`` given the run is tagged (and its results filed) as "cpu", so a notebook
    whose own ``device`` default is another (notebook 11's "cuda") gets ``device="cpu"``:
    else it would save under that device's tag, over that device's results.
    """
    declared = notebook_parameters(path)
    if not declared:
        return dict(given)
    chosen = {k: v for k, v in given.items() if k in declared}
    for k, v in chosen.items():
        check_type(v, declared[k].get("default"), f"{path.stem}'s {k}")
    if "device" in declared and "device" not in chosen:
        # (a default that is not a literal: leave the notebook's own)
        if device_tag(default_value(declared["device"].get("default"), "cpu")) != "cpu":
            chosen["device"] = "cpu"
    return chosen


def run_suite(
    notebooks: list[Path],
    output_dir: Path,
    parameters: dict[str, Any] | None = None,
    *,
    workers: int = 1,
    timeout: float | None = None,
    progress: bool = True,
    resume: bool = False,
    log=print,
) -> list[NotebookResult]:
    """Run ``notebooks`` (each with the parameters it declares) and return how each went.

    ``resume``: skip a notebook whose last run in ``output_dir`` ended ok with the
    same parameters, notebook and code (``resume_check``); its result has ``skipped``.
    """
    parameters = dict(parameters or {})
    output_dir = Path(output_dir)
    run_id = datetime.now().strftime("%Y%m%dT%H%M%S-") + secrets.token_hex(3)
    per_nb = [select_parameters(p, parameters) for p in notebooks]
    unused = set(parameters) - {k for ps in per_nb for k in ps} - {"device"}
    if unused:
        raise SystemExit(f"parameter(s) {', '.join(sorted(unused))} declared by no notebook run")
    code = code_version()
    n = len(notebooks)
    results: list[NotebookResult] = []
    todo: list[tuple[Path, dict[str, Any]]] = []
    for path, params in zip(notebooks, per_nb, strict=True):
        done, why = resume_check(path, output_dir, params, code) if resume else (False, "")
        if done:
            device = device_tag(params.get("device", "cpu"))
            r = NotebookResult(path.stem, device, True, 0.0, output_name(path.stem, device))
            r.state, r.skipped, r.parameters, r.code = OK, True, params, code
            results.append(r)
            log(f"[{len(results)}/{n}] {path.stem} skipped: {why}", flush=True)
        else:
            if resume:
                log(f"{path.stem}: to run ({why})", flush=True)
            todo.append((path, params))

    def report(r: NotebookResult) -> None:
        results.append(r)
        state = "ok" if r.ok else f"FAILED ({r.error_line()})"
        wait = f", waited {r.waited_s:.1f} s for the host" if r.waited_s else ""
        log(f"[{len(results)}/{n}] {r.name} {state} {r.seconds:.1f} s{wait}", flush=True)

    if workers <= 1:
        with kernel_spec():
            for path, params in todo:
                if progress:
                    log(f"[{len(results) + 1}/{n}] {path.stem} ...", flush=True)
                report(
                    _run_alone_if_timing(
                        path,
                        output_dir,
                        params,
                        timeout=timeout,
                        progress=progress,
                        run_id=run_id,
                        code=code,
                    )
                )
    elif todo:
        ctx = multiprocessing.get_context("spawn")  # no fork of zmq/asyncio state
        jobs = [(p, output_dir, ps, timeout, run_id, code) for p, ps in todo]
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            futures = {pool.submit(_run_in_worker, j): j for j in jobs}
            for fut in concurrent.futures.as_completed(futures):
                try:
                    r = fut.result()
                except Exception as exc:  # the worker itself died
                    path, params = futures[fut][0], futures[fut][2]
                    err, _ = _error_of(exc)
                    device = device_tag(params.get("device", "cpu"))
                    r = NotebookResult(path.stem, device, False, 0.0, "", error=err, run_id=run_id)
                    r.state = DIED
                report(r)
    order = {p.stem: k for k, p in enumerate(notebooks)}
    return sorted(results, key=lambda r: order[r.name])
