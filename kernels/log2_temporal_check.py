"""``log2-temporal`` codes checked before a decode: one flag per tensor, for one tensor or
for a group (a load's, over a table of tensors: ``tiles.launch_grouped``).

The spec is ``tw_triton.ops.reference.log2_temporal_code_errors_torch``: a block's bounds
must be ``0, 0`` (temporal), ``-1, -1`` (uncodable) or ``1 <= lo <= hi < bits(+inf)``; an
element's code must be at most ``2**bits - 1`` (0 in an uncodable block), and a temporal
block's code other than ``-128`` needs a positive finite reference. Integer comparisons
only. The kernel says whether anything is wrong; the torch spec then says what.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .tiles import check_block_bounds, find_entry, launch_grouped, launch_row_tiles

_F32_INF_BITS = tl.constexpr(0x7F800000)
_ZERO_CODE_BYTE = tl.constexpr(0x80)


@triton.jit
def check_rows(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    ref_ptr,
    n,
    first_row,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """1 if rows ``first_row`` .. ``+ ROWS`` hold a bad bound or code, else 0 (int32): the
    check's tile arithmetic, shared by the single and the grouped kernel."""
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        inside = offs < n
        row_inside = rows * BLOCK < n
        c = tl.load(codes_ptr + offs, mask=inside, other=_ZERO_CODE_BYTE).to(tl.int32)
        r = tl.load(ref_ptr + offs, mask=inside, other=1.0).to(tl.int32, bitcast=True)
        lo = tl.load(lo_ptr + rows, mask=row_inside, other=0)
        hi = tl.load(hi_ptr + rows, mask=row_inside, other=0)
    else:
        c = tl.load(codes_ptr + offs).to(tl.int32)
        r = tl.load(ref_ptr + offs).to(tl.int32, bitcast=True)
        lo = tl.load(lo_ptr + rows)
        hi = tl.load(hi_ptr + rows)
    temporal = (lo == 0) & (hi == 0)
    uncodable = (lo == -1) & (hi == -1)
    bounds_bad = ~(temporal | uncodable | ((lo >= 1) & (lo <= hi) & (hi < _F32_INF_BITS)))
    limit = tl.where(uncodable, 0, (1 << BITS) - 1)
    positive = (r > 0) & (r < _F32_INF_BITS)
    bad = tl.where(temporal[:, None], (c != _ZERO_CODE_BYTE) & ~positive, c > limit[:, None])
    if MASKED:
        # Outside the tensor: code 0x80 over a reference of 1.0 passes a temporal block but
        # not an absolute one, so the padding is masked out here (its rows' bounds, loaded
        # as 0, 0, pass).
        bad = bad & inside
    return tl.maximum(tl.max(bad.to(tl.int32)), tl.max(bounds_bad.to(tl.int32)))


@triton.jit(do_not_specialize=["row0"])
def log2_temporal_check_kernel(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    ref_ptr,
    flag_ptr,
    n,
    row0,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Set ``flag_ptr[0]`` to 1 if rows ``row0 + pid * ROWS`` .. ``+ ROWS`` hold a bad
    bound or code (it is left alone otherwise: every program writes the same 1)."""
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    worst = check_rows(codes_ptr, lo_ptr, hi_ptr, ref_ptr, n, first_row, MASKED, BITS, BLOCK, ROWS)
    tl.store(flag_ptr, worst, mask=worst > 0)


@triton.jit(do_not_specialize_on_alignment=["flags_ptr"])
def log2_temporal_check_grouped_kernel(
    table_ptr,
    flags_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Set tensor ``j``'s flag (``flags_ptr[slot]``) to 1 if this program's tile of it holds
    a bad bound or code; the table's row ``j``: the addresses of the codes, ``lo``, ``hi``
    and the reference (none assumed 16-byte aligned: a file's codes follow their bounds)."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    codes_ptr = tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True)
    lo_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int32), bitcast=True)
    hi_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int32), bitcast=True)
    ref_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32), bitcast=True)
    worst = check_rows(codes_ptr, lo_ptr, hi_ptr, ref_ptr, n, first_row, MASKED, BITS, BLOCK, ROWS)
    tl.store(flags_ptr + tl.load(row + 7), worst.to(tl.int64), mask=worst > 0)


def _check_args(codes, lo, hi, ref, block, what) -> None:
    n = codes.numel()
    if codes.dtype != torch.uint8 or ref.dtype != torch.float32 or ref.numel() != n:
        raise QuantizationError(
            f"{what}: codes {codes.dtype} x {n} over a reference {ref.dtype} x "
            f"{ref.numel()}; expected uint8 codes over a float32 reference of as many elements"
        )
    check_block_bounds(what, lo, hi, -(-n // block), codes.device)


def log2_temporal_check_grouped(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
) -> torch.Tensor:
    """Each tensor's flag (int64, on the codes' device: 1 if its codes hold what no encoder
    writes), with one table copy and at most two launches.

    Raises:
        QuantizationError: buffers of the wrong dtype, size or device.
    """
    flat = [c.contiguous().view(-1) for c in codes]
    refs = [r.contiguous().view(-1) for r in references]
    bounds = [(a.contiguous(), b.contiguous()) for a, b in zip(lo, hi)]
    for c, (a, b), r in zip(flat, bounds, refs):
        _check_args(c, a, b, r, block, "log2_temporal_check_grouped")
    flags = torch.zeros(len(flat), dtype=torch.int64, device=flat[0].device if flat else None)
    launch_grouped(
        log2_temporal_check_grouped_kernel,
        [
            [c.data_ptr(), a.data_ptr(), b.data_ptr(), r.data_ptr()]
            for c, (a, b), r in zip(flat, bounds, refs)
        ],
        [c.numel() for c in flat],
        block,
        flags,
        list(range(len(flat))),
        (),
        BITS=bits,
    )
    return flags


def log2_temporal_check(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> torch.Tensor:
    """A device int32 scalar: 1 if the codes hold what no encoder writes, else 0.

    Raises:
        QuantizationError: buffers of the wrong dtype, size or device.
    """
    n = codes.numel()
    ref = reference.reshape(-1)
    _check_args(codes, lo, hi, ref, block, "log2_temporal_check")
    flag = torch.zeros(1, dtype=torch.int32, device=codes.device)
    if n:
        launch_row_tiles(
            log2_temporal_check_kernel,
            (codes.contiguous().view(-1), lo.contiguous(), hi.contiguous(), ref.contiguous(), flag),
            n,
            0,
            block,
            codes.device,
            BITS=bits,
        )
    return flag
