"""The closed-loop temporal codec of non-negative state in plain torch: the specification of
``quantize_log2_temporal`` and ``dequantize_log2_temporal``.

Everything works on fp32 bit patterns read as integers (``t`` of the input, ``r`` of the
reference, the reconstruction the decoder already has), so every backend computes the
same integers. Per block of ``block`` elements:

* ``S = max((hi_r - lo_r) // N, min_step)`` (int64), ``N = 2**bits - 2``, where ``lo_r`` and
  ``hi_r`` are the smallest and largest pattern of the block's positive finite reference
  values (``S = min_step`` when there is none): the step of the absolute ``log2`` codes of
  the reference's block, which the decoder can compute too, so it is never stored;
* ``d = t - r``, ``q = sign(d) * ((|d| + S // 2) // S)``; an element is *temporal* when it is
  zero (``+0`` or ``-0``; code ``-128``) or positive finite over a positive finite
  reference with ``|q| <= 127`` (code ``q``);
* a block whose elements are all temporal stores ``lo = hi = 0`` and the signed codes
  (one byte each, two's complement); any other block of non-negative finite values stores
  the absolute ``log2`` codes of its elements (``lo >= 1``, ``u <= 2**bits - 1``, the rule of
  :mod:`tw_triton.ops.reference.log2`, one byte each); a block with a negative, NaN or
  infinite element stores ``lo = hi = -1`` and codes 0 (the tensor is then stored exact).

Decoding a temporal element: ``-128`` gives ``+0``; else ``t_hat = clamp(r + q * S, 1,
0x7F7FFFFF)``: positive and finite, within ``S / 2`` of ``t`` (the clamp only moves it
towards ``t``). Why and measurements: docs/codecs.md ("The temporal second-moment codec").
"""

from __future__ import annotations

import torch

from ...errors import QuantizationError
from ..layout import num_blocks
from .buffers import chunk_elements, decode_output, encode_outputs
from .log2 import CHUNK_ELEMENTS, levels

F32_INF_BITS = 0x7F800000
F32_MAX_BITS = 0x7F7FFFFF
NEG_ZERO_BITS = -(1 << 31)
INT32_MAX = (1 << 31) - 1
ZERO_CODE = -128  # the byte 0x80: exact zero in a temporal block
QMAX = 127
# The default floor of the temporal step, in bit-pattern units: 1/16 octave (2**23 units are
# one octave). It only binds in blocks whose reference spans less than N/16 octaves.
MIN_STEP = 1 << 19
# The largest floor: a step of at most 2**30 keeps the kernels' rounding exact in 32-bit
# integers (kernels/quantize_log2_temporal.py, ``rounded_steps``), and q * S far inside int64.
MAX_MIN_STEP = 1 << 29


def is_min_step(value: object) -> bool:
    """Whether ``value`` is a step floor the codec takes: an int from 1 to :data:`MAX_MIN_STEP`."""
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= MAX_MIN_STEP


def check_min_step(min_step: object, what: str) -> None:
    """Raise :class:`~tw_triton.errors.QuantizationError` unless :func:`is_min_step`."""
    if not is_min_step(min_step):
        raise QuantizationError(f"{what}: min_step must be an int from 1 to {MAX_MIN_STEP}, got {min_step!r}")


def temporal_buffers(numel: int, block: int) -> list[tuple[str, int, torch.dtype]]:
    """``(name, elements, dtype)`` of a temporal encoding's buffers: codes (one byte per
    element), lo, hi (int32 per block)."""
    nblocks = num_blocks(numel, block)
    return [("codes", numel, torch.uint8), ("lo", nblocks, torch.int32), ("hi", nblocks, torch.int32)]


def _rows(flat: torch.Tensor, start: int, m: int, padded: int, block: int) -> torch.Tensor:
    """fp32 bit patterns of ``flat[start:start+m]`` as ``(rows, block)`` int32, zero padded."""
    v = torch.zeros(padded, dtype=torch.float32, device=flat.device)
    v[:m].copy_(flat[start : start + m])
    return v.view(torch.int32).view(-1, block)


def temporal_step(r: torch.Tensor, bits: int, min_step: int) -> torch.Tensor:
    """The int64 step ``S`` of each row of reference patterns ``r`` (see the module doc)."""
    rpos = (r > 0) & (r < F32_INF_BITS)
    lo_r = torch.where(rpos, r, INT32_MAX).amin(dim=1).to(torch.int64)
    hi_r = torch.where(rpos, r, 0).amax(dim=1).to(torch.int64)
    span = torch.where(rpos.any(dim=1), hi_r - lo_r, 0)
    return torch.clamp(torch.div(span, levels(bits), rounding_mode="floor"), min=min_step)


def _absolute(t: torch.Tensor, pos: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """The ``log2`` bounds and codes of rows ``t`` whose ``pos`` elements are positive finite
    and the rest zeros (at least one positive per row)."""
    n_steps = float(levels(bits))
    lo = torch.where(pos, t, INT32_MAX).amin(dim=1)
    hi = torch.where(pos, t, 0).amax(dim=1)
    step = (hi - lo).to(torch.float32) / n_steps
    safe = torch.where(step > 0, step, 1.0).unsqueeze(1)
    r = ((t - lo.unsqueeze(1)).to(torch.float32) / safe).round_().clamp_(0.0, n_steps)
    u = torch.where(pos, r.to(torch.int32) + 1, 0)
    return lo, hi, u


def quantize_log2_temporal_torch(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int = MIN_STEP,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Encode float32 ``x`` against ``reference`` (its shape; both read in row-major order).

    Args:
        bits: the absolute codes' width (8, 4 or 2), which also sets ``N`` of the step.
        block: elements per block.
        min_step: the floor of the temporal step in bit-pattern units.
        out: optional ``(codes, lo, hi)`` to write into.

    Returns:
        ``(codes, lo, hi)``: ``uint8`` (one per element), int32 per block.
    """
    n = x.numel()
    out, (codes, lo, hi) = encode_outputs(out, x.device, temporal_buffers(n, block))
    xf, rf = x.reshape(-1), reference.reshape(-1)
    chunk = chunk_elements(block, CHUNK_ELEMENTS)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        nb = num_blocks(m, block)
        t = _rows(xf, start, m, nb * block, block)
        r = _rows(rf, start, m, nb * block, block)
        pos = (t > 0) & (t < F32_INF_BITS)
        zero = (t == 0) | (t == NEG_ZERO_BITS)
        bad = ~(pos | zero).all(dim=1)
        rpos = (r > 0) & (r < F32_INF_BITS)
        step = temporal_step(r, bits, min_step).unsqueeze(1)
        d = t.to(torch.int64) - r.to(torch.int64)
        qa = torch.div(d.abs() + step // 2, step, rounding_mode="floor")
        q = torch.where(d < 0, -qa, qa)
        ok = zero | (pos & rpos & (qa <= QMAX))
        temporal = ok.all(dim=1) & ~bad
        absolute = ~temporal & ~bad
        c = torch.where(zero, ZERO_CODE, torch.where(ok, q, 0))
        lo_b = torch.zeros(nb, dtype=torch.int32, device=x.device)
        hi_b = torch.zeros(nb, dtype=torch.int32, device=x.device)
        if bool(absolute.any()):
            rows = absolute.nonzero().squeeze(1)
            lo_a, hi_a, u_a = _absolute(t.index_select(0, rows), pos.index_select(0, rows), bits)
            lo_b.index_copy_(0, rows, lo_a)
            hi_b.index_copy_(0, rows, hi_a)
            c.index_copy_(0, rows, u_a.to(torch.int64))
        lo_b.masked_fill_(bad, -1)
        hi_b.masked_fill_(bad, -1)
        c.masked_fill_(bad.unsqueeze(1), 0)
        codes[start : start + m] = (c.reshape(-1)[:m] & 0xFF).to(torch.uint8)
        b0 = start // block
        lo[b0 : b0 + nb] = lo_b
        hi[b0 : b0 + nb] = hi_b
    return out


def dequantize_log2_temporal_torch(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    reference: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    min_step: int = MIN_STEP,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode to a flat float32 tensor of ``numel`` elements (``out`` when given; it may be
    ``reference`` itself: each chunk is read before it is written)."""
    dev = codes.device
    out, flat_out = decode_output(out, numel, torch.float32, dev)
    rf = reference.reshape(-1)
    n_steps = float(levels(bits))
    chunk = chunk_elements(block, CHUNK_ELEMENTS)
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        nb = num_blocks(m, block)
        padded = nb * block
        r = _rows(rf, start, m, padded, block)
        c = torch.full((padded,), ZERO_CODE, dtype=torch.int64, device=dev)
        c[:m] = codes[start : start + m].view(torch.int8).to(torch.int64)
        c = c.view(nb, block)
        b0 = start // block
        lo_b = lo[b0 : b0 + nb].unsqueeze(1)
        hi_b = hi[b0 : b0 + nb].unsqueeze(1)
        # Temporal rows.
        step = temporal_step(r, bits, min_step).unsqueeze(1)
        t_tmp = torch.clamp(r.to(torch.int64) + c * step, 1, F32_MAX_BITS)
        t_tmp = torch.where(c == ZERO_CODE, 0, t_tmp)
        # Absolute rows: the log2 decode of the unsigned codes.
        u = c & 0xFF
        a_step = (hi_b - lo_b).to(torch.float32) / n_steps
        p = (u - 1).to(torch.float32) * a_step + 0.5
        t_abs = torch.minimum(lo_b + p.to(torch.int32), hi_b)
        t_abs = torch.where(u > 0, t_abs, 0)
        temporal = (lo_b == 0) & (hi_b == 0)
        t = torch.where(temporal, t_tmp.to(torch.int32), t_abs)
        flat_out[start : start + m].copy_(t.reshape(-1)[:m].view(torch.float32))
    return out


def log2_temporal_code_flags_many_torch(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
) -> torch.Tensor:
    """int64, one per tensor, on the codes' device: 1 where
    :func:`log2_temporal_code_errors_torch` finds something in that tensor, else 0."""
    bad = [
        int(log2_temporal_code_errors_torch(*t, bits, block) is not None)
        for t in zip(codes, lo, hi, references)
    ]
    return torch.tensor(bad, dtype=torch.int64, device=codes[0].device if codes else None)


def log2_temporal_code_errors_torch(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> str | None:
    """What no encoder writes (``None`` if nothing): bounds other than ``0, 0``,
    ``-1, -1`` (an uncodable block, all codes 0; it decodes to zeros, as in ``log2``, and a
    file never holds one: such a tensor is stored exact) or ``1 <= lo <= hi < +inf``; an
    absolute code above ``2**bits - 1``; a temporal code other than ``-128`` over a
    reference value that is not positive finite. Chunk by chunk, so its temporaries stay a
    few MiB whatever the tensor's size."""
    temporal = (lo == 0) & (hi == 0)
    uncodable = (lo == -1) & (hi == -1)
    bounds_ok = temporal | uncodable | ((lo >= 1) & (lo <= hi) & (hi < F32_INF_BITS))
    if not bool(bounds_ok.all()):
        b = int((~bounds_ok).nonzero()[0, 0])
        return f"block {b} has bounds lo={int(lo[b])}, hi={int(hi[b])}"
    n = codes.numel()
    flat_ref = reference.reshape(-1)
    limit = torch.where(uncodable, 0, (1 << bits) - 1)

    def wrong(start: int, m: int) -> torch.Tensor:
        # Elements [start, start + m) (start a whole number of blocks) holding a bad code.
        blk = slice(start // block, start // block + num_blocks(m, block))
        padded = num_blocks(m, block) * block
        c = torch.nn.functional.pad(codes[start : start + m].to(torch.int32), (0, padded - m), value=0x80)
        r = torch.nn.functional.pad(flat_ref[start : start + m].float(), (0, padded - m)).view(torch.int32)
        c, r = c.view(-1, block), r.view(-1, block)
        rpos = (r > 0) & (r < F32_INF_BITS)
        out = torch.where(temporal[blk].unsqueeze(1), (c != 0x80) & ~rpos, c > limit[blk].unsqueeze(1))
        return out.view(-1)[:m]

    chunk = chunk_elements(block, CHUNK_ELEMENTS)
    starts = range(0, n, chunk)
    flags = [wrong(s, min(chunk, n - s)).any() for s in starts]
    # One read back to the host when all is well; the culprit is located only on failure.
    if not flags or not bool(torch.stack(flags).any()):
        return None
    first = next(s for s, f in zip(starts, flags) if bool(f))
    i = first + int(wrong(first, min(chunk, n - first)).nonzero()[0, 0])
    return f"element {i} has code {int(codes[i])}, which no encoder writes there"
