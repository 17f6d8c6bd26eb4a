"""Grouped blockwise encode: many tensors of one dtype and codec in two launches.

The same per-tile arithmetic as ``quantize_blockwise`` (it calls that kernel's helpers
and repeats its rounding lines), over a table of tensors instead of one: row ``j`` of the
int64 table holds tensor ``j``'s addresses (input, reference, codes, scales), its element
count, the first row of its first tile, the index of its first program and the index of
its flag. A program finds its tensor by a binary search of the programs' start indices
(``LOG_T`` steps), then encodes one ``(ROWS, BLOCK)`` tile as the single-tensor kernel does,
so every tensor's codes and scales are the bytes that kernel gives it alone.

Two launches cover a group: one over every whole tile of every tensor (no bounds masks, so
16-byte vector loads; the launcher only puts 16-byte aligned buffers in a group, and the
kernel says so with ``tl.multiple_of``), one over the partial tile at the end of each
tensor that has one. A program whose tile holds a NaN/Inf block raises its tensor's flag
with an atomic max (an OR, so the order of programs does not matter): the caller's flags
start at zero, and the flags of a whole save are one buffer read back once.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .quantize_blockwise import _RNE_MAGIC, _SCALE_HI_MASK, pack_lsb_first, widen_to_f32
from .tiles import NUM_WARPS, rows_per_program

# Columns of a table row (int64).
X, REF, CODES, SCALES, N, ROW0, START, FLAG = range(8)
COLUMNS = 8
# Output regions of one tensor start on this many bytes, so every whole tile's stores are
# vectors (the input tensors must be aligned as well: see group_key).
ALIGN = 16


@triton.jit
def find_entry(table_ptr, pid, T, LOG_T: tl.constexpr, COLS: tl.constexpr):
    """The last row ``j < T`` of the table whose START column is ``<= pid`` (starts ascend)."""
    j = pid * 0
    for k in tl.static_range(LOG_T):
        cand = j + (1 << (LOG_T - 1 - k))
        start = tl.load(table_ptr + cand * COLS + 6, mask=cand < T, other=pid + 1)
        j = tl.where(start <= pid, cand, j)
    return j


@triton.jit
def quantize_blockwise_grouped_kernel(
    table_ptr,
    flags_ptr,
    x_type_ptr,
    ref_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    QMAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode one tile of one tensor of the table (``T`` rows). ``x_type_ptr`` and
    ``ref_type_ptr`` only carry the element types of the inputs."""
    CODE_OFFSET: tl.constexpr = 1 << (BITS - 1)
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE
    COLS: tl.constexpr = 8

    pid = tl.program_id(0).to(tl.int64)
    j = find_entry(table_ptr, pid, T, LOG_T, COLS)
    row = table_ptr + j * COLS
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # Addresses to typed pointers; every one is 16-byte aligned (the launcher's rule).
    x_ptr = tl.multiple_of(tl.load(row + 0).to(x_type_ptr.dtype, bitcast=True), 16)
    codes_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    scales_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32), bitcast=True), 16)

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        in_bounds = offs < n
        x = tl.load(x_ptr + offs, mask=in_bounds, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    d = widen_to_f32(x)
    if HAS_REF:
        ref_ptr = tl.multiple_of(tl.load(row + 1).to(ref_type_ptr.dtype, bitcast=True), 16)
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
        d = d - widen_to_f32(r)

    # From here to the packing: the single-tensor kernel's lines (quantize_blockwise.py).
    a = tl.abs(d)
    a = tl.where(a == a, a, float("inf"))
    absmax = tl.max(a, axis=1)
    scale = tl.div_rn(absmax, QMAX * 1.0)
    usable = (scale > 0.0) & (scale < float("inf"))
    safe_scale = tl.where(usable, scale, 1.0)
    v = tl.div_rn(d, safe_scale[:, None])
    r = (v + _RNE_MAGIC) - _RNE_MAGIC
    s_hi = (safe_scale.to(tl.int32, bitcast=True) & _SCALE_HI_MASK).to(tl.float32, bitcast=True)
    s_lo = safe_scale - s_hi
    r1 = d - v * s_hi[:, None]
    r2 = r1 + r1
    p2 = (v + v) * s_lo[:, None]
    tie = tl.abs(v - r) == 0.5
    v = tl.where(tie & (r2 > p2), v + 0.5, tl.where(tie & (r2 < p2), v - 0.5, r))
    v = tl.minimum(tl.maximum(v, -QMAX * 1.0), QMAX * 1.0)
    v = tl.where(usable[:, None], v, 0.0)
    u = v.to(tl.int32) + CODE_OFFSET
    packed = pack_lsb_first(u, ROWS, BLOCK, BITS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        row_in = rows * BLOCK < n
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(scales_ptr + rows, scale, mask=row_in)
        bad = tl.max((row_in & (scale == float("inf"))).to(tl.int64), axis=0)
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(scales_ptr + rows, scale)
        bad = tl.max((scale == float("inf")).to(tl.int64), axis=0)
    tl.atomic_max(flags_ptr + tl.load(row + 7), bad, mask=bad > 0)


def aligned(t: torch.Tensor) -> bool:
    """Whether ``t`` may be read by a group's unmasked vector loads: contiguous, 16-byte
    aligned."""
    return t.is_contiguous() and t.data_ptr() % ALIGN == 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def plan_group(xs: list[torch.Tensor], bits: int, block: int) -> tuple[list[int], list[int], int, int]:
    """Byte offsets of each tensor's codes and scales in the group's two output buffers,
    each region ``ALIGN``-aligned, and the two buffers' sizes in bytes."""
    code_offs, scale_offs = [], []
    c = s = 0
    for x in xs:
        n = x.numel()
        code_offs.append(c)
        scale_offs.append(s)
        c += _round_up((n * bits + 7) // 8, ALIGN)
        s += _round_up(4 * -(-n // block), ALIGN)
    return code_offs, scale_offs, c, s


def quantize_blockwise_grouped(
    xs: list[torch.Tensor],
    refs: list[torch.Tensor] | None,
    bits: int,
    block: int,
    qmax: int,
    flags: torch.Tensor,
    slots: list[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Encode ``xs`` (contiguous, 16-byte aligned, one dtype; ``refs`` likewise, one dtype)
    with two launches; raise ``flags[slots[i]]`` (int64; ``slots`` default ``0, 1, ..``)
    where tensor ``i`` has a NaN/Inf block.

    Returns:
        ``(codes, scales)`` per tensor: views of one codes and one scales buffer, the
        bytes :func:`quantize_blockwise` gives each tensor alone.
    """
    device = xs[0].device
    slot = list(range(len(xs))) if slots is None else slots
    code_offs, scale_offs, code_bytes, scale_bytes = plan_group(xs, bits, block)
    codes_all = torch.empty(code_bytes, dtype=torch.uint8, device=device)
    scales_all = torch.empty(scale_bytes // 4, dtype=torch.float32, device=device)
    rows = rows_per_program(block)
    main: list[list[int]] = []
    tail: list[list[int]] = []
    outs = []
    total_main = 0  # programs of the main launch so far
    c_base, s_base = codes_all.data_ptr(), scales_all.data_ptr()
    for i, x in enumerate(xs):
        n = x.numel()
        ref_addr = refs[i].data_ptr() if refs is not None else 0
        base = [x.data_ptr(), ref_addr, c_base + code_offs[i], s_base + scale_offs[i], n]
        full = n // (rows * block)
        if full:
            main.append([*base, 0, total_main, slot[i]])
            total_main += full
        if full * rows * block < n:
            tail.append([*base, full * rows, len(tail), slot[i]])
        nc = (n * bits + 7) // 8
        ns = -(-n // block)
        outs.append(
            (
                codes_all[code_offs[i] : code_offs[i] + nc],
                scales_all[scale_offs[i] // 4 : scale_offs[i] // 4 + ns],
            )
        )
    host = torch.tensor([v for r in main + tail for v in r], dtype=torch.int64)
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    meta = dict(
        HAS_REF=refs is not None,
        BITS=bits,
        QMAX=qmax,
        BLOCK=block,
        ROWS=rows,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    x_type = xs[0]
    ref_type = refs[0] if refs is not None else xs[0]
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        if total_main:
            quantize_blockwise_grouped_kernel[(total_main,)](
                table, flags, x_type, ref_type, len(main), LOG_T=_log_t(len(main)), MASKED=False, **meta
            )
        if tail:
            quantize_blockwise_grouped_kernel[(len(tail),)](
                table[len(main) * COLUMNS :],
                flags,
                x_type,
                ref_type,
                len(tail),
                LOG_T=_log_t(len(tail)),
                MASKED=True,
                **meta,
            )
    return outs


def _log_t(t: int) -> int:
    """Binary-search steps over ``t`` rows: the least ``k`` with ``2**k >= t``, at least 1."""
    return max(1, (t - 1).bit_length())
