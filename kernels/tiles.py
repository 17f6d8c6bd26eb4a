"""Launch geometry shared by the blockwise kernels.

Both kernels view a flat tensor as rows of ``BLOCK`` elements (one row per scale) and give
each program ``ROWS`` consecutive rows. Tiles wholly inside the tensor run as one launch
without bounds masks, so their loads and stores stay 16-byte vectors whatever the length;
the partial tile at the end, if any, is one masked program of its own.
"""

from __future__ import annotations

import contextlib

import torch

# Elements per program: large enough to amortize the program's scalar work, small enough to
# keep the tile in registers (16 elements per thread with 8 warps).
TILE_ELEMENTS = 4096
NUM_WARPS = 8


def rows_per_program(block: int) -> int:
    """Blocks (rows) handled by one program for a given block size."""
    return max(1, TILE_ELEMENTS // block)


def launch_row_tiles(
    kernel,
    pointers: tuple,
    n: int,
    row0: int,
    block: int,
    device: torch.device,
    **constexprs,
) -> None:
    """Run ``kernel[grid](*pointers, n, row0', MASKED=..., BLOCK, ROWS, ...)`` over rows
    ``row0 ..`` of an ``n``-element flat tensor: the unmasked whole tiles, then the tail.

    ``row0`` is 0 in normal use; tests set it far past 2**31 elements to exercise the
    kernels' int64 offsets without allocating such a tensor.
    """
    rows = rows_per_program(block)
    full_tiles = max(0, n - row0 * block) // (rows * block)
    meta = dict(BLOCK=block, ROWS=rows, num_warps=NUM_WARPS, enable_fp_fusion=False, **constexprs)
    # Triton launches on the current device: make it the tensors' device.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        if full_tiles:
            kernel[(full_tiles,)](*pointers, n, row0, MASKED=False, **meta)
        tail_row0 = row0 + full_tiles * rows
        if tail_row0 * block < n:
            kernel[(1,)](*pointers, n, tail_row0, MASKED=True, **meta)
