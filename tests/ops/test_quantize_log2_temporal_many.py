"""``quantize_log2_temporal_many`` (the temporal encode of many tensors per launch) against
the single-tensor torch path, tensor by tensor.

The grouped kernel walks a table of tensors and their references; each tensor's codes and
bounds must be the bytes the torch path gives it alone, and its flag raised exactly where
one of its blocks cannot be coded (a negative, NaN or Inf: bounds ``-1``). Without a GPU
the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton backend's function
called directly); with one, compiled.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _kernel_testing import KERNEL_DEVICE, on_kernel_device, require_runnable_kernels
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton import ops
from tw_triton.codecs import get_codec
from tw_triton.codecs.log2_temporal import group_stored, split_stored
from tw_triton.ops.backends.triton import quantize_log2_temporal_many_cuda
from tw_triton.ops.reference import quantize_log2_temporal_many_torch, quantize_log2_temporal_torch

require_runnable_kernels()
MIN_STEP = 1 << 19
# Around the tile (4096 elements) and block boundaries: whole tiles only, a tail only,
# both, one element.
SIZES = (4096, 5000, 33, 4096 * 2 + 7, 1, 128)


def moments(gen: torch.Generator, n: int, drift: float = 0.05, zeros: float = 0.05):
    """A second moment over ~40 octaves and its reference (the same, some steps earlier),
    with zeros appearing and disappearing and a few jumps (absolute blocks)."""
    ref = torch.pow(2.0, 40 * torch.rand(n, generator=gen, dtype=torch.float64) - 30)
    x = ref * torch.pow(2.0, drift * torch.randn(n, generator=gen, dtype=torch.float64))
    jump = torch.rand(n, generator=gen, dtype=torch.float64) < 0.002
    x = torch.where(jump, x * 2.0**30, x).to(torch.float32)
    ref = ref.to(torch.float32)
    ref[torch.rand(n, generator=gen) < zeros] = 0.0
    x[torch.rand(n, generator=gen) < zeros] = 0.0
    return x, ref


def assert_group_encodes_like_torch(
    xs: list[torch.Tensor],
    refs: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int = MIN_STEP,
    out: list[tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """Encode ``xs`` as one group on the kernel device and each alone with torch on the
    CPU; returns the flags."""
    flags = torch.zeros(len(xs), dtype=torch.int64, device=KERNEL_DEVICE)
    got = quantize_log2_temporal_many_cuda(
        [on_kernel_device(x) for x in xs],
        [on_kernel_device(r) for r in refs],
        bits,
        block,
        min_step,
        flags=flags,
        out=out,
    )
    assert len(got) == len(xs)
    for i, (x, r) in enumerate(zip(xs, refs)):
        want = quantize_log2_temporal_torch(x, r, bits, block, min_step)
        if out is not None:
            assert all(g is o for g, o in zip(got[i], out[i])), f"tensor {i}: not written into out"
        for name, g, w in zip(("codes", "lo", "hi"), got[i], want):
            assert g.dtype == w.dtype and g.shape == w.shape, (i, name)
            assert torch.equal(g.cpu(), w), f"tensor {i}: {name} differ"
        assert int(flags[i]) == int((want[2] < 0).any()), f"tensor {i}: flag {int(flags[i])}"
    return flags


@pytest.mark.parametrize("bits,block", [(4, 128), (8, 32), (2, 4096)])
def test_a_group_gives_each_tensor_its_own_bytes_and_flags_the_uncodable(bits, block) -> None:
    gen = torch.Generator().manual_seed(bits + block)
    pairs = [moments(gen, n) for n in SIZES]
    xs, refs = [x for x, _ in pairs], [r for _, r in pairs]
    xs[2][3] = -1.0  # a negative element: that tensor cannot be coded
    xs[3][-1] = float("nan")  # in the tail tile
    xs[0][100] = float("inf")  # in a whole tile
    flags = assert_group_encodes_like_torch(xs, refs, bits, block)
    assert flags.tolist() == [1, 0, 1, 1, 0, 0]


def test_the_codecs_layout_is_written_in_place_and_other_outputs_are_filled() -> None:
    gen = torch.Generator().manual_seed(11)
    pairs = [moments(gen, n) for n in SIZES]
    xs, refs = [x for x, _ in pairs], [r for _, r in pairs]
    # The codec's stored buffers: bounds, then codes on 16 bytes, one buffer for the group.
    stored = group_stored(list(SIZES), 128, KERNEL_DEVICE)
    assert all(
        s.data_ptr() + 8 * -(-n // 128) == s[8 * -(-n // 128) :].data_ptr() for s, n in zip(stored, SIZES)
    )
    assert {s.untyped_storage().data_ptr() for s in stored} == {stored[0].untyped_storage().data_ptr()}
    out = [split_stored(s, n, 128) for s, n in zip(stored, SIZES)]
    assert all(codes.data_ptr() % 16 == 0 for codes, _, _ in out)
    assert_group_encodes_like_torch(xs, refs, 4, 128, out=out)
    # Buffers the kernel cannot write where they are (separate, codes 1 byte off): filled.
    odd = []
    for n in SIZES:
        nb = -(-n // 128)
        codes = torch.empty(n + 1, dtype=torch.uint8, device=KERNEL_DEVICE)[1:]
        odd.append(
            (
                codes,
                torch.empty(nb, dtype=torch.int32, device=KERNEL_DEVICE),
                torch.empty(nb, dtype=torch.int32, device=KERNEL_DEVICE),
            )
        )
    assert_group_encodes_like_torch(xs, refs, 4, 128, out=odd)


def test_views_that_are_not_aligned_or_not_contiguous_are_read_in_order() -> None:
    gen = torch.Generator().manual_seed(3)
    x, ref = moments(gen, 9001)
    m, mref = moments(gen, 100 * 90)
    xs = [x[1:], m.view(100, 90).t(), x[4:4100]]  # 4 bytes off, transposed, 16 bytes off
    refs = [ref[1:], mref.view(100, 90).t(), ref[4:4100]]
    assert_group_encodes_like_torch(xs, refs, 4, 128)


def test_flags_are_raised_and_never_cleared() -> None:
    gen = torch.Generator().manual_seed(4)
    x, ref = moments(gen, 300)
    bad = x.clone()
    bad[7] = -2.0
    raised = torch.tensor([1, 0, 0], dtype=torch.int64, device=KERNEL_DEVICE)
    quantize_log2_temporal_many_cuda(
        [on_kernel_device(t) for t in (x, x, bad)], [on_kernel_device(ref)] * 3, 4, 64, MIN_STEP, flags=raised
    )
    assert raised.tolist() == [1, 0, 1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=4),
    bits=st.sampled_from([8, 4, 2]),
    block=st.sampled_from([32, 128, 512, 4096]),
    drift=st.sampled_from([0.0, 0.05, 2.0]),
    min_step=st.sampled_from([1, MIN_STEP, 1 << 29]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_group_matches_the_torch_path(sizes, bits, block, drift, min_step, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    pairs = [moments(gen, n, drift=drift) for n in sizes]
    xs, refs = [x for x, _ in pairs], [r for _, r in pairs]
    if seed % 3 == 0:  # now and then an uncodable tensor
        xs[0][seed % sizes[0]] = -1.0
    assert_group_encodes_like_torch(xs, refs, bits, block, min_step)


def test_the_reference_op_writes_into_out_and_raises_the_flags() -> None:
    gen = torch.Generator().manual_seed(5)
    pairs = [moments(gen, n) for n in (700, 5000)]
    xs, refs = [x for x, _ in pairs], [r for _, r in pairs]
    xs[1][4999] = float("nan")
    stored = group_stored([700, 5000], 128, torch.device("cpu"))
    out = [split_stored(s, x.numel(), 128) for s, x in zip(stored, xs)]
    flags = torch.zeros(2, dtype=torch.int64)
    got = quantize_log2_temporal_many_torch(xs, refs, 4, 128, MIN_STEP, flags=flags, out=out)
    assert flags.tolist() == [0, 1]
    for x, r, g, o in zip(xs, refs, got, out):
        assert all(a is b for a, b in zip(g, o))
        for a, b in zip(g, quantize_log2_temporal_torch(x, r, 4, 128, MIN_STEP)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kernel", [False, True])
def test_the_codecs_grouped_encode_gives_the_bytes_of_its_encode(kernel) -> None:
    """``Log2TemporalCodec.encode_group`` (the op through the dispatch: the torch
    reference, or the kernel) stores what ``encode`` stores for each tensor alone."""
    codec = get_codec("log2-temporal")
    params = codec.resolve_params({}, bits=4, block=128)
    gen = torch.Generator().manual_seed(6)
    pairs = [moments(gen, n) for n in (5000, 33, 4096)]
    xs, refs = [x.view(-1, 1) for x, _ in pairs], [r.view(-1, 1) for _, r in pairs]
    xs[1][0, 0] = -1.0
    assert all(codec.group_key(x, params, r) == () for x, r in zip(xs, refs))
    assert codec.group_key(xs[0], params, None) is None  # no reference: alone
    assert codec.group_key(xs[0], params, refs[1]) is None  # another shape: alone
    flags = torch.zeros(len(xs), dtype=torch.int64, device=KERNEL_DEVICE)
    dev = [on_kernel_device(t) for t in xs], [on_kernel_device(t) for t in refs]
    backend = ops.using("quantize_log2_temporal_many", KERNEL_DEVICE.type, quantize_log2_temporal_many_cuda)
    with backend if kernel else contextlib.nullcontext():
        grouped = codec.encode_group(*dev[:1], params, dev[1], flags)
    assert flags.tolist() == [0, 1, 0]
    for x, r, enc in zip(xs, refs, grouped):
        alone = codec.encode(x, params, r).entry
        assert (enc.entry.params, enc.entry.shape, enc.entry.dtype) == (
            alone.params,
            alone.shape,
            alone.dtype,
        )
        assert torch.equal(enc.entry.buffers["codes"].cpu(), alone.buffers["codes"])
