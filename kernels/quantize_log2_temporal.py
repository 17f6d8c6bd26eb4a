"""Fused ``log2-temporal`` encode: reference step, integer delta, per-block fallback to the
absolute ``log2`` codes, one byte per element.

Same tile layout as ``quantize_log2`` (a ``(ROWS, BLOCK)`` tile per program, one row per
codec block, whole tiles unmasked and the partial tile as one masked program; int64
offsets). The spec is ``tw_triton.ops.reference.quantize_log2_temporal_torch``; the bytes
must be identical, so the temporal part is integer arithmetic only (the step from an int64
span, the delta and its rounding by ``(|d| + S // 2) // S`` exact in 32 bits: see
``rounded_steps``), and the absolute fallback is the ``log2``
kernel's own rule (``tl.div_rn``, ``cvt.rn`` and the ``1.5 * 2**23`` rounding trick).
The tile arithmetic (``temporal_tile``) and the rows' load, encode and store
(``temporal_encode_rows``) are shared with the grouped encode
(``quantize_log2_temporal_grouped``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .quantize_blockwise import rounded_int
from .quantize_log2 import log2_codes, positive_bounds, uncodable_rows
from .tiles import launch_row_tiles

_F32_INF_BITS = tl.constexpr(0x7F800000)
_ZERO_CODE = tl.constexpr(-128)
_QMAX = tl.constexpr(127)


@triton.jit
def temporal_step(rb, N_STEPS: tl.constexpr, min_step):
    """The int64 step of each row of reference patterns ``rb``: ``max((hi_r - lo_r) // N,
    min_step)`` over the row's positive finite values (``min_step`` when there is none)."""
    # As uint32, ``rb - 1`` puts the positive finite patterns (1 .. 0x7F7FFFFF) below every
    # other one: its minimum is the lowest of them less one, with no per-element select.
    lo_u = tl.min(rb.to(tl.uint32, bitcast=True) - 1, axis=1)
    any_r = lo_u < _F32_INF_BITS - 1
    hi_r = tl.max(tl.where(rb < _F32_INF_BITS, rb, 0), axis=1)
    span = tl.where(any_r, hi_r.to(tl.int64) - (lo_u + 1).to(tl.int64), 0)
    return tl.maximum(span // N_STEPS, min_step.to(tl.int64))


@triton.jit
def rounded_steps(ad, step):
    """``(ad + step // 2) // step`` (int32) where it is at most 200, and a value above 127
    elsewhere, for int32 ``ad`` in ``[0, 2**31)`` and int32 ``step`` in ``[1, 2**30]``: the
    temporal code's magnitude without a division per element (a long software routine on a
    GPU). The quotient ``Q = m / step`` of ``m = ad + step // 2`` (below ``2**32``: a
    uint32) is estimated as ``f = fl(fl(m) * fl(1 / step))``, within a relative
    ``3 * 2**-24`` of it (three roundings), so for ``Q`` up to 200 ``rne(f)`` is the floor
    of ``Q`` or one more, and one exact correction gives the floor: the remainder
    ``m - rne(f) * step`` then lies in ``[-step, step)``, inside int32, so it is computed
    modulo ``2**32`` and read back signed."""
    inv = tl.div_rn(tl.full(step.shape, 1.0, tl.float32), step.to(tl.float32))
    m = ad.to(tl.uint32, bitcast=True) + (step // 2).to(tl.uint32)
    q0 = rounded_int(tl.minimum(m.to(tl.float32) * inv, 200.0), 0)
    rem = (m - q0.to(tl.uint32, bitcast=True) * step.to(tl.uint32)).to(tl.int32, bitcast=True)
    return q0 - (rem < 0).to(tl.int32)


@triton.jit
def temporal_tile(x, r, min_step, BITS: tl.constexpr):
    """``(codes, lo, hi)`` of a ``(ROWS, BLOCK)`` fp32 input tile ``x`` against its
    reference tile ``r`` (one row per block): the codec's arithmetic, shared by the single
    and the grouped encode. A row holding a negative, NaN or infinite element gets
    ``lo = hi = -1`` and codes 0."""
    N_STEPS: tl.constexpr = (1 << BITS) - 2
    t = x.to(tl.int32, bitcast=True)
    rb = r.to(tl.int32, bitcast=True)

    top = tl.max(t, axis=1)
    bad = uncodable_rows(t, top)
    # In a row that is not bad, an element that is not a zero is positive finite: the rows
    # used below need no other per-element test of t (fewer masks to keep alive).
    zero = (t & 0x7FFFFFFF) == 0
    rpos = (rb > 0) & (rb < _F32_INF_BITS)

    # Temporal codes: the rounded change in steps of the reference block's log2 step (at
    # most 2**30 from the span, 2**29 from the floor: an int32).
    step = temporal_step(rb, N_STEPS, min_step).to(tl.int32)[:, None]
    # Where t and rb are both positive finite patterns (the only elements whose q is used),
    # d = t - rb fits an int32.
    d = t - rb
    qa = rounded_steps(tl.abs(d), step)
    ok = zero | (rpos & (qa <= _QMAX))
    temporal = (tl.min(ok.to(tl.int32), axis=1) > 0) & ~bad
    # Used only in temporal rows, where every element that is not a zero has its q.
    c_t = tl.where(zero, _ZERO_CODE, tl.where(d < 0, -qa, qa))

    # Absolute log2 codes, for the rows that cannot be coded as a change: in a tile with
    # none (the common case once a chain runs), their arithmetic is skipped.
    absolute = ~temporal & ~bad
    lo = tl.zeros_like(temporal.to(tl.int32))
    hi = lo
    u = tl.zeros_like(t)
    if tl.max(absolute.to(tl.int32)) > 0:
        # An absolute row holds a positive element (one that is not ok).
        lo, hi = positive_bounds(t, top)
        u = log2_codes(t, lo, hi, ~zero, N_STEPS)  # ~zero: positive, in those rows
    code = tl.where(temporal[:, None], c_t, tl.where(absolute[:, None], u, 0))
    code = (code & 0xFF).to(tl.uint8)
    lo = tl.where(bad, -1, tl.where(temporal, 0, lo))
    hi = tl.where(bad, -1, tl.where(temporal, 0, hi))
    return code, lo, hi


@triton.jit
def temporal_encode_rows(
    x_ptr,
    ref_ptr,
    codes_ptr,
    lo_ptr,
    hi_ptr,
    n,
    first_row,
    min_step,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Load, encode and store rows ``first_row`` .. ``+ ROWS`` of one tensor: the body of
    the single and the grouped encode, which differ only in where the pointers come from
    (and the grouped one's flag). Returns the rows' ``hi`` bounds (``-1``: a row that
    cannot be coded) and indices."""
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
        r = tl.load(ref_ptr + offs, mask=offs < n, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
        r = tl.load(ref_ptr + offs)
    code, lo, hi = temporal_tile(x, r, min_step, BITS)

    if MASKED:
        tl.store(codes_ptr + offs, code, mask=offs < n)
        tl.store(lo_ptr + rows, lo, mask=rows * BLOCK < n)
        tl.store(hi_ptr + rows, hi, mask=rows * BLOCK < n)
    else:
        tl.store(codes_ptr + offs, code)
        tl.store(lo_ptr + rows, lo)
        tl.store(hi_ptr + rows, hi)
    return hi, rows


@triton.jit(do_not_specialize=["row0"])
def quantize_log2_temporal_kernel(
    x_ptr,
    ref_ptr,
    codes_ptr,
    lo_ptr,
    hi_ptr,
    n,
    row0,
    min_step,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` of an ``n``-element flat input."""
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    temporal_encode_rows(
        x_ptr, ref_ptr, codes_ptr, lo_ptr, hi_ptr, n, first_row, min_step, MASKED, BITS, BLOCK, ROWS
    )


def check_temporal_args(x: torch.Tensor, reference: torch.Tensor, bits: int, block: int, what: str) -> None:
    """Raise :class:`QuantizationError` unless the kernels can read ``x`` and ``reference``."""
    for name, t in (("x", x), ("reference", reference)):
        if (
            t.dtype != torch.float32
            or not t.is_contiguous()
            or t.numel() != x.numel()
            or t.device != x.device
        ):
            raise QuantizationError(
                f"{what}: {name} must be a contiguous float32 tensor of {x.numel()} elements on "
                f"{x.device}, got {t.dtype} x {t.numel()} on {t.device}"
            )
    if bits not in (8, 4, 2) or block < 32 or block > 4096 or block & (block - 1):
        raise QuantizationError(
            f"{what}: bits must be 8, 4 or 2 and block a power of two from 32 to 4096, "
            f"got bits={bits!r}, block={block!r}"
        )


def quantize_log2_temporal(
    x: torch.Tensor, reference: torch.Tensor, bits: int, block: int, min_step: int
) -> tuple[torch.Tensor, ...]:
    """Encode contiguous float32 ``x`` against ``reference`` with the fused kernel.

    Returns:
        ``(codes, lo, hi)``: ``uint8`` of ``n`` bytes and two int32 of ``ceil(n / block)``.

    Raises:
        QuantizationError: inputs the kernel cannot read.
    """
    check_temporal_args(x, reference, bits, block, "quantize_log2_temporal")
    n = x.numel()
    nblocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    lo = torch.empty(nblocks, dtype=torch.int32, device=x.device)
    hi = torch.empty(nblocks, dtype=torch.int32, device=x.device)
    if n:
        launch_row_tiles(
            quantize_log2_temporal_kernel,
            (x, reference, codes, lo, hi),
            n,
            0,
            block,
            x.device,
            min_step=min_step,
            BITS=bits,
        )
    return codes, lo, hi
