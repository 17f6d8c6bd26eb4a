"""The ``log2`` encode and decode kernels against the torch path (the spec): identical bytes.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (conftest.py);
with one they run compiled on CUDA tensors and are compared with the CPU torch path, with
parameters from the precompiled grid (``ON_GRID``, tests/_kernel_testing.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _codec_oracle import near_half_log2_blocks
from _kernel_testing import (
    BLOCKS,
    FLOATS,
    KERNEL_DEVICE,
    ON_GRID,
    assert_same_bits,
    block_for,
    grid_bits,
    grid_variants,
    max_examples,
    numels,
    on_kernel_device,
    random_floats,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton.codecs.log2 import dequantize_log2_torch, quantize_log2_torch
from tw_triton.errors import QuantizationError
from tw_triton.kernels import dequantize_log2, quantize_log2

require_runnable_kernels()


def assert_round_trips_like_torch(x: torch.Tensor, bits: int, block: int) -> None:
    """Encode and decode on the kernel device and with torch on the CPU: all bytes equal."""
    got = quantize_log2(on_kernel_device(x.contiguous()), bits, block)
    want = quantize_log2_torch(x, bits, block)
    for name, g, w in zip(("codes", "lo", "hi"), got, want):
        assert g.device.type == KERNEL_DEVICE.type
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w), f"{name} differ at {(g.cpu() != w).nonzero()[:8].flatten().tolist()}"
    n = x.numel()
    decoded = dequantize_log2(*(on_kernel_device(t) for t in want), n, bits, block, x.dtype)
    assert_same_bits(decoded, dequantize_log2_torch(*want, n, bits, block, x.dtype), "decode")


def second_moments(gen: torch.Generator, n: int, dtype: torch.dtype, span: int, zeros: float) -> torch.Tensor:
    """Squares of normal draws over ``span`` decades: what exp_avg_sq looks like."""
    lo, hi = (-7, 2) if dtype == torch.float16 else (-40, 30)
    hi = min(hi, lo + span)
    return random_floats(gen, n, dtype, lo, hi, zero_fraction=zeros).abs()


@settings(max_examples=max_examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    dtype=st.sampled_from(FLOATS),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from(BLOCKS),
    grid=st.sampled_from(grid_variants("log2") if ON_GRID else (None,)),
    span=st.integers(0, 40),
    zeros=st.sampled_from((0.0, 0.2, 0.99)),
    seed=st.integers(0, 2**31 - 1),
)
def test_log2_kernels_are_byte_identical_to_torch(numel, dtype, bits, block, grid, span, zeros, seed) -> None:
    if grid is not None:
        dtype, bits, block = grid.dtype, grid.bits, grid.block
    gen = torch.Generator().manual_seed(seed)
    assert_round_trips_like_torch(second_moments(gen, numel, dtype, span, zeros), bits, block)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bits", grid_bits("log2") if ON_GRID else (8, 4, 2))
def test_log2_kernels_on_adversarial_values(dtype: torch.dtype, bits: int) -> None:
    """Subnormals, the largest finite value, one-value blocks, all-zero blocks, -0.0, and
    blocks that cannot be coded (negative, NaN, +-inf), with a partial last block."""
    info = torch.finfo(dtype)
    special = [
        0.0,
        -0.0,
        float(info.tiny),
        float(info.smallest_normal) / 4,
        float(info.max),
        float(info.max) / 3,
        1.0,
        1.0 + float(info.eps),
        2.0,
        3.0,
    ]
    blocks = [
        torch.tensor(special * 4, dtype=torch.float64)[:32],  # mixed extremes
        torch.full((32,), 3.0, dtype=torch.float64),  # one value: step 0
        torch.zeros(32, dtype=torch.float64),  # nothing positive
        torch.tensor([-0.0] * 16 + [5.0] * 16, dtype=torch.float64),
        torch.tensor([1.0] * 31 + [-1e-30], dtype=torch.float64),  # negative: uncodable
        torch.tensor([1.0] * 31 + [float("nan")], dtype=torch.float64),
        torch.tensor([1.0] * 31 + [float("inf")], dtype=torch.float64),
        torch.tensor([1.0] * 31 + [float("-inf")], dtype=torch.float64),
        torch.tensor([float(info.tiny)] * 16 + [float(info.max)] * 16, dtype=torch.float64),
        # The bit patterns at the kernel's bounds: only -0.0 (the lowest int32, the uint32
        # boundary itself), both zeros, -0.0 beside +inf, the negative pattern next to
        # -0.0 (the smallest negative subnormal), a NaN with its sign bit set.
        torch.full((32,), -0.0, dtype=torch.float64),
        torch.tensor([-0.0, 0.0] * 16, dtype=torch.float64),
        torch.tensor([-0.0] * 31 + [float("inf")], dtype=torch.float64),
        torch.tensor([1.0] * 31 + [-float(info.smallest_normal) * float(info.eps)], dtype=torch.float64),
        torch.tensor([1.0] * 31 + [-float("nan")], dtype=torch.float64),
        torch.tensor(special[:7], dtype=torch.float64),  # partial last block
    ]
    # On the GPU grid's larger block, each 32-value block repeated to fill one.
    block = block_for("log2", 32)
    x = torch.cat([b.repeat(block // 32) for b in blocks[:-1]] + blocks[-1:]).to(dtype)
    assert_round_trips_like_torch(x, bits, block)


@pytest.mark.parametrize("bits", grid_bits("log2") if ON_GRID else (8, 4, 2))
def test_log2_kernel_on_quotients_next_to_half_integers(bits: int) -> None:
    """Elements whose quotient ``fl(t - lo) / step`` sits on or a few units from a
    half-integer: where the kernel's product by the reciprocal can land on the wrong side,
    it must divide, as the spec does (in whole tiles and in the tail)."""
    block = block_for("log2", 128)
    nblocks = 2 * (4096 // block) + 3
    x = near_half_log2_blocks(np.random.default_rng(bits), nblocks, block, bits)
    assert_round_trips_like_torch(torch.from_numpy(x), bits, block)


def test_log2_kernel_tiles_and_tails() -> None:
    """Sizes across whole tiles (4096 elements per program) and a masked tail program."""
    gen = torch.Generator().manual_seed(7)
    for n in (4096, 4096 * 2 + 1, 4096 * 3 - 5):
        for block in sorted({block_for("log2", 32), block_for("log2", 4096)}):
            assert_round_trips_like_torch(second_moments(gen, n, torch.float32, 30, 0.1), 4, block)


def test_log2_kernel_rejects_what_it_cannot_read() -> None:
    x = torch.ones(64, 2, device=KERNEL_DEVICE)
    with pytest.raises(QuantizationError, match="contiguous"):
        quantize_log2(x.t(), 4, 32)
    with pytest.raises(QuantizationError, match="bits"):
        quantize_log2(x.reshape(-1), 3, 32)
    with pytest.raises(QuantizationError, match="int32"):
        dequantize_log2(
            torch.zeros(64, dtype=torch.uint8, device=KERNEL_DEVICE),
            torch.zeros(2, dtype=torch.float32, device=KERNEL_DEVICE),
            torch.zeros(2, dtype=torch.int32, device=KERNEL_DEVICE),
            64,
            8,
            32,
            torch.float32,
        )
