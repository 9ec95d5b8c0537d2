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
# # Self-quantize: safetensors -> GGUF, and what goes wrong
#
# Follows the seed chapter **自己量化 (self-quantize)**: instead of downloading a GGUF file,
# start from transformers' safetensors, rename the tensors to llama.cpp's names, permute the
# q/k rows, quantize each tensor, write the metadata `from_gguf` needs, and read it back.
# Here the "downloaded" safetensors folder is itself exported from the embedded SmolLM2 Q4_1
# file (the only weights on this machine), so the float32 reference is that file dequantized.
# We measure byte identity with gguf-py and llama.cpp, the failure cases (no metadata, no
# `llama.rope.freq_base`, no q/k permutation), the K-quant fallback on SmolLM2's 576-wide
# rows, an error table against transformers float32 on the exported folder, torch's dynamic
# int8 quantization beside it, and whether a position's logits depend on the rest of the batch.

# %% tags=["parameters"]
model_path = None  # source GGUF; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # the experiment runs on the CPU; another device is recorded as skipped
work_dir = None  # exported folder and GGUF files; None: <models dir>/self_quantize/
variants = ["F32", "Q8_0", "Q4_0", "Q4_K", "Q4_K_M"]  # types or recipes written from safetensors
prompt = "What is Rust?"  # one user message in the chat template
gen_tokens = 64  # greedy continuation of the reference (first-divergence column)
teacher_tokens = 256  # teacher-forced positions of data/passage.txt
failure_tokens = 20  # greedy tokens generated for the failure cases
form = "f32"  # qlib QMatMul form of the error table ("f32": weights dequantized once)
cpu_quantized = ["Q8_0"]  # also scored on qlib's CPU quantized path (activations quantized; slow)
gguf_py_types = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # byte identity with gguf-py
llama_cpp_types = ["Q8_0", "Q4_K_M"]  # compared with llama.cpp's own llama_model_quantize
torch_engines = ["x86", "qnnpack"]  # torch.ao dynamic int8 with these quantized engines ([]: skip)

# %%
import time
from pathlib import Path

import pandas as pd
import torch
from IPython.display import display

from qlib import models
from qlib.convert import gguf_to_hf, hf_to_gguf
from qlib.suite import plots
from qlib.suite.experiments import self_quantize as sq
from qlib.suite.experiments.common import build, teacher_forced_logits
from qlib.suite.results import ResultWriter
from qlib.tokenizer import Tokenizer

plots.style()
t_start = time.perf_counter()
model_path = str(model_path or models.path())
work = Path(work_dir) if work_dir else models.models_dir() / "self_quantize"
work.mkdir(parents=True, exist_ok=True)
w = ResultWriter("08_self_quantize", params=dict(
    model_path=model_path, device=device, work_dir=str(work), variants=variants, prompt=prompt,
    gen_tokens=gen_tokens, teacher_tokens=teacher_tokens, failure_tokens=failure_tokens,
    form=form, cpu_quantized=cpu_quantized, gguf_py_types=gguf_py_types,
    llama_cpp_types=llama_cpp_types, torch_engines=torch_engines))
section_s = {}
if device != "cpu":
    print(w.skipped(f"runs on {device}", "conversion and the error table run on the CPU"))
tok = Tokenizer.from_gguf(model_path)
prompt_ids = tok.encode(tok.chat_prompt(prompt))
passage = models.data_file("passage.txt").read_text(encoding="utf-8")
passage_ids = tok.encode(passage)[:teacher_tokens]
section_s["setup"] = time.perf_counter() - t_start
print(f"prompt {len(prompt_ids)} tokens, passage {len(passage_ids)} tokens, work dir {work}")

# %% [markdown]
# ## 1. GGUF -> safetensors: the reference folder
#
# `gguf_to_hf` dequantizes every tensor to float32, renames it to transformers' name, puts the
# q/k rows back in transformers' order and writes `config.json` (from the `llama.*` keys) and the
# tokenizer files (qlib's tokenizer saved as `tokenizer.json`, the chat template in
# `tokenizer_config.json`). transformers loads the folder offline; its float32 logits are the
# reference for everything below.

# %%
t_sec = time.perf_counter()
export = gguf_to_hf(model_path, work / "hf", log=print)
hf_tok, hf_model = sq.load_hf(export.path)
hf_ids = hf_tok(passage)["input_ids"][:teacher_tokens]
hf_prompt = hf_tok.apply_chat_template([{"role": "user", "content": prompt}],
                                       add_generation_prompt=True, tokenize=False)
t0 = time.perf_counter()
ref = sq.reference(hf_model, prompt_ids, passage_ids, gen_tokens)
ref_s = time.perf_counter() - t0
src, _ = build(model_path, "cpu", form="f32")
src_row = sq.score("source GGUF (qlib f32 form)", teacher_forced_logits(src, ref.seq_ids),
                   teacher_forced_logits(src, passage_ids), ref, Path(model_path).stat().st_size)
del src
export_rows = [dict(
    folder=str(export.path), tensors=len(export.tensors), safetensors_bytes=export.nbytes,
    files=", ".join(export.files), export_s=export.seconds, same_token_ids=hf_ids == passage_ids,
    same_chat_prompt=hf_prompt == tok.chat_prompt(prompt), reference_s=ref_s,
    qlib_vs_transformers_step0=src_row["step0_max_diff"], qlib_vs_transformers_tf_max=src_row["tf_max_diff"],
    argmax_agree=src_row["argmax_agree"], positions=src_row["positions"], max_abs_ref=ref.max_abs)]
w.save_table(export_rows, "export", key=True,
             caption="the exported folder: transformers vs qlib's f32 form of the source file")
section_s["export_and_reference"] = time.perf_counter() - t_sec
print("reference continuation:", repr(tok.decode(ref.continuation)))
pd.DataFrame(export_rows).T

# %% [markdown]
# ## 2. safetensors -> GGUF: types, recipes, fallbacks, failure options
#
# `hf_to_gguf` maps the names (`model.layers.{i}.self_attn.q_proj.weight` ->
# `blk.{i}.attn_q.weight`, ...; `lm_head` is tied, so no `output.weight`), permutes q (9 heads)
# and k (3 KV heads), quantizes, and writes the 8 keys `from_gguf` reads plus the context
# length, feed-forward length, vocab size, file type and tokenizer keys. K-quants need rows
# divisible by 256; SmolLM2's rows are 576 (attention, gate, up) or 1536 (`ffn_down`), so most
# matrices fall back (Q4_K -> Q5_0, Q6_K -> Q8_0, as llama.cpp does). The last three files
# reproduce the failure cases: no q/k permutation, no `llama.rope.freq_base`, no metadata.

# %%
specs = {v: dict(spec=v) for v in variants}
specs["Q8_0 no permute"] = dict(spec="Q8_0", permute_qk=False)
specs["Q8_0 no freq_base"] = dict(spec="Q8_0", drop_keys=["llama.rope.freq_base"])
specs["Q8_0 no metadata"] = dict(spec="Q8_0", metadata=False)
reports = {}
t_sec = time.perf_counter()
for name, kw in specs.items():
    out = work / ("own." + name.replace(" ", "_") + ".gguf")
    print(f"-- {name}")
    reports[name] = hf_to_gguf(export.path, out, **kw, log=print)
files = pd.DataFrame([dict(
    file=name, bytes=r.nbytes, tensors=len(r.choices),
    types=", ".join(f"{t} {n}" for t, n in r.type_counts().items()),
    fallbacks=len(r.fallbacks), metadata_keys=len(r.metadata_keys), permuted=r.permuted,
    seconds=r.seconds) for name, r in reports.items()])
section_s["write_gguf"] = time.perf_counter() - t_sec
w.save_table(files, "files", key=True, caption="GGUF files written from the safetensors folder")
files

# %%
plans = {}
for name in [v for v in variants if v in ("Q4_K", "Q4_K_M")] or list(variants)[-1:]:
    plans[name] = pd.DataFrame(sq.plan_table(reports[name].choices))
    w.save_table(plans[name], f"plan_{name}", key=True,
                 caption=f"{name}: the type of each tensor kind (wanted by the rule, written)")
    print(name)
    display(plans[name])

# %% [markdown]
# ## 3. Byte comparisons
#
# Our quantizer against gguf-py's (`gguf.quants.quantize`) on every matrix of the F32 file,
# then our files against llama.cpp's own `llama_model_quantize` of the same F32 file (types
# chosen and bytes written, tensor by tensor, as the seed's `qcmp`), the source file
# re-quantized to its own types, and the Q8_0 file without the q/k permutation.

# %%
f32_file = reports["F32"].path if "F32" in reports else hf_to_gguf(export.path, work / "own.F32.gguf", "F32").path
t_sec = time.perf_counter()
ident = pd.DataFrame(sq.gguf_py_identity(f32_file, gguf_py_types))
ident["all_identical"] = ident["identical"] == ident["tensors"]
w.save_table(ident, "gguf_py_identity", key=True,
             caption="qlib.quants.quantize vs gguf.quants.quantize, every matrix of the F32 file")
ident

# %%
cmp_rows = []
try:
    import llama_cpp  # noqa: F401
except ImportError:
    print(w.skipped("llama.cpp comparison", "llama_cpp (llama-cpp-python) is not installed"))
else:
    for t in llama_cpp_types:
        theirs, llama_log = sq.llama_cpp_quantize(f32_file, work / f"llama_cpp.{t}.gguf", t)
        print(f"llama.cpp {t}:", *llama_log, sep="\n  ")
        ours = reports.get(t) or hf_to_gguf(export.path, work / f"own.{t}.gguf", t)
        for r in sq.compare_gguf(ours.path, theirs):
            cmp_rows.append(dict(comparison=f"ours {t} vs llama.cpp {t}", **r))
for r in sq.compare_gguf(reports["Q8_0 no permute"].path, reports["Q8_0"].path):
    cmp_rows.append(dict(comparison="Q8_0 no permute vs Q8_0", **r))
cmp = pd.DataFrame(cmp_rows)
w.save_table(cmp, "compare", caption="tensor-by-tensor comparison, grouped by tensor kind and types")
summary = (cmp.assign(same_type=cmp.type_a == cmp.type_b)
           .groupby("comparison", sort=False)
           .agg(tensors=("tensors", "sum"), same_type=("same_type", lambda s: int(cmp.loc[s.index[s], "tensors"].sum())),
                identical=("identical", "sum"), bytes_differ=("bytes_differ", "sum"))
           .reset_index())
w.save_table(summary, "compare_summary", key=True, caption="identical tensors per comparison")
summary

# %%
requant = pd.DataFrame(sq.requantize_identity(model_path))
w.save_table(requant, "requantize_source", caption="each source tensor dequantized and quantized again to its own type")
section_s["byte_comparisons"] = time.perf_counter() - t_sec
requant

# %% [markdown]
# ## 4. The failure cases
#
# No metadata: `from_gguf` stops at the first key it needs. No `llama.rope.freq_base`: no error,
# RoPE silently uses 10000 instead of SmolLM2's 100000. No q/k permutation: no error either,
# the pairs RoPE rotates are the wrong ones and the text is nonsense. Greedy generation of
# `failure_tokens` tokens for the chat prompt, beside the reference's first tokens.

# %%
t_sec = time.perf_counter()
fail_rows = [dict(case="reference (transformers f32)", loads=True, error="",
                  rope_freq_base=hf_model.config.rope_parameters["rope_theta"],
                  text=tok.decode(ref.continuation[:failure_tokens]))]
scored, kept = {}, {}
for name in ["Q8_0 no freq_base", "Q8_0 no permute", "Q8_0 no metadata"]:
    r = reports[name]
    row = dict(case=name, metadata_keys=len(r.metadata_keys), permuted=r.permuted)
    try:
        scored[name], model, _ = sq.evaluate_gguf(f"own {name}", r.path, ref, form, keep=True, engine="qlib")
    except Exception as e:  # the failure case's error text is the result
        fail_rows.append(dict(row, loads=False, error=f"{type(e).__name__}: {e}"))
        continue
    g = sq.greedy_text(model, tok, prompt_ids, failure_tokens)
    agree = next((i for i, (a, b) in enumerate(zip(g["ids"], ref.continuation, strict=False)) if a != b), failure_tokens)
    fail_rows.append(dict(row, loads=True, error="", rope_freq_base=g["rope_freq_base"], text=g["text"],
                          agrees_for=agree))
    del model
fails = pd.DataFrame(fail_rows)
section_s["failure_cases"] = time.perf_counter() - t_sec
w.save_table(fails, "failures", key=True, caption=f"failure cases: load error or {failure_tokens} greedy tokens")
with pd.option_context("display.max_colwidth", 200):
    display(fails)

# %% [markdown]
# ## 5. The error table
#
# Every file against the float32 reference. `step0_max_diff`: max |logit difference| at the
# last prompt position (`max_abs_ref` gives the scale); `tf_*` and `argmax_agree`: teacher
# forcing over the passage; `first_divergence`: the first generated token that differs from
# the reference's greedy continuation (computed by teacher forcing on that continuation).
# qlib runs in `form` (weights dequantized once: the error of the weights alone); the variants
# in `cpu_quantized` also run on qlib's CPU quantized path, where each activation row is
# quantized too, as ggml does. torch's `quantize_dynamic` replaces every `nn.Linear` with an
# int8 one (one scale per weight tensor, activations quantized at run time with one scale per
# input); its size is that of its `state_dict`. Two engines: `x86` (fbgemm) quantizes activations
# with `reduce_range` (7 bits), `qnnpack` ignores it (its C++ warning is recorded), so it keeps
# 8 bits; the seed's Mac had only qnnpack. The last torch row keeps the int8 weights but not
# the activation quantization.

# %%
rows = [sq.score("transformers f32 (reference)", ref.seq_logits, ref.passage_logits, ref,
                 sq.state_dict_bytes(hf_model), engine="transformers", form="f32"), dict(src_row, engine="qlib", form="f32", model="source Q4_1 file")]
timing = {}
t_sec = time.perf_counter()
for name, r in reports.items():
    if name.endswith("no metadata"):
        continue
    for f in [form] + (["quantized"] if name in cpu_quantized else []):
        if f == form and name in scored:
            rows.append(scored[name])
            continue
        t0 = time.perf_counter()
        keep = f == "quantized" or (name == "F32" and f == "f32")
        row, model, seq = sq.evaluate_gguf(f"own {name}", r.path, ref, f, keep=keep, engine="qlib")
        timing[f"{name} {f}"] = time.perf_counter() - t0
        rows.append(row)
        if model is not None:
            kept[f"{name} {f}"] = (model, seq)
section_s["error_table_qlib"] = time.perf_counter() - t_sec
print({k: round(v, 1) for k, v in timing.items()})

# %%
t_sec = time.perf_counter()
engines = [e for e in torch_engines if e in torch.backends.quantized.supported_engines]
int8 = {}
for e in engines:
    qmodel, info = sq.torch_dynamic_int8(hf_model, e)
    seq = sq.int8_logits(qmodel, e, ref.seq_ids)
    int8[e] = (qmodel, info, seq)
    rows.append(sq.score(f"torch quantize_dynamic int8 ({e})", seq, sq.int8_logits(qmodel, e, passage_ids),
                         ref, sq.state_dict_bytes(qmodel), engine="torch", form=f"int8 dynamic, {e} engine"))
    w.save_json(info, f"torch_int8_{e}")
    for k, v in info.items():
        print(f"{e} {k}: {v}")
if int8:
    wonly = sq.int8_weights_only(hf_model, next(iter(int8.values()))[0])
    rows.append(sq.score("torch int8 weights, f32 activations", sq.hf_logits(wonly, ref.seq_ids),
                         sq.hf_logits(wonly, passage_ids), ref, None, engine="torch",
                         form="int8 per-tensor weights dequantized"))
    del wonly
else:
    print(w.skipped("torch dynamic int8", f"none of {torch_engines} in {torch.backends.quantized.supported_engines}"))
section_s["error_table_torch"] = time.perf_counter() - t_sec
errors = pd.DataFrame(rows)
errors["max_abs_ref"] = ref.max_abs
w.save_table(errors, "errors", key=True, caption="error against the transformers f32 reference")
errors.round(5)

# %%
ok = errors[errors.engine != "transformers"]
fig = plots.errors_figure(ok, max_ref=ref.max_abs, positions=len(passage_ids))
w.save_plot(fig, "errors", caption="logit error and argmax agreement per file / model",
            model=f"{Path(model_path).name} (the source of every file)")

# %% [markdown]
# ## 6. Batch dependence
#
# In a causal model the logits of the last prompt position depend only on the prompt. Computed
# twice, once with the prompt alone and once inside the prompt plus the reference continuation:
# qlib's CPU quantized path quantizes each activation row on its own (one scale per 32 or 256
# values of one token), torch's dynamic int8 uses one activation scale per input tensor, which
# the later tokens change. Float32 paths may differ at rounding level (their matmul kernels
# can block differently for different row counts); the quantized path's integer dots are exact
# and its float combination is done per row.

# %%
t_sec = time.perf_counter()
bd = [sq.batch_dependence("transformers f32", lambda ids: sq.hf_logits(hf_model, ids), prompt_ids, ref.seq_ids, ref.seq_logits)]
for e, (qmodel, _, seq) in int8.items():
    bd.append(sq.batch_dependence(f"torch int8 dynamic ({e})", lambda ids, qmodel=qmodel, e=e: sq.int8_logits(qmodel, e, ids), prompt_ids, ref.seq_ids, seq))
for name, (model, seq) in kept.items():
    label = f"qlib {name.replace(' quantized', '')} CPU quantized path" if name.endswith("quantized") else f"qlib {name} form"
    bd.append(sq.batch_dependence(label, lambda ids, model=model: teacher_forced_logits(model, ids), prompt_ids, ref.seq_ids, seq))
batch = pd.DataFrame(bd)
section_s["batch_dependence"] = time.perf_counter() - t_sec
w.save_table(batch, "batch_dependence", key=True,
             caption="last prompt position: prompt alone vs inside the whole sequence")
batch


# %% [markdown]
# ## Findings

# %%
def row(model, f=None):
    r = errors[(errors.model == model) & ((errors.form == f) if f else True)]
    return r.iloc[0] if len(r) else None

fb = reports["Q4_K"] if "Q4_K" in reports else None
if fb is not None:
    tc = fb.type_counts()
    w.finding("fallback", "With plain Q4_K only {k} of {n} matrices can be Q4_K (rows divisible by 256); "
              "{f} fall back to Q5_0.", table="files", k=tc.get("Q4_K", 0),
              n=sum(1 for c in fb.choices if len(c.shape) == 2), f=len(fb.fallbacks))
q8 = ident[ident.type == "Q8_0"]
if len(q8):
    q8 = q8.iloc[0]
    w.finding("gguf_py", "Our Q8_0 is byte-identical to gguf-py's for {s} of {n} matrices; all legacy types "
              "compared: {all_ok}.", table="gguf_py_identity", s=int(q8.identical), n=int(q8.tensors),
              all_ok="identical" if ident.all_identical.all() else "some differ")
for _, s in summary.iterrows():
    if s.comparison.startswith("ours"):
        w.finding(f"llama_cpp {s.comparison}", "{c}: {same} of {n} tensors get the same type and "
                  "{i} are byte-identical.", table="compare_summary", c=s.comparison, same=int(s.same_type),
                  n=int(s.tensors), i=int(s.identical))
f32r = row("own F32", form)
if f32r is not None:
    w.finding("f32", "The F32 GGUF written from safetensors differs from the transformers reference by "
              "{d:.2g} at the last prompt position; argmax agrees at {a} of {p} positions.",
              table="errors", d=f32r.step0_max_diff, a=int(f32r.argmax_agree), p=int(f32r.positions))
err_meta = fails[fails.case == "Q8_0 no metadata"].error.iloc[0]
w.finding("no_metadata", "Without metadata from_gguf fails: {e}", table="failures", e=err_meta)
nofb = row("own Q8_0 no freq_base", form)
if nofb is not None:
    w.finding("no_freq_base", "Without llama.rope.freq_base the file loads and silently uses 10000: argmax agrees "
              "at {a} of {p} positions, generation diverges at token {g}.", table="errors",
              a=int(nofb.argmax_agree), p=int(nofb.positions), g=int(nofb.first_divergence))
noperm = row("own Q8_0 no permute", form)
if noperm is not None:
    w.finding("no_permute", "Without the q/k permutation the file loads, argmax agrees at only {a} of {p} positions "
              "and generation diverges at token {g}.", table="errors", a=int(noperm.argmax_agree),
              p=int(noperm.positions), g=int(noperm.first_divergence))
q8r = row("own Q8_0", form)
for e in int8:
    ti = row(f"torch quantize_dynamic int8 ({e})")
    if q8r is not None:
        w.finding(f"q8_vs_torch_{e}", "Both 8-bit: Q8_0 is off by {q:.3f} at the last prompt position "
                  "({qb:.0f} MB), torch dynamic int8 with the {e} engine by {t:.3f} ({tb:.0f} MB); argmax "
                  "agreement {qa} vs {ta} of {p}.", table="errors", q=q8r.step0_max_diff, e=e,
                  t=ti.step0_max_diff, qb=q8r.bytes / 1e6, tb=ti.bytes / 1e6, qa=int(q8r.argmax_agree),
                  ta=int(ti.argmax_agree), p=int(ti.positions))
for _, b in batch.iterrows():
    w.finding(f"batch {b.model}", "{m}: the last prompt position computed alone vs inside {n} tokens differs by "
              "{d:.3g}.", table="batch_dependence", m=b.model, n=int(b.inside_tokens), d=b.max_diff)
total_s = time.perf_counter() - t_start
w.save_table([dict(part=k, seconds=v) for k, v in {**section_s, **{f"score {k}": v for k, v in timing.items()}, "total": total_s}.items()],
             "timing", caption="wall time of the notebook's parts and of each scored file")
for f in w.meta["findings"]:
    print(f["sentence"])
print(f"total {total_s:.0f} s")


# %% [markdown]
# ## The seed's figures, for reference only
#
# Measured with candle 0.11.0 and PyTorch 2.15 on an M2 Max, from the original bf16 weights
# (ours are re-quantized from Q4_1, so every number differs; the phenomena are what to compare).

# %%
def ours(model, col, f=None):
    r = row(model, f)
    return None if r is None or pd.isna(r[col]) else float(r[col])

SOURCE = "seed chapter 自己量化 (self-quantize)"
if fb is not None:
    w.seed_reference("q4k_fallback", "plain Q4_K: tensors that fall back to Q5_0", 181,
                     ours=len(fb.fallbacks), unit="tensors", source=SOURCE + ", step 3")
w.seed_reference("f32_step0", "own F32 GGUF vs reference, last prompt position", 4.39e-5,
                 ours=ours("own F32", "step0_max_diff", form), unit="max |diff|", source=SOURCE + ", table (CPU)")
w.seed_reference("q8_step0_cpu", "own Q8_0, CPU quantized path, last prompt position", 0.718,
                 ours=ours("own Q8_0", "step0_max_diff", "quantized"), unit="max |diff|", source=SOURCE + ", table (CPU)")
w.seed_reference("q8_step0_gpu", "own Q8_0, no activation quantization (seed: Metal)", 0.416,
                 ours=ours("own Q8_0", "step0_max_diff", form), unit="max |diff|", source=SOURCE + ", table (Metal)")
w.seed_reference("noperm_first", "Q8_0 without q/k permutation: first diverging token", 2,
                 ours=ours("own Q8_0 no permute", "first_divergence", form), unit="token", source=SOURCE + ", table")
w.seed_reference("nofreq_argmax", "Q8_0 without freq_base: argmax agreement", "215/270",
                 ours=f"{int(nofb.argmax_agree)}/{int(nofb.positions)}" if nofb is not None else None,
                 source=SOURCE + ", table")
if int8:
    e = "qnnpack" if "qnnpack" in int8 else next(iter(int8))  # the seed's engine when we have it
    w.seed_reference("torch_int8_step0", f"torch quantize_dynamic int8 ({e}), last prompt position", 6.892,
                     ours=ours(f"torch quantize_dynamic int8 ({e})", "step0_max_diff"), unit="max |diff|",
                     source=SOURCE + ", PyTorch: quantize_dynamic (qnnpack)")
    w.seed_reference("torch_int8_bytes", "torch int8 dynamic state_dict", 249019179,
                     ours=ours(f"torch quantize_dynamic int8 ({e})", "bytes"), unit="bytes", source=SOURCE + ", PyTorch")
    w.seed_reference("torch_int8_weights", "torch int8 weights only, f32 activations, last prompt position",
                     2.649, ours=ours("torch int8 weights, f32 activations", "step0_max_diff"),
                     unit="max |diff|", source=SOURCE + ", ao_split.py")
    b = batch[batch.model == f"torch int8 dynamic ({e})"]
    w.seed_reference("torch_int8_batch", "torch int8 dynamic: prompt alone vs whole sequence", 6.637,
                     ours=float(b.max_diff.iloc[0]) if len(b) else None, unit="max |diff|", source=SOURCE + ", 动脑筋答案")
pd.DataFrame(w.meta["seed_references"])
