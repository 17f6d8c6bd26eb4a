"""Grouped ``log2-temporal`` decode: many float32 tensors over their references in two
launches.

The single-tensor decode (``dequantize_log2_temporal``) over a table of tensors (row ``j``:
the addresses of the codes, the bounds (``lo`` then ``hi``, which follow it directly, as in
the codec's stored buffer), the reference and the output; the table and the launches:
``tiles.launch_grouped``), with the same tile arithmetic (``temporal_decode_tile``), so
every tensor decodes to the bits the single kernel gives it alone. The output may be the
reference itself: a program loads its whole tile of the reference before it stores, every
value of a row depends on that row's reference only, and no two programs share a row. A
closed-loop save decodes its second moments this way to advance its reference in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .dequantize_log2_temporal import temporal_decode_rows
from .quantize_log2_temporal import check_temporal_args
from .tiles import aligned, find_entry, group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr"])
def dequantize_log2_temporal_grouped_kernel(
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
    """Decode one tile of one tensor of the table (``T`` rows); ``flags_ptr`` is not used."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # The codes, the reference and the output are 16-byte aligned; the bounds 4-byte (they
    # follow the previous tensor's codes in a group's stored buffer).
    codes_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    lo_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int32), bitcast=True)
    hi_ptr = lo_ptr + (n + BLOCK - 1) // BLOCK
    ref_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    out_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    temporal_decode_rows(
        codes_ptr, lo_ptr, hi_ptr, ref_ptr, out_ptr, n, first_row, min_step, MASKED, BITS, BLOCK, ROWS
    )


def writable(out: torch.Tensor | None, n: int) -> bool:
    """Whether the kernel can write a tensor's values into ``out`` where it is."""
    return out is not None and out.dtype == torch.float32 and out.numel() == n and aligned(out)


def dequantize_log2_temporal_grouped(
    codes: list[torch.Tensor],
    bounds: list[torch.Tensor],
    refs: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Decode tensors (codes contiguous and 16-byte aligned; ``bounds[i]`` int32, ``lo``
    then ``hi``; ``refs`` contiguous float32, 16-byte aligned) with one table copy and at
    most two launches.

    Args:
        out: per tensor, ``None`` or a float32 tensor of its size to write into: in place
            where :func:`writable` (it may be the reference itself), else copied in after
            the launches.

    Returns:
        Each flat decoded tensor (``out[i]`` when given, else a view of one buffer), the
        values :func:`dequantize_log2_temporal` gives each alone.
    """
    numels = [c.numel() for c in codes]
    for c, b, r in zip(codes, bounds, refs):
        check_temporal_args(r, r, bits, block, "dequantize_log2_temporal_grouped")
        nb = -(-c.numel() // block)
        if c.dtype != torch.uint8 or r.numel() != c.numel() or b.dtype != torch.int32 or b.numel() != 2 * nb:
            raise QuantizationError(
                f"dequantize_log2_temporal_grouped: codes {c.dtype} x {c.numel()}, bounds {b.dtype} x "
                f"{b.numel()}, reference of {r.numel()} elements; expected uint8 x n, int32 x {2 * nb}, n"
            )
    outs = [None] * len(codes) if out is None else list(out)
    scratch = [i for i, n in enumerate(numels) if not writable(outs[i], n)]
    views, addrs = group_outputs(
        [numels[i] for i in scratch], [(torch.float32, lambda n: n)], codes[0].device
    )
    results: list[torch.Tensor] = [None] * len(codes)  # type: ignore[list-item]
    addresses: list[int] = [0] * len(codes)
    for k, i in enumerate(scratch):
        results[i], addresses[i] = views[k][0], addrs[k][0]
    for i in range(len(codes)):
        if i not in scratch:
            results[i], addresses[i] = outs[i], outs[i].data_ptr()  # type: ignore[union-attr]
    launch_grouped(
        dequantize_log2_temporal_grouped_kernel,
        [[c.data_ptr(), b.data_ptr(), r.data_ptr(), a] for c, b, r, a in zip(codes, bounds, refs, addresses)],
        numels,
        block,
        torch.empty(0, dtype=torch.int64, device=codes[0].device),
        [0] * len(codes),
        (),
        min_step=min_step,
        BITS=bits,
    )
    for i in scratch:
        if outs[i] is not None:  # a caller's tensor the kernel cannot write in place
            outs[i].view(-1).copy_(results[i])  # type: ignore[union-attr]
            results[i] = outs[i]  # type: ignore[assignment]
    return results
