"""Grouped blockwise decode: many tensors of one pair of dtypes in two launches.

The single-tensor decode (``dequantize_blockwise``) over a table of tensors (addresses of
codes, scales, reference and output; the table and the launches: ``tiles.launch_grouped``),
with the same tile arithmetic (``dequantize_tile``), so every tensor decodes to the values
the single kernel gives it alone. A closed-loop save decodes its deltas this way to advance
its reference: a fixed number of launches, whatever the number of tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequantize_blockwise import dequantize_tile
from .tiles import find_entry, group_outputs, launch_grouped


@triton.jit
def dequantize_blockwise_grouped_kernel(
    table_ptr,
    flags_ptr,
    ref_type_ptr,
    out_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode one tile of one tensor of the table (``T`` rows). ``ref_type_ptr`` and
    ``out_type_ptr`` only carry element types; ``flags_ptr`` is not used."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    codes_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    scales_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    out_ptr = tl.multiple_of(tl.load(row + 3).to(out_type_ptr.dtype, bitcast=True), 16)

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        in_bounds = offs < n
        packed = tl.load(codes_ptr + byte_offs, mask=byte_offs * PER_BYTE < n, other=0)
        scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=0.0)
    else:
        packed = tl.load(codes_ptr + byte_offs)
        scale = tl.load(scales_ptr + rows)
    if HAS_REF:
        ref_ptr = tl.multiple_of(tl.load(row + 2).to(ref_type_ptr.dtype, bitcast=True), 16)
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
    else:
        r = 0.0
    y = dequantize_tile(packed, scale, r, HAS_REF, BITS, BLOCK, ROWS, out_type_ptr.dtype.element_ty)
    if MASKED:
        tl.store(out_ptr + offs, y, mask=in_bounds)
    else:
        tl.store(out_ptr + offs, y)


def dequantize_blockwise_grouped(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    bits: int,
    block: int,
    refs: list[torch.Tensor] | None,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Decode tensors (codes and scales contiguous and 16-byte aligned; ``refs`` likewise,
    one dtype) to ``dtype`` with one table copy and at most two launches.

    Returns:
        Each flat decoded tensor: views of one buffer, the values
        :func:`dequantize_blockwise` gives each alone.
    """
    device = codes[0].device
    views, out_addrs = group_outputs(numels, [(dtype, lambda n: n)], device)
    addresses = [
        [c.data_ptr(), s.data_ptr(), 0 if refs is None else refs[i].data_ptr(), out_addrs[i][0]]
        for i, (c, s) in enumerate(zip(codes, scales))
    ]
    outs = [v[0] for v in views]
    launch_grouped(
        dequantize_blockwise_grouped_kernel,
        addresses,
        numels,
        block,
        torch.empty(0, dtype=torch.int64, device=device),
        [0] * len(codes),
        (outs[0] if refs is None else refs[0], outs[0]),
        HAS_REF=refs is not None,
        BITS=bits,
    )
    return outs
