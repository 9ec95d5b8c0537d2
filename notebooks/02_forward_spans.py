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
# # One forward of quantized llama: spans, attention ops, threads
#
# Follows the seed chapter *one forward of quantized llama* (000), its section on where the
# time of a decode step goes. The engine marks its regions with candle's span names (`model`,
# `output`, `attn`, `attn-rot`, `attn-mlp`, `qmatmul`, `rms-norm`); after a warm-up we record
# count, total and self time per name for the prefill of the chat prompt and for decode step
# 20 (context 32), and check the counts against what the model's structure implies. Then one
# attention layer is replayed op by op on random tensors of the model's shapes, at context 32
# and 1024, exactly as `forward_attn` runs it (cat KV, repeat_kv, q·kᵀ, scale, softmax, att·v),
# and with a preallocated cache and PyTorch's SDPA with GQA for contrast. Last, the same forward
# with 1, 2 (and more, where there are more cores) threads, and on a GPU the time when `forward`
# returns against the time after `synchronize`.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps; on a GPU also: spans enqueued vs synchronized, return vs sync
prompt = "What is Rust?"  # the user's message, wrapped in the chat template
system_prompt = False  # True: keep the template's default system message (longer prompt)
decode_step = 20  # decode step whose spans are recorded (13-token prompt: context 32)
warmup = 2  # full generations before recording
replay_contexts = [32, 1024]  # cached positions in the one-layer attention replay
replay_reps = 300  # passes over the replayed ops
threads = 1  # torch CPU threads for spans and replay; None: torch's default
thread_counts = None  # thread counts to compare; None: 1, 2 and doubling up to the cores
forward_reps = 3  # timed forwards per thread count, after one warm-up
form = None  # QMatMul form: None (the engine's default), "quantized", "f32" or "f16"
seed = 0

# %%
import os

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display

from qlib import models
from qlib.suite import plots
from qlib.suite.experiments import span_study
from qlib.suite.experiments.common import build, chat_ids
from qlib.suite.results import SEED_LABEL, ResultWriter

plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
if threads:
    torch.set_num_threads(threads)
devices = ["cpu"] if device == "cpu" else ["cpu", device]
w = ResultWriter("02_forward_spans", params=dict(
    model_path=model_path, device=device, prompt=prompt, system_prompt=system_prompt,
    decode_step=decode_step, warmup=warmup, replay_contexts=replay_contexts,
    replay_reps=replay_reps, threads=threads, thread_counts=thread_counts,
    forward_reps=forward_reps, form=form, seed=seed))
model, tokenizer = build(model_path, "cpu", form=form)
cfg = model.config
prompt_ids = chat_ids(tokenizer, prompt, system=system_prompt)
context = len(prompt_ids) + decode_step - 1
print(f"{cfg.block_count} blocks, {cfg.head_count} query heads, {cfg.head_count_kv} KV heads, "
      f"head_dim {cfg.head_dim}; prompt {len(prompt_ids)} tokens, decode step {decode_step} at "
      f"index_pos {context}; torch threads {torch.get_num_threads()}; "
      f"load average {os.getloadavg()[0]:.1f}")

# %% [markdown]
# ## Spans by name
#
# *Self* time is a span's time minus the spans entered inside it: `attn`'s self time is the
# attention without its four projections (`qmatmul`) and RoPE (`attn-rot`); `attn-mlp` holds
# the FFN norm and the three MLP projections. The expected counts follow from the structure:
# 7 projections per block plus the output layer, 2 norms per block plus the final one, RoPE on
# q and k in every block.

# %%
expected = span_study.expected_counts(cfg)
profiles = {}  # (device, spans) -> (prefill, decode)
profiles["cpu", "as recorded"] = span_study.profile_spans(model, prompt_ids, decode_step,
                                                          warmup=warmup)
gpu_model = None
if device != "cpu":
    gpu_model, _ = build(model_path, device, form=form)
    profiles[device, "as recorded"] = span_study.profile_spans(gpu_model, prompt_ids, decode_step,
                                                               warmup=warmup)
    profiles[device, "sync at every exit"] = span_study.profile_spans(
        gpu_model, prompt_ids, decode_step, warmup=0, sync_spans=True)
span_rows, check_rows, wall_rows = [], [], []
for (dev, how), passes in profiles.items():
    for p in passes:
        span_rows += [{"device": dev, "spans": how, **r} for r in p.table()]
        check_rows += [{"device": dev, "spans": how, "pass": p.pass_name, **r}
                       for r in span_study.check_counts(p.rows, expected)]
        wall_rows.append({"device": dev, "spans": how, "pass": p.pass_name, "seq_len": p.seq_len,
                          "index_pos": p.index_pos, "wall_ms": p.wall_ms})
spans = w.save_table(span_rows, "spans", key=True, caption=(
    f"count, total and self time (ms) per span name: prefill of {len(prompt_ids)} tokens and "
    f"decode step {decode_step} (index_pos {context})"))
check = w.save_table(check_rows, "span_counts", key=True,
                     caption="span counts observed against the counts the structure implies")
walls = w.save_table(wall_rows, "forward_wall", caption="wall time of the recorded forwards (ms)")
assert check.ok.all(), check[~check.ok]
display(walls.round(2))
spans[spans.device == "cpu"].round(3)

# %%
cpu_spans = spans[(spans.device == "cpu")]
passes = list(dict.fromkeys(cpu_spans["pass"]))
fig, axes = plt.subplots(1, len(passes), figsize=(10, 3))
for ax, name in zip(axes, passes, strict=True):
    d = cpu_spans[cpu_spans["pass"] == name].sort_values("self_ms")
    plots.bar_labels(ax, ax.barh(d.name + " ×" + d["count"].astype(str), d.self_ms), "{:.2g}")
    ax.set(xlabel="self time, ms", title=f"CPU {name}")
fig.tight_layout()
w.save_plot(fig, "spans", caption="self time per span name (with counts), CPU")

# %% [markdown]
# ## One attention layer, op by op
#
# The replay follows `LayerWeights.forward_attn` line by line on random tensors with the model's
# attention shapes, for one decode step with `context` positions already cached. On a decode step
# the forward applies no mask; the `mask (where)` row times the `where` anyway, to show its cost,
# and is left out of the totals (`in_forward` false). The contrast keeps a preallocated cache
# (the new key and value written in place, attention over a view) and calls
# `F.scaled_dot_product_attention(..., enable_gqa=True)`, which needs no repeat_kv copies, or
# (`fold`) plain SDPA with each KV head's query heads folded into rows
# (`qlib.llama.faithful.sdpa_folded`), which needs no copies and no GQA support from the kernel.
# Times are medians over `replay_reps` passes.

# %%
replay_rows = []
for dev in devices:
    for ctx in replay_contexts:
        for cache, attention in (("cat", "naive"), ("prealloc", "sdpa"), ("prealloc", "fold")):
            replay = span_study.AttentionReplay.for_model(cfg, ctx, cache=cache,
                                                          attention=attention, device=dev)
            replay_rows += [{"device": dev, "threads": torch.get_num_threads(), **r}
                            for r in replay.run(reps=replay_reps)]
ops = w.save_table(replay_rows, "attention_ops", caption=(
    "one attention layer of a decode step, op by op (µs): forward_attn (cat + naive) and a "
    "preallocated cache with SDPA-GQA or folded SDPA"))
ops["variant"] = ops.cache + " + " + ops.attention
wide = ops.pivot_table(index=["device", "op"], columns=["context", "variant"], values="median_us",
                       sort=False)
wide.columns = [f"ctx {c}, {v} (µs)" for c, v in wide.columns]
w.save_table(wide.reset_index(), "attention_ops_median", key=True, caption=(
    "one attention layer of a decode step: median µs per op, by context and variant "
    "(mask (where) does not run on a decode step)"))
totals = pd.DataFrame(span_study.replay_totals(replay_rows, "median_us"))
totals["all_layers_ms"] = totals.total_us * cfg.block_count / 1e3
w.save_table(totals, "attention_totals",
             caption="sum of the ops that run in the forward, per layer (µs) and for all layers (ms)")
display(totals.round(1))
wide.round(1)

# %%
c = ops[ops.device == "cpu"]
fig, axes = plt.subplots(1, len(replay_contexts), figsize=(5 * len(replay_contexts), 4),
                         squeeze=False)
for ax, ctx in zip(axes[0], replay_contexts, strict=True):
    d = c[c.context == ctx]
    names = list(dict.fromkeys(d.op))
    groups = list(d.groupby("variant", sort=False))
    h = 0.8 / len(groups)
    for i, (variant, g) in enumerate(groups):
        y = [names.index(op) + (i - (len(groups) - 1) / 2) * h for op in g.op]
        ax.barh(y, g.median_us, h, label=variant)
    ax.set_yticks(range(len(names)),
                  [n if d[d.op == n].in_forward.all() else f"{n} (not in decode)" for n in names])
    ax.invert_yaxis()
    ax.set(xlabel="µs (median)", title=f"one layer, decode at context {ctx} (CPU)")
    ax.legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "attention_ops", caption="attention ops of one layer at each context, CPU")

# %% [markdown]
# ## Threads
#
# Spans and replay above ran with `threads` torch threads. Here `torch.set_num_threads(n)` for
# each count: the prefill of the prompt and one decode step at
# the same context (best of `forward_reps`, each ending with the argmax read back), and the
# replayed attention core at each context. The machine's load average is recorded beside them:
# on a shared machine threads compete with other processes.

# %%
counts = thread_counts or span_study.thread_counts()
prepared = span_study.prepare_decode(model, prompt_ids, context)  # the same cache for every count
thread_rows = []
for n in counts:
    def measure():
        row = span_study.forward_times(model, prompt_ids, context, reps=forward_reps,
                                       prepared=prepared)
        for ctx in replay_contexts:
            r = span_study.AttentionReplay.for_model(cfg, ctx).run(reps=max(replay_reps // 3, 10))
            (tot,) = span_study.replay_totals(r, "median_us")
            row[f"attn_core_us_ctx{ctx}"] = tot["total_us"]
        return row
    thread_rows.append({"threads": n, **span_study.with_threads(n, measure),
                        "load_1min": os.getloadavg()[0]})
th = w.save_table(thread_rows, "threads", key=True, caption=(
    "forward wall time (ms) and one layer's attention core (µs) per thread count, CPU"))
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
axes[0].plot(th.threads, th.prefill_min_ms, marker="o")
axes[0].set(xlabel="threads", ylabel="ms", title=f"prefill, {len(prompt_ids)} tokens")
axes[1].plot(th.threads, th.decode_min_ms, marker="o", color="#c44e52")
axes[1].set(xlabel="threads", ylabel="ms", title=f"decode step at context {context}")
for ax in axes:
    ax.set_xticks(list(th.threads))
fig.tight_layout()
w.save_plot(fig, "threads", caption="forward time against torch's thread count, CPU")
th.round(2)

# %% [markdown]
# ## GPU: forward at return vs after synchronize
#
# On a GPU `forward` returns once its kernels are queued; spans then measure enqueueing, and
# only a synchronize shows when the work is done (the `spans` table above also holds a run with a
# synchronize at every span exit).

# %%
if gpu_model is not None:
    ev = w.save_table(span_study.enqueue_vs_sync(gpu_model, prompt_ids, context, reps=20),
                      "enqueue_vs_sync", key=True,
                      caption=f"{device}: ms when forward returns and after synchronize (medians)")
    display(ev.round(3))
else:
    print(w.skipped("GPU spans and enqueue vs sync",
                    "device='cpu': run with device='cuda' (or mps) for the GPU parts"))

# %% [markdown]
# ## Findings

# %%
qm, rms, rot = expected["qmatmul"], expected["rms-norm"], expected["attn-rot"]
print(w.finding(
    "counts", "All {names} span names occurred as often as the structure implies in every "
    "recorded pass: {qm} qmatmul = 7 x {n} blocks + 1, {rms} rms-norm = 2 x {n} + 1, {rot} attn-rot "
    "= 2 x {n}, {n} attn and attn-mlp.", table="span_counts", names=len(expected), qm=qm,
    rms=rms, rot=rot, n=cfg.block_count))
dec = cpu_spans[cpu_spans["pass"] == f"decode step {decode_step}"].set_index("name")
wall_dec = walls[(walls.device == "cpu") & (walls["pass"] == f"decode step {decode_step}")]
print(w.finding(
    "decode_split", "In CPU decode step {step} (index_pos {pos}), attn's self time (attention "
    "without its projections and RoPE) was {attn:.2f} ms against {qm:.2f} ms for all {nq} "
    "qmatmuls, in a {wall:.1f} ms forward.", table="spans", step=decode_step, pos=context,
    attn=dec.loc["attn", "self_ms"], qm=dec.loc["qmatmul", "self_ms"],
    nq=int(dec.loc["qmatmul", "count"]), wall=float(wall_dec.wall_ms.iloc[0])))
pre = cpu_spans[cpu_spans["pass"] == "prefill"].set_index("name")
print(w.finding(
    "rope", "RoPE (attn-rot) cost {pre_us:.0f} µs per call in the {t}-token prefill against "
    "{dec_us:.0f} µs per call in the decode step.", table="spans", t=len(prompt_ids),
    pre_us=pre.loc["attn-rot", "total_ms"] / pre.loc["attn-rot", "count"] * 1e3,
    dec_us=dec.loc["attn-rot", "total_ms"] / dec.loc["attn-rot", "count"] * 1e3))
big, small = max(replay_contexts), min(replay_contexts)
o = c[(c.context == big) & (c.cache == "cat")].set_index("op")
copies = o.loc[["cat k", "cat v", "repeat_kv k", "repeat_kv v"], "median_us"].sum()
matmuls = o.loc[["q @ k^T", "att @ v"], "median_us"].sum()
t = totals[totals.device == "cpu"].set_index(["context", "cache", "attention"])
print(w.finding(
    "copies", "At context {ctx} the copies of forward_attn (cat and repeat_kv of K and V) took "
    "{copies:.0f} µs per layer against {mm:.0f} µs for its two matmuls; a preallocated cache with "
    "SDPA-GQA ran the whole core in {pre:.0f} µs instead of {cat:.0f} µs.", table="attention_ops_median",
    ctx=big, copies=copies, mm=matmuls, pre=t.loc[(big, "prealloc", "sdpa"), "total_us"],
    cat=t.loc[(big, "cat", "naive"), "total_us"]))
o_small = c[(c.context == small) & (c.cache == "cat") & c.in_forward].set_index("op").median_us
print(w.finding(
    "small_context", "At context {ctx} the most expensive op of forward_attn was {op} "
    "({us:.1f} µs of {total:.1f} µs per layer).", table="attention_ops_median", ctx=small,
    op=o_small.idxmax(), us=o_small.max(), total=o_small.sum()))
best_d, best_p = th.loc[th.decode_min_ms.idxmin()], th.loc[th.prefill_min_ms.idxmin()]
print(w.finding(
    "threads", "The CPU decode step was fastest with {dn} thread(s) ({dms:.1f} ms, slowest "
    "{wms:.1f} ms with {wn}); the prefill with {pn} ({pms:.1f} ms).", table="threads",
    dn=int(best_d.threads), dms=best_d.decode_min_ms, wms=th.decode_min_ms.max(),
    wn=int(th.loc[th.decode_min_ms.idxmax()].threads), pn=int(best_p.threads),
    pms=best_p.prefill_min_ms))
if gpu_model is not None:
    e = ev.set_index("pass").iloc[-1]
    print(w.finding(
        "enqueue", "On {dev}, forward returned after {r:.2f} ms of a {s:.2f} ms decode step "
        "({share:.0%} of it).", table="enqueue_vs_sync", dev=device, r=e.at_return_ms,
        s=e.after_sync_ms, share=e.enqueue_share))

# %% [markdown]
# ## Seed figures beside ours
#
# References only, from chapter 000 (candle 0.11.0 on an M2 Max, a Q8_0 file, the CPU run with
# the lowest load).

# %%
src = "chapter 000, section on where a decode step's time goes"
w.seed_reference("prefill_wall_cpu", "CPU prefill wall time (13 tokens)", 20.8,
                 ours=float(walls[(walls.device == "cpu") & (walls["pass"] == "prefill")].wall_ms.iloc[0]),
                 unit="ms", source=src)
w.seed_reference("decode_wall_cpu", "CPU decode step 20 wall time", 5.0,
                 ours=float(wall_dec.wall_ms.iloc[0]), unit="ms", source=src)
w.seed_reference("copies_1024", "cat + repeat_kv at context 1024, one layer", 129,
                 ours=copies, unit="µs", source="chapter 000, attncore replay")
w.seed_reference("matmuls_1024", "the two attention matmuls at context 1024, one layer", 56,
                 ours=matmuls, unit="µs", source="chapter 000, attncore replay")
if gpu_model is not None:
    w.seed_reference("gpu_return", "GPU decode: forward returns (Metal)", 0.94,
                     ours=e.at_return_ms, unit="ms", source=src)
    w.seed_reference("gpu_sync", "GPU decode: after synchronize (Metal)", 2.25,
                     ours=e.after_sync_ms, unit="ms", source=src)
pd.DataFrame(w.meta["seed_references"])[["what", "seed", "ours", "unit"]].rename(
    columns={"seed": SEED_LABEL})
