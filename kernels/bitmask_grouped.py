"""Grouped bitmask encode: the mask and the compacted non-zero values of many tensors of
one element width in a fixed number of launches.

The spec is ``tw_triton.ops.reference.bitmask_encode_many_torch`` (the single
``bitmask_encode`` of each tensor). The launcher views the tensors as the integer of their
width, so zero is the all-zero bit pattern (``-0.0`` and NaN are values) and no float
instruction is involved. The two passes of the single encode (``kernels/bitmask.py``, whose
tile bodies ``load_tile`` and ``mask_tile`` they call) run over the table geometry of the other grouped kernels (``tiles.launch_grouped``: tiles of
``TILE`` elements, whole tiles unmasked, the tails masked, int64 offsets), with one count
per tile of the whole group:

1. per tile, the packed mask bytes and the tile's count of non-zero elements, into the
   group's counts at the tensor's first tile (table column 7) plus the tile;
2. the exclusive cumulative sum of all the counts (torch, on the device: two ops); a
   tile's place in its tensor's ``values`` is its start minus that of the tensor's first
   tile, so one scan serves every tensor;
3. per tile, each non-zero element's rank inside the tile (``tl.cumsum``) plus that place.

The caller knows each tensor's count of non-zero elements (the save read it back with the
choice), which sizes the outputs: one mask buffer and one values buffer for the group, each
tensor's region 16-byte aligned. Every store into a tensor's values is bounded by its
count (table column 3), so a wrong count cannot reach another tensor's region.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bitmask import load_tile, mask_tile
from .tiles import find_entry, group_outputs, launch_grouped

# Elements per program (tiles.TILE_ELEMENTS, one row per program), as the single encode.
TILE = 4096
_BIT_VIEW = {2: torch.int16, 4: torch.int32}


@triton.jit
def grouped_tile(table_ptr, x_type_ptr, T, LOG_T: tl.constexpr):
    """This program's table row, its tensor's length, the tile (of that tensor) it codes
    and the tensor's elements as the integer type ``x_type_ptr`` carries."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    tile = tl.load(row + 5) + (pid - tl.load(row + 6))
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    return row, n, tile, x_ptr


@triton.jit(do_not_specialize_on_alignment=["counts_ptr", "x_type_ptr"])
def bitmask_mask_grouped_kernel(
    table_ptr,
    counts_ptr,
    x_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Pass 1: the mask bytes of one tile of one tensor of the table (``T`` rows: input,
    mask, values, count; length, first tile, program index, first count slot) and its
    non-zero count. ``x_type_ptr`` only carries the integer type of the elements."""
    tl.static_assert(ROWS == 1)
    row, n, tile, x_ptr = grouped_tile(table_ptr, x_type_ptr, T, LOG_T)
    mask_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    nz = mask_tile(x_ptr, mask_ptr, tile, n, MASKED, BLOCK)
    tl.store(counts_ptr + tl.load(row + 7) + tile, tl.sum(nz, axis=0).to(tl.int64))


@triton.jit(do_not_specialize_on_alignment=["starts_ptr", "x_type_ptr"])
def bitmask_scatter_grouped_kernel(
    table_ptr,
    starts_ptr,
    x_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Pass 3: the non-zero elements of one tile of one tensor of the table to their
    places in its values (``starts_ptr``: the exclusive scan of the group's counts)."""
    tl.static_assert(ROWS == 1)
    row, n, tile, x_ptr = grouped_tile(table_ptr, x_type_ptr, T, LOG_T)
    values_ptr = tl.multiple_of(tl.load(row + 2).to(x_type_ptr.dtype, bitcast=True), 16)
    nnz = tl.load(row + 3)
    first = tl.load(row + 7)
    v, nz = load_tile(x_ptr, tile, n, MASKED, BLOCK)
    rank = tl.cumsum(nz, axis=0) - nz
    start = tl.load(starts_ptr + first + tile) - tl.load(starts_ptr + first)
    dest = start + rank.to(tl.int64)
    tl.store(values_ptr + dest, v, mask=(nz != 0) & (dest < nnz))


def bitmask_encode_grouped(
    xs: list[torch.Tensor], nnzs: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(mask, values)`` of each of ``xs`` (contiguous, 16-byte aligned, one element width
    of 2 or 4 bytes, one device), ``nnzs[i]`` the count of non-zero bit patterns of
    ``xs[i]``: two table copies, at most four launches and two torch ops (the scan).

    Returns:
        Views of one mask buffer (uint8, ``ceil(n / 8)`` each) and of one values buffer
        (``nnzs[i]`` elements of ``xs[i]``'s dtype each).
    """
    device = xs[0].device
    ints = [x.reshape(-1).view(_BIT_VIEW[x.element_size()]) for x in xs]
    numels = [x.numel() for x in ints]
    masks, mask_addrs = group_outputs(numels, [(torch.uint8, lambda n: (n + 7) // 8)], device)
    values, value_addrs = group_outputs(nnzs, [(ints[0].dtype, lambda n: n)], device)
    firsts, total = [], 0
    for n in numels:
        firsts.append(total)
        total += -(-n // TILE)
    rows = [[x.data_ptr(), mask_addrs[i][0], value_addrs[i][0], nnzs[i]] for i, x in enumerate(ints)]
    if total:
        counts = torch.empty(total, dtype=torch.int64, device=device)  # pass 1 writes every tile
        launch_grouped(bitmask_mask_grouped_kernel, rows, numels, TILE, counts, firsts, (ints[0],))
        sparse = [i for i, nnz in enumerate(nnzs) if nnz and numels[i]]
        if sparse:
            starts = torch.cumsum(counts, 0) - counts
            launch_grouped(
                bitmask_scatter_grouped_kernel,
                [rows[i] for i in sparse],
                [numels[i] for i in sparse],
                TILE,
                starts,
                [firsts[i] for i in sparse],
                (ints[0],),
            )
    return [(m[0], v[0].view(x.dtype)) for m, v, x in zip(masks, values, xs)]
