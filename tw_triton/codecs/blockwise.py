"""Blockwise absmax delta codec: the tensor-level API and its plain-torch reference.

The torch functions in this module are the *specification* of the codec. The Triton
kernels in :mod:`tw_triton.kernels` implement the same signatures and must produce the same
bytes (codes and scales) and decode to the same tensors, bit for bit. See DESIGN.md,
"The codec" and "Bit-exact across devices".

Encoding of one block of ``B`` elements (flattened, row-major order):

* ``d = fp32(x) - fp32(ref)`` (or ``fp32(x)`` without a reference);
* ``absmax = max |d|``, or ``+inf`` when any ``d`` in the block is NaN or infinite;
* ``scale = absmax / qmax`` in fp32 (correctly rounded), ``qmax = 2**(bits-1) - 1``;
* ``q = clamp(nearest(d / scale), -qmax, qmax)``, or ``0`` where ``scale`` is 0 or infinite,
  with ``nearest`` the integer nearest to the *exact* quotient, ties to even. The kernel
  computes it as ``rne(fl32(d / scale))`` except where that rounded quotient is a
  half-integer, and settles the side of the exact quotient there with a few exact fp32
  operations (:func:`nearest_integer_at_ties`); the torch path, at 8 and 4 bits, as
  ``rne(fl64(d / scale))``, the same integer (proof at :func:`_encode_chunk_fp64`), and at
  2 bits as ``rne(fl32(d / scale))``, which cannot land on a false tie there. Hence ``|d - q*scale| <= scale/2`` for every normal
  scale, and ``<= max(scale/2, absmax - qmax*scale)`` (``< qmax * 2**-150`` past
  ``scale/2``) for a subnormal one;
* the stored code is ``u = q + 2**(bits-1)`` (so 0 is never used), packed LSB-first,
  ``k = 8 // bits`` codes to a byte: element ``i`` sits at bits ``(i % k) * bits``.

Decoding: ``x_hat = cast(sat(fp32(ref) + sat32(fp32(q) * scale)))``, the multiply and the
add rounded separately (never an FMA); ``sat32`` clamps the product to the largest finite
fp32 and ``sat`` the sum to the largest finite value of the output dtype, NaN staying NaN.
Decoded to its own dtype, ``x`` is finite and inside that range, so a saturation only
moves the value towards it: a quantizable block never decodes to +-inf and keeps its error
bound. A block whose scale is infinite (NaN/Inf in ``x``, in the reference or in their
difference) decodes to NaN: such a tensor could not be quantized, which
:attr:`QuantizedTensor.nonfinite` reports without a sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, QuantizationError
from ..qstate import EncodedEntry
from .base import Codec, Encoded, entry_buffer, move_to

PACKING = "lsb-first"

SUPPORTED_BITS = (8, 4, 2)
MIN_BLOCK = 32
MAX_BLOCK = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The torch path works on this many elements at a time, so that encoding a large tensor
# needs temporaries of about three fp32 chunks only (12 MiB; four at 4 bits, where the
# fp64 quotients take two). Measured on a 2-core VM
# (benchmarks/codec.py): 2**16 loses to per-op overhead (~15 torch ops per chunk), 2**20
# is fastest; the passes then run from L2/L3 rather than L1.
CHUNK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class QuantizedTensor:
    """A tensor encoded by the blockwise codec.

    Attributes:
        codes: packed codes, ``uint8``, 1-D, ``ceil(numel * bits / 8)`` bytes.
        scales: one fp32 scale per block, 1-D, ``ceil(numel / block)`` values.
        shape: the original shape.
        dtype: the original floating dtype.
        bits: code width, 8, 4 or 2.
        block: elements per block, a power of two from 32 to 4096.
        nonfinite: a 0-dim bool tensor on the codes' device, true exactly when some block
            held a NaN or an infinity (in ``x``, in the reference, or in their difference);
            the tensor must then be stored exact. Reading it as a Python bool syncs.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    block: int
    nonfinite: torch.Tensor

    @property
    def numel(self) -> int:
        """Number of elements of the original tensor."""
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        """Device that holds the codes and scales."""
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Stored bytes: packed codes plus fp32 scales."""
        return self.codes.numel() + 4 * self.scales.numel()

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QuantizedTensor":
        """A copy of this encoding on another device (the codes do not change)."""
        return QuantizedTensor(
            codes=self.codes.to(device, non_blocking=non_blocking),
            scales=self.scales.to(device, non_blocking=non_blocking),
            shape=self.shape,
            dtype=self.dtype,
            bits=self.bits,
            block=self.block,
            nonfinite=self.nonfinite.to(device, non_blocking=non_blocking),
        )


def qmax_for(bits: int) -> int:
    """Largest code magnitude for ``bits``: 127, 7 or 1."""
    return (1 << (bits - 1)) - 1


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of packed codes for ``numel`` elements: padding is never stored."""
    return (numel * bits + 7) // 8


def num_blocks(numel: int, block: int) -> int:
    """Number of blocks (and of scales) for ``numel`` elements."""
    return (numel + block - 1) // block


def stored_bytes_per_element(bits: int, block: int) -> float:
    """Asymptotic stored bytes per element: ``bits / 8 + 4 / block``."""
    return bits / 8 + 4 / block


def check_params(bits: int, block: int) -> None:
    """Raise :class:`QuantizationError` unless ``bits`` and ``block`` are supported."""
    # bool is an int and 8.0 == 8: both would slip through a bare membership test.
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise QuantizationError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or block < MIN_BLOCK
        or block > MAX_BLOCK
        or block & (block - 1)
    ):
        raise QuantizationError(
            f"block must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {block!r}"
        )


def _check_input(x: torch.Tensor, reference: torch.Tensor | None) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantizationError(
            f"can only quantize float32, float16 or bfloat16 tensors, got {x.dtype}"
        )
    if reference is None:
        return
    if not isinstance(reference, torch.Tensor):
        raise QuantizationError(f"reference must be a torch.Tensor, got {type(reference).__name__}")
    if reference.dtype not in FLOAT_DTYPES:
        raise QuantizationError(
            f"reference must be float32, float16 or bfloat16, got {reference.dtype}"
        )
    if tuple(reference.shape) != tuple(x.shape):
        raise QuantizationError(
            f"reference shape {tuple(reference.shape)} does not match tensor shape {tuple(x.shape)}"
        )
    if reference.device != x.device:
        raise QuantizationError(
            f"reference is on {reference.device} but the tensor is on {x.device}"
        )


# --------------------------------------------------------------------------------------
# The reference implementation (plain torch). The Triton launchers share these signatures.
# --------------------------------------------------------------------------------------

# Adding 1.5 * 2**23 to a fp32 value v with |v| < 2**22 lands in [2**23, 2**24), where fp32
# has a spacing of exactly 1: the add itself rounds v to an integer, ties to even, which is
# torch.round. Adding an even integer more (the code offset) keeps the tie-breaking parity, and
# the low byte of the sum's bit pattern is then the stored code: no float->uint8 conversion
# (slow in torch) and no separate round pass.
_RNE_MAGIC = 12582912.0
# The same in fp64: 1.5 * 2**52 rounds |v| < 2**51 to an integer, ties to even.
_RNE_MAGIC64 = 6755399441055744.0
# Adding 1.5 * 2**22 to a fp64 value |v| < 2**21 rounds it to a multiple of 2**-30.
_SNAP_MAGIC64 = 6291456.0
# A normal fp32 scale s = fl(absmax / qmax) is within a factor (1 + 2**-24) of the exact
# quotient, so |d / s| rounds to at most qmax: the clamp can only bind when s is subnormal.
_FP32_SMALLEST_NORMAL = 2.0**-126
_FP32_MAX = torch.finfo(torch.float32).max
# 0xFFFFF000 as an int32: keeps the sign, the exponent and the top 11 stored mantissa bits.
_SCALE_HI_MASK = -4096
def nearest_integer_at_ties(v: torch.Tensor, d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The integer nearest to the exact quotient ``d / s`` where ``v = fl(d / s)`` is a
    half-integer, ties to even: the encoder's rounding rule, in fp32 ops only. This is
    the kernel's method (GPUs divide fp64 slowly); the torch path divides in fp64 instead.

    ``rne(v)`` is that integer everywhere except where the one rounding of the division
    lands exactly on a half-integer ``v`` that ``d / s`` is not on; ``d / s`` is then above
    or below ``v``, that is ``d > v*s`` or ``d < v*s``, and this decides it exactly. Split
    ``s = s_hi + s_lo``, with ``s_hi`` the top 12 significant bits of ``s`` (the low 12 bits
    of its bit pattern cleared) and ``s_lo`` the rest (exact, at most 12 bits). With
    ``w = 2v`` an odd integer, ``|w| < 2**8``:

    * ``v*s_hi`` is exact: at most 8 + 12 significant bits, a multiple of ``2**-138``;
    * ``r1 = d - v*s_hi`` is exact: for a normal ``s``, ``d / (v*s_hi)`` lies within
      ``[1 - 2**-23, 1 + 2**-10]`` (Sterbenz); for a subnormal ``s``, ``r1`` is a multiple of
      ``2**-149`` below ``2**-125``, hence an fp32;
    * ``w*s_lo`` is exact: at most 20 bits, a multiple of ``2**-149``. (``v*s_lo`` may not be:
      for ``s < 2**-125`` it can be an odd multiple of ``2**-150``.)

    So ``d - v*s = r1 - v*s_lo`` has the sign of ``2*r1 - w*s_lo``, computed exactly. (A
    half-integer ``|v| > qmax``, possible only with a subnormal scale, is clamped to
    ``+-qmax`` whichever neighbour is chosen.)

    Args:
        v: fp32 half-integers ``fl(d / s)``.
        d: fp32 deltas, same shape.
        s: fp32 scales, positive and finite, same shape.

    Returns:
        fp32 integers: ``v + 1/2``, ``v - 1/2`` or (an exact tie) ``rne(v)``.
    """
    s_hi = (s.view(torch.int32) & _SCALE_HI_MASK).view(torch.float32)
    s_lo = s - s_hi
    r1 = d - v * s_hi
    r2 = r1 + r1
    p2 = (v + v) * s_lo
    return torch.where(r2 > p2, v + 0.5, torch.where(r2 < p2, v - 0.5, torch.round(v)))


def _encode_chunk_fp64(
    d: torch.Tensor,
    sc: torch.Tensor,
    wide: torch.Tensor,
    spare: torch.Tensor,
    all_normal: bool,
    any_inf: bool,
    qmax: float,
    bits: int,
    magic: float,
) -> torch.Tensor:
    """Codes of one chunk from the fp64 quotient: the encoder's rule, ``nearest(d / s)``.

    At 4 bits this is ``rne(fl64(d / s))``; at 8 bits (where a pass saved shows) it is
    ``rne(snap(fl64(d * fl64(1/s))))``, ``snap`` rounding to a multiple of ``2**-30``.

    ``d`` (fp32, whole blocks) and ``s`` are exact in fp64, so ``fl64(d / s)`` is ``d / s``
    rounded once to 53 bits, within ``|d/s| * 2**-53`` of it. That never moves it onto or
    across a half-integer ``h`` that ``d/s`` is not on: with ``d = a * 2**e`` and
    ``s = b * 2**f`` (``a``, ``b`` integers below ``2**24``; subnormals included),
    ``d/s - h = (2d - w*s) / (2s)`` (``w = 2h`` odd) is a nonzero multiple of
    ``2**min(e+1, f) / (2s)``. That is at least ``|d/s| * 2**-24`` when ``e+1 <= f`` (as
    ``|d| < 2**(e+24)``), and at least ``1 / (2b) > 2**-25`` otherwise: past ``|d/s| * 2**-33``
    for any ``|d/s|`` that reaches a half-integer (>= 1/2) and stays below ``2**8`` (``|d/s|
    <= 1.5 * qmax`` even for a subnormal scale, whose rounding error is at most ``2**-150``
    while ``s >= 2**-149``). An exact half-integer quotient is computed exactly, and rounding
    it ties to even is the rule. The clamp to ``+-qmax`` commutes with rounding (``qmax`` is
    an integer), and ``0`` where the scale is 0 or infinite is set as in the fp32 path.

    The product ``p = fl64(d * fl64(1/s))`` is within ``|d/s| * 2**-51.9 < 2**-43`` of
    ``d/s`` (``1/s <= 2**149`` is in range). When ``d/s`` is a half-integer, ``p`` snaps
    to it exactly (within half the grid step, ``2**-31``); when not, ``d/s`` is at least
    ``2**-26`` from every half-integer (by the bound above when ``|d/s| >= 1/4``, and by
    ``1/4`` otherwise), so the snapped value, within ``2**-31 + 2**-43`` of ``d/s``, stays
    strictly on the same side of each, and rounds to the same integer.

    Args:
        d: fp32 deltas of whole blocks, ``nb * block`` elements.
        sc: their ``nb`` fp32 scales.
        wide: fp64 scratch, at least ``d.numel()`` elements.
        spare: fp32 scratch of ``d.numel()`` elements (the pack level for 4 bits).
        all_normal: every scale normal and finite (no mask, no clamp needed).
        any_inf: some scale is infinite.
        qmax, bits, magic: the code's parameters; ``magic`` is ``1.5 * 2**52`` plus the
            packed code offsets.

    Returns:
        fp64 values whose bit patterns hold the packed codes in their low byte.
    """
    nb = sc.numel()
    q = wide[: d.numel()]
    rows = q.view(nb, -1)
    q.copy_(d)  # exact widening
    # q = 0 where the scale is 0 or infinite: a finite d divided by (or times the inverse
    # of) +inf is +-0, and the rows of infinite scales are zeroed after.
    divisor = sc.double() if all_normal else sc.masked_fill(sc == 0.0, math.inf).double()
    if bits == 8:
        rows.mul_(divisor.reciprocal_().unsqueeze(1))
    else:
        rows.div_(divisor.unsqueeze(1))
    if not all_normal:
        if any_inf:
            rows.masked_fill_((sc == math.inf).unsqueeze(1), 0.0)
        q.clamp_(-qmax, qmax)
    if bits == 8:
        # Snap to multiples of 2**-30, then one add rounds ties to even (magic is even) and
        # adds the offset: the low byte is the code. See the docstring for why a product
        # by the rounded inverse, snapped, rounds as the exact quotient does.
        q.add_(_SNAP_MAGIC64)
        return q.add_(magic - _SNAP_MAGIC64)
    # 4 bits: round, join pairs (exact: small integers) into the spare fp32 buffer's memory.
    q.round_()
    pairs = q.view(-1, 2)
    packed = spare.view(torch.float64)[: pairs.shape[0]]
    torch.add(pairs[:, 0], pairs[:, 1], alpha=1 << bits, out=packed)
    return packed.add_(magic)


def _chunk_elements(block: int) -> int:
    """Elements per chunk of the torch path: a whole number of blocks."""
    return max(block, CHUNK_ELEMENTS // block * block)


def _copy_flat_range(src: torch.Tensor, start: int, dst: torch.Tensor) -> None:
    """Copy elements ``start : start + dst.numel()`` of ``src`` in row-major order into ``dst``
    (1-D, converting the dtype), without materializing a contiguous copy of ``src``.

    A strided tensor's flat range is a run of whole sub-tensors along dim 0 (one strided
    ``copy_``) between two partial ones, handled the same way one dimension down.
    """
    m = dst.numel()
    if src.is_contiguous():
        dst.copy_(src.reshape(-1)[start : start + m])
        return
    if src.dim() == 1:
        dst.copy_(src[start : start + m])
        return
    inner = math.prod(src.shape[1:])
    pos = 0
    while pos < m:
        i, off = divmod(start + pos, inner)
        if off == 0 and m - pos >= inner:
            rows = (m - pos) // inner
            dst[pos : pos + rows * inner].view(rows, *src.shape[1:]).copy_(src[i : i + rows])
            pos += rows * inner
        else:
            take = min(inner - off, m - pos)
            _copy_flat_range(src[i], off, dst[pos : pos + take])
            pos += take


def quantize_blockwise_torch(
    x: torch.Tensor, reference: torch.Tensor | None, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a contiguous tensor: the plain-torch reference of the encode kernel.

    Works through the flattened tensor ``CHUNK_ELEMENTS`` at a time, so the temporaries are
    about three fp32 chunks whatever the tensor's size (strided inputs included: they are
    read chunk by chunk, never copied whole).

    Args:
        x: float32, float16 or bfloat16 tensor (any shape and strides; read in row-major
            order).
        reference: ``None`` or a float tensor of ``x``'s shape (any strides).
        bits: 8, 4 or 2.
        block: power of two from 32 to 4096.

    Returns:
        ``(codes, scales)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and fp32 of
        ``ceil(n / block)`` values, on ``x``'s device.
    """
    n = x.numel()
    dev = x.device
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=dev)
    scales = torch.empty(num_blocks(n, block), dtype=torch.float32, device=dev)
    if n == 0:
        return codes, scales
    qmax = float(qmax_for(bits))
    k = 8 // bits
    # A packed byte is sum_j (q_j + offset) << (j * bits); the offsets' share is a constant.
    code_bias = sum((1 << (bits - 1)) << (j * bits) for j in range(k))
    # 8 and 4 bits round the fp64 quotient (_encode_chunk_fp64); 2 bits the fp32 one.
    magic = (_RNE_MAGIC if bits == 2 else _RNE_MAGIC64) + code_bias
    # Contiguous tensors are sliced as flat views; strided ones go through _copy_flat_range.
    flat = x.view(-1) if x.is_contiguous() else None
    ref = reference
    if ref is not None and ref.is_contiguous():
        ref = ref.view(-1)
    chunk = _chunk_elements(block)
    size = min(chunk, num_blocks(n, block) * block)
    d_buf: torch.Tensor | None = None
    t_buf = torch.empty(size, dtype=torch.float32, device=dev)
    if bits == 2:
        # The two levels of joining codes, 4 to a byte, in fp32 (exact small integers).
        pack_bufs = [torch.empty(size >> j, dtype=torch.float32, device=dev) for j in (1, 2)]
    else:
        # The fp64 quotients. Measured (benchmarks/codec.py, several runs): at 8 bits, a
        # whole-chunk (8 MiB) buffer often came as fresh pages, faulting on every call (2x
        # slower encode), so it takes half a chunk at a time; at 4 bits, halves fell into a
        # 2.5x slower state in some runs (cause not pinned down) and a whole chunk did not.
        wide_elems = size if bits == 4 else num_blocks(size, 2 * block) * block
        wide = torch.empty(wide_elems, dtype=torch.float64, device=dev)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        nb = num_blocks(m, block)
        padded = nb * block
        in_place = flat is not None and padded == m and ref is None and x.dtype == torch.float32
        if in_place:
            d = flat[start : start + m]  # the delta is x itself: read it in place
        else:
            if d_buf is None:
                d_buf = torch.empty(size, dtype=torch.float32, device=dev)
            d = d_buf[:padded]
            if padded != m:
                # Zero padding: it never raises the absmax and is never stored.
                d[m:].zero_()
            t = t_buf[:padded]
            if ref is None:
                _copy_flat_range(x, start, d[:m])
            else:
                # The delta is one fp32 subtraction of exact upcasts. Mixed-dtype torch ops
                # take a slow scalar path (fp16 - bf16 into fp32: 20x a copy), so every
                # operand is made fp32 first, in buffers this chunk does not need yet.
                if ref.dtype == torch.float32 and ref.dim() == 1:
                    rs = ref[start : start + m]
                else:
                    rs = t[:m]
                    _copy_flat_range(ref, start, rs)
                if flat is not None and x.dtype == torch.float32:
                    torch.sub(flat[start : start + m], rs, out=d[:m])
                else:
                    _copy_flat_range(x, start, d[:m])
                    d[:m].sub_(rs)
        rows = d.view(nb, block)
        t = t_buf[:padded]
        trows = t.view(nb, block)
        b0 = start // block
        sc = scales[b0 : b0 + nb]
        torch.abs(rows, out=trows)
        torch.amax(trows, dim=1, out=sc)  # NaN propagates into the block's absmax
        sc.div_(qmax)
        # NaN or Inf anywhere in the block makes the block unquantizable: scale = +inf.
        sc.nan_to_num_(nan=math.inf, posinf=math.inf)
        lo_t, hi_t = torch.aminmax(sc)
        lo, hi = lo_t.item(), hi_t.item()
        byte0 = start * bits // 8
        nbytes = packed_nbytes(m, bits)
        if bits != 2:
            all_normal = lo >= _FP32_SMALLEST_NORMAL and hi < math.inf
            for s0 in range(0, min(m, padded), wide.numel()):
                s1 = min(s0 + wide.numel(), padded)
                packed64 = _encode_chunk_fp64(
                    d[s0:s1], sc[s0 // block : s1 // block], wide, t[s0:s1],
                    all_normal, hi == math.inf, qmax, bits, magic,
                )
                b = (start + s0) * bits // 8
                nb_sub = packed_nbytes(min(s1, m) - s0, bits)
                # int64 -> uint8 keeps the low byte: the code.
                codes[b : b + nb_sub].copy_(packed64[:nb_sub].view(torch.int64))
            continue
        if lo > 0.0 and hi < math.inf:
            torch.div(rows, sc.unsqueeze(1), out=trows)
        else:
            # q = 0 where the scale is 0 or infinite: a finite d divided by +inf is +-0.
            divisor = sc.masked_fill(sc == 0.0, math.inf)
            torch.div(rows, divisor.unsqueeze(1), out=trows)
            if hi == math.inf:
                # NaN/Inf elements of an unquantizable block: q = 0 as well.
                trows.masked_fill_((sc == math.inf).unsqueeze(1), 0.0)
        if lo < _FP32_SMALLEST_NORMAL:
            t.clamp_(-qmax, qmax)
        # 2 bits: qmax = 1, so s = absmax exactly, and then a d/s that is not +-1/2 is more
        # than 2**-25 away from it: fl32(d/s) never lands on a tie that d/s is not on, and
        # one fp32 division rounded half to even is the rule.
        packed = t.round_()
        for j, buf in enumerate(pack_bufs):
            pairs = packed.view(-1, 2)
            nxt = buf[: packed.numel() // 2]
            # Exact: small integers. Level j joins groups of 2**j codes.
            torch.add(pairs[:, 0], pairs[:, 1], alpha=1 << (bits << j), out=nxt)
            packed = nxt
        packed.add_(magic)  # integral: this adds the offsets, and the low byte is the code
        # int32 -> uint8 keeps the low byte: the code.
        codes[byte0 : byte0 + nbytes].copy_(packed[:nbytes].view(torch.int32))
    return codes, scales


def dequantize_blockwise_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    reference: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Decode to a flat tensor of ``numel`` elements: the reference of the decode kernel.

    ``x_hat = cast(sat(fp32(ref) + sat(fp32(q) * scale)))``: the product is rounded to fp32
    before the add, and ``sat`` clamps to the largest finite value (of fp32 for the
    product, of ``dtype`` for the sum), NaN staying NaN. ``reference`` is ``None`` or a
    contiguous tensor with ``numel`` elements.
    """
    dev = codes.device
    out = torch.empty(numel, dtype=dtype, device=dev)
    if numel == 0:
        return out
    k = 8 // bits
    offset = float(1 << (bits - 1))
    out_max = torch.finfo(dtype).max
    ref = reference.reshape(-1) if reference is not None else None
    chunk = _chunk_elements(block)
    size = min(chunk, num_blocks(numel, block) * block)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=dev)
    u_buf = torch.empty(size, dtype=torch.uint8, device=dev) if k > 1 else None
    i_buf = torch.empty(size, dtype=torch.int32, device=dev)
    v_buf = torch.empty(size, dtype=torch.float32, device=dev)
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        nb = num_blocks(m, block)
        padded = nb * block
        nbytes = packed_nbytes(m, bits)
        byte0 = start * bits // 8
        packed = codes[byte0 : byte0 + nbytes]
        filled = nbytes * k  # elements unpacked from whole bytes, m <= filled <= padded
        if k == 1:
            u = packed
        else:
            u2 = u_buf[:filled].view(nbytes, k)
            torch.bitwise_right_shift(packed.unsqueeze(1), shifts, out=u2)
            u2.bitwise_and_((1 << bits) - 1)
            u = u_buf[:filled]
        # uint8 -> fp32 is slow in torch; uint8 -> int32 -> fp32 is not.
        i = i_buf[:filled]
        i.copy_(u)
        v = v_buf[:padded]
        v[:filled].copy_(i)
        if filled != padded:
            v[filled:].zero_()
        v.sub_(offset)
        b0 = start // block
        sc = scales[b0 : b0 + nb]
        # A bound on the products' magnitude, fl(2**(bits-1) * max |scale|) (code 0, never
        # written by the encoder, is q = -2**(bits-1); rounding is monotone), NaN when a
        # scale is NaN. Saturating is a no-op unless it exceeds the limit, so the pass is
        # skipped then: the result is the same bits.
        reach = (sc.abs().amax() * offset).item()
        dst = out[start : start + m]
        if ref is None:
            if dtype == torch.float32 and padded == m and reach <= out_max:
                # The product is the result: write it straight into the output.
                torch.mul(v.view(nb, block), sc.unsqueeze(1), out=dst.view(nb, block))
                continue
            v.view(nb, block).mul_(sc.unsqueeze(1))
            if not reach <= out_max:
                v.clamp_(-out_max, out_max)  # torch.clamp keeps NaN
            dst.copy_(v[:m])
            continue
        v.view(nb, block).mul_(sc.unsqueeze(1))
        if not reach <= _FP32_MAX:
            v.clamp_(-_FP32_MAX, _FP32_MAX)
        # fp32 += any float dtype: the reference is widened exactly, one fp32 add.
        vm = v[:m]
        vm.add_(ref[start : start + m])
        if dtype == torch.float32:
            torch.clamp(vm, -out_max, out_max, out=dst)
        else:
            vm.clamp_(-out_max, out_max)
            dst.copy_(vm)
    return out


# --------------------------------------------------------------------------------------
# Public tensor-level API
# --------------------------------------------------------------------------------------


def _use_kernels(device: torch.device) -> bool:
    return device.type == "cuda"


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = 128,
    reference: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Quantize ``x`` (optionally as a delta from ``reference``) blockwise.

    On a CUDA tensor this launches the fused Triton encode kernel (delta, absmax, rounding
    and packing in one pass); on a CPU tensor it runs the bit-identical torch path. Nothing
    here synchronizes with the device: whether some block was NaN/Inf is reported by the
    device-side flag :attr:`QuantizedTensor.nonfinite`.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape; non-contiguous tensors are
            read in their logical (row-major) order (on CPU chunk by chunk; the CUDA
            kernels take a contiguous copy).
        bits: 8, 4 or 2 bits per element.
        block: elements per scale, a power of two from 32 to 4096.
        reference: optional tensor of the same shape and device, any float dtype.

    Returns:
        A :class:`QuantizedTensor` on ``x``'s device.

    Raises:
        QuantizationError: unsupported dtype, bits or block, or a mismatched reference.
    """
    _check_input(x, reference)
    check_params(bits, block)
    if _use_kernels(x.device):
        from ..kernels import quantize_blockwise

        rc = reference.contiguous() if reference is not None else None
        codes, scales = quantize_blockwise(x.contiguous(), rc, bits, block)
    else:
        # The torch path reads strided tensors chunk by chunk: no full-size copy.
        codes, scales = quantize_blockwise_torch(x, reference, bits, block)
    # A block is unquantizable exactly when its scale is infinite (NaN/Inf in it). A block
    # whose qmax * scale overflows fp32 is not: the decode saturates the product, and x is
    # finite, so that only moves the value towards x. The flag stays on the device.
    nonfinite = torch.isinf(scales).any()
    return QuantizedTensor(
        codes=codes,
        scales=scales,
        shape=tuple(x.shape),
        dtype=x.dtype,
        bits=bits,
        block=block,
        nonfinite=nonfinite,
    )


def dequantize(
    q: QuantizedTensor,
    *,
    reference: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Decode a :class:`QuantizedTensor`.

    On CUDA this launches the fused decode kernel (unpack, scale, add the reference, cast).

    Args:
        q: the encoding.
        reference: the tensor ``q`` was encoded against, if any (same shape); it is moved
            to ``device`` if it lives elsewhere.
        dtype: output dtype; defaults to the original dtype.
        device: where to decode; defaults to where ``q`` lives.

    Returns:
        A tensor of ``q.shape`` and ``dtype`` on ``device``.
    """
    if not isinstance(q, QuantizedTensor):
        raise QuantizationError(f"expected a QuantizedTensor, got {type(q).__name__}")
    out_dtype = q.dtype if dtype is None else dtype
    if out_dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"can only decode to float32, float16 or bfloat16, got {out_dtype}")
    dev = q.device if device is None else torch.device(device)
    if dev != q.device:
        q = q.to(dev)
    rc = None
    if reference is not None:
        if not isinstance(reference, torch.Tensor) or reference.dtype not in FLOAT_DTYPES:
            raise QuantizationError("reference must be a float32, float16 or bfloat16 tensor")
        if tuple(reference.shape) != tuple(q.shape):
            raise QuantizationError(
                f"reference shape {tuple(reference.shape)} does not match encoded shape {q.shape}"
            )
        rc = reference.to(dev).contiguous()
    if _use_kernels(dev):
        from ..kernels import dequantize_blockwise

        flat = dequantize_blockwise(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    else:
        flat = dequantize_blockwise_torch(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    return flat.view(q.shape)


def stored_codes(entry: EncodedEntry, context: str) -> tuple[int, int, torch.Tensor]:
    """``(bits, block, codes)`` of a stored entry of a packed-code codec, checked.

    Checks what every codec with LSB-first packed codes shares: ``bits`` and ``block``,
    the packing, a float dtype, and a ``codes`` buffer of the right size.

    Raises:
        CheckpointError: naming ``context`` and what was expected.
    """
    params = entry.params
    bits, block = params.get("bits"), params.get("block")
    try:
        check_params(bits, block)  # type: ignore[arg-type]
    except QuantizationError as e:
        raise CheckpointError(f"{context}: {e}") from e
    if params.get("packing") != PACKING:
        raise CheckpointError(
            f"{context}: packing {params.get('packing')!r} is not supported, expected {PACKING!r}"
        )
    if entry.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{context}: {entry.codec} entry has dtype {entry.dtype}, expected one of "
            "float32, float16, bfloat16"
        )
    shape = tuple(entry.shape)
    codes = entry_buffer(entry, "codes", context)
    want = packed_nbytes(math.prod(shape), bits)  # type: ignore[arg-type]
    if codes.dtype != torch.uint8 or codes.numel() != want:
        raise CheckpointError(
            f"{context}: codes are {codes.dtype} x {codes.numel()}, expected uint8 x "
            f"{want} for shape {shape} at {bits} bits"
        )
    return bits, block, codes  # type: ignore[return-value]


def per_block_buffer(
    entry: EncodedEntry, name: str, dtype: torch.dtype, block: int, context: str
) -> torch.Tensor:
    """The buffer ``name`` of ``entry``, checked to hold one ``dtype`` value per block.

    Raises:
        CheckpointError: naming ``context`` and what was expected.
    """
    shape = tuple(entry.shape)
    want = num_blocks(math.prod(shape), block)
    buf = entry_buffer(entry, name, context)
    if buf.dtype != dtype or buf.numel() != want:
        raise CheckpointError(
            f"{context}: {name} are {buf.dtype} x {buf.numel()}, expected "
            f"{str(dtype).removeprefix('torch.')} x {want} for shape {shape} and block {block}"
        )
    return buf


class BlockwiseCodec(Codec):
    """Blockwise absmax integer codec (delta from a reference when one is given)."""

    name = "blockwise"
    has_kernel = True
    _KEYS = frozenset({"bits", "block", "packing", "delta"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'blockwise' has no parameter(s) {sorted(unknown)}; it takes "
                f"{sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "packing": params.get("packing", PACKING),
            "delta": params.get("delta", True),
        }
        check_params(out["bits"], out["block"])
        if out["packing"] != PACKING:
            raise QuantizationError(f"codec 'blockwise' packs {PACKING!r} only, got {out['packing']!r}")
        if not isinstance(out["delta"], bool):
            raise QuantizationError(f"'delta' must be true or false, got {out['delta']!r}")
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        q = quantize(x, bits=params["bits"], block=params["block"], reference=reference)
        stored = {
            "bits": q.bits,
            "block": q.block,
            "packing": PACKING,
            "delta": reference is not None,
        }
        entry = EncodedEntry(
            codec=self.name,
            params=stored,
            shape=q.shape,
            dtype=q.dtype,
            buffers={"codes": q.codes, "scales": q.scales},
        )
        return Encoded(entry, unusable=q.nonfinite)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        params = entry.params
        bits, block, codes = stored_codes(entry, context)
        shape = tuple(entry.shape)
        numel = math.prod(shape)
        scales = per_block_buffer(entry, "scales", torch.float32, block, context)
        if self.uses_reference(params) and reference is None:
            raise CheckpointError(f"{context}: delta entry decoded without its reference tensor")
        dev = codes.device if device is None else device
        q = QuantizedTensor(
            codes=move_to(codes.reshape(-1), dev),
            scales=move_to(scales.reshape(-1), dev),
            shape=shape,
            dtype=entry.dtype,
            bits=bits,  # type: ignore[arg-type]
            block=block,  # type: ignore[arg-type]
            nonfinite=torch.zeros((), dtype=torch.bool, device=dev),
        )
        ref = move_to(reference, dev) if reference is not None else None
        return dequantize(q, reference=ref if self.uses_reference(params) else None)
