"""Notebook 6: how far apart the logits of one GGUF are across engines, forms and devices.

Seeds: "QTensor and QMatMul" (CPU vs GPU logits; the quantized vs dequantized
forms) and "self-quantize" (the error table: max|diff| at step 0, argmax
agreement under teacher forcing, first divergence in greedy generation).

Every *source* computes, for the same file, (a) the teacher-forced logits of
every position of a passage (one prefill), and (b) a greedy generation from a
chat prompt, keeping the logits of its first step (the prompt's last
position). Sources: qlib in the ``quantized`` and ``f32`` forms on the CPU and
a GPU, llama.cpp (f32 KV cache), transformers in float32 (the reference).
``nudged`` adds a sensitivity test: every QMatMul input moved by one ulp.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from ...gguf import Content
from ...llama.engine import load
from ...llama.faithful import ModelWeights
from ...quants.qtensor import QMatMul
from .common import teacher_forced_logits
from .index_pos import Decoder, first_difference

REFERENCE = "transformers f32"
COUNT_ROWS = 32  # rows per QMatMul call on which the nudge's code flips are counted


# -- model files ----------------------------------------------------------


def main_type(content: Content) -> str:
    """The ggml type of most of a file's matrices (2-D tensors)."""
    types = Counter(i.dtype.name for i in content.tensor_infos.values() if len(i.shape) > 1)
    return types.most_common(1)[0][0]


def variant_path(src: str | Path, type_name: str, models_dir: str | Path | None = None) -> Path:
    """``src`` itself when its matrices are ``type_name``, else ``src`` re-quantized to it by
    ``qlib.models.derive`` (made once, in ``models_dir`` or the models folder; 1-D tensors and
    the metadata copied, ``general.file_type`` set; not byte-identical to a file quantized from
    the original weights)."""
    from ... import models

    with open(src, "rb") as f:
        if main_type(Content.read(f)) == type_name:
            return Path(src)
    return models.derive(type_name, str(src), dest_dir=models_dir)


def passage_ids(tok: Any, n: int, name: str = "passage.txt") -> list[int]:
    """The first ``n`` tokens of a shipped passage (no template, no special tokens)."""
    from ...models import data_file

    ids = tok.encode(data_file(name).read_text(encoding="utf-8"))
    if len(ids) < n:
        raise ValueError(f"{name} has {len(ids)} tokens, fewer than the {n} asked for")
    return ids[:n]


# -- the 1-ulp nudge --------------------------------------------------------


def qmatmuls(model: ModelWeights) -> Iterator[tuple[object, str, QMatMul]]:
    """Every QMatMul of the model as (owner, attribute, object): 7 per layer and the output."""
    owners: list[object] = [model]
    for layer in model.layers:
        owners += [layer, layer.mlp]
    for owner in owners:
        for attr, value in vars(owner).items():
            if isinstance(value, QMatMul):
                yield owner, attr, value


@dataclass
class NudgeStats:
    """What the nudge changed in the activations the CPU quantized kernel would use."""

    calls: int = 0
    values: int = 0
    counted_values: int = 0
    codes_changed: int = 0
    scales_changed: int = 0
    blocks: int = 0
    counted: bool = False

    @property
    def codes_changed_share(self) -> float:
        n = self.counted_values
        return self.codes_changed / n if self.counted and n else float("nan")

    @property
    def scales_changed_share(self) -> float:
        return self.scales_changed / self.blocks if self.counted and self.blocks else float("nan")


class NudgedQMatMul:
    """A QMatMul whose input is moved one ulp up (``nextafter(x, +inf)``) before it runs."""

    def __init__(self, inner: QMatMul, stats: NudgeStats, count: bool = False):
        self.inner, self.stats, self.count = inner, stats, count
        self.form, self.qtensor = inner.form, inner.qtensor
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nudged = torch.nextafter(x, torch.full_like(x, float("inf")))
        self.stats.calls += 1
        self.stats.values += x.numel()
        if self.count:
            self._count(x, nudged)
        return self.inner.forward(nudged)

    __call__ = forward

    def _count(self, x: torch.Tensor, nudged: torch.Tensor) -> None:
        """Count the activation codes and block scales the nudge flips (quantized form).

        On up to ``COUNT_ROWS`` evenly spaced rows per call: an estimate of the share.
        """
        from ...quants.activations import VEC_DOT_TYPE, quantize_activations

        dot = VEC_DOT_TYPE.get(self.qtensor.dtype.name)
        if dot is None or dot in ("F32", "F16", "BF16"):
            return
        x, nudged = x.reshape(-1, self.in_features), nudged.reshape(-1, self.in_features)
        if x.shape[0] > COUNT_ROWS:
            rows = torch.linspace(0, x.shape[0] - 1, COUNT_ROWS, device=x.device).long()
            x, nudged = x[rows], nudged[rows]
        a, b = quantize_activations(x, dot), quantize_activations(nudged, dot)
        self.stats.counted_values += x.numel()
        self.stats.codes_changed += int((a.codes != b.codes).sum())
        self.stats.scales_changed += int((a.d != b.d).sum())
        self.stats.blocks += a.d.numel()
        self.stats.counted = True


@contextmanager
def nudged(model: ModelWeights, count: bool = False) -> Iterator[NudgeStats]:
    """Within the block, every QMatMul input of ``model`` is nudged by one ulp."""
    stats = NudgeStats()
    swapped = list(qmatmuls(model))
    for owner, attr, q in swapped:
        setattr(owner, attr, NudgedQMatMul(q, stats, count))
    try:
        yield stats
    finally:
        for owner, attr, q in swapped:
            setattr(owner, attr, q)


# -- sources ----------------------------------------------------------------


class Source(Protocol):
    name: str

    def teacher_forced(self, ids: list[int]) -> np.ndarray: ...

    def greedy(self, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]: ...


class QlibSource:
    """qlib's ModelWeights in one QMatMul form on one device."""

    def __init__(self, path: str | Path, device: str = "cpu", form: str | None = None, **kw: Any):
        self.model, _ = load(path, device, form=form, **kw)
        self.form = form or next(qmatmuls(self.model))[2].form
        self.name = f"qlib {torch.device(device).type} {self.form}"

    def teacher_forced(self, ids: list[int]) -> np.ndarray:
        return teacher_forced_logits(self.model, ids).numpy()

    def greedy(self, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        m = self.model
        m.clear_kv_cache()
        ids: list[int] = []
        with torch.inference_mode():
            logits = m.forward(torch.tensor([prompt_ids], device=m.device), 0)[0]
            step0 = logits.float().cpu().numpy()
            pos = len(prompt_ids)
            for _ in range(steps):
                ids.append(int(logits.argmax()))
                if len(ids) == steps:
                    break
                logits = m.forward(torch.tensor([[ids[-1]]], device=m.device), pos)[0]
                pos += 1
        m.clear_kv_cache()
        return ids, step0


class LlamaCppSource:
    """llama.cpp through llama-cpp-python, f32 KV cache, every position's logits kept."""

    def __init__(self, path: str | Path, n_ctx: int = 512, threads: int | None = None):
        import llama_cpp

        self.name = "llama.cpp cpu"
        self.llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=n_ctx,
            n_ubatch=n_ctx,
            logits_all=True,
            type_k=0,  # GGML_TYPE_F32: the default f16 cache would add its own rounding
            type_v=0,
            n_gpu_layers=0,
            n_threads=threads or torch.get_num_threads(),
            verbose=False,
        )

    def teacher_forced(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def greedy(self, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        llm = self.llm
        llm.reset()
        llm.eval(prompt_ids)
        step0 = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        ids = [int(step0.argmax())]
        while len(ids) < steps:
            llm.eval([ids[-1]])
            ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        return ids, step0

    def close(self) -> None:
        self.llm.close()


class TransformersSource:
    """transformers' llama on the same GGUF, dequantized to float32 (offline)."""

    def __init__(self, path: str | Path):
        import inspect

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        path = Path(path)
        quiet = os.environ.get("TQDM_DISABLE")
        os.environ["TQDM_DISABLE"] = "1"  # the GGUF conversion's own progress bar
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=torch.float32
            ).eval()
        finally:
            if quiet is None:
                os.environ.pop("TQDM_DISABLE", None)
            else:
                os.environ["TQDM_DISABLE"] = quiet
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in 5.x
        self.name = REFERENCE

    def teacher_forced(self, ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            return self.model(torch.tensor([ids])).logits[0].float().numpy()

    def greedy(self, prompt_ids: list[int], steps: int) -> tuple[list[int], np.ndarray]:
        with torch.inference_mode():
            out = self.model(torch.tensor([prompt_ids]), use_cache=True)
            step0 = out.logits[0, -1].float().numpy()
            ids = [int(step0.argmax())]
            while len(ids) < steps:
                cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
                kw = {self._cache_kw: cache}
                out = self.model(torch.tensor([[ids[-1]]]), use_cache=True, **kw)
                ids.append(int(out.logits[0, -1].argmax()))
        return ids, step0


@dataclass
class SourceSpec:
    """How to make one source, and whether to also run it with nudged inputs."""

    name: str
    make: Callable[[], Source]
    nudge: bool = False


@dataclass
class Run:
    """What one source produced for one file."""

    name: str
    logits: np.ndarray  # (T, vocab), teacher forced
    step0: np.ndarray  # (vocab,), the prompt's last position
    greedy: list[int]
    seconds: float
    nudged_logits: np.ndarray | None = None
    nudge: NudgeStats | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def source_specs(
    path: str | Path, gpu: str | None, *, llama_cpp: bool = True, transformers: bool = True
) -> tuple[list[SourceSpec], list[tuple[str, str]]]:
    """The sources for one file, reference first; and (part, reason) for those left out."""
    specs, skipped = [], []
    if transformers:
        specs.append(SourceSpec(REFERENCE, lambda: TransformersSource(path)))
    else:
        skipped.append((REFERENCE, "turned off by the notebook's parameters"))
    for device in ["cpu"] + ([gpu] if gpu else []):
        tag = torch.device(device).type
        for form in ("quantized", "f32"):
            specs.append(
                SourceSpec(
                    f"qlib {tag} {form}",
                    lambda d=device, fm=form: QlibSource(path, d, fm),
                    nudge=tag == "cpu",
                )
            )
    if not gpu:
        skipped.append(("qlib GPU quantized and f32", "no GPU (CUDA or MPS) on this machine"))
    if not llama_cpp:
        skipped.append(("llama.cpp cpu", "turned off by the notebook's parameters"))
    else:
        try:
            import llama_cpp as _  # noqa: F401

            specs.append(SourceSpec("llama.cpp cpu", lambda: LlamaCppSource(path)))
        except ImportError as e:
            skipped.append(("llama.cpp cpu", f"llama-cpp-python is not installed ({e})"))
    return specs, skipped


def run_source(
    spec: SourceSpec, ids: list[int], prompt_ids: list[int], steps: int, count: bool = True
) -> Run:
    """Make the source, run teacher forcing, greedy generation and (if asked) the nudged run."""
    t0 = time.perf_counter()
    src = spec.make()
    try:
        logits = src.teacher_forced(ids)
        greedy, step0 = src.greedy(prompt_ids, steps)
        run = Run(spec.name, logits, step0, greedy, 0.0)
        if spec.nudge and isinstance(src, QlibSource):
            with nudged(src.model, count=count and src.form == "quantized") as stats:
                run.nudged_logits = src.teacher_forced(ids)
            run.nudge = stats
    finally:
        if hasattr(src, "close"):
            src.close()
        del src
        gc.collect()
    run.seconds = time.perf_counter() - t0
    return run


def run_sources(
    specs: list[SourceSpec],
    ids: list[int],
    prompt_ids: list[int],
    steps: int,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Run], list[tuple[str, str]]]:
    """Run every source; one that fails is reported as skipped, with its error."""
    runs, skipped = {}, []
    for spec in specs:
        try:
            run = run_source(spec, ids, prompt_ids, steps)
        except Exception as e:  # a missing kernel or peer: recorded, the others still run
            skipped.append((spec.name, f"{type(e).__name__}: {e}"))
            log(f"{spec.name}: skipped ({type(e).__name__}: {e})")
            continue
        runs[spec.name] = run
        log(f"{spec.name}: {run.seconds:.1f} s")
    return runs, skipped


# -- comparisons ------------------------------------------------------------


def _diff_stats(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = np.abs(a.astype(np.float32) - b.astype(np.float32))
    return float(d.max()), float(d.mean())


def drift_matrix(logits: dict[str, np.ndarray]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """max|diff| and mean|diff| between every pair of same-shaped logits, as two square frames."""
    names = list(logits)
    mx = pd.DataFrame(0.0, index=names, columns=names)
    mean = pd.DataFrame(0.0, index=names, columns=names)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            mx.loc[a, b], mean.loc[a, b] = _diff_stats(logits[a], logits[b])
            mx.loc[b, a], mean.loc[b, a] = mx.loc[a, b], mean.loc[a, b]
    return mx, mean


def long_pairs(mx: pd.DataFrame, mean: pd.DataFrame, **extra: Any) -> list[dict]:
    """The upper triangle of a drift matrix as rows (a, b, max, mean)."""
    names = list(mx.index)
    return [
        {**extra, "a": a, "b": b, "max_abs_diff": mx.loc[a, b], "mean_abs_diff": mean.loc[a, b]}
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    ]


def versus_reference(
    runs: dict[str, Run], reference: str, tok: Decoder, **extra: Any
) -> list[dict]:
    """Each source against the reference: step-0 and teacher-forced drift, argmax, divergence.

    ``first_diverging_token`` counts from 1 (the first generated token); None: none in
    ``generated`` tokens.
    """
    ref = runs[reference]
    ref_argmax = ref.logits.argmax(-1)
    rows = []
    for name, run in runs.items():
        if name == reference:
            continue
        agree = run.logits.argmax(-1) == ref_argmax
        first = first_difference(run.greedy, ref.greedy)
        step0_max, _ = _diff_stats(run.step0, ref.step0)
        tf_max, tf_mean = _diff_stats(run.logits, ref.logits)
        rows.append(
            {
                **extra,
                "source": name,
                "step0_max_abs_diff": step0_max,
                "max_abs_diff": tf_max,
                "mean_abs_diff": tf_mean,
                "argmax_agree": int(agree.sum()),
                "positions": int(agree.size),
                "argmax_agree_share": float(agree.mean()),
                "first_diverging_token": None if first is None else first + 1,
                "generated": len(run.greedy),
                "reference_token": None if first is None else tok.decode([ref.greedy[first]]),
                "token": None if first is None else tok.decode([run.greedy[first]]),
                "seconds": run.seconds,
            }
        )
    return rows


def position_drift(runs: dict[str, Run], reference: str) -> pd.DataFrame:
    """max|diff| vs the reference at every teacher-forced position, one column per source."""
    ref = runs[reference].logits
    return pd.DataFrame(
        {name: np.abs(run.logits - ref).max(-1) for name, run in runs.items() if name != reference}
    ).rename_axis("position")


def at_position(
    runs: dict[str, Run], pairs: list[tuple[str, str]], position: int = 0, **extra: Any
) -> list[dict]:
    """max and mean |logit diff| of each pair of sources (both run, not the same) at one
    teacher-forced position."""
    rows = []
    for a, b in pairs:
        if a != b and a in runs and b in runs:
            mx, mean = _diff_stats(runs[a].logits[position], runs[b].logits[position])
            rows.append({**extra, "a": a, "b": b, "position": position, "max_abs_diff": mx,
                         "mean_abs_diff": mean})  # fmt: skip
    return rows


def ulp_sensitivity(runs: dict[str, Run], **extra: Any) -> list[dict]:
    """The drift a one-ulp nudge alone causes, beside the quantized-vs-f32 drift on one device."""
    rows = []
    for name, run in runs.items():
        if run.nudged_logits is None:
            continue
        mx, mean = _diff_stats(run.nudged_logits, run.logits)
        agree = run.nudged_logits.argmax(-1) == run.logits.argmax(-1)
        stats = run.nudge or NudgeStats()
        rows.append(
            {
                **extra,
                "comparison": f"{name}: nudged by 1 ulp vs not",
                "max_abs_diff": mx,
                "mean_abs_diff": mean,
                "argmax_agree_share": float(agree.mean()),
                "qmatmul_calls": stats.calls,
                "codes_changed_share": stats.codes_changed_share,
                "scales_changed_share": stats.scales_changed_share,
            }
        )
    for device in ("cpu", "cuda", "mps"):
        q, f = runs.get(f"qlib {device} quantized"), runs.get(f"qlib {device} f32")
        if q is None or f is None:
            continue
        mx, mean = _diff_stats(q.logits, f.logits)
        agree = q.logits.argmax(-1) == f.logits.argmax(-1)
        rows.append(
            {
                **extra,
                "comparison": f"qlib {device} quantized vs qlib {device} f32",
                "max_abs_diff": mx,
                "mean_abs_diff": mean,
                "argmax_agree_share": float(agree.mean()),
                "qmatmul_calls": None,
                "codes_changed_share": None,
                "scales_changed_share": None,
            }
        )
    return rows
