# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Smoke test: read a GGUF header
#
# Reads the model file's header, counts its tensors by ggml type and moves one tensor to the device, to check in a few seconds that the engine, the suite, the results folder and the report work end to end.
#

# %% tags=["parameters"]
model_path = None  # GGUF file; None: the embedded SmolLM2 (qlib.models.path())
device = "cpu"  # cpu, cuda or mps
seed = 0

# %%
import time

import matplotlib.pyplot as plt
import pandas as pd
import torch

from qlib import models
from qlib.suite import plots
from qlib.suite.results import ResultWriter

plots.style()
model_path = str(model_path or models.path())
torch.manual_seed(seed)
w = ResultWriter("00_smoke", params=dict(model_path=model_path, device=device, seed=seed))
w.dir

# %% [markdown]
# ## The header
#
# With `qlib.gguf.Content.read` when the engine has it, otherwise with llama.cpp's `gguf.GGUFReader` (the table records which reader ran).

# %%
try:
    from qlib.gguf import Content
except ImportError:  # the engine's reader is not there yet
    Content = None

t0 = time.perf_counter()
if Content is not None:
    reader = "qlib.gguf.Content.read"
    with open(model_path, "rb") as f:
        content = Content.read(f)
        norm = content.tensor_bytes(f, "output_norm.weight")
    arch = content.get("general.architecture")
    blocks = content.get(f"{arch}.block_count")
    tensors = [(i.name, i.dtype.name, i.n_elements, i.nbytes)
               for i in content.tensor_infos.values()]
else:
    import gguf

    reader = "gguf.GGUFReader (qlib.gguf is not importable)"
    r = gguf.GGUFReader(model_path)
    arch = r.fields["general.architecture"].contents()
    blocks = r.fields[f"{arch}.block_count"].contents()
    tensors = [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes))
               for t in r.tensors]
    norm = bytearray(r.get_tensor([t.name for t in r.tensors].index("output_norm.weight")).data.tobytes())
read_s = time.perf_counter() - t0
print(f"{reader}: {len(tensors)} tensors, {arch}, {blocks} blocks, {read_s * 1e3:.1f} ms")

# %%
df = pd.DataFrame(tensors, columns=["name", "type", "elements", "bytes"])
types = (df.groupby("type").agg(tensors=("name", "size"), elements=("elements", "sum"),
                                bytes=("bytes", "sum"))
         .sort_values("tensors", ascending=False).reset_index())
types["reader"] = reader
w.save_table(types, "tensor_types", key=True, caption="tensors by ggml type")
w.save_table(df, "tensors", caption="the tensor directory")
types

# %%
fig, ax = plt.subplots(figsize=(5, 2.8))
plots.bar_labels(ax, ax.bar(types["type"], types["tensors"]), "{:.0f}")
ax.set_xlabel("ggml type")
ax.set_ylabel("tensors")
ax.set_title(f"{len(df)} tensors in {model_path.rsplit('/', 1)[-1]}", fontsize=9)
w.save_plot(fig, "tensor_types", caption="tensors by ggml type")

# %% [markdown]
# ## One tensor on the device
#
# `output_norm.weight` (F32) moved to `device`.

# %%
t0 = time.perf_counter()
x = torch.frombuffer(norm, dtype=torch.float32).to(device)
mean = float(x.mean())  # reads the value back to the host
move_s = time.perf_counter() - t0
w.save_table([dict(device=str(x.device), tensor="output_norm.weight", elements=x.numel(),
                   mean=mean, seconds=move_s)], "device_check")
top = types.iloc[0]
w.finding("types", "{top} of {total} tensors are {top_type}; the {arch} file has {blocks} "
          "blocks and {mb:.1f} MB of tensor data.", table="tensor_types",
          top=int(top.tensors), total=len(df), top_type=top.type, arch=arch,
          blocks=blocks, mb=df.bytes.sum() / 1e6)
