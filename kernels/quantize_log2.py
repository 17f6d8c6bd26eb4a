"""Fused ``log2`` encode (the second-moment codec): log-domain bounds, rounding, packing.

Same tile layout as ``quantize_blockwise`` (a ``(ROWS, BLOCK)`` tile per program, one row per
codec block, whole tiles unmasked and the partial tile as one masked program; int64 offsets).
The spec is ``tw_triton.ops.reference.quantize_log2_torch``; the bytes must be identical, so:

* ``t`` is the fp32 bit pattern of the input (bf16 widened by a shift, as in the blockwise
  encoder, because the 3.9 interpreter's bf16 conversion is wrong for subnormals);
* the row bounds are integer min/max reductions, exact everywhere;
* ``step`` uses ``tl.div_rn`` on fp32 values converted from int32 with round-to-nearest
  (``cvt.rn``), as torch's CPU conversion does; the rounding to an integer is the
  ``1.5 * 2**23`` trick (the quotient is at most 254, far below ``2**22``);
* the code is ``rne(fl(a / step))``, ``a = fl(t - lo)``: the kernel multiplies by each
  block's correctly rounded reciprocal instead of dividing each element (the division and
  its conversions made the encode compute-bound on the H100: bf16 and fp32 coded the same
  elements per second), and divides only in tiles where a product lands within its error
  bound of a half-integer, for those elements (the proof:
  ``tw_triton.ops.reference.log2_levels_by_reciprocal``);
* ``enable_fp_fusion=False`` (from the launch helper) keeps every operation separately rounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .quantize_blockwise import pack_lsb_first, rounded_int, widen_to_f32
from .tiles import launch_row_tiles

_RNE_MAGIC = tl.constexpr(12582912.0)
# Four times the unit roundoff: a product within |v| * _APPROX_ERROR of a half-integer is
# decided by the division (log2_levels_by_reciprocal has the bound).
_APPROX_ERROR = tl.constexpr(2.0**-22)
_F32_INF_BITS = tl.constexpr(0x7F800000)
_NEG_ZERO_U32 = tl.constexpr(1 << 31)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def log2_tile(x, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """``(packed codes, lo, hi)`` of a ``(ROWS, BLOCK)`` input tile (one row per block):
    the codec's arithmetic, shared by the single and the grouped encode. A row holding a
    negative, NaN or infinite element gets ``lo = hi = -1``."""
    N_STEPS: tl.constexpr = (1 << BITS) - 2
    t = widen_to_f32(x).to(tl.int32, bitcast=True)

    # The bounds come from plain reductions of the bit patterns (positive_bounds).
    top = tl.max(t, axis=1)
    bad = uncodable_rows(t, top)
    lo, hi = positive_bounds(t, top)
    pos = (t > 0) & ~bad[:, None]
    lo = tl.where(bad, -1, lo)
    hi = tl.where(bad, -1, hi)

    u = log2_codes(t, lo, hi, pos, N_STEPS)
    packed = pack_lsb_first(u, ROWS, BLOCK, BITS)
    return packed, lo, hi


@triton.jit
def positive_bounds(t, top):
    """``(lo, hi)``: the smallest and largest positive pattern of each row of bit patterns
    ``t`` (``top``: their int32 maxima), ``0, 0`` for a row with none; meaningful for the
    rows :func:`uncodable_rows` passes. Plain reductions, no per-element select: as int32
    the positive finite patterns are 1 .. 0x7F7FFFFF, below them the zeros and the
    negatives; ``t - 1`` as uint32 puts them below everything else. Shared with the
    ``log2-temporal`` encode's absolute rows."""
    hi = tl.maximum(top, 0)
    lo = tl.where(
        hi > 0, (tl.min(t.to(tl.uint32, bitcast=True) - 1, axis=1) + 1).to(tl.int32, bitcast=True), 0
    )
    return lo, hi


@triton.jit
def uncodable_rows(t, top):
    """The rows of bit patterns ``t`` (``top``: their int32 maxima) that hold an element
    neither positive finite nor a zero, from reductions alone: +inf and +NaN are the int32
    patterns from 0x7F800000 up, the negative non-zero ones the uint32 patterns above
    -0.0's 0x80000000. Shared with the ``log2-temporal`` encode."""
    return (top >= _F32_INF_BITS) | (tl.max(t.to(tl.uint32, bitcast=True), axis=1) > _NEG_ZERO_U32)


@triton.jit
def log2_codes(t, lo, hi, pos, N_STEPS: tl.constexpr):
    """The int32 codes of a ``(ROWS, BLOCK)`` tile of bit patterns ``t`` between its rows'
    bounds: ``rne(fl(fl(t - lo) / step)) + 1`` clamped to ``[1, N + 1]`` where ``pos``, else 0,
    ``step = fl(fl(hi - lo) / N)`` (a row with no positive step codes 0 + 1). Shared with the
    ``log2-temporal`` encode's absolute rows, whose ``lo`` and ``hi`` bound every ``pos``
    element of their row.

    Neither the clamp nor the zero of a row without a step is computed: where ``pos``,
    ``0 <= t - lo <= hi - lo``, so the quotient lies in ``[0, N (1 + 2**-22)]`` (a few
    roundings of ``fl(hi - lo) / step``) and rounds into ``[0, N]``; a row without a step
    has ``t = lo`` there, so ``a = 0``. Elsewhere the codes are garbage, and zeroed."""
    step = tl.div_rn((hi - lo).to(tl.float32), N_STEPS * 1.0)
    safe = tl.where(step > 0.0, step, 1.0)
    a = (t - lo[:, None]).to(tl.float32)
    # A step is at least 1/254 (hi > lo): its reciprocal is finite.
    inv = tl.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
    v = a * inv[:, None]
    q = (v + _RNE_MAGIC) - _RNE_MAGIC
    near = (tl.abs(v - q) > 0.5 - tl.abs(v) * _APPROX_ERROR) & pos
    if tl.max(near.to(tl.int32)) > 0:
        r = tl.div_rn(a, safe[:, None])
        q = tl.where(near, (r + _RNE_MAGIC) - _RNE_MAGIC, q)
    return tl.where(pos, rounded_int(q, 1), 0)


@triton.jit(do_not_specialize=["row0"])
def quantize_log2_kernel(
    x_ptr,
    codes_ptr,
    lo_ptr,
    hi_ptr,
    n,
    row0,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` of an ``n``-element flat input."""
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    packed, lo, hi = log2_tile(x, BITS, BLOCK, ROWS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(lo_ptr + rows, lo, mask=rows * BLOCK < n)
        tl.store(hi_ptr + rows, hi, mask=rows * BLOCK < n)
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(lo_ptr + rows, lo)
        tl.store(hi_ptr + rows, hi)


def quantize_log2(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, ...]:
    """Encode a contiguous tensor with the fused kernel; the torch path's contract.

    Returns:
        ``(codes, lo, hi)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and two int32 of
        ``ceil(n / block)`` values, on ``x``'s device.

    Raises:
        QuantizationError: an input the kernel cannot read as a flat contiguous tensor.
    """
    if x.dtype not in _SUPPORTED_DTYPES or not x.is_contiguous():
        raise QuantizationError(
            f"quantize_log2: x must be a contiguous float32, float16 or bfloat16 tensor, "
            f"got {x.dtype}{'' if x.is_contiguous() else ' (not contiguous)'}"
        )
    if bits not in (8, 4, 2) or block < 32 or block > 4096 or block & (block - 1):
        raise QuantizationError(
            f"quantize_log2: bits must be 8, 4 or 2 and block a power of two from 32 to 4096, "
            f"got bits={bits!r}, block={block!r}"
        )
    n = x.numel()
    nblocks = -(-n // block)
    codes = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    lo = torch.empty(nblocks, dtype=torch.int32, device=x.device)
    hi = torch.empty(nblocks, dtype=torch.int32, device=x.device)
    if n:
        launch_row_tiles(quantize_log2_kernel, (x, codes, lo, hi), n, 0, block, x.device, BITS=bits)
    return codes, lo, hi
