"""Grouped copy: the exact entries of a save, many tensors of any dtype in two launches.

Each tensor is copied as bytes, over the table geometry of the grouped encodes
(``tiles.launch_grouped``: addresses of the source and the destination, rows of ``BLOCK``
bytes, whole tiles unmasked and 16-byte vectors, the tails masked). A copy is exact
whatever the dtype, so there is nothing to round and no flag to raise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import find_entry, group_outputs, launch_grouped

# Bytes per row of a copy (one row per program: tiles.TILE_ELEMENTS bytes).
COPY_BLOCK = 4096


@triton.jit(do_not_specialize_on_alignment=["flags_ptr"])
def copy_grouped_kernel(
    table_ptr,
    flags_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Copy one tile of bytes of one tensor of the table (``T`` rows: source and
    destination addresses, byte count). ``flags_ptr`` is not used."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    src = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
    else:
        tl.store(dst + offs, tl.load(src + offs))


def copy_grouped(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``xs`` (contiguous, 16-byte aligned, any dtypes, one device)
    with one table copy and at most two launches.

    Returns:
        Each copy, of its tensor's dtype and shape: views of one byte buffer.
    """
    nbytes = [x.numel() * x.element_size() for x in xs]
    views, out_addrs = group_outputs(nbytes, [(torch.uint8, lambda n: n)], xs[0].device)
    flags = torch.empty(0, dtype=torch.int64, device=xs[0].device)
    launch_grouped(
        copy_grouped_kernel,
        [[x.data_ptr(), out_addrs[i][0], 0, 0] for i, x in enumerate(xs)],
        nbytes,
        COPY_BLOCK,
        flags,
        [0] * len(xs),
        (),
    )
    return [v[0].view(x.dtype).view(x.shape) for v, x in zip(views, xs)]
