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
# # index_pos misuse
#
# Follows the seed chapter **量化 llama 的一次前向 (one forward of quantized llama)**, section
# "index_pos 传错" and "换 prompt 要不要 clear_kv_cache". `forward(x, index_pos)` trusts the caller:
# `index_pos` picks the RoPE rows, sizes the causal mask (`kv_len = index_pos + seq_len`) and, when
# 0, drops the KV cache; nothing checks it against what the cache holds. You will see four greedy
# decodes of the chat prompt side by side (index_pos correct, +100, -3, always 0; the prefill is
# always right) with repetition measures, a chunked prefill whose second chunk gets a wrong
# index_pos (a broadcast error that never names index_pos; qlib's `strict=True` names it), and
# the four `clear_kv_cache` cases of changing prompts.

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps
form = None  # QMatMul form: None for the engine default (quantized), or f32, f16
prompt = "What is Rust?"  # user message, rendered with the file's chat template
prompt2 = "What is Python?"  # the second conversation of the clear_kv_cache cases
steps = 20  # tokens generated per run
split = None  # chunked prefill: tokens in the first chunk (None: two thirds of the prompt)
compare_device = "auto"  # also decode on this device; auto: a GPU beside the CPU; None: no
seed = 0

# %%
import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.devices import gpu_device
from qlib.suite import plots
from qlib.suite.experiments import index_pos as ip
from qlib.suite.experiments.common import build, chat_ids
from qlib.suite.results import ResultWriter

pd.set_option("display.max_colwidth", 120)
plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
w = ResultWriter("04_index_pos_misuse", params=dict(
    model_path=model_path, device=device, form=form, prompt=prompt, prompt2=prompt2,
    steps=steps, split=split, compare_device=compare_device, seed=seed))
SEED_SOURCE = "chapter 'one forward of quantized llama', section 'index_pos 传错'"

model, tok = build(model_path, device, form=form)
prompt_ids, prompt2_ids = chat_ids(tok, prompt), chat_ids(tok, prompt2)
print(f"{len(prompt_ids)}-token prompt, QMatMul form {model.output.form!r}, device {device}")

# %% [markdown]
# ## Decoding with a wrong index_pos
#
# Prefill at 0 (correct), then every decode step passes `f(pos)` instead of `pos`. `distinct_tokens`,
# `repetition` (1 - distinct / generated) and `longest_run` (one token back to back) measure
# degeneration; `agrees_with_correct_for` counts the leading tokens equal to the correct run.

# %%
rows = ip.decode_variants(model, tok, prompt_ids, steps)
dv = w.save_table([{k: v for k, v in r.items() if k != "ids"} for r in rows], "decode_variants",
                  key=True, caption=f"greedy decode of {steps} tokens per index_pos variant")
w.save_json({r["variant"]: r["ids"] for r in rows}, "decode_variant_ids")
dv

# %%
fig, axes = plt.subplots(1, 2, figsize=(8, 2.8))
for ax, col, label in zip(axes, ["distinct_tokens", "longest_run"],
                          ["distinct tokens", "longest run of one token"], strict=True):
    plots.bar_labels(ax, ax.bar(dv["variant"], dv[col], color=["#4c72b0", "#c44e52", "#dd8452",
                                                             "#c44e52"]), "{:.0f}")
    ax.axhline(steps, color="#999", lw=0.8, ls=":")
    ax.set_title(f"{label} (of {steps})", fontsize=9)
fig.tight_layout()
w.save_plot(fig, "decode_variants", caption="degeneration per decode index_pos variant")

# %%
v = dv.set_index("variant")
c, p100, z, m3 = (v.loc[k] for k in ["correct", "+100", "always 0", "-3"])
print(w.finding(
    "degenerate", "index_pos +100 and always 0 degenerate: {d100} and {d0} distinct tokens of "
    "{n} (longest runs {r100} and {r0}), against {dc} distinct for the correct index_pos.",
    table="decode_variants", d100=int(p100.distinct_tokens), d0=int(z.distinct_tokens),
    n=steps, r100=int(p100.longest_run), r0=int(z.longest_run), dc=int(c.distinct_tokens)))
print(w.finding(
    "minus3", "index_pos -3 stays plausible ({d} distinct tokens, longest run {r}) but "
    "{how}.", table="decode_variants", d=int(m3.distinct_tokens), r=int(m3.longest_run),
    how=("is identical to the correct text" if m3.identical_to_correct else
         f"leaves the correct text at generated token {int(m3.agrees_with_correct_for) + 1}")))
seed_texts = {  # the seed's outputs (candle 0.11.0, CPU), shown only as a reference
    "correct": "Rust is a modern, high-performance, and object-oriented programming language "
               "developed by Brian K",
    "+100": "RRRRRRRRRRRRRRRRRRRR",
    "-3": "R\nRust is a modern, object-oriented programming language developed by the Rust "
          "initiative, which",
    "always 0": "R\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
}
for name, text in seed_texts.items():
    w.seed_reference(f"text_{name}", f"decode text, index_pos {name}", text,
                     ours=v.loc[name, "text"], source=SEED_SOURCE)

# %% [markdown]
# ## Chunked prefill with a wrong index_pos
#
# The prompt is sent in two chunks. The second is passed the length of the chunk itself (a counter
# of tokens sent now, not of positions cached) and then the right value, the first chunk's length.
# The mask is built for `kv_len = index_pos + len(chunk 2)`, the cache holds `split + len(chunk 2)`
# after the cat. The last row repeats the wrong call with qlib's `strict=True`.

# %%
split_at = split or len(prompt_ids) * 2 // 3
wrong = len(prompt_ids) - split_at
if wrong == split_at:  # the wrong value must differ from the right one
    split_at += 1
    wrong -= 1
cp = w.save_table([
    ip.chunked_prefill(model, tok, prompt_ids, split_at, wrong),
    ip.chunked_prefill(model, tok, prompt_ids, split_at, split_at),
    ip.chunked_prefill(model, tok, prompt_ids, split_at, wrong, strict=True),
], "chunked_prefill", key=True, caption="prefill in two chunks: the second at a wrong and the "
   "right index_pos, then the wrong one in strict mode")
# cp

# %%
bad, good, strict_row = cp.iloc[0], cp.iloc[1], cp.iloc[2]
print(w.finding(
    "chunk_error", "With index_pos {wrong} instead of {right} the second chunk fails with "
    "\"{error}\" (mask kv_len {mkv}, cache {ckv}), which {mention} index_pos; with {right} it "
    "runs ({ok}).", table="chunked_prefill", wrong=int(bad.index_pos), right=int(good.index_pos),
    error=bad.error or "no error", mkv=int(bad.mask_kv_len), ckv=int(bad.cache_kv_len),
    mention="mentions" if bad.error_mentions_index_pos else "never mentions",
    ok=f"next token {good.next_token!r}" if good.ok else good.error))
print(w.finding(
    "strict", "strict=True turns the same call into \"{error}\".", table="chunked_prefill",
    error=strict_row.error or "no error"))
w.seed_reference("chunk_error", "error of the second chunk at a wrong index_pos",
                 "Err(cannot broadcast [5, 10] to [1, 9, 5, 13])", ours=bad.error,
                 source=SEED_SOURCE + " (8 + 5 tokens, index_pos 5)")

# %% [markdown]
# ## Changing prompts: the four clear_kv_cache cases
#
# Prompt 1 is answered for `steps` tokens, then prompt 2 is answered in four ways. `index_pos == 0`
# drops the old cache by itself, so forgetting `clear_kv_cache` changes nothing; clearing the cache
# but keeping the counter is what fails.

# %%
ck = w.save_table(ip.clear_kv_cases(model, tok, prompt_ids, prompt2_ids, steps),
                  "clear_kv_cache", key=True,
                  caption="answering prompt 2 after prompt 1, with and without clear_kv_cache")
ck

# %%
fresh, noclear, cont, cleared = (ck.iloc[i] for i in range(4))
print(w.finding(
    "clear_cases", "Without clear_kv_cache but at index_pos 0 the answer is {same} a fresh "
    "model's; continuing at {pos} {cont}; clearing the cache but keeping index_pos {pos} "
    "{err}.", table="clear_kv_cache",
    same="identical to" if noclear.same_as_fresh else "different from",
    pos=int(cont.index_pos),
    cont=("also gives the fresh answer" if cont.same_as_fresh else
          "answers differently" if cont.ok else f"fails ({cont.error})"),
    err=f"fails with \"{cleared.error}\"" if not cleared.ok else "runs"))
w.seed_reference("clear_error", "error when clearing the cache but keeping index_pos",
                 "Error: cannot broadcast [13, 46] to [1, 9, 13, 13]", ours=cleared.error,
                 source="chapter 'one forward of quantized llama', section 'clear_kv_cache'")

# %% [markdown]
# ## The same decodes on another device
#
# The seed found the GPU's (Metal's) texts identical to the CPU's. With a GPU beside the CPU the
# four decodes run there too. The CPU's quantized form quantizes activations and the GPU's does not,
# so texts may part for that reason alone (notebook 6 measures it).

# %%
other = compare_device
if compare_device == "auto":
    other = gpu_device() if device == "cpu" else "cpu"
if not other:
    print(w.skipped("decode variants on a GPU", "no GPU (CUDA or MPS) on this machine"))
else:
    model_o, _ = build(model_path, other, form=form)
    rows_o = ip.decode_variants(model_o, tok, prompt_ids, steps)
    same = {r["variant"]: r["ids"] for r in rows}
    do = w.save_table([{"variant": r["variant"], "device": other, "text": r["text"],
                        "identical_to_" + device: r["ids"] == same[r["variant"]]}
                       for r in rows_o], "decode_variants_other_device",
                      caption=f"the four decodes on {other}")
    n_same = int(do["identical_to_" + device].sum())
    print(w.finding("other_device", "On {other}, {n} of 4 decodes are identical to {device}'s.",
                    table="decode_variants_other_device", other=other, n=n_same, device=device))
    del model_o
