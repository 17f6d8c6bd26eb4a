"""The ``log2-temporal`` encode and decode kernels against the torch path (the spec):
identical bytes and decoded bits.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (conftest.py);
with one they run compiled on CUDA tensors and are compared with the CPU torch path.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_testing import (
    BLOCKS,
    KERNEL_DEVICE,
    assert_same_bits,
    numels,
    on_kernel_device,
    require_runnable_kernels,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tw_triton.errors import QuantizationError
from tw_triton.kernels import dequantize_log2_temporal, quantize_log2_temporal
from tw_triton.ops.reference import dequantize_log2_temporal_torch, quantize_log2_temporal_torch

require_runnable_kernels()
MIN_STEP = 1 << 19


def moments_pair(gen: torch.Generator, n: int, span: float, drift: float, zeros: float, jumps: float):
    """A second moment (``ref``, squares over ``span`` octaves-ish) and the same moment some
    steps later: each value times ``2**(drift * N(0, 1))``, with zeros appearing and
    disappearing (``zeros``) and a few values jumping by up to 2**40 (``jumps``)."""
    g = torch.randn(n, generator=gen, dtype=torch.float64) * torch.pow(
        2.0, span * torch.rand(n, generator=gen, dtype=torch.float64) - span / 2
    )
    ref = (g * g).to(torch.float32)
    x = ref.double() * torch.pow(2.0, drift * torch.randn(n, generator=gen, dtype=torch.float64))
    if jumps:
        jump = torch.rand(n, generator=gen, dtype=torch.float64) < jumps
        x = torch.where(
            jump, x * torch.pow(2.0, 80 * torch.rand(n, generator=gen, dtype=torch.float64) - 40), x
        )
    x = x.to(torch.float32)
    if zeros:
        ref[torch.rand(n, generator=gen) < zeros] = 0.0
        x[torch.rand(n, generator=gen) < zeros] = 0.0
    return x, ref


def assert_like_torch(
    x: torch.Tensor, ref: torch.Tensor, bits: int, block: int, min_step: int = MIN_STEP
) -> None:
    """Encode and decode on the kernel device and with torch on the CPU: all bytes equal."""
    got = quantize_log2_temporal(on_kernel_device(x), on_kernel_device(ref), bits, block, min_step)
    want = quantize_log2_temporal_torch(x, ref, bits, block, min_step)
    for name, g, w in zip(("codes", "lo", "hi"), got, want):
        assert g.device.type == KERNEL_DEVICE.type
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.cpu(), w), f"{name} differ at {(g.cpu() != w).nonzero()[:8].flatten().tolist()}"
    n = x.numel()
    decoded = dequantize_log2_temporal(
        *(on_kernel_device(t) for t in want), on_kernel_device(ref), n, bits, block, min_step
    )
    assert_same_bits(decoded, dequantize_log2_temporal_torch(*want, ref, n, bits, block, min_step), "decode")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numel=numels(),
    bits=st.sampled_from((8, 4, 2)),
    block=st.sampled_from(BLOCKS),
    span=st.sampled_from((0.0, 4.0, 40.0, 200.0)),
    drift=st.sampled_from((0.0, 0.05, 1.0, 30.0)),
    zeros=st.sampled_from((0.0, 0.01, 0.5)),
    jumps=st.sampled_from((0.0, 0.001)),
    min_step=st.sampled_from((1, MIN_STEP, 1 << 29)),
    seed=st.integers(0, 2**31 - 1),
)
def test_log2_temporal_kernels_are_byte_identical_to_torch(
    numel, bits, block, span, drift, zeros, jumps, min_step, seed
) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, ref = moments_pair(gen, numel, span, drift, zeros, jumps)
    assert_like_torch(x, ref, bits, block, min_step)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_log2_temporal_kernels_on_adversarial_values(bits: int) -> None:
    """Subnormals, the largest finite value, -0.0, NaN/Inf/negative in the tensor or in the
    reference, zeros appearing and disappearing, a partial last block."""
    info = torch.finfo(torch.float32)
    special = [0.0, -0.0, float(info.tiny), float(info.smallest_normal) / 4, float(info.max), 1.0, 3.0]
    nan, inf = float("nan"), float("inf")
    pairs = [
        (special * 4, list(reversed(special)) * 4),  # mixed extremes against each other
        ([3.0] * 32, [3.0] * 32),  # no change, step floor
        ([0.0] * 32, [5.0] * 32),  # all zero now
        ([5.0] * 32, [0.0] * 32),  # all zero before: absolute
        ([1.0] * 31 + [nan], [1.0] * 32),  # uncodable
        ([1.0] * 31 + [-1e-30], [1.0] * 32),
        ([1.0] * 31 + [inf], [1.0] * 32),
        ([1.0] * 32, [1.0] * 31 + [nan]),  # NaN in the reference: absolute
        ([0.0] * 31 + [2.0], [-1.0] * 31 + [2.0]),  # negative reference under zeros
        ([float(info.max)] * 32, [float(info.tiny)] * 32),  # a jump far past 127 steps
        ([float(info.max)] * 16 + [1.0] * 16, [float(info.max)] * 16 + [1.0] * 16),
        # Patterns at the kernel's bounds: -0.0 only; a NaN with its sign bit set and the
        # negative pattern next to -0.0 (uncodable); a reference's +inf, +NaN, -NaN or
        # negative under a zero, in a row that stays temporal (its step ignores them).
        ([-0.0] * 32, [2.0] * 32),
        ([1.0] * 31 + [-nan], [1.0] * 32),
        ([1.0] * 31 + [-float(info.tiny) * float(info.eps)], [1.0] * 32),
        ([1.0] * 31 + [0.0], [1.0] * 16 + [2.0] * 15 + [inf]),
        ([1.0] * 30 + [0.0] * 2, [1.0] * 16 + [2.0] * 14 + [nan, -nan]),
        ([1.0] * 31 + [0.0], [1.0] * 16 + [64.0] * 15 + [-float(info.tiny) * float(info.eps)]),
        (special[:7], special[:7]),  # partial last block
    ]
    x = torch.tensor([v for a, _ in pairs for v in a], dtype=torch.float32)
    ref = torch.tensor([v for _, b in pairs for v in b], dtype=torch.float32)
    assert_like_torch(x, ref, bits, 32)
    assert_like_torch(x, ref, bits, 32, min_step=1)


def test_log2_temporal_kernel_tiles_and_tails() -> None:
    """Sizes across whole tiles (4096 elements per program) and a masked tail program."""
    gen = torch.Generator().manual_seed(7)
    for n in (4096, 4096 * 2 + 1, 4096 * 3 - 5):
        for block in (32, 4096):
            x, ref = moments_pair(gen, n, 40.0, 0.1, 0.01, 0.001)
            assert_like_torch(x, ref, 4, block)


def test_log2_temporal_kernel_rejects_what_it_cannot_read() -> None:
    x = torch.ones(64, 2, device=KERNEL_DEVICE)
    with pytest.raises(QuantizationError, match="contiguous"):
        quantize_log2_temporal(x.t(), x.t(), 4, 32, MIN_STEP)
    with pytest.raises(QuantizationError, match="float32"):
        quantize_log2_temporal(x.reshape(-1), x.reshape(-1).half(), 4, 32, MIN_STEP)
    with pytest.raises(QuantizationError, match="bits"):
        quantize_log2_temporal(x.reshape(-1), x.reshape(-1), 3, 32, MIN_STEP)
    with pytest.raises(QuantizationError, match="int32"):
        dequantize_log2_temporal(
            torch.zeros(128, dtype=torch.uint8, device=KERNEL_DEVICE),
            torch.zeros(4, dtype=torch.float32, device=KERNEL_DEVICE),
            torch.zeros(4, dtype=torch.int32, device=KERNEL_DEVICE),
            x.reshape(-1),
            128,
            8,
            32,
            MIN_STEP,
        )


@pytest.mark.parametrize("min_step", (1, 2, 3, 4, 7))
def test_log2_temporal_kernels_at_every_remainder(min_step: int) -> None:
    """A constant reference (step = ``min_step``) and inputs every bit pattern from 600
    below to 600 above it: every remainder of the rounding, ties included, and the edge of
    the 127-step range on both sides."""
    base = torch.tensor([1.5], dtype=torch.float32).view(torch.int32)
    x = (base + torch.arange(-600, 600, dtype=torch.int32)).view(torch.float32)
    ref = torch.full_like(x, 1.5)
    assert_like_torch(x, ref, 4, 32, min_step)


def near_step_boundaries(seed: int, nblocks: int, block: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, ref)``: blocks whose reference spans ``lo .. lo + span`` (``span`` up to
    ``2**30``, so steps from ``min_step`` to millions of patterns), and inputs whose change
    ``|d| + step // 2`` sits on and one or two patterns beside ``k * step``, ``k`` up to 130:
    the kernel's estimate of the rounded quotient and its correction at every edge."""
    gen = torch.Generator().manual_seed(seed)
    n_steps = (1 << bits) - 2
    lo = torch.randint(0x20000000, 0x30000000, (nblocks, 1), generator=gen, dtype=torch.int64)
    span = torch.randint(1 << 10, 1 << 30, (nblocks, 1), generator=gen, dtype=torch.int64)
    step = torch.clamp(span // n_steps, min=1)
    r = lo + torch.randint(0, 1 << 62, (nblocks, block), generator=gen, dtype=torch.int64) % (span + 1)
    r[:, 0:1], r[:, 1:2] = lo, lo + span
    k = torch.randint(0, 131, (nblocks, block), generator=gen, dtype=torch.int64)
    k[: nblocks // 2] = torch.clamp(k[: nblocks // 2], max=127)  # rows that stay temporal
    ad = torch.clamp(k * step - step // 2 + torch.randint(-2, 3, (nblocks, block), generator=gen), min=0)
    sign = torch.where(torch.rand(nblocks, block, generator=gen) < 0.5, -1, 1)
    t = torch.clamp(r + sign * ad, 1, 0x7F7FFFFF)
    as_f32 = lambda v: v.to(torch.int32).view(torch.float32).reshape(-1)  # noqa: E731
    return as_f32(t), as_f32(r)


@pytest.mark.parametrize("bits", (8, 4, 2))
def test_log2_temporal_kernels_at_step_boundaries(bits: int) -> None:
    """Steps of every size (up to millions of patterns): the rounded change of each input at
    and beside every boundary between two codes, in whole tiles and in the tail."""
    block = 64
    x, ref = near_step_boundaries(bits, 2 * (4096 // block) + 5, block, bits)
    assert_like_torch(x, ref, bits, block, 1)


def test_log2_temporal_kernels_clamp_like_torch() -> None:
    """Changes that round to zero or past the largest finite value: the clamps."""
    top = 0x7F7FFFFF
    t = torch.tensor([5] * 32 + [top] * 32, dtype=torch.int32)
    r = torch.tensor([1000] * 32 + [top - 3600] * 32, dtype=torch.int32)
    assert_like_torch(t.view(torch.float32), r.view(torch.float32), 4, 32, 1000)


@pytest.mark.parametrize("min_step", (1, 3, (1 << 29) - 1, 1 << 29))
def test_log2_temporal_kernels_at_the_widest_changes(min_step: int) -> None:
    """Blocks of one reference value each (so the step is the floor ``min_step``, from 1 to
    its largest) and inputs across the whole positive range, smallest subnormal to largest
    finite, on and beside multiples of the step: the 32-bit correction's remainder at its
    extremes (``m`` up to ``2**31 + 2**28``, quotients from 0 to far past 200)."""
    top, block = 0x7F7FFFFF, 32
    refs = [1, 2, min_step, 1 << 23, 0x3F800000, top - min_step, top]
    ts, rs = [], []
    for r0 in refs:
        picks = [1, top, r0, r0 + 1, r0 - 1]
        for k in (1, 2, 3, 4, 127, 128, 200, 201):
            for side in (-1, 1):
                picks += [r0 + side * (k * min_step - min_step // 2 + e) for e in (-1, 0, 1)]
        picks = [min(max(p, 1), top) for p in picks]
        for start in range(0, len(picks), block):
            row = (picks[start : start + block] * block)[:block]
            ts += row
            rs += [r0] * block
    t = torch.tensor(ts, dtype=torch.int64).to(torch.int32)
    r = torch.tensor(rs, dtype=torch.int64).to(torch.int32)
    for bits in (8, 4, 2):
        assert_like_torch(t.view(torch.float32), r.view(torch.float32), bits, block, min_step)


@pytest.mark.parametrize("min_step", (0, -1, (1 << 29) + 1, 1 << 31, True, 2.0))
def test_the_temporal_ops_refuse_a_step_floor_out_of_range(min_step) -> None:
    """Every backend's rounding is exact for floors up to 2**29 (the kernels' in 32 bits):
    the ops refuse any other floor before a backend runs."""
    from tw_triton import ops

    x = torch.ones(64)
    with pytest.raises(QuantizationError, match="min_step must be an int from 1 to 536870912"):
        ops.quantize_log2_temporal(x, x, 4, 32, min_step)
    flags = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(QuantizationError, match="min_step"):
        ops.quantize_log2_temporal_many([x], [x], 4, 32, min_step, flags=flags)
    codes, lo, hi = ops.quantize_log2_temporal(x, x, 4, 32, 1 << 29)
    with pytest.raises(QuantizationError, match="min_step"):
        ops.dequantize_log2_temporal(codes, lo, hi, x, 64, 4, 32, min_step)
