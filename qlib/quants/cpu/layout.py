"""The weight layouts the C kernels read (``packing`` makes them, ``ops`` passes them).

* ``PackedWeight``: a Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weight as per-row planes for the
  quantized GEMM/GEMV of ``kernels.c`` (code bytes, f16 scales, the minimums and high bits
  of Q4_1 / Q5_*), a Q4_0 / Q4_1 / Q8_0 weight as 16-row panels (``panels``: the same
  kernels' other layout, which the fast engine's layers use; Q4_K too, for ``kquants.c``),
  or a K-quant weight as its GGUF blocks, row after row, for ``kquants.c`` (F32 / F16 /
  BF16 rows the same way, for ``floats.c``);
* ``AmxWeight``: a weight for the AMX kernels of ``prefill.c``, bf16 B tiles or the
  4/8-bit codes in tile order with float32 scales; ``AmxWeightC`` is its C descriptor
  (``amx_weight`` of prefill.c).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..gridquants import X3_BYTES, X4_BYTES, X4_UNIT

# kernels.c's types: ggml's type ids, and qlib's own blocks of 32 for three GGUF types: MXFP4H
# (``d:f16 qs[16]``, 18 bytes: an MXFP4 block's nibbles under its E8M0 scale as an f16, IQ4_NL's
# layout), NVFP4H (``d0:f16 d1:f16 qs[16]``, 20 bytes: two NVFP4 groups of 16, the first's
# codes in the low nibbles under d0, the second's in the high ones under d1) and Q1_0H
# (``d:f16 qs[4]``, 6 bytes: a quarter of a Q1_0 block's signs under its d)
TYPE_CODES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "IQ4_NL": 20,
              "MXFP4H": 61, "NVFP4H": 62, "Q1_0H": 63}  # fmt: skip
# kernels.c's types with panels and no planes: IQ4_NL, MXFP4H, NVFP4H (Q4_0's panel layout,
# NVFP4H Q4_1's record; their nibbles looked up in ggml's levels of the type) and Q1_0H (a
# record's codes 8 masks of signs); ``pack`` makes Q8_0 planes of IQ4_NL's values where panels
# do not fit (MXFP4, NVFP4, Q1_0: their other forms)
PANELS_ONLY = ("IQ4_NL", "MXFP4H", "NVFP4H", "Q1_0H")
# the GGUF types whose weights ``pack`` makes those panels of, where asked for panels
PANEL_FORMS = {"MXFP4": "MXFP4H", "NVFP4": "NVFP4H", "Q1_0": "Q1_0H"}
# int16 words of the m plane per block: Q4_1 its minimum; Q5_0 its qh word; Q5_1 both (the
# row's minimums, then its qh words)
M_WORDS = {"Q4_1": 1, "Q5_0": 2, "Q5_1": 3}
# the weight types of kquants.c (ggml's type ids), read as GGUF blocks: (elements, bytes) a
# block; the float types' rows (floats.c, through kquants.c's entry points) are blocks of one.
# X4 and X3 are qlib's own blocks (60, 59: not GGUF types): the types of ``X4_TYPES`` expanded
# at load (X3: those of ``X3_TYPES``, at most 8 levels, 3-bit indices)
BLOCK_CODES = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_XS": 23,
               "X4": 60, "X3": 59, "F32": 0, "F16": 1, "BF16": 30}  # fmt: skip
BLOCKS = {"Q2_K": (256, 84), "Q3_K": (256, 110),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_XS": (256, 136),
          "X4": (256, X4_BYTES), "X3": (256, X3_BYTES), "F32": (1, 4), "F16": (1, 2),
          "BF16": (1, 2)}  # fmt: skip
# the GGUF types ``pack`` expands into X4 blocks (``gridquants.as_x4``; X3 for
# ``gridquants.X3_TYPES``): the grid i-quants, the ternary types and NVFP4 not packed as panels
# (bf16 rows where its scales do not fit one X4 block's unit)
X4_TYPES = (*X4_UNIT, "NVFP4")
# the GGUF types ``pack`` runs as legacy planes or panels of the same values (``packing._legacy``:
# MXFP4 as Q5_0, Q1_0 as Q4_0; bf16 rows where an MXFP4 scale leaves f16's range), unless they
# go as panels (``PANEL_FORMS``)
LEGACY_TYPES = ("MXFP4", "Q1_0")
# the kernels' rows: k % ROW_MULTIPLE[type] == 0 (K-quants, IQ4_XS, X4: super-blocks of 256;
# NVFP4 rows of 64s that are no whole super-blocks go as bf16 rows)
ROW_MULTIPLE = (
    {t: 256 if BLOCKS.get(t, (1,))[0] == 256 else 64 for t in (*TYPE_CODES, *BLOCK_CODES)}
    | dict.fromkeys(X4_TYPES, 256)
    | {"MXFP4": 64, "Q1_0": 128, "NVFP4": 64}
)
# kernels.c's 16-row panels: its type code | PANELS; per 16 rows and block of 32 a record of
# PANEL_RECORD bytes (codes: Q4_*, IQ4_NL, MXFP4H, NVFP4H 256, Q8_0 512, Q1_0H 64; then 16 f16 d,
# Q4_1: 16 f16 m, NVFP4H: 16 f16 d1)
PANELS = 64
PANEL_RECORD = {"Q4_0": 288, "Q4_1": 320, "Q8_0": 544, "IQ4_NL": 288, "MXFP4H": 288,
                "NVFP4H": 320, "Q1_0H": 96}  # fmt: skip
# Q4_K and IQ4_XS as 16-row panels: kquants.c's type code | PANELS; per 16 rows and super-block
# of 256 K_PANEL_RECORD bytes (the codes (IQ4_XS: indices) four at a time a lane, the decoded
# scales (and Q4_K's mins), d (and dmin))
K_PANEL_RECORD = {"Q4_K": 2368, "IQ4_XS": 2208}
AMX_KINDS = {"bf16": 0, "q4": 1, "q8": 2, "q4g16": 3, "q8g16": 4}  # amx_weight.kind of prefill.c


@dataclass
class PackedWeight:
    """A weight for ``ops.qgemm``: per-row code bytes and f16 scale planes (``TYPE_CODES``),
    or the GGUF blocks themselves (``BLOCK_CODES``: ``codes`` holds them, ``d`` and ``m`` are
    None).

    Per 64 elements of a Q4_* / Q5_* row 32 bytes, byte ``i`` = ``e[i] | e[i + 32] << 4``
    (codes 0..15, as ggml stores them before the -8 of Q4_0; Q5_*'s low 4 bits, their fifth
    bits in ``m``: the blocks' ``qh`` words, ``M_WORDS``); Q8_0: code + 128.

    ``panels`` (Q4_0 / Q4_1 / Q8_0, n % 16 == 0): ``codes`` is ``[n / 16, k / 32 *
    PANEL_RECORD]``, per 16 rows and block the 16 rows' ``qs`` bytes four at a time (64-byte
    vector ``j``, lane ``r``: bytes ``4j .. 4j + 3`` of row ``r``; Q8_0's + 128), their d,
    then their m (kernels.c); ``d`` and ``m`` are None. One vector then holds 4 codes of 16
    rows, so the decode GEMV takes a block of 16 rows in 8 ``vpdpbusd``, and each thread
    reads one stream. Q4_K panels (``K_PANEL_RECORD``; kquants.c's ``qlib_kpanel_put``):
    ``codes`` is ``[n / 16, k / 256 * 2368]``, per 16 rows and super-block 32 vectors of
    4 codes a lane (two steps in the two nibbles), then the rows' scales, mins, d and dmin.
    """

    type_name: str
    n: int
    k: int
    codes: torch.Tensor  # [n, k/2] (Q4_*), [n, k] (Q8_0) uint8; [n, row bytes] (GGUF blocks)
    d: torch.Tensor | None  # [n, k/32] int16 (f16 bits); None for GGUF blocks
    m: torch.Tensor | None  # [n, k/32 * M_WORDS] int16 (Q4_1, Q5_0, Q5_1)
    panels: bool = False

    @property
    def type_code(self) -> int:
        """The C kernels' code of the weight type (and layout: panels | ``PANELS``)."""
        code = TYPE_CODES.get(self.type_name) or BLOCK_CODES[self.type_name]
        return code | PANELS if self.panels else code

    @property
    def blocks(self) -> bool:
        """Whether ``kquants.c`` reads the weight (its GGUF blocks, or Q4_K panels), not
        ``kernels.c`` (planes, or Q4_0 / Q4_1 / Q8_0 panels)."""
        return self.type_name in BLOCK_CODES

    def nbytes(self) -> int:
        ts = (self.codes, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


class AmxWeightC(ctypes.Structure):
    """``amx_weight`` of prefill.c."""

    _fields_ = [("kind", ctypes.c_int), ("t", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p)]  # fmt: skip


@dataclass
class AmxWeight:
    """A weight for the AMX prefill kernels: bf16 B tiles (``kind="bf16"``, from ``pack_amx``),
    or the 4/8-bit codes in tile order with float32 scales per 32 k (``"q4"``, ``"q8"``) or
    per 16 k (``"q4g16"``, ``"q8g16"``: the K-quants with sub-blocks of 16), from
    ``pack_amx_quantized`` or ``pack_amx_codes``, expanded to bf16 tiles per column block
    inside the GEMM."""

    kind: str
    n: int
    k: int
    tiles: torch.Tensor
    d: torch.Tensor | None = None  # [n/16, k/32 or k/16, 16] float32
    m: torch.Tensor | None = None  # as d (None: 0)

    def nbytes(self) -> int:
        ts = (self.tiles, self.d, self.m)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def c_struct(self) -> AmxWeightC:
        """The C descriptor (holds raw pointers: keep this object alive while it is used)."""
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        return AmxWeightC(AMX_KINDS[self.kind], self.tiles.data_ptr(), ptr(self.d), ptr(self.m))
