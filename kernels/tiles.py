"""Launch geometry shared by the blockwise kernels.

Both kernels view a flat tensor as rows of ``BLOCK`` elements (one row per scale) and give
each program ``ROWS`` consecutive rows. Tiles wholly inside the tensor run as one launch
without bounds masks, so their loads and stores stay 16-byte vectors whatever the length;
the partial tile at the end, if any, is one masked program of its own.

The grouped kernels do the same over many tensors (:func:`launch_grouped`): row ``j`` of
an int64 table holds tensor ``j``'s four addresses (inputs and outputs), its element
count, the first row of its first tile, the index of its first program and the slot of its
flag (then any values of its own a kernel adds, such as the encode's ``qmax``); a program
finds its row by a binary search of the programs' start indices
(:func:`find_entry`). One launch runs every whole tile of every tensor unmasked, one the
partial tile of each tensor that has one: two launches and one table copy per group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

# Elements per program: large enough to amortize the program's scalar work, small enough to
# keep the tile in registers (16 elements per thread with 8 warps).
TILE_ELEMENTS = 4096
NUM_WARPS = 8


def rows_per_program(block: int) -> int:
    """Blocks (rows) handled by one program for a given block size."""
    return max(1, TILE_ELEMENTS // block)


def check_block_bounds(
    op: str, lo: torch.Tensor, hi: torch.Tensor, nblocks: int, device: torch.device
) -> None:
    """Raise unless ``lo`` and ``hi`` are int32 with one value per block, on ``device``: the
    per-block bounds of the log2 codecs' launchers."""
    for name, b in (("lo", lo), ("hi", hi)):
        if b.dtype != torch.int32 or b.numel() != nblocks or b.device != device:
            raise QuantizationError(
                f"{op}: {name} is {b.dtype} x {b.numel()} on {b.device}, expected int32 x {nblocks} on {device}"
            )


def launch_row_tiles(
    kernel,
    pointers: tuple,
    n: int,
    row0: int,
    block: int,
    device: torch.device,
    scalars: tuple = (),
    **constexprs,
) -> None:
    """Run ``kernel[grid](*pointers, n, row0', *scalars, MASKED=..., BLOCK, ROWS, ...)``
    over rows ``row0 ..`` of an ``n``-element flat tensor: the unmasked whole tiles, then
    the tail. ``scalars`` are runtime values (not specialized on: fp32 ones).

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
            kernel[(full_tiles,)](*pointers, n, row0, *scalars, MASKED=False, **meta)
        tail_row0 = row0 + full_tiles * rows
        if tail_row0 * block < n:
            kernel[(1,)](*pointers, n, tail_row0, *scalars, MASKED=True, **meta)


# A grouped kernel is specialized on the alignment of its table only: its flag or output
# slots are int64 slices of a save's scalars at any 8-byte offset, and its type carriers are
# never read, so each of their alignments would otherwise compile again at a save
# (do_not_specialize_on_alignment; tests/checkpointing/test_first_save_kernels.py).
# A grouped kernel's table row (int64): four addresses, then the length, the first row,
# the row's index and the flag slot (the kernels read them at row + 4 .. row + 7), then
# any per-tensor values a kernel adds (``launch_grouped``'s ``columns``).
TABLE_COLUMNS = 8
# Every input and output region of a group starts on this many bytes: the kernels declare
# the table's addresses 16-byte aligned, so whole tiles load and store 16-byte vectors.
ALIGN = 16


def table_width(extra: int) -> int:
    """Columns of a grouped table with ``extra`` per-tensor values after the slot: rounded
    up to 16 bytes, so the tail launch's table (a slice after the main rows) stays as
    aligned as the whole, whatever the number of rows (one kernel specialization)."""
    return -(-(TABLE_COLUMNS + extra) // 2) * 2


@triton.jit
def find_entry(table_ptr, pid, T, LOG_T: tl.constexpr, COLUMNS: tl.constexpr = 8):
    """The last row ``j < T`` of a grouped table (``COLUMNS`` int64 a row) whose start
    column is ``<= pid`` (starts ascend): the tensor whose tile program ``pid`` encodes."""
    j = pid * 0
    for k in tl.static_range(LOG_T):
        cand = j + (1 << (LOG_T - 1 - k))
        start = tl.load(table_ptr + cand * COLUMNS + 6, mask=cand < T, other=pid + 1)
        j = tl.where(start <= pid, cand, j)
    return j


def aligned(t: torch.Tensor) -> bool:
    """Whether a grouped kernel may read ``t`` as it is: contiguous and 16-byte aligned."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def group_outputs(
    numels: Sequence[int], outputs: Sequence[tuple[torch.dtype, Callable[[int], int]]], device: torch.device
) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """One buffer per output kind (``(dtype, length for n elements)``) for a whole group,
    each tensor's region ``ALIGN``-aligned; returns each tensor's views and addresses."""
    views: list[list[torch.Tensor]] = [[] for _ in numels]
    addrs: list[list[int]] = [[] for _ in numels]
    for dtype, length in outputs:
        size = torch.empty((), dtype=dtype).element_size()
        offsets, total = [], 0
        for n in numels:
            offsets.append(total)
            total += _round_up(length(n) * size, ALIGN)
        buf = torch.empty(total // size, dtype=dtype, device=device)
        for i, n in enumerate(numels):
            start = offsets[i] // size
            views[i].append(buf[start : start + length(n)])
            addrs[i].append(buf.data_ptr() + offsets[i])
    return views, addrs


def launch_grouped(
    kernel,
    addresses: Sequence[Sequence[int]],
    numels: Sequence[int],
    block: int,
    flags: torch.Tensor,
    slots: Sequence[int],
    type_carriers: tuple,
    passes: Sequence[dict] = ({},),
    columns: Sequence[Sequence[int]] | None = None,
    **constexprs,
) -> None:
    """Run a grouped ``kernel[grid](table, flags, *type_carriers, T, LOG_T=.., MASKED=..,
    BLOCK, ROWS, ...)`` over tensors with four ``addresses`` each: the whole tiles in one
    launch, the tails in another, after one copy of the table to the device (from pinned
    memory on CUDA, so no sync). With several ``passes`` (extra constexprs each) the one
    table serves each pass's two launches in turn, a pass reading what the one before
    wrote. ``columns``: more int64 values per tensor, after its slot (the kernel's rows
    are then :func:`table_width` wide)."""
    rows = rows_per_program(block)
    width = table_width(len(columns[0]) if columns else 0)
    pad = [0] * (width - TABLE_COLUMNS)
    extra = [pad] * len(numels) if columns is None else [[*c, *pad[len(c) :]] for c in columns]
    main: list[int] = []
    tail: list[int] = []
    programs = 0
    for addr, n, slot, more in zip(addresses, numels, slots, extra):
        full = n // (rows * block)
        if full:
            main += [*addr, n, 0, programs, slot, *more]
            programs += full
        if full * rows * block < n:
            tail += [*addr, n, full * rows, len(tail) // width, slot, *more]
    if not main and not tail:
        return
    device = flags.device
    host = torch.tensor(main + tail, dtype=torch.int64)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    meta = dict(BLOCK=block, ROWS=rows, num_warps=NUM_WARPS, enable_fp_fusion=False, **constexprs)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    n_main, n_tail = len(main) // width, len(tail) // width
    with on_device:
        for extra in passes:
            if n_main:
                kernel[(programs,)](
                    table,
                    flags,
                    *type_carriers,
                    n_main,
                    LOG_T=log_steps(n_main),
                    MASKED=False,
                    **meta,
                    **extra,
                )
            if n_tail:
                kernel[(n_tail,)](
                    table[len(main) :],
                    flags,
                    *type_carriers,
                    n_tail,
                    LOG_T=log_steps(n_tail),
                    MASKED=True,
                    **meta,
                    **extra,
                )


def log_steps(t: int) -> int:
    """Binary-search steps over ``t`` table rows: the least ``k >= 1`` with ``2**k >= t``."""
    return max(1, (t - 1).bit_length())
