"""The log2 encode and decode in plain torch: the specification of ``quantize_log2`` and
``dequantize_log2``.

Codes linear in the fp32 bit pattern (a piecewise-linear log2) between each block's smallest
and largest positive value, code 0 reserved for exact zero; every operation an integer one
or a correctly rounded fp32 one, so every backend gives the same bytes and values. The rule
is stated in docs/codecs.md and in :mod:`tw_triton.codecs.log2`.
"""

from __future__ import annotations

import sys

import torch

from ..layout import log2_buffers, num_blocks, packed_nbytes
from .buffers import chunk_elements, decode_output, encode_outputs, scratch

# bits(+inf): every t at or above it is +inf or a NaN with the sign bit clear.
_F32_INF_BITS = 0x7F800000
# bits(-0.0) read as an int32.
_NEG_ZERO_BITS = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
# Packing reads the int16 codes of a byte as one wider integer, which assumes this order.
_LITTLE_ENDIAN = sys.byteorder == "little"
# Elements per chunk of the torch path (a whole number of blocks): temporaries stay at a few
# 2 MiB buffers whatever the tensor's size (chosen with blockwise's CHUNK_ELEMENTS).
CHUNK_ELEMENTS = 1 << 19


def levels(bits: int) -> int:
    """Steps between the nonzero levels: ``2**bits - 2`` (254, 14 or 2)."""
    return (1 << bits) - 2


def _pack_into(u: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack int16 codes (< 2**bits, a whole number of bytes' worth) LSB-first into ``out``.

    The ``8 // bits`` codes of a byte are read as one wider integer (little-endian: code
    ``j`` sits at bit ``16 j``) and shifted onto bits ``j * bits``; the fields do not
    overlap, and the copy into ``uint8`` keeps the low byte. Integer ops on contiguous
    memory: several times faster than shifting strided ``uint8`` views.
    """
    k = 8 // bits
    if k == 1:
        out.copy_(u[: out.numel()])
        return
    if not _LITTLE_ENDIAN:
        groups = u.view(-1, k)[: out.numel()]
        acc = groups[:, 0].clone()
        for j in range(1, k):
            acc |= groups[:, j] << (j * bits)
        out.copy_(acc)
        return
    wide = u.view(torch.int32 if k == 2 else torch.int64)[: out.numel()]
    acc = wide.clone()
    for j in range(1, k):
        acc |= wide >> (j * (16 - bits))
    out.copy_(acc)


def _unpack_into(packed: torch.Tensor, bits: int, u: torch.Tensor) -> None:
    """Unpack ``uint8`` bytes into ``8 // bits`` int16 codes each, the inverse of
    :func:`_pack_into` (``u`` holds exactly ``packed.numel() * 8 // bits`` elements).

    Each byte is copied into a wider integer, replicated onto the bits of the int16 lanes
    (code ``j`` lands at bit ``16 j``) and masked: three contiguous passes.
    """
    k = 8 // bits
    if k == 1:
        u.copy_(packed)
        return
    if not _LITTLE_ENDIAN:
        groups = u.view(-1, k)
        for j in range(k):
            groups[:, j].copy_((packed >> (j * bits)) & ((1 << bits) - 1))
        return
    wide = u.view(torch.int32 if k == 2 else torch.int64)
    wide.copy_(packed)
    # k == 2: bits 0-3 and (byte << 12) bits 16-19; k == 4: the byte at 0, 14, 28, 42.
    wide |= wide << (16 - bits)
    if k == 4:
        wide |= wide << 2 * (16 - bits)
    lane = (1 << bits) - 1
    wide &= sum(lane << (16 * j) for j in range(k))


def _levels(t: torch.Tensor, lo_b: torch.Tensor, hi_b: torch.Tensor, n_steps: float, r: torch.Tensor) -> None:
    """``r = clamp(rne(fl32(fl32(t - lo) / step)), 0, N)`` per block, into ``r`` (fp32).

    A block whose step is 0 (``hi == lo``) divides by 1: its coded elements all equal
    ``lo``, so they get 0 as the spec says, and its other elements are masked by the caller.
    """
    step = (hi_b - lo_b).to(torch.float32) / n_steps
    safe = torch.where(step > 0, step, 1.0).unsqueeze(1)
    # int32 - int32 into an fp32 output: torch subtracts in int32 (exact for coded elements,
    # both being positive fp32 patterns) and rounds the difference once, as fl32(t - lo).
    torch.sub(t, lo_b.unsqueeze(1), out=r)
    r.div_(safe)
    torch.round(r, out=r).clamp_(0.0, n_steps)


# Scaling of the bound on a product's error against the quotient it stands for.
_APPROX_ERROR = 2.0**-22


def log2_levels_by_reciprocal(a: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """``rne(fl(a / step))`` by the encode kernel's method (``kernels/quantize_log2.py``):
    a multiply by ``fl(1 / step)`` per element, a division only near a half-integer.

    ``v = fl(a * fl(1 / step))`` is ``(a / step)(1 + e1)(1 + e2)`` and ``fl(a / step)`` is
    ``(a / step)(1 + e3)``, each ``|e| <= 2**-24``, so ``|v - fl(a / step)| < 3.001 * 2**-24 * |v|``.
    Where ``|v - rne(v)| <= fl(0.5 - |v| * 2**-22)``, ``fl(a / step)`` lies strictly inside
    ``rne(v) +- 1/2``, so its ``rne`` is ``rne(v)``: the subtraction's rounding, at most
    ``2**-26``, is within the margin left, ``0.999 * 2**-24 * |v|``, wherever ``v`` is near a
    half-integer (``|v| > 0.49``). Elsewhere the quotient is divided.

    Args:
        a: fp32 values (``fl(t - lo)``).
        step: fp32 steps, positive and finite, broadcastable to ``a``.

    Returns:
        fp32 integers, before the clamp to ``[0, N]``.
    """
    v = a * (1.0 / step)
    q = torch.round(v)
    near = (v - q).abs() > 0.5 - v.abs() * _APPROX_ERROR
    return torch.where(near, torch.round(a / step), q)


def _general_rows(
    t: torch.Tensor, n_steps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bounds and codes of blocks that mix zeros, positives and uncodable elements.

    The slow, plain statement of the spec, on the rows the fast path cannot take.

    Returns:
        ``(lo, hi, u)``: int32 bounds per row and fp32 codes (whole numbers) per element,
        written into ``out`` when given (fp32, ``t``'s shape).
    """
    pos = (t > 0) & (t < _F32_INF_BITS)
    zero = (t == 0) | (t == _NEG_ZERO_BITS)
    bad_b = ~(pos | zero).all(dim=1)
    pos &= ~bad_b.unsqueeze(1)
    lo_b = torch.where(pos, t, _INT32_MAX).amin(dim=1)
    hi_b = torch.where(pos, t, 0).amax(dim=1)
    lo_b = torch.where(hi_b > 0, lo_b, 0)
    # A block that cannot be coded stores bounds -1 and codes 0: the flag is then
    # (hi < 0).any(), read on the device like the blockwise codec's infinite scales.
    lo_b = torch.where(bad_b, -1, lo_b)
    hi_b = torch.where(bad_b, -1, hi_b)
    u = torch.empty(t.shape, dtype=torch.float32, device=t.device) if out is None else out
    _levels(t, lo_b, hi_b, n_steps, u)
    u.add_(1.0).masked_fill_(~pos, 0.0)
    return lo_b, hi_b, u


def quantize_log2_torch(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Encode ``x`` (any shape and strides, read in row-major order): the kernel's spec.

    Per chunk of ``CHUNK_ELEMENTS``, in per-thread scratch kept between calls (see
    :func:`~tw_triton.ops.reference.buffers.scratch`); a contiguous fp32 chunk of whole blocks
    is read where it lies. A min and a max per block sort the blocks: all positive and finite
    (the bounds are the min and max), all ``+0`` (bounds and codes 0), or other. Only the
    other blocks (mixed zeros, ``-0``, negative or non-finite elements: few in a second
    moment, where a zero is a whole row of an unused embedding) take the slower masked path.

    Args:
        out: optional ``(codes, lo, hi)`` to write into: contiguous, of the sizes below.

    Returns:
        ``(codes, lo, hi)``: ``uint8`` codes and int32 bounds per block (``-1, -1`` for a
        block with a negative, NaN or infinite element, whose codes are then all 0).
    """
    n = x.numel()
    dev = x.device
    nblocks = num_blocks(n, block)
    out, (codes, lo, hi) = encode_outputs(out, dev, log2_buffers(n, bits, block))
    if n == 0:
        return out
    flat = x.reshape(-1)
    n_steps = float(levels(bits))
    chunk = chunk_elements(block, CHUNK_ELEMENTS)
    size = min(chunk, nblocks * block)
    v_buf = scratch("log2_v", size, torch.float32, dev)
    r_buf = scratch("log2_p", size, torch.float32, dev)
    u_buf = scratch("log2_h", size, torch.int16, dev)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        nb = num_blocks(m, block)
        padded = nb * block
        if x.dtype == torch.float32 and padded == m:
            v = flat[start : start + m]  # read only: the bits are taken as they are
        else:
            v = v_buf[:padded]
            if padded != m:
                v[m:].zero_()  # a zero is coded as itself and never widens the bounds
            v[:m].copy_(flat[start : start + m])
        t = v.view(torch.int32).view(nb, block)
        # Two reductions: torch's fused aminmax over rows is much slower on the CPU.
        mn, mx = t.amin(dim=1), t.amax(dim=1)
        positive = (mn > 0) & (mx < _F32_INF_BITS)
        other = ~(positive | ((mn == 0) & (mx == 0)))
        n_other = int(other.sum())
        r = r_buf[:padded].view(nb, block)
        if n_other * 4 > nb:
            # Mostly mixed blocks (zeros scattered through the tensor): the masked path on the
            # whole chunk beats gathering and scattering most of its rows.
            lo_b, hi_b, _ = _general_rows(t, n_steps, out=r)
        else:
            lo_b = torch.where(positive, mn, 0)
            hi_b = torch.where(positive, mx, 0)
            _levels(t, lo_b, hi_b, n_steps, r)
            # +1 on the positive blocks; an all-+0 block has t = lo = 0, so r = 0 = its code.
            r.add_(positive.to(torch.float32).unsqueeze(1))
            if n_other:
                rows = other.nonzero().squeeze(1)
                lo_o, hi_o, u_o = _general_rows(t.index_select(0, rows), n_steps)
                lo_b.index_copy_(0, rows, lo_o)
                hi_b.index_copy_(0, rows, hi_o)
                r.index_copy_(0, rows, u_o)
        b0 = start // block
        lo[b0 : b0 + nb] = lo_b
        hi[b0 : b0 + nb] = hi_b
        u = u_buf[:padded]
        # Whole numbers in [0, 2**bits - 1]: exact in int16, which fp32 converts to faster
        # than to uint8.
        u.copy_(r.view(-1))
        byte0 = start * bits // 8
        _pack_into(u, bits, codes[byte0 : byte0 + packed_nbytes(m, bits)])
    return out


def dequantize_log2_torch(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode to a flat tensor of ``numel`` elements of ``dtype``: the kernel's spec.

    Per chunk of ``CHUNK_ELEMENTS``, in per-thread scratch kept between calls (a chunk's
    temporaries are megabytes, and fresh pages fault in on every call otherwise): the
    codes are unpacked into int16 ``u``, then ``fl32(u - 1)`` (exact: ``u`` is small),
    times the block's step, plus one half, truncated, plus ``lo``, capped at ``hi``; an
    fp32 output is written in place. ``u = 0`` must give ``+0``: a block without a positive
    element (``lo = hi = 0``) gives 0 from the formula itself, so only the blocks that hold
    a zero code next to positive ones are masked. ``out``: an optional contiguous tensor of
    ``numel`` elements of ``dtype`` on the codes' device to decode into; returned.
    """
    dev = codes.device
    out, flat_out = decode_output(out, numel, dtype, dev)
    if numel == 0:
        return out
    n_steps = float(levels(bits))
    k = 8 // bits
    chunk = chunk_elements(block, CHUNK_ELEMENTS)
    size = min(chunk, num_blocks(numel, block) * block)
    u_buf = scratch("log2_h", size, torch.int16, dev)
    p_buf = scratch("log2_p", size, torch.float32, dev)
    t_buf = scratch("log2_t", size, torch.int32, dev)
    out_bits = flat_out.view(torch.int32) if dtype == torch.float32 else None
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        nb = num_blocks(m, block)
        padded = nb * block
        byte0 = start * bits // 8
        packed = codes[byte0 : byte0 + packed_nbytes(m, bits)]
        u = u_buf[:padded]
        filled = packed.numel() * k  # m <= filled <= padded
        _unpack_into(packed, bits, u[:filled])
        if filled != padded:
            u[filled:].zero_()
        b0 = start // block
        lo_b = lo[b0 : b0 + nb]
        hi_b = hi[b0 : b0 + nb]
        step = (hi_b - lo_b).to(torch.float32) / n_steps
        p = p_buf[:padded]
        p.copy_(u).sub_(1.0)
        p.view(nb, block).mul_(step.unsqueeze(1)).add_(0.5)
        # fp32 output of whole blocks: the bits are written straight into it.
        direct = out_bits is not None and padded == m
        t = out_bits[start : start + m] if direct else t_buf[:padded]
        t.copy_(p)  # float -> int32 truncates toward zero, as the kernel's conversion does
        rows = t.view(nb, block)
        rows.add_(lo_b.unsqueeze(1))
        torch.minimum(rows, hi_b.unsqueeze(1), out=rows)
        u_rows = u.view(nb, block)
        masked = (u_rows.amin(dim=1) == 0) & ((lo_b != 0) | (hi_b != 0))
        if bool(masked.any()):
            idx = masked.nonzero().squeeze(1)
            rows.index_copy_(
                0, idx, rows.index_select(0, idx).masked_fill_(u_rows.index_select(0, idx) == 0, 0)
            )
        if not direct:
            flat_out[start : start + m].copy_(t[:m].view(torch.float32))
    return out
