"""ctypes access to the ggml that llama-cpp-python ships (test helper of tests/test_quants*.py).

* ``ggml_quantize(x, type)``: ``ggml_quantize_chunk`` from libggml-base, the
  function ``llama_model_quantize`` calls per tensor (no importance matrix ->
  ``quantize_row_*_ref``); Q8_K goes through ``quantize_row_q8_K_ref``.
* ``to_float(blocks, type, k)``: ggml's own dequantization (``dequantize_row_*``).
* ``ggml_from_float(x, type)``: the CPU backend's ``from_float`` for a dot type
  (the x86 SIMD ``quantize_row_q8_0`` etc. that a matmul runs on activations).
* ``ggml_vec_dot(w_bytes, a_bytes, type, k)``: the CPU backend's ``vec_dot``.
* ``GGMLDot(ggml, qmatmul)``: a stand-in for one of qlib's ``QMatMul`` whose product is
  ggml's own (``from_float`` + ``vec_dot`` per output, the x86 build's, or with
  ``generic=True`` the scalar reference ``*_generic`` functions): tests/test_position0.py.

``load()`` returns None when llama_cpp is missing, so callers can skip.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from qlib.quants.types import ggml_type


class _Traits(ctypes.Structure):  # ggml.h's ggml_type_traits (libggml-base)
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


class _TraitsCPU(ctypes.Structure):
    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(
    None,
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
)


class GGML:
    def __init__(self, libdir: str):
        self.base = ctypes.CDLL(os.path.join(libdir, "libggml-base.so"))
        self.cpu = ctypes.CDLL(os.path.join(libdir, "libggml-cpu.so"))
        b = self.base
        b.ggml_quantize_chunk.restype = ctypes.c_size_t
        b.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        b.ggml_quantize_chunk.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_void_p]
        b.quantize_row_q8_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        b.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        b.ggml_get_type_traits.argtypes = [ctypes.c_int]
        b.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
        b.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCPU)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]

    def quantize(self, x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None
                 ) -> np.ndarray:  # fmt: skip
        """``ggml_quantize_chunk`` of the rows of ``x`` (``imatrix``: one weight per column;
        the types that need one, ``requires_imatrix``, assert without it)."""
        t = ggml_type(type_name)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], t.row_bytes(x.shape[1])), dtype=np.uint8)
        if t.name == "Q8_K":  # not a storage type: ggml_quantize_chunk refuses it
            self.base.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
        else:
            imatrix = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
            if imatrix is None and self.requires_imatrix(t.name):
                raise ValueError(f"ggml quantizes {t.name} only with an importance matrix")
            self.base.ggml_quantize_chunk(
                t.id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1],
                None if imatrix is None else imatrix.ctypes.data,
            )  # fmt: skip
        return out

    def requires_imatrix(self, type_name: str) -> bool:
        return bool(self.base.ggml_quantize_requires_imatrix(ggml_type(type_name).id))

    def to_float(self, blocks: np.ndarray, type_name: str, k: int) -> np.ndarray:
        """ggml's ``to_float`` (``dequantize_row_*``) of each row of ``blocks``."""
        fn = _FROM_FLOAT(self.base.ggml_get_type_traits(ggml_type(type_name).id).contents.to_float)
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        out = np.zeros((blocks.shape[0], k), dtype=np.float32)
        for i in range(blocks.shape[0]):
            fn(blocks[i].ctypes.data, out[i].ctypes.data, k)
        return out

    def traits(self, type_name: str) -> _TraitsCPU:
        return self.cpu.ggml_get_type_traits_cpu(ggml_type(type_name).id).contents

    def from_float(self, x: np.ndarray, dot_type: str) -> np.ndarray:
        t = ggml_type(dot_type)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], t.row_bytes(x.shape[1])), dtype=np.uint8)
        fn = _FROM_FLOAT(self.traits(dot_type).from_float)
        for i in range(x.shape[0]):
            fn(x[i].ctypes.data, out[i].ctypes.data, x.shape[1])
        return out

    def matmul(self, w: np.ndarray, a: np.ndarray, type_name: str, k: int) -> np.ndarray:
        """``[m, n]`` from ggml's vec_dot of every weight row with every activation row."""
        fn = _VEC_DOT(self.traits(type_name).vec_dot)
        w, a = np.ascontiguousarray(w), np.ascontiguousarray(a)
        out = np.zeros((a.shape[0], w.shape[0]), dtype=np.float32)
        s = ctypes.c_float()
        for i in range(a.shape[0]):
            for j in range(w.shape[0]):
                fn(k, ctypes.addressof(s), 0, w[j].ctypes.data, 0, a[i].ctypes.data, 0, 1)
                out[i, j] = s.value
        return out


class GGMLDot:
    """``y = x @ w.T`` of a qlib ``QMatMul``'s weight, computed by ggml itself.

    ``generic=False``: the CPU backend's ``from_float`` and ``vec_dot`` (what llama.cpp's
    x86 build runs, AVX2 / VNNI order). ``generic=True``: ggml's scalar reference,
    ``quantize_row_<dot>_ref`` and ``ggml_vec_dot_<w>_<dot>_generic``. One ctypes call per
    output: for checks on a few rows, not for speed.
    """

    def __init__(self, ggml: GGML, inner, generic: bool = False):
        from qlib.quants.activations import VEC_DOT_TYPE

        w = inner.qtensor
        self.ggml, self.generic = ggml, generic
        self.type_name, self.dot_type = w.dtype.name, VEC_DOT_TYPE[w.dtype.name]
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[-1])
        self.weight = np.ascontiguousarray(w.data.cpu().numpy().reshape(self.out_features, -1))
        if generic:
            t, d = self.type_name.lower(), self.dot_type.lower()
            vp = ctypes.c_void_p
            vec_dot = ctypes.cast(getattr(ggml.cpu, f"ggml_vec_dot_{t}_{d}_generic"), vp).value
            quant = ctypes.cast(getattr(ggml.base, f"quantize_row_{d}_ref"), vp).value
            self._vec_dot, self._from_float = _VEC_DOT(vec_dot), _FROM_FLOAT(quant)
        else:
            traits = ggml.traits(self.type_name)
            self._vec_dot = _VEC_DOT(traits.vec_dot)
            self._from_float = _FROM_FLOAT(ggml.traits(self.dot_type).from_float)

    def forward(self, x):
        import torch

        lead, k, n = x.shape[:-1], self.in_features, self.out_features
        rows = np.ascontiguousarray(x.reshape(-1, k).float().cpu().numpy())
        acts = np.zeros((rows.shape[0], ggml_type(self.dot_type).row_bytes(k)), dtype=np.uint8)
        out = np.zeros((rows.shape[0], n), dtype=np.float32)
        s = ctypes.c_float()
        for i in range(rows.shape[0]):
            self._from_float(rows[i].ctypes.data, acts[i].ctypes.data, k)
            a = acts[i].ctypes.data
            for j in range(n):
                self._vec_dot(k, ctypes.addressof(s), 0, self.weight[j].ctypes.data, 0, a, 0, 1)
                out[i, j] = s.value
        return torch.from_numpy(out).reshape(*lead, n).to(x.device)

    __call__ = forward


def with_ggml_dots(model, ggml: GGML, generic: bool = False):
    """Swap every QMatMul of a ``ModelWeights`` (7 per layer, the output) for a ``GGMLDot``
    in place; returns the model."""
    owners = [model]
    for layer in model.layers:
        owners += [layer, layer.mlp]
    for owner in owners:
        for attr, value in list(vars(owner).items()):
            if hasattr(value, "qtensor") and hasattr(value, "form"):
                setattr(owner, attr, GGMLDot(ggml, value, generic))
    return model


def load() -> GGML | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return GGML(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
