# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Throughput against context: prefill and decode
#
# Follows the seed's *throughput* experiment (chapter 000, "prefill and decode throughput", and
# the speed chapter 004). Prefill: a prompt of T tokens of the shipped English passage at
# index_pos 0, timed until the argmax is back on the host, for T from 1 to 512. Decode: the KV
# cache holds a context of 16 to 1024 positions, then a few greedy decode steps; ms per token is
# their mean. The engine grows its KV cache with `torch.cat` (a copy of the whole cache every
# step) and copies K and V three times more in `repeat_kv`; beside it run the engine's SDPA
# option and a preallocated cache with SDPA-GQA (written in `qlib.suite.experiments.throughput`, the
# engine has no such option yet), end to end and, for one layer, op by op. You will see tok/s
# against T, ms/token against context for each variant, and how much of the growth with context
# is copying. torch runs on one CPU thread by default (`threads`; notebook 02 compares).

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps; on a GPU the CPU parts run too
prefill_sizes = [1, 4, 16, 64, 128, 256, 512]  # prompt lengths T, at index_pos 0
prefill_reps = 2  # timed prefills per T, after one warm-up
decode_contexts = [16, 64, 256, 512, 1024]  # cached positions before the decode steps
decode_steps = 8  # decode steps per run (ms/token is their mean)
decode_steps_long = 4  # decode steps at contexts of 512 and more
decode_reps = 1  # timed runs per context and variant, after one warm-up
variants = [["cat", "naive"], ["cat", "sdpa"], ["prealloc", "sdpa"], ["prealloc", "fold"]]  # (cache, attention)
replay_reps = 200  # passes of the one-layer op replay
threads = 1  # torch CPU threads; None: torch's default (notebook 02 compares thread counts)
form = None  # QMatMul form: None (the engine's default), "quantized", "f32" or "f16"
seed = 0
long_contexts = [256, 1024, 2048]  # the fast engines and llama.cpp: bench --context N
long_steps = 16  # decode steps at each long context
long_reps = 2  # timed runs per point (min), after the untimed first one (on CUDA the first
# timed prefill captures its graph, the second replays it)
long_threads = 2  # CPU threads of the long-context runs (each its own process)
long_kv_types = ["f32", "f16"]  # the fast engines' KV cache types

# %%
import os
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.suite import plots
from qlib.suite.experiments import throughput
from qlib.suite.experiments.common import build
from qlib.suite.results import SEED_LABEL, ResultWriter

plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
if threads:
    torch.set_num_threads(threads)
devices = ["cpu"] if device == "cpu" else ["cpu", device]
w = ResultWriter("03_throughput_vs_context", params=dict(
    model_path=model_path, device=device, prefill_sizes=prefill_sizes, prefill_reps=prefill_reps,
    decode_contexts=decode_contexts, decode_steps=decode_steps,
    decode_steps_long=decode_steps_long, decode_reps=decode_reps, variants=variants,
    replay_reps=replay_reps, threads=threads, form=form, seed=seed, long_contexts=long_contexts,
    long_steps=long_steps, long_reps=long_reps, long_threads=long_threads,
    long_kv_types=long_kv_types))
built = {dev: build(model_path, dev, form=form) for dev in devices}
tokenizer = built["cpu"][1]
ids = throughput.passage_ids(tokenizer, max(max(prefill_sizes), max(decode_contexts)) + 1)
steps = {c: decode_steps_long if c >= 512 else decode_steps for c in decode_contexts}
print(f"devices {devices}; torch threads {torch.get_num_threads()}; "
      f"load average {os.getloadavg()[0]:.1f}; {len(ids)} passage tokens (cycled if the passage "
      f"is shorter); decode steps per context {steps}")

# %% [markdown]
# ## Prefill tok/s against prompt length

# %%
pre_rows = []
for dev, (model, _) in built.items():
    pre_rows += [{"device": dev, **r} for r in throughput.prefill_throughput(
        model, ids, prefill_sizes, reps=prefill_reps)]
pre = w.save_table(pre_rows, "prefill", key=True, caption=(
    "prefill of T passage tokens at index_pos 0, until the argmax is read back: first (warm-up), "
    "best and median ms, tok/s at the best"))
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
for dev, g in pre.groupby("device", sort=False):
    axes[0].plot(g["T"], g.tok_s, marker="o", label=dev)
    axes[1].plot(g["T"], g.min_ms, marker="o", label=dev)
axes[0].set(xlabel="prompt tokens T", ylabel="tok/s", title="prefill throughput")
axes[1].set(xlabel="prompt tokens T", ylabel="ms (log scale)", title="prefill time (to argmax)")
plots.log_axis(axes[1], "y")
for ax in axes:
    plots.log2_axis(ax, "x", prefill_sizes)
    ax.legend()
fig.tight_layout()
w.save_plot(fig, "prefill", caption="prefill tok/s and ms against prompt length")
pre.round(1)

# %% [markdown]
# ## Decode ms/token against context
#
# The cache is filled by one prefill of the longest context; a context of c positions is its
# first c positions, which is exactly what a prefill of c tokens leaves (attention is causal).
# Each run loads that cache, feeds the passage's next token at index_pos c and decodes greedily.
# Variants: `cat + naive` is the engine on a CPU (candle's path), `cat + sdpa` the engine's
# `attention="sdpa"` option for decode steps (its path on a GPU), `prealloc + sdpa` a
# preallocated cache written in place with SDPA-GQA, `prealloc + fold` the same cache with plain
# SDPA over the query heads folded onto their KV head (`qlib.llama.faithful.sdpa_folded`).

# %%
dec_rows, fill_rows = [], []
for dev, (model, _) in built.items():
    snap, fill_ms = throughput.prefill_snapshot(model, ids[:max(decode_contexts)])
    fill_rows.append({"device": dev, "tokens": max(decode_contexts), "prefill_ms": fill_ms})
    t0 = time.perf_counter()
    dec_rows += [{"device": dev, **r} for r in throughput.decode_comparison(
        model, ids, decode_contexts, steps, reps=decode_reps,
        variants=[tuple(v) for v in variants], snapshot=snap)]
    print(f"{dev}: cache filled in {fill_ms:.0f} ms, decode runs {time.perf_counter() - t0:.1f} s")
    del snap
dec = w.save_table(dec_rows, "decode", key=True, caption=(
    "decode ms per token (mean over the steps; best and median of the runs) against context, "
    "per KV cache and attention variant"))
w.save_table(fill_rows, "cache_fill", caption="the one prefill that fills the cache (ms)")
fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 3.2), squeeze=False)
for ax, dev in zip(axes[0], devices, strict=True):
    for name, g in dec[dec.device == dev].groupby("variant", sort=False):
        ax.plot(g.context, g.ms_per_token, marker="o", label=name)
    ax.set(xlabel="context (cached positions)", ylabel="ms / token", title=f"{dev}: decode")
    plots.log2_axis(ax, "x", decode_contexts)
    ax.set_ylim(bottom=0)
    ax.legend()
fig.tight_layout()
w.save_plot(fig, "decode", caption="decode ms/token against context, per variant")
dec.pivot_table(index="context", columns=["device", "variant"], values="ms_per_token",
                sort=False).round(2)

# %% [markdown]
# ## Where the growth goes: one layer's attention core, op by op
#
# The one-layer replay of notebook 02 at each context: forward_attn's ops (cat, repeat_kv, two
# matmuls, scale, softmax) against the preallocated cache with SDPA-GQA and with folded SDPA;
# `copy_us` is the share
# spent copying (cat and repeat_kv, or the in-place writes). Times the block count, that is what
# the attention core costs one decode step.

# %%
core_rows = []
for dev, (model, _) in built.items():
    core_rows += [{"device": dev, **r} for r in throughput.attention_core_by_context(
        model, decode_contexts, reps=replay_reps)]
core = w.save_table(core_rows, "attention_core", key=True, caption=(
    "one layer's attention core of a decode step (µs, median), its copying part, and times the "
    "block count (ms per token)"))
fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 3.2), squeeze=False)
for ax, dev in zip(axes[0], devices, strict=True):
    for (cache, attention), g in core[core.device == dev].groupby(["cache", "attention"],
                                                                 sort=False):
        line, = ax.plot(g.context, g.layer_us, marker="o", label=f"{cache} + {attention}")
        ax.plot(g.context, g.copy_us, ls="--", color=line.get_color(),
                label=f"{cache} + {attention}: copying")
    ax.set(xlabel="context", ylabel="µs per layer", title=f"{dev}: attention core")
    plots.log2_axis(ax, "x", decode_contexts)
    ax.legend(fontsize=7)
fig.tight_layout()
w.save_plot(fig, "attention_core", caption="one layer's attention core against context")
core.round(1)

# %% [markdown]
# ## Findings

# %%
for dev in devices:
    p = pre[pre.device == dev]
    peak = p.loc[p.tok_s.idxmax()]
    one = p[p["T"] == min(prefill_sizes)].iloc[0]
    print(w.finding(
        f"prefill_{dev}", "On {dev}, prefill peaked at {tps:.0f} tok/s for T = {t}, "
        "{ratio:.0f}x the {one_tps:.1f} tok/s of a single token.", table="prefill", dev=dev,
        tps=peak.tok_s, t=int(peak["T"]), ratio=peak.tok_s / one.tok_s, one_tps=one.tok_s))
    d = dec[dec.device == dev]
    lo, hi = min(decode_contexts), max(decode_contexts)
    base = d[d.variant == d.variant.iloc[0]].set_index("context")
    best_hi = d[d.context == hi].set_index("variant").ms_per_token
    print(w.finding(
        f"decode_{dev}", "On {dev}, {base} decode went from {a:.1f} ms/token at context {lo} to "
        "{b:.1f} at {hi} ({r:.2f}x); at {hi}, {best} took {bms:.1f} ms/token.", table="decode",
        dev=dev, base=base.variant.iloc[0], a=base.ms_per_token[lo], b=base.ms_per_token[hi],
        lo=lo, hi=hi, r=base.ms_per_token[hi] / base.ms_per_token[lo], best=best_hi.idxmin(),
        bms=best_hi.min()))
    k = core[(core.device == dev) & (core.cache == "cat")].set_index("context")
    growth_core = k.all_layers_ms[hi] - k.all_layers_ms[lo]
    growth_dec = base.ms_per_token[hi] - base.ms_per_token[lo]
    print(w.finding(
        f"core_{dev}", "On {dev}, forward_attn's replayed core grew by {gc:.2f} ms per token "
        "over all {n} layers from context {lo} to {hi} ({copy:.0%} of it at {hi} copying), against "
        "{gd:.2f} ms measured end to end.", table="attention_core", dev=dev, gc=growth_core,
        n=built[dev][0].config.block_count, lo=lo, hi=hi,
        copy=k.copy_us[hi] / k.layer_us[hi], gd=growth_dec))

# %% [markdown]
# ## The fast engines and llama.cpp at long context
#
# The benchmark protocol at each context (`python -m qlib bench --context N`, one process per
# point): the passage's tokens repeated to N, prefilled, then `long_steps` greedy steps from
# position N. Beside each point the floor of a decode step: the bytes it must read (every
# matmul weight once, and the KV cache over N positions in its type) at this machine's
# measured memory bandwidth (`copy_bandwidth`: a read-only pass on CPU, a copy on GPU),
# measured just before and just after that point (the higher of the two): a shared machine's
# memory can change speed between points, and a point whose two passes differ by more than
# 25% is measured again (at most three times; `attempts`). llama.cpp keeps its default f16
# cache.

# %%
from qlib.suite.experiments.speed import llama_cpp_available

long_configs = throughput.long_context_configs(device if device in ("cpu", "cuda") else "cpu",
                                               tuple(long_kv_types), llama_cpp_available())
if not llama_cpp_available():
    print(w.skipped("llama.cpp at long context", "llama-cpp-python is not installed (peers)"))
long_rows = throughput.long_context_curve(model_path, long_contexts, steps=long_steps,
                                          reps=long_reps, threads=long_threads,
                                          configs=long_configs,
                                          device=device if device == "cuda" else "cpu")
longc = pd.DataFrame(long_rows)
longc["floor_ms"] = (longc.weight_bytes + longc.kv_bytes) / (longc.read_gbs * 1e9) * 1e3
if "decode_ms" in longc:
    longc["decode_over_floor"] = longc.decode_ms / longc.floor_ms
w.save_table(longc.drop(columns=["weight_bytes"]), "long_context", key=True, caption=(
    f"bench --context N: prefill ms and decode ms/token (min), the step's bytes floor at each "
    f"point's memory rate (read_gbs, {longc.read_gbs.min():.1f}-{longc.read_gbs.max():.1f} GB/s: "
    f"a read-only pass on CPU, a copy on GPU, just before and after the point)"),
    timing=["peak_rss_mb", "read_gbs"])
ok_long = longc[longc.error == ""] if "error" in longc else longc
fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
for name, g in ok_long.groupby("runtime", sort=False):
    axes[0].plot(g.context, g.decode_ms, marker="o", label=name)
    axes[1].plot(g.context, g.prefill_ms, marker="o", label=name)
    floor = g.floor_ms
    axes[0].plot(g.context, floor, ls=":", color=axes[0].lines[-1].get_color())
axes[0].set(xlabel="context N", ylabel="ms / token (log)", title="decode (dotted: bytes floor)")
axes[1].set(xlabel="prompt tokens N", ylabel="ms (log)", title="prefill")
for ax in axes:
    plots.log2_axis(ax, "x", long_contexts)
    plots.log_axis(ax, "y")
    ax.legend(fontsize=7)
fig.tight_layout()
w.save_plot(fig, "long_context", caption="the fast engines and llama.cpp against context: decode "
            "ms/token with each runtime's bytes floor, and prefill ms")
if len(ok_long):
    top, low = ok_long.context.max(), ok_long.context.min()  # (a point past the file's length
    at = ok_long[ok_long.context == top].set_index("runtime")  # runs at its last position)
    fast = [r for r in at.index if r.startswith("qlib fast")]
    if fast:
        best = at.loc[fast, "decode_ms"].idxmin()
        first = ok_long[(ok_long.context == low) & (ok_long.runtime == best)].decode_ms
        print(w.finding("long_fast", "At {n} positions the fast engine ({cfg}) decodes in "
                        "{ms:.2f} ms/token, {x:.2f}x its bytes floor and {g:.2f}x its time at "
                        "{low} positions.", table="long_context", n=top, cfg=best,
                        ms=at.decode_ms[best], x=at.decode_over_floor[best],
                        g=at.decode_ms[best] / first.iloc[0] if len(first) else float("nan"),
                        low=low))
        if "llama.cpp cpu, f16 KV" in at.index:
            lc = at.loc["llama.cpp cpu, f16 KV"]
            quick = at.loc[fast, "prefill_ms"].idxmin()
            print(w.finding("long_vs_llama_cpp", "There llama.cpp takes {ms:.2f} ms/token and "
                            "{pms:.0f} ms to prefill: the fast engine's decode ratio is {d:.2f}x "
                            "({best}), its prefill ratio {p:.2f}x ({quick}).",
                            table="long_context", ms=lc.decode_ms, pms=lc.prefill_ms,
                            d=at.decode_ms[best] / lc.decode_ms, best=best,
                            p=at.prefill_ms[quick] / lc.prefill_ms, quick=quick))
longc.round(2)

# %% [markdown]
# ## Seed figures beside ours
#
# References only (candle 0.11.0 on an M2 Max, a Q8_0 file): the chapter gives the CPU
# prefill plateau and decode rate as ranges in its text.

# %%
src = "chapter 000, section on prefill and decode throughput"
p = pre[pre.device == "cpu"]
w.seed_reference("prefill_cpu_peak", "CPU prefill plateau", "420-550", ours=p.tok_s.max(),
                 unit="tok/s", source=src)
d0 = dec[(dec.device == "cpu") & (dec.variant == "cat + naive")]
w.seed_reference("decode_cpu", "CPU decode rate", "about 140", ours=1e3 / d0.ms_per_token.min(),
                 unit="tok/s", source=src)
if device != "cpu":
    g = dec[(dec.device == device) & (dec.variant == "cat + sdpa")].set_index("context")
    if len(g) and 16 in g.index and 1024 in g.index:
        w.seed_reference("decode_gpu_16", "GPU decode at context 16 (Metal, sdpa)", 2.6,
                         ours=g.ms_per_token[16], unit="ms/token", source=src)
        w.seed_reference("decode_gpu_1024", "GPU decode at context 1024 (Metal, sdpa)", 3.4,
                         ours=g.ms_per_token[1024], unit="ms/token", source=src)
else:
    print(w.skipped("GPU prefill and decode", "device='cpu': run with device='cuda' (or mps) for "
                    "the same measurements on a GPU beside the CPU"))
pd.DataFrame(w.meta["seed_references"])[["what", "seed", "ours", "unit"]].rename(
    columns={"seed": SEED_LABEL})
