"""Grouped blockwise decode: many tensors of one pair of dtypes in two launches.

The single-tensor decode (``dequantize_blockwise``) over a table of tensors (addresses of
codes, scales, reference and output; the table and the launches: ``tiles.launch_grouped``),
with the same tile arithmetic (``dequantize_tile``), so every tensor decodes to the values
the single kernel gives it alone. A closed-loop save decodes its deltas this way to advance
its reference: a fixed number of launches, whatever the number of tensors, each written
over its reference tensor (a block's reference values are read before its outputs are
written), so the reference is never held twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequantize_blockwise import dequantize_tile
from .tiles import aligned, find_entry, group_outputs, launch_grouped


@triton.jit
def grouped_decode_row(table_ptr, T, LOG_T: tl.constexpr, ROWS: tl.constexpr):
    """This program's place in a grouped blockwise decode (table rows: codes, scales, two
    more addresses; length, first row, program index, slot): its table row, the tensor's
    length, the tile's first block row and the codes and scales pointers."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    codes_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    scales_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    return row, n, first_row, codes_ptr, scales_ptr


@triton.jit
def load_codes_tile(
    codes_ptr,
    scales_ptr,
    first_row,
    n,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The tile's element offsets (int64, ``(ROWS, BLOCK)``), which of them are below
    ``n``, and its packed codes and scales (0 past ``n``): what :func:`dequantize_tile`
    decodes."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    in_bounds = offs < n  # unused (and not computed) when not MASKED
    if MASKED:
        packed = tl.load(codes_ptr + byte_offs, mask=byte_offs * PER_BYTE < n, other=0)
        scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=0.0)
    else:
        packed = tl.load(codes_ptr + byte_offs)
        scale = tl.load(scales_ptr + rows)
    return offs, in_bounds, packed, scale


@triton.jit
def store_tile(out_ptr, offs, y, in_bounds, MASKED: tl.constexpr):
    """``y`` to ``out_ptr + offs`` (only where ``in_bounds`` when ``MASKED``)."""
    if MASKED:
        tl.store(out_ptr + offs, y, mask=in_bounds)
    else:
        tl.store(out_ptr + offs, y)


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "ref_type_ptr", "out_type_ptr"])
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
    row, n, first_row, codes_ptr, scales_ptr = grouped_decode_row(table_ptr, T, LOG_T, ROWS)
    out_ptr = tl.multiple_of(tl.load(row + 3).to(out_type_ptr.dtype, bitcast=True), 16)
    offs, in_bounds, packed, scale = load_codes_tile(
        codes_ptr, scales_ptr, first_row, n, MASKED, BITS, BLOCK, ROWS
    )
    if HAS_REF:
        ref_ptr = tl.multiple_of(tl.load(row + 2).to(ref_type_ptr.dtype, bitcast=True), 16)
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
    else:
        r = 0.0
    y = dequantize_tile(packed, scale, r, HAS_REF, BITS, BLOCK, ROWS, out_type_ptr.dtype.element_ty)
    store_tile(out_ptr, offs, y, in_bounds, MASKED)


def dequantize_blockwise_grouped(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    bits: int,
    block: int,
    refs: list[torch.Tensor] | None,
    dtype: torch.dtype,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Decode tensors (codes and scales contiguous and 16-byte aligned; ``refs`` likewise,
    one dtype) to ``dtype`` with one table copy and at most two launches.

    Args:
        out: per tensor, ``None`` or a flat tensor of ``dtype`` and its size to write
            into: in place where contiguous and 16-byte aligned (it may be the reference
            itself: a program loads a tile's reference before it stores the tile), else
            copied in after the launches.

    Returns:
        Each flat decoded tensor (``out[i]`` when given, else a view of one buffer), the
        values :func:`dequantize_blockwise` gives each alone.
    """
    device = codes[0].device
    outs = [None] * len(codes) if out is None else list(out)
    direct = [
        o is not None and o.dtype == dtype and o.numel() == n and aligned(o) for o, n in zip(outs, numels)
    ]
    scratch = [i for i, d in enumerate(direct) if not d]
    views, out_addrs = group_outputs([numels[i] for i in scratch], [(dtype, lambda n: n)], device)
    results: list[torch.Tensor] = [None] * len(codes)  # type: ignore[list-item]
    targets = [0] * len(codes)
    for k, i in enumerate(scratch):
        results[i], targets[i] = views[k][0], out_addrs[k][0]
    for i, d in enumerate(direct):
        if d:
            results[i], targets[i] = outs[i], outs[i].data_ptr()  # type: ignore[union-attr]
    addresses = [
        [c.data_ptr(), s.data_ptr(), 0 if refs is None else refs[i].data_ptr(), targets[i]]
        for i, (c, s) in enumerate(zip(codes, scales))
    ]
    launch_grouped(
        dequantize_blockwise_grouped_kernel,
        addresses,
        numels,
        block,
        torch.empty(0, dtype=torch.int64, device=device),
        [0] * len(codes),
        (results[0] if refs is None else refs[0], results[0]),
        HAS_REF=refs is not None,
        BITS=bits,
    )
    for i in scratch:
        if outs[i] is not None:  # a caller's tensor the kernel cannot write in place
            outs[i].view(-1).copy_(results[i])  # type: ignore[union-attr]
            results[i] = outs[i]  # type: ignore[assignment]
    return results
