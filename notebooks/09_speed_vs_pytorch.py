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
# # Speed vs PyTorch
#
# Follows the seed chapter **速度 (speed)**: the same generation task on every engine, each
# configuration in a new process. Prompt: the first 203 tokens of `data/passage.txt` (no chat
# template, no special tokens); prefill once, then 128 greedy decode steps without stopping at
# EOS; every step reads the next token back to the host. One untimed first run (reported
# separately), then `reps` runs on a fresh KV cache; min and median.
#
# Runtimes: qlib (its fast engine, and its faithful engine in each QMatMul form), transformers on the same GGUF (hand-written loop with
# `DynamicCache` and `logits_to_keep=1`) and llama.cpp through llama-cpp-python when installed.
# Compare ratios within this run, never absolute times across runs or machines.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps
threads = [1, 2]  # CPU thread counts (ignored on a GPU)
prompt_tokens = 203  # the benchmark protocol (docs/design.md): first 203 tokens of data/passage.txt
steps = 128  # greedy decode steps, no stop at EOS
reps = 3  # timed runs after the untimed first run (min and median reported)
qlib_variants = ["fast", "quantized", "f32"]  # fast: the fast engine; a form: the faithful engine in it
transformers_dtypes = ["f32", "bf16"]
peers = True  # also run transformers and llama.cpp (when installed)

# %%
import pandas as pd

from qlib import models
from qlib.suite import plots
from qlib.suite.experiments import speed
from qlib.suite.results import ResultWriter

plots.style()
model_path = str(model_path or models.path())
w = ResultWriter("09_speed_vs_pytorch", params=dict(
    model_path=model_path, device=device, threads=threads, prompt_tokens=prompt_tokens,
    steps=steps, reps=reps, qlib_variants=qlib_variants, transformers_dtypes=transformers_dtypes,
    peers=peers))
configs = speed.default_configs(device, tuple(threads), tuple(qlib_variants),
                                tuple(transformers_dtypes), peers)
if peers and not speed.llama_cpp_available():
    print(w.skipped("llama.cpp", "llama-cpp-python is not installed (the `peers` extra)"))
[c.label for c in configs]

# %% [markdown]
# ## The matrix
#
# One process per row. A configuration's name ends in its CPU thread count (`2t`: 2 threads).

# %%
rows = speed.run_matrix(configs, model=model_path, prompt_tokens=prompt_tokens, steps=steps,
                       reps=reps)
df = pd.DataFrame(rows)
w.save_table(df, "speed", key=True, caption="prefill (ms for the prompt) and decode (ms/token), "
             "min over reps; first run separately", timing=["peak_rss_mb"])
failed = df[df["error"].astype(bool)] if "error" in df else df.iloc[0:0]
if len(failed):
    print("failed configurations:\n" + failed[["config", "error"]].to_string())
ok = df[~df["error"].astype(bool)].copy()
ok[["config", "prefill_ms_min", "prefill_ms_median", "decode_ms_min", "decode_ms_median",
    "first_prefill_ms", "first_decode_ms", "load_ms", "peak_rss_mb"]].round(2)

# %% [markdown]
# ## Ratios to transformers f32
#
# Below 1: faster than the baseline, measured side by side in this run.

# %%
most = max(threads) if device == "cpu" else None
baseline = speed.Config("transformers", device, most, dtype="f32").label
rat = pd.DataFrame(speed.ratios(rows, baseline))
if len(rat):
    w.save_table(rat, "ratios", caption=f"time / time of {baseline}", timing=True)
rat.round(3) if len(rat) else print(w.skipped("ratios", f"baseline {baseline} did not run"))

# %%
fig = plots.speed_figure(ok, prompt_tokens=prompt_tokens, device=device)
w.save_plot(fig, "speed", caption="prefill and decode time per configuration, coloured by engine "
            "family, grouped by CPU threads (lower is better)")

# %% [markdown]
# ## First run vs steady state

# %%
ok["first_over_steady_prefill"] = ok["first_prefill_ms"] / ok["prefill_ms_min"]
ok["first_over_steady_decode"] = ok["first_decode_ms"] / ok["decode_ms_min"]
first = ok[["config", "first_prefill_ms", "prefill_ms_min", "first_over_steady_prefill",
            "first_decode_ms", "decode_ms_min", "first_over_steady_decode"]]
w.save_table(first, "first_run", caption="the untimed first run against the best steady run",
             timing=True)
first.round(2)

# %% [markdown]
# ## Findings

# %%
fastest = ok.loc[ok["decode_ms_min"].idxmin()]
w.finding("fastest_decode", "The fastest decode here is {cfg} at {ms:.2f} ms/token "
          "({tps:.0f} tokens/s).", table="speed", cfg=fastest["config"],
          ms=fastest["decode_ms_min"], tps=fastest["decode_tok_s"])
quick = ok.loc[ok["prefill_ms_min"].idxmin()]
w.finding("fastest_prefill", "The fastest prefill of {n} tokens is {cfg} at {ms:.1f} ms.",
          table="speed", n=prompt_tokens, cfg=quick["config"], ms=quick["prefill_ms_min"])
if len(rat):
    for cfg in [c.label for c in configs if c.engine == "qlib" and c.threads in (most, None)]:
        r = rat[rat["config"] == cfg]
        if len(r):
            r = r.iloc[0]
            w.finding(f"ratio {cfg}", "{cfg} takes {p:.2f}x the prefill time and {d:.2f}x the "
                      "decode time of {base}.", table="ratios", cfg=cfg, p=r.prefill_ratio,
                      d=r.decode_ratio, base=baseline)
worst = ok.loc[ok["first_over_steady_prefill"].idxmax()]
w.finding("first_run", "The first run costs most for {cfg}: its first prefill takes "
          "{x:.2f}x the steady one.", table="first_run", cfg=worst["config"],
          x=worst["first_over_steady_prefill"])
for f in w.meta["findings"]:
    print(f["sentence"])


# %% [markdown]
# ## The seed's figures, for reference only
#
# Measured on an M2 Max with candle 0.11.0 and PyTorch 2.15 (accelerate BLAS, 8 performance cores): other hardware, shown beside ours only as a label.

# %%
def ours(cfg, col):
    r = ok[ok["config"] == cfg]
    return float(r.iloc[0][col]) if len(r) else None

t1 = speed.Config("transformers", device, 1 if device == "cpu" else None, dtype="f32").label
w.seed_reference("torch_f32_decode_1t", "transformers f32 decode, 1 thread (ms/token)", 14.20,
                 ours=ours(t1, "decode_ms_min"), unit="ms/token",
                 source="速度: CPU decode, threads table (PyTorch 1 thread)")
w.seed_reference("torch_f32_prefill", "transformers f32 prefill of 203 tokens (ms)", 81,
                 ours=ours(baseline, "prefill_ms_min"), unit="ms",
                 source="速度: summary (prefill torch 81 ms, candle 117 ms)")
pd.DataFrame(w.meta["seed_references"])
