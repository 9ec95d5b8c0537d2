"""``python -m qlib bench``: the benchmark protocol (``qlib.suite.bench``) from the command line."""

from __future__ import annotations

import argparse
import csv
import io
import json
from pathlib import Path

from .. import models
from ..suite.bench import (
    PEERS,
    PROMPT_TOKENS,
    REPS,
    RUNTIMES,
    STEPS,
    merge_rounds,
    peer_configs,
    protocol_argv,
    run_config,
    run_in_subprocess,
)
from .common import (
    add_engine_args,
    add_model_args,
    add_seed_arg,
    apply_seed_and_threads,
    check_position_limit,
    existing_file,
    positive_int,
    positive_ints,
)

FORMATS = ("md", "csv", "json")


def peer_names(text: str) -> tuple[str, ...]:
    """``--peers``' value: peer names separated by commas, each one of ``PEERS``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown peer {', '.join(unknown) or repr(text)}: choose from {', '.join(PEERS)}"
        )
    return names


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="prefill / decode speed with the benchmark protocol (docs/design.md)",
        description="The benchmark protocol: the first --prompt-tokens tokens of the prompt "
        "file, prefilled once, then --steps greedy decode steps (each reads the token back to "
        "the host); one untimed first run, then --reps timed runs on a fresh KV cache; min and "
        "median. The table has one row per runtime and test: ppN = prefill of N prompt "
        "tokens, tgN = N decode steps.",
    )
    add_model_args(p)
    p.add_argument(
        "--prompt-file",
        type=existing_file,
        default=None,
        help="the prompt's text (default: data/passage.txt)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=PROMPT_TOKENS,
        help="prompt tokens, from the start of the file (default: %(default)s)",
    )
    p.add_argument(
        "--context",
        type=positive_ints,
        default=None,
        metavar="N[,M,...]",
        help="long context: prefill N tokens (the prompt file's tokens repeated to N; "
        "replaces --prompt-tokens), then time --steps decode steps from position N; several "
        "points run in one process, alternating in each rep, with their decode ratios printed",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=STEPS,
        help="greedy decode steps after the prefill (default: %(default)s, the "
        "protocol's); a run generates steps + 1 tokens, the prefill's included",
    )
    p.add_argument(
        "--reps",
        type=positive_int,
        default=REPS,
        help="timed runs after the untimed first one (default: %(default)s)",
    )
    add_seed_arg(
        p,
        "seeds torch (default: %(default)s); the protocol decodes greedily, so "
        "the tokens do not depend on it",
    )

    add_engine_args(p)
    p.add_argument(
        "--prefill",
        default=None,
        choices=("bf16", "int8", "int8-attn", "f32", "tf32", "packed"),
        help="--engine fast: prefill matmuls (CPU: bf16 (default where the CPU has AMX "
        "hardware), int8, or int8-attn: int8 attention products too; CUDA: f32 (default), "
        "tf32, bf16 or packed)",
    )
    p.add_argument(
        "--runtime",
        default="qlib",
        choices=sorted(RUNTIMES),
        help="what runs the model: qlib (default), or a peer (transformers, llama.cpp)",
    )
    p.add_argument(
        "--dtype",
        default="f32",
        choices=("f32", "bf16", "f16"),
        help="transformers dtype (default: f32)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="md: a table (default); csv: the same rows; json: one JSON object with every run",
    )
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument(
        "--peers",
        nargs="?",
        const=",".join(PEERS),
        type=peer_names,
        default=None,
        metavar="NAME[,NAME]",
        help="also run the peers, each in its own process, and print qlib / peer ratios: "
        "transformers and llama.cpp (where installed), or those named",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="with --peers: run qlib and the peers this many times, alternating (the order "
        "reversed every other round), pool each one's runs and print the ratio of each "
        "round beside the pooled one: ratios that a machine's drift between processes moves "
        "less (default: %(default)s)",
    )
    p.add_argument(
        "--no-floor",
        dest="floor",
        action="store_false",
        help="skip the note of qlib's decode against its bytes floor (the weights and KV cache "
        "a step reads, at the memory's rate measured after the runs: ~1 s more)",
    )
    p.set_defaults(func=main)


# -- the table ---------------------------------------------------------------

COLUMNS = (
    "model",
    "size",
    "params",
    "runtime",
    "variant",
    "device",
    "threads",
    "test",
    "t/s median",
    "t/s max",
    "ms median",
    "first run ms",
    "peak RSS",
)
CSV_COLUMNS = (
    "model",
    "size_bytes",
    "params",
    "runtime",
    "variant",
    "device",
    "threads",
    "test",
    "tokens",
    "tok_s_median",
    "tok_s_max",
    "ms_median",
    "ms_min",
    "first_run_ms",
    "peak_rss_mb",
    "rss_before_load_mb",
    "load_ms",
    "error",
)


def model_facts(path: str) -> dict:
    """Name, file size and parameter count of a GGUF file (its header only)."""
    from ..gguf import SplitContent, read_content
    from ..gguf.split import SHARD_NAME

    p = Path(path)
    facts = {"model": p.name.removesuffix(".gguf"), "size_bytes": None, "params": None}
    try:
        facts["size_bytes"] = p.stat().st_size
        content = read_content(p)
        if isinstance(content, SplitContent):  # the model's name and its shards' bytes
            facts["model"] = SHARD_NAME.match(p.name)["prefix"]
            facts["size_bytes"] = content.file_size
        facts["params"] = sum(t.n_elements for t in content.tensor_infos.values())
    except (OSError, ValueError):
        pass
    return facts


def variant(r: dict) -> str:
    if r["runtime"] == "qlib":
        if r.get("engine") == "fast":
            kv = f", {r['kv_type']} KV" if r.get("kv_type", "f32") != "f32" else ""
            if r.get("decode") in ("merged", "persistent"):  # the fast CUDA engine's, not fused
                kv += f", {r['decode']} decode"
            return f"fast ({r['prefill']} prefill{kv})" if r.get("prefill") else "fast"
        return f"faithful {r.get('form') or 'default'}"
    if r["runtime"] == "transformers":
        return r.get("dtype", "")
    kv = f", {r['kv_type']} KV" if r.get("kv_type") else ""
    return f"v{r['version']}{kv}" if r.get("version") else kv.lstrip(", ")


def _runtime_of(r: dict) -> str:
    if "runtime" in r:
        return r["runtime"]
    argv = r.get("argv", [])
    return argv[argv.index("--runtime") + 1] if "--runtime" in argv else "qlib"


def rows(results: list[dict]) -> list[dict]:
    """Two rows per configuration and context (ppN: the prefill, tgN: the decode steps; with
    several contexts tgN @ dC: the steps after C prompt tokens), CSV names."""
    facts: dict[str, dict] = {}
    out = []
    for r in results:
        if "error" in r:
            out.append({"runtime": _runtime_of(r), "error": r["error"]})
            continue
        f = facts.setdefault(r["model"], model_facts(r["model"]))
        common = {**f, "runtime": r["runtime"], "variant": variant(r), "device": r["device"],
                  "threads": r["threads"], "peak_rss_mb": r["peak_rss_mb"],
                  "rss_before_load_mb": r.get("rss_before_load_mb"),
                  "load_ms": r.get("load_ms")}  # fmt: skip
        points = r.get("curve") or [{**r, "context": None}]
        for p in points:
            n = p["context"] or r["prompt_tokens"]
            depth = f" @ d{p['context']}" if r.get("curve") else ""
            for test, ms, tok_s, first in (
                (f"pp{n}", "prefill_ms", "prefill_tok_s", "prefill_ms"),
                (f"tg{r['steps']}{depth}", "decode_ms_per_token", "decode_tok_s",
                 "decode_ms_per_token"),
            ):  # fmt: skip
                out.append({**common, "test": test, "tokens": n if test[1] == "p" else r["steps"],
                            "tok_s_median": p[tok_s]["median"], "tok_s_max": p[tok_s]["max"],
                            "ms_median": p[ms]["median"], "ms_min": p[ms]["min"],
                            "first_run_ms": p["first_run"][first]})  # fmt: skip
    return out


def curve_ratios(result: dict) -> list[str]:
    """With several contexts: each one's decode time (min) over the first context's, measured
    in the one process."""
    curve = result.get("curve") or []
    if len(curve) < 2:
        return []
    base = curve[0]
    parts = [
        f"d{p['context']} / d{base['context']} x"
        f"{p['decode_ms_per_token']['min'] / base['decode_ms_per_token']['min']:.3f}"
        for p in curve[1:]
    ]
    return [f"{result['runtime']} decode time, contexts alternating in one process: "
            + ", ".join(parts)]  # fmt: skip


def _size(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _params(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def decode_notes(results: list[dict]) -> list[str]:
    """What the fast CUDA engine's ``decode="auto"`` chose and why (nothing for a decode the
    command line named, "as asked", or for engines without a choice)."""
    return [f"{r['runtime']} decode: {r['decode']}: {r['decode_note']}" for r in results
            if r.get("decode_note") not in (None, "as asked")]  # fmt: skip


def floor_notes(results: list[dict]) -> list[str]:
    """Each decode against its bytes floor (``bench.decode_floor``), where one was measured."""
    notes = []
    for r in results:
        f = r.get("floor")
        if f and "error" not in r:
            ms = r["decode_ms_per_token"]["median"]
            notes.append(f"{r['runtime']} decode: {ms / f['ms']:.2f}x its bytes floor ("
                         f"{f['bytes'] / 1e6:.1f} MB a step at {f['read_gbs']:.1f} GB/s, the "
                         f"memory's rate measured after the runs: {f['ms']:.2f} ms)")  # fmt: skip
    return notes


def markdown(results: list[dict], ratios: dict | None = None) -> str:
    table = [rw for rw in rows(results) if "error" not in rw]
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---:" if c.startswith(("t/s", "ms", "first", "peak", "threads",
                                                     "size", "params")) else "---"
                            for c in COLUMNS) + "|"]  # fmt: skip
    for rw in table:
        unit = "" if rw["test"].startswith("pp") else "/token"
        cells = (rw["model"], _size(rw["size_bytes"]), _params(rw["params"]), rw["runtime"],
                 rw["variant"], rw["device"], str(rw["threads"]), rw["test"],
                 f"{rw['tok_s_median']:.2f}", f"{rw['tok_s_max']:.2f}",
                 f"{rw['ms_median']:.2f}{unit}", f"{rw['first_run_ms']:.2f}{unit}",
                 f"{rw['peak_rss_mb']:.0f} MB")  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    loads = [f"{r['runtime']} {r['load_ms']:.0f} ms" for r in results if r.get("load_ms")]
    notes = [f"\nload (read + build): {', '.join(loads)}"] if loads else []
    added = [f"{r['runtime']} {r['peak_rss_mb'] - r['rss_before_load_mb']:.0f} MB"
             for r in results if r.get("rss_before_load_mb") and "peak_rss_mb" in r]  # fmt: skip
    if added:  # the runtime's own imports (torch: ~220 MB) apart
        notes.append(f"peak RSS above the RSS before loading the model: {', '.join(added)}")
    notes += decode_notes(results)
    notes += floor_notes(results)
    notes += [f"{rw['runtime']}: FAILED {rw['error']}" for rw in rows(results) if "error" in rw]
    notes += [line for r in results if "error" not in r for line in curve_ratios(r)]
    for peer, r in (ratios or {}).items():
        notes.append(
            f"qlib / {peer}: prefill time x{r['prefill']:.2f}, decode time x{r['decode']:.2f}, "
            f"peak RSS x{r['peak_rss']:.2f} (below 1: qlib faster / smaller)"
        )
        if "rounds" in r:
            each = "; ".join(f"{key} " + " ".join(f"x{v:.2f}" for v in r["rounds"][key])
                             for key, _ in _RATIO_OF)  # fmt: skip
            notes.append(f"qlib / {peer} in each of {len(r['rounds']['decode'])} rounds: {each}")
    return "\n".join(lines + notes)


def csv_text(results: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows(results))
    return buf.getvalue().rstrip("\n")


_RATIO_OF = (("prefill", "prefill_ms"), ("decode", "decode_ms_per_token"))


def _format(args: argparse.Namespace) -> str:
    if args.json and args.format not in (None, "json"):
        raise ValueError(f"--json is --format json; it cannot go with --format {args.format}")
    return args.format or ("json" if args.json else "md")


def main(args: argparse.Namespace) -> int:
    fmt = _format(args)
    if args.rounds > 1 and not args.peers:
        raise ValueError("--rounds alternates qlib with its peers: it needs --peers")
    args.model = args.model or models.path()
    args.prompt_file = args.prompt_file or models.data_file("passage.txt")
    if args.context:
        args.prompt_tokens = args.context[0]
    if args.runtime == "qlib":  # (a peer runtime says its own limit)
        from ..gguf import read_content

        longest = max(args.context or [args.prompt_tokens])
        flag = "--context" if args.context else "--prompt-tokens"
        check_position_limit(read_content(args.model).metadata, args.engine, args.form,
                             longest + args.steps, f"{flag} {longest} and {args.steps} steps",
                             f"lower {flag} or --steps", args.max_seq_len)  # fmt: skip
    if not args.peers:
        apply_seed_and_threads(args)
        result = run_config(args)
        if fmt == "json":
            print(json.dumps(result))
        else:
            print(markdown([result]) if fmt == "md" else csv_text([result]))
        return 0
    seed = ["--seed", str(args.seed)]
    own = protocol_argv(args) + seed
    for flag, value in (
        ("--engine", args.engine),
        ("--form", args.form),
        ("--attention", args.attention),
        ("--prefill", args.prefill),
    ):
        if value:
            own += [flag, value]
    configs = [own] + [c + seed for c in peer_configs(args, args.peers)]
    rounds = []
    for r in range(args.rounds):  # every other round in the reverse order
        order = range(len(configs)) if r % 2 == 0 else reversed(range(len(configs)))
        done = {i: run_in_subprocess(configs[i]) for i in order}
        rounds.append([done[i] for i in range(len(configs))])
    results = [merge_rounds([rd[i] for rd in rounds]) for i in range(len(configs))]
    ours = results[0]
    ratios = {}
    for i, peer in enumerate(results[1:], start=1):
        if "error" in peer or "error" in ours:
            continue
        ratios[peer["runtime"]] = {
            **{key: ours[stat]["min"] / peer[stat]["min"] for key, stat in _RATIO_OF},
            "peak_rss": ours["peak_rss_mb"] / peer["peak_rss_mb"],
        }
        if args.rounds > 1:  # each round's own ratio of mins
            ratios[peer["runtime"]]["rounds"] = {
                key: [rd[0][stat]["min"] / rd[i][stat]["min"] for rd in rounds]
                for key, stat in _RATIO_OF
            }
    if fmt == "json":
        print(json.dumps({"qlib": ours, "peers": results[1:], "ratios": ratios}))
    elif fmt == "csv":
        print(csv_text(results))
    else:
        print(markdown(results, ratios))
    return 0
