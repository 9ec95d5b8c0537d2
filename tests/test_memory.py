"""Peak RSS of loading and running the default model, bounded relative to the file size.

A child process imports qlib, notes its RSS, loads SmolLM2 (default form),
notes its peak RSS (``VmHWM``, which is ``ru_maxrss`` for this process image:
``ru_maxrss`` itself keeps the parent's peak across fork + exec, so inside a big
pytest process it reports the parent's 1.7 GB), runs a 64-token prefill and 32
decode steps and notes the peak again. What loading may hold, in MiB:

* the file's tensor blocks, once: <= the file size. Read (``mmap=False``),
  ``Content.tensor`` reads each tensor into one buffer that the QTensor keeps;
  mapped (the default), the QTensors are views of the mapped file and its pages
  count once touched (all of them after the run); nothing else keeps a copy;
* the token embedding dequantized to float32 (candle does the same), built a
  few rows at a time so no full-size temporaries exist;
* the metadata as Python objects (the 49,152-token vocabulary and merges,
  about 9 MiB), RoPE tables (1 MiB), allocator slack: ``LOAD_MARGIN_MIB``.

A second full copy of the file (about 94 MiB) or of the float32 embedding
(108 MiB) during loading breaks the bound. Running adds what the quantized
matmul caches per weight on first use (``qlib.quants.cpu.matmul``): the C kernels'
repacked planes (the same bytes as the blocks: 77 MiB here), or without them
(``QLIB_NO_CKERNELS=1``) the torch path's int8 codes and float32 scales (about
3x the blocks: 184 MiB); the child reports that figure, and the run bound is
load bound + cache + ``RUN_MARGIN_MIB`` (KV cache, activations, thread pools;
``RUN_MARGIN_TORCH_MIB`` on the torch path, whose first use of a weight holds its
unpacked codes twice for a moment: 54 MiB for the tied 49,152 x 576 output).

Measured on the 2-core dev machine (SmolLM2 Q4_1, 93.8 MiB file, 108 MiB f32
embedding): loading +218 MiB at peak (steady RSS after loading also +218);
running +324 to +332 MiB at peak with the C kernels (cache 92 MiB), +417 to +429
without them (cache 157 MiB). The same commit in a fresh clone with its own
virtual environment measured +238 MiB loading and +348 running (and 58 MiB more
RSS after the imports): transparent huge pages are "always" here, so RSS depends
on how mappings fall on 2 MB pages. The load margin (64 MiB) covers that and is
still below one extra copy of the file (94 MiB) or of the embedding (108 MiB);
the run margins grow by the same 32 MiB. Bounds: loading 265.8 MiB, running
389.8 with the C kernels, 486.8 without.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qlib import models
from qlib.gguf import Content

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and ru_maxrss in KiB")

MIB = 1 << 20
LOAD_MARGIN_MIB = 64  # environment spread ~20 MiB (see above) < one copy (94)
# the fast engine packs piece by piece and drops each piece's mapped pages once packed, so for
# a moment it holds one piece twice: up to the tied 49,152 x 576 Q8_0 output, 30 MiB. Its
# load peak spread over 193.6-227.8 MiB in nine runs on an Intel Xeon VM (2026-12-06; 93.8
# file + 75.9 AMX codes + 24-58) and reached 237.5 in a fresh clone there, 249.9 in another
# (forty-second session: 80 MiB of margin missed by 0.13; the same tree 218-230 in six runs
# beside it, and the session's starting tree 217-228). 88 MiB: a second copy of the file
# would still show, at least 169.7 + 94 + 24 (the least spread seen) = 287.7 > 257.7
FAST_LOAD_MARGIN_MIB = 88
RUN_MARGIN_MIB = 96  # with the C kernels (64 + the environment spread)
RUN_MARGIN_TORCH_MIB = 128  # torch path: unpacking the 27 MiB tied output makes two code copies

CHILD = r"""
import json, sys
import torch
from qlib.llama.engine import load

def status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024

def rss_mib():
    return status_mib("VmRSS")

def peak_mib():
    # VmHWM, the peak RSS of this process image. ru_maxrss is the same figure, except
    # that Linux carries the parent's high-water mark over fork + exec, so a child of a
    # big pytest process would report the parent's peak.
    return status_mib("VmHWM")

torch.set_num_threads(2)
out = {"peak_after_imports": peak_mib()}
try:  # reset the peak to the current RSS (Linux >= 4.0): the load's own peak
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
out["rss_before_load"] = rss_mib()
model, content = load(sys.argv[1], mmap=sys.argv[2] == "mmap", engine=sys.argv[3])
out["rss_after_load"], out["peak_after_load"] = rss_mib(), peak_mib()
prompt = int(sys.argv[4]) if len(sys.argv) > 4 else 64
vocab = content.tensor_infos["token_embd.weight"].shape[0]
with torch.inference_mode():
    # ids spread over the vocabulary, as a text's are (the embedding rows looked up)
    ids = (torch.arange(1, prompt + 1) * 7919 % vocab).reshape(1, -1)
    logits = model.forward(ids, 0)
    for pos in range(prompt, prompt + 32):
        nxt = logits.argmax(-1, keepdim=True)
        logits = model.forward(nxt, pos)
out["rss_after_run"], out["peak_after_run"] = rss_mib(), peak_mib()
# what the quantized matmul caches per weight after first use (C kernels' packed planes,
# or the torch path's unpacked int8 codes and scales)
from qlib.quants.cpu import matmul as mm
caches = [getattr(mm, name, {}) for name in ("_CACHE", "_PACKED")]
out["kernel_cache_mib"] = sum(v[1].nbytes() for c in caches for v in list(c.values())) / 2**20
out["c_kernels"] = bool(getattr(mm, "_PACKED", None))
# the fast engine's own prefill copy of the weights, where it keeps one (AMX tile order, or
# bf16 for oneDNN: on CPUs with AMX; none for the int8 prefill)
copy = 0
for layer in getattr(model, "layers", []):
    for lin in (getattr(layer, n, None) for n in ("wqkv", "wo", "w13", "w2")):
        if getattr(lin, "amx", None) is not None:
            copy += lin.amx.nbytes()
        if getattr(lin, "bf16", None) is not None:
            copy += lin.bf16.numel() * lin.bf16.element_size()
out["prefill_copy_mib"] = copy / 2**20
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model_path():
    try:
        return models.path()
    except models.ModelNotFoundError as e:
        pytest.skip(str(e))


def _child(model_path, mapping: str, engine: str, prompt: int = 64) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_path), mapping, engine, str(prompt)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    m["file_mib"] = model_path.stat().st_size / MIB
    m["load_peak_mib"] = m["peak_after_load"] - m["rss_before_load"]
    m["run_peak_mib"] = m["peak_after_run"] - m["rss_before_load"]
    print("\nmemory:", engine, mapping, json.dumps({k: round(v, 1) for k, v in m.items()}))
    return m


@pytest.fixture(scope="module", params=["mmap", "read"])
def measured(model_path, request):
    m = _child(model_path, request.param, "faithful")
    emb = Content.read_path(model_path).tensor_infos["token_embd.weight"]
    m["embedding_f32_mib"] = emb.n_elements * 4 / MIB
    m["load_steady_mib"] = m["rss_after_load"] - m["rss_before_load"]
    m["mapped"] = request.param == "mmap"
    return m


def test_loading_holds_each_tensor_once(measured):
    m = measured
    bound = m["file_mib"] + m["embedding_f32_mib"] + LOAD_MARGIN_MIB
    assert m["load_peak_mib"] <= bound, (
        f"loading took {m['load_peak_mib']:.1f} MiB at peak, more than the file "
        f"({m['file_mib']:.1f}) + the f32 embedding ({m['embedding_f32_mib']:.1f}) + "
        f"{LOAD_MARGIN_MIB}: a second copy of the data? {m}"
    )
    # what stays after loading is the same, and not much below: read, the data is really
    # there; mapped, only the pages touched so far are (the embedding, dequantized)
    assert m["load_steady_mib"] <= bound
    read_part = 0.0 if m["mapped"] else m["file_mib"] * 0.9
    assert m["load_steady_mib"] >= read_part + m["embedding_f32_mib"]


def test_running_peak_is_bounded(measured):
    m = measured
    cache = m["kernel_cache_mib"]
    assert cache <= 3.5 * m["file_mib"]
    margin = RUN_MARGIN_MIB if m["c_kernels"] else RUN_MARGIN_TORCH_MIB
    bound = m["file_mib"] + m["embedding_f32_mib"] + cache + margin
    assert m["run_peak_mib"] <= bound, (
        f"loading and running took {m['run_peak_mib']:.1f} MiB at peak, more than the "
        f"file ({m['file_mib']:.1f}) + the f32 embedding ({m['embedding_f32_mib']:.1f}) + "
        f"the matmul caches ({cache:.1f}) + {margin}: {m}"
    )


def test_fast_engine_holds_the_weights_once(model_path):
    """The fast engine repacks every weight from the mapped file, dropping the mapped pages of
    each piece once packed: at peak it holds about the file once (packed planes: the same
    bytes as the blocks). The tied output's packed weight is also where the embedding's rows
    are looked up, so the embedding is not held a second time (before: +17 MiB here). Where
    the CPU has AMX, the bf16 prefill keeps its own copy of the layer
    weights (AMX tile order: the same bytes as the blocks for Q4_x / Q8_0), counted apart."""
    m = _child(model_path, "mmap", "fast")
    bound = m["file_mib"] + m["prefill_copy_mib"] + FAST_LOAD_MARGIN_MIB
    assert m["load_peak_mib"] <= bound, f"fast load peak {m['load_peak_mib']:.1f} > {bound:.1f}"
    assert m["run_peak_mib"] <= bound + RUN_MARGIN_MIB, m


# What the fast engine may add to the 1B-shape files (``models.synthetic``; skipped where they
# have not been made) beyond the interpreter with torch and qlib imported, in MiB: the file's
# tensors once (packed: the same bytes) + this margin. Measured (2-core dev machine, 128-token
# prefill of ids spread over the vocabulary, 32 steps): Q4_K_M +63 over the file's 637.8, Q8_0
# +58 to +65 over 1,090.0 (the metadata as Python objects 9, RoPE tables and the C kernels'
# library 11, the KV cache of 160 positions 10, prefill activations and the allocator's
# retention ~30). Before the embedding was looked up in the tied output's packed copy and the
# mapped pages were dropped piece by piece while packing: +109 and +113 (the mapped
# embedding's pages touched by the lookups, a layer's pages on top of its packed copy, at the
# tied output the whole embedding's). The margin lies between the two.
BIG_MARGIN_MIB = 84
# The whole process: the target, peak RSS <= 1.3 x the file. The interpreter with torch
# and qlib is ~225 MiB before any model (0.35 x the Q4_K_M file alone), so only Q8_0 can meet
# it; printed for both, asserted for Q8_0 where the imports cost what they cost here.
TARGET_RATIO = 1.3
IMPORTS_MIB = 240  # the imports' RSS above which the whole-process ratio is not asserted


@pytest.mark.parametrize("spec", ["Q4_K_M", "Q8_0"])
def test_fast_engine_big_file_peak(spec):
    path = models.models_dir() / f"synthetic-1b.{spec}.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not made (qlib.models.synthetic('1b', {spec!r}))")
    m = _child(path, "mmap", "fast", prompt=128)
    ratio = m["peak_after_run"] / m["file_mib"]
    print(f"{spec}: peak {m['peak_after_run']:.0f} MiB = {ratio:.3f} x the file")
    bound = m["file_mib"] + BIG_MARGIN_MIB
    assert m["run_peak_mib"] <= bound, (
        f"the fast engine added {m['run_peak_mib']:.1f} MiB at peak to the imports, more than "
        f"the file ({m['file_mib']:.1f}) + {BIG_MARGIN_MIB}: a second copy of a weight? {m}"
    )
    if spec == "Q8_0" and m["rss_before_load"] <= IMPORTS_MIB:
        assert ratio <= TARGET_RATIO, m
