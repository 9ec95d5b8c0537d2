"""Activation quantization for the CPU dot products, as ggml's x86 CPU backend does it.

ggml multiplies a weight of type T by first converting every activation row
to ``VEC_DOT_TYPE[T]`` with the CPU backend's ``from_float`` (ggml-cpu's
``type_traits_cpu``). What runs on x86 (llama.cpp's ``arch/x86/quants.c``,
built with AVX2 or AVX-512, as here) is not the scalar reference:

* Q8_0 and Q8_1 (``quantize_row_q8_0`` / ``quantize_row_q8_1``, AVX2 path):
  ``amax = max|x|``, ``d = amax / 127``, stored as f16; the multiplier is
  ``id = 127 / amax`` (not ``1 / d``) and ``x * id`` is rounded with
  ``_mm256_round_ps(_MM_ROUND_NEAREST)``, i.e. half to **even**, then
  saturated to int8. Q8_1 adds ``s = f16(d * sum(q))`` with the unrounded
  float32 ``d``. The reference ``quantize_row_q8_0_ref`` uses ``1/d`` and
  ``roundf`` (half away from zero); the two differ on ties and near them.
* Q8_K: x86 calls ``quantize_row_q8_K_ref`` itself: ``iscale = -127 / max``
  (``max`` the signed value of largest magnitude), ``nearest_int`` (half to
  even), ``min(127, q)``, ``d = 1 / iscale`` as float32, ``bsums`` per 16.
  The AVX2 repacked Q4_K/Q2_K path (``ggml_quantize_mat_q8_K_4x8``) rounds
  the same way; on a +a/-a tie for the max it takes the positive one, which
  at most flips the signs of both ``d`` and the codes (same products).
* F16 / BF16: the row is rounded to half / bfloat16 (nearest even).

Tests compare these bytes with the ``from_float`` functions of the
``libggml-cpu`` that llama-cpp-python ships (inf, huge and subnormal inputs
included; NaN inputs are not reproduced).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

VEC_DOT_TYPE: dict[str, str] = {
    "F32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "Q4_0": "Q8_0",
    "Q5_0": "Q8_0",
    "Q8_0": "Q8_0",
    "Q4_1": "Q8_1",
    "Q5_1": "Q8_1",
    "Q2_K": "Q8_K",
    "Q3_K": "Q8_K",
    "Q4_K": "Q8_K",
    "Q5_K": "Q8_K",
    "Q6_K": "Q8_K",
    "IQ4_NL": "Q8_0",
    "IQ4_XS": "Q8_K",
    **dict.fromkeys(("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"), "Q8_K"),
    "TQ1_0": "Q8_K",
    "TQ2_0": "Q8_K",
    **dict.fromkeys(("MXFP4", "NVFP4", "Q1_0"), "Q8_0"),
}

ACT_BLOCK: dict[str, int] = {"Q8_0": 32, "Q8_1": 32, "Q8_K": 256, "F32": 1, "F16": 1, "BF16": 1}


@dataclass
class QActivations:
    """Activation rows quantized to a dot type.

    ``codes``: ``[m, k]`` float32 holding the int8 codes (for F16/BF16/F32 the
    rounded values themselves); ``d``: ``[m, k / block]`` float32 block scale
    (Q8_0/Q8_1: the f16-rounded value ggml stores; Q8_K: float32); ``s``: Q8_1's
    ``[m, k / 32]`` f16-rounded ``d * sum(q)``; ``bsums``: Q8_K's ``[m, k / 16]``
    sums of 16 codes (float32, exact).
    """

    dot_type: str
    codes: torch.Tensor
    d: torch.Tensor | None = None
    s: torch.Tensor | None = None
    bsums: torch.Tensor | None = None

    @property
    def block(self) -> int:
        return ACT_BLOCK[self.dot_type]

    def dequantize(self) -> torch.Tensor:
        if self.d is None:
            return self.codes.clone()
        m, k = self.codes.shape
        return (self.codes.view(m, -1, self.block) * self.d.unsqueeze(-1)).reshape(m, k)

    def group_scale(self, group: int) -> torch.Tensor:
        """Activation scale for each weight group of ``group`` elements: ``[m, k / group]``."""
        return self.d.repeat_interleave(self.block // group, dim=1)

    def group_sum(self, group: int) -> torch.Tensor:
        """The term a weight group's offset multiplies: ``[m, k / group]``.

        Q8_1: ggml's stored ``s`` (f16, per 32); Q8_K: ``d * bsum`` over the group.
        """
        if self.dot_type == "Q8_1":
            return self.s
        m = self.codes.shape[0]
        sums = self.bsums.view(m, -1, group // 16).sum(-1)
        return self.group_scale(group) * sums

    def to_bytes(self) -> np.ndarray:
        """ggml's block bytes, ``[m, row_bytes]`` uint8 (for comparison with ggml)."""
        m = self.codes.shape[0]
        t = self.dot_type
        if t in ("F32", "F16", "BF16"):
            dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[t]
            return self.codes.to(dtype).cpu().contiguous().view(torch.uint8).numpy()
        q = self.codes.cpu().to(torch.int8).numpy().reshape(m, -1, self.block).view(np.uint8)
        nb = q.shape[1]
        d = self.d.cpu().numpy()
        if t == "Q8_K":
            fields = [d.astype("<f4")[..., None].view(np.uint8), q]
            bs = self.bsums.cpu().numpy().astype("<i2").reshape(m, nb, 16)
            fields.append(bs.view(np.uint8))
        else:
            fields = [d.astype("<f2")[..., None].view(np.uint8)]
            if t == "Q8_1":
                fields.append(self.s.cpu().numpy().astype("<f2")[..., None].view(np.uint8))
            fields.append(q)
        return np.concatenate(fields, axis=2).reshape(m, -1)


def _rdiv(a: float, t: torch.Tensor) -> torch.Tensor:
    """``a / t`` correctly rounded (torch's ``a / t`` is ``reciprocal(t) * a``)."""
    return torch.full_like(t, a) / t


def _q8_x86(xb: torch.Tensor, with_sum: bool):
    amax = xb.abs().amax(dim=-1)
    d = amax / 127
    inv = torch.where(amax != 0, _rdiv(127.0, amax), torch.zeros_like(amax))
    r = torch.round(xb * inv.unsqueeze(-1))  # _mm256_round_ps: half to even
    # _mm256_cvtps_epi32 gives INT_MIN for inf/NaN/out of range; the packs saturate to int8.
    r = torch.where(r.abs() < 2.0**31, r, torch.full_like(r, -(2.0**31)))
    q = r.clamp(-128, 127)
    s = None
    if with_sum:  # int32 sum of the unsaturated values (wrapping, as the SIMD add does)
        total = r.to(torch.int64).sum(dim=-1)
        total = (total + 2**31) % 2**32 - 2**31
        s = (d * total.float()).half().float()
    return q, d.half().float(), s


def _nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``nearest_int`` bit trick (int32), exact even for inf/NaN/huge inputs."""
    bits = (v + 12582912.0).view(torch.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def _q8_k(xb: torch.Tensor):
    idx = xb.abs().argmax(dim=-1, keepdim=True)  # first of equal magnitudes
    vmax = xb.gather(-1, idx).squeeze(-1)
    zero = vmax == 0
    iscale = _rdiv(-127.0, torch.where(zero, torch.ones_like(vmax), vmax))
    q = _nearest_int(xb * iscale.unsqueeze(-1)).clamp_(max=127)
    q = ((q + 128) & 0xFF) - 128  # stored as int8
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q).float()
    d = torch.where(zero, torch.zeros_like(vmax), _rdiv(1.0, iscale))
    bsums = q.view(q.shape[0], -1, 16).sum(dim=-1).view(q.shape[0], -1)
    return q, d, bsums


def quantize_activations(x: torch.Tensor, dot_type: str) -> QActivations:
    """Quantize each row of ``x`` (``[m, k]``, converted to float32) to ``dot_type``.

    Follows the x86 CPU backend of ggml (see the module docstring); pure torch,
    so it runs on ``x``'s device.
    """
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if x.dim() != 2:
        raise ValueError(f"quantize_activations expects [m, k] rows, got shape {list(x.shape)}")
    x = x.float()
    m, k = x.shape
    block = ACT_BLOCK.get(dot_type)
    if block is None:
        raise ValueError(f"{dot_type} is not a dot type (choose from {', '.join(ACT_BLOCK)})")
    if k % block:
        raise ValueError(
            f"cannot quantize activations to {dot_type}: row length {k} is not a "
            f"multiple of its block size {block}"
        )
    if dot_type == "F32":
        return QActivations(dot_type, x)
    if dot_type == "F16":
        return QActivations(dot_type, x.half().float())
    if dot_type == "BF16":
        return QActivations(dot_type, x.bfloat16().float())
    xb = x.reshape(m, k // block, block)
    if dot_type == "Q8_K":
        q, d, bsums = _q8_k(xb)
        return QActivations(dot_type, q.reshape(m, k), d, bsums=bsums)
    q, d, s = _q8_x86(xb, dot_type == "Q8_1")
    return QActivations(dot_type, q.reshape(m, k), d, s=s)
