"""Notebook 9: speed vs PyTorch (seed: "speed"), with the protocol of ``qlib.suite.bench``.

Every configuration runs in its own process (``python -m qlib bench ...
--json``), so one configuration's warm caches, threads or JIT never help the
next; the rows of one matrix are compared as ratios measured in that run.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from ..bench import run_in_subprocess


@dataclass(frozen=True)
class Config:
    """One benchmark configuration: a runtime and its options."""

    runtime: str  # qlib, transformers, llama.cpp
    device: str = "cpu"
    threads: int | None = None
    engine: str | None = None  # qlib engine: faithful (default) or fast
    form: str | None = None  # qlib faithful engine's QMatMul form
    dtype: str | None = None  # transformers dtype
    extra: tuple[str, ...] = field(default=())

    @property
    def variant(self) -> str:
        """fast (the fast engine), the faithful engine's form, or the transformers dtype."""
        if self.engine == "fast":
            return "fast"
        return self.form or self.dtype or ("default" if self.runtime == "qlib" else "")

    @property
    def label(self) -> str:
        threads = f" {self.threads}t" if self.threads else ""
        return f"{self.runtime} {self.variant}".strip() + f" {self.device}{threads}"

    def argv(self) -> list[str]:
        args = ["--runtime", self.runtime, "--device", self.device]
        if self.threads:
            args += ["--threads", str(self.threads)]
        if self.engine:
            args += ["--engine", self.engine]
        if self.form:
            args += ["--form", self.form]
        if self.dtype:
            args += ["--dtype", self.dtype]
        return args + list(self.extra)


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def default_configs(
    device: str = "cpu",
    threads: tuple[int, ...] = (1, 2),
    qlib_variants: tuple[str, ...] = ("fast", "quantized", "f32"),
    transformers_dtypes: tuple[str, ...] = ("f32", "bf16"),
    peers: bool = True,
) -> list[Config]:
    """The matrix notebook 9 runs: qlib variants ("fast": the fast engine; a form: the faithful
    engine in it), transformers dtypes, llama.cpp; per thread count.

    On a GPU the thread count does not matter, so one row per configuration.
    """
    per_threads = threads if device == "cpu" else (None,)
    configs: list[Config] = []
    for t in per_threads:
        # fast: qlib.llama.fast_cpu (CPU) or qlib.llama.fast_cuda (CUDA); neither runs on MPS
        for v in qlib_variants:
            if v == "fast" and device in ("cpu", "cuda"):
                configs.append(Config("qlib", device, t, engine="fast"))
            elif v != "fast":
                configs.append(Config("qlib", device, t, form=v))
        if peers:
            configs += [Config("transformers", device, t, dtype=d) for d in transformers_dtypes]
            if llama_cpp_available():
                configs.append(Config("llama.cpp", device, t))
    return configs


def run_matrix(
    configs: list[Config],
    *,
    model: str,
    prompt_tokens: int,
    steps: int,
    reps: int,
    progress: bool = True,
) -> list[dict]:
    """Run each configuration in a new process; one flat row per configuration."""
    from tqdm.auto import tqdm

    common = [
        "--model",
        str(model),
        "--prompt-tokens",
        str(prompt_tokens),
        "--steps",
        str(steps),
        "--reps",
        str(reps),
        "--no-floor",
    ]
    rows = []
    for config in tqdm(configs, desc="configurations", disable=not progress):
        r = run_in_subprocess(common + config.argv())
        row = {
            "config": config.label,
            "runtime": config.runtime,
            "device": config.device,
            "threads": config.threads,
            "variant": config.variant,
        }
        if "error" in r:
            row["error"] = r["error"]
        else:
            row.update(
                prefill_ms_min=r["prefill_ms"]["min"],
                prefill_ms_median=r["prefill_ms"]["median"],
                decode_ms_min=r["decode_ms_per_token"]["min"],
                decode_ms_median=r["decode_ms_per_token"]["median"],
                first_prefill_ms=r["first_run"]["prefill_ms"],
                first_decode_ms=r["first_run"]["decode_ms_per_token"],
                load_ms=r.get("load_ms"),
                peak_rss_mb=r["peak_rss_mb"],
                prefill_tok_s=prompt_tokens / r["prefill_ms"]["min"] * 1e3,
                decode_tok_s=1e3 / r["decode_ms_per_token"]["min"],
                error="",
            )
        rows.append(row)
    return rows


def ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Each row's prefill and decode time over the baseline row's (same run)."""
    base = next((r for r in rows if r["config"] == baseline and not r.get("error")), None)
    if base is None:
        return []
    return [
        {
            "config": r["config"],
            "baseline": baseline,
            "prefill_ratio": r["prefill_ms_min"] / base["prefill_ms_min"],
            "decode_ratio": r["decode_ms_min"] / base["decode_ms_min"],
        }
        for r in rows
        if not r.get("error")
    ]
