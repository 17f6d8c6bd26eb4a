"""The two ways the codec rounds the exact quotient ``d/s`` agree with exact arithmetic.

The kernel multiplies by the block's reciprocal and settles the quotients that land near a
half-integer with :func:`tw_triton.codecs.blockwise.nearest_integer_at_ties` (fp32 ops only:
:func:`tw_triton.ops.reference.nearest_integer_by_reciprocal`); the CPU torch path rounds an fp64 quotient (a product by the fp64 inverse,
snapped to ``2**-30``, at 8 bits; a division at 4 bits), half a chunk or a whole chunk at a
time. Both are checked here against the Fraction-exact oracle on deltas built to sit on and
next to half-integer multiples of their scale, normal and subnormal scales alike. The
kernel's method is exercised here directly on CPU, without the Triton interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _codec_oracle import near_half_log2_blocks, near_tie_blocks, nearest_integer, scale_of, spec_encode

import tw_triton
from tw_triton.codecs import blockwise as codec
from tw_triton.ops.reference import buffers, levels, log2_levels_by_reciprocal, nearest_integer_by_reciprocal

# (lowest, highest) log2 of the scales: normal ones, and subnormal ones where d/s has up to
# 24 significant bits against a short scale.
SCALE_RANGES = [(-20.0, 20.0), (-148.0, -127.0)]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("log2_lo,log2_hi", SCALE_RANGES)
def test_kernel_tie_method_matches_exact_rounding(bits, log2_lo, log2_hi):
    rng = np.random.default_rng(bits * 1000 + int(-log2_lo))
    block = 64
    d = near_tie_blocks(rng, 64, block, bits, log2_lo, log2_hi).reshape(64, block)
    s = scale_of(np.abs(d).max(axis=1), bits)[:, None]
    with np.errstate(all="ignore"):
        v = (d / s).astype(np.float32)  # numpy divides fp32 by fp32 correctly rounded
    at_half = (np.abs(v - np.rint(v)) == 0.5) & (s > 0)
    # The generator is built to produce these: an empty set would make the test vacuous.
    assert at_half.sum() > 100
    dt = torch.from_numpy(d[at_half])
    st = torch.from_numpy(np.broadcast_to(s, d.shape)[at_half].copy())
    got = codec.nearest_integer_at_ties(torch.from_numpy(v[at_half]), dt, st)
    want = nearest_integer(d[at_half], np.broadcast_to(s, d.shape)[at_half])
    assert np.array_equal(got.numpy().astype(np.int64), want)
    # And rne(v) alone is wrong for some of them: the settling is doing work.
    assert np.any(np.rint(v[at_half]).astype(np.int64) != want)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("log2_lo,log2_hi", [*SCALE_RANGES, (-70.0, -58.0)])
def test_kernel_reciprocal_method_matches_exact_rounding(bits, log2_lo, log2_hi):
    """Deltas within 24 ulps of half-integer multiples of their scale (and scales on both
    sides of the 2**-64 rescaling), where one multiply by the reciprocal can land on the
    wrong side of the half-integer."""
    rng = np.random.default_rng(bits * 7 + int(-log2_lo))
    block = 64
    d = near_tie_blocks(rng, 512, block, bits, log2_lo, log2_hi).reshape(512, block)
    s = scale_of(np.abs(d).max(axis=1), bits)[:, None]
    body = d[:, 1:]  # the absmax stays where it is
    moved = np.abs(body).view(np.int32) + rng.integers(-24, 25, body.shape).astype(np.int32)
    d[:, 1:] = np.copysign(np.maximum(moved, 0).view(np.float32), body)
    want = nearest_integer(d, s)
    got = nearest_integer_by_reciprocal(torch.from_numpy(d), torch.from_numpy(s))
    assert np.array_equal(got.numpy().astype(np.int64), want)
    # The exact step is doing work: rounding the approximate quotient alone is wrong for some.
    f = np.where(s < 2.0**-64, np.float32(2.0**64), np.float32(1.0))
    with np.errstate(all="ignore"):
        v = (d * f) * (np.float32(1.0) / (s * f))
    assert np.any(np.rint(v).astype(np.int64) != want)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("log2_lo,log2_hi", SCALE_RANGES)
def test_fp64_quotient_path_matches_spec_across_sub_chunks(monkeypatch, bits, log2_lo, log2_hi):
    """Chunks of 3 blocks of 32: at 8 bits the fp64 quotients go 2 blocks then 1 at a time,
    and the last chunk is partial (a tail shorter than a block)."""
    monkeypatch.setattr(buffers, "CHUNK_ELEMENTS", 96)
    rng = np.random.default_rng(bits + int(-log2_lo))
    block = 32
    d = near_tie_blocks(rng, 40, block, bits, log2_lo, log2_hi)[: 40 * block - 13]
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.from_numpy(d).to(dtype)
        q = tw_triton.quantize(x, bits=bits, block=block)
        codes, scales = spec_encode(x.to(torch.float32).numpy(), None, bits, block)
        assert np.array_equal(q.scales.numpy().view(np.int32), scales.view(np.int32))
        assert np.array_equal(q.codes.numpy(), codes)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_log2_reciprocal_method_matches_division(bits):
    """The log2 encode kernel's levels, ``rne(fl(a / step))`` by a multiply and a division
    only near a half-integer, against the division everywhere, on quotients built to sit
    next to half-integers."""
    rng = np.random.default_rng(bits)
    x = near_half_log2_blocks(rng, 4096, 64, bits)
    t = torch.from_numpy(x.view(np.int32)).view(4096, 64)
    lo, hi = t[:, :1], t[:, 1:2]
    step = (hi - lo).to(torch.float32) / float(levels(bits))
    a = (t - lo).to(torch.float32)
    want = torch.round(a / step)
    assert torch.equal(log2_levels_by_reciprocal(a, step), want)
    # The division is doing work: rounding the product alone is wrong for some.
    assert (torch.round(a * (1.0 / step)) != want).any()
