"""Grouped ``log2`` encode: many tensors of one dtype in two launches.

The single-tensor encode (``quantize_log2``) over a table of tensors (addresses of x,
codes, lo, hi; the table and the launches: ``tiles.launch_grouped``), with the same tile
arithmetic (``log2_tile``), so every tensor's codes and bounds are the bytes the single
kernel gives it alone. A program whose tile holds a block with a negative, NaN or infinite
element (bounds ``-1``) raises its tensor's flag with an atomic max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_log2 import log2_tile
from .tiles import find_entry, group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "x_type_ptr"])
def quantize_log2_grouped_kernel(
    table_ptr,
    flags_ptr,
    x_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode one tile of one tensor of the table (``T`` rows). ``x_type_ptr`` only
    carries the input's element type."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    codes_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    lo_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.int32), bitcast=True), 16)
    hi_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.int32), bitcast=True), 16)

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    packed, lo, hi = log2_tile(x, BITS, BLOCK, ROWS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        row_in = rows * BLOCK < n
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(lo_ptr + rows, lo, mask=row_in)
        tl.store(hi_ptr + rows, hi, mask=row_in)
        bad = tl.max((row_in & (hi < 0)).to(tl.int64), axis=0)
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(lo_ptr + rows, lo)
        tl.store(hi_ptr + rows, hi)
        bad = tl.max((hi < 0).to(tl.int64), axis=0)
    tl.atomic_max(flags_ptr + tl.load(row + 7), bad, mask=bad > 0)


def quantize_log2_grouped(
    xs: list[torch.Tensor], bits: int, block: int, flags: torch.Tensor, slots: list[int] | None = None
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Encode ``xs`` (contiguous, 16-byte aligned, one dtype) with one table copy and at
    most two launches; raise ``flags[slots[i]]`` where tensor ``i`` cannot be coded.

    Returns:
        ``(codes, lo, hi)`` per tensor: views of one buffer each, the bytes
        :func:`quantize_log2` gives each tensor alone.
    """
    numels = [x.numel() for x in xs]
    nblocks = lambda n: -(-n // block)  # noqa: E731
    outputs = [(torch.uint8, lambda n: (n * bits + 7) // 8), (torch.int32, nblocks), (torch.int32, nblocks)]
    views, out_addrs = group_outputs(numels, outputs, xs[0].device)
    launch_grouped(
        quantize_log2_grouped_kernel,
        [[x.data_ptr(), *out_addrs[i]] for i, x in enumerate(xs)],
        numels,
        block,
        flags,
        list(range(len(xs))) if slots is None else slots,
        (xs[0],),
        BITS=bits,
    )
    return [(v[0], v[1], v[2]) for v in views]
