"""``python -m qlib suite run|report|list``: the experiment suite's command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import report
from .catalogue import NOTEBOOKS_DIR, discover, notebook_intro, notebook_parameters
from .results import results_dir
from .runner import run_suite


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


def _cmd_run(args: argparse.Namespace) -> int:
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
        resume=args.resume,
    )
    failed = [r for r in results if not r.ok]
    skipped = sum(r.skipped for r in results)
    print(
        f"{len(results) - len(failed)} of {len(results)} notebooks ok"
        + (f" ({skipped} skipped: done before)" if skipped else "")
        + f" in {time.perf_counter() - t0:.1f} s; results in {out}"
    )
    rc = 0
    try:
        md = report.build(out, notebooks_dir=args.notebooks)
        print(f"report: {md}, {md.with_suffix('.html')} and {md.with_name('index.json')}")
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
    md = report.build(Path(args.output_dir), notebooks_dir=args.notebooks)
    print(f"report: {md}, {md.with_suffix('.html')} and {md.with_name('index.json')}")
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
    r.add_argument(
        "--resume",
        action="store_true",
        help="skip notebooks whose last run here ended ok with the same parameters, notebook "
        "and commit; run the others",
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
