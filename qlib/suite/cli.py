"""``python -m qlib suite run|report|list``: the experiment suite's command line."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import report
from .catalogue import NOTEBOOKS_DIR, discover, notebook_intro, notebook_parameters
from .params import combine, load_params_file, parse_grid, parse_value
from .results import results_dir
from .runner import run_suite

__all__ = ["add_parser", "parse_value"]


def _parameters(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """(fixed, grid) from -f, -p, --grid and --device; ValueError for a bad one."""
    file_fixed, file_grid = load_params_file(args.params_file) if args.params_file else ({}, {})
    cli_fixed = {k: parse_value(v) for k, v in (args.param or [])}
    cli_grid: dict[str, list[Any]] = {}
    for spec in args.grid or []:
        name, values = parse_grid(spec)
        if name in cli_grid:
            raise ValueError(f"--grid {name} given twice (list every value in one --grid)")
        cli_grid[name] = values
    fixed, grid = combine(file_fixed, file_grid, cli_fixed, cli_grid)
    if args.device:
        if "device" in grid:
            raise ValueError("device: given with both --device and --grid")
        fixed["device"] = args.device
    return fixed, grid


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        params, grid = _parameters(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    executor = args.executor or ("dask" if args.scheduler else "local")
    if args.scheduler and executor != "dask":
        print("error: --scheduler goes with --executor dask", file=sys.stderr)
        return 2
    if executor == "dask" and not grid:
        print("error: --executor dask runs sweeps: give --grid (or `grid:` in -f)", file=sys.stderr)
        return 2
    notebooks = discover(args.notebooks, args.only)
    if not notebooks:
        print(f"no notebooks in {args.notebooks}", file=sys.stderr)
        return 2
    if grid:
        return _run_sweep(args, notebooks, params, grid, executor)
    workers = args.workers or 1
    out = Path(args.output_dir)
    t0 = time.perf_counter()
    results = run_suite(
        notebooks,
        out,
        params,
        workers=workers,
        timeout=args.timeout,
        progress=workers <= 1 and not args.quiet,
        resume=args.resume,
    )
    failed = [r for r in results if not r.ok]
    skipped = sum(r.skipped for r in results)
    print(
        f"{len(results) - len(failed)} of {len(results)} notebooks ok"
        + (f" ({skipped} skipped: done before)" if skipped else "")
        + f" in {time.perf_counter() - t0:.1f} s; results in {out}"
    )
    rc = _report(out, args.notebooks)
    if failed:
        print(f"{len(failed)} notebook(s) failed:", file=sys.stderr)
        for r in failed:
            where = f" ({out / r.output})" if r.output else ""
            print(f"  {r.name}: {r.error_line()}{where}", file=sys.stderr)
        rc = 1
    return rc


def _report(out: Path, notebooks: Path) -> int:
    """Build the report; 1 (and why) when it fails, without losing the run's verdict."""
    try:
        md = report.build(out, notebooks_dir=notebooks)
        print(f"report: {md}, {md.with_suffix('.html')} and {md.with_name('index.json')}")
    except Exception as exc:
        print(f"report failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_sweep(
    args: argparse.Namespace,
    notebooks: list[Path],
    params: dict[str, Any],
    grid: dict[str, list[Any]],
    executor: str,
) -> int:
    from . import sweep

    out = Path(args.output_dir)
    workers = args.workers or ((os.cpu_count() or 2) if executor == "dask" else 1)
    axes = "; ".join(f"{k}={', '.join(map(repr, v))}" for k, v in grid.items())
    print(f"sweep over {axes} on {executor}", flush=True)
    done = sweep.run_sweep(
        notebooks,
        out,
        params,
        grid,
        executor=executor,
        workers=workers,
        scheduler=args.scheduler,
        timeout=args.timeout,
        progress=executor == "local" and workers <= 1 and not args.quiet,
        resume=args.resume,
    )
    s = done.summary
    print(sweep.format_summary(s))
    c = s["counts"]
    print(
        f"{c['ok']} of {c['points']} points ok"
        + (f" ({c['skipped']} skipped: done before)" if c["skipped"] else "")
        + f" in {s['seconds']:.1f} s; summary in {out / sweep.SUMMARY}, "
        f"points in {out / sweep.SWEEPS_DIR}"
    )
    rc = _report(out, args.notebooks)
    if done.failed:
        print(f"{len(done.failed)} point(s) failed:", file=sys.stderr)
        for e in done.failed:
            where = f" ({out / e['executed_notebook']})" if e.get("executed_notebook") else ""
            print(f"  {e['notebook']} {e['point']}: {e['failure']}{where}", file=sys.stderr)
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
        "-f",
        "--params-file",
        type=Path,
        metavar="FILE",
        help="YAML mapping name -> value (papermill's -f); its `grid:` mapping name -> list "
        "holds sweep axes. -p and --grid win over it",
    )
    r.add_argument(
        "--grid",
        action="append",
        metavar="NAME=V1,V2,...",
        help="sweep: run every combination of the values (each parsed like a -p value; "
        "commas inside [] or quotes do not split) of every --grid, one run per point, "
        "into DIR/sweeps/<notebook>/<point>/",
    )
    r.add_argument(
        "--executor",
        choices=("local", "dask"),
        help="where a sweep's points run: local (default; --workers processes) or dask "
        "(a LocalCluster of --workers processes, or --scheduler)",
    )
    r.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="a running Dask scheduler (tcp://host:8786) for --executor dask",
    )
    r.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="run N notebooks (points) in parallel processes (no per-cell progress bars; a "
        "timing notebook still runs alone on the host); with --executor dask: the "
        "LocalCluster's worker processes (default: the cores)",
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
        help="skip notebooks (sweep points) whose last run here ended ok with the same "
        "parameters, notebook and commit; run the others",
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
