"""Parameter sweeps: the cartesian product of a grid, one papermill run per point.

``plan(notebooks, DIR, fixed, grid)`` gives each selected notebook that declares some of
the grid's names one ``Point`` per combination of their values (the names it does not
declare are not its axes; a notebook that declares none is left out). A point runs like
``suite run`` runs a notebook, into a folder of its own::

    DIR/sweep.json                               the last sweep: every point, state, time
    DIR/sweeps/04_index_pos_misuse/
      points.json                                point id -> its grid values, parameters
      steps=4/04_index_pos_misuse.ipynb          executed notebook of the point
      steps=4/04_index_pos_misuse/status_cpu.json, meta_cpu.json, tables, plots
      steps=6/...
      sweep_decode_variants.csv, .png            the sweep view (``VIEWS``), by the report

A point's id names it: ``name=value`` for each axis, joined by commas, in grid order
(``point_id``); a value that does not read back as itself from its text (a path, a list,
a string with other characters than ``[A-Za-z0-9._+-]``, a string that looks like a
number) gets a short hash of the values appended (``model_path=x.gguf,form=f32~1a2b3c4d``)
so two points never share a folder. ``--resume`` skips a point whose folder holds an ok
run at the same parameters, notebook and code (``runner.resume_check``).

``run_sweep`` runs the points through an executor (``qlib.suite.cluster``: ``local`` or
``dask``), writes ``sweep.json`` as points finish and returns its content. The timing
rule (a timing-sensitive point alone on its host) is ``qlib.suite.hostslot``.

Sweep views (``VIEWS``): for a notebook stem, which saved table the report concatenates
over the points (with the point's id and grid values as columns) and which column it
plots against which (``aggregate``, ``plot``, ``build_views``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from . import runner
from .catalogue import notebook_parameters, output_name
from .cluster import EXECUTORS, Job, run_dask, run_local
from .hostslot import is_timing
from .params import check_type, parse_value
from .results import atomic_write_bytes, atomic_write_text, device_tag, dump_json, now

SWEEPS_DIR = "sweeps"  # under the output dir
SUMMARY = "sweep.json"  # in the output dir: the last sweep's summary
POINTS = "points.json"  # in DIR/sweeps/<notebook>/: every point run there
SCHEMA = 1  # of sweep.json and points.json
MAX_ID = 100  # characters of a point id before its hash

# -- sweep views -------------------------------------------------------------


@dataclass(frozen=True)
class SweepView:
    """How the report shows a notebook's sweep: one table, one plot.

    ``table``: the stem of the table each point saved; ``columns``: the columns kept
    (None: all), after the point's id and grid values; ``where``: keep rows whose
    column equals the value; the plot draws ``y`` against ``x``, one line per value of
    ``series`` (columns; ``"point"`` is the point's id, a grid name its value).
    """

    table: str
    x: str
    y: str
    series: tuple[str, ...] = ("point",)
    columns: tuple[str, ...] | None = None
    where: tuple[tuple[str, Any], ...] = ()
    logx: bool = False
    logy: bool = False
    caption: str = ""


VIEWS: dict[str, SweepView] = {
    "03_throughput_vs_context": SweepView(
        "prefill",
        x="T",
        y="tok_s",
        series=("point", "device"),
        columns=("device", "T", "first_ms", "min_ms", "median_ms", "tok_s"),
        logx=True,
        caption="prefill tok/s against prompt length T, one line per point (model, form)",
    ),
    "04_index_pos_misuse": SweepView(
        "decode_variants",
        x="steps",
        y="distinct_tokens",
        series=("variant",),
        columns=("variant", "tokens", "distinct_tokens", "repetition", "longest_run"),
        caption="distinct tokens of each decode index_pos variant against the steps generated",
    ),
    "06_device_logit_drift": SweepView(
        "vs_reference",
        x="variant",
        y="max_abs_diff",
        series=("source",),
        columns=(
            "variant",
            "source",
            "reference_source",
            "step0_max_abs_diff",
            "max_abs_diff",
            "mean_abs_diff",
            "argmax_agree_share",
            "first_diverging_token",
        ),
        logy=True,
        caption="max |logit difference| from the reference per quantization type, per source",
    ),
}


# -- points ------------------------------------------------------------------

_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")


def _slug(v: Any) -> tuple[str, bool]:
    """(text for a folder name, whether it reads back as ``v``)."""
    if isinstance(v, (list, tuple)):
        return "+".join(_slug(x)[0] for x in v) or "empty", False
    if isinstance(v, dict):
        return "+".join(f"{k}-{_slug(x)[0]}" for k, x in v.items()) or "empty", False
    text = str(v)
    if isinstance(v, str) and ("/" in v or "\\" in v):
        text = re.split(r"[/\\]", v.rstrip("/\\"))[-1] or "root"  # a path: its file's name
    safe = _UNSAFE.sub("-", text) or "-"
    back = parse_value(safe)
    exact = safe == str(v) and back == v and type(back) is type(v)
    return safe, exact


def point_id(values: dict[str, Any]) -> str:
    """``steps=4,form=f32``; a hash appended when a value does not read back from it."""
    parts, exact = [], True
    for k, v in values.items():
        text, ok = _slug(v)
        parts.append(f"{k}={text}")
        exact &= ok
    pid = ",".join(parts)
    if exact and len(pid) <= MAX_ID:
        return pid
    digest = hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()
    return f"{pid[:MAX_ID]}~{digest[:8]}"


@dataclass
class Point:
    notebook: Path
    id: str
    values: dict[str, Any]  # its grid values
    parameters: dict[str, Any]  # everything papermill gets
    dir: Path  # DIR/sweeps/<notebook>/<id>
    timing: bool = False

    @property
    def device(self) -> str:
        return device_tag(self.parameters.get("device", "cpu"))

    @property
    def status_path(self) -> Path:
        return self.dir / self.notebook.stem / f"status_{self.device}.json"


def plan(
    notebooks: list[Path],
    output_dir: Path,
    fixed: dict[str, Any],
    grid: dict[str, list[Any]],
) -> tuple[list[Point], list[str]]:
    """The points of every notebook that declares some of the grid's names, and a note
    for each notebook left out. A name (fixed or axis) no notebook declares is an error."""
    if not grid:
        raise ValueError("a sweep needs a grid (--grid NAME=V1,V2 or `grid:` in -f)")
    declared = {p: notebook_parameters(p) for p in notebooks}
    known = set().union(*declared.values()) if declared else set()
    unknown = sorted((set(fixed) | set(grid)) - known - {"device"})
    if unknown:
        raise SystemExit(f"parameter(s) {', '.join(unknown)} declared by no notebook run")
    points: list[Point] = []
    notes: list[str] = []
    for path in notebooks:
        axes = [a for a in grid if a in declared[path]]
        if not axes:
            notes.append(f"{path.stem}: declares none of {', '.join(grid)}; left out")
            continue
        base = runner.select_parameters(path, fixed)
        for a in axes:
            for v in grid[a]:
                check_type(v, declared[path][a].get("default"), f"{path.stem}'s {a}")
        timing = is_timing(path)
        ids: set[str] = set()
        for combo in itertools.product(*(grid[a] for a in axes)):
            values = dict(zip(axes, combo, strict=True))
            pid = point_id(values)
            if pid in ids:  # pragma: no cover - a hash collision
                raise ValueError(f"{path.stem}: two points share the id {pid!r}")
            ids.add(pid)
            d = Path(output_dir) / SWEEPS_DIR / path.stem / pid
            points.append(Point(path, pid, values, {**base, **values}, d, timing))
    return points, notes


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _record_points(output_dir: Path, points: list[Point]) -> None:
    """Add the points to each notebook's ``points.json`` (earlier points stay listed)."""
    by_nb: dict[str, list[Point]] = {}
    for p in points:
        by_nb.setdefault(p.notebook.stem, []).append(p)
    for stem, pts in by_nb.items():
        path = Path(output_dir) / SWEEPS_DIR / stem / POINTS
        old = _read_json(path) or {}
        index = old.get("points") if isinstance(old.get("points"), dict) else {}
        for p in pts:
            index[p.id] = {"values": p.values, "parameters": p.parameters, "timing": p.timing}
        doc = {"schema": SCHEMA, "notebook": stem, "points": index}
        atomic_write_text(path, dump_json(doc))


# -- running -----------------------------------------------------------------

_STATUS_KEYS = (
    "state",
    "ok",
    "seconds",
    "error",
    "executor",
    "host",
    "worker",
    "machine",
    "waited_s",
    "run_id",
    "started",
    "finished",
)


def _entry(point: Point, output_dir: Path, status: dict[str, Any] | None) -> dict[str, Any]:
    """A point's line in ``sweep.json``."""
    status = status or {}
    out = status.get("output")
    rel_dir = point.dir.relative_to(output_dir).as_posix()
    e: dict[str, Any] = {
        "notebook": point.notebook.stem,
        "point": point.id,
        "values": point.values,
        "device": point.device,
        "timing": point.timing,
        "skipped": False,
        "dir": rel_dir,
        "executed_notebook": f"{rel_dir}/{out}" if out else None,
        "status": point.status_path.relative_to(output_dir).as_posix(),
        "failure": None,
    }
    e.update({k: status.get(k) for k in _STATUS_KEYS})
    e["state"] = e["state"] or "pending"
    if status and not status.get("ok"):
        e["failure"] = runner.failure_reason(status)
    return e


@dataclass
class SweepRun:
    """What ``run_sweep`` did: ``summary`` is ``sweep.json``'s content."""

    summary: dict[str, Any]
    results: list[runner.NotebookResult] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [e for e in self.summary["points"] if not e.get("ok")]


def run_sweep(
    notebooks: list[Path],
    output_dir: Path,
    fixed: dict[str, Any],
    grid: dict[str, list[Any]],
    *,
    executor: str = "local",
    workers: int = 1,
    scheduler: str | None = None,
    timeout: float | None = None,
    progress: bool = True,
    resume: bool = False,
    log=print,
) -> SweepRun:
    """Run every point of the grid (``plan``) and write ``DIR/sweep.json``.

    A failed point (an error, a timeout, a dead kernel or worker) is recorded and the
    others go on. ``resume``: skip points done before at the same parameters and code.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r} (choose from {', '.join(EXECUTORS)})")
    output_dir = Path(output_dir)
    points, notes = plan(notebooks, output_dir, fixed, grid)
    for note in notes:
        log(note, flush=True)
    if not points:
        raise SystemExit("no point to run: no selected notebook declares a grid name")
    run_id = datetime.now().strftime("%Y%m%dT%H%M%S-") + secrets.token_hex(3)
    code = runner.code_version()
    _record_points(output_dir, points)
    t0 = time.perf_counter()
    n = len(points)
    summary: dict[str, Any] = {
        "schema": SCHEMA,
        "run_id": run_id,
        "started": now(),
        "finished": None,
        "seconds": None,
        "output_dir": str(output_dir.resolve()),
        "executor": {"executor": executor},
        "grid": grid,
        "parameters": fixed,
        "code": code,
        "notebooks": sorted({p.notebook.stem for p in points}),
        "left_out": notes,
        "counts": {},
        "points": [],
    }
    entries: dict[tuple[str, str], dict[str, Any]] = {}
    jobs: list[Job] = []
    done_count = 0
    for p in points:
        done, why = (
            runner.resume_check(p.notebook, p.dir, p.parameters, code) if resume else (False, "")
        )
        e = _entry(p, output_dir, _read_json(p.status_path) if done else None)
        if done:
            e["skipped"] = True
            done_count += 1
            log(f"[{done_count}/{n}] {p.notebook.stem} {p.id} skipped: {why}", flush=True)
        else:
            if resume:
                log(f"{p.notebook.stem} {p.id}: to run ({why})", flush=True)
            jobs.append(Job(p.notebook, p.dir, p.parameters, p.id, p.timing, timeout, run_id, code))
        entries[(p.notebook.stem, p.id)] = e

    def write() -> None:
        summary["points"] = list(entries.values())
        oks = sum(bool(e.get("ok")) for e in entries.values())
        finished = [e for e in entries.values() if e["state"] not in ("pending", "running")]
        summary["counts"] = {
            "points": n,
            "ok": oks,
            "failed": sum(not e.get("ok") for e in finished),
            "skipped": sum(e["skipped"] for e in entries.values()),
            "pending": n - len(finished),
        }
        atomic_write_text(output_dir / SUMMARY, dump_json(summary))

    results: list[runner.NotebookResult] = []

    def on_result(job: Job, r: runner.NotebookResult) -> None:
        nonlocal done_count
        done_count += 1
        results.append(r)
        p = next(q for q in points if q.notebook == job.notebook and q.id == job.point)
        status = _read_json(p.status_path) or {**r.status(), "finished": now()}
        e = _entry(p, output_dir, status)
        entries[(p.notebook.stem, p.id)] = e
        write()
        state = "ok" if r.ok else f"FAILED ({r.error_line()})"
        where = f" on {r.executor} {r.host}" if r.host else ""
        wait = f", waited {r.waited_s:.1f} s for the host" if r.waited_s else ""
        log(f"[{done_count}/{n}] {job.label} {state} {r.seconds:.1f} s{where}{wait}", flush=True)

    write()
    try:
        if jobs:
            if executor == "dask":
                where = run_dask(jobs, on_result, workers=workers, scheduler=scheduler, log=log)
            else:
                where = run_local(jobs, on_result, workers=workers, progress=progress)
            summary["executor"] = where
    finally:
        summary["finished"] = now()
        summary["seconds"] = round(time.perf_counter() - t0, 2)
        for e in entries.values():
            if e["state"] == "pending":  # the sweep was interrupted, or its client failed
                e["state"] = "did not finish"
                e["failure"] = "did not finish: the sweep stopped before this point ended"
        write()
    return SweepRun(summary, results)


def format_summary(summary: dict[str, Any]) -> str:
    """The sweep's points as a text table: notebook, point, state, seconds, executor, host."""
    head = ("notebook", "point", "state", "seconds", "executor", "host")
    rows = [head]
    for e in summary["points"]:
        state = e["state"] + (" (skipped: done before)" if e.get("skipped") else "")
        secs = "" if e.get("seconds") is None else f"{e['seconds']:.1f}"
        rows.append(
            (e["notebook"], e["point"], state, secs, e.get("executor") or "", e.get("host") or "")
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


# -- what the report shows -----------------------------------------------------


@dataclass
class PointRun:
    """One point's run on one device, read back from its folder."""

    notebook: str
    point: str
    values: dict[str, Any]
    device: str
    folder: str  # relative to the results dir: sweeps/<notebook>/<point>
    status: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return bool(self.status and self.status.get("ok"))

    def executed_notebook(self, results_dir: Path) -> str | None:
        out = (self.status or {}).get("output") or output_name(self.notebook, self.device)
        rel = f"{self.folder}/{out}"
        return rel if (Path(results_dir) / rel).is_file() else None


def collect(results_dir: Path) -> dict[str, list[PointRun]]:
    """Every point under ``DIR/sweeps/``, by notebook (in ``points.json`` order)."""
    root = Path(results_dir) / SWEEPS_DIR
    out: dict[str, list[PointRun]] = {}
    if not root.is_dir():
        return out
    for nb_dir in sorted(d for d in root.iterdir() if d.is_dir()):
        stem = nb_dir.name
        index = (_read_json(nb_dir / POINTS) or {}).get("points") or {}
        order = {pid: i for i, pid in enumerate(index)}
        runs: list[PointRun] = []
        folders = [d for d in nb_dir.iterdir() if d.is_dir() and (d / stem).is_dir()]
        for d in sorted(folders, key=lambda d: (order.get(d.name, len(order)), d.name)):
            files = {f.stem.split("_", 1)[1] for f in (d / stem).glob("status_*.json")}
            files |= {f.stem.split("_", 1)[1] for f in (d / stem).glob("meta_*.json")}
            values = (index.get(d.name) or {}).get("values") or {}
            for dev in sorted(files):
                runs.append(
                    PointRun(
                        stem,
                        d.name,
                        values,
                        dev,
                        d.relative_to(results_dir).as_posix(),
                        _read_json(d / stem / f"status_{dev}.json"),
                        _read_json(d / stem / f"meta_{dev}.json"),
                    )
                )
        if runs:
            out[stem] = runs
    return out


def aggregate(view: SweepView, runs: list[PointRun], results_dir: Path):
    """The view's table of every ok point, concatenated: point, grid values, then the
    table's columns (``view.columns``). None when no point saved it."""
    import pandas as pd

    frames = []
    axes: list[str] = []
    for r in runs:
        for a in r.values:
            if a not in axes:
                axes.append(a)
    for r in runs:
        if not r.ok or not r.meta:
            continue
        entry = next((t for t in r.meta.get("tables") or [] if t.get("stem") == view.table), None)
        if entry is None:
            continue
        try:
            df = pd.read_csv(Path(results_dir) / r.folder / r.notebook / entry["csv"])
        except (OSError, ValueError):
            continue
        for col, value in view.where:
            if col in df.columns:
                df = df[df[col] == value]
        if view.columns:
            df = df[[c for c in view.columns if c in df.columns]]
        front = {"point": r.point}
        front.update({a: value_cell(r.values.get(a)) for a in axes if a not in df.columns})
        if "device" not in df.columns:
            front["device"] = r.device
        df = df.copy()
        for i, (k, v) in enumerate(front.items()):
            df.insert(i, k, [v] * len(df))
        frames.append(df)
    if not frames:
        return None
    df = pd.concat(frames, ignore_index=True)
    df.attrs["axes"] = [a for a in axes if a in df.columns]
    return df


def value_cell(v: Any) -> Any:
    """A grid value as a table cell: scalars as they are, a path by its file name."""
    if isinstance(v, str) and ("/" in v or "\\" in v):
        return re.split(r"[/\\]", v.rstrip("/\\"))[-1]
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return v


def plot(view: SweepView, df, title: str = ""):
    """``view.y`` against ``view.x``, one line per value of ``view.series``: a figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    fig, ax = plt.subplots(figsize=(7, 3.6))
    numeric_x = pd.api.types.is_numeric_dtype(df[view.x])
    cats = list(dict.fromkeys(df[view.x].astype(str))) if not numeric_x else []
    series: list[str] = []
    for c in view.series:  # "point": the grid values name a line better than the id does
        names = (df.attrs.get("axes") or ["point"]) if c == "point" else [c]
        series += [n for n in names if n in df.columns and n not in series]
    groups = df.groupby(series, sort=False) if series else [((), df)]
    for key, g in groups:
        key = key if isinstance(key, tuple) else (key,)
        label = " / ".join(str(k) for k in key) or view.y
        if numeric_x:
            g = g.sort_values(view.x)
            xs = g[view.x]
        else:
            xs = [cats.index(str(v)) for v in g[view.x]]
        ax.plot(xs, g[view.y], marker="o", label=label)
    if view.logx and numeric_x and (df[view.x] > 0).all():
        ax.set_xscale("log")
    if view.logy and (df[view.y] > 0).all():
        ax.set_yscale("log")
    if not numeric_x:
        ax.set_xticks(range(len(cats)), cats)
    elif df[view.x].nunique() <= 12:
        ticks = sorted(df[view.x].unique())
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.set(xlabel=view.x, ylabel=view.y, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


@dataclass
class ViewResult:
    """A notebook's sweep view as built by ``build_views``: files relative to the results dir."""

    notebook: str
    view: SweepView
    csv: str | None = None
    png: str | None = None
    rows: int = 0
    points: int = 0
    note: str | None = None  # why there is no table or plot


def build_views(results_dir: Path, sweeps: dict[str, list[PointRun]] | None = None):
    """Write each swept notebook's view (``VIEWS``): ``sweep_<table>.csv`` and ``.png``
    in ``DIR/sweeps/<notebook>/``. Returns {notebook: ViewResult}; never raises."""
    import io

    results_dir = Path(results_dir)
    sweeps = collect(results_dir) if sweeps is None else sweeps
    out: dict[str, ViewResult] = {}
    for stem, runs in sweeps.items():
        view = VIEWS.get(stem)
        if view is None:
            continue
        vr = ViewResult(stem, view)
        out[stem] = vr
        try:
            df = aggregate(view, runs, results_dir)
            if df is None or df.empty:
                vr.note = f"no ok point saved the table `{view.table}`"
                continue
            folder = results_dir / SWEEPS_DIR / stem
            csv = atomic_write_text(folder / f"sweep_{view.table}.csv", df.to_csv(index=False))
            vr.csv, vr.rows = csv.relative_to(results_dir).as_posix(), len(df)
            vr.points = df["point"].nunique()
            if view.x in df.columns and view.y in df.columns:
                import matplotlib.pyplot as plt

                fig = plot(view, df, title=f"{stem}: {view.y} against {view.x}")
                buf = io.BytesIO()
                fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
                plt.close(fig)
                png = atomic_write_bytes(folder / f"sweep_{view.table}.png", buf.getvalue())
                vr.png = png.relative_to(results_dir).as_posix()
            else:
                vr.note = f"the table has no column {view.x!r} or {view.y!r} to plot"
        except Exception as exc:  # never fail the report for a view
            vr.note = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    return out
