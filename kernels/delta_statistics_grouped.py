"""Grouped delta statistics: the four integers of the weight-delta bits choice of many
tensors of one pair of dtypes in one table copy and four launches.

The spec is ``tw_triton.ops.reference.delta_statistics_many_torch`` (``delta_statistics``
of each tensor into four int64 slots): the fp32 bits of ``A``, the largest block maximum
of ``|x - ref|``, and of ``B``, the largest ``|x|``; then ``sum_b floor(s_b * (4096 / A))**2``
and ``sum_i floor(|x_i| * (256 / B))**2``. The sums need the maxima, so the kernel runs in
two passes over the same table (``tiles.launch_grouped``, whole tiles then tails each):

* ``SUMS=False``: each program finds the largest ``|d|`` and ``|x|`` of its tile and raises
  its tensor's first two slots to them with integer atomic maxima. The maxima are of bit
  patterns with the sign cleared (``abs``), whose integer order is the float order (a NaN
  above an infinity), so the result does not depend on the order of the programs.
* ``SUMS=True``: each program reads its tensor's ``A`` and ``B``, forms the level factors
  as the spec does (the correctly rounded reciprocal of ``max(top, FLT_MIN)`` times the
  power-of-two scale, which is ``torch``'s ``scale / top``), recomputes its blocks' maxima,
  and adds the squared levels to the last two slots with integer atomic adds.

Every float operation is a correctly rounded one (subtraction, ``div_rn``, products; the
floor of a non-negative level is its truncation to an integer), and the sums are of integers in int64, so each tensor's integers are the
spec's wherever the spec's are defined: a level factor that is not finite (a maximum that
is NaN, infinite or below about ``1e-35``) makes the spec's sums undefined (a NaN cast
to an integer), and the kernel counts no level there; ``tw_triton.delta_bits`` does not
read those sums.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_blockwise import widen_to_f32
from .tiles import find_entry, launch_grouped

# The smallest normal fp32, the spec's floor under a maximum before its reciprocal.
_FLT_MIN = tl.constexpr(torch.finfo(torch.float32).tiny)
# Levels above this are not levels (the spec's are at most 4096): a factor that is not finite.
_MAX_LEVEL = tl.constexpr(16777216.0)
# The fp32 bits without the sign: a bit pattern's absolute value.
_ABS_BITS = tl.constexpr(0x7FFFFFFF)


@triton.jit
def level_factor(top, SCALE: tl.constexpr):
    """``scale / max(top, FLT_MIN)`` as torch computes it: reciprocal, then product."""
    t = tl.where(top > _FLT_MIN, top, _FLT_MIN)
    return tl.div_rn(tl.full((), 1.0, tl.float32), t) * SCALE


@triton.jit
def squared_levels(v, factor):
    """``floor(v * factor)**2`` in int64, zero where that is no level (see _MAX_LEVEL).
    The product is non-negative, so its floor is its truncation to an integer: an exact
    conversion (``libdevice``'s ``floor`` would flush subnormal inputs to zero)."""
    p = v * factor
    q = tl.where(p <= _MAX_LEVEL, p, 0.0).to(tl.int32).to(tl.int64)
    return q * q


@triton.jit(do_not_specialize_on_alignment=["out_ptr", "x_type_ptr", "ref_type_ptr"])
def delta_statistics_grouped_kernel(
    table_ptr,
    out_ptr,
    x_type_ptr,
    ref_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    SUMS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One tile of one tensor of the table (``T`` rows: addresses of x and ref): its maxima
    into slots ``slot``, ``slot + 1`` or (``SUMS``) its squared levels into ``slot + 2``,
    ``slot + 3`` of ``out_ptr``. The type pointers only carry the element types."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    v = widen_to_f32(x)
    # |v| as a bit pattern (elements past the end are +0.0: no maximum, no level).
    x_abs = v.to(tl.int32, bitcast=True) & _ABS_BITS
    if HAS_REF:
        ref_ptr = tl.multiple_of(tl.load(row + 1).to(ref_type_ptr.dtype, bitcast=True), 16)
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=offs < n, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
        d_abs = (v - widen_to_f32(r)).to(tl.int32, bitcast=True) & _ABS_BITS
    else:
        d_abs = x_abs
    s = tl.max(d_abs, axis=1)  # the block maxima, as bit patterns
    slot = tl.load(row + 7)
    if SUMS:
        a = tl.load(out_ptr + slot).to(tl.int32).to(tl.float32, bitcast=True)
        b = tl.load(out_ptr + slot + 1).to(tl.int32).to(tl.float32, bitcast=True)
        qs = tl.sum(squared_levels(s.to(tl.float32, bitcast=True), level_factor(a, 4096.0)), axis=0)
        qx = squared_levels(x_abs.to(tl.float32, bitcast=True), level_factor(b, 256.0))
        qx = tl.sum(tl.sum(qx, axis=1), axis=0)
        tl.atomic_add(out_ptr + slot + 2, qs, mask=qs > 0)
        tl.atomic_add(out_ptr + slot + 3, qx, mask=qx > 0)
    else:
        a = tl.max(s, axis=0).to(tl.int64)
        b = tl.max(tl.max(x_abs, axis=1), axis=0).to(tl.int64)
        tl.atomic_max(out_ptr + slot, a, mask=a > 0)
        tl.atomic_max(out_ptr + slot + 1, b, mask=b > 0)


def delta_statistics_grouped(
    xs: list[torch.Tensor], refs: list[torch.Tensor] | None, block: int, out: torch.Tensor, slots: list[int]
) -> None:
    """The four statistics of each of ``xs`` (contiguous, 16-byte aligned, one dtype;
    ``refs`` likewise, one dtype, or ``None``) into ``out[slots[i] : slots[i] + 4]`` (int64,
    zero-filled by the caller), with one table copy and at most four launches. ``block``:
    a power of two up to 4096."""
    launch_grouped(
        delta_statistics_grouped_kernel,
        [[x.data_ptr(), 0 if refs is None else refs[i].data_ptr(), 0, 0] for i, x in enumerate(xs)],
        [x.numel() for x in xs],
        block,
        out,
        slots,
        (xs[0], xs[0] if refs is None else refs[0]),
        passes=({"SUMS": False}, {"SUMS": True}),
        HAS_REF=refs is not None,
    )
