"""Grouped sparsity counts: the non-zero elements and the runs of zeros of many tensors of
one element width in two launches.

The spec is ``tw_triton.ops.reference.sparsity_counts_many_torch`` (``sparsity_counts`` of
each tensor, added to two int64 slots). The launcher views the tensors as the integer of
their width, so zero is the all-zero bit pattern (``-0.0`` and NaN are values) and no
float instruction is involved. Tiles of ``TILE`` elements run over the table geometry of
the other grouped kernels (``tiles.launch_grouped``: whole tiles unmasked, the tails
masked, int64 offsets). An element starts a run where it is zero and the element before
it is not; for a tile's first element that is the last element of the tile before, so
each program also reads the element before each of its own (the tensor's first element
follows nothing: a zero there starts a run). Each program adds its tile's two counts to
its tensor's slots with atomic adds, which do not depend on the order of the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import find_entry, launch_grouped

# Elements per program (tiles.TILE_ELEMENTS, one row per program).
TILE = 4096
_BIT_VIEW = {2: torch.int16, 4: torch.int32}


@triton.jit
def sparsity_counts_grouped_kernel(
    table_ptr,
    out_ptr,
    x_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Add the counts of one tile of one tensor of the table (``T`` rows) to
    ``out_ptr[slot]`` (non-zero elements) and ``out_ptr[slot + 1]`` (runs of zeros that
    start in the tile). ``x_type_ptr`` only carries the integer type of the elements."""
    tl.static_assert(ROWS == 1)
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    tile = tl.load(row + 5) + (pid - tl.load(row + 6))
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    offs = tile * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    if MASKED:
        inside = offs < n
        v = tl.load(x_ptr + offs, mask=inside, other=0)
        before = tl.load(x_ptr + (offs - 1), mask=inside & (offs > 0), other=1)
        nonzero = inside & (v != 0)
        zero = inside & (v == 0)
    else:
        v = tl.load(x_ptr + offs)
        before = tl.load(x_ptr + (offs - 1), mask=offs > 0, other=1)
        nonzero = v != 0
        zero = v == 0
    nnz = tl.sum(nonzero.to(tl.int32), axis=0).to(tl.int64)
    runs = tl.sum((zero & (before != 0)).to(tl.int32), axis=0).to(tl.int64)
    slot = tl.load(row + 7)
    tl.atomic_add(out_ptr + slot, nnz, mask=nnz > 0)
    tl.atomic_add(out_ptr + slot + 1, runs, mask=runs > 0)


def sparsity_counts_grouped(xs: list[torch.Tensor], out: torch.Tensor, slots: list[int]) -> None:
    """Add ``(nnz, runs)`` of each of ``xs`` (contiguous, 16-byte aligned, one element width
    of 2 or 4 bytes, one device) to ``out[slots[i]]`` and ``out[slots[i] + 1]`` (int64)
    with one table copy and at most two launches."""
    ints = [x.reshape(-1).view(_BIT_VIEW[x.element_size()]) for x in xs]
    launch_grouped(
        sparsity_counts_grouped_kernel,
        [[x.data_ptr(), 0, 0, 0] for x in ints],
        [x.numel() for x in ints],
        TILE,
        out,
        slots,
        (ints[0],),
    )
