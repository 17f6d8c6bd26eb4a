"""The blockwise encode in plain torch: the specification of ``quantize_blockwise``.

Every backend of the op (the Triton kernel, the compiled CPU codec) must give the bytes
this gives, codes and scales. The rule (delta, absmax, scale, rounding of the exact
quotient ties to even, LSB-first packing) is stated in docs/codecs.md; the docstrings below
prove that the fast arithmetic here computes it exactly.
"""

from __future__ import annotations

import math

import torch

from ..layout import blockwise_buffers, check_qmax, num_blocks, packed_nbytes
from .buffers import chunk_elements, copy_flat_range, encode_outputs, scratch

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
# 0xFFFFF000 as an int32: keeps the sign, the exponent and the top 11 stored mantissa bits.
_SCALE_HI_MASK = -4096


def nearest_integer_at_ties(v: torch.Tensor, d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The integer nearest to the exact quotient ``d / s`` where ``v = fl(d / s)`` is a
    half-integer, ties to even: the encoder's rounding rule, in fp32 ops only. The kernel
    settles its near-half quotients with it (:func:`nearest_integer_by_reciprocal`; GPUs
    divide fp64 slowly); the torch path divides in fp64 instead.

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


# Scales below _TINY_SCALE are multiplied by _UNTINY, with their deltas, before the
# reciprocal (see nearest_integer_by_reciprocal).
_TINY_SCALE = 2.0**-64
_UNTINY = 2.0**64
# Twice the relative error of fl(d * fl(1 / s)) against d / s.
_APPROX_ERROR = 2.0**-22


def nearest_integer_by_reciprocal(d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The integer nearest to the exact quotient ``d / s``, ties to even, by the encode
    kernel's method (``kernels/quantize_blockwise.py``): a multiply per element, no division.

    1. Where ``s < 2**-64``, ``d`` and ``s`` are both multiplied by ``2**64``: exact (a power
       of two, and ``|d| <= qmax * s`` stays far below overflow), ``d / s`` unchanged, and
       ``1 / s`` finite.
    2. ``v = fl(d * fl(1 / s))`` is ``(d / s)(1 + e1)(1 + e2)`` with ``|e1|, |e2| <= 2**-24``,
       so ``|v - d/s| < |v| * 2**-22`` (a margin of two over the bound). ``v - rne(v)`` is exact.
    3. Where ``|v - rne(v)| <= fl(0.5 - |v| * 2**-22)``, ``d / s`` is strictly inside
       ``rne(v) +- 1/2`` (the subtraction's rounding, at most ``2**-26`` for a result in
       ``[1/4, 1/2]``, is within the margin), so ``rne(v)`` is the answer.
    4. Elsewhere ``h``, the half-integer beside ``v`` (``rne(v) +- 1/2``, on ``v``'s side), is
       within ``|h| * 2**-21`` of ``d / s``, and :func:`nearest_integer_at_ties` decides the
       side exactly: its proof needs ``d / (h * s_hi)`` within a factor 2 of 1 (Sterbenz), so
       it holds for this ``h`` as for a once-rounded quotient; after step 1 every scale is
       normal and every product there exact.

    Args:
        d: fp32 deltas.
        s: fp32 scales, positive and finite, broadcastable to ``d``.

    Returns:
        fp32 integers, before the clamp to ``+-qmax``.
    """
    f = torch.where(s < _TINY_SCALE, _UNTINY, 1.0)
    s = s * f
    d = d * f
    v = d * (1.0 / s)
    r = torch.round(v)
    near = (v - r).abs() > 0.5 - v.abs() * _APPROX_ERROR
    h = torch.where(v > r, r + 0.5, r - 0.5)
    return torch.where(near, nearest_integer_at_ties(h, d, s.expand_as(d)), r)


def _rows_absmax(rows: torch.Tensor, sc: torch.Tensor, low: torch.Tensor) -> None:
    """``sc[i] = max |rows[i]|`` (NaN when the row holds one) from two read-only reductions.

    ``max(amax, -amin)`` is the absmax, and both reductions propagate NaN; it saves the
    write of ``|rows|`` that ``abs`` then ``amax`` costs. ``abs_`` turns a ``-0.0`` (a row of
    negative zeros) into the ``+0.0`` that the kernel's ``max |d|`` gives.
    """
    torch.amax(rows, dim=1, out=sc)
    torch.amin(rows, dim=1, out=low)
    torch.maximum(sc, low.neg_(), out=sc)
    sc.abs_()


def _round_quotients_fp64(
    wide: torch.Tensor, sc: torch.Tensor, all_normal: bool, any_inf: bool, qmax: float, bias: int
) -> torch.Tensor:
    """Round ``d / s`` to the nearest integer, exactly, in place, for 8 and 4 bits.

    ``wide`` holds the fp32 deltas of whole blocks widened to fp64 (exact); ``sc`` their
    scales. Returns ``wide`` as int64 whose low byte is the code ``q + bias``.

    The rule is ``nearest(d / s)`` of the exact quotient, ties to even. This computes
    ``rne(snap(fl64(d * fl64(1/s))))``, ``snap`` rounding to a multiple of ``2**-30``.
    ``d`` (fp32) and ``s`` are exact in fp64. With ``d = a * 2**e`` and ``s = b * 2**f``
    (``a``, ``b`` integers below ``2**24``; subnormals included), ``d/s - h = (2d - w*s) /
    (2s)`` for a half-integer ``h = w/2`` (``w`` odd) is either zero or a nonzero multiple of
    ``2**min(e+1, f) / (2s)``: at least ``|d/s| * 2**-24`` when ``e+1 <= f`` (as ``|d| <
    2**(e+24)``) and at least ``1 / (2b) > 2**-25`` otherwise. So a ``d/s`` with ``1/4 <=
    |d/s| < 2**8`` that is not a half-integer is at least ``2**-26`` from every one (and one
    below ``1/4`` is ``1/4`` from the nearest). (``|d/s| <= 1.5 * qmax`` even for a subnormal
    scale, whose rounding error is at most ``2**-150`` while ``s >= 2**-149``.)

    The product ``p`` is within ``|d/s| * 2**-51.9 < 2**-43`` of ``d/s`` (``1/s <= 2**149``
    is in range). When ``d/s`` is a half-integer, ``p`` snaps to it exactly (within half the
    grid step, ``2**-31``), and rounding it ties to even is the rule; when not, the snapped
    value, within ``2**-31 + 2**-43`` of ``d/s``, stays strictly on the same side of every
    half-integer, so it rounds to the same integer. The clamp to ``+-qmax`` commutes with
    rounding (``qmax`` is an integer), and ``q = 0`` where the scale is 0 or infinite.

    Adding ``1.5 * 2**22`` to ``|v| < 2**21`` rounds it to a multiple of ``2**-30``; adding
    then ``1.5 * 2**52 + bias - 1.5 * 2**22`` (an even integer) rounds to an integer ties to
    even and adds the offset, and the sum's bit pattern ends in ``q + bias``.
    """
    rows = wide.view(sc.numel(), -1)
    # q = 0 where the scale is 0 or infinite: a finite d times the inverse of +inf is +-0,
    # and the rows of infinite scales (NaN/Inf elements) are zeroed after.
    divisor = sc.double() if all_normal else sc.masked_fill(sc == 0.0, math.inf).double()
    rows.mul_(divisor.reciprocal_().unsqueeze(1))
    if not all_normal:
        if any_inf:
            rows.masked_fill_((sc == math.inf).unsqueeze(1), 0.0)
        wide.clamp_(-qmax, qmax)
    wide.add_(_SNAP_MAGIC64)
    wide.add_(_RNE_MAGIC64 + bias - _SNAP_MAGIC64)
    return wide.view(torch.int64)


def pack_codes(u: torch.Tensor, bits: int, out: torch.Tensor, words: torch.Tensor) -> None:
    """Join ``u`` (one code per byte, a multiple of 4 bytes, aligned) into ``out``, LSB-first.

    Whole words at a time instead of strided byte views (strided byte ops run far slower
    than contiguous ones): at 4 bits an int16 ``b0 | b1 << 8`` becomes ``b0 | b1 << 4``
    in its low byte by ``w | w >> 4``; at 2 bits an int32 of four codes by ``w | w >> 6``
    then ``| >> 12``. Casting to uint8 keeps the low byte.
    """
    if bits == 4:
        w = u.view(torch.int16)
        t = words[: w.numel() * 2].view(torch.int16)
        torch.bitwise_right_shift(w, 4, out=t)
        w.bitwise_or_(t)
    else:
        w = u.view(torch.int32)
        t = words[: w.numel() * 4].view(torch.int32)
        torch.bitwise_right_shift(w, 6, out=t)
        w.bitwise_or_(t)
        torch.bitwise_right_shift(w, 12, out=t)
        w.bitwise_or_(t)
    out.copy_(w[: out.numel()])


def quantize_blockwise_torch(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a tensor: the plain-torch reference of the encode kernel.

    Works through the flattened tensor ``CHUNK_ELEMENTS`` at a time, in per-thread scratch
    buffers kept between calls (:func:`~tw_triton.ops.reference.buffers.scratch`), so the temporaries are a few chunks
    whatever the tensor's size (strided inputs included: they are read chunk by chunk,
    never copied whole). Each torch op runs on both cores (torch intra-op threads).

    Per chunk: the fp32 delta (read in place for a contiguous fp32 tensor without a
    reference), two read-only reductions for the absmax, then for 8 and 4 bits the fp64
    quotient rounded exactly (:func:`_round_quotients_fp64`: widen, multiply, two adds) and
    for 2 bits the fp32 one (divide, one add); the code is the low byte of the result, and
    4 and 2 bits join codes a word at a time (:func:`_pack_codes`).

    Args:
        x: float32, float16 or bfloat16 tensor (any shape and strides; read in row-major
            order).
        reference: ``None`` or a float tensor of ``x``'s shape (any strides).
        bits: 8, 4 or 2.
        block: power of two from 32 to 4096.
        out: optional ``(codes, scales)`` to write into (for instance memory that is
            already mapped, from a snapshot pool): contiguous, of the sizes below.
        qmax: largest code magnitude (default ``2**(bits-1) - 1``; see :func:`check_qmax`).

    Returns:
        ``(codes, scales)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and fp32 of
        ``ceil(n / block)`` values, on ``x``'s device (``out`` itself when given).
    """
    n = x.numel()
    dev = x.device
    out, (codes, scales) = encode_outputs(out, dev, blockwise_buffers(n, bits, block))
    if n == 0:
        return out
    qmax = float(check_qmax(bits, qmax))
    bias = 1 << (bits - 1)
    # Contiguous tensors are sliced as flat views; strided ones go through _copy_flat_range.
    flat = x.view(-1) if x.is_contiguous() else None
    ref = reference
    if ref is not None and ref.is_contiguous():
        ref = ref.view(-1)
    chunk = chunk_elements(block)
    size = min(chunk, num_blocks(n, block) * block)
    d_buf = scratch("a", size, torch.float32, dev)
    t_buf = scratch("b", size, torch.float32, dev)
    low = torch.empty(size // block, dtype=torch.float32, device=dev)
    wide = scratch("wide", size, torch.float64, dev) if bits != 2 else None
    u_buf = scratch("u", size, torch.uint8, dev) if bits != 8 else None
    words = scratch("w", size, torch.uint8, dev) if bits != 8 else None
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        nb = num_blocks(m, block)
        padded = nb * block
        if flat is not None and padded == m and ref is None and x.dtype == torch.float32:
            d = flat[start : start + m]  # the delta is x itself: read it in place
        else:
            d = d_buf[:padded]
            if padded != m:
                # Zero padding: it never raises the absmax and is never stored.
                d[m:].zero_()
            if ref is None:
                copy_flat_range(x, start, d[:m])
            else:
                # The delta is one fp32 subtraction of exact upcasts. Mixed-dtype torch ops
                # take a slow scalar path (fp16 - bf16 into fp32), so every
                # operand is made fp32 first.
                if ref.dtype == torch.float32 and ref.dim() == 1:
                    rs = ref[start : start + m]
                else:
                    rs = t_buf[:m]
                    copy_flat_range(ref, start, rs)
                if flat is not None and x.dtype == torch.float32:
                    torch.sub(flat[start : start + m], rs, out=d[:m])
                else:
                    copy_flat_range(x, start, d[:m])
                    d[:m].sub_(rs)
        rows = d.view(nb, block)
        b0 = start // block
        sc = scales[b0 : b0 + nb]
        _rows_absmax(rows, sc, low[:nb])  # NaN propagates into the block's absmax
        sc.div_(qmax)
        # NaN or Inf anywhere in the block makes the block unquantizable: scale = +inf.
        sc.nan_to_num_(nan=math.inf, posinf=math.inf)
        lo_t, hi_t = torch.aminmax(sc)
        lo, hi = lo_t.item(), hi_t.item()
        byte0 = start * bits // 8
        dst = codes[byte0 : byte0 + packed_nbytes(m, bits)]
        if bits != 2:
            w = wide[:padded]
            w.copy_(d)  # exact widening
            all_normal = lo >= _FP32_SMALLEST_NORMAL and hi < math.inf
            src = _round_quotients_fp64(w, sc, all_normal, hi == math.inf, qmax, bias)
        else:
            t = t_buf[:padded]
            trows = t.view(nb, block)
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
            # 2 bits: qmax = 1, so s = absmax exactly, and then a d/s that is not +-1/2 is
            # more than 2**-25 away from it: fl32(d/s) never lands on a tie that d/s is not
            # on, and one fp32 division rounded half to even is the rule. Adding 1.5 * 2**23
            # plus the (even) offset rounds ties to even and leaves q + bias in the low byte.
            src = t.add_(_RNE_MAGIC + bias).view(torch.int32)
        if bits == 8:
            dst.copy_(src[: dst.numel()])  # int64 -> uint8 keeps the low byte: the code
        else:
            u = u_buf[:padded]
            u.copy_(src)  # one code per byte, the padding's too (q = 0)
            pack_codes(u, bits, dst, words)
    return out
