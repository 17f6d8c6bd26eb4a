"""The bitmask kernels against the torch reference (the spec): identical mask and values,
and the same decoded bits.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (conftest.py);
with one they run compiled on CUDA tensors and are compared with the CPU torch path.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import (
    FLOATS,
    KERNEL_DEVICE,
    bit_patterns,
    numels,
    on_kernel_device,
    require_runnable_kernels,
    same_bits,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton.errors import QuantizationError
from tw_triton.kernels import bitmask_decode, bitmask_encode, mask_popcount
from tw_triton.kernels.bitmask import TILE
from tw_triton.ops.reference.bitmask import (
    bitmask_decode_torch,
    bitmask_encode_torch,
    mask_popcount_torch,
    nonzero_count,
)

require_runnable_kernels()


def assert_like_torch(x: torch.Tensor, *, given_count: bool) -> None:
    want_mask, want_values = bitmask_encode_torch(x)
    xd = on_kernel_device(x)
    nnz = int(nonzero_count(xd)) if given_count else None
    mask, values = bitmask_encode(xd, nnz)
    assert mask.device.type == KERNEL_DEVICE.type
    assert torch.equal(mask.cpu(), want_mask), (
        f"mask differs at bytes {(mask.cpu() != want_mask).nonzero()[:8].flatten().tolist()}"
    )
    assert same_bits(values.cpu(), want_values)
    # Each side's decode of the reference's buffers.
    back = bitmask_decode(on_kernel_device(want_mask), on_kernel_device(want_values), x.numel())
    assert same_bits(back.cpu(), bitmask_decode_torch(want_mask, want_values, x.numel()))
    assert same_bits(back.cpu(), x.reshape(-1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    dtype=st.sampled_from(FLOATS),
    zeros=st.sampled_from((0.0, 0.5, 0.97, 1.0)),
    given_count=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_bitmask_kernels_are_byte_identical_to_torch(numel, dtype, zeros, given_count, seed) -> None:
    x = bit_patterns(torch.Generator().manual_seed(seed), numel, dtype, zeros)
    assert_like_torch(x, given_count=given_count)


@pytest.mark.parametrize("dtype", FLOATS)
def test_bitmask_kernels_across_tiles(dtype) -> None:
    """Whole tiles, a masked tail, tiles with no value and tiles with no zero: each tile's
    start in ``values`` comes from the ones before it."""
    gen = torch.Generator().manual_seed(11)
    n = 3 * TILE + 77
    x = bit_patterns(gen, n, dtype, 0.5)
    x[:TILE] = 0  # a tile with nothing to keep
    x[TILE : 2 * TILE] = bit_patterns(gen, TILE, dtype, 0.0)  # and one with no zero
    assert_like_torch(x, given_count=True)
    assert_like_torch(x[: 2 * TILE].clone(), given_count=False)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=st.sampled_from((0, 1, 7, 8, 9, 100, TILE - 1, TILE, TILE + 3, 2 * TILE + 13)),
    density=st.sampled_from((0.0, 0.3, 1.0)),
    padding=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mask_popcount_kernel_matches_torch(numel, density, padding, seed) -> None:
    """The decode's check of a stored mask: set bits among the first ``numel`` and whether a
    padding bit is set, the same as the reference's (which counts with ``bincount``)."""
    gen = torch.Generator().manual_seed(seed)
    bits = (torch.rand((numel + 7) // 8 * 8, generator=gen) < density).to(torch.int64)
    if padding and numel % 8:
        bits[numel] = 1
    else:
        bits[numel:] = 0
    mask = (bits.view(-1, 8) << torch.arange(8)).sum(1).to(torch.uint8)
    got = mask_popcount(on_kernel_device(mask), numel).cpu()
    want = mask_popcount_torch(mask, numel)
    assert torch.equal(got, want)
    assert want.tolist() == [int(bits[:numel].sum()), int(padding and numel % 8 != 0)]


def test_bitmask_kernel_reads_and_writes_within_values() -> None:
    """A mask with more set bits than there are values (a crafted file) gathers zeros past
    the end instead of reading beyond the buffer; a count too small stores fewer values."""
    n = 100
    mask = torch.full(((n + 7) // 8,), 255, dtype=torch.uint8)
    values = torch.arange(1, 11, dtype=torch.float32)
    out = bitmask_decode(on_kernel_device(mask), on_kernel_device(values), n).cpu()
    assert torch.equal(out[:10], values) and not out[10:].any()
    mask, kept = bitmask_encode(on_kernel_device(torch.ones(n)), 10)
    assert kept.numel() == 10 and torch.equal(kept.cpu(), torch.ones(10))


def test_bitmask_kernels_reject_what_they_cannot_read() -> None:
    x = torch.ones(64, 2, device=KERNEL_DEVICE)
    with pytest.raises(QuantizationError, match="contiguous"):
        bitmask_encode(x.t())
    with pytest.raises(QuantizationError, match="float32"):
        bitmask_encode(torch.ones(8, dtype=torch.int32, device=KERNEL_DEVICE))
    with pytest.raises(QuantizationError, match="mask"):
        bitmask_decode(torch.zeros(3, dtype=torch.uint8, device=KERNEL_DEVICE), x.reshape(-1), 64)
    with pytest.raises(QuantizationError, match="mask_popcount"):
        mask_popcount(torch.zeros(3, dtype=torch.uint8, device=KERNEL_DEVICE), 64)
