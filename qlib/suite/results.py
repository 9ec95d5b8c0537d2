"""What notebooks call to save their tables, plots and findings, with provenance.

One ``ResultWriter`` per notebook run::

    w = ResultWriter("03_throughput_vs_context", params=dict(device=device, n=n))
    w.save_table(df, "prefill", key=True, caption="prefill tok/s by prompt length")
    w.save_plot(fig, "prefill", caption="prefill tok/s")
    w.finding("peak", "Prefill peaks at {tps:.0f} tok/s for T = {t}.", table="prefill",
              tps=best.tps, t=best.T)

Files land in ``<output_dir>/<name>/``: ``prefill_cpu.csv`` (and ``.json``),
``prefill_cpu.png`` (and ``.svg``), ``meta_cpu.json``. The suffix is the device, so a CPU run
and a GPU run sit side by side. ``output_dir`` is ``$QLIB_RESULTS_DIR`` (set by
``python -m qlib suite run``) or ``results/`` of the checkout, so a notebook
opened by hand writes to the same place. Every file is written atomically
(temporary file in the same folder, then ``os.replace``), so a crash never
leaves a truncated result, and ``meta_<device>.json`` is rewritten after each
save, so a run that fails half-way still describes what it saved. What an
earlier run saved and this one has not saved again stays listed under
``meta["earlier"]`` (the suite runner drops that list when the notebook
finishes), so a rerun that dies half-way hides nothing from the report.

Reproducibility: ``meta["machine"]`` (``qlib.suite.machine.machine_info``) records
the versions, commit and machine of every run. A table's *timing columns*
(``is_timing_column``: a time unit, a rate or a load average in the name, plus
any named by ``save_table(..., timing=[...])``) are recorded in its meta entry;
``comparable(dir, device)`` is a run's results without them, which two runs
with the same parameters and seed must match exactly.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from .machine import REPO_ROOT, machine_info

RESULTS_ENV = "QLIB_RESULTS_DIR"  # set by the suite runner
NOTEBOOK_ENV = "QLIB_NOTEBOOK"  # the notebook's stem, set by the suite runner
RUN_ID_ENV = "QLIB_RUN_ID"  # one id per suite run, set by the suite runner
SEED_LABEL = "seed (candle 0.11.0, M2 Max)"
_STEM = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
# Words of a column name that make it a timing column (the name is split at anything but
# letters and digits, lower-cased): a time unit, a rate, or the machine's load average.
TIMING_WORDS = frozenset(
    {"ms", "us", "µs", "μs", "ns", "s", "sec", "secs", "seconds", "gbps", "1min", "5min", "15min"}
)
_WORD = re.compile(r"[^0-9a-zµμ]+")


def results_dir() -> Path:
    """``$QLIB_RESULTS_DIR`` or ``results/`` of the checkout."""
    env = os.environ.get(RESULTS_ENV)
    return Path(env) if env else REPO_ROOT / "results"


def device_tag(device: object) -> str:
    """'cpu', 'cuda', 'mps' for a device string or torch.device ('cuda:1' -> 'cuda')."""
    return str(device).split(":", 1)[0].strip().lower() or "cpu"


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def jsonable(obj: Any) -> Any:
    """Plain JSON types from numpy/torch scalars, arrays, paths, tuples; NaN/inf -> None."""
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy / torch arrays and scalars
        return jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return jsonable(obj.item())
    return str(obj)


def dump_json(obj: Any) -> str:
    return json.dumps(jsonable(obj), indent=1, ensure_ascii=False) + "\n"


def is_timing_column(name: object) -> bool:
    """Whether a column holds a measured time or something that varies with it.

    By name: ``prefill_ms``, ``decode_ms_median``, ``time_s``, ``tok_s``,
    ``gbps``, ``seconds``, ``ctx 32 (µs)``, ``load_1min`` are; ``tokens``,
    ``max_abs_diff``, ``text`` are not. Columns derived from timings under
    another name (a speed ratio) are declared with ``save_table(timing=...)``.
    """
    words = set(_WORD.split(str(name).lower()))
    return bool(words & TIMING_WORDS)


def timing_columns(columns: Any, extra: Any = None) -> list[str]:
    """The timing columns among ``columns``: by name, plus ``extra`` (True: all of them)."""
    columns = [str(c) for c in columns]
    if extra is True:
        return columns
    extra = {str(c) for c in (extra or ())}
    missing = extra - set(columns)
    if missing:
        raise ValueError(f"timing column(s) {sorted(missing)} not in the table ({columns})")
    return [c for c in columns if c in extra or is_timing_column(c)]


def _frame(data: Any):
    """A DataFrame from a DataFrame, a list of records or a dict of columns."""
    import pandas as pd

    df = data if isinstance(data, pd.DataFrame) else pd.DataFrame(data)
    if not isinstance(df.index, pd.RangeIndex) or df.index.name is not None:
        df = df.reset_index()
    return df


class ResultWriter:
    """Saves one notebook run's results under ``<output_dir>/<name>/``, tagged by device.

    ``name`` is the notebook's stem; when the suite runs the notebook, the
    runner's stem (``$QLIB_NOTEBOOK``) wins. ``params`` are the notebook's
    parameters (recorded in ``meta_<device>.json``); ``device`` defaults to
    ``params["device"]``, else "cpu".
    """

    def __init__(
        self,
        name: str,
        params: dict[str, Any] | None = None,
        *,
        device: object = None,
        output_dir: str | Path | None = None,
    ) -> None:
        self.name = os.environ.get(NOTEBOOK_ENV) or name
        self.params = dict(params or {})
        self.device = device_tag(device if device is not None else self.params.get("device", "cpu"))
        self.dir = Path(output_dir) if output_dir is not None else results_dir()
        self.dir = self.dir / self.name
        self.meta: dict[str, Any] = {
            "notebook": self.name,
            "device": self.device,
            "run_id": os.environ.get(RUN_ID_ENV),
            "started": now(),
            "updated": None,
            "params": self.params,
            "machine": machine_info(),
            "tables": [],
            "plots": [],
            "files": [],
            "findings": [],
            "seed_references": [],
            "skipped": [],
            "earlier": self._earlier(),
        }
        self._write_meta()

    _SAVED = ("tables", "plots", "files")

    def _earlier(self) -> dict[str, list[dict[str, Any]]]:
        """What the last run saved here (and what it still carried), whose files exist."""
        try:
            old = json.loads(self.meta_path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(old, dict):
            return {}
        out: dict[str, list[dict[str, Any]]] = {}
        for kind in self._SAVED:
            entries = [
                {**e, "run_id": old.get("run_id"), "started": old.get("started")}
                for e in old.get(kind) or []
            ]
            stems = {e.get("stem") for e in entries}
            carried = (old.get("earlier") or {}).get(kind) or []
            entries += [e for e in carried if e.get("stem") not in stems]
            entries = [e for e in entries if self._files_exist(e)]
            if entries:
                out[kind] = entries
        return out

    def _files_exist(self, entry: dict[str, Any]) -> bool:
        names = [entry.get(k) for k in ("csv", "json", "png") if entry.get(k)]
        return bool(names) and all((self.dir / n).is_file() for n in names)

    # -- paths ------------------------------------------------------------
    def path(self, stem: str, ext: str) -> Path:
        """``<dir>/<stem>_<device>.<ext>``."""
        if not _STEM.match(stem):
            raise ValueError(f"bad result name {stem!r}: use letters, digits, '_', '-', '.'")
        if stem in ("meta", "status") or stem.startswith(("meta_", "status_")):
            raise ValueError(f"result name {stem!r} is reserved for the meta and status files")
        return self.dir / f"{stem}_{self.device}.{ext}"

    @property
    def meta_path(self) -> Path:
        return self.dir / f"meta_{self.device}.json"

    def _write_meta(self) -> None:
        self.meta["updated"] = now()
        atomic_write_text(self.meta_path, dump_json(self.meta))

    def _record(self, kind: str, entry: dict[str, Any], key: str = "stem") -> None:
        """Add ``entry`` to ``meta[kind]``, replacing one with the same key, and save meta."""
        items = [e for e in self.meta[kind] if e[key] != entry[key]]
        items.append(entry)
        self.meta[kind] = items
        earlier = self.meta["earlier"]
        if kind in earlier:  # saved again: no longer an earlier run's
            earlier[kind] = [e for e in earlier[kind] if e.get(key) != entry[key]]
            if not earlier[kind]:
                del earlier[kind]
        self._write_meta()

    # -- what notebooks call ----------------------------------------------
    def save_table(
        self,
        data: Any,
        stem: str,
        *,
        key: bool = False,
        caption: str = "",
        timing: Any = None,
    ):
        """Save a table as CSV and JSON (records); ``key=True`` puts it in the report.

        ``data``: a DataFrame, a list of dicts or a dict of columns. Returns the DataFrame.
        ``timing``: columns that vary from run to run besides those named as timings
        (``is_timing_column``), e.g. a ratio of two times; ``True``: every column.
        """
        df = _frame(data)
        timed = timing_columns(df.columns, timing)
        csv, js = self.path(stem, "csv"), self.path(stem, "json")
        atomic_write_text(csv, df.to_csv(index=False))
        atomic_write_text(js, df.to_json(orient="records", indent=1, force_ascii=False) + "\n")
        entry = {
            "stem": stem,
            "csv": csv.name,
            "json": js.name,
            "rows": len(df),
            "columns": [str(c) for c in df.columns],
            "key": key,
            "caption": caption,
            "timing_columns": timed,
        }
        self._record("tables", entry)
        return df

    def save_plot(
        self,
        fig: Any,
        stem: str,
        *,
        caption: str = "",
        dpi: int = 160,
        model: Any = None,
        footer: bool = True,
    ) -> Path:
        """Save a matplotlib figure as PNG (``dpi``) and SVG beside it; returns the PNG's path.

        ``footer``: first write 'model: ... · machine: ...' under the figure
        (``qlib.suite.plots.footer``): the model is ``model`` (a path or a description),
        else the file name of ``params["model_path"]``; the machine comes from
        ``meta["machine"]`` and the device. The figure stays open for inline display.
        """
        if footer:
            from .plots import footer as add_footer
            from .plots import machine_line

            dev = self.params.get("device")
            if dev is None or device_tag(dev) != self.device:
                dev = self.device
            add_footer(
                fig,
                model=model if model is not None else self.params.get("model_path"),
                machine=machine_line(self.meta["machine"], dev),
            )
        saved = {}
        for fmt in ("png", "svg"):
            buf = io.BytesIO()
            kwargs = {"dpi": dpi} if fmt == "png" else {"metadata": {"Date": None}}
            fig.savefig(buf, format=fmt, bbox_inches="tight", **kwargs)
            saved[fmt] = atomic_write_bytes(self.path(stem, fmt), buf.getvalue())
        entry = {"stem": stem, "png": saved["png"].name, "svg": saved["svg"].name}
        self._record("plots", {**entry, "caption": caption})
        return saved["png"]

    def save_json(self, obj: Any, stem: str, *, timing: bool = False) -> Path:
        """Save any JSON-able object (numpy values and NaN are converted).

        ``timing=True``: it holds timings (left out of ``comparable``).
        """
        p = atomic_write_text(self.path(stem, "json"), dump_json(obj))
        self._record("files", {"stem": stem, "json": p.name, "timing": bool(timing)})
        return p

    def finding(self, key: str, sentence: str, *, table: str | None = None, **values: Any) -> str:
        """Record a one-sentence finding computed from the data; returns the sentence.

        ``sentence`` is a ``str.format`` template filled from ``values``
        (``"{ratio:.1f}x faster"``); ``table`` names the saved table it comes from.
        """
        text = sentence.format(**values)
        tables = {t["stem"] for t in self.meta["tables"]}
        if table is not None and table not in tables:
            raise ValueError(f"finding {key!r} cites table {table!r}, not saved (saved: {tables})")
        entry = {"key": key, "sentence": text, "table": table, "values": values}
        self._record("findings", entry, key="key")
        return text

    def seed_reference(
        self,
        key: str,
        what: str,
        seed: Any,
        *,
        ours: Any = None,
        unit: str = "",
        source: str = "",
    ) -> dict[str, Any]:
        """Record the seed's figure for ``what`` beside ours, labelled ``SEED_LABEL``.

        ``source`` says where in the seed the figure is (chapter, table). The
        report shows it as a reference only: it was measured on other hardware.
        """
        entry = {
            "key": key,
            "what": what,
            "seed": seed,
            "ours": ours,
            "unit": unit,
            "source": source,
            "label": SEED_LABEL,
        }
        self._record("seed_references", entry, key="key")
        return entry

    def skipped(self, part: str, reason: str) -> str:
        """Record a part of the experiment that did not run here, and why."""
        self._record("skipped", {"part": part, "reason": reason}, key="part")
        return f"skipped {part}: {reason}"


def drop_earlier(folder: str | Path, device: str = "cpu") -> bool:
    """Forget the earlier run's entries in ``folder/meta_<device>.json`` (its run finished).

    Their files stay on disk. Returns whether the meta changed.
    """
    path = Path(folder) / f"meta_{device}.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or not meta.get("earlier"):
        return False
    meta["earlier"] = {}
    atomic_write_text(path, dump_json(meta))
    return True


def comparable(folder: str | Path, device: str = "cpu") -> dict[str, Any]:
    """One run's results in ``folder`` as plain data, without what varies between runs.

    Every saved table (read back from its CSV) without its timing columns, every
    saved JSON file not marked ``timing``, and the names of the plots, findings
    and seed references (their values may quote timings). Two runs with the same
    parameters and seed give equal results.
    """
    import pandas as pd

    folder = Path(folder)
    meta = json.loads((folder / f"meta_{device}.json").read_text())
    tables = {}
    for t in meta["tables"]:
        df = pd.read_csv(folder / t["csv"], keep_default_na=False)
        kept = [c for c in df.columns if c not in set(t.get("timing_columns") or ())]
        tables[t["stem"]] = {"columns": kept, "rows": df[kept].to_dict("records")}
    files = {
        f["stem"]: json.loads((folder / f["json"]).read_text())
        for f in meta["files"]
        if not f.get("timing")
    }
    return {
        "params": meta["params"],
        "tables": tables,
        "files": files,
        "plots": sorted(p["stem"] for p in meta["plots"]),
        "findings": sorted(f["key"] for f in meta["findings"]),
        "seed_references": sorted(r["key"] for r in meta["seed_references"]),
        "skipped": meta["skipped"],
    }
