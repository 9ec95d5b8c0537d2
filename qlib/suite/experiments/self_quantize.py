"""Notebook 8: quantize a model yourself (seed: "self-quantize").

From the embedded GGUF, export a transformers folder (the "safetensors" a user
would download), convert it back to GGUF at several types and recipes with
``qlib.convert``, and measure: byte identity of our quantizer with gguf-py and
llama.cpp, the failure cases (no metadata, no freq_base, no q/k permutation),
an error table against the float32 reference (transformers on the exported
folder), torch's dynamic int8 quantization beside it, and batch dependence.

The free-generation column uses the reference's own greedy continuation: a
model generates the same tokens as the reference up to the first position
where its teacher-forced argmax on the reference continuation differs, so one
forward pass replaces a decode loop.
"""

from __future__ import annotations

import copy
import io
import os
import re
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...convert import TensorChoice
from ...gguf import Content
from ...llama.faithful import ModelWeights
from .common import build, teacher_forced_logits

GGUF_PY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16")


# -- the f32 reference --------------------------------------------------------


def load_hf(folder: str | Path):
    """(tokenizer, model) from a transformers folder, float32, eager attention, offline."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return tok, model


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    """Logits of every position, (len(ids), vocab) float32."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: Any, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy continuation with the KV cache, ``steps`` tokens, never stopping at EOS."""
    import inspect

    # transformers 5.2x renamed past_key_values to cache (the old name warns)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out: list[int] = []
    with torch.inference_mode():
        res = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            kv = {key: getattr(res, key)}
            res = model(torch.tensor([[token]]), use_cache=True, **kv)
    return out


@dataclass
class Reference:
    """The reference's logits on the chat sequence and on the passage."""

    prompt_ids: list[int]
    continuation: list[int]
    seq_logits: torch.Tensor  # (len(prompt) + len(continuation), vocab)
    passage_ids: list[int]
    passage_logits: torch.Tensor  # (len(passage), vocab)

    @property
    def seq_ids(self) -> list[int]:
        return self.prompt_ids + self.continuation

    @property
    def max_abs(self) -> float:
        return float(self.seq_logits[len(self.prompt_ids) - 1].abs().max())


def reference(model: Any, prompt_ids: list[int], passage_ids: list[int], steps: int) -> Reference:
    cont = hf_greedy(model, prompt_ids, steps)
    return Reference(
        prompt_ids, cont, hf_logits(model, prompt_ids + cont),
        passage_ids, hf_logits(model, passage_ids),
    )  # fmt: skip


def score(
    name: str,
    seq_logits: torch.Tensor,
    passage_logits: torch.Tensor | None,
    ref: Reference,
    nbytes: int | None,
    **extra: Any,
) -> dict[str, Any]:
    """One row of the error table: logit differences, argmax agreement, first divergence."""
    p = len(ref.prompt_ids)
    step0 = float((seq_logits[p - 1] - ref.seq_logits[p - 1]).abs().max())
    pred = seq_logits[p - 1 : p - 1 + len(ref.continuation)].argmax(-1).tolist()
    pairs = zip(pred, ref.continuation, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    row: dict[str, Any] = {"model": name, **extra, "bytes": nbytes, "step0_max_diff": step0}
    if passage_logits is not None:
        per_pos = (passage_logits - ref.passage_logits).abs().amax(-1)
        agree = passage_logits.argmax(-1) == ref.passage_logits.argmax(-1)
        row.update(
            tf_median_diff=float(per_pos.median()),
            tf_max_diff=float(per_pos.max()),
            argmax_agree=int(agree.sum()),
            positions=len(agree),
        )
    row["first_divergence"] = len(pred) if first is None else first
    row["generated"] = len(pred)
    return row


def evaluate_gguf(
    name: str,
    path: str | Path,
    ref: Reference,
    form: str,
    *,
    passage: bool = True,
    keep: bool = False,
    **extra: Any,
) -> tuple[dict[str, Any], ModelWeights | None, torch.Tensor]:
    """Score a GGUF file with qlib in ``form``.

    Returns the row, the model when ``keep`` (else None) and its logits on the
    chat sequence (for ``batch_dependence``).
    """
    model, _ = build(path, "cpu", form=form)
    seq = teacher_forced_logits(model, ref.seq_ids)
    pas = teacher_forced_logits(model, ref.passage_ids) if passage else None
    row = score(name, seq, pas, ref, Path(path).stat().st_size, form=form, **extra)
    return row, (model if keep else None), seq


# -- torch dynamic int8 ---------------------------------------------------------


@contextmanager
def captured_stderr() -> Iterator[list[str]]:
    """Collect what C++ code writes to file descriptor 2 (torch's ``[W ...]`` warnings)."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode("utf-8", "replace").splitlines())


def torch_dynamic_int8(model: Any, engine: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``quantize_dynamic`` every nn.Linear to int8 (a copy); returns it and what happened.

    ``engine`` defaults to the current quantized engine, or the first supported one
    when none is set. The info records the engines, each distinct Python warning
    (first line) and C++ warning, from quantizing and from a first forward pass.
    """
    engines = list(torch.backends.quantized.supported_engines)
    default = torch.backends.quantized.engine
    info: dict[str, Any] = {"supported_engines": engines, "default_engine": default}
    chosen = engine or (default if default != "none" else next(e for e in engines if e != "none"))
    with warnings.catch_warnings(record=True) as caught, captured_stderr() as cpp:
        warnings.simplefilter("always")
        torch.backends.quantized.engine = chosen
        qmodel = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
        with torch.inference_mode():
            qmodel(torch.tensor([[1, 2, 3]]))
    info["engine"] = chosen
    seen: dict[str, None] = {}
    for w in caught:
        text = str(w.message).strip()
        first = text.splitlines()[0].strip() if text else ""
        seen.setdefault(f"{w.category.__name__}: {first}", None)
    info["warnings"] = list(seen)
    info["cpp_warnings"] = [line for line in cpp if "Warning" in line]
    info["lm_head"] = repr(qmodel.lm_head)
    info["q_proj"] = repr(qmodel.model.layers[0].self_attn.q_proj)
    return qmodel, info


def int8_logits(qmodel: Any, engine: str, ids: list[int]) -> torch.Tensor:
    """``hf_logits`` of a dynamic-int8 model under the engine that packed its weights."""
    torch.backends.quantized.engine = engine
    return hf_logits(qmodel, ids)


def int8_weights_only(model: Any, qmodel: Any) -> Any:
    """A copy of ``model`` whose Linear weights are ``qmodel``'s int8 weights, dequantized.

    Activations stay float32: the error of the per-tensor weight scale alone.
    """
    wmodel = copy.deepcopy(model)
    qmods = dict(qmodel.named_modules())
    with torch.no_grad():
        for name, mod in wmodel.named_modules():
            if isinstance(mod, torch.nn.Linear) and name in qmods:
                w = qmods[name].weight().dequantize()
                mod.weight = torch.nn.Parameter(w.float().clone(), requires_grad=False)
    return wmodel


def state_dict_bytes(model: Any) -> int:
    """Size of ``torch.save(model.state_dict())``."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


def batch_dependence(
    name: str, logits_fn: Callable[[list[int]], torch.Tensor], prompt_ids: list[int],
    seq_ids: list[int], seq_logits: torch.Tensor | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Logits of the last prompt position: prompt alone vs inside the whole sequence."""
    p = len(prompt_ids)
    alone = logits_fn(prompt_ids)[p - 1]
    inside = (seq_logits if seq_logits is not None else logits_fn(seq_ids))[p - 1]
    return {
        "model": name,
        "position": p - 1,
        "alone_tokens": p,
        "inside_tokens": len(seq_ids),
        "max_diff": float((alone - inside).abs().max()),
        "same_argmax": bool(alone.argmax() == inside.argmax()),
    }


# -- byte comparisons -------------------------------------------------------------


def _kind(name: str) -> str:
    return re.sub(r"^blk\.\d+\.", "blk.*.", name)


def compare_gguf(a: str | Path, b: str | Path) -> list[dict[str, Any]]:
    """Tensor by tensor, as the seed's ``qcmp``: per kind and type pair, identical tensors."""
    groups: dict[tuple, dict[str, int]] = defaultdict(lambda: Counter())
    with open(a, "rb") as fa, open(b, "rb") as fb:
        ca, cb = Content.read(fa), Content.read(fb)
        for name, ia in ca.tensor_infos.items():
            ib = cb.tensor_infos.get(name)
            key = (_kind(name), ia.dtype.name, ib.dtype.name if ib else "missing")
            g = groups[key]
            g["tensors"] += 1
            if ib is None or ia.dtype != ib.dtype or ia.shape != ib.shape:
                continue
            xa = np.frombuffer(ca.tensor_bytes(fa, name), np.uint8)
            xb = np.frombuffer(cb.tensor_bytes(fb, name), np.uint8)
            diff = int((xa != xb).sum())
            g["identical"] += int(diff == 0)
            g["bytes_differ"] += diff
            g["bytes"] += xa.size
    return [
        {"tensor": k, "type_a": ta, "type_b": tb, "tensors": g["tensors"],
         "identical": g["identical"], "bytes_differ": g["bytes_differ"], "bytes": g["bytes"]}
        for (k, ta, tb), g in groups.items()
    ]  # fmt: skip


def gguf_py_identity(
    f32_path: str | Path, types: Iterable[str] = GGUF_PY_TYPES
) -> list[dict[str, Any]]:
    """Our quantizer vs ``gguf.quants.quantize`` on every matrix of an F32 GGUF, per type."""
    import gguf

    from ... import quants

    rows = []
    with open(f32_path, "rb") as f:
        content = Content.read(f)
        mats = {
            n: content.tensor(f, n).dequantize().numpy()
            for n, i in content.tensor_infos.items()
            if len(i.shape) == 2
        }
    for t in types:
        same = nbytes = 0
        ours_s = theirs_s = 0.0
        for x in mats.values():
            t0 = time.perf_counter()
            ours = quants.quantize(x, t)
            t1 = time.perf_counter()
            theirs = gguf.quants.quantize(x, gguf.GGMLQuantizationType[t])
            t2 = time.perf_counter()
            ours_s, theirs_s = ours_s + t1 - t0, theirs_s + t2 - t1
            theirs = np.ascontiguousarray(theirs).view(np.uint8).reshape(ours.shape)
            same += int(np.array_equal(ours, theirs))
            nbytes += ours.size
        rows.append({"type": t, "tensors": len(mats), "identical": same, "bytes": nbytes,
                     "qlib_s": ours_s, "gguf_py_s": theirs_s})  # fmt: skip
    return rows


def requantize_identity(path: str | Path) -> list[dict[str, Any]]:
    """Each tensor dequantized and quantized again to its own type: same bytes as the file?"""
    from ... import quants

    counts: dict[str, Counter] = defaultdict(Counter)
    with open(path, "rb") as f:
        content = Content.read(f)
        for name, info in content.tensor_infos.items():
            q = content.tensor(f, name)
            x = q.dequantize().numpy().reshape(-1, info.shape[-1])
            again = quants.quantize(x, info.dtype.name)
            c = counts[info.dtype.name]
            c["tensors"] += 1
            c["identical"] += int(np.array_equal(again.reshape(-1), q.data.numpy().reshape(-1)))
    return [{"type": t, **c} for t, c in counts.items()]


def llama_cpp_quantize(
    src: str | Path, dst: str | Path, recipe: str, threads: int = 2
) -> tuple[Path, list[str]]:
    """``llama_model_quantize`` (llama.cpp via llama-cpp-python) with a file type name.

    Returns the output path and llama.cpp's summary lines (its per-tensor log is dropped).
    """
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{recipe}")
    params.nthread = threads
    with captured_stderr() as log:
        rc = llama_cpp.llama_model_quantize(
            str(src).encode(), str(dst).encode(), ctypes.byref(params)
        )
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {recipe}) returned {rc}: {log[-3:]}")
    return Path(dst), [line for line in log if line.startswith("llama_model_quantize_impl")]


# -- recipes and failure cases ------------------------------------------------------


def plan_table(choices: list[TensorChoice]) -> list[dict[str, Any]]:
    """The type plan grouped: tensor kind, wanted type, written type, layers, rule."""
    groups: dict[tuple, list] = defaultdict(list)
    for c in choices:
        m = re.match(r"blk\.(\d+)\.", c.name)
        groups[(_kind(c.name), c.wanted, c.type, c.rule)].append(int(m.group(1)) if m else None)
    rows = []
    for (kind, wanted, got, rule), layers in groups.items():
        idx = [i for i in layers if i is not None]
        rows.append({"tensor": kind, "wanted": wanted, "type": got, "count": len(layers),
                     "layers": ",".join(map(str, idx)) if idx else "", "rule": rule})  # fmt: skip
    return rows


def greedy_text(model: ModelWeights, tok: Any, prompt_ids: list[int], steps: int) -> dict:
    """Greedy generation with qlib: the ids, the text and the RoPE base it ran with."""
    from ...generate import generate

    ids = generate(model, prompt_ids, steps)
    return {"ids": ids, "text": tok.decode(ids), "rope_freq_base": model.config.rope_freq_base}
