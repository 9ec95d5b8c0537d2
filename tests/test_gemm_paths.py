"""The two paths of the C matmul kernels: the tiled (GEMM) path that ``qgemm`` takes from
``GEMM_MIN_ROWS`` rows (prefill) and the GEMV loops (decode).

Both quantize each activation row the same way (Q8_0 / Q8_1 / Q8_K, as ggml's x86 backend)
and sum the same exact integer block dots; only the float32 combination of the per-block
terms differs (legacy types, GEMV: 16 partial lanes per pair of blocks, summed at the end;
GEMM: one term per block in block order, as ggml. K-quants, GEMM: the exact products
sc_s * isum_s of the sub-blocks summed in float32, not in int32). So every output agrees to
float rounding: ``TOL`` = 1e-5 x the largest |output| of the product (observed <= 9.2e-7 for
every type at k = 512..8192, m = 300; a wrong code, scale, offset or row moves outputs by 1e-2
and more). Checked for m = 1..300 rows (every remainder of the tiles of 4 activation rows;
tiles of 32 weight rows with n not a multiple of 32), every type of each kernel (Q5_1: the
GEMV loops of ``kquants.c``, the tiled path of ``kernels.c`` on its GGUF blocks), with the
fused RmsNorm / SwiGLU input and accumulate."""

from __future__ import annotations

import pytest
import torch

from qlib.quants import cpu
from qlib.quants.cpu import ops, packing
from qlib.quants.qtensor import QTensor

TOL = 1e-5  # x max |output|: the float32 order of the per-block terms (see above)
PLANES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # kernels.c
BLOCKS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # kquants.c
ROWS = list(range(1, 41)) + [63, 64, 65, 127, 128, 129, 203, 255, 256, 299, 300]

pytestmark = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)


@pytest.fixture
def paths():
    """(gemv, gemm): qgemm with the GEMV loops / the tiled path forced."""

    def run(min_rows, *args, **kw):
        ops.set_gemm_min_rows(min_rows)
        try:
            return cpu.qgemm(*args, **kw)
        finally:
            ops.set_gemm_min_rows(ops.GEMM_MIN_ROWS)

    return (lambda *a, **kw: run(1 << 30, *a, **kw)), (lambda *a, **kw: run(1, *a, **kw))


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(y, ref, rtol=TOL, atol=TOL * ref.abs().max().item())


def _packed(type_name: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return packing.pack(QTensor.quantize(torch.randn(n, k, generator=g), type_name))


@pytest.mark.parametrize("t", PLANES + BLOCKS)
def test_gemm_equals_gemv_every_row_count(t, paths):
    gemv, gemm = paths
    k = 512 if t.endswith("_K") else 576  # k % 256 (K-quants); 576 = 9 x 64 (SmolLM2's width)
    w = _packed(t, 75, k, seed=len(t))  # 75 = 2 x 32 + 11 weight rows
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(1))
    full = gemv(x, w)
    for m in ROWS:
        y = gemm(x[:m], w)
        _close(y, full[:m])
        if m in (4, 37, 300):  # the tiled path's rows do not depend on the other rows
            assert torch.equal(y, gemm(x, w)[:m])


@pytest.mark.parametrize("t", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_1"])
@pytest.mark.parametrize("n,k", [(33, 2048), (100, 1536)])
def test_gemm_equals_gemv_shapes_and_fusions(t, n, k, paths):
    gemv, gemm = paths
    w = _packed(t, n, k, seed=n)
    g = torch.Generator().manual_seed(2)
    m = 21
    x = torch.randn(m, k, generator=g)
    norm = torch.rand(k, generator=g) + 0.5
    _close(gemm(x, w, norm=norm, eps=1e-5), gemv(x, w, norm=norm, eps=1e-5))
    gu = torch.randn(m, 2 * k, generator=g) * 3
    _close(gemm(gu, w, swiglu=True), gemv(gu, w, swiglu=True))
    base = torch.randn(m, n, generator=g)
    a, b = base.clone(), base.clone()
    gemm(x, w, a, accumulate=True), gemv(x, w, b, accumulate=True)
    _close(a, b)


def test_default_threshold():
    """Decode (one row) stays on the GEMV loops; the prefill takes the tiled path."""
    assert 1 < ops.GEMM_MIN_ROWS <= 8


@pytest.mark.parametrize("t", ["Q8_0", "Q5_0", "Q4_1"])
@pytest.mark.parametrize("k", [576, 1536, 2048])
def test_gemv_rows_in_sequence_are_the_same(t, k):
    """The GEMV's Q8_0 rows taken one after the other (``set_gemv_sequential``: the default
    for every k, or up to 1536) give the same outputs bit for bit as 4 rows side by side: the
    same per-row arithmetic, m = 1..3 activation rows, a last group of 3 rows."""
    w = _packed(t, 75, k, seed=k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    runs = []
    try:
        for max_k in (0, 1536, 1 << 20):
            ops.set_gemv_sequential(max_k)
            runs.append([cpu.qgemm(x[:m], w) for m in (1, 2, 3)])
    finally:
        ops.set_gemv_sequential()
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run, strict=True))


def _both_layouts(type_name: str, rows: list[int], k: int, seed: int):
    """One stacked weight (parts of ``rows``) packed as planes and as 16-row panels."""
    g = torch.Generator().manual_seed(seed)
    qs = [QTensor.quantize(torch.randn(r, k, generator=g), type_name) for r in rows]
    return packing.pack(qs), packing.pack(qs, panels=True)


@pytest.mark.parametrize("t", ["Q4_0", "Q4_1", "Q8_0", "IQ4_NL"])
@pytest.mark.parametrize("rows,k", [([16], 64), ([48, 16, 16], 576), ([64], 1536), ([96], 2048)])
def test_panels_equal_planes(t, rows, k, paths):
    """Q4_0 / Q4_1 / Q8_0 / IQ4_NL as 16-row panels (the fast engine's; IQ4_NL's planes are Q8_0
    planes of its values, ``pack``): the GEMV over them equals the
    planes' GEMV to float rounding (one integer block dot of 16 rows per lane, then one
    float term per block, where the planes sum 8 partial lanes), for 1..3 rows, with the fused
    RmsNorm / SwiGLU input and accumulate; the tiled path reads the same tiles from either
    layout, so its outputs are equal bit for bit (n = 16 or 80: a tile of 48 rows cut short);
    rows looked up (a tied embedding) are the same values."""
    gemv, gemm = paths
    planes, panels = _both_layouts(t, rows, k, seed=k + len(rows))
    assert panels.panels and not planes.panels
    assert panels.nbytes() == planes.nbytes() or (t, planes.type_name) == ("IQ4_NL", "Q8_0")
    n = sum(rows)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, k, generator=g)
    for m in (1, 2, 3):
        _close(gemv(x[:m], panels), gemv(x[:m], planes))
    for m in (1, 4, 5, 40):
        assert torch.equal(gemm(x[:m], panels), gemm(x[:m], planes))
    norm = torch.rand(k, generator=g) + 0.5
    _close(gemv(x[:1], panels, norm=norm, eps=1e-5), gemv(x[:1], planes, norm=norm, eps=1e-5))
    gu = torch.randn(2, 2 * k, generator=g) * 3
    _close(gemv(gu, panels, swiglu=True), gemv(gu, planes, swiglu=True))
    base = torch.randn(1, n, generator=g)
    a, b = base.clone(), base.clone()
    gemv(x[:1], panels, a, accumulate=True), gemv(x[:1], planes, b, accumulate=True)
    _close(a, b)
    ids = torch.tensor([0, n - 1, 17 % n, 5, 5])
    assert torch.equal(cpu.dequantize_rows(panels, ids), cpu.dequantize_rows(planes, ids))


def test_panels_only_where_they_fit(monkeypatch):
    """``pack(panels=True)``: panels for Q4_0 / Q4_1 / Q8_0 stacks whose every part has a
    multiple of 16 rows, written piece by piece (``PACK_CHUNK``, 16 rows at a time) to the same
    bytes as in one piece; planes for other types and row counts; the readers of planes alone
    (``dequantize_bf16``, AMX tiles) refuse panels."""
    g = torch.Generator().manual_seed(5)
    q = QTensor.quantize(torch.randn(160, 576, generator=g), "Q4_1")
    whole = packing.pack(q, panels=True)
    monkeypatch.setattr(packing, "PACK_CHUNK", 3000)  # pieces of 16 rows (9 of 320 bytes)
    assert torch.equal(packing.pack(q, panels=True).codes, whole.codes)
    for t, rows in (("Q5_0", [32]), ("Q5_1", [32]), ("Q4_0", [24]), ("Q4_1", [16, 8])):
        qs = [QTensor.quantize(torch.randn(r, 64, generator=g), t) for r in rows]
        assert not packing.pack(qs, panels=True).panels
    for read in (cpu.dequantize_bf16, packing.pack_amx_quantized):
        with pytest.raises(ValueError, match="panels"):
            read(whole)
