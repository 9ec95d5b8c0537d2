# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # QMatMul's three forms
#
# Follows the seed chapter **QTensor 与 QMatMul**: one 8192 x 4096 weight (about a projection of a
# 7B model) in Q8_0, Q4_K and Q4_0, multiplied by m input rows in the three forms of candle's
# `QMatMul`: **quantized** (blocks kept; on CPU every activation row is quantized to Q8_0/Q8_K and
# the block dots are integer, as ggml does), **f32** and **f16** (dequantized once at construction).
# One row reads the whole weight once, so decode speed is bytes over bandwidth; many rows turn it
# into arithmetic, where the dense forms reuse each weight. The notebook finds the row count where
# the dense form starts to win on this CPU, reports effective GB/s, and checks f16 and bf16
# inputs on every path (a correct result or a clear error, never a silently wrong one).

# %% tags=["parameters"]
device = "cpu"  # cpu, cuda or mps: the GPU part runs when this is not cpu
types = ["Q8_0", "Q4_K", "Q4_0"]
ms = [1, 2, 4, 8, 16, 64, 256]  # input rows
n = 8192  # weight rows (outputs)
k = 4096  # weight columns (inputs): about one projection of a 7B model
repeats = 3  # timed calls after one untimed call; the minimum is reported
dtype_ms = [1, 16]  # rows for the f16/bf16 input check

# %%
import pandas as pd

from qlib.suite import plots
from qlib.suite.experiments import qmatmul_forms as qf
from qlib.suite.results import ResultWriter

plots.style()

w = ResultWriter("07_qmatmul_forms", params=dict(device=device, types=types, ms=ms, n=n, k=k,
                                                 repeats=repeats, dtype_ms=dtype_ms))
devices = ["cpu"] + ([device] if device != "cpu" else [])
if device == "cpu":
    print(w.skipped("GPU forms", "device is cpu (run with -p device cuda on a GPU machine)"))

# %% [markdown]
# ## Time per call by rows, form and format

# %%
rows = []
for dev in devices:
    rows += qf.run_grid(types, ms, n=n, k=k, device=dev, repeats=repeats)
df = pd.DataFrame(rows)
df["device"] = df["device"].str.split(":").str[0]
w.save_table(df, "forms", key=True,
             caption=f"{n}x{k} weight: min time per call (ms) and GB/s of weight bytes read")
df.pivot_table(index=["device", "type", "m"], columns="form", values="ms").round(3)

# %%
fig = plots.forms_figure(df, devices, types)
w.save_plot(fig, "forms", caption="time per call against input rows (log-log; one y axis per "
            "device)", model=f"a seeded random {n}x{k} weight in {', '.join(types)}")

# %% [markdown]
# ## One row: bytes over bandwidth

# %%
one = df[df.m == 1][["device", "type", "form", "ms", "weight_bytes", "gbps"]].copy()
one["weight_mb"] = one["weight_bytes"] / 1e6
w.save_table(one, "one_row", caption="m = 1: weight bytes read and effective GB/s")
one.round(3)

# %% [markdown]
# ## Where the dense form starts to win (CPU)

# %%
cpu = df[df.device == "cpu"]
cross = pd.DataFrame([dict(type=t, crossover_m=qf.crossover(rows=cpu.to_dict("records"), type_name=t),
                           quantized_ms_m1=float(cpu[(cpu.type == t) & (cpu.form == "quantized") & (cpu.m == 1)].ms.iloc[0]),
                           f32_ms_m1=float(cpu[(cpu.type == t) & (cpu.form == "f32") & (cpu.m == 1)].ms.iloc[0]),
                           quantized_ms_mmax=float(cpu[(cpu.type == t) & (cpu.form == "quantized") & (cpu.m == max(ms))].ms.iloc[0]),
                           f32_ms_mmax=float(cpu[(cpu.type == t) & (cpu.form == "f32") & (cpu.m == max(ms))].ms.iloc[0]))
                      for t in types]).astype({"crossover_m": "Int64"})  # (no crossover: <NA>, not NaN)
w.save_table(cross, "crossover", caption="smallest m where the f32 form beats the quantized form on CPU",
             timing=["crossover_m"])
cross

# %% [markdown]
# ## f16 and bf16 inputs on every path
#
# Relative error of the output against the same form with an f32 input, in units of the input dtype's epsilon; an exception counts as a clear error.

# %%
checks = []
for dev in devices:
    checks += qf.dtype_check(types, dtype_ms, device=dev, n=1024, k=k)
chk = pd.DataFrame(checks)
w.save_table(chk, "dtypes", caption="f16/bf16 inputs: correct result or clear error on every path")
chk[["device", "type", "form", "m", "dtype", "ok", "out_dtype", "rel_error_in_eps", "correct", "error"]].round(3)

# %% [markdown]
# ## Findings

# %%
q1 = one[(one.device == "cpu") & (one.form == "quantized")].set_index("type")
f1 = one[(one.device == "cpu") & (one.form == "f32")].set_index("type")
best = (f1["ms"] / q1["ms"]).idxmax()
speedup = f1.loc[best, "ms"] / q1.loc[best, "ms"]
w.finding("one_row", "With one input row on CPU, the quantized {t} form is {x:.1f}x {how} than "
          "the f32 form ({q:.3f} ms vs {f:.3f} ms): it reads {mb:.0f} MB instead of {fmb:.0f} MB.",
          table="one_row", t=best, x=max(speedup, 1 / speedup),
          how="faster" if speedup >= 1 else "slower", q=q1.loc[best, "ms"],
          f=f1.loc[best, "ms"], mb=q1.loc[best, "weight_mb"], fmb=f1.loc[best, "weight_mb"])
for r in cross.itertuples():
    if pd.isna(r.crossover_m):
        w.finding(f"cross_{r.type}", "On CPU the quantized {t} form stays faster than f32 up to "
                  "m = {m} rows.", table="crossover", t=r.type, m=max(ms))
    else:
        w.finding(f"cross_{r.type}", "On CPU the f32 form overtakes the quantized {t} form at "
                  "m = {m} rows; at m = {mm} the quantized form takes {x:.1f}x as long.",
                  table="crossover", t=r.type, m=int(r.crossover_m), mm=max(ms),
                  x=r.quantized_ms_mmax / r.f32_ms_mmax)
bad = chk[~chk.correct & chk.ok]
w.finding("dtypes", "{good} of {total} f16/bf16 input checks gave a correct result, {err} raised a "
          "clear error and {bad} were wrong.", table="dtypes", good=int(chk.correct.sum()),
          total=len(chk), err=int((~chk.ok).sum()), bad=len(bad))
for f in w.meta["findings"]:
    print(f["sentence"])


# %% [markdown]
# ## The seed's figures, for reference only
#
# Measured on an M2 Max CPU with candle 0.11.0 (accelerate): other hardware, a label beside ours.

# %%
def ours(t, form, m):
    r = cpu[(cpu.type == t) & (cpu.form == form) & (cpu.m == m)]
    return float(r.ms.iloc[0]) if len(r) else None

w.seed_reference("q8_0_m1", "CPU Q8_0 quantized, m = 1 (ms)", 0.156, ours=ours("Q8_0", "quantized", 1),
                 unit="ms", source="QTensor 与 QMatMul: qmv cpu")
w.seed_reference("q8_0_m256_q", "CPU Q8_0 quantized, m = 256 (ms)", 54.466,
                 ours=ours("Q8_0", "quantized", 256), unit="ms", source="QTensor 与 QMatMul: qmv cpu")
w.seed_reference("q8_0_m256_f32", "CPU Q8_0 f32 form, m = 256 (ms)", 10.657,
                 ours=ours("Q8_0", "f32", 256), unit="ms", source="QTensor 与 QMatMul: qmv cpu")
w.seed_reference("crossover", "CPU crossover rows (quantized vs f32)", "16 to 64",
                 ours=", ".join(f"{r.type}: {'none' if pd.isna(r.crossover_m) else r.crossover_m}"
                                for r in cross.itertuples()),
                 source="QTensor 与 QMatMul: qmv cpu")
pd.DataFrame(w.meta["seed_references"])
