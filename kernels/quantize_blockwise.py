"""Fused blockwise encode: delta from a reference, absmax scale, rounding and bit packing.

Tile layout. The flat input is viewed as rows of ``BLOCK`` elements (one row = one codec
block = one scale). A program owns ``ROWS`` consecutive rows, a ``(ROWS, BLOCK)`` tile of
about 4096 elements (16 KB of fp32, 8 KB of bf16), so it reads ``x`` (and ``ref``) once,
reduces each row to its absmax in registers, and writes ``ROWS * BLOCK * BITS / 8`` code
bytes and ``ROWS`` scales once. Tiles that lie wholly inside the tensor run as one launch
without bounds masks, so their loads stay 16-byte vectors whatever the tensor's length;
the partial tile at the end, if any, is a second launch of one masked program. Element
offsets are computed in int64 (the program id is widened before it is multiplied) so
tensors of more than 2**31 elements address correctly. ``row0`` shifts the first row of
a launch: 0 for the main launch, the tail's first row for the tail launch, and in tests a
row far past 2**31 elements, to run the offset arithmetic there without allocating it.

Why the arithmetic looks the way it does: the CUDA kernel, this kernel under
``TRITON_INTERPRET=1`` and the torch path (``tw_triton.ops.reference.quantize_blockwise_torch``)
must give the same bytes, so every fp32 operation has to be correctly rounded.

* The code is the integer nearest the exact quotient ``d / s``, ties to even. The kernel
  multiplies by the row's reciprocal (``tl.div_rn``: Triton's ``/`` on fp32 lowers to
  ``div.full.f32``, which may be 2 ulp off) instead of dividing each element, which made
  the encode compute-bound on the H100 (bf16 at half of fp32's bandwidth, the same
  elements per second). ``v = fl(d * fl(1/s))`` is within ``|d/s| * 2**-23`` of the
  quotient, so ``rne(v)`` is the code unless ``v`` lies that close to a half-integer;
  there the side of the exact quotient is decided exactly by comparing
  ``2 * (d - h * s_hi)`` with ``(2 * h) * s_lo`` for the half-integer ``h`` beside ``v``
  (``s`` split into its top and bottom 12 significant bits; every step exact), as in
  ``tw_triton.ops.reference.nearest_integer_by_reciprocal``, whose docstring has the proof.
  That step runs only in tiles that hold such an element.
* The launcher passes ``enable_fp_fusion=False``: a contracted multiply-add rounds once
  where torch rounds twice.
* Round half to even by ``(v + 1.5 * 2**23) - 1.5 * 2**23``: exact for ``|v| < 2**22``, which
  covers every unclamped code, and it runs under the interpreter, where
  ``libdevice.rint`` does not.
* bf16 is widened with an integer shift rather than a cast, because the 3.9 interpreter's
  software bf16 -> fp32 conversion gets subnormals wrong (1e-39 comes out as 4.4e-39).
* NaN is mapped to +inf before the row max, since the GPU ``max`` ignores NaN while the
  spec makes any NaN/Inf block unquantizable (scale = +inf, all codes q = 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

# NUM_WARPS, TILE_ELEMENTS and rows_per_program are re-exported for the PTX tests.
from .tiles import NUM_WARPS, TILE_ELEMENTS, launch_row_tiles, rows_per_program  # noqa: F401

# 1.5 * 2**23: adding and subtracting it rounds an fp32 of magnitude < 2**22 to an integer,
# ties to even, in the current (round-to-nearest-even) mode.
_RNE_MAGIC = tl.constexpr(12582912.0)

# The bit pattern of _RNE_MAGIC: v + _RNE_MAGIC has bits _RNE_MAGIC_BITS + v for an integer
# |v| < 2**22.
_RNE_MAGIC_BITS = tl.constexpr(0x4B400000)

# Twice the relative error of fl(d * fl(1 / s)) against d / s (two roundings, 2**-24 each).
_APPROX_ERROR = tl.constexpr(2.0**-22)

_F32_INF_BITS = tl.constexpr(0x7F800000)

# Scales below this are multiplied by _UNTINY, with their deltas, before the reciprocal.
_TINY_SCALE = tl.constexpr(2.0**-64)
_UNTINY = tl.constexpr(2.0**64)

# 0xFFFFF000 as an int32: a scale with the low 12 bits of its mantissa cleared.
_SCALE_HI_MASK = tl.constexpr(-4096)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def widen_to_f32(v):
    """Exact conversion of an fp32/fp16/bf16 tile to fp32."""
    if v.dtype == tl.bfloat16:
        # bf16 is the top half of an fp32: shifting its bits is exact for every value.
        bits = v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def pack_lsb_first(u, ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Pack a (ROWS, BLOCK) int32 tile of codes into (ROWS, BLOCK * BITS // 8) bytes.

    Element ``i`` of a byte lands at bits ``(i % k) * BITS`` (the earlier element in the
    low bits), matching the torch path.
    """
    if BITS == 8:
        packed = u
    elif BITS == 4:
        lo, hi = tl.split(tl.reshape(u, (ROWS, BLOCK // 2, 2)))
        packed = lo | (hi << 4)
    else:
        # Last axis: element parity; middle axis: which pair of the group of four.
        even, odd = tl.split(tl.reshape(u, (ROWS, BLOCK // 4, 2, 2)))
        pairs = even | (odd << 2)
        first, second = tl.split(pairs)
        packed = first | (second << 4)
    return packed.to(tl.uint8)


@triton.jit
def rounded_int(v, OFFSET: tl.constexpr):
    """``rne(v) + OFFSET`` as int32, for ``|v + OFFSET| < 2**22`` and an integer ``OFFSET``:
    the bits of ``v + (1.5 * 2**23 + OFFSET)``, which the add itself rounds (cheaper than a
    float-to-int conversion). Shared by the encodes' codes."""
    return (v + (_RNE_MAGIC + OFFSET)).to(tl.int32, bitcast=True) - _RNE_MAGIC_BITS


@triton.jit
def quantize_tile(d, qmax, BITS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """``(packed codes, scales)`` of a ``(ROWS, BLOCK)`` fp32 tile of ``d`` (one row per
    block): the codec's arithmetic, shared by the single and the grouped encode. ``qmax``
    (fp32, an integer) is a value, not a constexpr: fewer levels in a container compile
    nothing the container's full range does not.

    A code is the integer nearest the exact quotient ``d / s``, ties to even (the spec's
    rule, docs/codecs.md). The quotient is approximated by one multiply with the row's
    correctly rounded reciprocal; only where that lands near a half-integer is the side
    of the exact quotient decided exactly, and only in tiles that hold such an element.
    """
    # The row's absmax from the integer max of |d|'s bit patterns, where NaN's lie above
    # +inf (the fp32 max would skip a NaN; the spec makes its block uncodable): capped at
    # +inf's pattern, a NaN gives the scale +inf, as in the spec.
    a_bits = d.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    absmax = tl.minimum(tl.max(a_bits, axis=1), _F32_INF_BITS).to(tl.float32, bitcast=True)
    scale = tl.div_rn(absmax, qmax)
    # A normal scale s = fl(absmax / qmax) is within 2**-24 of the quotient, so every
    # |d / s| is below qmax + 1/2 and its nearest integer within [-qmax, qmax]: no clamp.
    # A row of zeros codes zeros with any scale. Only tiles with a tiny (or subnormal)
    # scale, or an uncodable row, take the careful path.
    special = ((scale > 0.0) & (scale < _TINY_SCALE)) | (scale == float("inf"))
    careful = tl.max(special.to(tl.int32)) > 0
    usable = (scale > 0.0) & (scale < float("inf"))
    # Dividing by 1 where the block is unusable, or all zeros, keeps NaN out.
    s = tl.where(usable, scale, 1.0)
    if careful:
        # A tiny scale and its deltas are scaled by 2**64 (exact: a power of two, far from
        # overflow), so that the reciprocal is finite and the exact side test below never
        # underflows.
        f = tl.where(s < _TINY_SCALE, _UNTINY, 1.0)
        d = d * f[:, None]
        s = s * f
    r = nearest_codes(d, s, ROWS)
    if careful:
        # A subnormal scale's rounding can leave a quotient above qmax; the rows that
        # cannot be coded give 0.
        r = tl.where(usable[:, None], tl.minimum(tl.maximum(r, -qmax), qmax), 0.0)
    u = rounded_int(r, 1 << (BITS - 1))
    packed = pack_lsb_first(u, ROWS, BLOCK, BITS)
    return packed, scale


@triton.jit
def nearest_codes(d, s, ROWS: tl.constexpr):
    """``rne(d / s)`` (fp32, ties to even) of a tile and its rows' scales, which are normal
    and finite: one multiply by each row's correctly rounded reciprocal, and the exact side
    test only near a half-integer, in tiles that hold such an element."""
    inv = tl.div_rn(tl.full((ROWS,), 1.0, tl.float32), s)
    v = d * inv[:, None]
    r = (v + _RNE_MAGIC) - _RNE_MAGIC
    # |v - d/s| <= |d/s| * 2**-23 (two roundings); the window is twice that. Outside it
    # rne(v) is the nearest integer to d/s.
    near = tl.abs(v - r) > 0.5 - tl.abs(v) * _APPROX_ERROR
    if tl.max(near.to(tl.int32)) > 0:
        r = nearest_at_half(v, r, near, d, s)
    return r


@triton.jit
def nearest_at_half(v, r, near, d, s):
    """``r`` where ``near`` is false; elsewhere the integer nearest the exact ``d / s``
    beside ``h``, the half-integer nearest ``v`` (ties to even), decided exactly as in
    ``tw_triton.ops.reference.nearest_integer_at_ties`` (which has the proof; with the
    scaling of tiny scales every product here is exact)."""
    h = tl.where(v > r, r + 0.5, r - 0.5)
    s_hi = (s.to(tl.int32, bitcast=True) & _SCALE_HI_MASK).to(tl.float32, bitcast=True)
    s_lo = s - s_hi
    r1 = d - h * s_hi[:, None]
    r2 = r1 + r1
    p2 = (h + h) * s_lo[:, None]
    even = (h + _RNE_MAGIC) - _RNE_MAGIC
    exact = tl.where(r2 > p2, h + 0.5, tl.where(r2 < p2, h - 0.5, even))
    return tl.where(near, exact, r)


@triton.jit(do_not_specialize=["row0"])
def quantize_blockwise_kernel(
    x_ptr,
    ref_ptr,
    codes_ptr,
    scales_ptr,
    n,
    row0,
    qmax,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Encode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` of an ``n``-element flat input.

    ``MASKED`` is False for tiles wholly inside the tensor, which then need no bounds
    checks (and keep 16-byte vector loads whatever ``n`` is); the launcher runs the one
    partial tile at the end as a separate ``MASKED`` launch. ``qmax`` (fp32) is the largest
    code magnitude: ``2**(BITS-1) - 1``, or fewer levels in the same container (3 in 4 bits).
    """
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    # Widen before multiplying: pid * ROWS * BLOCK passes 2**31 on large tensors.
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if MASKED:
        in_bounds = offs < n
        x = tl.load(x_ptr + offs, mask=in_bounds, other=0.0)
    else:
        x = tl.load(x_ptr + offs)
    d = widen_to_f32(x)
    if HAS_REF:
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
        d = d - widen_to_f32(r)

    packed, scale = quantize_tile(d, qmax, BITS, BLOCK, ROWS)

    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        # A byte is stored when its first element exists: ceil(n * BITS / 8) bytes in all.
        tl.store(codes_ptr + byte_offs, packed, mask=byte_offs * PER_BYTE < n)
        tl.store(scales_ptr + rows, scale, mask=rows * BLOCK < n)
    else:
        tl.store(codes_ptr + byte_offs, packed)
        tl.store(scales_ptr + rows, scale)


def launch_quantize(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    bits: int,
    block: int,
    row0: int = 0,
    qmax: int | None = None,
) -> None:
    """Launch the encode kernel over rows ``row0 ..`` of an ``n``-element flat tensor.

    The output buffers are given by the caller. With ``row0 == 0`` this covers the whole
    tensor; a nonzero ``row0`` is for tests of the int64 offset arithmetic. ``qmax``
    defaults to the container's ``2**(bits-1) - 1``.
    """
    ref = reference if reference is not None else x
    launch_row_tiles(
        quantize_blockwise_kernel,
        (x, ref, codes, scales),
        n,
        row0,
        block,
        x.device,
        scalars=(float((1 << (bits - 1)) - 1 if qmax is None else qmax),),
        HAS_REF=reference is not None,
        BITS=bits,
    )


def quantize_blockwise(
    x: torch.Tensor, reference: torch.Tensor | None, bits: int, block: int, qmax: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a contiguous tensor with the fused kernel; same contract as the torch path.

    Args:
        x: contiguous float32, float16 or bfloat16 tensor (any shape; read flattened).
        reference: ``None`` or a contiguous float tensor with ``x.numel()`` elements on
            ``x``'s device.
        bits: 8, 4 or 2 (the code container).
        block: power of two from 32 to 4096.
        qmax: largest code magnitude, from 1 to ``2**(bits-1) - 1`` (the default).

    Returns:
        ``(codes, scales)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and fp32 of
        ``ceil(n / block)`` values, on ``x``'s device.

    Raises:
        QuantizationError: an input the kernel cannot read as a flat contiguous tensor.
    """
    _check_kernel_input("x", x, x.numel(), x.device)
    if reference is not None:
        _check_kernel_input("reference", reference, x.numel(), x.device)
    if bits not in (8, 4, 2) or block < 32 or block > 4096 or block & (block - 1):
        raise QuantizationError(
            f"quantize_blockwise: bits must be 8, 4 or 2 and block a power of two from 32 "
            f"to 4096, got bits={bits!r}, block={block!r}"
        )
    if qmax is not None and not 1 <= qmax <= (1 << (bits - 1)) - 1:
        raise QuantizationError(
            f"quantize_blockwise: qmax must be from 1 to {(1 << (bits - 1)) - 1}, got {qmax!r}"
        )
    n = x.numel()
    codes = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    if n:
        launch_quantize(x, reference, codes, scales, n, bits, block, qmax=qmax)
    return codes, scales


def _check_kernel_input(name: str, t: torch.Tensor, numel: int, device: torch.device) -> None:
    if t.dtype not in _SUPPORTED_DTYPES:
        raise QuantizationError(
            f"quantize_blockwise: {name} must be float32, float16 or bfloat16, got {t.dtype}"
        )
    if not t.is_contiguous():
        raise QuantizationError(f"quantize_blockwise: {name} must be contiguous")
    if t.numel() != numel:
        raise QuantizationError(f"quantize_blockwise: {name} has {t.numel()} elements, expected {numel}")
    if t.device != device:
        raise QuantizationError(f"quantize_blockwise: {name} is on {t.device}, expected {device}")
