"""Fused blockwise decode: unpack codes, multiply by the block scale, add the reference, cast.

Tile layout. As in the encode kernel, the flat output is viewed as rows of ``BLOCK``
elements, one scale per row, and a program owns ``ROWS`` consecutive rows (about 4096
elements). It loads the row's ``BLOCK * BITS / 8`` packed bytes, splits every byte into its
``8 / BITS`` codes in registers (``tl.join`` then ``tl.reshape`` restores element order),
loads ``ROWS`` scales and the reference tile, and writes the output tile once. Tiles wholly
inside the tensor run as one unmasked launch, the partial tile at the end as a second,
masked launch; element offsets are int64 (see ``row0`` in the encode kernel's docstring,
which plays the same role here).

Why the arithmetic looks the way it does: the decode must equal
``tw_triton.ops.reference.dequantize_blockwise_torch`` bit for bit, on the GPU and under
``TRITON_INTERPRET=1``.

* ``x_hat = fp32(ref) + fp32(q) * scale`` is a multiply and an add, each rounded: the
  launcher passes ``enable_fp_fusion=False`` so the two are never contracted into an FMA.
* Saturation: the product is clamped to the largest finite fp32 before the add, and the
  sum to the largest finite value of the output dtype before the cast, with comparisons
  and ``tl.where`` (the GPU's ``min``/``max`` would turn NaN into the bound).
* The final cast to bf16 is done with integer arithmetic (round to nearest, ties to even,
  NaN kept NaN), because the 3.9 interpreter's fp32-to-bf16 conversion truncates (and
  mangles subnormals); on the GPU it costs a few integer ops in a memory-bound kernel.
  fp16 uses the normal cast, which rounds to nearest even on the GPU (``cvt.rn``) and in
  the interpreter (numpy).
* bf16 references are widened by a shift for the same reason as in the encoder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

# NUM_WARPS, TILE_ELEMENTS and rows_per_program are re-exported for the PTX tests.
from .tiles import NUM_WARPS, TILE_ELEMENTS, launch_row_tiles, rows_per_program  # noqa: F401

# Largest finite fp32, fp16 and bf16 values: the decode saturates to the output dtype's.
_FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
_FP16_MAX = tl.constexpr(torch.finfo(torch.float16).max)
_BF16_MAX = tl.constexpr(torch.finfo(torch.bfloat16).max)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def widen_to_f32(v):
    """Exact conversion of an fp32/fp16/bf16 tile to fp32."""
    if v.dtype == tl.bfloat16:
        bits = v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _finite_max(DTYPE: tl.constexpr):
    """Largest finite value of ``DTYPE`` (fp32, fp16 or bf16), as an fp32 constant."""
    if DTYPE == tl.float16:
        return _FP16_MAX
    elif DTYPE == tl.bfloat16:
        return _BF16_MAX
    else:
        return _FP32_MAX


@triton.jit
def _saturate(v, limit):
    """Clamp to ``[-limit, limit]`` with comparisons: NaN stays NaN (GPU min/max drop it)."""
    return tl.where(v > limit, limit, tl.where(v < -limit, -limit, v))


@triton.jit
def narrow_from_f32(v, OUT_DTYPE: tl.constexpr):
    """Round an fp32 tile to ``OUT_DTYPE`` to nearest, ties to even (as torch's ``.to``)."""
    if OUT_DTYPE == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        # Adding 0x7FFF plus the kept LSB carries into the kept half exactly when the
        # dropped half is above one half ulp, or equal to it with an odd kept half.
        lsb = (bits >> 16) & 1
        rounded = (bits + 0x7FFF + lsb) >> 16
        # NaN stays NaN (quiet) rather than rounding into an infinity.
        rounded = tl.where(v == v, rounded, (bits >> 16) | 0x40)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif OUT_DTYPE == tl.float16:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def to_output(v, OUT_DTYPE: tl.constexpr):
    """An fp32 tile saturated to ``OUT_DTYPE``'s finite range (NaN kept) and rounded to it:
    a decode's last step, shared by the blockwise and blockwise-update decodes."""
    return narrow_from_f32(_saturate(v, _finite_max(OUT_DTYPE)), OUT_DTYPE)


@triton.jit
def codes_to_f32(u, LESS: tl.constexpr):
    """Codes (int32, ``0 <= u < 2**23``) less ``LESS`` (an integer, ``|LESS| < 2**22``) as
    exact fp32, read from the bits of ``2**23 + u``: one subtraction of ``2**23 + LESS``
    (each decode's code offset folded in, an fp32 operation per element fewer).

    Not ``u.to(tl.float32)``: LLVM folds a following ``- c`` into the integer (``(u - c)``,
    then packed 16-bit adds for byte codes), and ptxas 12.8 (triton 3.6's) dropped the
    immediate of such an add for one pair of lanes in eight on an H100. fp32 arithmetic on
    a bit pattern is not folded back into integers.
    """
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + LESS)


@triton.jit
def unpack_lsb_first(packed, ROWS: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Unpack (ROWS, BLOCK * BITS // 8) bytes into a (ROWS, BLOCK) int32 tile of codes."""
    p = packed.to(tl.int32)
    if BITS == 8:
        u = p
    elif BITS == 4:
        u = tl.reshape(tl.join(p & 15, p >> 4), (ROWS, BLOCK))
    else:
        # join(join(c0, c2), join(c1, c3)) flattens to c0, c1, c2, c3.
        low_pair = tl.join(p & 3, (p >> 4) & 3)
        high_pair = tl.join((p >> 2) & 3, p >> 6)
        u = tl.reshape(tl.join(low_pair, high_pair), (ROWS, BLOCK))
    return u


@triton.jit
def dequantize_tile(
    packed,
    scale,
    r,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """The decoded ``(ROWS, BLOCK)`` tile of ``OUT_DTYPE`` from its packed codes, its row
    scales and (``HAS_REF``) its reference tile: the codec's arithmetic, shared by the
    single and the grouped decode."""
    CODE_OFFSET: tl.constexpr = 1 << (BITS - 1)
    q = codes_to_f32(unpack_lsb_first(packed, ROWS, BLOCK, BITS), CODE_OFFSET)
    v = q * scale[:, None]
    if HAS_REF:
        # An overflowed product is brought back by a reference of the other sign only if
        # it is saturated first (inf + r stays inf).
        v = _saturate(v, _FP32_MAX) + widen_to_f32(r)
    return to_output(v, OUT_DTYPE)


@triton.jit(do_not_specialize=["row0"])
def dequantize_blockwise_kernel(
    codes_ptr,
    scales_ptr,
    ref_ptr,
    out_ptr,
    n,
    row0,
    MASKED: tl.constexpr,
    HAS_REF: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode rows ``row0 + pid * ROWS`` .. ``+ ROWS`` of an ``n``-element flat output.

    ``MASKED`` is False for tiles wholly inside the tensor (no bounds checks, vector
    accesses whatever ``n`` is); the launcher runs the partial tile at the end separately.
    """
    PER_BYTE: tl.constexpr = 8 // BITS
    BYTES_PER_ROW: tl.constexpr = BLOCK // PER_BYTE

    # Widen before multiplying: pid * ROWS * BLOCK passes 2**31 on large tensors.
    first_row = row0 + tl.program_id(0).to(tl.int64) * ROWS
    rows = first_row + tl.arange(0, ROWS).to(tl.int64)
    offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    byte_offs = rows[:, None] * BYTES_PER_ROW + tl.arange(0, BYTES_PER_ROW)[None, :]
    if MASKED:
        in_bounds = offs < n
        packed = tl.load(codes_ptr + byte_offs, mask=byte_offs * PER_BYTE < n, other=0)
        scale = tl.load(scales_ptr + rows, mask=rows * BLOCK < n, other=0.0)
    else:
        packed = tl.load(codes_ptr + byte_offs)
        scale = tl.load(scales_ptr + rows)
    if HAS_REF:
        if MASKED:
            r = tl.load(ref_ptr + offs, mask=in_bounds, other=0.0)
        else:
            r = tl.load(ref_ptr + offs)
    else:
        r = 0.0
    y = dequantize_tile(packed, scale, r, HAS_REF, BITS, BLOCK, ROWS, out_ptr.dtype.element_ty)
    if MASKED:
        tl.store(out_ptr + offs, y, mask=in_bounds)
    else:
        tl.store(out_ptr + offs, y)


def launch_dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    reference: torch.Tensor | None,
    out: torch.Tensor,
    n: int,
    bits: int,
    block: int,
    row0: int = 0,
) -> None:
    """Launch the decode kernel over rows ``row0 ..`` of an ``n``-element flat output.

    The output buffer is given by the caller. With ``row0 == 0`` this covers the whole
    tensor; a nonzero ``row0`` is for tests of the int64 offset arithmetic.
    """
    ref = reference if reference is not None else out
    launch_row_tiles(
        dequantize_blockwise_kernel,
        (codes, scales, ref, out),
        n,
        row0,
        block,
        out.device,
        HAS_REF=reference is not None,
        BITS=bits,
    )


def dequantize_blockwise(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    reference: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode to a flat tensor of ``numel`` elements with the fused kernel.

    Same contract as ``tw_triton.ops.reference.dequantize_blockwise_torch``:
    ``x_hat = cast(sat(fp32(ref) + sat32(fp32(q) * scale)))``, the product rounded before
    the add, ``sat32``/``sat`` clamping to the fp32/output dtype's finite range.

    Args:
        codes: contiguous ``uint8`` packed codes, ``ceil(numel * bits / 8)`` bytes.
        scales: contiguous fp32 scales, ``ceil(numel / block)`` values, on ``codes``'s device.
        numel: number of elements to decode.
        bits: 8, 4 or 2.
        block: power of two from 32 to 4096.
        reference: ``None`` or a contiguous float tensor with ``numel`` elements.
        dtype: output dtype, float32, float16 or bfloat16.

    Returns:
        A flat tensor of ``numel`` elements of ``dtype`` on ``codes``'s device.

    Raises:
        QuantizationError: buffers of the wrong size, dtype, layout or device.
    """
    if bits not in (8, 4, 2) or block < 32 or block > 4096 or block & (block - 1):
        raise QuantizationError(
            f"dequantize_blockwise: bits must be 8, 4 or 2 and block a power of two from 32 "
            f"to 4096, got bits={bits!r}, block={block!r}"
        )
    if dtype not in _SUPPORTED_DTYPES:
        raise QuantizationError(
            f"dequantize_blockwise: output dtype must be float32, float16 or bfloat16, got {dtype}"
        )
    device = codes.device
    _check_buffer("codes", codes, torch.uint8, (numel * bits + 7) // 8, device)
    _check_buffer("scales", scales, torch.float32, -(-numel // block), device)
    if reference is not None:
        if reference.dtype not in _SUPPORTED_DTYPES:
            raise QuantizationError(
                f"dequantize_blockwise: reference must be float32, float16 or bfloat16, got {reference.dtype}"
            )
        _check_buffer("reference", reference, reference.dtype, numel, device)
    out = torch.empty(numel, dtype=dtype, device=device)
    if numel:
        launch_dequantize(codes, scales, reference, out, numel, bits, block)
    return out


def _check_buffer(name: str, t: torch.Tensor, dtype: torch.dtype, numel: int, device: torch.device) -> None:
    if t.dtype != dtype:
        raise QuantizationError(f"dequantize_blockwise: {name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise QuantizationError(f"dequantize_blockwise: {name} must be contiguous")
    if t.numel() != numel:
        raise QuantizationError(f"dequantize_blockwise: {name} has {t.numel()} elements, expected {numel}")
    if t.device != device:
        raise QuantizationError(f"dequantize_blockwise: {name} is on {t.device}, expected {device}")
