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
# # The format zoo: one model in every GGUF type
#
# The seed measures one file in one type. People download the same model in many: F16, Q8_0,
# the legacy 4- and 5-bit blocks, the K-quants, the non-linear IQ4_NL / IQ4_XS and llama.cpp's
# mixes (Q4_K_M puts Q6_K on some `attn_v` / `ffn_down` matrices and on the output). Here one model is re-quantized by qlib's
# quantizer to each of them (the derived files come from the embedded Q4_1, so they are not the
# files published upstream) and every variant gets the same three questions: how big (bits per
# weight), how fast (the benchmark protocol, one process per configuration: qlib's faithful
# and fast engines, llama.cpp beside them), and how far from F32 (teacher-forced over a
# passage: mean and max |logit diff|, argmax agreement, perplexity), llama.cpp's own drift
# from its F32 run measured the same way.

# %% tags=["parameters"]
model_path = None  # source GGUF; None: the embedded SmolLM2 (its variants are derived from it)
device = "cpu"  # cpu or cuda: the results tag; cuda also times the fast CUDA engine
types = ["F32", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_1", "IQ4_NL", "Q4_0", "IQ4_XS", "NVFP4", "MXFP4", "Q3_K", "Q2_K"]  # any of qlib.convert's types and recipes
tokens = 192  # teacher-forced positions of data/passage.txt
prompt_tokens = 64  # benchmark prompt (first tokens of data/passage.txt)
steps = 32  # benchmark decode steps
reps = 1  # timed runs after the untimed first one
threads = 2  # CPU threads for every runtime
llama_cpp = True  # llama.cpp through llama-cpp-python, when installed

# %%
import importlib.util

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from qlib import models
from qlib.llama.engine import load
from qlib.suite import plots
from qlib.suite.experiments import format_zoo as zoo
from qlib.suite.experiments.common import teacher_forced_logits
from qlib.suite.experiments.drift import LlamaCppSource, passage_ids
from qlib.suite.results import ResultWriter
from qlib.tokenizer import Tokenizer

plots.style()
torch.set_num_threads(threads)
model_path = str(model_path or models.path())
w = ResultWriter("10_format_zoo", params=dict(
    model_path=model_path, device=device, types=types, tokens=tokens,
    prompt_tokens=prompt_tokens, steps=steps, reps=reps, threads=threads, llama_cpp=llama_cpp))
if zoo.REFERENCE not in types:
    types = [zoo.REFERENCE, *types]
have_llama_cpp = llama_cpp and importlib.util.find_spec("llama_cpp") is not None
if llama_cpp and not have_llama_cpp:
    print(w.skipped("llama.cpp", "llama-cpp-python is not installed (the `peers` extra)"))
variants = zoo.variants(types, model_path, log=print)
ids = passage_ids(Tokenizer.from_gguf(model_path), tokens)

# %% [markdown]
# ## The files

# %%
facts = pd.DataFrame([zoo.file_facts(v) for v in variants])
w.save_table(facts, "files", key=True, caption="size and bits per weight of every variant")
facts.round(3)

# %% [markdown]
# ## Drift from F32, teacher-forced
#
# Each runner against its own F32 run: qlib's faithful engine (candle's default form: quantized
# for the block types, every activation row quantized to the weight type's dot type first, as
# ggml does on the CPU), qlib's fast engine, and llama.cpp (f32 KV cache).

# %%
runners = {"qlib faithful": {}, "qlib fast": dict(engine="fast")}  # faithful: candle's default form
logits: dict[tuple[str, str], np.ndarray] = {}
for v in variants:
    for name, kw in runners.items():
        try:
            model, _ = load(v.path, "cpu", **kw)
        except ValueError as e:  # an engine that refuses a type: said, not fatal
            print(w.skipped(f"{name} on {v.name}", str(e)))
            continue
        logits[(name, v.name)] = teacher_forced_logits(model, ids).numpy()
        del model
    if have_llama_cpp:
        src = LlamaCppSource(v.path, threads=threads)
        logits[("llama.cpp", v.name)] = src.teacher_forced(ids)
        src.close()
drift_rows = []
for (runner, variant), lg in logits.items():
    ref = logits.get((runner, zoo.REFERENCE))
    if ref is None:
        continue
    drift_rows.append({"runner": runner, "variant": variant, **zoo.drift(lg, ref, ids)})
dr = pd.DataFrame(drift_rows)
w.save_table(dr, "drift", key=True, caption="teacher-forced drift of each variant from the "
             "same runner's F32 run")
dr.pivot(index="variant", columns="runner", values="mean_abs_diff").reindex(types).round(4)

# %%
bits = facts.set_index("variant")["bits_per_weight"]
fig, axes = plt.subplots(1, 2, figsize=(11, 4))
for runner, g in dr[dr.variant != zoo.REFERENCE].groupby("runner"):
    x = bits.reindex(g.variant)
    axes[0].plot(x, g.mean_abs_diff, "o", label=runner, alpha=0.8)
    axes[1].plot(x, g.perplexity, "o", label=runner, alpha=0.8)
for v, b in bits.items():
    if v != zoo.REFERENCE:
        axes[0].annotate(v, (b, dr[(dr.variant == v)].mean_abs_diff.max()), fontsize=7,
                         xytext=(2, 2), textcoords="offset points")
axes[0].set(xlabel="bits per weight", ylabel="mean |logit diff| from F32", yscale="log")
ref_ppl = dr[dr.variant == zoo.REFERENCE].perplexity.mean()
axes[1].axhline(ref_ppl, color="grey", lw=0.8, ls="--", label="F32")
axes[1].set(xlabel="bits per weight", ylabel="passage perplexity")
axes[0].legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "drift", caption="drift from F32 and perplexity against bits per weight")

# %% [markdown]
# ## Speed
#
# The benchmark protocol with a shorter prompt and fewer steps (parameters above), one process
# per configuration; compare the rows of this run only.

# %%
configs = [("qlib", None, "cpu"), ("qlib", "fast", "cpu")]
if device == "cuda" and torch.cuda.is_available():
    configs.append(("qlib", "fast", "cuda"))
if have_llama_cpp:
    configs.append(("llama.cpp", None, "cpu"))
speed_rows = [zoo.speed(v, rt, engine=eng, device=dev, threads=threads, prompt_tokens=prompt_tokens,
                        steps=steps, reps=reps)
              for v in variants for rt, eng, dev in configs]
sp = pd.DataFrame(speed_rows)
w.save_table(sp, "speed", key=True, caption=f"prefill ({prompt_tokens} tokens, ms) and decode "
             "(ms/token), min over reps", timing=["peak_rss_mb"])
failed = sp[sp.error.astype(bool)]
if len(failed):
    print("failed:\n" + failed[["variant", "runner", "error"]].to_string())
ok = sp[~sp.error.astype(bool)]
ok.pivot(index="variant", columns="runner", values="decode_ms").reindex(types).round(2)

# %%
fig, ax = plt.subplots(figsize=(11, 4))
table = ok.pivot(index="variant", columns="runner", values="decode_ms").reindex(types)
table.plot.bar(ax=ax, width=0.8)
ax.set(ylabel="decode ms/token (min)", xlabel="")
ax.legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "decode", caption="decode time per variant and runner (lower is better)")

# %% [markdown]
# ## Findings

# %%
if len(ok):
    fast = ok[ok.runner == "qlib fast cpu"].set_index("variant").decode_ms
    best = fast.idxmin()
    w.finding("fastest_fast", "The fast CPU engine decodes {v} fastest: {ms:.2f} ms/token "
              "({bpw:.2f} bits per weight).", table="speed", v=best, ms=fast[best], bpw=bits[best])
    if "llama.cpp cpu" in set(ok.runner):
        ref = ok[ok.runner == "llama.cpp cpu"].set_index("variant").decode_ms
        ratio = (fast / ref).dropna()
        w.finding("vs_llama_cpp", "Against llama.cpp the fast engine's decode time ranges from "
                  "{lo:.2f}x ({vlo}) to {hi:.2f}x ({vhi}) over the variants both ran.",
                  table="speed", lo=ratio.min(), vlo=ratio.idxmin(), hi=ratio.max(),
                  vhi=ratio.idxmax())
q = dr[(dr.runner == "qlib faithful") & (dr.variant != zoo.REFERENCE)].set_index("variant")
worst = q.mean_abs_diff.idxmax()
w.finding("worst_drift", "The faithful engine drifts most from F32 in {v}: mean |logit diff| "
          "{d:.3f}, argmax agreement {a:.1%}.", table="drift", v=worst,
          d=q.mean_abs_diff[worst], a=q.argmax_agreement[worst])
if have_llama_cpp:
    lc = dr[(dr.runner == "llama.cpp") & (dr.variant != zoo.REFERENCE)].set_index("variant")
    rel = (q.mean_abs_diff / lc.mean_abs_diff).dropna()
    w.finding("drift_vs_llama_cpp", "qlib's faithful drift from F32 is {lo:.2f}x to {hi:.2f}x "
              "llama.cpp's own over the same files (largest for {v}).", table="drift",
              lo=rel.min(), hi=rel.max(), v=rel.idxmax())
