"""``build(results_dir)``: REPORT.md and REPORT.html from what the notebooks saved.

One section per experiment, ordered by notebook name, with a part per device
(cpu first): status, findings (each naming its table), key tables, plots,
the seed's figures beside ours, and a provenance line. A notebook that failed
or never ran gets a section that says so; failed runs (an error, a timeout, a
kernel that died, a run that never finished) are also listed under the status
table with their reason.

Tables: one number format per column (``column_format``), numbers right-aligned
and text left-aligned (in the markdown alignment row, and as the classes ``num``
and ``text`` in the HTML), each HTML table inside a horizontal scroll box.
The executed notebooks are rendered to HTML beside their ``.ipynb``
(``render_notebooks``, nbconvert in-process, skipped where up to date), and
``index.json`` lists every run for machines (``index``).
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from . import runner, sweep
from .machine import summary
from .results import SEED_LABEL, atomic_write_text, dump_json, now

MAX_ROWS = 20  # rows of a key table shown in the report
DEVICE_ORDER = ("cpu", "cuda", "mps")
INDEX_SCHEMA = 1  # of index.json
THOUSANDS_FROM = 10_000  # a column with a number this large gets thousands separators
MAX_DECIMALS = 6  # a float column needing more is written in scientific notation

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 60rem;
       margin: 2rem auto; padding: 0 1rem; color: #1d1d1f; }
h1, h2, h3 { line-height: 1.2; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem;
       margin-top: 2.5rem; }
.table-scroll { overflow-x: auto; max-width: 100%; margin: .6rem 0; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: .2rem .5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
th.num, td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
th.text, td.text { text-align: left; }
img { max-width: 100%; border: 1px solid #eee; }
code { background: #f5f5f5; padding: 0 .2rem; border-radius: 3px; }
blockquote { color: #555; margin-left: 0; padding-left: 1rem; border-left: 3px solid #ddd; }
"""


@dataclass
class DeviceRun:
    """One device's results for one experiment: the notebook's meta and the runner's status."""

    device: str
    meta: dict[str, Any] | None = None
    status: dict[str, Any] | None = None

    @property
    def stale(self) -> bool:
        """The saved results come from an earlier run than the runner's last one."""
        if not (self.meta and self.status and self.status.get("run_id")):
            return False
        if self.meta.get("run_id") == self.status["run_id"]:
            return False
        try:  # a run by hand after the suite's is not stale
            saved = datetime.fromisoformat(self.meta["started"])
            return saved < datetime.fromisoformat(self.status["started"])
        except (KeyError, TypeError, ValueError):
            return True


@dataclass
class Experiment:
    name: str
    title: str = ""
    intro: str = ""
    runs: list[DeviceRun] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _device_key(device: str) -> tuple[int, str]:
    return (DEVICE_ORDER.index(device) if device in DEVICE_ORDER else len(DEVICE_ORDER), device)


def collect(results_dir: Path, notebooks_dir: Path | None = None) -> list[Experiment]:
    """Experiments from the notebooks in ``notebooks_dir`` and the folders in ``results_dir``."""
    from .catalogue import NOTEBOOKS_DIR, notebook_intro

    results_dir = Path(results_dir)
    notebooks_dir = Path(notebooks_dir) if notebooks_dir else NOTEBOOKS_DIR
    sources = {p.stem: p for p in notebooks_dir.glob("*.ipynb") if not p.name.startswith(".")}
    names = set(sources)
    if results_dir.is_dir():
        for d in results_dir.iterdir():
            if d.is_dir() and (any(d.glob("meta_*.json")) or any(d.glob("status_*.json"))):
                names.add(d.name)
    experiments = []
    for name in sorted(names):
        exp = Experiment(name)
        nb = sources.get(name) or results_dir / f"{name}.ipynb"
        if nb.is_file():
            try:
                exp.title, exp.intro = notebook_intro(nb)
            except Exception:  # unreadable notebook: the section still appears
                pass
        d = results_dir / name
        devices: dict[str, DeviceRun] = {}
        for kind in ("meta", "status"):
            for f in sorted(d.glob(f"{kind}_*.json")) if d.is_dir() else []:
                dev = f.stem.split("_", 1)[1]
                setattr(devices.setdefault(dev, DeviceRun(dev)), kind, _read_json(f))
        exp.runs = [devices[k] for k in sorted(devices, key=_device_key)]
        experiments.append(exp)
    return experiments


# -- rendering --------------------------------------------------------------


def _scalar(v: Any) -> Any:
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        return v.item()
    return v


def _number(v: Any) -> float | int | None:
    """``v`` as a finite number, or None (text, bool, None, NaN, inf)."""
    v = _scalar(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v if isinstance(v, int) or math.isfinite(v) else None


def _empty(v: Any) -> bool:
    v = _scalar(v)
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def _text(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class ColumnFormat:
    """How every number of one table column is written.

    ``kind``: "int" (whole numbers), "fixed" (``decimals`` after the point) or
    "sci" (4 significant digits, ``1.234e-07``); ``thousands``: with separators
    (``140,544``). ``numeric``: every filled cell is a number (right-aligned).
    """

    numeric: bool = False
    kind: str = "int"
    decimals: int = 0
    thousands: bool = False

    def __call__(self, v: Any) -> str:
        if _empty(v):
            return ""
        x = _number(v)
        if x is None:
            return _text(_scalar(v))
        sep = "," if self.thousands else ""
        if self.kind == "int":
            return f"{int(x):{sep}d}"
        if self.kind == "sci":
            return f"{x:.3e}"
        return f"{x:{sep}.{self.decimals}f}"


def column_format(values: list[Any]) -> ColumnFormat:
    """One format for all the numbers of a column, chosen from its values.

    Whole numbers (ints, or floats that are all whole) as integers; other floats
    with the same number of decimals (at least one): enough for 4 significant digits of the
    largest and 2 of the smallest (scientific notation past ``MAX_DECIMALS``).
    Thousands separators for all or none: all when one number reaches
    ``THOUSANDS_FROM``.
    """
    filled = [v for v in values if not _empty(v)]
    nums = [x for x in map(_number, filled) if x is not None]
    numeric = bool(nums) and len(nums) == len(filled)
    if not nums:
        return ColumnFormat(numeric=False)
    big = max(abs(x) for x in nums)
    thousands = big >= THOUSANDS_FROM
    if all(isinstance(x, int) or (x.is_integer() and abs(x) < 1e15) for x in nums):
        return ColumnFormat(numeric, "int", 0, thousands)
    nonzero = [abs(x) for x in nums if x != 0]
    hi = math.floor(math.log10(max(nonzero)))
    lo = math.floor(math.log10(min(nonzero)))
    decimals = max(3 - hi, 1 - lo, 1)
    if decimals > MAX_DECIMALS or hi >= 15:
        return ColumnFormat(numeric, "sci", 3, False)
    return ColumnFormat(numeric, "fixed", decimals, thousands)


def fmt(v: Any) -> str:
    """One cell on its own (a column of one value): ``column_format([v])(v)``."""
    return column_format([v])(v)


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A GitHub-style markdown table from a list of records.

    One number format per column (``column_format``); numeric columns are
    right-aligned (``---:``), the others left-aligned (``:---``).
    """
    columns = columns or (list(rows[0]) if rows else [])
    if not columns:
        return ""
    formats = {c: column_format([r.get(c) for r in rows]) for c in columns}
    head = "| " + " | ".join(_text(c) for c in columns) + " |"
    rule = "|" + "".join(" ---: |" if formats[c].numeric else " :--- |" for c in columns)
    out = [head, rule]
    out += ["| " + " | ".join(formats[c](r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(out)


def _table_section(folder: Path, rel: str, t: dict[str, Any]) -> list[str]:
    import pandas as pd

    csv = folder / t["csv"]
    head = f"**{t['stem']}**" + (f": {t['caption']}" if t.get("caption") else "")
    link = f"[CSV]({rel}/{t['csv']})"
    try:
        df = pd.read_csv(csv)
    except (OSError, ValueError) as exc:
        return [f"{head} ({link}): cannot read it: {exc}", ""]
    more = len(df) - MAX_ROWS
    rows = df.head(MAX_ROWS).astype(object).where(df.head(MAX_ROWS).notna(), None)
    rows_txt = f"{len(df)} row" + ("" if len(df) == 1 else "s")
    lines = [f"{head} ({rows_txt}, {link})", "", markdown_table(rows.to_dict("records"))]
    if more > 0:
        lines.append(f"\n*… {more} more rows in the CSV.*")
    return lines + [""]


def _provenance(run: DeviceRun, rel_nb: str | None, page: NotebookPage | None = None) -> str:
    meta, status = run.meta or {}, run.status or {}
    machine = meta.get("machine") or {}
    parts = []
    if machine:
        parts.append(summary(machine))
        git = machine.get("git") or {}
        if git:
            parts.append(f"commit {git.get('commit')}" + (" (dirty)" if git.get("dirty") else ""))
    date = meta.get("updated") or meta.get("started") or status.get("finished")
    if date:
        parts.append(str(date))
    params = meta.get("params") or status.get("parameters") or {}
    if params:
        parts.append("parameters: " + ", ".join(f"`{k}={v!r}`" for k, v in params.items()))
    if rel_nb:
        if page is not None and page.html:
            parts.append(f"[executed notebook]({page.html}) ([.ipynb]({rel_nb}))")
        else:
            why = f" (no HTML page: {page.note})" if page is not None and page.note else ""
            parts.append(f"[executed notebook (.ipynb)]({rel_nb}){why}")
    return "*Provenance:* " + "; ".join(parts) if parts else ""


def failure_reason(status: dict[str, Any]) -> str:
    """'timeout at cell In [3]: `CellTimeoutError: ...`' for a failed run's status."""
    return runner.failure_reason(status, quote="`")


def _executed_notebook(run: DeviceRun, results_dir: Path) -> str | None:
    """The run's executed notebook, relative to ``results_dir``, if it is there."""
    out = (run.status or {}).get("output")
    return out if out and (results_dir / out).is_file() else None


def _device_section(
    exp: Experiment, run: DeviceRun, results_dir: Path, pages: dict[str, NotebookPage] | None
) -> list[str]:
    meta, status = run.meta, run.status
    lines = [f"### {exp.name} on {run.device}", ""]
    rel_nb = _executed_notebook(run, results_dir)
    page = None
    if rel_nb:
        page = pages.get(rel_nb) if pages is not None else _existing_page(results_dir, rel_nb)
    if status and not status.get("ok"):
        lines += [f"**Failed** ({failure_reason(status)})", ""]
    elif status:
        took = f"{status.get('seconds', 0):.1f} s"
        lines += [f"Ran in {took}, finished {status.get('finished')}.", ""]
    else:
        lines += ["Run by hand (no suite status recorded).", ""]
    if not meta:
        lines += ["No results were saved.", ""]
    else:
        if run.stale:
            lines += [f"*The results below come from an earlier run ({meta.get('started')}).*", ""]
        lines += _results(meta, results_dir / exp.name, exp.name, run.device)
    prov = _provenance(run, rel_nb, page)
    if prov:
        lines += [prov, ""]
    return lines


def _results(meta: dict[str, Any], folder: Path, rel: str, device: str) -> list[str]:
    lines: list[str] = []
    if meta.get("findings"):
        lines += ["**Findings**", ""]
        for f in meta["findings"]:
            src = f" *(table `{f['table']}`)*" if f.get("table") else ""
            lines.append(f"- {f['sentence']}{src}")
        lines.append("")
    for t in meta.get("tables", []):
        if t.get("key"):
            lines += _table_section(folder, rel, t)
    for p in meta.get("plots", []):
        cap = p.get("caption") or p["stem"]
        lines += [f"![{cap}]({rel}/{p['png']})", ""]
    refs = meta.get("seed_references") or []
    if refs:
        rows = [
            {
                "quantity": r["what"],
                f"ours ({device})": r.get("ours"),
                SEED_LABEL: r.get("seed"),
                "unit": r.get("unit", ""),
                "source": r.get("source", ""),
            }
            for r in refs
        ]
        lines += ["**Beside the seed** (a reference measured on other hardware)", ""]
        lines += [markdown_table(rows), ""]
    for s in meta.get("skipped", []):
        lines.append(f"- *Skipped* {s['part']}: {s['reason']}")
    if meta.get("skipped"):
        lines.append("")
    others = [t for t in meta.get("tables", []) if not t.get("key")]
    others += meta.get("files", [])
    if others:
        links = ", ".join(f"[{t['stem']}]({rel}/{t.get('csv') or t['json']})" for t in others)
        lines += [f"Other tables: {links}", ""]
    earlier = [
        e
        for kind in ("tables", "plots", "files")
        for e in (meta.get("earlier") or {}).get(kind, [])
    ]
    if earlier:
        links = ", ".join(
            f"[{e['stem']}]({rel}/{e.get('csv') or e.get('png') or e['json']})"
            + (f" ({e['started']})" if e.get("started") else "")
            for e in earlier
        )
        lines += [f"Still there from an earlier run (not saved again by this one): {links}", ""]
    return lines


def _status_cell(run: DeviceRun) -> str:
    if run.status is None:
        return "by hand" if run.meta else "—"
    if run.status.get("ok"):
        return f"ok {run.status.get('seconds', 0):.1f} s"
    state = {"running": "did not finish", "error": None}.get(
        run.status.get("state"), run.status.get("state")
    )
    return "**failed**" + (f" ({state})" if state else "")


def render(
    experiments: list[Experiment],
    results_dir: Path,
    pages: dict[str, NotebookPage] | None = None,
    sweeps: Sweeps | None = None,
) -> str:
    """The whole report as markdown.

    ``pages``: the executed notebooks' HTML pages (``render_notebooks``); None:
    link those already beside their notebook. ``sweeps``: the points under
    ``sweeps/`` and their views (``collect_sweeps``), shown after the experiments.
    """
    devices = sorted({r.device for e in experiments for r in e.runs}, key=_device_key)
    lines = ["# qlab results", "", f"Built {now()} by `python -m qlib suite report`."]
    lines += ["Every run, for scripts: [index.json](index.json).", ""]
    if experiments:
        cols = ["experiment", *devices] if devices else ["experiment", "status"]
        rows = []
        for e in experiments:
            row: dict[str, Any] = {"experiment": f"[{e.name}](#{e.name.replace('_', '-')})"}
            by_dev = {r.device: r for r in e.runs}
            for d in devices:
                row[d] = _status_cell(by_dev[d]) if d in by_dev else "—"
            if not devices:
                row["status"] = "not run"
            rows.append(row)
        lines += [markdown_table(rows, cols), ""]
        failed = [
            f"- [{e.name}](#{e.name.replace('_', '-')}) on {r.device}: {failure_reason(r.status)}"
            for e in experiments
            for r in e.runs
            if r.status is not None and not r.status.get("ok")
        ]
        if failed:
            lines += [f"**Failed** ({len(failed)}):", "", *failed, ""]
    if sweeps and sweeps.runs:
        lines += [_sweeps_line(sweeps), ""]
    for e in experiments:
        title = f": {e.title}" if e.title and e.title != e.name else ""
        lines += [f'<a id="{e.name.replace("_", "-")}"></a>', "", f"## {e.name}{title}", ""]
        if e.intro:
            lines += [f"> {e.intro}", ""]
        if not e.runs and sweeps and e.name in sweeps.runs:
            sweep_link = f"[its sweep](#{_sweep_anchor(e.name)})"
            lines += [f"**Not run** on its own (no results in `{e.name}/`): see {sweep_link}.", ""]
        elif not e.runs:
            lines += [f"**Not run**: no results in `{e.name}/`.", ""]
        for run in e.runs:
            lines += _device_section(e, run, results_dir, pages)
    if sweeps and sweeps.runs:
        titles = {e.name: e.title for e in experiments}
        lines += _sweeps_section(sweeps, results_dir, titles)
    return "\n".join(lines).rstrip() + "\n"


# -- sweeps ---------------------------------------------------------------------


@dataclass
class Sweeps:
    """The points under ``DIR/sweeps/`` by notebook, and each notebook's view (if any)."""

    runs: dict[str, list[sweep.PointRun]] = field(default_factory=dict)
    views: dict[str, sweep.ViewResult] = field(default_factory=dict)


def collect_sweeps(results_dir: Path, *, build_views: bool = True) -> Sweeps:
    """Read every sweep point back; ``build_views``: write the views' CSV and plot."""
    runs = sweep.collect(results_dir)
    views = sweep.build_views(results_dir, runs) if build_views else {}
    return Sweeps(runs, views)


def _sweep_anchor(name: str) -> str:
    return "sweep-" + name.replace("_", "-")


def _sweeps_line(sweeps: Sweeps) -> str:
    parts = []
    for name, runs in sweeps.runs.items():
        ok = sum(bool(r.ok) for r in runs)
        parts.append(f"[{name}](#{_sweep_anchor(name)}) {len(runs)} points ({ok} ok)")
    return "**Sweeps:** " + "; ".join(parts) + "."


def _sweep_state(status: dict[str, Any] | None) -> str:
    if status is None:
        return "—"
    if status.get("ok"):
        return "ok"
    state = {"running": "did not finish", "error": None}.get(
        status.get("state"), status.get("state")
    )
    return "**failed**" + (f" ({state})" if state else "")


def _sweeps_section(sweeps: Sweeps, results_dir: Path, titles: dict[str, str]) -> list[str]:
    """A section per swept notebook: its points, failures, and its view's table and plot."""
    lines = ['<a id="sweeps"></a>', "", "## Sweeps", ""]
    lines += [
        "Each point of a sweep is one run of the notebook with the grid values shown "
        "(`python -m qlib suite run --grid ...`), in its own folder under `sweeps/`.",
        "",
    ]
    for name, runs in sweeps.runs.items():
        title = titles.get(name)
        head = f"### {name}" + (f": {title}" if title and title != name else "")
        lines += [f'<a id="{_sweep_anchor(name)}"></a>', "", head, ""]
        axes: list[str] = []
        for r in runs:
            axes += [a for a in r.values if a not in axes]
        rows = []
        for r in runs:
            st = r.status or {}
            nb = r.executed_notebook(results_dir)
            row: dict[str, Any] = {"point": f"`{r.point}`"}
            row.update({a: sweep.value_cell(r.values.get(a)) for a in axes})
            row.update(
                {
                    "device": r.device,
                    "state": _sweep_state(r.status),
                    "seconds": st.get("seconds"),
                    "executor": st.get("executor") or "",
                    "host": st.get("host") or "",
                    "finished": st.get("finished") or "",
                    "notebook": f"[.ipynb]({nb})" if nb else "",
                }
            )
            rows.append(row)
        lines += [markdown_table(rows), ""]
        failed = [
            f"- `{r.point}` on {r.device}: {failure_reason(r.status)}"
            for r in runs
            if r.status is not None and not r.status.get("ok")
        ]
        if failed:
            lines += [f"**Failed** ({len(failed)}):", "", *failed, ""]
        vr = sweeps.views.get(name)
        if vr is not None:
            lines += _sweep_view(vr, results_dir)
    return lines


def _sweep_view(vr: sweep.ViewResult, results_dir: Path) -> list[str]:
    import pandas as pd

    view = vr.view
    head = f"**{view.table} across the points**" + (f": {view.caption}" if view.caption else "")
    if vr.csv is None:
        return [f"{head}: {vr.note}", ""]
    try:
        df = pd.read_csv(results_dir / vr.csv)
    except (OSError, ValueError) as exc:
        return [f"{head} ([CSV]({vr.csv})): cannot read it: {exc}", ""]
    shown = df.head(MAX_ROWS).astype(object).where(df.head(MAX_ROWS).notna(), None)
    lines = [
        f"{head} ({len(df)} rows of {vr.points} points, [CSV]({vr.csv}))",
        "",
        markdown_table(shown.to_dict("records")),
    ]
    if len(df) > MAX_ROWS:
        lines.append(f"\n*… {len(df) - MAX_ROWS} more rows in the CSV.*")
    lines.append("")
    if vr.png:
        lines += [f"![{view.caption or view.table}]({vr.png})", ""]
    elif vr.note:
        lines += [f"*No plot: {vr.note}*", ""]
    return lines


def sweep_index(sweeps: Sweeps, results_dir: Path) -> list[dict[str, Any]]:
    """``index.json``'s ``sweeps``: one entry per point and device."""
    out = []
    for name, runs in sweeps.runs.items():
        for r in runs:
            st, meta = r.status or {}, r.meta or {}
            failed = r.status is not None and not st.get("ok")
            folder = f"{r.folder}/{name}"
            out.append(
                {
                    "notebook": name,
                    "point": r.point,
                    "values": r.values,
                    "device": r.device,
                    "state": st.get("state") or ("by hand" if r.meta else "unknown"),
                    "ok": st.get("ok") if r.status is not None else None,
                    "error": st.get("error") if failed else None,
                    "failure": failure_reason(st) if failed else None,
                    "seconds": st.get("seconds"),
                    "executor": st.get("executor"),
                    "host": st.get("host"),
                    "worker": st.get("worker"),
                    "machine": st.get("machine"),
                    "waited_s": st.get("waited_s"),
                    "run_id": st.get("run_id") or meta.get("run_id"),
                    "started": st.get("started") or meta.get("started"),
                    "finished": st.get("finished"),
                    "parameters": st.get("parameters"),
                    "commit": (st.get("code") or {}).get("commit"),
                    "files": {
                        "dir": r.folder,
                        "executed_notebook": r.executed_notebook(results_dir),
                        "status": f"{folder}/status_{r.device}.json" if r.status else None,
                        "meta": f"{folder}/meta_{r.device}.json" if r.meta else None,
                        "tables": [f"{folder}/{t['csv']}" for t in meta.get("tables") or []],
                        "plots": [f"{folder}/{p['png']}" for p in meta.get("plots") or []],
                    },
                }
            )
    return out


# -- executed notebooks as HTML -------------------------------------------------


@dataclass
class NotebookPage:
    """An executed notebook's HTML page beside it (``html``), or why there is none (``note``)."""

    html: str | None = None  # relative to the results dir
    note: str | None = None


_PAGE_MARK = "<!-- qlib suite: rendered from {name} sha256={sha} -->"
_PAGE_MARK_RE = re.compile(r"<!-- qlib suite: rendered from \S+ sha256=([0-9a-f]{64}) -->")


def _page_path(results_dir: Path, rel_nb: str) -> Path:
    return (results_dir / rel_nb).with_suffix(".html")


def _existing_page(results_dir: Path, rel_nb: str) -> NotebookPage | None:
    page = _page_path(results_dir, rel_nb)
    return NotebookPage(page.relative_to(results_dir).as_posix()) if page.is_file() else None


def _rendered_from(page: Path) -> str | None:
    """The sha256 of the notebook ``page`` was rendered from (None: not one of ours)."""
    try:
        with page.open("r", encoding="utf-8", errors="replace") as f:
            m = _PAGE_MARK_RE.search(f.read(4096))
    except OSError:
        return None
    return m.group(1) if m else None


def render_notebooks(
    results_dir: Path, experiments: list[Experiment], *, log=None
) -> dict[str, NotebookPage]:
    """Render each run's executed notebook to ``NN_name[_device].html`` beside it (nbconvert).

    A page already rendered from the same notebook (its sha256 is in the page) is
    kept as it is, so a rebuild only renders what changed. A notebook nbconvert
    cannot render gets a note instead (and loses a page rendered from an older
    version of it); nothing here raises. Keyed by the notebook's relative path.
    """
    results_dir = Path(results_dir)
    pages: dict[str, NotebookPage] = {}
    exporter: Any = None
    for e in experiments:
        for run in e.runs:
            rel_nb = _executed_notebook(run, results_dir)
            if rel_nb is None or rel_nb in pages:
                continue
            nb_path, page = results_dir / rel_nb, _page_path(results_dir, rel_nb)
            rel_page = page.relative_to(results_dir).as_posix()
            try:
                data = nb_path.read_bytes()
                sha = hashlib.sha256(data).hexdigest()
                if page.is_file() and _rendered_from(page) == sha:
                    pages[rel_nb] = NotebookPage(rel_page)
                    continue
                if exporter is None:
                    exporter = _exporter()
                body = _render_page(exporter, data)
                mark = _PAGE_MARK.format(name=nb_path.name, sha=sha)
                first, nl, rest = body.partition("\n")  # the mark after <!DOCTYPE html>
                atomic_write_text(page, f"{first}\n{mark}\n{rest}" if nl else f"{mark}\n{body}")
                pages[rel_nb] = NotebookPage(rel_page)
            except Exception as exc:  # never fail the report for a page
                note = f"nbconvert failed: {type(exc).__name__}: {str(exc).strip()[:200]}"
                if isinstance(exc, ImportError):
                    note = f"nbconvert is not installed ({exc})"
                if page.is_file() and _rendered_from(page) is not None:
                    page.unlink(missing_ok=True)  # rendered from an older notebook: misleading
                pages[rel_nb] = NotebookPage(None, note.replace("\n", " "))
                if log:
                    log(f"{rel_nb}: {note}")
    return pages


def _exporter() -> Any:
    from nbconvert import HTMLExporter

    return HTMLExporter()


def _render_page(exporter: Any, data: bytes) -> str:
    import nbformat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nb = nbformat.reads(data.decode("utf-8"), as_version=4)
        body, _ = exporter.from_notebook_node(nb)
    return body


# -- index.json -------------------------------------------------------------


def _rel(folder: str, name: str | None) -> str | None:
    return f"{folder}/{name}" if name else None


def _run_entry(
    exp: Experiment, run: DeviceRun, results_dir: Path, pages: dict[str, NotebookPage] | None
) -> dict[str, Any]:
    meta, status = run.meta or {}, run.status or {}
    git = (meta.get("machine") or {}).get("git") or {}
    code = status.get("code") or (dict(git) if git else None)
    rel_nb = _executed_notebook(run, results_dir)
    page = None
    if rel_nb:
        page = pages.get(rel_nb) if pages is not None else _existing_page(results_dir, rel_nb)
    if run.status is not None:
        state = status.get("state") or ("ok" if status.get("ok") else "error")
    else:
        state = "by hand" if run.meta else "unknown"

    failed = run.status is not None and not status.get("ok")
    tables = [
        {
            "stem": t.get("stem"),
            "csv": _rel(exp.name, t.get("csv")),
            "json": _rel(exp.name, t.get("json")),
            "rows": t.get("rows"),
            "key": bool(t.get("key")),
            "caption": t.get("caption") or "",
        }
        for t in meta.get("tables") or []
    ]
    plots = [
        {"stem": p.get("stem"), "png": _rel(exp.name, p.get("png")), "caption": p.get("caption")}
        for p in meta.get("plots") or []
    ]
    jsons = [
        {"stem": f.get("stem"), "json": _rel(exp.name, f.get("json"))}
        for f in meta.get("files") or []
    ]
    earlier = [
        {
            "kind": kind,
            "stem": x.get("stem"),
            "file": _rel(exp.name, x.get("csv") or x.get("png") or x.get("json")),
            "started": x.get("started"),
        }
        for kind in ("tables", "plots", "files")
        for x in (meta.get("earlier") or {}).get(kind) or []
    ]
    return {
        "notebook": exp.name,
        "title": exp.title or None,
        "device": run.device,
        "state": state,
        "ok": status.get("ok") if run.status is not None else None,
        "error": status.get("error") if failed else None,
        "failure": failure_reason(status) if failed else None,
        "seconds": status.get("seconds"),
        "started": status.get("started") or meta.get("started"),
        "finished": status.get("finished"),
        "run_id": status.get("run_id") or meta.get("run_id"),
        "stale": run.stale,
        "parameters": status.get("parameters") if run.status is not None else None,
        "notebook_params": meta.get("params"),
        "commit": (code or {}).get("commit"),
        "code": code,
        "notebook_sha256": status.get("notebook_sha256"),
        "machine": summary(meta["machine"]) if meta.get("machine") else None,
        "findings": [
            {"key": f.get("key"), "sentence": f.get("sentence"), "table": f.get("table")}
            for f in meta.get("findings") or []
        ],
        "files": {
            "executed_notebook": rel_nb,
            "html": page.html if page else None,
            "html_note": page.note if page else None,
            "status": _rel(exp.name, f"status_{run.device}.json" if run.status else None),
            "meta": _rel(exp.name, f"meta_{run.device}.json" if run.meta else None),
            "tables": tables,
            "plots": plots,
            "json": jsons,
            "earlier": earlier,
        },
    }


def index(
    experiments: list[Experiment],
    results_dir: Path,
    pages: dict[str, NotebookPage] | None = None,
    sweeps: Sweeps | None = None,
) -> dict[str, Any]:
    """``index.json``: one entry per run (notebook and device), for scripts.

    Each entry: the run's state and timing (from ``status_<device>.json``), its
    parameters and code version, and the files it wrote (tables, plots, JSON,
    the executed notebook and its HTML page), paths relative to the results dir.
    Experiments with no run are listed under ``not_run``; every sweep point (state,
    time, executor, host, files) under ``sweeps`` and each notebook's sweep view (its
    concatenated table and plot) under ``sweep_views``.
    """
    results_dir = Path(results_dir)
    sweeps = sweeps or Sweeps()
    return {
        "schema": INDEX_SCHEMA,
        "built": now(),
        "report": {"markdown": "REPORT.md", "html": "REPORT.html"},
        "runs": [_run_entry(e, r, results_dir, pages) for e in experiments for r in e.runs],
        "not_run": [e.name for e in experiments if not e.runs],
        "sweeps": sweep_index(sweeps, results_dir),
        "sweep_views": {
            name: {
                "table": v.view.table,
                "x": v.view.x,
                "y": v.view.y,
                "csv": v.csv,
                "png": v.png,
                "rows": v.rows,
                "points": v.points,
                "note": v.note,
            }
            for name, v in sweeps.views.items()
        },
    }


# -- HTML -------------------------------------------------------------------

_ALIGN = re.compile(r'<(th|td) style="text-align: (left|right|center);">')
_ALIGN_CLASS = {"left": "text", "right": "num", "center": "center"}


def to_html(md: str, title: str = "qlab results") -> str:
    """The report as a page: numeric cells of class ``num`` (right), text ``text`` (left),
    each table in a horizontal scroll box."""
    import markdown

    body = markdown.markdown(md, extensions=["tables", "fenced_code", "sane_lists"])
    body = _ALIGN.sub(lambda m: f'<{m[1]} class="{_ALIGN_CLASS[m[2]]}">', body)
    body = body.replace(
        "<table>", '<div class="table-scroll" style="overflow-x:auto"><table>'
    ).replace("</table>", "</table></div>")
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{CSS}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def build(results_dir: str | Path, notebooks_dir: str | Path | None = None) -> Path:
    """Write ``REPORT.md``, ``REPORT.html`` and ``index.json`` into ``results_dir``,
    with the executed notebooks' HTML pages beside them; returns the .md path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    experiments = collect(results_dir, Path(notebooks_dir) if notebooks_dir else None)
    pages = render_notebooks(results_dir, experiments)
    sweeps = collect_sweeps(results_dir)
    md = render(experiments, results_dir, pages, sweeps)
    path = atomic_write_text(results_dir / "REPORT.md", md)
    atomic_write_text(results_dir / "REPORT.html", to_html(md))
    entries = index(experiments, results_dir, pages, sweeps)
    atomic_write_text(results_dir / "index.json", dump_json(entries))
    return path
