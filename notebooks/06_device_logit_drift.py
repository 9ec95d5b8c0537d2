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
# # CPU vs GPU logit drift
#
# Follows the seed chapter **QTensor 与 QMatMul (QTensor and QMatMul)**, section "两个设备为什么不一致"
# (why CPU and GPU logits differ), with the error-table method of **自己量化 (self-quantize)**. One
# GGUF file, many ways to run it: qlib's `quantized` form (on the CPU: every activation row
# quantized to Q8_0 / Q8_1 / Q8_K first, integer dots, as ggml) and its dequantized `f32` form, on
# the CPU and on a GPU when there is one; llama.cpp (f32 KV cache); transformers in float32, the
# reference. For the file's own Q4_1 and a Q8_0 derived from it by qlib's quantizer you will see
# the drift matrix (max and mean |logit difference| between every pair over the teacher-forced
# passage), the argmax agreement with the reference, the first generated token where greedy
# generation leaves the reference, and a sensitivity test the seed does not have: moving every
# QMatMul input by one ulp before the CPU quantization, compared with the whole
# quantized-vs-dequantized drift.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps: the results tag; a GPU device also runs the GPU half
variants = ["Q4_1", "Q8_0"]  # the file type itself, and types derived by qlib's quantizer
tokens = 256  # teacher-forced positions of data/passage.txt
prompt = "What is Rust?"  # user message of the greedy generation (chat template)
gen_steps = 48  # greedy tokens per source, no stop at EOS
gpu = "auto"  # auto: the GPU beside the CPU (CUDA or MPS) when there is one; None: CPU only
llama_cpp = True  # llama.cpp through llama-cpp-python, when installed
transformers = True  # transformers float32 on the same GGUF: the reference
seed = 0

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from qlib import models
from qlib.devices import gpu_device
from qlib.suite import plots
from qlib.suite.experiments import drift
from qlib.suite.experiments.common import chat_ids
from qlib.suite.results import ResultWriter
from qlib.tokenizer import Tokenizer

pd.set_option("display.max_colwidth", 80)
pd.set_option("display.width", 200)
plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
w = ResultWriter("06_device_logit_drift", params=dict(
    model_path=model_path, device=device, variants=variants, tokens=tokens, prompt=prompt,
    gen_steps=gen_steps, gpu=gpu, llama_cpp=llama_cpp, transformers=transformers, seed=seed))
gpu_dev = (device if device != "cpu" else gpu_device()) if gpu == "auto" else gpu
tok = Tokenizer.from_gguf(model_path)
ids = drift.passage_ids(tok, tokens)
prompt_ids = chat_ids(tok, prompt)
print(f"GPU half: {gpu_dev or 'none'}; {len(ids)} teacher-forced tokens; "
      f"{len(prompt_ids)}-token prompt, {gen_steps} greedy tokens")

# %% [markdown]
# ## The files
#
# Variants other than the file's own type are derived by `qlib.models.derive` (`qlib.convert.quantize_gguf`): every matrix
# dequantized to f32 and re-quantized with qlib's quantizer (norms stay F32), cached in
# `data/models/`. They are re-quantized from Q4_1, so not byte-identical to files published
# upstream.

# %%
paths = {t: drift.variant_path(model_path, t) for t in variants}
model_files = ", ".join(p.name for p in paths.values())  # the plots' footer
files = w.save_table([{"variant": t, "file": p.name, "bytes": p.stat().st_size,
                       "derived": str(p) != model_path} for t, p in paths.items()], "files",
                     caption="the files compared")
files

# %% [markdown]
# ## Running every source
#
# Per source and file: one prefill of the passage with every position's logits (teacher forcing),
# a greedy generation keeping its first step's logits, and for qlib on the CPU the same teacher
# forcing with every QMatMul input moved one ulp up. The reference runs once per file.

# %%
runs, source_rows = {}, []
for t, path in paths.items():
    specs, left_out = drift.source_specs(path, gpu_dev, llama_cpp=llama_cpp,
                                         transformers=transformers)
    for part, reason in left_out:
        print(w.skipped(part, reason))
    print(f"-- {t}")
    runs[t], failed = drift.run_sources(specs, ids, prompt_ids, gen_steps)
    for part, reason in failed:
        print(w.skipped(f"{part} ({t})", reason))
    source_rows += [{"variant": t, "source": n, "seconds": r.seconds,
                     "text": tok.decode(r.greedy)} for n, r in runs[t].items()]
sources = w.save_table(source_rows, "sources", caption="sources run, time (load, teacher "
                       "forcing, generation, nudged run) and greedy text")
reference = {t: drift.REFERENCE if drift.REFERENCE in r else "qlib cpu f32"
             for t, r in runs.items()}
print("reference:", reference)
sources

# %% [markdown]
# ## The drift matrix
#
# max |logit difference| (top) and mean (bottom) between every pair, over all teacher-forced
# positions and the whole vocabulary.

# %%
pairs, matrices = [], {}
for t, r in runs.items():
    mx, mean = drift.drift_matrix({n: run.logits for n, run in r.items()})
    matrices[t] = (mx, mean)
    pairs += drift.long_pairs(mx, mean, variant=t)
w.save_table(pairs, "drift_pairs", caption="max and mean |logit diff| of every pair of sources")

fig = plots.drift_matrix_figure(matrices)
w.save_plot(fig, "drift_matrix", caption="drift matrix: max (top) and mean (bottom) |logit "
            "difference| between every pair of sources, per file (one colour scale)",
            model=model_files)

# %% [markdown]
# ## Against the reference
#
# `step0_max_abs_diff`: the prompt's last position (the seed's "first step"); `max`/`mean`: over the
# teacher-forced passage; `argmax_agree`: positions whose top token is the reference's;
# `first_diverging_token`: the first generated token (counting from 1) unlike the reference's.

# %%
vs = []
for t, r in runs.items():
    vs += drift.versus_reference(r, reference[t], tok, variant=t, reference_source=reference[t])
vs = w.save_table(vs, "vs_reference", key=True, caption="each source against the reference: "
                  "step-0 and teacher-forced drift, argmax agreement, first diverging token")
vs.drop(columns=["reference_source"])


# %%
def row(t, source):
    hit = vs[(vs.variant == t) & (vs.source == source)]
    return hit.iloc[0] if len(hit) else None


def diverges(r):
    if pd.isna(r.first_diverging_token):
        return f"never leaves it in {int(r.generated)} tokens"
    return (f"leaves it at generated token {int(r.first_diverging_token)} "
            f"({r.reference_token!r} -> {r.token!r})")


for t in runs:
    q, f, lc = row(t, "qlib cpu quantized"), row(t, "qlib cpu f32"), row(t, "llama.cpp cpu")
    if q is None or f is None:
        continue
    print(w.finding(
        f"cpu_forms_{t}", "{t}: against {ref}, qlib's CPU quantized form drifts by max {q:.3f} "
        "(mean {qm:.4f}) and its dequantized f32 form by max {f:.1e}{lc}.", table="vs_reference",
        t=t, ref=reference[t], q=q.max_abs_diff, qm=q.mean_abs_diff, f=f.max_abs_diff,
        lc="" if lc is None else f"; llama.cpp by max {lc.max_abs_diff:.3f} "
                                 f"(mean {lc.mean_abs_diff:.4f})"))
    print(w.finding(
        f"argmax_{t}", "{t}: the CPU quantized argmax agrees with the reference at {a} of {n} "
        "teacher-forced positions (f32 form: {af}), and its greedy generation {div}.",
        table="vs_reference", t=t, a=int(q.argmax_agree), n=int(q.positions),
        af=int(f.argmax_agree), div=diverges(q)))
gtag = str(gpu_dev).split(":")[0] if gpu_dev else None
for t in runs:
    g, gf = row(t, f"qlib {gtag} quantized"), row(t, f"qlib {gtag} f32")
    c = row(t, "qlib cpu quantized")
    if gtag and g is not None and gf is not None and c is not None:
        print(w.finding(
            f"gpu_{t}", "{t} on {gpu}: the quantized form (no activation quantization) is max "
            "{g:.1e} from the reference, the f32 form {gf:.1e}, the CPU quantized form {c:.3f}; "
            "greedy generation {div}.", table="vs_reference", t=t, gpu=gpu_dev,
            g=g.max_abs_diff, gf=gf.max_abs_diff, c=c.max_abs_diff, div=diverges(g)))

# %%
fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 3.2), squeeze=False)
for ax, (t, r) in zip(axes[0], runs.items(), strict=True):
    pdrift = drift.position_drift(r, reference[t])
    for name in pdrift:
        ax.plot(pdrift.index, pdrift[name].clip(lower=1e-7), lw=0.9, label=name)
    plots.log_axis(ax, "y")
    ax.set_xlabel("teacher-forced position")
    ax.set_ylabel(f"max |logit diff| vs {reference[t]}", fontsize=8)
    ax.set_title(t, fontsize=10)
    ax.legend(fontsize=7)
fig.tight_layout()
w.save_plot(fig, "drift_by_position", caption="max |logit difference| from the reference at "
            "each teacher-forced position", model=model_files)

# %% [markdown]
# ## Position 0 against llama.cpp
#
# At position 0 no attention has mixed positions yet, so two engines that follow ggml's semantics
# should agree there; teacher-forced, qlib's CPU quantized form and llama.cpp still part on some
# tokens. docs/design.md ("Position 0 against llama.cpp") settles why, with `tools/position0.py`:
# neither engine departs from ggml's semantics. llama.cpp runs ggml's x86 `vec_dot` for every
# weight matmul (bit for bit, the tied Q8_0 output included); qlib sums the same per-block terms
# in another float32 order, so its outputs differ by ulps, and where an activation block's
# `amax / 127` lands on an f16 rounding midpoint the two round that block's scale to neighbouring
# f16 values; large activations carry the step to the logits. With ggml's own dots in qlib's
# place the position-0 logits are equal (`tests/test_position0.py` holds it). The table gives the
# size of the split in this run beside each engine's distance from the dequantized f32 form.

# %%
p0 = []
for t, r in runs.items():
    p0 += drift.at_position(r, [("qlib cpu quantized", "llama.cpp cpu"),
                                ("qlib cpu quantized", "qlib cpu f32"),
                                ("llama.cpp cpu", "qlib cpu f32"),
                                ("qlib cpu f32", reference[t])], 0, variant=t)  # fmt: skip
p0 = w.save_table(p0, "position0", key=True, caption="|logit diff| at teacher-forced position 0 "
                  "(the passage's first token) between pairs of sources")
for t in runs:
    pick = {(x.a, x.b): x for x in p0[p0.variant == t].itertuples()} if len(p0) else {}
    split = pick.get(("qlib cpu quantized", "llama.cpp cpu"))
    q, lc = pick.get(("qlib cpu quantized", "qlib cpu f32")), pick.get(("llama.cpp cpu",
                                                                        "qlib cpu f32"))
    if split is not None and q is not None and lc is not None:
        print(w.finding(
            f"position0_{t}", "{t}: at position 0 qlib's CPU quantized form and llama.cpp differ "
            "by max {d:.3g} (mean {m:.2g}); they are {q:.3g} and {lc:.3g} from the dequantized "
            "f32 form there.", table="position0", t=t, d=split.max_abs_diff,
            m=split.mean_abs_diff, q=q.max_abs_diff, lc=lc.max_abs_diff))
p0

# %% [markdown]
# ## Sensitivity: one ulp before the CPU quantization
#
# Every QMatMul input `x` becomes `nextafter(x, +inf)` (the next float32 up), in both forms. In the
# f32 form that is a relative change of at most 2^-23, which float rounding all but absorbs. In the
# quantized form a value on the edge of a rounding step lands in the next Q8 code; that change
# propagates, and later layers quantize slightly different activations. `codes_changed_share` counts
# the activation codes the nudge itself flips, at each QMatMul of the nudged run.

# %%
ulp = []
for t, r in runs.items():
    ulp += drift.ulp_sensitivity(r, variant=t)
ulp = w.save_table(ulp, "ulp_sensitivity", key=True, caption="drift caused by a one-ulp nudge of "
                   "every QMatMul input, beside the quantized-vs-f32 drift")
ulp

# %%
if len(ulp):
    fig = plots.ulp_figure(ulp)
    w.save_plot(fig, "ulp_sensitivity", caption="one-ulp nudge vs the quantized-vs-f32 drift",
                model=model_files)
u = ulp.set_index(["variant", "comparison"])
for t in runs:
    keys = [(t, "qlib cpu quantized: nudged by 1 ulp vs not"), (t, "qlib cpu f32: nudged by 1 ulp "
            "vs not"), (t, "qlib cpu quantized vs qlib cpu f32")]
    if not all(k in u.index for k in keys):
        continue
    nq, nf, qf = (u.loc[k] for k in keys)
    print(w.finding(
        f"ulp_{t}", "{t}: nudging every QMatMul input by one ulp flips {codes:.4%} of the "
        "activation codes yet moves the CPU quantized logits by mean {nm:.4f} (max {nx:.3f}), "
        "{ratio:.0%} of the quantized-vs-f32 drift (mean {qm:.4f}); the same nudge moves the f32 "
        "form by mean {fm:.1e}.", table="ulp_sensitivity", t=t, codes=nq.codes_changed_share,
        nm=nq.mean_abs_diff, nx=nq.max_abs_diff, ratio=nq.mean_abs_diff / qf.mean_abs_diff,
        qm=qf.mean_abs_diff, fm=nf.mean_abs_diff))

# %% [markdown]
# ## The weights themselves
#
# The two files' references against each other: how much the weight formats differ, beside how
# much the forms of one file do.

# %%
rows = []
names = list(runs)
for i, a in enumerate(names):
    for b in names[i + 1:]:
        ra, rb = runs[a].get(reference[a]), runs[b].get(reference[b])
        if ra is None or rb is None:
            continue
        d = np.abs(ra.logits - rb.logits)
        rows.append({"a": f"{a} {reference[a]}", "b": f"{b} {reference[b]}",
                     "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                     "argmax_agree": int((ra.logits.argmax(-1) == rb.logits.argmax(-1)).sum()),
                     "positions": len(ids)})
weights = w.save_table(rows, "weights_drift", caption="reference of one file vs another's")
if len(weights):
    x = weights.iloc[0]
    q = vs[vs.source == "qlib cpu quantized"]
    print(w.finding(
        "weights", "The references of {a} and {b} differ by max {m:.3f} (mean {mm:.4f}, argmax "
        "agreeing at {ag} of {n}), against at most {q:.3f} (mean {qm:.4f}) between qlib's CPU "
        "quantized form and the reference of one file.", table="weights_drift",
        a=variants[0], b=variants[1], m=x.max_abs_diff, mm=x.mean_abs_diff, ag=int(x.argmax_agree),
        n=int(x.positions), q=q.max_abs_diff.max(), qm=q.mean_abs_diff.max()))
weights

# %% [markdown]
# ## Beside the seed
#
# The seed compared Metal and the M2 Max CPU on its own prompt (first step after the prefill); here
# the first step of our chat prompt, against transformers f32 instead of Metal's dequantized form
# (the dequantized f32 form and transformers f32 agree to float rounding, in the seed and in the
# table above).

# %%
SEED_QMM = "chapter 'QTensor and QMatMul', section 'why the two devices differ'"
SEED_OWN = "chapter 'self-quantize', error table (downloaded Q8_0, CPU)"
q8 = row("Q8_0", "qlib cpu quantized") if "Q8_0" in runs else None
if q8 is not None:
    w.seed_reference("q8_cpu_step0", "Q8_0: max|CPU quantized - dequantized f32| at step 0", 0.5388,
                     ours=float(f"{q8.step0_max_abs_diff:.3g}"), source=SEED_QMM)
    w.seed_reference("q8_cpu_argmax", "Q8_0 CPU: argmax agreement under teacher forcing",
                     "262/270", ours=f"{int(q8.argmax_agree)}/{int(q8.positions)}",
                     source=SEED_OWN)
    w.seed_reference("q8_cpu_diverge", "Q8_0 CPU: first diverging generated token", 26,
                     ours=(None if pd.isna(q8.first_diverging_token)
                           else int(q8.first_diverging_token)), source=SEED_OWN)
q8g = row("Q8_0", f"qlib {gtag} quantized") if gtag and "Q8_0" in runs else None
w.seed_reference("q8_gpu_step0", "Q8_0: max|GPU quantized - dequantized f32| at step 0", 0.0154,
                 ours=None if q8g is None else float(f"{q8g.step0_max_abs_diff:.3g}"),
                 source=SEED_QMM + " (Metal)")
