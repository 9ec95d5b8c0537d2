"""Where a sweep's points run: on this machine (``local``) or on a Dask cluster (``dask``).

A point is a ``Job``: one notebook, its parameters and the folder it writes to. ``run_job``
runs it wherever it lands (this process, a process of a local pool, a Dask worker) and
records where in its status: the executor, the host, the Dask worker, the machine
(``qlib.suite.machine.summary``) and how long it waited for the host.

The host rule (``qlib.suite.hostslot``): a timing-sensitive point runs alone on its host,
whatever the executor, with no cluster configuration.

Executors:

- ``run_local(jobs, workers=1)``: in this process one after another, or ``workers``
  processes of a spawn pool;
- ``run_dask(jobs, workers=N)``: a ``distributed.LocalCluster`` of N worker processes,
  one thread each; ``scheduler=ADDRESS``: the workers of an existing cluster. Each point
  is one task (``retries=0``); a point whose worker dies is marked ``kernel died`` with
  the scheduler's reason.

A process runs one point at a time (``_PROCESS_LOCK``: the runner sets environment
variables that the notebook's kernel inherits), so a Dask worker started with several
threads still runs its points one by one.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .hostslot import host_name, host_slot
from .machine import machine_info, summary
from .results import atomic_write_text, device_tag, dump_json, now
from .runner import DIED, NotebookResult, _error_of, kernel_spec, run_notebook

EXECUTORS = ("local", "dask")
_PROCESS_LOCK = threading.Lock()


@dataclass
class Job:
    """One point to run: ``notebook`` with ``parameters`` into ``output_dir``."""

    notebook: Path
    output_dir: Path  # the point's folder (papermill's output and the ResultWriter's dir)
    parameters: dict[str, Any]
    point: str  # the point's id
    timing: bool = False  # timing-sensitive: alone on its host
    timeout: float | None = None
    run_id: str | None = None
    code: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"{self.notebook.stem} {self.point}"


def _dask_worker() -> str | None:
    try:
        from distributed import get_worker

        return get_worker().address
    except (ImportError, ValueError):
        return None


def run_job(job: Job, executor: str = "local", progress: bool = False) -> NotebookResult:
    """Run one point here; never raises for the notebook's failure (``run_notebook``)."""
    provenance: dict[str, Any] = {
        "executor": executor,
        "host": host_name(),
        "worker": _dask_worker() if executor == "dask" else None,
        "machine": summary(machine_info()),
        "point": job.point,
    }
    with _PROCESS_LOCK, host_slot(job.timing) as waited, kernel_spec():
        return run_notebook(
            job.notebook,
            job.output_dir,
            job.parameters,
            timeout=job.timeout,
            progress=progress,
            run_id=job.run_id,
            code=job.code,
            provenance={**provenance, "waited_s": waited},
        )


def lost_result(job: Job, exc: BaseException, executor: str) -> NotebookResult:
    """The result of a point whose process died or was lost: written as its status."""
    err, _ = _error_of(exc)
    device = device_tag(job.parameters.get("device", "cpu"))
    r = NotebookResult(
        job.notebook.stem,
        device,
        False,
        0.0,
        "",
        error=f"{err} (the {executor} worker running it was lost)",
        run_id=job.run_id,
        parameters=job.parameters,
        code=job.code,
        executor=executor,
        point=job.point,
    )
    r.state = DIED
    status = Path(job.output_dir) / job.notebook.stem / f"status_{device}.json"
    try:
        old = json.loads(status.read_text())
    except (OSError, ValueError):
        old = {}
    if old.get("run_id") == job.run_id:  # it started: keep where and when
        for k in ("started", "host", "worker", "machine", "notebook_sha256", "waited_s"):
            if old.get(k) is not None:
                setattr(r, k, old[k])
    atomic_write_text(status, dump_json({**r.status(), "finished": now()}))
    return r


OnResult = Callable[[Job, NotebookResult], None]


def run_local(
    jobs: list[Job], on_result: OnResult, *, workers: int = 1, progress: bool = True
) -> dict[str, Any]:
    """Run ``jobs`` on this machine: one by one here, or in ``workers`` spawned processes."""
    if workers <= 1:
        for job in jobs:
            on_result(job, run_job(job, "local", progress=progress))
        return {"executor": "local", "workers": 1}
    ctx = multiprocessing.get_context("spawn")  # no fork of zmq/asyncio state
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = {pool.submit(run_job, job, "local"): job for job in jobs}
        for fut in concurrent.futures.as_completed(futures):
            job = futures[fut]
            try:
                r = fut.result()
            except Exception as exc:  # the pool's process died
                r = lost_result(job, exc, "local")
            on_result(job, r)
    return {"executor": "local", "workers": workers}


def run_dask(
    jobs: list[Job],
    on_result: OnResult,
    *,
    workers: int = 2,
    scheduler: str | None = None,
    log: Callable[..., Any] = print,
) -> dict[str, Any]:
    """Run ``jobs`` as Dask tasks: on a new LocalCluster of ``workers`` processes (one
    thread each), or on the cluster whose scheduler is at ``scheduler``."""
    try:
        import dask
        from distributed import Client, LocalCluster, as_completed
    except ImportError as exc:
        raise SystemExit(
            f"--executor dask needs dask[distributed] ({exc}): pip install 'dask[distributed]'"
        ) from None
    cluster = None
    if scheduler:
        client = Client(scheduler)
    else:
        # a point whose worker dies fails at once (the scheduler would rerun it elsewhere)
        with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
            cluster = LocalCluster(
                n_workers=workers, processes=True, threads_per_worker=1, dashboard_address=None
            )
        client = Client(cluster)
    try:
        names = client.run(host_name)  # worker address -> its host's name
        hosts = sorted(set(names.values()))
        where = {
            "executor": "dask",
            "scheduler": client.scheduler.address,
            "cluster": "LocalCluster" if cluster is not None else "external",
            "workers": len(names),
            "hosts": hosts,
        }
        log(
            f"dask: {where['workers']} worker(s) on {', '.join(hosts) or 'no host yet'} "
            f"({where['cluster']}, scheduler {where['scheduler']})",
            flush=True,
        )
        futures = {
            client.submit(
                run_job, job, "dask", key=f"qlib-{job.run_id}-{i}", pure=False, retries=0
            ): job
            for i, job in enumerate(jobs)
        }
        for fut in as_completed(futures):
            job = futures[fut]
            try:
                r = fut.result()
            except Exception as exc:  # the worker died or the task was lost
                r = lost_result(job, exc, "dask")
            on_result(job, r)
        return where
    finally:
        client.close()
        if cluster is not None:
            # a worker slow to exit (a loaded machine) is killed: that is no news
            nanny_log = logging.getLogger("distributed.nanny")
            level = nanny_log.level
            nanny_log.setLevel(logging.ERROR)
            try:
                cluster.close()
            finally:
                nanny_log.setLevel(level)
