"""ctypes access to the ggml that llama-cpp-python ships (test helper of tests/test_quants*.py).

* ``ggml_quantize(x, type)``: ``ggml_quantize_chunk`` from libggml-base, the
  function ``llama_model_quantize`` calls per tensor (no importance matrix ->
  ``quantize_row_*_ref``); Q8_K goes through ``quantize_row_q8_K_ref``.
* ``ggml_from_float(x, type)``: the CPU backend's ``from_float`` for a dot type
  (the x86 SIMD ``quantize_row_q8_0`` etc. that a matmul runs on activations).
* ``ggml_vec_dot(w_bytes, a_bytes, type, k)``: the CPU backend's ``vec_dot``.

``load()`` returns None when llama_cpp is missing, so callers can skip.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from qlib.quants.types import ggml_type


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
        self.cpu.ggml_cpu_init()
        self.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCPU)
        self.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]

    def quantize(self, x: np.ndarray, type_name: str) -> np.ndarray:
        t = ggml_type(type_name)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.zeros((x.shape[0], t.row_bytes(x.shape[1])), dtype=np.uint8)
        if t.name == "Q8_K":  # not a storage type: ggml_quantize_chunk refuses it
            self.base.quantize_row_q8_K_ref(x.ctypes.data, out.ctypes.data, x.size)
        else:
            self.base.ggml_quantize_chunk(
                t.id, x.ctypes.data, out.ctypes.data, 0, x.shape[0], x.shape[1], None
            )
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


def load() -> GGML | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return GGML(os.path.join(os.path.dirname(llama_cpp.__file__), "lib"))
