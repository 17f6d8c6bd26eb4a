"""Grouped blockwise-update encode: ``u = m / (sqrt(v_hat) + eps)`` coded blockwise, many
tensors in two launches.

The grouped blockwise encode (``quantize_blockwise_grouped``) with the update computed in
the tile: each program loads a ``(ROWS, BLOCK)`` tile of ``m`` and of its partner's decode
``v_hat`` (fp32), forms ``u`` with correctly rounded fp32 ops (``sqrt.rn``, an add,
``div.rn``; no fusion), the bits of the codec's torch expression, and runs the same tile
arithmetic (``quantize_tile``). A tensor's flag is raised where ``u`` has a NaN/Inf block
or the denominator is infinite (an infinite partner: the decode would be ``0 * inf``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quantize_blockwise import quantize_tile, widen_to_f32
from .tiles import find_entry, group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "m_type_ptr", "v_type_ptr"])
def quantize_blockwise_update_grouped_kernel(
    table_ptr,
    flags_ptr,
    m_type_ptr,
    v_type_ptr,
    eps,
    qmax,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode one tile of one tensor of the table (``T`` rows: addresses of m, v_hat, codes,
    scales); ``eps`` and ``qmax`` (the largest code magnitude) are fp32. ``m_type_ptr`` and
    ``v_type_ptr`` only carry element types."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # Addresses to typed pointers; every one is 16-byte aligned (tiles.ALIGN).
    m_ptr = tl.multiple_of(tl.load(row + 0).to(m_type_ptr.dtype, bitcast=True), 16)
    v_ptr = tl.multiple_of(tl.load(row + 1).to(v_type_ptr.dtype, bitcast=True), 16)
    codes_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    scales_ptr = tl.multiple_of(tl.load(row + 3).to(tl.pointer_type(tl.float32), bitcast=True), 16)

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        in_bounds = offs < n
        m = tl.load(m_ptr + offs, mask=in_bounds, other=0.0)
        v = tl.load(v_ptr + offs, mask=in_bounds, other=0.0)
    else:
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
    den = tl.sqrt_rn(widen_to_f32(v)) + tl.full((ROWS, BLOCK), eps, tl.float32)
    u = tl.div_rn(widen_to_f32(m), den)

    packed, scale = quantize_tile(u, qmax, BITS, BLOCK, ROWS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    inf_den = den == float("inf")
    if MASKED:
        row_in = rows * BLOCK < n
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(scales_ptr + rows, scale, mask=row_in)
        bad = tl.max((row_in & (scale == float("inf"))).to(tl.int64), axis=0)
        bad = tl.maximum(bad, tl.max(tl.max((in_bounds & inf_den).to(tl.int64), axis=1), axis=0))
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(scales_ptr + rows, scale)
        bad = tl.max((scale == float("inf")).to(tl.int64), axis=0)
        bad = tl.maximum(bad, tl.max(tl.max(inf_den.to(tl.int64), axis=1), axis=0))
    tl.atomic_max(flags_ptr + tl.load(row + 7), bad, mask=bad > 0)


def quantize_blockwise_update_grouped(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    qmax: int,
    flags: torch.Tensor,
    slots: list[int] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Encode ``ms[i] / (sqrt(vs[i]) + eps)`` (``ms`` contiguous, 16-byte aligned, one
    dtype; ``vs`` fp32 likewise) with one table copy and at most two launches; raise
    ``flags[slots[i]]`` (int64; default ``0, 1, ..``) where tensor ``i`` is flagged.

    Returns:
        ``(codes, scales)`` per tensor: views of one codes and one scales buffer.
    """
    numels = [m.numel() for m in ms]
    outputs = [(torch.uint8, lambda n: (n * bits + 7) // 8), (torch.float32, lambda n: -(-n // block))]
    views, out_addrs = group_outputs(numels, outputs, ms[0].device)
    addresses = [[m.data_ptr(), vs[i].data_ptr(), *out_addrs[i]] for i, m in enumerate(ms)]
    launch_grouped(
        quantize_blockwise_update_grouped_kernel,
        addresses,
        numels,
        block,
        flags,
        list(range(len(ms))) if slots is None else slots,
        (ms[0], vs[0], float(eps), float(qmax)),
        BITS=bits,
    )
    return [(v[0], v[1]) for v in views]
