"""The speed protocol (docs/design.md), for qlib and its peers.

Prompt: the first N (203) tokens of ``data/passage.txt`` (no chat template,
no special tokens). One run = prefill once, then greedy-decode ``steps``
(128) tokens without stopping at EOS; every step reads the token back to the
host. One process per configuration: load, one untimed run (reported as
``first_run``), then ``reps`` runs on a fresh KV cache; min and median, and the
speeds from them (``prefill_tok_s``, ``decode_tok_s``: max and median).

``python -m qlib bench --json`` prints one JSON object. ``--peers`` also runs
transformers and llama.cpp (when installed; or the peers named), each in its own process
through this same module, and prints qlib / peer ratios from that one invocation;
``--rounds R`` repeats qlib and the peers R times, alternating, and pools each one's runs
(``merge_rounds``), printing each round's ratio beside the pooled one.

Long context (``--context N``): the prompt is the passage's tokens repeated to N (the same
ids for every runtime, each through its own tokenizer), so one invocation measures one point
of the decode-cost-against-context curve: prefill N tokens, then ``steps`` decode steps at
positions N .. N + steps - 1. ``--context N,M,...`` measures several points in one process,
the contexts alternating within each rep, so their ratios are side by side (the result's
``curve``; its top level is the first context's). ``--kv-type`` picks the KV cache's element
type for qlib's fast engine and llama.cpp alike (llama.cpp's default is f16; the fast
engine's f32).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROMPT_TOKENS = 203
STEPS = 128
REPS = 5


def _status_mb(key: str) -> float | None:
    """Field ``key`` (``VmRSS``, ``VmHWM``) of /proc/self/status in MiB; None without /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb() -> float:
    """Resident set size of this process now, in MiB (``VmRSS``; 0 where there is no /proc)."""
    return _status_mb("VmRSS") or 0.0


def peak_rss_mb() -> float:
    """Peak resident set size of this process image, in MiB.

    Linux: ``VmHWM`` from /proc/self/status. ``ru_maxrss`` would do elsewhere, but on Linux it
    keeps the parent's peak across fork + exec, so a configuration started from a big process
    (a notebook kernel, pytest) would report the parent's peak.
    """
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def prompt_ids(
    tokenizer_encode: Callable[[str], list[int]], n: int, prompt_file: Path, repeat: bool = False
) -> list[int]:
    """The first ``n`` tokens of the file; ``repeat``: of its tokens repeated as often as needed
    (the ``--context`` prompts)."""
    ids = tokenizer_encode(prompt_file.read_text())
    if repeat and ids:
        ids = ids * -(-n // len(ids))
    if len(ids) < n:
        raise ValueError(f"{prompt_file} has only {len(ids)} tokens, {n} requested")
    return ids[:n]


def contexts(args: argparse.Namespace) -> list[int]:
    """The ``--context`` points (none: the protocol's prompt)."""
    return list(getattr(args, "context", None) or [])


def max_prompt_tokens(args: argparse.Namespace) -> int:
    """The longest prompt of this configuration (a runtime's context size)."""
    return max(contexts(args) or [args.prompt_tokens])


def measure_prompts(
    run_once: Callable[[list[int]], tuple[float, float]],
    encode: Callable[[str], list[int]],
    args: argparse.Namespace,
) -> dict:
    """``run_once(ids) -> (prefill_ms, decode_ms_per_token)`` with the protocol's prompt, or at
    each ``--context`` point: one untimed run of each (``first_run``), then ``reps`` rounds
    that run every prompt in turn. With several contexts the first one's statistics are at the
    top and every context's in ``curve``."""
    points = contexts(args)
    if points:
        prompts = {n: prompt_ids(encode, n, args.prompt_file, repeat=True) for n in points}
    else:
        prompts = {args.prompt_tokens: prompt_ids(encode, args.prompt_tokens, args.prompt_file)}
    first = {n: run_once(ids) for n, ids in prompts.items()}
    runs: dict[int, list[tuple[float, float]]] = {n: [] for n in prompts}
    for _ in range(args.reps):
        for n, ids in prompts.items():
            runs[n].append(run_once(ids))
    if len(prompts) == 1:
        (n,) = prompts
        return _stats(first[n], runs[n])
    curve = [{"context": n, **_stats(first[n], runs[n])} for n in prompts]
    for point in curve:
        point.update(tokens_per_s({**point, "prompt_tokens": point["context"]}))
    return {**{k: v for k, v in curve[0].items() if k != "context"}, "curve": curve}


def _stats(first: tuple[float, float], runs: list[tuple[float, float]]) -> dict:
    prefill = [r[0] for r in runs]
    decode = [r[1] for r in runs]
    return {
        "prefill_ms": {"min": min(prefill), "median": statistics.median(prefill)},
        "decode_ms_per_token": {"min": min(decode), "median": statistics.median(decode)},
        "first_run": {"prefill_ms": first[0], "decode_ms_per_token": first[1]},
        "runs": [{"prefill_ms": p, "decode_ms_per_token": d} for p, d in runs],
    }


# -- engines -----------------------------------------------------------------


def bench_qlib(args: argparse.Namespace) -> dict:
    import torch

    from ..devices import synchronize
    from ..generate import greedy_id
    from ..llama.engine import GreedyOnDevice, load, resolve
    from ..tokenizer import Tokenizer

    options = {"prefill": args.prefill} if args.prefill else {}
    if args.attention:
        options["attention"] = args.attention
    if getattr(args, "kv_type", None) and resolve(args.engine, args.form)[0] == "fast":
        options["kv_type"] = args.kv_type  # (the faithful engine's cache is float32)
    if getattr(args, "decode", None) and resolve(args.engine, args.form)[0] == "fast":
        options["decode"] = args.decode  # (the fast CUDA engine's)
    if getattr(args, "max_seq_len", None) and resolve(args.engine, args.form)[0] == "fast":
        options["max_seq_len"] = args.max_seq_len
    times: dict[str, float] = {}
    rss_before_load = rss_mb()
    model, content = load(
        args.model, args.device, engine=args.engine, form=args.form, times=times, **options
    )
    load_ms = times["read_ms"] + times["build_ms"]
    tokenizer = Tokenizer.from_metadata(content.metadata)
    device = model.device
    on_device = isinstance(model, GreedyOnDevice)  # greedy steps as qlib.generate takes them

    def run_once(ids: list[int]) -> tuple[float, float]:
        model.clear_kv_cache()
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model.forward(torch.tensor([ids], device=device), 0)
            token = greedy_id(logits)
            t1 = time.perf_counter()
            pos = len(ids)
            for _ in range(args.steps):
                if on_device:  # the argmax on the device, the id read back
                    token = model.greedy_step(token, pos)
                else:
                    logits = model.forward(torch.tensor([[token]], device=device), pos)
                    token = greedy_id(logits)
                pos += 1
            synchronize(device)  # (work still queued counts: a greedy step launched ahead)
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps

    result = measure_prompts(run_once, tokenizer.encode, args)
    engine, form = resolve(args.engine, args.form)
    result.update(runtime="qlib", engine=engine, form=form or "default", load_ms=load_ms,
                  rss_before_load_mb=rss_before_load)  # fmt: skip
    if engine == "fast":
        result.update(prefill=getattr(model, "prefill", args.prefill),
                      kv_type=getattr(model, "kv_type", "f32"),
                      decode=getattr(model, "decode", "fused"),
                      decode_note=getattr(model, "decode_note", None))  # fmt: skip
    return result


def decode_floor(args: argparse.Namespace, kv_type: str) -> dict | None:
    """The bytes floor of the timed decode steps (the first context's): every matmul weight
    and the KV cache at the steps' mean position, read once a step at this machine's memory
    rate measured now (``copy_bandwidth``: a read pass on CPU, on 2 MB pages; a copy on GPU).
    None when the file lacks the shape keys."""
    from ..gguf import read_content
    from .experiments.common import bytes_per_step, copy_bandwidth

    n = (contexts(args) or [args.prompt_tokens])[0]
    try:
        content = read_content(args.model)
        need = bytes_per_step(content, n + args.steps // 2, 2 if kv_type == "f16" else 4)
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    rate = copy_bandwidth(args.device, mib=256, reps=3)  # ~1 s here, imports included
    total = need["weight_bytes"] + need["kv_bytes"]
    return {"bytes": total, "read_gbs": rate / 1e9, "ms": total / rate * 1e3}


def bench_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    model_path = Path(args.model)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
    rss_before_load = rss_mb()
    start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = (
        AutoModelForCausalLM.from_pretrained(
            model_path.parent, gguf_file=model_path.name, dtype=dtype
        )
        .to(args.device)
        .eval()
    )
    load_ms = (time.perf_counter() - start) * 1e3

    def next_token(x, cache) -> int:
        out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def run_once(ids: list[int]) -> tuple[float, float]:
        with torch.inference_mode():
            cache = DynamicCache()
            t0 = time.perf_counter()
            token = next_token(torch.tensor([ids], device=args.device), cache)
            t1 = time.perf_counter()
            for _ in range(args.steps):
                token = next_token(torch.tensor([[token]], device=args.device), cache)
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps

    encode = lambda t: tok(t, add_special_tokens=False)["input_ids"]  # noqa: E731
    result = measure_prompts(run_once, encode, args)
    result.update(runtime="transformers", dtype=args.dtype, load_ms=load_ms,
                  rss_before_load_mb=rss_before_load)  # fmt: skip
    return result


def bench_llama_cpp(args: argparse.Namespace) -> dict:
    import llama_cpp  # noqa: I001  (import before numpy/torch, as on the GPU machine)

    kv = {}  # llama.cpp's own default (f16) unless --kv-type says
    if getattr(args, "kv_type", None):
        t = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[args.kv_type]
        kv = {"type_k": t, "type_v": t}
    rss_before_load = rss_mb()
    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(args.model),
        n_ctx=max_prompt_tokens(args) + args.steps + 8,
        n_batch=512,
        n_threads=args.threads or os.cpu_count(),
        n_threads_batch=args.threads or os.cpu_count(),
        n_gpu_layers=-1 if args.device == "cuda" else 0,
        verbose=False,
        **kv,
    )
    load_ms = (time.perf_counter() - start) * 1e3
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(logits.argmax())

    def run_once(ids: list[int]) -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        token = argmax_last()
        t1 = time.perf_counter()
        for _ in range(args.steps):
            llm.eval([token])
            token = argmax_last()
        t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps

    encode = lambda t: llm.tokenize(t.encode(), add_bos=False, special=False)  # noqa: E731
    result = measure_prompts(run_once, encode, args)
    result.update(runtime="llama.cpp", version=llama_cpp.__version__, load_ms=load_ms,
                  kv_type=args.kv_type or "f16", rss_before_load_mb=rss_before_load)  # fmt: skip
    return result


RUNTIMES = {"qlib": bench_qlib, "transformers": bench_transformers, "llama.cpp": bench_llama_cpp}


def run_config(args: argparse.Namespace) -> dict:
    """Run one configuration in this process."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = RUNTIMES[args.runtime](args)
    result.update(
        device=args.device,
        threads=args.threads or os.cpu_count(),
        prompt_tokens=args.prompt_tokens,
        context=(contexts(args) or [None])[0],
        steps=args.steps,
        reps=args.reps,
        model=str(args.model),
        peak_rss_mb=peak_rss_mb(),
    )
    result.update(tokens_per_s(result))
    if args.runtime == "qlib" and getattr(args, "floor", True):  # after the peak RSS: the
        # read pass's buffer is not the model's
        floor = decode_floor(args, result.get("kv_type", "f32"))
        if floor is not None:
            result["floor"] = floor
    return result


def tokens_per_s(result: dict) -> dict:
    """Speeds beside the times: prefill tok/s = prompt tokens / prefill s, decode tok/s =
    1000 / ms per token; ``max`` from the min time, ``median`` from the median."""
    n = result["prompt_tokens"]
    return {
        "prefill_tok_s": {k: n * 1e3 / result["prefill_ms"][m] for k, m in _STATS},
        "decode_tok_s": {k: 1e3 / result["decode_ms_per_token"][m] for k, m in _STATS},
    }


_STATS = (("max", "min"), ("median", "median"))


def run_in_subprocess(argv: list[str]) -> dict:
    """One configuration in a new process; returns its JSON or an ``error`` entry."""
    proc = subprocess.run(
        [sys.executable, "-m", "qlib", "bench", *argv, "--json"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "argv": argv}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def protocol_argv(args: argparse.Namespace) -> list[str]:
    """The command-line arguments every runtime of one ``--peers`` invocation shares."""
    argv = ["--model", str(args.model), "--prompt-file", str(args.prompt_file),
            "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps),
            "--reps", str(args.reps), "--device", args.device]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if contexts(args):
        argv += ["--context", ",".join(map(str, contexts(args)))]
    if getattr(args, "kv_type", None):
        argv += ["--kv-type", args.kv_type]
    if not getattr(args, "floor", True):
        argv += ["--no-floor"]
    return argv


PEERS = ("transformers", "llama.cpp")


def peer_configs(args: argparse.Namespace, names: tuple[str, ...] = PEERS) -> list[list[str]]:
    """The arguments of each peer in ``names`` for a ``--peers`` invocation (llama.cpp only
    where llama-cpp-python is installed)."""
    base = protocol_argv(args)
    configs = []
    if "transformers" in names:
        configs.append([*base, "--runtime", "transformers", "--dtype", "f32"])
    try:
        import importlib.util

        if "llama.cpp" in names and importlib.util.find_spec("llama_cpp") is not None:
            configs.append([*base, "--runtime", "llama.cpp"])
    except ValueError:
        pass
    return configs


def merge_rounds(results: list[dict]) -> dict:
    """One runtime's results from several rounds of a ``--peers --rounds`` invocation as one:
    the timed runs of every round pooled (min and median over them all; each context point of
    a curve likewise), the first round's untimed run, the largest peak RSS, the shortest load;
    the first failure if a round failed."""
    failed = [r for r in results if "error" in r]
    if failed or len(results) == 1:
        return (failed or results)[0]

    def pooled(points: list[dict]) -> dict:
        runs = [(r["prefill_ms"], r["decode_ms_per_token"]) for p in points for r in p["runs"]]
        first = points[0]["first_run"]
        return _stats((first["prefill_ms"], first["decode_ms_per_token"]), runs)

    merged = {**results[0], **pooled(results), "rounds": len(results)}
    floors = [r["floor"] for r in results if "floor" in r]
    if floors:  # the fastest minute's memory: the most demanding floor
        merged["floor"] = min(floors, key=lambda f: f["ms"])
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    if all(r.get("load_ms") is not None for r in results):
        merged["load_ms"] = min(r["load_ms"] for r in results)
    if "curve" in merged:
        merged["curve"] = [
            {**point, **pooled([r["curve"][i] for r in results])}
            for i, point in enumerate(results[0]["curve"])
        ]
        for point in merged["curve"]:
            point.update(tokens_per_s({**point, "prompt_tokens": point["context"]}))
    merged.update(tokens_per_s(merged))
    return merged
