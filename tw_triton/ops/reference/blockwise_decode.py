"""The blockwise decode in plain torch: the specification of ``dequantize_blockwise``.

``x_hat = cast(sat(fp32(ref) + sat32(fp32(q) * scale)))``, the product rounded to fp32
before the add (never an FMA). Every backend of the op must decode to these values, bit for
bit. The rule is stated in docs/codecs.md.
"""

from __future__ import annotations

import torch

from ..layout import num_blocks, packed_nbytes
from .buffers import chunk_elements, copy_flat_range, decode_output, scratch

_FP32_MAX = torch.finfo(torch.float32).max
# 0xF0F0 and 0xC0C0C0C0 as signed integers: the top bits of each byte of a word.
_HI_NIBBLES16 = -3856
_HI_CRUMBS32 = -1061109568


def crumb_table(device: torch.device) -> torch.Tensor:
    """For 2-bit codes: 256 int32 words, word ``b`` holding the four int8 ``q`` of a packed
    byte ``b`` (field ``j``, bits ``2j..2j+1``, minus the offset 2) as its bytes in order."""
    fields = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1) >> torch.arange(
        0, 8, 2, dtype=torch.int32, device=device
    )
    return ((fields & 3) - 2).to(torch.int8).contiguous().view(torch.int32).view(-1)


def signed_codes(
    packed: torch.Tensor,
    bits: int,
    x: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    e: torch.Tensor | None,
    crumbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The codes of ``packed`` as int8 ``q``, one per element (``len(packed) * 8 // bits``).

    8 and 4 bits: XOR with the offset in every field turns ``u = q + 2**(bits-1)`` into
    ``q`` in two's complement of ``bits`` bits. Each field is then moved to the top of its
    own byte of a wider word (contiguous int16 ops; no strided byte views) and an
    arithmetic shift right of the int8 bytes sign-extends it. 2 bits with ``crumbs``
    (:func:`crumb_table` on ``packed``'s device): one lookup of each byte's four codes, a
    gather of 4-byte words (faster than the nine word ops below, which serve without a
    table; at 4 bits the shifts beat a table of 2-byte words).
    ``x``: byte scratch of at least ``len(packed)``; ``w``, ``t``, ``e`` (``e`` for 2 bits
    only): of ``len(packed) * 8 // bits`` bytes each.
    """
    n = packed.numel()
    xs = x[:n]
    if bits == 8:
        torch.bitwise_xor(packed, 0x80, out=xs)
        return xs.view(torch.int8)
    if bits == 2 and crumbs is not None:
        index = w[: 4 * n].view(torch.int32)
        index.copy_(packed)
        words = t[: 4 * n].view(torch.int32)
        torch.index_select(crumbs, 0, index, out=words)
        return words.view(torch.int8)
    if bits == 4:
        torch.bitwise_xor(packed, 0x88, out=xs)
        ww = w[: 2 * n].view(torch.int16)
        tt = t[: 2 * n].view(torch.int16)
        ww.copy_(xs)  # 0x00HL
        torch.bitwise_left_shift(ww, 4, out=tt)  # L at bits 4-7
        ww.bitwise_left_shift_(8)  # H at bits 12-15
        ww.bitwise_or_(tt).bitwise_and_(_HI_NIBBLES16)
        return ww.view(torch.int8).bitwise_right_shift_(4)
    torch.bitwise_xor(packed, 0xAA, out=xs)
    ww = w[: 4 * n].view(torch.int32)
    tt = t[: 4 * n].view(torch.int32)
    ee = e[: 4 * n].view(torch.int32)
    ww.copy_(xs)
    torch.bitwise_and(ww, 0x33, out=tt)  # fields 0 and 2, at bits 0-1 and 4-5
    ww.bitwise_and_(0xCC)  # fields 1 and 3, at bits 2-3 and 6-7
    # Fields 0..3 go to bits 6-7, 14-15, 22-23, 30-31; the copies each OR leaves elsewhere
    # are masked off after.
    torch.bitwise_left_shift(tt, 12, out=ee)
    tt.bitwise_or_(ee).bitwise_left_shift_(6)
    torch.bitwise_left_shift(ww, 12, out=ee)
    ww.bitwise_or_(ee).bitwise_left_shift_(12)
    ww.bitwise_or_(tt).bitwise_and_(_HI_CRUMBS32)
    return ww.view(torch.int8).bitwise_right_shift_(6)


def dequantize_blockwise_torch(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    reference: torch.Tensor | None,
    dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode to a flat tensor of ``numel`` elements: the reference of the decode kernel.

    ``x_hat = cast(sat(fp32(ref) + sat(fp32(q) * scale)))``: the product is rounded to fp32
    before the add, and ``sat`` clamps to the largest finite value (of fp32 for the
    product, of ``dtype`` for the sum), NaN staying NaN. ``reference`` is ``None`` or a
    tensor with ``numel`` elements (read in row-major order, chunk by chunk).

    Per chunk of ``CHUNK_ELEMENTS``: the codes become int8 ``q`` with a few byte and word
    ops (:func:`signed_codes`), one conversion to fp32, one multiply by the scales (for
    fp32 without a reference written straight into the output), then the reference's add
    and the saturating cast into the output. The saturation of the product is skipped when
    the scales show it cannot bind (same bits). Each torch op runs on both cores.

    Args:
        out: optional contiguous tensor of ``numel`` elements and ``dtype`` on ``codes``'
            device to decode into (for instance memory that is already mapped); returned.
            It may be ``reference`` itself: each chunk of the reference is read before the
            same chunk of the output is written, so a loader that owns the reference's
            memory can decode a delta in place, without a second full-size buffer.
    """
    dev = codes.device
    out, out_flat = decode_output(out, numel, dtype, dev)
    if numel == 0:
        return out
    k = 8 // bits
    out_max = torch.finfo(dtype).max
    # A bound on the products' magnitude, fl(2**(bits-1) * max |scale|) (code 0, never
    # written by the encoder, is q = -2**(bits-1); rounding is monotone), NaN when a scale
    # is NaN. Saturating is a no-op unless it exceeds the limit, so the pass is skipped
    # then: the result is the same bits.
    reach = (scales.abs().amax() * float(1 << (bits - 1))).item()
    ref = reference
    if ref is not None and ref.is_contiguous():
        ref = ref.view(-1)
    chunk = chunk_elements(block)
    size = min(chunk, num_blocks(numel, block) * block)
    v_buf = scratch("a", size, torch.float32, dev)
    r_buf = scratch("b", size, torch.float32, dev) if ref is not None else None
    x_buf = scratch("u", size // k, torch.uint8, dev)
    w_buf = scratch("w", size, torch.uint8, dev) if k > 1 else None
    t_buf = scratch("t", size, torch.uint8, dev) if k > 1 else None
    crumbs = crumb_table(dev) if k == 4 else None  # 2 bits: a lookup, no third scratch
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        nb = num_blocks(m, block)
        padded = nb * block
        nbytes = packed_nbytes(m, bits)
        byte0 = start * bits // 8
        q = signed_codes(codes[byte0 : byte0 + nbytes], bits, x_buf, w_buf, t_buf, None, crumbs)
        filled = q.numel()  # elements unpacked from whole bytes, m <= filled <= padded
        v = v_buf[:padded]
        v[:filled].copy_(q)
        if filled != padded:
            v[filled:].zero_()
        vrows = v.view(nb, block)
        b0 = start // block
        sc = scales[b0 : b0 + nb].unsqueeze(1)
        dst = out_flat[start : start + m]
        if ref is None:
            if dtype == torch.float32 and padded == m:
                # The product is the result: write it straight into the output.
                torch.mul(vrows, sc, out=dst.view(nb, block))
                if not reach <= out_max:
                    dst.clamp_(-out_max, out_max)  # torch.clamp keeps NaN
                continue
            vrows.mul_(sc)
            if not reach <= out_max:
                v.clamp_(-out_max, out_max)
            dst.copy_(v[:m])
            continue
        vrows.mul_(sc)
        if not reach <= _FP32_MAX:
            v.clamp_(-_FP32_MAX, _FP32_MAX)
        # fp32 + any float dtype: the reference is widened exactly (a copy: mixed-dtype
        # adds take a slow path), then one fp32 add.
        if ref.dtype == torch.float32 and ref.dim() == 1:
            rs = ref[start : start + m]
        else:
            rs = r_buf[:m]
            copy_flat_range(ref, start, rs)
        vm = v[:m]
        vm.add_(rs)
        if dtype == torch.float32:
            torch.clamp(vm, -out_max, out_max, out=dst)
        else:
            vm.clamp_(-out_max, out_max)
            dst.copy_(vm)
    return out
