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
# # The GPU decode ladder: what launching costs
#
# A decode step of a 135M model moves about 100 MB and does little arithmetic: on an H200 the
# bytes take tens of microseconds, so what a step costs is mostly how the GPU is driven. The
# same greedy decode (the benchmark prompt, then `steps` steps, the next token read back every
# step) runs on each rung of a ladder: (a) the faithful engine, one torch op after another;
# (b) the fast CUDA engine's fused Triton kernels launched one by one from Python; (c) the same
# kernels captured once in a CUDA graph and replayed, without and with programmatic dependent
# launch (PDL: Hopper and later), and with the attention's combine merged into the output
# projection's kernel (five kernels a layer instead of six); (d) one persistent kernel that walks all
# the layers, each block waiting only for the words it reads (they carry the step's tag or
# count their addends), no grid-wide barrier
# (`qlib.quants.cuda.persistent`), also replayed from a graph; then the PDL graph and the
# persistent kernel again with the greedy argmax inside the step's graph, only the id read back
# (as `qlib generate` decodes); a rung that cannot run this model says why. Per rung: kernels
# per token, host launches per token, host time per step, GPU busy time per step, ms/token and
# the share of the bandwidth floor (the bytes a step reads / this GPU's measured copy
# bandwidth). CUDA only: elsewhere the notebook records why it skipped.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cuda"  # the ladder is a CUDA experiment; any other device skips with the reason
prompt_tokens = 203  # the benchmark protocol: first 203 tokens of data/passage.txt
steps = 128  # greedy decode steps per run
reps = 5  # timed runs per rung (min and median)

# %%
import pandas as pd
import torch

from qlib import models
from qlib.suite import plots
from qlib.suite.experiments import gpu_ladder
from qlib.suite.experiments.drift import passage_ids
from qlib.suite.results import ResultWriter
from qlib.tokenizer import Tokenizer

plots.style()
model_path = str(model_path or models.path())
w = ResultWriter("11_gpu_decode_ladder", params=dict(
    model_path=model_path, device=device, prompt_tokens=prompt_tokens, steps=steps, reps=reps))
runs_here = device == "cuda" and torch.cuda.is_available()
if not runs_here:
    why = ("no CUDA device here" if device == "cuda"
           else f"a CUDA experiment: run it with device 'cuda' (this run: {device!r})")
    print(w.skipped("ladder", why))

# %% [markdown]
# ## The ladder

# %%
if runs_here:
    ids = passage_ids(Tokenizer.from_gguf(model_path), prompt_tokens)
    rows = gpu_ladder.ladder(model_path, ids, steps=steps, reps=reps)
    df = pd.DataFrame(rows)
    built = df[df["missing"].isna()] if "missing" in df else df
    for r in df[df["missing"].notna()].to_dict("records") if "missing" in df else []:
        print(w.skipped(r["rung"], r["missing"]))
    cols = ["rung", "kernels_per_token", "launches_per_token", "host_ms_per_step",
            "gpu_busy_ms", "ms_per_token", "ms_per_token_median", "floor_ms", "floor_pct"]
    w.save_table(built[cols], "ladder", key=True, caption="one decode step per rung: kernels "
                 "and launches per token, host and GPU time per step, ms/token (min over reps), "
                 "% of the bandwidth floor", timing=cols[1:])
    built[cols].round(4)

# %% [markdown]
# ## Plot

# %%
if runs_here:
    floor = float(built["floor_ms"].iloc[0])
    fig = plots.ladder_figure(built.to_dict("records"), floor_ms=floor)
    w.save_plot(fig, "ladder", caption="decode ms/token per rung (log scale) with the bandwidth "
                "floor of this GPU drawn")

# %% [markdown]
# ## Findings

# %%
if runs_here:
    r = {row["rung"]: row for row in built.to_dict("records")}
    per_op, eager, graph = r["per-op"], r["fused, one by one"], r["fused, CUDA graph"]
    same = all(row["ids"] == per_op["ids"] for row in r.values())
    print(w.finding("rungs_agree", "The {k} rungs produce {same} greedy ids over {n} steps.",
                    table="ladder", k=len(r), same="the same" if same else "different", n=steps))
    print(w.finding("fusion", "Fusing the step's ops into {k:.0f} Triton kernels takes decode "
                    "from {a:.2f} to {b:.3f} ms/token ({x:.1f}x); launched one by one the host "
                    "spends {h:.3f} ms per step enqueueing them.", table="ladder",
                    k=eager["kernels_per_token"], a=per_op["ms_per_token"],
                    b=eager["ms_per_token"], x=per_op["ms_per_token"] / eager["ms_per_token"],
                    h=eager["host_ms_per_step"]))
    print(w.finding("graph", "Replaying them as one CUDA graph: {b:.3f} ms/token ({x:.2f}x "
                    "the one-by-one rung), {pct:.1f}% of the {floor:.0f} us bandwidth floor; the "
                    "GPU is busy {busy:.3f} ms of it, so {gap:.0f}% of the step is the gaps "
                    "between {k:.0f} kernels and the read-back.", table="ladder",
                    b=graph["ms_per_token"], x=graph["ms_per_token"] / eager["ms_per_token"],
                    pct=graph["floor_pct"], floor=graph["floor_ms"] * 1e3,
                    busy=graph["gpu_busy_ms"], k=graph["kernels_per_token"],
                    gap=100 * (1 - graph["gpu_busy_ms"] / graph["ms_per_token"])))
    if "fused, CUDA graph + PDL" in r:
        pdl = r["fused, CUDA graph + PDL"]
        print(w.finding("pdl", "With programmatic dependent launch (each kernel's blocks wait on "
                        "the device for the previous kernel) the same graph takes {b:.3f} "
                        "ms/token ({x:.2f}x the CUDA-graph rung); its kernels' durations sum to "
                        "{busy:.3f} ms because each now includes its blocks' wait for the "
                        "previous kernel: they overlap.",
                        table="ladder", b=pdl["ms_per_token"],
                        x=pdl["ms_per_token"] / graph["ms_per_token"], busy=pdl["gpu_busy_ms"]))
    if "merged, CUDA graph + PDL" in r and "fused, CUDA graph + PDL" in r:
        mg, pdl = r["merged, CUDA graph + PDL"], r["fused, CUDA graph + PDL"]
        print(w.finding("merged", "Merging the attention's combine into the output "
                        "projection's kernel ({k:.0f} kernels per token instead of {k0:.0f}) "
                        "takes the PDL graph from {a:.3f} to {b:.3f} ms/token ({x:.2f}x).", table="ladder", k=mg["kernels_per_token"],
                        k0=pdl["kernels_per_token"], a=pdl["ms_per_token"],
                        b=mg["ms_per_token"], x=mg["ms_per_token"] / pdl["ms_per_token"]))
    if "persistent" in r:
        pk = r["persistent"]
        print(w.finding("persistent", "One persistent kernel per step: {b:.3f} ms/token "
                        "({x:.2f}x the CUDA-graph rung), {k:.0f} kernels per token, GPU busy "
                        "{busy:.3f} ms, {pct:.1f}% of the bandwidth floor.", table="ladder",
                        b=pk["ms_per_token"], x=pk["ms_per_token"] / graph["ms_per_token"],
                        k=pk["kernels_per_token"], busy=pk["gpu_busy_ms"], pct=pk["floor_pct"]))
    for name, tag in (("fused, CUDA graph + PDL", "pdl"), ("persistent", "persistent")):
        if f"{name} + argmax on device" in r and name in r:
            a, b = r[name], r[f"{name} + argmax on device"]
            print(w.finding(f"argmax_on_device_{tag}",
                            "{name}: the argmax inside the step's graph, only the id read back "
                            "(as `qlib generate` decodes), takes {a:.3f} to {b:.3f} ms/token "
                            "({x:.2f}x; {k:.3g} kernels per token against {k0:.3g}).",
                            table="ladder", name=name, a=a["ms_per_token"], b=b["ms_per_token"],
                            x=b["ms_per_token"] / a["ms_per_token"], k=b["kernels_per_token"],
                            k0=a["kernels_per_token"]))
    w.seed_reference("metal_per_op_commit", "decode step, Metal, one command buffer per op "
                     "(CANDLE_METAL_COMPUTE_PER_BUFFER=1) vs the default 50", "11.6 vs 2.4 ms",
                     ours=f"{per_op['ms_per_token']:.2f} (per-op) vs "
                          f"{graph['ms_per_token']:.3f} (one graph) ms/token",
                     source="seed chapter 001, the CANDLE_METAL_COMPUTE_PER_BUFFER answer")
