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
# # RoPE mismatch
#
# Follows the seed chapter **量化 llama 的一次前向 (one forward of quantized llama)**, section
# "RoPE：两种约定，按架构名选" and the 4096 limit, with the missing `llama.rope.freq_base` case of
# **自己量化 (self-quantize)**. `from_gguf` picks the RoPE pairing from `general.architecture` alone:
# the same file relabelled `qwen2` in memory gets the NEOX pairing (i, i + d/2) for weights laid
# out for llama's (2i, 2i + 1). You will see that nothing complains, how the greedy text
# degenerates, how far the teacher-forced logits move position by position, the narrow error at
# index_pos 4096 (a constant of the engine, not the model's context length), and that without
# `llama.rope.freq_base` the model silently runs with 10000 and generates differently.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps
form = None  # QMatMul form: None for the engine default (quantized), or f32, f16
prompt = "What is Rust?"  # user message, rendered with the file's chat template
steps = 20  # greedy tokens per variant
tf_tokens = 256  # teacher-forced tokens of data/passage.txt
relabel = "qwen2"  # an architecture name in candle's NEOX list
compare_device = "auto"  # also generate on this device; auto: a GPU beside the CPU; None: no
seed = 0

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.devices import gpu_device
from qlib.suite import plots
from qlib.suite.experiments import rope
from qlib.suite.experiments.common import chat_ids
from qlib.suite.experiments.drift import passage_ids
from qlib.suite.results import ResultWriter
from qlib.tokenizer import Tokenizer

pd.set_option("display.max_colwidth", 120)
plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
w = ResultWriter("05_rope_mismatch", params=dict(
    model_path=model_path, device=device, form=form, prompt=prompt, steps=steps,
    tf_tokens=tf_tokens, relabel=relabel, compare_device=compare_device, seed=seed))
SEED_SOURCE = "chapter 'one forward of quantized llama', section 'RoPE'"
specs = rope.variants(relabel)
tok = Tokenizer.from_gguf(model_path)
prompt_ids = chat_ids(tok, prompt)

# %% [markdown]
# ## What from_gguf makes of each variant
#
# The metadata is edited in memory before `from_gguf`; the file is not touched.

# %%
variant_models, build_rows = rope.load_variants(model_path, device, specs, form=form)
builds = w.save_table(build_rows, "builds", key=True,
                      caption="what from_gguf built from each edited metadata")
builds

# %%
b = builds.set_index("variant")
fb = b.loc["freq_base removed"]
print(w.finding(
    "no_complaint", "from_gguf built {ok} of {n} variants without an error; without "
    "llama.rope.freq_base it used {used:g} where the file says {file:g}.", table="builds",
    ok=int(builds.from_gguf_ok.sum()), n=len(builds), used=fb.freq_base_used,
    file=b.loc["file as is", "freq_base_in_metadata"]))

# %% [markdown]
# ## Greedy generation
#
# `steps` tokens from the chat prompt; repetition measures as in notebook 4.

# %%
gen_rows = rope.generation_rows(variant_models, tok, prompt_ids, steps)
gen = w.save_table([{k: v for k, v in r.items() if k != "ids"} for r in gen_rows], "generation",
                   key=True, caption=f"greedy generation of {steps} tokens per variant")
w.save_json({r["variant"]: r["ids"] for r in gen_rows}, "generation_ids")
gen

# %%
g = gen.set_index("variant")
base, rel, nofb = g.loc["file as is"], g.loc[f"relabelled {relabel}"], g.loc["freq_base removed"]
print(w.finding(
    "relabel_text", "Relabelled {arch}, the greedy text keeps {d} distinct tokens of {n} "
    "(repetition {r:.2f}, against {d0} and {r0:.2f} for the file as is) and leaves the file's text "
    "at generated token {first}.", table="generation", arch=relabel, d=int(rel.distinct_tokens),
    n=steps, r=rel.repetition, d0=int(base.distinct_tokens), r0=base.repetition,
    first=int(rel.first_token_unlike_file) if pd.notna(rel.first_token_unlike_file) else "none"))
print(w.finding(
    "freq_base_text", "Without llama.rope.freq_base the greedy text {how}.", table="generation",
    how=(f"leaves the file's text at generated token {int(nofb.first_token_unlike_file)}"
         if pd.notna(nofb.first_token_unlike_file)
         else f"matches the file's for all {steps} tokens")))
w.seed_reference("text_llama", "greedy text, file as is (rope_i)", "Rust is a modern, "
                 "high-performance, and object-oriented programming language developed by Brian K",
                 ours=base.text, source=SEED_SOURCE)
w.seed_reference("text_qwen2", "greedy text, relabelled qwen2 (rope)",
                 "Rust\nRustin\nRustin\nRustin the world\nRust\n", ours=rel.text,
                 source=SEED_SOURCE)

# %% [markdown]
# ## Teacher-forced logits, position by position
#
# The first `tf_tokens` tokens of `data/passage.txt` in one prefill; every variant against the file
# as is. At position 0 the rotation angle is 0 in every convention and for every base, so the
# logits there must agree; the drift grows with the position.

# %%
ids = passage_ids(tok, tf_tokens)
tf_rows, curves = rope.teacher_forced_rows(variant_models, ids)
tf = w.save_table(tf_rows, "teacher_forced", key=True,
                  caption=f"teacher-forced logits, {tf_tokens} passage tokens, vs the file as is")
fig, ax = plt.subplots(figsize=(7, 3))
for name, d in curves.items():
    ax.plot(d["position"], d["max_abs_diff"], lw=1, label=name)
ax.set_yscale("symlog", linthresh=1e-3)
ax.set_xlabel("position")
ax.set_ylabel("max |logit diff| vs file as is")
ax.legend(fontsize=8)
w.save_plot(fig, "drift_by_position", caption="max|logit difference| per teacher-forced position")
tf

# %%
t = tf.set_index("variant")
print(w.finding(
    "teacher_forced", "Over {n} teacher-forced tokens the argmax agrees with the file as is at "
    "{a_rel} positions relabelled {arch} and {a_fb} without freq_base; at position 0 the logits "
    "differ by {d0:.1e} and {d0b:.1e}.", table="teacher_forced", n=tf_tokens, arch=relabel,
    a_rel=int(t.loc[f"relabelled {relabel}", "argmax_agree"]),
    a_fb=int(t.loc["freq_base removed", "argmax_agree"]),
    d0=t.loc[f"relabelled {relabel}", "max_abs_diff_pos0"],
    d0b=t.loc["freq_base removed", "max_abs_diff_pos0"]))
w.seed_reference("freq_base_argmax", "argmax agreement without freq_base, teacher forcing",
                 "215/270", ours=f"{int(t.loc['freq_base removed', 'argmax_agree'])}/{tf_tokens}",
                 source="chapter 'self-quantize', error table (own Q8_0 without freq_base, "
                        "vs transformers f32; here vs the file as is)")

# %% [markdown]
# ## The 4096 limit
#
# cos/sin tables hold `MAX_SEQ_LEN = 4096` positions. Single forwards on an empty cache: the last
# position that fits, one past it, and a chunk that straddles the end.

# %%
cl = w.save_table(rope.context_limit(variant_models["file as is"]), "context_limit", key=True,
                  caption="forwards around position 4096")
ok_row = cl[cl.ok].iloc[-1]
bad_row = cl[~cl.ok].iloc[0]
print(w.finding(
    "limit", "index_pos {ok} runs, index_pos {bad} fails with \"{err}\", although the file's "
    "llama.context_length is {ctx}.", table="context_limit", ok=int(ok_row.index_pos),
    bad=int(bad_row.index_pos), err=bad_row.error, ctx=b.loc["file as is", "context_length"]))
w.seed_reference("limit_error", "error at index_pos 4096",
                 "Err(narrow invalid args start + len > dim_len: [4096, 32], dim: 0, start: 4096, "
                 "len:1)", ours=bad_row.error, source=SEED_SOURCE)
cl

# %% [markdown]
# ## The relabelled file on another device
#
# With a GPU beside the CPU, the file as is and the relabelled one generate there too. The CPU's
# quantized form quantizes activations and the GPU's does not, so texts may part for that reason
# alone (notebook 6 measures it).

# %%
other = compare_device
if compare_device == "auto":
    other = gpu_device() if device == "cpu" else "cpu"
if not other:
    print(w.skipped("generation on a GPU", "no GPU (CUDA or MPS) on this machine"))
else:
    two = {k: specs[k] for k in ("file as is", f"relabelled {relabel}")}
    others, _ = rope.load_variants(model_path, other, two, form=form)
    rows_o = rope.generation_rows(others, tok, prompt_ids, steps)
    here = {r["variant"]: r["ids"] for r in gen_rows}
    go = w.save_table([{"variant": r["variant"], "device": other, "text": r["text"],
                        "identical_to_" + device: r["ids"] == here[r["variant"]]}
                       for r in rows_o], "generation_other_device",
                      caption=f"greedy generation on {other}")
    print(w.finding("other_device", "On {other}, {n} of {m} generations are identical to "
                    "{device}'s.", table="generation_other_device", other=other,
                    n=int(go["identical_to_" + device].sum()), m=len(go), device=device))
    del others
