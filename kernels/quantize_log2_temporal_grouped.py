"""Grouped ``log2-temporal`` encode: many float32 tensors against their references in two
launches.

The single-tensor encode (``quantize_log2_temporal``) over a table of tensors (row ``j``:
the addresses of x, its reference, the codes and the bounds, ``lo`` then ``hi``, which
follow it directly; the table and the launches: ``tiles.launch_grouped``), with the same
rows' load, tile arithmetic and store (``temporal_encode_rows``), so every tensor's codes
and bounds are the bytes the single kernel gives it alone. The codec's stored buffer is
bounds then codes, so the kernel writes into it in place. A program whose tile holds a
block with a negative, NaN or infinite element (bounds ``-1``) raises its tensor's flag
with an atomic max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_log2_temporal import check_temporal_args, temporal_encode_rows
from .tiles import ALIGN, find_entry, group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr"])
def quantize_log2_temporal_grouped_kernel(
    table_ptr,
    flags_ptr,
    T,
    min_step,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode one tile of one tensor of the table (``T`` rows)."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # x, its reference and the codes are 16-byte aligned; the bounds 4-byte (they follow
    # the previous tensor's codes in the stored buffer).
    x_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    ref_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    codes_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    lo_ptr = tl.load(row + 3).to(tl.pointer_type(tl.int32), bitcast=True)
    hi_ptr = lo_ptr + (n + BLOCK - 1) // BLOCK

    hi, rows = temporal_encode_rows(
        x_ptr, ref_ptr, codes_ptr, lo_ptr, hi_ptr, n, first_row, min_step, MASKED, BITS, BLOCK, ROWS
    )
    if MASKED:
        bad = tl.max(((rows * BLOCK < n) & (hi < 0)).to(tl.int64), axis=0)
    else:
        bad = tl.max((hi < 0).to(tl.int64), axis=0)
    tl.atomic_max(flags_ptr + tl.load(row + 7), bad, mask=bad > 0)


def writable_in_place(out: tuple[torch.Tensor, ...], n: int, block: int) -> bool:
    """Whether the kernel can write ``out`` (``(codes, lo, hi)`` of an ``n``-element
    tensor) where it is: codes contiguous and 16-byte aligned, ``hi`` right after ``lo``."""
    codes, lo, hi = out
    nb = -(-n // block)
    return (
        codes.dtype == torch.uint8
        and codes.is_contiguous()
        and codes.numel() == n
        and codes.data_ptr() % ALIGN == 0
        and lo.dtype == hi.dtype == torch.int32
        and lo.is_contiguous()
        and hi.is_contiguous()
        and lo.numel() == hi.numel() == nb
        and lo.data_ptr() % 4 == 0
        and hi.data_ptr() == lo.data_ptr() + 4 * nb
    )


def quantize_log2_temporal_grouped(
    xs: list[torch.Tensor],
    refs: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    flags: torch.Tensor,
    slots: list[int] | None = None,
    out: list[tuple[torch.Tensor, ...]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """Encode ``xs`` against ``refs`` (contiguous float32, 16-byte aligned) with one table
    copy and at most two launches; raise ``flags[slots[i]]`` where tensor ``i`` cannot be
    coded.

    Args:
        out: ``(codes, lo, hi)`` per tensor to write into: in place where
            :func:`writable_in_place`, else copied in after the launches.

    Returns:
        ``(codes, lo, hi)`` per tensor (``out``'s when given, else views of one buffer per
        kind), the bytes :func:`quantize_log2_temporal` gives each tensor alone.
    """
    for x, r in zip(xs, refs):
        check_temporal_args(x, r, bits, block, "quantize_log2_temporal_grouped")
    numels = [x.numel() for x in xs]
    direct = [out is not None and writable_in_place(out[i], n, block) for i, n in enumerate(numels)]
    scratch = [i for i, d in enumerate(direct) if not d]
    nblocks = lambda n: -(-n // block)  # noqa: E731
    views, addrs = group_outputs(
        [numels[i] for i in scratch],
        [(torch.uint8, lambda n: n), (torch.int32, lambda n: 2 * nblocks(n))],
        xs[0].device if xs else flags.device,
    )
    results: list[tuple[torch.Tensor, ...]] = [None] * len(xs)  # type: ignore[list-item]
    addresses: list[list[int]] = [[] for _ in xs]
    for k, i in enumerate(scratch):
        codes, bounds = views[k]
        nb = nblocks(numels[i])
        results[i] = (codes, bounds[:nb], bounds[nb:])
        addresses[i] = addrs[k]
    for i, d in enumerate(direct):
        if d:
            results[i] = out[i]  # type: ignore[index]
            addresses[i] = [out[i][0].data_ptr(), out[i][1].data_ptr()]  # type: ignore[index]
    launch_grouped(
        quantize_log2_temporal_grouped_kernel,
        [[x.data_ptr(), r.data_ptr(), *a] for x, r, a in zip(xs, refs, addresses)],
        numels,
        block,
        flags,
        list(range(len(xs))) if slots is None else slots,
        (),
        min_step=min_step,
        BITS=bits,
    )
    if out is not None:
        for i in scratch:  # a caller's buffers the kernel cannot write in place
            for dst, src in zip(out[i], results[i]):
                dst.copy_(src)
            results[i] = out[i]
    return results
