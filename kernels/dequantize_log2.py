"""Fused ``log2`` decode (the second-moment codec): unpack, log-domain level, cast.

Same tile layout as ``dequantize_blockwise``. The spec is
``tw_triton.ops.reference.dequantize_log2_torch``; every step is an integer operation or a
correctly rounded fp32 one (``cvt.rn`` int32 -> fp32, ``div.rn``, ``mul.rn``, ``add.rn``, and
the truncating fp32 -> int32 conversion that torch's ``.to(torch.int32)`` also does), so the
decoded tensors are identical. The fp32 -> bf16 narrowing is integer rounding, for the
interpreter's sake (see ``dequantize_blockwise``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .dequantize_blockwise import codes_to_f32, narrow_from_f32, unpack_lsb_first
from .tiles import check_block_bounds, launch_row_tiles

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def log2_decode_tile(
    packed, lo, hi, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, OUT_DTYPE: tl.constexpr
):
    """The decoded ``ROWS x BLOCK`` tile of packed codes and their rows' bounds, in
    ``OUT_DTYPE``: level, log-domain value, cast (shared by the grouped decode)."""
    N_STEPS: tl.constexpr = (1 << BITS) - 2
    u = unpack_lsb_first(packed, ROWS, BLOCK, BITS)
    step = tl.div_rn((hi - lo).to(tl.float32), N_STEPS * 1.0)
    p = codes_to_f32(u, 1) * step[:, None]
    t = lo[:, None] + (p + 0.5).to(tl.int32)
    t = tl.minimum(t, hi[:, None])
    t = tl.where(u > 0, t, 0)
    return narrow_from_f32(t.to(tl.float32, bitcast=True), OUT_DTYPE)


@triton.jit
def log2_decode_rows(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    out_ptr,
    n,
    first_row,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Load, decode and store rows ``first_row`` .. ``+ ROWS`` of one tensor: the body of
    the single and the grouped decode, which differ only in where the pointers come from."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        packed = tl.load(codes_ptr + byte_offs, mask=byte_offs * PER_BYTE < n, other=0)
        lo = tl.load(lo_ptr + rows, mask=rows * BLOCK < n, other=0)
        hi = tl.load(hi_ptr + rows, mask=rows * BLOCK < n, other=0)
    else:
        packed = tl.load(codes_ptr + byte_offs)
        lo = tl.load(lo_ptr + rows)
        hi = tl.load(hi_ptr + rows)
    v = log2_decode_tile(packed, lo, hi, BITS, BLOCK, ROWS, out_ptr.dtype.element_ty)

    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        tl.store(out_ptr + offs, v, mask=offs < n)
    else:
        tl.store(out_ptr + offs, v)


@triton.jit(do_not_specialize=["row0"])
def dequantize_log2_kernel(
    codes_ptr,
    lo_ptr,
    hi_ptr,
    out_ptr,
    n,
    row0,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` into an ``n``-element flat output."""
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    log2_decode_rows(codes_ptr, lo_ptr, hi_ptr, out_ptr, n, first_row, MASKED, BITS, BLOCK, ROWS)


def dequantize_log2(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode with the fused kernel to a flat ``numel``-element tensor of ``dtype``.

    Raises:
        QuantizationError: buffers of the wrong dtype, size or device.
    """
    if dtype not in _SUPPORTED_DTYPES:
        raise QuantizationError(f"dequantize_log2: cannot decode to {dtype}")
    nblocks = -(-numel // block)
    if codes.dtype != torch.uint8 or codes.numel() != (numel * bits + 7) // 8:
        raise QuantizationError(
            f"dequantize_log2: codes are {codes.dtype} x {codes.numel()}, expected uint8 x "
            f"{(numel * bits + 7) // 8}"
        )
    check_block_bounds("dequantize_log2", lo, hi, nblocks, codes.device)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel:
        launch_row_tiles(
            dequantize_log2_kernel,
            (codes.contiguous(), lo.contiguous(), hi.contiguous(), out),
            numel,
            0,
            block,
            codes.device,
            BITS=bits,
        )
    return out
