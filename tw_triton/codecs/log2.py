"""The second-moment codec ``log2``: blockwise codes of a non-negative tensor in a log domain.

AdamW's ``exp_avg_sq`` is non-negative and spans the square of the gradient's range (often
30 octaves and more inside one tensor). Linear codes round its small entries to zero or, as a
delta, below zero, and the resumed step ``m / (sqrt(v) + eps)`` then explodes. This codec
codes the *logarithm* instead, with exact zero kept apart, so that no decoded value is ever
negative and none is zero unless the input was:

* ``t = bits(fp32(v))``, the fp32 bit pattern as an int32. For a positive ``v``,
  ``t / 2**23 - 127`` is a piecewise-linear ``log2 v`` (exact at powers of two, within 0.086
  of it in between): monotone, integer, and the same on every device, with no
  transcendental function whose rounding differs between libraries;
* per block of ``block`` elements, ``lo`` and ``hi`` are the smallest and largest ``t`` of
  the block's positive values (``0, 0`` when there is none; ``-1, -1`` when the block holds
  a negative, NaN or infinite element, which cannot be coded: all its codes are then 0);
* ``step = fl32(fl32(hi - lo) / N)`` with ``N = 2**bits - 2`` steps between
  ``2**bits - 1`` levels;
* a positive element gets ``u = 1 + min(N, rne(fl32(fl32(t - lo) / step)))`` (``u = 1`` when
  ``step`` is 0); a zero (``+0`` or ``-0``) gets ``u = 0``: code 0 is reserved for exact zero;
* codes are packed LSB-first as in :mod:`tw_triton.codecs.blockwise`.

Decoding: ``u = 0`` gives ``+0``; otherwise ``t_hat = min(hi, lo + trunc(fl32(fl32(u - 1) *
step) + 0.5))`` and ``v_hat = cast(as_fp32(t_hat))``, a positive fp32 between the block's
smallest and largest positive input, hence (rounding being monotone) a positive value of the
original dtype. The error in ``t`` is at most ``step / 2`` plus a few units of fp32 rounding,
so the relative error of ``v`` is about ``2**(step / 2**24) - 1``: with 4 bits and a block
spanning 20 octaves, a factor of at most ``2**(20/28)``, about 1.64.

A negative, NaN or infinite element cannot be coded: its block gets bounds ``-1`` and the
encoder's flag (:attr:`Log2Tensor.unusable`, a device bool, no sync) turns true, and the
state-level code stores that tensor exact, as for the blockwise codec.

Every operation above is an integer operation or a correctly rounded fp32 one, so the Triton
kernels (``tw_triton.kernels.quantize_log2`` / ``dequantize_log2``) and this torch path give
the same bytes and the same decoded tensors. Stored bytes per element: ``bits / 8 + 8 /
block`` (two int32 bounds per block).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch

from ..errors import QuantizationError
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from . import native
from .base import BatchLayout, Codec, Encoded, check_param_names, host_outputs, move_to
from .blockwise import (
    FLOAT_DTYPES,
    PACKING,
    _scratch,
    decode_output,
    encode_outputs,
    batchable,
    check_packed_params,
    check_params,
    num_blocks,
    packed_nbytes,
    per_block_buffer,
    stored_codes,
)

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


@dataclass(frozen=True)
class Log2Tensor:
    """A non-negative tensor encoded by the ``log2`` codec.

    Attributes:
        codes: packed codes, ``uint8``, ``ceil(numel * bits / 8)`` bytes.
        lo, hi: int32, one per block: the smallest and largest fp32 bit pattern of the
            block's positive elements (both 0 for a block without one).
        shape, dtype: of the original tensor.
        bits, block: code width (8, 4 or 2) and elements per block.
        unusable: 0-dim bool on the codes' device, true when some element was negative,
            NaN or infinite: the tensor must then be stored exact.
    """

    codes: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    bits: int
    block: int
    unusable: torch.Tensor

    @property
    def numel(self) -> int:
        """Elements of the original tensor."""
        return math.prod(self.shape)


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise QuantizationError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise QuantizationError(f"log2 codes float32, float16 or bfloat16 tensors, got {x.dtype}")


# --------------------------------------------------------------------------------------
# The reference implementation (plain torch). The Triton launchers share these signatures.
# --------------------------------------------------------------------------------------


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


def _log2_specs(n: int, bits: int, block: int) -> list[tuple[str, int, torch.dtype]]:
    nblocks = num_blocks(n, block)
    return [("codes", packed_nbytes(n, bits), torch.uint8), ("lo", nblocks, torch.int32), ("hi", nblocks, torch.int32)]


def quantize_log2_torch(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Encode ``x`` (any shape and strides, read in row-major order): the kernel's spec.

    Per chunk of ``CHUNK_ELEMENTS``, in per-thread scratch kept between calls (see
    :func:`~tw_triton.codecs.blockwise._scratch`); a contiguous fp32 chunk of whole blocks
    is read where it lies. A min and a max per block sort the blocks: all positive and finite
    (the bounds are the min and max), all ``+0`` (bounds and codes 0), or other. Only the
    other blocks (mixed zeros, ``-0``, negative or non-finite elements: few in a second
    moment, where a zero is a whole row of an unused embedding) take the masked path, about
    6x slower per element (a tensor whose every block mixes zeros in encodes at the speed of
    the all-masked implementation this replaced, 0.09 s for 16M fp32 on one core of the
    2-core VM, against 0.016 s for the same values without the zeros).

    Args:
        out: optional ``(codes, lo, hi)`` to write into: contiguous, of the sizes below.

    Returns:
        ``(codes, lo, hi)``: ``uint8`` codes and int32 bounds per block (``-1, -1`` for a
        block with a negative, NaN or infinite element, whose codes are then all 0).
    """
    n = x.numel()
    dev = x.device
    nblocks = num_blocks(n, block)
    out, (codes, lo, hi) = encode_outputs(out, dev, _log2_specs(n, bits, block))
    if n == 0:
        return out
    flat = x.reshape(-1)
    n_steps = float(levels(bits))
    chunk = max(block, CHUNK_ELEMENTS // block * block)
    size = min(chunk, nblocks * block)
    v_buf = _scratch("log2_v", size, torch.float32, dev)
    r_buf = _scratch("log2_p", size, torch.float32, dev)
    u_buf = _scratch("log2_h", size, torch.int16, dev)
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
        # Two reductions: torch's fused aminmax over rows is ~9x slower on the CPU.
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
        # Whole numbers in [0, 2**bits - 1]: exact in int16, which fp32 converts to 3x
        # faster than to uint8.
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
    chunk = max(block, CHUNK_ELEMENTS // block * block)
    size = min(chunk, num_blocks(numel, block) * block)
    u_buf = _scratch("log2_h", size, torch.int16, dev)
    p_buf = _scratch("log2_p", size, torch.float32, dev)
    t_buf = _scratch("log2_t", size, torch.int32, dev)
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
            rows.index_copy_(0, idx, rows.index_select(0, idx).masked_fill_(u_rows.index_select(0, idx) == 0, 0))
        if not direct:
            flat_out[start : start + m].copy_(t[:m].view(torch.float32))
    return out


def quantize_log2_cpu(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """The CPU encode: the compiled codec (:mod:`~tw_triton.codecs.native`) where it takes
    the tensor, else :func:`quantize_log2_torch`. Same signature, same bytes."""
    out, (codes, lo, hi) = encode_outputs(out, x.device, _log2_specs(x.numel(), bits, block))
    if native.encode_log2(x.reshape(-1) if x.is_contiguous() else x, bits, block, codes, lo, hi):
        return out
    return quantize_log2_torch(x, bits, block, out=out)


def dequantize_log2_cpu(
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
    """The CPU decode: the compiled codec where it takes the tensors, else
    :func:`dequantize_log2_torch` (which also finishes any blocks the compiled one leaves).
    Same signature, same values."""
    out, flat_out = decode_output(out, numel, dtype, codes.device)
    left = native.decode_log2(codes, lo, hi, numel, bits, block, flat_out)
    if left is None:
        return dequantize_log2_torch(codes, lo, hi, numel, bits, block, dtype, out=out)
    for start, stop in left:
        code_bytes, blocks = native.range_slices(start, stop, bits, block)
        dequantize_log2_torch(
            codes[code_bytes], lo[blocks], hi[blocks], stop - start, bits, block, dtype, out=flat_out[start:stop]
        )
    return out


# --------------------------------------------------------------------------------------
# Public tensor-level API
# --------------------------------------------------------------------------------------


def quantize_log2(
    x: torch.Tensor, *, bits: int = 4, block: int = 128, out: tuple[torch.Tensor, ...] | None = None
) -> Log2Tensor:
    """Encode a non-negative tensor with the ``log2`` codec (see the module doc).

    On a CUDA tensor one fused Triton kernel does it; on a CPU tensor the torch path gives
    the same bytes, written into ``out`` (``(codes, lo, hi)``) when given. Nothing here
    synchronizes with the device.

    Raises:
        QuantizationError: an unsupported dtype, bits or block.
    """
    _check_input(x)
    check_params(bits, block)
    if x.device.type == "cuda":
        from ..kernels import quantize_log2 as kernel

        codes, lo, hi = kernel(x.contiguous(), bits, block)
    else:
        codes, lo, hi = quantize_log2_cpu(x, bits, block, out=out)
    # The flag stays on the device: no sync here.
    unusable = _unusable(hi)
    return Log2Tensor(codes, lo, hi, tuple(x.shape), x.dtype, bits, block, unusable)


def _unusable(hi: torch.Tensor) -> torch.Tensor:
    """The device flag of a tensor with a negative, NaN or infinite element: some block's
    bounds are ``-1``."""
    return (hi < 0).any()


def dequantize_log2(q: Log2Tensor, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Decode a :class:`Log2Tensor` to its shape and dtype, on ``device`` (default: where
    its codes are)."""
    if not isinstance(q, Log2Tensor):
        raise QuantizationError(f"expected a Log2Tensor, got {type(q).__name__}")
    dev = q.codes.device if device is None else torch.device(device)
    codes, lo, hi = (t.to(dev, non_blocking=t.is_pinned()) for t in (q.codes, q.lo, q.hi))
    if dev.type == "cuda":
        from ..kernels import dequantize_log2 as kernel

        flat = kernel(codes, lo, hi, q.numel, q.bits, q.block, q.dtype)
    else:
        flat = dequantize_log2_cpu(codes, lo, hi, q.numel, q.bits, q.block, q.dtype)
    return flat.view(q.shape)


class Log2Codec(Codec):
    """Registry entry ``log2``: the second-moment codec (no reference; see the module doc)."""

    name = "log2"
    has_kernel = True
    _KEYS = frozenset({"bits", "block", "packing"})

    def resolve_params(self, params: Mapping[str, Any], *, bits: int, block: int) -> dict[str, Any]:
        unknown = set(params) - self._KEYS
        if unknown:
            raise QuantizationError(
                f"codec 'log2' has no parameter(s) {sorted(unknown)}; it takes {sorted(self._KEYS)}"
            )
        out = {
            "bits": params.get("bits", bits),
            "block": params.get("block", block),
            "packing": params.get("packing", PACKING),
        }
        check_params(out["bits"], out["block"])
        if out["packing"] != PACKING:
            raise QuantizationError(f"codec 'log2' packs {PACKING!r} only, got {out['packing']!r}")
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def uses_reference(self, params: Mapping[str, Any]) -> bool:
        return False

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._KEYS, frozenset(), context)
        check_packed_params(params, context)

    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        return self._encoded(x, params, None)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        nblocks = num_blocks(x.numel(), params["block"])
        sizes = [(packed_nbytes(x.numel(), params["bits"]), torch.uint8), (nblocks, torch.int32), (nblocks, torch.int32)]
        return self._encoded(x, params, host_outputs(x, allocate, sizes))

    def batch_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        return x.dtype if batchable(x, params["block"], None) else None

    def batch_layout(self, params: Mapping[str, Any]) -> BatchLayout:
        # Blocks are coded alone, and each tensor is whole blocks.
        bits, block = params["bits"], params["block"]
        return BatchLayout(
            lambda n: {"codes": n * bits // 8, "lo": n // block, "hi": n // block}, lambda b: _unusable(b["hi"])
        )

    def _encoded(self, x: torch.Tensor, params: Mapping[str, Any], out: tuple[torch.Tensor, ...] | None) -> Encoded:
        q = quantize_log2(x, bits=params["bits"], block=params["block"], out=out)
        entry = EncodedEntry(
            codec=self.name,
            params={"bits": q.bits, "block": q.block, "packing": PACKING},
            shape=q.shape,
            dtype=q.dtype,
            buffers={"codes": q.codes, "lo": q.lo, "hi": q.hi},
        )
        return Encoded(entry, unusable=q.unusable)

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        self.check_stored_params(entry.params, context)
        bits, block, codes = stored_codes(entry, context)
        lo, hi = (per_block_buffer(entry, n, torch.int32, block, context) for n in ("lo", "hi"))
        shape = tuple(entry.shape)
        dev = codes.device if device is None else device
        q = Log2Tensor(
            codes=move_to(codes.reshape(-1), dev),
            lo=move_to(lo.reshape(-1), dev),
            hi=move_to(hi.reshape(-1), dev),
            shape=shape,
            dtype=entry.dtype,
            bits=bits,  # type: ignore[arg-type]
            block=block,  # type: ignore[arg-type]
            unusable=torch.zeros((), dtype=torch.bool, device=dev),
        )
        return dequantize_log2(q)


__all__ = [
    "Log2Tensor",
    "Log2Codec",
    "quantize_log2",
    "dequantize_log2",
    "quantize_log2_torch",
    "dequantize_log2_torch",
    "levels",
]
