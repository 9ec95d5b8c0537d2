"""``build(results_dir)``: REPORT.md and REPORT.html from what the notebooks saved.

One section per experiment, ordered by notebook name, with a part per device
(cpu first): status, findings (each naming its table), key tables, plots,
the seed's figures beside ours, and a provenance line. A notebook that failed
or never ran gets a section that says so; failed runs (an error, a timeout, a
kernel that died, a run that never finished) are also listed under the status
table with their reason.
"""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .machine import summary
from .results import SEED_LABEL, atomic_write_text, now

MAX_ROWS = 20  # rows of a key table shown in the report
DEVICE_ORDER = ("cpu", "cuda", "mps")

CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 60rem;
       margin: 2rem auto; padding: 0 1rem; color: #1d1d1f; }
h1, h2, h3 { line-height: 1.2; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem;
       margin-top: 2.5rem; }
table { border-collapse: collapse; margin: .6rem 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: .2rem .5rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
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
    from .suite import NOTEBOOKS_DIR, notebook_intro

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


def fmt(v: Any) -> str:
    """A table cell: integers as such, floats to 4 significant digits, pipes escaped."""
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):  # numpy scalar
        v = v.item()
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if v.is_integer() and abs(v) < 1e15:
            return fmt(int(v))
        return f"{v:.1f}" if 1e3 <= abs(v) < 1e7 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 100_000 else str(v)
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A GitHub-style markdown table from a list of records."""
    columns = columns or (list(rows[0]) if rows else [])
    if not columns:
        return ""
    out = ["| " + " | ".join(fmt(c) for c in columns) + " |", "|" + " --- |" * len(columns)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
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


def _provenance(run: DeviceRun, rel_nb: str | None) -> str:
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
        parts.append(f"[executed notebook]({rel_nb})")
    return "*Provenance:* " + "; ".join(parts) if parts else ""


def failure_reason(status: dict[str, Any]) -> str:
    """'timeout at cell In [3]: `CellTimeoutError: ...`' for a failed run's status."""
    state = status.get("state")
    how = {"running": "did not finish", None: "error"}.get(state, state)
    if status.get("cell") is not None:
        how += f" at cell In [{status['cell']}]"
    elif status.get("cell_index") is not None:
        how += f" at cell #{status['cell_index']}"
    return f"{how}: `{status.get('error')}`"


def _device_section(exp: Experiment, run: DeviceRun, results_dir: Path) -> list[str]:
    meta, status = run.meta, run.status
    lines = [f"### {exp.name} on {run.device}", ""]
    rel_nb = None
    if status and status.get("output") and (results_dir / status["output"]).is_file():
        rel_nb = status["output"]
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
    prov = _provenance(run, rel_nb)
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


def render(experiments: list[Experiment], results_dir: Path) -> str:
    """The whole report as markdown."""
    devices = sorted({r.device for e in experiments for r in e.runs}, key=_device_key)
    lines = ["# qlab results", "", f"Built {now()} by `python -m qlib suite report`.", ""]
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
    for e in experiments:
        title = f": {e.title}" if e.title and e.title != e.name else ""
        lines += [f'<a id="{e.name.replace("_", "-")}"></a>', "", f"## {e.name}{title}", ""]
        if e.intro:
            lines += [f"> {e.intro}", ""]
        if not e.runs:
            lines += [f"**Not run**: no results in `{e.name}/`.", ""]
        for run in e.runs:
            lines += _device_section(e, run, results_dir)
    return "\n".join(lines).rstrip() + "\n"


def to_html(md: str, title: str = "qlab results") -> str:
    import markdown

    body = markdown.markdown(md, extensions=["tables", "fenced_code", "sane_lists"])
    return (
        f'<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{CSS}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def build(results_dir: str | Path, notebooks_dir: str | Path | None = None) -> Path:
    """Write ``REPORT.md`` and ``REPORT.html`` into ``results_dir``; returns the .md path."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    md = render(collect(results_dir, Path(notebooks_dir) if notebooks_dir else None), results_dir)
    path = atomic_write_text(results_dir / "REPORT.md", md)
    atomic_write_text(results_dir / "REPORT.html", to_html(md))
    return path
