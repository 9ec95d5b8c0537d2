"""GGUF -> transformers folder: ``model.safetensors``, ``config.json``, tokenizer files.

The weights are dequantized to float32 (or cast to bf16 / f16), renamed to
transformers' names, and q/k rows are put back in transformers' order. The
config comes from the ``llama.*`` keys, the tokenizer from qlib's ``Tokenizer``
(its ``tokenizers`` backend is saved as ``tokenizer.json``), so that
``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
load the folder offline.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..gguf import open_model
from ..llama.config import NEOX_ARCHITECTURES
from .names import hf_name, permuted_heads, unpermute

HF_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


@dataclass
class ExportReport:
    """What ``gguf_to_hf`` wrote."""

    path: Path
    dtype: str
    tensors: dict[str, tuple[int, ...]]
    config: dict[str, Any]
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    permuted: bool = True

    @property
    def nbytes(self) -> int:
        return (self.path / "model.safetensors").stat().st_size

    def summary(self) -> str:
        return (
            f"{self.path}: {len(self.tensors)} tensors ({self.dtype}), "
            f"{self.nbytes:,} bytes of safetensors, files {', '.join(self.files)}"
        )


ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")  # projections with a bias or not
MLP = ("ffn_gate", "ffn_up", "ffn_down")


def f32_value(v: float) -> float:
    """The shortest decimal that rounds to the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _arch_key(md: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    v = md.get(f"{arch}.{key}", default)
    if v is None:
        raise ValueError(f"cannot find {arch}.{key} in metadata")
    return v


def config_from_metadata(
    md: dict[str, Any], shapes: dict[str, tuple[int, ...]], dtype: str = "F32"
) -> dict[str, Any]:
    """A transformers ``LlamaConfig`` dict from GGUF metadata and tensor shapes."""
    arch = md.get("general.architecture")
    if arch is None:
        raise ValueError("cannot find general.architecture in metadata")
    if arch in NEOX_ARCHITECTURES or arch != "llama":
        raise ValueError(f"only llama-architecture files can be exported, not {arch!r}")
    n_head = int(_arch_key(md, arch, "attention.head_count"))
    n_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head))
    hidden = int(_arch_key(md, arch, "embedding_length"))
    head_dim = int(md.get(f"{arch}.attention.key_length",
                          md.get(f"{arch}.rope.dimension_count", hidden // n_head)))  # fmt: skip
    vocab = shapes["token_embd.weight"][0]
    ffn = shapes["blk.0.ffn_gate.weight"][0] if "blk.0.ffn_gate.weight" in shapes else None
    rope_theta = f32_value(md.get(f"{arch}.rope.freq_base", 10000.0))
    tok = "tokenizer.ggml."
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(md.get(f"{arch}.feed_forward_length", ffn)),
        "num_hidden_layers": int(_arch_key(md, arch, "block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": f32_value(_arch_key(md, arch, "attention.layer_norm_rms_epsilon")),
        # both spellings: transformers 5 reads rope_parameters, older readers rope_theta
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "vocab_size": int(md.get(f"{arch}.vocab_size", vocab)),
        "max_position_embeddings": int(md.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in shapes,
        # transformers has all four attention biases or none (and all three MLP ones):
        # gguf_to_hf writes zeros for those a file lacks
        "attention_bias": any(f"blk.0.{n}.bias" in shapes for n in ATTENTION),
        "mlp_bias": any(f"blk.0.{n}.bias" in shapes for n in MLP),
        "bos_token_id": md.get(tok + "bos_token_id"),
        "eos_token_id": md.get(tok + "eos_token_id"),
        "pad_token_id": md.get(tok + "padding_token_id"),
        "dtype": {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype],
        "use_cache": True,
    }
    if md.get("general.name"):
        cfg["_name_or_path"] = str(md["general.name"])  # read back as general.name
    return cfg


def tokenizer_files(md: dict[str, Any], model_max_length: int) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` texts."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    from ..tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(md)
    backend = HFTokenizer.from_str(tok.backend.to_str())  # a copy: qlib's stays as it is
    names = {
        k: tok.tokens[i] if i is not None else None
        for k, i in (
            ("bos_token", tok.bos_token_id),
            ("eos_token", tok.eos_token_id),
            ("unk_token", tok.unk_token_id),
            ("pad_token", tok.pad_token_id),
        )
    }
    if tok.add_bos_token and tok.bos_token_id is not None:
        bos = names["bos_token"]
        backend.post_processor = TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, tok.bos_token_id)],
        )  # fmt: skip
    special = {k: v for k, v in names.items() if v is not None}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": tok.add_eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    return {
        "tokenizer.json": backend.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2, ensure_ascii=False) + "\n",
    }


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def gguf_to_hf(
    src: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "F32",
    permute: bool = True,
    log: Callable[[str], None] | None = None,
) -> ExportReport:
    """Export a llama GGUF file to a transformers folder (weights, config, tokenizer).

    ``dtype``: F32 (default), BF16 or F16 for the safetensors weights.
    ``permute=False`` leaves q/k rows in llama.cpp's order (a wrong export).
    """
    from safetensors.torch import save_file

    dtype = dtype.upper()
    if dtype not in HF_DTYPES:
        raise ValueError(f"safetensors dtype must be one of {', '.join(HF_DTYPES)}, not {dtype}")
    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open_model(src) as (content, f):
        md = content.metadata
        shapes = {n: i.shape for n, i in content.tensor_infos.items()}
        config = config_from_metadata(md, shapes, dtype)
        n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
        tensors: dict[str, torch.Tensor] = {}
        for name in content.tensor_infos:
            hf = hf_name(name)
            if hf is None:
                raise ValueError(f"no transformers name for GGUF tensor {name!r}")
            w = content.tensor(f, name).dequantize()
            heads = permuted_heads(name, n_head, n_kv)
            if permute and heads is not None:
                w = unpermute(w, heads)
            tensors[hf] = w.to(HF_DTYPES[dtype]).contiguous()
        for i in range(config["num_hidden_layers"]):  # biases transformers needs, as zeros
            for names, on in ((ATTENTION, config["attention_bias"]), (MLP, config["mlp_bias"])):
                for n in names if on else ():
                    hf = hf_name(f"blk.{i}.{n}.bias")
                    if hf not in tensors:
                        rows = shapes[f"blk.{i}.{n}.weight"][0]
                        tensors[hf] = torch.zeros(rows, dtype=HF_DTYPES[dtype])
    tmp = out / ".model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")
    files = {"config.json": json.dumps(config, indent=2) + "\n"}
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    files["generation_config.json"] = json.dumps(gen, indent=2) + "\n"
    if "tokenizer.ggml.tokens" in md:
        files.update(tokenizer_files(md, config["max_position_embeddings"]))
    elif log:
        log("no tokenizer in the GGUF metadata: tokenizer files not written")
    for name, text in files.items():
        _write_text(out / name, text)
    report = ExportReport(
        out, dtype, {k: tuple(v.shape) for k, v in tensors.items()}, config,
        ["model.safetensors", *files], time.perf_counter() - t0, permute,
    )  # fmt: skip
    if log:
        log(report.summary())
    return report
