"""The CPU quantized matmul with ggml semantics: ``y = x @ w.T``.

As ggml's CPU backend does, each activation row is first quantized to the
weight's dot type (``VEC_DOT_TYPE``, x86 rounding, see ``activations``); the
product is then a sum over scale groups ``g`` (16 or 32 weights sharing a scale)
of integer dot products, accumulated in float32:

    y[i, j] = sum_g  w_scale[g, j] * a_scale[i, g] * isum[g, j, i]
            + sum_g  w_offset[g, j] * a_sum[i, g]

``isum`` (codes times codes over one group) is an exact integer: at most
32 * 127 * 127 < 2**24, so it is exact in float32 whatever the summation order.
Two ways compute it, by the number of rows ``m``:

* few rows (``m <= _INT_ROWS``): one int8 x int8 -> int32 matmul
  (``torch._int_mm``) of a block-diagonal activation matrix (one row per
  row-and-group) with the int8 weight codes: the weight is read once, as bytes;
* more rows: the codes of a tile of weight rows are converted to float32 and a
  batched float32 matmul over groups, ``[G, n, group] @ [G, group, m]``, gives
  the same exact integers.

Only the combination rounds (elementwise products, then a pairwise tree sum
over ``g`` in a fixed order), and it is the same code for both ways and every
row, so a row's result never depends on the other rows. Results match ggml's
``vec_dot`` to float rounding, not bit for bit (ggml adds its per-block terms
one after the other). F32/F16/BF16 weights (ggml's ``vec_dot_f16`` etc.): the
row is rounded to the weight's type and multiplied in float32, one
matrix-vector product per row (slow for many rows; QMatMul's default form for
float weights is "f32" anyway).

``prepare(w)`` unpacks codes (int8, one byte per weight) and float32 scales
once; ``qmatmul(x, w)`` caches that per QTensor (keyed by its data tensor).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..activations import ACT_BLOCK, VEC_DOT_TYPE, quantize_activations
from ..api import block_format, dequantize_torch
from .layout import PANEL_FORMS
from .ops import qgemm
from .packing import pack, supports

_INT_ROWS = 8  # up to this many rows: block-diagonal int8 matmul
# types the C kernels run with other activations than ggml's dot product takes unless packed as
# panels (NVFP4 as X4 blocks: Q8_K, where ggml's NVFP4 dot takes Q8_0; its NVFP4H panels take
# Q8_0): the faithful matmul keeps torch's for those weights whose rows do not come in 16s
OTHER_DOT = ("NVFP4",)
_HAS_INT_MM = hasattr(torch, "_int_mm")  # private torch API (CPU int8 x int8 -> int32)
_TILE_FLOATS = 1 << 21  # float32 elements of one [G, n_tile, m_tile] tile of group sums
_N_TILE = 1024


@dataclass
class PreparedWeight:
    """A weight unpacked for ``qmatmul``: int8 codes and float32 scales per group."""

    type_name: str
    dot_type: str
    shape: tuple[int, int]  # (n, k)
    group: int
    codes: torch.Tensor | None  # [n, k] int8 (quantized types)
    scales: torch.Tensor | None  # [G, n] float32
    offsets: torch.Tensor | None  # [G, n] float32, or None
    dense: torch.Tensor | None  # [n, k] float32 (F32 / F16 / BF16 weights)

    def nbytes(self) -> int:
        ts = (self.codes, self.scales, self.offsets, self.dense)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def prepare(w) -> PreparedWeight:
    """Unpack a 2-D ``QTensor`` once for repeated ``qmatmul`` calls."""
    name = w.dtype.name
    if name not in VEC_DOT_TYPE:
        raise NotImplementedError(f"no quantized matmul for {name} weights (ggml has no vec_dot)")
    n, k = int(w.shape[0]), int(w.shape[-1])
    if len(w.shape) != 2:
        raise ValueError(f"qmatmul needs a 2-D weight, got shape {list(w.shape)}")
    dot = VEC_DOT_TYPE[name]
    if name in ("F32", "F16", "BF16"):
        dense = dequantize_torch(w.data.cpu(), name, (n, k))
        return PreparedWeight(name, dot, (n, k), 1, None, None, None, dense)
    fmt = block_format(name)
    q, scale, offset = fmt.unpack(w.data.cpu().reshape(-1, fmt.type_size))
    group = fmt.block_size // scale.shape[1]
    act_block = ACT_BLOCK[dot]
    if group > act_block:  # Q1_0: one scale a 128 weights, Q8_0 activations a 32
        scale = scale.repeat_interleave(group // act_block, dim=1)
        group = act_block
    G = k // group

    def per_group(t):
        return t.reshape(n, G).t().contiguous()

    codes = q.reshape(n, k).to(torch.int8).contiguous()
    offsets = per_group(offset) if offset is not None else None
    return PreparedWeight(name, dot, (n, k), group, codes, per_group(scale), offsets, None)


# QTensor has __slots__ without __weakref__, so the cache is keyed by its data
# tensor: id -> (weakref to the data, PreparedWeight); an entry dies with its data.
_CACHE: dict[int, tuple[weakref.ref, PreparedWeight]] = {}


def _prepared(w) -> PreparedWeight:
    if isinstance(w, PreparedWeight):
        return w
    key = id(w.data)
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is w.data and hit[1].type_name == w.dtype.name:
        return hit[1]
    pw = prepare(w)
    _CACHE[key] = (weakref.ref(w.data, lambda _, key=key: _CACHE.pop(key, None)), pw)
    return pw


# the same for the C kernels' repacked planes (qlib.quants.cpu), keyed by the data tensor
_PACKED: dict[int, tuple[weakref.ref, object]] = {}


def _packed(w):
    """The C kernel's ``PackedWeight`` for ``w``, or None when the kernel cannot take it."""
    if isinstance(w, PreparedWeight) or len(w.shape) != 2:
        return None
    name = w.dtype.name
    if not supports(name, int(w.shape[-1])) or (name in OTHER_DOT and int(w.shape[0]) % 16):
        return None
    key = id(w.data)
    hit = _PACKED.get(key)
    if hit is not None and hit[0]() is w.data:
        return hit[1]
    # (IQ4_NL: Q8_0 planes of its values; MXFP4, NVFP4, Q1_0: their panels, ``pack``)
    pw = pack(w, panels=name in PANEL_FORMS)
    if name in OTHER_DOT and pw.type_name not in PANEL_FORMS.values():
        return None
    _PACKED[key] = (weakref.ref(w.data, lambda _, key=key: _PACKED.pop(key, None)), pw)
    return pw


def clear_cache() -> None:
    """Drop every cached ``PreparedWeight`` and packed weight."""
    _CACHE.clear()
    _PACKED.clear()


def _group_sums_int(pw: PreparedWeight, a_codes: torch.Tensor) -> torch.Tensor:
    """``[G, n, m]`` exact group sums via one int8 matmul with block-diagonal activations."""
    m, k = a_codes.shape
    G, group = k // pw.group, pw.group
    blockdiag = torch.zeros(G, m, G, group, dtype=torch.int8)
    idx = torch.arange(G)
    blockdiag[idx, :, idx] = a_codes.to(torch.int8).view(m, G, group).transpose(0, 1)
    isum = torch._int_mm(blockdiag.view(G * m, k), pw.codes.t())  # [G*m, n]
    return isum.view(G, m, -1).transpose(1, 2).float().contiguous()


def _tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by pairwise halving, in place: a fixed order for every element.

    (``torch.sum``'s order depends on the tensor's shape, which would make a row's
    result depend on how many rows are computed with it.)
    """
    size = t.shape[0]
    while size > 1:
        half = size // 2
        t[:half].add_(t[half : 2 * half])
        if size % 2:
            t[half].copy_(t[size - 1])
        size = half + size % 2
    return t[0]


def _dense(x_codes: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float weights: one matrix-vector product per row (the same kernel for every row)."""
    return torch.stack([torch.mv(weight, row) for row in x_codes])


def qmatmul_prepared(x: torch.Tensor, pw: PreparedWeight) -> torch.Tensor:
    """``x @ w.T`` on CPU for ``x`` ``[m, k]`` float32 and a prepared weight; ``[m, n]`` float32."""
    n, k = pw.shape
    m = x.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=torch.float32)
    act = quantize_activations(x, pw.dot_type)
    if pw.dense is not None:  # ggml_vec_dot_f16 / bf16 / f32: rounded activations, f32 sums
        return _dense(act.codes, pw.dense)
    group = pw.group
    G = k // group
    a_scale = act.group_scale(group).t()[:, None, :]  # [G, 1, m]
    a_sum = act.group_sum(group).t()[:, None, :] if pw.offsets is not None else None
    out = torch.empty(m, n, dtype=torch.float32)

    def combine(t: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> None:
        t.mul_(pw.scales[:, j0:j1, None]).mul_(a_scale[:, :, i0:i1])
        if a_sum is not None:
            t.addcmul_(pw.offsets[:, j0:j1, None], a_sum[:, :, i0:i1])
        out[i0:i1, j0:j1] = _tree_sum(t).t()

    if m <= _INT_ROWS and _HAS_INT_MM:
        combine(_group_sums_int(pw, act.codes), 0, m, 0, n)
        return out
    a_t = act.codes.view(m, G, group).permute(1, 2, 0).contiguous()  # [G, group, m]
    n_tile = min(n, _N_TILE)
    m_tile = max(1, _TILE_FLOATS // (G * n_tile))
    for j0 in range(0, n, n_tile):
        j1 = min(n, j0 + n_tile)
        w = pw.codes[j0:j1].float().view(j1 - j0, G, group).transpose(0, 1)  # [G, nt, group]
        for i0 in range(0, m, m_tile):
            i1 = min(m, i0 + m_tile)
            combine(torch.bmm(w, a_t[:, :, i0:i1]), i0, i1, j0, j1)  # exact sums [G, nt, mt]
    return out


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ w.T`` for a 2-D ``QTensor`` ``w`` (``shape`` = (n, k)), ggml semantics on CPU.

    ``x``: ``[m, k]``; f16/bf16 inputs are computed in float32 and the result cast
    back (CUDA/MPS inputs: ``qlib.quants.cuda.matmul``). ``w`` may also be a
    ``PreparedWeight``; a QTensor is prepared on first use and cached. Q4_0, Q4_1,
    Q8_0, Q5_0 and Q5_1 weights with rows a multiple of 64, and K-quants (rows a multiple of
    256), go
    through the C kernels of ``qlib.quants.cpu`` when they are available
    (AVX-512 VNNI and a C compiler; ``QLIB_NO_CKERNELS=1`` turns them off): the same
    quantized activations and integer block sums, summed in another order (equal to
    float rounding).
    """
    if x.dim() != 2 or x.shape[1] != w.shape[-1]:
        raise ValueError(f"qmatmul: x {list(x.shape)} does not match weight {list(w.shape)}")
    packed = _packed(w)
    if packed is not None:  # the AVX-512 VNNI kernel: the same ggml semantics, much faster
        y = qgemm(x.float(), packed)
    else:
        y = qmatmul_prepared(x.float(), _prepared(w))
    return y if x.dtype == torch.float32 else y.to(x.dtype)
