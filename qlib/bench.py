"""The speed protocol of DESIGN.md, for qlib and its peers.

Prompt: the first N (203) tokens of ``data/passage.txt`` (no chat template,
no special tokens). One run = prefill once, then greedy-decode ``steps``
(128) tokens without stopping at EOS; every step reads the token back to the
host. One process per configuration: load, one untimed run (reported as
``first_run``), then ``reps`` runs on a fresh KV cache; min and median.

``python -m qlib bench --json`` prints one JSON object. ``--peers`` also runs
transformers and llama.cpp (when installed), each in its own process through
this same module, and prints qlib / peer ratios from that one invocation.
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

from . import models

PROMPT_TOKENS = 203
STEPS = 128
REPS = 5


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompt_ids(
    tokenizer_encode: Callable[[str], list[int]], n: int, prompt_file: Path
) -> list[int]:
    ids = tokenizer_encode(prompt_file.read_text())
    if len(ids) < n:
        raise ValueError(f"{prompt_file} has only {len(ids)} tokens, {n} requested")
    return ids[:n]


def measure(run_once: Callable[[], tuple[float, float]], reps: int) -> dict:
    """``run_once() -> (prefill_ms, decode_ms_per_token)``: first run, then ``reps`` timed."""
    first = run_once()
    runs = [run_once() for _ in range(reps)]
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

    from . import engines
    from .devices import synchronize
    from .gguf_file import Content
    from .tokenizer import Tokenizer

    start = time.perf_counter()
    with open(args.model, "rb") as f:
        content = Content.read(f)
        kwargs = {"prefill": args.prefill} if args.prefill else {}
        if args.form != "fast":
            kwargs = {"attention": args.attention}
        model = engines.from_gguf(content, f, args.device, args.form, **kwargs)
    synchronize(model.device)
    load_ms = (time.perf_counter() - start) * 1e3
    tokenizer = Tokenizer.from_metadata(content.metadata)
    ids = prompt_ids(tokenizer.encode, args.prompt_tokens, args.prompt_file)
    device = model.device

    def run_once() -> tuple[float, float]:
        model.clear_kv_cache()
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = model.forward(torch.tensor([ids], device=device), 0)
            token = int(logits[0].argmax())
            t1 = time.perf_counter()
            pos = len(ids)
            for _ in range(args.steps):
                logits = model.forward(torch.tensor([[token]], device=device), pos)
                token = int(logits[0].argmax())
                pos += 1
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps

    result = measure(run_once, args.reps)
    result.update(engine="qlib", form=args.form or "default", load_ms=load_ms)
    if args.form == "fast":
        result.update(prefill=getattr(model, "prefill", args.prefill))
    return result


def bench_transformers(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    model_path = Path(args.model)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]
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
    ids = prompt_ids(
        lambda t: tok(t, add_special_tokens=False)["input_ids"],
        args.prompt_tokens,
        args.prompt_file,
    )
    prompt = torch.tensor([ids], device=args.device)

    def next_token(x, cache) -> int:
        out = model(x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def run_once() -> tuple[float, float]:
        with torch.inference_mode():
            cache = DynamicCache()
            t0 = time.perf_counter()
            token = next_token(prompt, cache)
            t1 = time.perf_counter()
            for _ in range(args.steps):
                token = next_token(torch.tensor([[token]], device=args.device), cache)
            t2 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3 / args.steps

    result = measure(run_once, args.reps)
    result.update(engine="transformers", dtype=args.dtype, load_ms=load_ms)
    return result


def bench_llama_cpp(args: argparse.Namespace) -> dict:
    import llama_cpp  # noqa: I001  (import before numpy/torch, as on the GPU machine)

    start = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=str(args.model),
        n_ctx=args.prompt_tokens + args.steps + 8,
        n_batch=512,
        n_threads=args.threads or os.cpu_count(),
        n_threads_batch=args.threads or os.cpu_count(),
        n_gpu_layers=-1 if args.device == "cuda" else 0,
        verbose=False,
    )
    load_ms = (time.perf_counter() - start) * 1e3
    ids = prompt_ids(
        lambda t: llm.tokenize(t.encode(), add_bos=False, special=False),
        args.prompt_tokens,
        args.prompt_file,
    )
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))
        return int(logits.argmax())

    def run_once() -> tuple[float, float]:
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

    result = measure(run_once, args.reps)
    result.update(engine="llama.cpp", version=llama_cpp.__version__, load_ms=load_ms)
    return result


ENGINES = {"qlib": bench_qlib, "transformers": bench_transformers, "llama.cpp": bench_llama_cpp}


def run_config(args: argparse.Namespace) -> dict:
    """Run one configuration in this process."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    result = ENGINES[args.engine](args)
    result.update(
        device=args.device,
        threads=args.threads or os.cpu_count(),
        prompt_tokens=args.prompt_tokens,
        steps=args.steps,
        reps=args.reps,
        model=str(args.model),
        peak_rss_mb=peak_rss_mb(),
    )
    return result


def run_in_subprocess(argv: list[str]) -> dict:
    """One configuration in a new process; returns its JSON or an ``error`` entry."""
    proc = subprocess.run(
        [sys.executable, "-m", "qlib", "bench", *argv, "--json"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "argv": argv}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def protocol_argv(args: argparse.Namespace) -> list[str]:
    """The command-line arguments every engine of one ``--peers`` invocation shares."""
    argv = ["--model", str(args.model), "--prompt-file", str(args.prompt_file),
            "--prompt-tokens", str(args.prompt_tokens), "--steps", str(args.steps),
            "--reps", str(args.reps), "--device", args.device]  # fmt: skip
    if args.threads:
        argv += ["--threads", str(args.threads)]
    return argv


def peer_configs(args: argparse.Namespace) -> list[list[str]]:
    base = protocol_argv(args)
    configs = [[*base, "--engine", "transformers", "--dtype", "f32"]]
    try:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is not None:
            configs.append([*base, "--engine", "llama.cpp"])
    except ValueError:
        pass
    return configs


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="prefill / decode speed with the DESIGN.md protocol")
    p.add_argument("--model", type=Path, default=None, help="GGUF (default: embedded SmolLM2)")
    p.add_argument("--prompt-file", type=Path, default=None, help="default: data/passage.txt")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--reps", type=int, default=REPS)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch / llama.cpp threads")
    p.add_argument(
        "--form",
        default=None,
        help="qlib QMatMul form (quantized, f32, f16), or fast (qlib.fast on CPU, "
        "qlib.fast_cuda on CUDA)",
    )
    p.add_argument(
        "--prefill",
        default=None,
        choices=("bf16", "int8", "f32", "packed"),
        help="--form fast: prefill matmuls (CPU: bf16 (default) or int8; CUDA: f32 (default) "
        "or packed)",
    )
    p.add_argument("--attention", default="auto", choices=("auto", "naive", "sdpa"))
    p.add_argument("--engine", default="qlib", choices=sorted(ENGINES))
    p.add_argument(
        "--dtype", default="f32", choices=("f32", "bf16", "f16"), help="transformers dtype"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run transformers and llama.cpp, each in its own process",
    )
    p.set_defaults(func=main)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{' '.join(r['argv'])}: FAILED {r['error']}"
    name = r["engine"] + (f" {r.get('form') or r.get('dtype', '')}".rstrip())
    if r.get("prefill"):
        name += f" ({r['prefill']} prefill)"
    return (
        f"{name:<24} prefill {r['prefill_ms']['min']:8.1f} ms (median "
        f"{r['prefill_ms']['median']:.1f})  decode {r['decode_ms_per_token']['min']:7.2f} "
        f"ms/token (median {r['decode_ms_per_token']['median']:.2f})  "
        f"first run {r['first_run']['prefill_ms']:.1f} / "
        f"{r['first_run']['decode_ms_per_token']:.2f}  peak RSS {r['peak_rss_mb']:.0f} MB  "
        f"load {r['load_ms']:.0f} ms"
    )


def main(args: argparse.Namespace) -> int:
    args.model = args.model or models.path()
    args.prompt_file = args.prompt_file or models.data_file("passage.txt")
    if not args.peers:
        result = run_config(args)
        print(json.dumps(result) if args.json else _line(result))
        return 0
    own = [*protocol_argv(args), "--attention", args.attention]
    if args.form:
        own += ["--form", args.form]
    if args.form == "fast" and args.prefill:
        own += ["--prefill", args.prefill]
    results = [run_in_subprocess(own)] + [run_in_subprocess(c) for c in peer_configs(args)]
    ours = results[0]
    ratios = {}
    for peer in results[1:]:
        if "error" in peer or "error" in ours:
            continue
        ratios[peer["engine"]] = {
            "prefill": ours["prefill_ms"]["min"] / peer["prefill_ms"]["min"],
            "decode": ours["decode_ms_per_token"]["min"] / peer["decode_ms_per_token"]["min"],
            "peak_rss": ours["peak_rss_mb"] / peer["peak_rss_mb"],
        }
    if args.json:
        print(json.dumps({"qlib": ours, "peers": results[1:], "ratios": ratios}))
        return 0
    for r in results:
        print(_line(r))
    for peer, r in ratios.items():
        print(
            f"qlib / {peer}: prefill x{r['prefill']:.2f}, decode x{r['decode']:.2f}, "
            f"peak RSS x{r['peak_rss']:.2f} (below 1 = qlib faster / smaller)"
        )
    return 0
