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
# # Generate one token: every phase timed
#
# Follows the seed chapter *generate one token* (001). One round does what the seed's
# program does from opening the file on: read the GGUF header (`Content.read`), build the
# model (`ModelWeights.from_gguf`), prefill the chat prompt at position 0, then decode
# 20 tokens greedily, each step ending with the token read back to the host; several rounds
# run in one process, so the first round can be told apart from the later ones. You will see
# how many small reads the header takes and what an unbuffered file costs against a buffered
# one, a table of rounds × phases, the time of every decode step, the generated text, and,
# with `device` set to a GPU, the same rounds on the GPU beside the CPU. torch runs on one CPU
# thread by default (`threads`): on a small, shared machine more threads mostly wait for each
# other (notebook 02 measures this).

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps; on a GPU the CPU rounds run too, for comparison
prompt = "What is Rust?"  # the user's message, wrapped in the chat template
system_prompt = False  # True: keep the template's default system message (longer prompt)
steps = 20  # decode steps after the prefill
rounds = 3  # rounds in this one process
form = None  # QMatMul form: None (the engine's default), "quantized", "f32" or "f16"
threads = 1  # torch CPU threads; None: torch's default (notebook 02 compares thread counts)
seed = 0

# %%
import os

import pandas as pd
import torch

from qlib import models
from qlib.suite import plots
from qlib.suite.experiments import phases
from qlib.suite.experiments.common import chat_ids
from qlib.suite.results import SEED_LABEL, ResultWriter
from qlib.tokenizer import Tokenizer

plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
if threads:
    torch.set_num_threads(threads)
devices = ["cpu"] if device == "cpu" else ["cpu", device]
w = ResultWriter("01_generate_one_token", params=dict(
    model_path=model_path, device=device, prompt=prompt, system_prompt=system_prompt,
    steps=steps, rounds=rounds, form=form, threads=threads, seed=seed))
tokenizer = Tokenizer.from_gguf(model_path)
prompt_ids = chat_ids(tokenizer, prompt, system=system_prompt)
print(f"{len(prompt_ids)} prompt tokens; devices {devices}; form {form or 'engine default'}; "
      f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")

# %% [markdown]
# ## The header: many small reads
#
# `Content.read` parses the magic, the metadata (here the whole vocabulary: every token string,
# every merge rule, every token type) and the tensor directory, value by value. Through an
# unbuffered file each of those reads is a system call; a buffered file turns them into a few
# large ones. The data of the tensors is not read here.

# %%
reads = phases.header_reads(model_path)
w.save_table([reads], "header_reads", caption="reads Content.read issues for the header")
pd.DataFrame([reads])

# %% [markdown]
# ## Rounds × phases
#
# Each round reads the header twice (unbuffered, then buffered: the model is built from the
# buffered read), builds the model, prefills, and decodes `steps` tokens without stopping at
# EOS. `generate_ms` is the prefill plus all decode steps, the seed's "total".

# %%
all_rounds = []
for dev in devices:
    for r in phases.run_rounds(model_path, prompt_ids, steps, rounds, device=dev, form=form):
        all_rounds.append(r)
        x = r.row()
        print(f"[{dev} round {r.round}] read gguf {x['read_unbuffered_ms']:.1f} ms "
              f"(buffered {x['read_buffered_ms']:.1f} ms), build model {x['build_ms']:.1f} ms, "
              f"prefill ({len(prompt_ids)} tokens) {x['prefill_ms']:.1f} ms, {steps} decode steps "
              f"{x['decode_total_ms']:.1f} ms (mean {x['decode_mean_ms']:.1f} ms), "
              f"total {x['generate_ms']:.1f} ms")
rows = pd.DataFrame([r.row() for r in all_rounds])
rows["load_1min"] = os.getloadavg()[0]
w.save_table(rows, "rounds", key=True, caption="phase times (ms) per round, all rounds in one process")
rows.round(1)

# %%
steps_df = w.save_table(phases.step_rows(all_rounds), "decode_steps",
                        caption="ms of each decode step, per round")
fig = plots.decode_steps_figure(steps_df, devices)
w.save_plot(fig, "decode_steps", caption="time of every decode step, one line per round, one y "
            "axis for every device")

# %%
parts = {"read unbuffered": "read_unbuffered_ms", "read buffered": "read_buffered_ms",
         "build": "build_ms", "prefill": "prefill_ms", f"{steps} decode steps": "decode_total_ms"}
fig = plots.phases_figure(rows, parts)
w.save_plot(fig, "phases", caption="every phase of every round (ms, totals), the header read "
            "both ways")

# %%
texts = pd.DataFrame([{"device": r.device, "round": r.round, "tokens": len(r.ids),
                       "text": tokenizer.decode(r.ids)} for r in all_rounds])
w.save_table(texts, "text", caption="generated text (prefill token + decode steps), per round")
print(repr(texts.text.iloc[0]))
texts

# %% [markdown]
# ## Findings

# %%
cpu = rows[rows.device == "cpu"]
ratio = (cpu.read_unbuffered_ms / cpu.read_buffered_ms).median()
print(w.finding(
    "read", "Reading the header through an unbuffered file took {ratio:.1f}x as long as through "
    "a buffered one (median over {n} CPU rounds: {u:.0f} vs {b:.0f} ms); the parser issues "
    "{reads:,} reads for a {mb:.1f} MB header.", table="rounds", ratio=ratio, n=len(cpu),
    u=cpu.read_unbuffered_ms.median(), b=cpu.read_buffered_ms.median(), reads=reads["reads"],
    mb=reads["header_bytes"] / 1e6))
for dev in devices:
    d = rows[rows.device == dev].to_dict("records")
    if len(d) > 1:
        g = phases.first_vs_later(d, "generate_ms")
        b = phases.first_vs_later(d, "build_ms")
        print(w.finding(
            f"first_round_{dev}", "On {dev}, round 1 generated its {n} tokens in {first:.0f} ms "
            "against {later:.0f} ms on average in rounds 2-{last} ({ratio:.2f}x); building the "
            "model took {bf:.0f} ms against {bl:.0f} ms.", table="rounds", dev=dev, n=steps + 1,
            first=g["first"], later=g["later"], ratio=g["ratio"], last=rounds, bf=b["first"],
            bl=b["later"]))
    s = steps_df[steps_df.device == dev]
    r1 = s[s["round"] == 1]
    print(w.finding(
        f"decode_{dev}", "On {dev}, a decode step took {med:.1f} ms (median over all rounds); "
        "round 1's first decode step took {first:.1f} ms.", table="decode_steps", dev=dev,
        med=s.ms.median(), first=r1.ms.iloc[0]))
agree = phases.text_agreement(all_rounds)
within = "the same text" if agree["same_within_device"] else "NOT always the same text"
print(w.finding(
    "text", "Every device's {n} rounds generated {within}; the first CPU round reads {text!r}.",
    table="text", n=rounds, within=within, text=texts.text.iloc[0]))
for dev, k in agree["first_difference"].items():
    if dev != "cpu":
        print(w.finding(
            f"text_{dev}", "On {dev} the generated text {how} (the CPU quantizes activations "
            "as ggml does, the GPU multiplies them unquantized).", table="text", dev=dev,
            how="equals the CPU's" if k is None else f"first differs from the CPU's at generated "
            f"token {k}"))

# %% [markdown]
# ## Seed figures beside ours
#
# References only: the seed measured a Q8_0 file (the same vocabulary, so the same header
# size) with candle 0.11.0 on an M2 Max; the numbers come from the chapter's printed log.

# %%
c1 = cpu[cpu["round"] == 1].iloc[0]
src = "chapter 001 (generate one token), [cpu round 1] and meta log"
w.seed_reference("read_unbuffered", "Content::read on the File (unbuffered)", 130.0,
                 ours=c1.read_unbuffered_ms, unit="ms", source=src)
w.seed_reference("read_buffered", "Content::read via BufReader", 31.4,
                 ours=c1.read_buffered_ms, unit="ms", source=src)
w.seed_reference("prefill_cpu", "CPU prefill of the 13-token chat prompt, round 1", 35.5,
                 ours=c1.prefill_ms, unit="ms", source=src)
w.seed_reference("decode_cpu", "CPU decode, mean of 20 steps, round 1", 8.5,
                 ours=c1.decode_mean_ms, unit="ms/token", source=src)
if device != "cpu":
    g2 = rows[(rows.device == device) & (rows["round"] == 2)]
    if len(g2):
        w.seed_reference("decode_gpu_warm", "GPU decode, mean of 20 steps, round 2 (Metal)", 2.6,
                         ours=g2.decode_mean_ms.iloc[0], unit="ms/token",
                         source="chapter 001, [metal round 2], warm cache")
else:
    print(w.skipped("GPU rounds", "device='cpu': run with device='cuda' (or mps) to time the "
                    "same rounds on a GPU beside the CPU"))
pd.DataFrame(w.meta["seed_references"])[["what", "seed", "ours", "unit"]].rename(
    columns={"seed": SEED_LABEL})
