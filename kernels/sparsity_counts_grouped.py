"""Grouped sparsity counts: the non-zero elements and the runs of zeros of many tensors of
one element width in two launches.

The spec is ``tw_triton.ops.reference.sparsity_counts_many_torch`` (``sparsity_counts`` of
each tensor, added to two int64 slots). The launcher views the tensors as the integer of
their width, so zero is the all-zero bit pattern (``-0.0`` and NaN are values) and no
float instruction is involved. Tiles of ``TILE`` elements run over the table geometry of
the other grouped kernels (``tiles.launch_grouped``: whole tiles unmasked, the tails
masked, int64 offsets). An element starts a run where it is zero and the element before
it is not. A program packs the zero flags of each 16 elements of its tile into a word and
finds the starts with shifts inside the word; for a word's first element it reads the
element before the word (for the tile's first word, the last element of the tile before;
the tensor's first element follows nothing: a zero there starts a run). Each program adds
its tile's two counts to its tensor's slots with atomic adds, which do not depend on the
order of the programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tiles import find_entry, launch_grouped

# Elements per program (tiles.TILE_ELEMENTS, one row per program).
TILE = 4096
_BIT_VIEW = {2: torch.int16, 4: torch.int32}


@triton.jit(do_not_specialize_on_alignment=["out_ptr", "x_type_ptr"])
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
    WORD: tl.constexpr = 16  # elements whose zero flags make one word
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    tile = tl.load(row + 5) + (pid - tl.load(row + 6))
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    starts = tile * BLOCK + tl.arange(0, BLOCK // WORD).to(tl.int64) * WORD
    offs = starts[:, None] + tl.arange(0, WORD)[None, :]
    if MASKED:
        inside = offs < n
        v = tl.load(x_ptr + offs, mask=inside, other=0)
        nonzero = inside & (v != 0)
        zero = inside & (v == 0)
        # The element before each word (a word past the end has no zero: no run).
        before = tl.load(x_ptr + (starts - 1), mask=(starts > 0) & (starts < n), other=1)
    else:
        v = tl.load(x_ptr + offs)
        nonzero = v != 0
        zero = v == 0
        before = tl.load(x_ptr + (starts - 1), mask=starts > 0, other=1)
    # Bit j of a word: element j is zero; a run starts where the bit before it is clear.
    bits = tl.arange(0, WORD)[None, :]
    word = tl.sum(zero.to(tl.int32) << bits, axis=1)
    first = word & ~((word << 1) | (before == 0).to(tl.int32))
    nnz = tl.sum(tl.sum(nonzero.to(tl.int32), axis=1), axis=0).to(tl.int64)
    runs = tl.sum(tl.sum((first[:, None] >> bits) & 1, axis=1), axis=0).to(tl.int64)
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
