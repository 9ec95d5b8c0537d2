"""Where qlib's faithful quantized form and llama.cpp part at position 0 (issue 13, item 7).

    .venv/bin/python tools/position0.py [MODEL.gguf] [--ids 1,9690,198]

Runs the ids teacher-forced (one batch from position 0) through llama.cpp (llama-cpp-python,
f32 KV cache, flash attention off) with an eval callback that keeps the input and output of
every weight matmul, and through qlib's faithful quantized form with every QMatMul recorded.
Prints:

1. llama.cpp's matmuls against ggml's own x86 ``from_float`` + ``vec_dot`` on the same
   input: how many outputs differ (0: llama.cpp runs the vec_dot of the weight's type, also
   for a tied Q8_0 output; no other kernel or buffer);
2. max |logit diff| per position: qlib as it is; qlib with every QMatMul replaced by ggml's
   x86 vec_dot; by ggml's scalar reference (``quantize_row_*_ref`` + ``*_generic``);
3. the first weight matmul whose input, quantized to its dot type (Q8_0 / Q8_1 bytes),
   differs between the two engines, and in which blocks: the f16 scale ``d = amax / 127``
   or the codes, with ``amax`` and the nearest f16 rounding midpoint.

Nothing is written. Needs llama-cpp-python; SmolLM2 Q4_1 by default.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # quants_ggml: ctypes access to llama-cpp-python's ggml

import quants_ggml  # noqa: E402

from qlib.llama.engine import load  # noqa: E402
from qlib.quants.activations import VEC_DOT_TYPE  # noqa: E402

DEFAULT = ROOT / "data/models/SmolLM2-135M-Instruct.Q4_1.gguf"
ATTRS = {"attn_q": "attention_wq", "attn_k": "attention_wk", "attn_v": "attention_wv",
         "attn_output": "attention_wo", "ffn_gate": "feed_forward_w1",
         "ffn_down": "feed_forward_w2", "ffn_up": "feed_forward_w3"}  # fmt: skip


class _Base:
    """The few libggml-base functions the eval callback reads a tensor with."""

    def __init__(self, libdir: str):
        self.lib = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
        for fn, res in [("ggml_get_name", ctypes.c_char_p), ("ggml_get_data", ctypes.c_void_p),
                        ("ggml_nelements", ctypes.c_int64), ("ggml_op_desc", ctypes.c_char_p),
                        ("ggml_nbytes", ctypes.c_size_t),
                        ("ggml_is_contiguous", ctypes.c_bool)]:  # fmt: skip
            getattr(self.lib, fn).restype = res
            getattr(self.lib, fn).argtypes = [ctypes.c_void_p]
        self.lib.ggml_type_name.restype = ctypes.c_char_p
        self.lib.ggml_type_name.argtypes = [ctypes.c_int]

    def name(self, t: int) -> str:
        return self.lib.ggml_get_name(t).decode()

    @staticmethod
    def shape(t: int) -> list[int]:  # struct ggml_tensor: type, buffer, ne[4] at byte 16
        return list((ctypes.c_int64 * 4).from_address(t + 16))

    @staticmethod
    def srcs(t: int) -> list[int]:  # ... op, op_params[16], flags, src[10] at byte 152
        return [s for s in (ctypes.c_void_p * 10).from_address(t + 152) if s]

    def f32(self, t: int) -> np.ndarray:
        n = self.lib.ggml_nelements(t)
        assert int(np.prod(self.shape(t))) == n, "ggml_tensor layout differs from this ggml"
        ne = self.shape(t)
        data = (ctypes.c_float * n).from_address(self.lib.ggml_get_data(t))
        return np.ctypeslib.as_array(data).copy().reshape(ne[3] * ne[2] * ne[1], ne[0])


def llama_cpp_run(path: Path, ids: list[int]) -> tuple[np.ndarray, dict]:
    """Logits of every position and {weight name: (input rows, output rows, type, bytes)}."""
    import llama_cpp
    from llama_cpp import llama_cpp as lc

    base = _Base(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
    mats: dict[str, tuple[np.ndarray, np.ndarray, str]] = {}

    def callback(t, ask, _user):
        if ask:
            return True
        src = base.srcs(t)
        if base.lib.ggml_op_desc(t).decode() == "MUL_MAT" and base.name(src[0]).endswith(".weight"):
            wtype = base.lib.ggml_type_name(ctypes.c_int.from_address(src[0]).value).decode()
            n = base.shape(src[0])[1]
            nbytes = base.lib.ggml_nbytes(src[0])
            raw = (ctypes.c_uint8 * nbytes).from_address(base.lib.ggml_get_data(src[0]))
            wbytes = np.ctypeslib.as_array(raw).copy().reshape(n, -1)
            mats[base.name(src[0])] = (base.f32(src[1]), base.f32(t), wtype.upper(), wbytes)
        return True

    cb = lc.ggml_backend_sched_eval_callback(callback)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_ubatch=64,
                          logits_all=True, type_k=0, type_v=0, n_gpu_layers=0, n_threads=2,
                          flash_attn=False, verbose=False)  # fmt: skip
    params = llm.context_params
    params.cb_eval = cb
    ctx = lc.llama_init_from_model(llm.model, params)
    batch = lc.llama_batch_init(len(ids), 0, 1)
    for i, tok in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(ids)
    try:
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        logits = np.ctypeslib.as_array(lc.llama_get_logits(ctx), shape=(len(ids), llm.n_vocab()))
        logits = logits.copy()
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        llm.close()
    return logits, mats


class _Recorded:
    def __init__(self, inner, name: str, store: dict):
        self.inner, self.name, self.store = inner, name, store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.store[self.name] = x.detach().float().reshape(-1, x.shape[-1]).numpy().copy()
        return self.inner.forward(x)

    __call__ = forward


def qlib_logits(path: Path, ids: list[int], dots: str = "qlib", store: dict | None = None):
    """qlib's faithful quantized logits; ``dots``: qlib, ggml (x86 vec_dot) or generic."""
    model, _ = load(path, "cpu", form="quantized")
    if dots != "qlib":
        quants_ggml.with_ggml_dots(model, quants_ggml.load(), generic=dots == "generic")
    if store is not None:
        for i, layer in enumerate(model.layers):
            for short, attr in ATTRS.items():
                owner = layer.mlp if attr.startswith("feed") else layer
                setattr(owner, attr, _Recorded(getattr(owner, attr), f"blk.{i}.{short}", store))
        model.output = _Recorded(model.output, "output", store)
    model.clear_kv_cache()
    with torch.inference_mode():
        return model.forward(torch.tensor([ids]), 0, all_logits=True)[0].float().numpy()


def first_split(mats: dict, qin: dict, ggml) -> str:
    """The first weight matmul whose quantized input differs, described."""
    for name, (x_l, _, wtype, _) in mats.items():
        tied = name in ("output.weight", "token_embd.weight")
        key = "output" if tied else name[: -len(".weight")]
        dot = VEC_DOT_TYPE[wtype]
        a_l, a_q = ggml.from_float(x_l, dot), ggml.from_float(qin[key], dot)
        if (a_l == a_q).all():
            continue
        lines = [f"first differing quantized input: {name} ({wtype} x {dot}), input max|diff| "
                 f"{np.abs(x_l - qin[key]).max():.3g}"]  # fmt: skip
        bs = a_l.shape[1] // (x_l.shape[1] // (256 if dot == "Q8_K" else 32))  # bytes a block
        if dot == "Q8_K":  # super-blocks of 256 with a float32 d: counted, not described
            for row in range(a_l.shape[0]):
                blocks = (a_l[row].reshape(-1, bs) != a_q[row].reshape(-1, bs)).any(1)
                if blocks.any():
                    lines.append(f"  position {row}: {int(blocks.sum())} of {blocks.size} Q8_K "
                                 f"blocks differ, the first {int(np.argmax(blocks))}")  # fmt: skip
            return "\n".join(lines)
        for row in range(a_l.shape[0]):
            bl, bq = a_l[row].reshape(-1, bs), a_q[row].reshape(-1, bs)
            for b in np.nonzero((bl != bq).any(1))[0][:4]:
                dl, dq = bl[b, :2].view(np.float16)[0], bq[b, :2].view(np.float16)[0]
                codes = int((bl[b, bs - 32 :] != bq[b, bs - 32 :]).sum())
                xs_l, xs_q = x_l[row, 32 * b : 32 * b + 32], qin[key][row, 32 * b : 32 * b + 32]
                amax_l, amax_q = np.abs(xs_l).max(), np.abs(xs_q).max()
                ulps = abs(int(amax_l.view(np.int32)) - int(amax_q.view(np.int32)))
                d_l, d_q = (np.float32(a) / np.float32(127) for a in (amax_l, amax_q))
                lo = np.float16(min(d_l, d_q))
                lo = lo if float(lo) <= min(d_l, d_q) else np.nextafter(lo, np.float16(0))
                mid = (float(lo) + float(np.nextafter(lo, np.float16(1)))) / 2
                lines.append(
                    f"  position {row} block {b}: {codes} codes differ; amax {float(amax_l)!r} "
                    f"(llama.cpp) vs {float(amax_q)!r} (qlib), {ulps} ulp apart; amax/127 "
                    f"{float(d_l)!r} vs {float(d_q)!r} around the f16 midpoint {mid!r}; "
                    f"f16 d {float(dl)!r} vs {float(dq)!r}"
                )
        return "\n".join(lines)
    return "no quantized input differs"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=str(DEFAULT))
    ap.add_argument("--ids", default="1", help="comma-separated token ids (default: 1)")
    ap.add_argument("--no-generic", action="store_true", help="skip the scalar-reference run")
    args = ap.parse_args(argv)
    path, ids = Path(args.model), [int(t) for t in args.ids.split(",")]
    ggml = quants_ggml.load()
    if ggml is None:
        sys.exit("llama-cpp-python is not installed")
    lcpp, mats = llama_cpp_run(path, ids)
    differ = total = 0  # llama.cpp's products against ggml's vec_dot on the same inputs
    for x, y, wtype, wbytes in mats.values():
        ref = ggml.matmul(wbytes, ggml.from_float(x, VEC_DOT_TYPE[wtype]), wtype, x.shape[1])
        differ, total = differ + int((ref != y).sum()), total + y.size
    print(f"{path.name}, ids {ids}")
    print(f"1. llama.cpp's {len(mats)} weight matmuls vs ggml's x86 vec_dot on their inputs: "
          f"{differ} of {total} outputs differ")  # fmt: skip
    store: dict = {}
    runs = {"qlib faithful quantized": qlib_logits(path, ids, store=store),
            "qlib, QMatMul = ggml x86 vec_dot": qlib_logits(path, ids, "ggml")}  # fmt: skip
    if not args.no_generic:
        runs["qlib, QMatMul = ggml scalar reference"] = qlib_logits(path, ids, "generic")
    print("2. max |logit diff| against llama.cpp, per position:")
    for name, lg in runs.items():
        print(f"   {name:40s} " + " ".join(f"{v:.3g}" for v in np.abs(lg - lcpp).max(1)))
    print("3. " + first_split(mats, store, ggml))


if __name__ == "__main__":
    main()
