"""The keys-outer scores (``attn.c``, ``block_scores_ko``: a float16 cache's single pass, a
float32 cache's three passes) against the earlier kernel (the block converted into a float32
buffer or read in place, then 16 dot products per query head), switched with the A/B hook
``qlib_attn_set_keys_outer``: the same outputs bit for bit, for every shape of the one-pass
piece (1-4 query heads a KV head with d = 32 or 64,
1-2 with d = 128: sub-blocks of 16, 8 and 4 keys), at lengths with and without a partial
last block, pieces cut for the threads and of fixed sizes; and within 2e-5 of a float64
reference (as ``test_long_context.py``'s split-attention test)."""

from __future__ import annotations

import pytest
import torch
from test_long_context import _reference

from qlib.llama import fast_cpu as fast
from qlib.quants import cpu

needs_kernels = pytest.mark.skipif(
    not cpu.available(), reason=f"C kernels unavailable: {cpu.unavailable_reason()}"
)

SHAPES = [(2, 2, 32), (4, 2, 32), (6, 2, 32), (8, 2, 32), (3, 3, 64), (6, 3, 64), (9, 3, 64),
          (8, 2, 64), (2, 2, 128), (4, 2, 128)]  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("kv_type", ["f16", "f32"])
@pytest.mark.parametrize("heads", SHAPES)
def test_keys_outer_equals_earlier_kernel(heads, kv_type):
    n_head, n_kv, d = heads
    lib = cpu.ops._lib()
    cpu.ops.set_attn_two_pass(1)  # a float32 cache's three passes (the AMD default) everywhere
    g = torch.Generator().manual_seed(n_head * 1000 + d)
    ms = 520
    cos, sin = torch.randn(ms, d // 2, generator=g), torch.randn(ms, d // 2, generator=g)
    position = cpu.DecodePosition(cos, sin)
    kc = torch.randn(n_kv, ms, d, generator=g).to(fast.KV_TYPES[kv_type])
    vc = torch.randn(n_kv, ms, d, generator=g).to(fast.KV_TYPES[kv_type])
    out = torch.empty(n_head * d)
    try:
        for pos in (0, 15, 16, 40, 257, 519):
            for split in (0, 32, 48):
                x = torch.randn((n_head + 2 * n_kv) * d, generator=g) * 2
                qkv = x.clone()
                call = cpu.attn_decode_plan(qkv, kc, vc, position, out, n_head=n_head,
                                            n_kv=n_kv, neox=False, split=split)  # fmt: skip
                position.at(pos)
                outs = []
                for keys_outer in (0, 1):
                    lib.qlib_attn_set_keys_outer(keys_outer)
                    qkv.copy_(x)
                    assert call() == 0
                    outs.append(out.clone())
                assert torch.equal(outs[0], outs[1]), (pos, split)
                ref = _reference(x, kc, vc, pos, n_head, n_kv, d, cos, sin)[0]
                err = (outs[1].double() - ref).abs().max().item()
                assert err < 2e-5, (pos, split, err)
    finally:
        lib.qlib_attn_set_keys_outer(1)
        cpu.ops.set_attn_two_pass()


@needs_kernels
@pytest.mark.parametrize("heads", [(3, 3, 64), (9, 3, 64), (8, 2, 64), (2, 2, 128), (4, 2, 32)])
def test_float32_cache_one_pass_and_three_passes(heads):
    """A float32 cache's pieces in one pass (keys and values side by side) and in three passes
    (``set_attn_two_pass``: the keys, the softmax, the values; the default on AMD CPUs): both
    within 2e-5 of a float64 reference, and each the same run to run; the three passes the
    same bits with and without their software prefetch (``set_attn_prefetch``)."""
    n_head, n_kv, d = heads
    g = torch.Generator().manual_seed(n_head * 100 + d)
    ms = 520
    cos, sin = torch.randn(ms, d // 2, generator=g), torch.randn(ms, d // 2, generator=g)
    position = cpu.DecodePosition(cos, sin)
    kc, vc = torch.randn(n_kv, ms, d, generator=g), torch.randn(n_kv, ms, d, generator=g)
    out = torch.empty(n_head * d)
    first = None
    try:
        for pos in (0, 40, 257, 519):
            for split in (0, 48):
                x = torch.randn((n_head + 2 * n_kv) * d, generator=g) * 2
                qkv = x.clone()
                call = cpu.attn_decode_plan(qkv, kc, vc, position, out, n_head=n_head,
                                            n_kv=n_kv, neox=False, split=split)  # fmt: skip
                position.at(pos)
                ref = None
                for two_pass, ahead in ((0, 16), (1, 16), (1, 0)):
                    cpu.ops.set_attn_two_pass(two_pass)
                    cpu.ops.set_attn_prefetch(ahead)
                    qkv.copy_(x)
                    assert call() == 0
                    if ref is None:  # (the call writes the position's k and v rows first)
                        ref = _reference(x, kc, vc, pos, n_head, n_kv, d, cos, sin)[0]
                    err = (out.double() - ref).abs().max().item()
                    assert err < 2e-5, (pos, split, two_pass, err)
                    if two_pass:
                        first = out.clone() if first is None else first
                        assert torch.equal(out, first)
                first = None
    finally:
        cpu.ops.set_attn_two_pass()
        cpu.ops.set_attn_prefetch()
