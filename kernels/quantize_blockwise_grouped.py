"""Grouped blockwise encode: many tensors of one pair of dtypes in two launches.

The single-tensor encode (``quantize_blockwise``) over a table of tensors instead of one
(the table and the launches: ``tiles.launch_grouped``). Each program finds its tensor, loads
one ``(ROWS, BLOCK)`` tile of it (and of its reference) and runs the same tile arithmetic
(``quantize_tile``), so every tensor's codes and scales are the bytes the single kernel
gives it alone. Each tensor's largest code ``qmax`` is a column of the table (an integer,
converted exactly to fp32), so tensors coded with different numbers of levels in one
container share the launches. A program whose tile holds a NaN/Inf block (an infinite scale) raises its
tensor's flag with an atomic max, an OR whatever the order of the programs: the caller's
flags start at zero, and the flags of a whole save are one buffer read back once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_blockwise import quantize_tile, widen_to_f32
from .tiles import find_entry, group_outputs, launch_grouped, table_width

# The table's columns: the common eight (tiles.launch_grouped), then each tensor's qmax.
_COLUMNS = tl.constexpr(table_width(1))


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "x_type_ptr", "ref_type_ptr"])
def quantize_blockwise_grouped_kernel(
    table_ptr,
    flags_ptr,
    x_type_ptr,
    ref_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode one tile of one tensor of the table (``T`` rows: addresses of x, ref, codes,
    scales, .., then the largest code magnitude ``qmax``). ``x_type_ptr`` and
    ``ref_type_ptr`` only carry the inputs' element types."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T, _COLUMNS) * _COLUMNS
    n = tl.load(row + 4)
    # An integer up to 127: exact in fp32, as the single kernel's fp32 argument.
    qmax = tl.load(row + 8).to(tl.float32)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # Addresses to typed pointers; every one is 16-byte aligned (tiles.ALIGN).
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    codes_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    scales_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32), bitcast=True), 16)

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        in_bounds = offs < n
        x = tl.load(x_ptr + offs, mask=in_bounds, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    d = widen_to_f32(x)
    if HAS_REF:
        ref_ptr = tl.multiple_of(tl.load(row + 1).to(ref_type_ptr.dtype, bitcast=True), 16)
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
        d = d - widen_to_f32(r)

    packed, scale = quantize_tile(d, qmax, BITS, BLOCK, ROWS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        row_in = rows * BLOCK < n
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(scales_ptr + rows, scale, mask=row_in)
        bad = tl.max((row_in & (scale == float("inf"))).to(tl.int64), axis=0)
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(scales_ptr + rows, scale)
        bad = tl.max((scale == float("inf")).to(tl.int64), axis=0)
    tl.atomic_max(flags_ptr + tl.load(row + 7), bad, mask=bad > 0)


def quantize_blockwise_grouped(
    xs: list[torch.Tensor],
    refs: list[torch.Tensor] | None,
    bits: int,
    block: int,
    qmax: int | list[int],
    flags: torch.Tensor,
    slots: list[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Encode ``xs`` (contiguous, 16-byte aligned, one dtype; ``refs`` likewise, one dtype)
    with codes up to ``qmax`` (one for all, or one per tensor), with one table copy and at
    most two launches; raise ``flags[slots[i]]`` (int64; ``slots`` default ``0, 1, ..``)
    where tensor ``i`` has a NaN/Inf block.

    Returns:
        ``(codes, scales)`` per tensor: views of one codes and one scales buffer, the
        bytes :func:`quantize_blockwise` gives each tensor alone.
    """
    numels = [x.numel() for x in xs]
    outputs = [(torch.uint8, lambda n: (n * bits + 7) // 8), (torch.float32, lambda n: -(-n // block))]
    views, out_addrs = group_outputs(numels, outputs, xs[0].device)
    addresses = [
        [x.data_ptr(), 0 if refs is None else refs[i].data_ptr(), *out_addrs[i]] for i, x in enumerate(xs)
    ]
    qmaxes = [qmax] * len(xs) if isinstance(qmax, int) else qmax
    launch_grouped(
        quantize_blockwise_grouped_kernel,
        addresses,
        numels,
        block,
        flags,
        list(range(len(xs))) if slots is None else slots,
        (xs[0], xs[0] if refs is None else refs[0]),
        columns=[[q] for q in qmaxes],
        HAS_REF=refs is not None,
        BITS=bits,
    )
    return [(v[0], v[1]) for v in views]
