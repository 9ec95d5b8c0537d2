"""Write notebooks 01-03 (outputs cleared) with nbformat."""

import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

OUT = sys.argv[1] if len(sys.argv) > 1 else "notebooks"


def nb(cells):
    book = new_notebook()
    book.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    out = []
    for kind, src in cells:
        src = src.strip("\n")
        if kind == "md":
            out.append(new_markdown_cell(src))
        elif kind == "params":
            c = new_code_cell(src)
            c.metadata["tags"] = ["parameters"]
            out.append(c)
        else:
            out.append(new_code_cell(src))
    book.cells = out
    for i, c in enumerate(book.cells):
        c["id"] = f"c{i:02d}"
    return book


# ----------------------------------------------------------------------------- 01
NB01 = [
    (
        "params",
        """
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps; on a GPU the CPU rounds run too, for comparison
prompt = "What is Rust?"  # the user's message, wrapped in the chat template
system_prompt = False  # True: keep the template's default system message (longer prompt)
steps = 20  # decode steps after the prefill
rounds = 3  # rounds in this one process
form = None  # QMatMul form: None (the engine's default), "quantized", "f32" or "f16"
threads = 1  # torch CPU threads; None: torch's default (notebook 02 compares thread counts)
seed = 0
""",
    ),
    (
        "md",
        """
# Generate one token: every phase timed

Follows the seed chapter *generate one token* (001). One round does what the seed's
program does from opening the file on: read the GGUF header (`Content.read`), build the
model (`ModelWeights.from_gguf`), prefill the chat prompt at position 0, then decode
20 tokens greedily, each step ending with the token read back to the host; several rounds
run in one process, so the first round can be told apart from the later ones. You will see
how many small reads the header takes and what an unbuffered file costs against a buffered
one, a table of rounds × phases, the time of every decode step, the generated text, and,
with `device` set to a GPU, the same rounds on the GPU beside the CPU. torch runs on one CPU
thread by default (`threads`): on a small, shared machine more threads mostly wait for each
other (notebook 02 measures this).
""",
    ),
    (
        "code",
        """
import os

import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.experiments import phases
from qlib.results import SEED_LABEL, ResultWriter
from qlib.tokenizer import Tokenizer

model_path = str(model_path or models.path())
torch.manual_seed(seed)
if threads:
    torch.set_num_threads(threads)
devices = ["cpu"] if device == "cpu" else ["cpu", device]
w = ResultWriter("01_generate_one_token", params=dict(
    model_path=model_path, device=device, prompt=prompt, system_prompt=system_prompt,
    steps=steps, rounds=rounds, form=form, threads=threads, seed=seed))
tokenizer = Tokenizer.from_gguf(model_path)
prompt_ids = phases.chat_ids(tokenizer, prompt, system=system_prompt)
print(f"{len(prompt_ids)} prompt tokens; devices {devices}; form {form or 'engine default'}; "
      f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
""",
    ),
    (
        "md",
        """
## The header: many small reads

`Content.read` parses the magic, the metadata (here the whole vocabulary: every token string,
every merge rule, every token type) and the tensor directory, value by value. Through an
unbuffered file each of those reads is a system call; a buffered file turns them into a few
large ones. The data of the tensors is not read here.
""",
    ),
    (
        "code",
        """
reads = phases.header_reads(model_path)
w.save_table([reads], "header_reads", caption="reads Content.read issues for the header")
pd.DataFrame([reads])
""",
    ),
    (
        "md",
        """
## Rounds × phases

Each round reads the header twice (unbuffered, then buffered: the model is built from the
buffered read), builds the model, prefills, and decodes `steps` tokens without stopping at
EOS. `generate_ms` is the prefill plus all decode steps, the seed's "total".
""",
    ),
    (
        "code",
        """
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
""",
    ),
    (
        "code",
        """
steps_df = w.save_table(phases.step_rows(all_rounds), "decode_steps",
                        caption="ms of each decode step, per round")
fig, axes = plt.subplots(1, len(devices), figsize=(5 * len(devices), 3), squeeze=False)
for ax, dev in zip(axes[0], devices, strict=True):
    d = steps_df[steps_df.device == dev]
    for rnd, g in d.groupby("round"):
        ax.plot(g.step, g.ms, marker="o", ms=3, label=f"round {rnd}")
    if d.ms.max() > 10 * d.ms.median():
        ax.set_yscale("log")
    ax.set(xlabel="decode step", ylabel="ms", title=f"{dev}: each decode step")
    ax.set_xticks(range(1, steps + 1, max(1, steps // 10)))
    ax.legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "decode_steps", caption="time of every decode step, one line per round")
""",
    ),
    (
        "code",
        """
parts = {"read unbuffered": "read_unbuffered_ms", "read buffered": "read_buffered_ms",
         "build": "build_ms", "prefill": "prefill_ms", "decode step (mean)": "decode_mean_ms",
         f"{steps} decode steps": "decode_total_ms"}
fig, ax = plt.subplots(figsize=(9, 3.2))
width = 0.8 / len(rows)
for i, (_, r) in enumerate(rows.iterrows()):
    xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(parts))]
    ax.bar(xs, [r[c] for c in parts.values()], width, label=f"{r.device} round {r['round']}")
ax.set_xticks(range(len(parts)), list(parts), fontsize=8)
ax.set(yscale="log", ylabel="ms (log scale)", title="phases of each round")
ax.legend(fontsize=7, ncol=2)
fig.tight_layout()
w.save_plot(fig, "phases", caption="every phase of every round, the header read both ways")
""",
    ),
    (
        "code",
        """
texts = pd.DataFrame([{"device": r.device, "round": r.round, "tokens": len(r.ids),
                       "text": tokenizer.decode(r.ids)} for r in all_rounds])
w.save_table(texts, "text", caption="generated text (prefill token + decode steps), per round")
print(repr(texts.text.iloc[0]))
texts
""",
    ),
    ("md", "## Findings"),
    (
        "code",
        """
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
""",
    ),
    (
        "md",
        """
## Seed figures beside ours

References only: the seed measured a Q8_0 file (the same vocabulary, so the same header
size) with candle 0.11.0 on an M2 Max; the numbers come from the chapter's printed log.
""",
    ),
    (
        "code",
        """
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
""",
    ),
]

# ----------------------------------------------------------------------------- 02
NB02 = [
    (
        "params",
        """
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
""",
    ),
    (
        "md",
        """
# One forward of quantized llama: spans, attention ops, threads

Follows the seed chapter *one forward of quantized llama* (000), its section on where the
time of a decode step goes. The engine marks its regions with candle's span names (`model`,
`output`, `attn`, `attn-rot`, `attn-mlp`, `qmatmul`, `rms-norm`); after a warm-up we record
count, total and self time per name for the prefill of the chat prompt and for decode step
20 (context 32), and check the counts against what the model's structure implies. Then one
attention layer is replayed op by op on random tensors of the model's shapes, at context 32
and 1024, exactly as `forward_attn` runs it (cat KV, repeat_kv, q·kᵀ, scale, softmax, att·v),
and with a preallocated cache and PyTorch's SDPA with GQA for contrast. Last, the same forward
with 1, 2 (and more, where there are more cores) threads, and on a GPU the time when `forward`
returns against the time after `synchronize`.
""",
    ),
    (
        "code",
        """
import os

import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.experiments import span_study
from qlib.experiments.common import build
from qlib.experiments.phases import chat_ids
from qlib.results import SEED_LABEL, ResultWriter

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
""",
    ),
    (
        "md",
        """
## Spans by name

*Self* time is a span's time minus the spans entered inside it: `attn`'s self time is the
attention without its four projections (`qmatmul`) and RoPE (`attn-rot`); `attn-mlp` holds
the FFN norm and the three MLP projections. The expected counts follow from the structure:
7 projections per block plus the output layer, 2 norms per block plus the final one, RoPE on
q and k in every block.
""",
    ),
    (
        "code",
        """
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
""",
    ),
    (
        "code",
        """
cpu_spans = spans[(spans.device == "cpu")]
passes = list(dict.fromkeys(cpu_spans["pass"]))
fig, axes = plt.subplots(1, len(passes), figsize=(10, 3))
for ax, name in zip(axes, passes, strict=True):
    d = cpu_spans[cpu_spans["pass"] == name].sort_values("self_ms")
    ax.barh(d.name + " ×" + d["count"].astype(str), d.self_ms, color="#4c72b0")
    ax.set(xlabel="self time, ms", title=f"CPU {name}")
fig.tight_layout()
w.save_plot(fig, "spans", caption="self time per span name (with counts), CPU")
""",
    ),
    (
        "md",
        """
## One attention layer, op by op

The replay follows `LayerWeights.forward_attn` line by line on random tensors with the model's
attention shapes, for one decode step with `context` positions already cached. On a decode step
the forward applies no mask; the `mask (where)` row times the `where` anyway, to show its cost,
and is left out of the totals (`in_forward` false). The contrast keeps a preallocated cache
(the new key and value written in place, attention over a view) and calls
`F.scaled_dot_product_attention(..., enable_gqa=True)`, which needs no repeat_kv copies, or
(`fold`) plain SDPA with each KV head's query heads folded into rows
(`span_study.sdpa_folded`), which needs no copies and no GQA support from the kernel.
Times are medians over `replay_reps` passes.
""",
    ),
    (
        "code",
        """
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
""",
    ),
    (
        "code",
        """
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
""",
    ),
    (
        "md",
        """
## Threads

Spans and replay above ran with `threads` torch threads. Here `torch.set_num_threads(n)` for
each count: the prefill of the prompt and one decode step at
the same context (best of `forward_reps`, each ending with the argmax read back), and the
replayed attention core at each context. The machine's load average is recorded beside them:
on a shared machine threads compete with other processes.
""",
    ),
    (
        "code",
        """
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
""",
    ),
    (
        "md",
        """
## GPU: forward at return vs after synchronize

On a GPU `forward` returns once its kernels are queued; spans then measure enqueueing, and
only a synchronize shows when the work is done (the `spans` table above also holds a run with a
synchronize at every span exit).
""",
    ),
    (
        "code",
        """
if gpu_model is not None:
    ev = w.save_table(span_study.enqueue_vs_sync(gpu_model, prompt_ids, context, reps=20),
                      "enqueue_vs_sync", key=True,
                      caption=f"{device}: ms when forward returns and after synchronize (medians)")
    display(ev.round(3))
else:
    print(w.skipped("GPU spans and enqueue vs sync",
                    "device='cpu': run with device='cuda' (or mps) for the GPU parts"))
""",
    ),
    ("md", "## Findings"),
    (
        "code",
        """
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
""",
    ),
    (
        "md",
        """
## Seed figures beside ours

References only, from chapter 000 (candle 0.11.0 on an M2 Max, a Q8_0 file, the CPU run with
the lowest load).
""",
    ),
    (
        "code",
        """
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
""",
    ),
]

# ----------------------------------------------------------------------------- 03
NB03 = [
    (
        "params",
        """
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
""",
    ),
    (
        "md",
        """
# Throughput against context: prefill and decode

Follows the seed's *throughput* experiment (chapter 000, "prefill and decode throughput", and
the speed chapter 004). Prefill: a prompt of T tokens of the shipped English passage at
index_pos 0, timed until the argmax is back on the host, for T from 1 to 512. Decode: the KV
cache holds a context of 16 to 1024 positions, then a few greedy decode steps; ms per token is
their mean. The engine grows its KV cache with `torch.cat` (a copy of the whole cache every
step) and copies K and V three times more in `repeat_kv`; beside it run the engine's SDPA
option and a preallocated cache with SDPA-GQA (written in `qlib.experiments.throughput`, the
engine has no such option yet), end to end and, for one layer, op by op. You will see tok/s
against T, ms/token against context for each variant, and how much of the growth with context
is copying. torch runs on one CPU thread by default (`threads`; notebook 02 compares).
""",
    ),
    (
        "code",
        """
import os
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.experiments import throughput
from qlib.experiments.common import build
from qlib.results import SEED_LABEL, ResultWriter

model_path = str(model_path or models.path())
torch.manual_seed(seed)
if threads:
    torch.set_num_threads(threads)
devices = ["cpu"] if device == "cpu" else ["cpu", device]
w = ResultWriter("03_throughput_vs_context", params=dict(
    model_path=model_path, device=device, prefill_sizes=prefill_sizes, prefill_reps=prefill_reps,
    decode_contexts=decode_contexts, decode_steps=decode_steps,
    decode_steps_long=decode_steps_long, decode_reps=decode_reps, variants=variants,
    replay_reps=replay_reps, threads=threads, form=form, seed=seed))
built = {dev: build(model_path, dev, form=form) for dev in devices}
tokenizer = built["cpu"][1]
ids = throughput.passage_ids(tokenizer, max(max(prefill_sizes), max(decode_contexts)) + 1)
steps = {c: decode_steps_long if c >= 512 else decode_steps for c in decode_contexts}
print(f"devices {devices}; torch threads {torch.get_num_threads()}; "
      f"load average {os.getloadavg()[0]:.1f}; {len(ids)} passage tokens (cycled if the passage "
      f"is shorter); decode steps per context {steps}")
""",
    ),
    ("md", "## Prefill tok/s against prompt length"),
    (
        "code",
        """
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
axes[0].set(xscale="log", xlabel="prompt tokens T", ylabel="tok/s", title="prefill throughput")
axes[1].set(xscale="log", yscale="log", xlabel="prompt tokens T", ylabel="ms",
            title="prefill time (to argmax)")
for ax in axes:
    ax.set_xticks(prefill_sizes, [str(t) for t in prefill_sizes])
    ax.legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "prefill", caption="prefill tok/s and ms against prompt length")
pre.round(1)
""",
    ),
    (
        "md",
        """
## Decode ms/token against context

The cache is filled by one prefill of the longest context; a context of c positions is its
first c positions, which is exactly what a prefill of c tokens leaves (attention is causal).
Each run loads that cache, feeds the passage's next token at index_pos c and decodes greedily.
Variants: `cat + naive` is the engine on a CPU (candle's path), `cat + sdpa` the engine's
`attention="sdpa"` option for decode steps (its path on a GPU), `prealloc + sdpa` a
preallocated cache written in place with SDPA-GQA, `prealloc + fold` the same cache with plain
SDPA over the query heads folded onto their KV head (`span_study.sdpa_folded`).
""",
    ),
    (
        "code",
        """
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
    ax.set(xscale="log", xlabel="context (cached positions)", ylabel="ms / token",
           title=f"{dev}: decode")
    ax.set_xticks(decode_contexts, [str(c) for c in decode_contexts])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
fig.tight_layout()
w.save_plot(fig, "decode", caption="decode ms/token against context, per variant")
dec.pivot_table(index="context", columns=["device", "variant"], values="ms_per_token",
                sort=False).round(2)
""",
    ),
    (
        "md",
        """
## Where the growth goes: one layer's attention core, op by op

The one-layer replay of notebook 02 at each context: forward_attn's ops (cat, repeat_kv, two
matmuls, scale, softmax) against the preallocated cache with SDPA-GQA and with folded SDPA;
`copy_us` is the share
spent copying (cat and repeat_kv, or the in-place writes). Times the block count, that is what
the attention core costs one decode step.
""",
    ),
    (
        "code",
        """
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
    ax.set(xscale="log", xlabel="context", ylabel="µs per layer", title=f"{dev}: attention core")
    ax.set_xticks(decode_contexts, [str(c) for c in decode_contexts])
    ax.legend(fontsize=7)
fig.tight_layout()
w.save_plot(fig, "attention_core", caption="one layer's attention core against context")
core.round(1)
""",
    ),
    ("md", "## Findings"),
    (
        "code",
        """
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
""",
    ),
    (
        "md",
        """
## Seed figures beside ours

References only (candle 0.11.0 on an M2 Max, a Q8_0 file): the chapter gives the CPU
prefill plateau and decode rate as ranges in its text.
""",
    ),
    (
        "code",
        """
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
""",
    ),
]

for name, cells in (
    ("01_generate_one_token", NB01),
    ("02_forward_spans", NB02),
    ("03_throughput_vs_context", NB03),
):
    nbformat.write(nb(cells), f"{OUT}/{name}.ipynb")
    print("wrote", name)
