"""Fused ``log2-temporal`` decode: the change added to the reference's bit pattern, or the
absolute ``log2`` level, per block.

Same tile layout as ``dequantize_log2``. The spec is
``tw_triton.ops.reference.dequantize_log2_temporal_torch``: the temporal part is int64
arithmetic (``clamp(r + q * S, 1, 0x7F7FFFFF)``), the absolute part the ``log2`` decode
(``cvt.rn``, ``div.rn``, ``mul.rn``, ``add.rn`` and a truncating conversion), so the decoded
tensors are identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .dequantize_blockwise import codes_to_f32
from .quantize_log2_temporal import check_temporal_args, temporal_step
from .tiles import check_block_bounds, launch_row_tiles

_F32_MAX_BITS = tl.constexpr(0x7F7FFFFF)
_ZERO_CODE = tl.constexpr(-128)


@triton.jit
def temporal_decode_tile(c8, r, lo, hi, min_step, BITS: tl.constexpr):
    """The decoded float32 values of a tile: codes ``c8`` (uint8, rows x BLOCK) over the
    reference ``r`` (float32, same shape), with each row's bounds ``lo``, ``hi``. Shared
    with the grouped decode, so both give the same bits."""
    N_STEPS: tl.constexpr = (1 << BITS) - 2
    rb = r.to(tl.int32, bitcast=True)
    u = c8.to(tl.int32)
    q = tl.where(u >= 128, u - 256, u)

    step = temporal_step(rb, N_STEPS, min_step)[:, None]
    t_tmp = rb.to(tl.int64) + q.to(tl.int64) * step
    t_tmp = tl.minimum(tl.maximum(t_tmp, 1), _F32_MAX_BITS)
    t_tmp = tl.where(q == _ZERO_CODE, 0, t_tmp).to(tl.int32)

    # The absolute rows' levels, in a tile that holds one (once a chain runs, most hold none).
    temporal = (lo == 0) & (hi == 0)
    t = t_tmp
    if tl.min(temporal.to(tl.int32)) == 0:
        a_step = tl.div_rn((hi - lo).to(tl.float32), N_STEPS * 1.0)
        p = codes_to_f32(u, 1) * a_step[:, None]
        t_abs = lo[:, None] + (p + 0.5).to(tl.int32)
        t_abs = tl.minimum(t_abs, hi[:, None])
        t_abs = tl.where(u > 0, t_abs, 0)
        t = tl.where(temporal[:, None], t_tmp, t_abs)
    return t.to(tl.float32, bitcast=True)


@triton.jit
def temporal_decode_rows(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    ref_ptr,
    out_ptr,
    n,
    first_row,
    min_step,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Load, decode and store rows ``first_row`` .. ``+ ROWS`` of one tensor: the body of
    the single and the grouped decode, which differ only in where the pointers come from."""
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        c8 = tl.load(codes_ptr + offs, mask=offs < n, other=128)
        r = tl.load(ref_ptr + offs, mask=offs < n, other=0.0)
        lo = tl.load(lo_ptr + rows, mask=rows * BLOCK < n, other=0)
        hi = tl.load(hi_ptr + rows, mask=rows * BLOCK < n, other=0)
    else:
        c8 = tl.load(codes_ptr + offs)
        r = tl.load(ref_ptr + offs)
        lo = tl.load(lo_ptr + rows)
        hi = tl.load(hi_ptr + rows)
    v = temporal_decode_tile(c8, r, lo, hi, min_step, BITS)
    if MASKED:
        tl.store(out_ptr + offs, v, mask=offs < n)
    else:
        tl.store(out_ptr + offs, v)


@triton.jit(do_not_specialize=["row0"])
def dequantize_log2_temporal_kernel(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    ref_ptr,
    out_ptr,
    n,
    row0,
    min_step,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` into an ``n``-element flat output."""
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    temporal_decode_rows(
        codes_ptr, lo_ptr, hi_ptr, ref_ptr, out_ptr, n, first_row, min_step, MASKED, BITS, BLOCK, ROWS
    )


def dequantize_log2_temporal(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    reference: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    min_step: int,
) -> torch.Tensor:
    """Decode with the fused kernel to a flat float32 tensor of ``numel`` elements.

    Raises:
        QuantizationError: buffers of the wrong dtype, size or device.
    """
    nblocks = -(-numel // block)
    if codes.dtype != torch.uint8 or codes.numel() != numel:
        raise QuantizationError(
            f"dequantize_log2_temporal: codes are {codes.dtype} x {codes.numel()}, expected uint8 x {numel}"
        )
    check_block_bounds("dequantize_log2_temporal", lo, hi, nblocks, codes.device)
    ref = reference.contiguous().view(-1)
    out = torch.empty(numel, dtype=torch.float32, device=codes.device)
    check_temporal_args(out, ref, bits, block, "dequantize_log2_temporal")
    if numel:
        launch_row_tiles(
            dequantize_log2_temporal_kernel,
            (codes.contiguous(), lo.contiguous(), hi.contiguous(), ref, out),
            numel,
            0,
            block,
            codes.device,
            min_step=min_step,
            BITS=bits,
        )
    return out
