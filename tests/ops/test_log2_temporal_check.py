"""The ``log2-temporal`` code check's kernel (a load's, before its decode) against the torch
spec, ``log2_temporal_code_errors_torch``: it passes what the encoder writes and flags
every corruption the spec refuses, in whole tiles and in a ragged tail."""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import KERNEL_DEVICE, require_runnable_kernels
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_log2_temporal_native import MIN_STEP, _checked_cases, pair

from tw_triton import ops
from tw_triton.ops.backends.triton import (
    kernels,
    log2_temporal_code_errors_cuda,
    log2_temporal_code_flags_many_cuda,
)
from tw_triton.ops.reference import (
    log2_temporal_code_errors_torch,
    log2_temporal_code_flags_many_torch,
    quantize_log2_temporal_torch,
)

require_runnable_kernels()


def _flag(codes, lo, hi, ref, bits, block) -> int:
    on = [t.to(KERNEL_DEVICE) for t in (codes, lo, hi, ref)]
    return int(kernels().log2_temporal_check(*on, bits, block).item())


@pytest.mark.parametrize("bits", (8, 4, 2))
@pytest.mark.parametrize("block", (64, 128))
def test_log2_temporal_check_flags_what_the_spec_refuses(bits, block):
    for name, (codes, lo, hi, ref) in _checked_cases(bits, block):
        want = log2_temporal_code_errors_torch(codes, lo, hi, ref, bits, block)
        assert (want is None) == (name == "encoded"), name
        assert _flag(codes, lo, hi, ref, bits, block) == (want is not None), name
        on = [t.to(KERNEL_DEVICE) for t in (codes, lo, hi, ref)]
        # The op the codec calls: None, or the spec's own message naming the culprit.
        assert log2_temporal_code_errors_cuda(*on, bits, block) == want, name


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    bits=st.sampled_from((8, 4, 2)),
    blocks=st.integers(1, 70),
    tail=st.integers(0, 127),
    where=st.floats(0, 1, exclude_max=True),
    what=st.sampled_from(("code", "lo", "hi", "ref", "none")),
    value=st.integers(-(2**31), 2**31 - 1),
)
def test_log2_temporal_check_agrees_with_the_spec_on_any_change(seed, bits, blocks, tail, where, what, value):
    """One element, bound or reference value changed to anything: the kernel's verdict is
    the spec's (both see a change that happens to be valid as valid)."""
    block = 128
    n = blocks * block + tail
    x, ref = pair(torch.Generator().manual_seed(seed), n, "plain", 8.0, 0.01)
    codes, lo, hi = quantize_log2_temporal_torch(x, ref, bits, block, MIN_STEP)
    i = int(where * n)
    b = i // block
    if what == "code":
        codes[i] = value & 0xFF
    elif what == "lo":
        lo[b] = value
    elif what == "hi":
        hi[b] = value
    elif what == "ref":
        ref.view(torch.int32)[i] = value
    want = log2_temporal_code_errors_torch(codes, lo, hi, ref, bits, block)
    assert _flag(codes, lo, hi, ref, bits, block) == (want is not None)


def test_the_codec_decode_refuses_corrupt_codes_through_the_op():
    """``ops.log2_temporal_code_errors`` on the kernels' device is the check kernel (the
    "cuda" backend, here serving the CPU), and the codec's decode raises its message."""
    bits, block = 4, 64
    name, (codes, lo, hi, ref) = _checked_cases(bits, block)[1]
    on = [t.to(KERNEL_DEVICE) for t in (codes, lo, hi, ref)]
    with ops.using("log2_temporal_code_errors", KERNEL_DEVICE.type, log2_temporal_code_errors_cuda):
        got = ops.log2_temporal_code_errors(*on, bits, block)
    assert got == log2_temporal_code_errors_torch(codes, lo, hi, ref, bits, block) and got is not None, name


@pytest.mark.parametrize("bits", (8, 4))
def test_the_grouped_check_flags_each_tensor_as_the_spec_does(bits):
    """The flags a grouped load reads: one per tensor, the spec's verdict on each, for a
    group mixing every corruption with a tensor that passes (whole tiles and tails alike)."""
    block = 64
    cases = _checked_cases(bits, block)  # tails only: 581 elements
    x, ref = pair(torch.Generator().manual_seed(7), 2 * 4096 + 70, "plain", 8.0, 0.01)
    big = (*quantize_log2_temporal_torch(x, ref, bits, block, MIN_STEP), ref)
    assert big[1][100] == 0 and big[1][129] == 0  # temporal blocks, in the whole tiles and the tail
    bad_tile, bad_tail = [t.clone() for t in big], [t.clone() for t in big]
    bad_tile[3][100 * block + 5] = 0.0  # a temporal code over a zero reference, in a whole tile
    bad_tile[0][100 * block + 5] = 1
    bad_tail[2][129] = -5  # bounds no encoder writes, in the tail's last block
    cases += [("encoded", big), ("in a whole tile", tuple(bad_tile)), ("in the tail", tuple(bad_tail))]
    codes, lo, hi, refs = ([c[1][k] for c in cases] for k in range(4))
    on = ([t.to(KERNEL_DEVICE) for t in ts] for ts in (codes, lo, hi, refs))
    got = log2_temporal_code_flags_many_cuda(*on, bits, block)
    want = log2_temporal_code_flags_many_torch(codes, lo, hi, refs, bits, block)
    assert (got.dtype, got.device.type) == (torch.int64, KERNEL_DEVICE.type)
    assert got.cpu().tolist() == want.tolist() == [int(name != "encoded") for name, _ in cases]
    assert len(cases) >= 9  # every kind of corruption, beside the encoder's own outputs
