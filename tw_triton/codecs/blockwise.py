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
  ``rne(fl64(d / scale))``, the same integer (proof at :func:`_round_quotients_fp64`), and at
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
import threading
from dataclasses import dataclass
from typing import Any, Hashable, Mapping

import torch

from ..errors import CheckpointError, QuantizationError
from ..qstate import EncodedEntry
from ..snapshot_pool import Allocator
from . import native
from .base import (
    BatchLayout, Codec, Encoded, check_param_names, check_ref_fp, entry_buffer, host_outputs, move_to, param_error,
)

PACKING = "lsb-first"

SUPPORTED_BITS = (8, 4, 2)
MIN_BLOCK = 32
MAX_BLOCK = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The torch path works on this many elements at a time, so that encoding a large tensor
# needs temporaries of about three fp32 chunks only (6 MiB; four at 4 bits, where the
# fp64 quotients take two). Measured on a 2-core VM on the MiniLM + AdamW state: alone,
# 2**18 runs as fast as 2**20 (decode 1.2x faster); inside a save or load, where two
# worker threads take turns at the GIL for every torch op, 2**20 was up to ~10% faster
# (noisy). Each worker keeps its scratch, which counts in a load's peak memory: 2**19
# keeps the peak of a delta load at 1.17x the state, 2**20 at 1.21x.
CHUNK_ELEMENTS = 1 << 19


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


def check_qmax(bits: int, qmax: Any) -> int:
    """``qmax`` checked for the container ``bits`` (``None``: the container's full range).

    Fewer levels than the container holds (``qmax=3`` in 4 bits: seven levels, "int3")
    cost the same raw bytes, but the entropy stage stores them in about their entropy.

    Raises:
        QuantizationError: not an int from 1 to :func:`qmax_for` ``(bits)``.
    """
    if qmax is None:
        return qmax_for(bits)
    if isinstance(qmax, bool) or not isinstance(qmax, int) or not 1 <= qmax <= qmax_for(bits):
        raise QuantizationError(f"qmax must be an int from 1 to {qmax_for(bits)} for {bits} bits, got {qmax!r}")
    return qmax


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


# Scratch buffers of the torch path, one set per thread, kept between calls.
_SCRATCH = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized 1-D ``dtype`` buffer of ``numel`` elements, reused across calls.

    Why: a chunk's temporaries are megabytes, and glibc serves blocks that large with new
    ``mmap()`` pages, which fault in on first touch and are unmapped again on free. On a
    2-core VM (benchmarks/codec.py) faulting 16 MiB costs about as much as encoding 64 MiB,
    so each call paid that again. The buffers stay per thread (the writer thread and the
    training loop may run the codec at once; a thread's set goes when the thread ends),
    at most six of them, about 10 MiB at the default chunk. Other devices allocate.
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    nbytes = numel * dtype.itemsize
    buf = bufs.get(name)
    if buf is None or buf.numel() < nbytes:
        buf = bufs[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype)


def batchable(x: torch.Tensor, block: int, reference: torch.Tensor | None) -> bool:
    """Whether the torch path may encode ``x`` as part of a concatenation of tensors: a
    contiguous host tensor of whole blocks (so no block spans two tensors, and its codes
    end on a byte), with a contiguous reference on the same device if any."""
    return (
        x.device.type == "cpu"
        and x.is_contiguous()
        and x.numel() > 0
        and x.numel() % block == 0
        and (reference is None or (reference.device == x.device and reference.is_contiguous()))
    )


def release_scratch() -> None:
    """Free the calling thread's scratch buffers of the torch path (they come back on use)."""
    _SCRATCH.__dict__.pop("bufs", None)


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


def _pack_codes(u: torch.Tensor, bits: int, out: torch.Tensor, words: torch.Tensor) -> None:
    """Join ``u`` (one code per byte, a multiple of 4 bytes, aligned) into ``out``, LSB-first.

    Whole words at a time instead of strided byte views (strided byte ops ran 8x slower
    than contiguous ones here): at 4 bits an int16 ``b0 | b1 << 8`` becomes ``b0 | b1 << 4``
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


# 0xF0F0 and 0xC0C0C0C0 as signed integers: the top bits of each byte of a word.
_HI_NIBBLES16 = -3856
_HI_CRUMBS32 = -1061109568


def crumb_table(device: torch.device) -> torch.Tensor:
    """For 2-bit codes: 256 int32 words, word ``b`` holding the four int8 ``q`` of a packed
    byte ``b`` (field ``j``, bits ``2j..2j+1``, minus the offset 2) as its bytes in order."""
    fields = torch.arange(256, dtype=torch.int32, device=device).unsqueeze(1) >> torch.arange(
        0, 8, 2, dtype=torch.int32, device=device)
    return ((fields & 3) - 2).to(torch.int8).contiguous().view(torch.int32).view(-1)


def _signed_codes(
    packed: torch.Tensor, bits: int, x: torch.Tensor, w: torch.Tensor, t: torch.Tensor,
    e: torch.Tensor | None, crumbs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The codes of ``packed`` as int8 ``q``, one per element (``len(packed) * 8 // bits``).

    8 and 4 bits: XOR with the offset in every field turns ``u = q + 2**(bits-1)`` into
    ``q`` in two's complement of ``bits`` bits. Each field is then moved to the top of its
    own byte of a wider word (contiguous int16 ops; no strided byte views) and an
    arithmetic shift right of the int8 bytes sign-extends it. 2 bits with ``crumbs``
    (:func:`crumb_table` on ``packed``'s device): one lookup of each byte's four codes, a
    gather of 4-byte words (4x faster here than the nine word ops below, which serve
    without a table; at 4 bits a table of 2-byte words was slower than the shifts).
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


def _checked_out(
    t: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor:
    """``t`` flattened, if it is a contiguous ``dtype`` tensor of ``numel`` elements on
    ``device``; else :class:`QuantizationError`."""
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype != dtype
        or t.numel() != numel
        or t.device != device
        or not t.is_contiguous()
    ):
        got = f"{t.dtype} x {t.numel()} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise QuantizationError(
            f"{name} must be a contiguous {dtype} tensor of {numel} elements on {device}, got {got}"
            + ("" if not isinstance(t, torch.Tensor) or t.is_contiguous() else " (not contiguous)")
        )
    return t.view(-1)


def encode_outputs(
    out: tuple[torch.Tensor, ...] | None, device: torch.device, specs: list[tuple[str, int, torch.dtype]]
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    """An encoder's outputs: ``out`` checked against ``specs`` (name, elements, dtype; see
    :func:`_checked_out`), or new tensors of those sizes; with their flat views."""
    if out is None:
        out = tuple(torch.empty(n, dtype=dtype, device=device) for _, n, dtype in specs)
    return out, [_checked_out(t, n, dtype, device, name) for t, (name, n, dtype) in zip(out, specs)]


def decode_output(
    out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder's output: ``out`` checked to hold ``numel`` elements of ``dtype`` on
    ``device`` (see :func:`_checked_out`), or a new tensor; with its flat view."""
    if out is None:
        out = torch.empty(numel, dtype=dtype, device=device)
    return out, _checked_out(out, numel, dtype, device, "out")


def _blockwise_specs(n: int, bits: int, block: int) -> list[tuple[str, int, torch.dtype]]:
    return [("codes", packed_nbytes(n, bits), torch.uint8), ("scales", num_blocks(n, block), torch.float32)]


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
    buffers kept between calls (:func:`_scratch`), so the temporaries are a few chunks
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
    out, (codes, scales) = encode_outputs(out, dev, _blockwise_specs(n, bits, block))
    if n == 0:
        return out
    qmax = float(check_qmax(bits, qmax))
    bias = 1 << (bits - 1)
    # Contiguous tensors are sliced as flat views; strided ones go through _copy_flat_range.
    flat = x.view(-1) if x.is_contiguous() else None
    ref = reference
    if ref is not None and ref.is_contiguous():
        ref = ref.view(-1)
    chunk = _chunk_elements(block)
    size = min(chunk, num_blocks(n, block) * block)
    d_buf = _scratch("a", size, torch.float32, dev)
    t_buf = _scratch("b", size, torch.float32, dev)
    low = torch.empty(size // block, dtype=torch.float32, device=dev)
    wide = _scratch("wide", size, torch.float64, dev) if bits != 2 else None
    u_buf = _scratch("u", size, torch.uint8, dev) if bits != 8 else None
    words = _scratch("w", size, torch.uint8, dev) if bits != 8 else None
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
                _copy_flat_range(x, start, d[:m])
            else:
                # The delta is one fp32 subtraction of exact upcasts. Mixed-dtype torch ops
                # take a slow scalar path (fp16 - bf16 into fp32: 20x a copy), so every
                # operand is made fp32 first.
                if ref.dtype == torch.float32 and ref.dim() == 1:
                    rs = ref[start : start + m]
                else:
                    rs = t_buf[:m]
                    _copy_flat_range(ref, start, rs)
                if flat is not None and x.dtype == torch.float32:
                    torch.sub(flat[start : start + m], rs, out=d[:m])
                else:
                    _copy_flat_range(x, start, d[:m])
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
            _pack_codes(u, bits, dst, words)
    return out


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
    ops (:func:`_signed_codes`), one conversion to fp32, one multiply by the scales (for
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
    chunk = _chunk_elements(block)
    size = min(chunk, num_blocks(numel, block) * block)
    v_buf = _scratch("a", size, torch.float32, dev)
    r_buf = _scratch("b", size, torch.float32, dev) if ref is not None else None
    x_buf = _scratch("u", size // k, torch.uint8, dev)
    w_buf = _scratch("w", size, torch.uint8, dev) if k > 1 else None
    t_buf = _scratch("t", size, torch.uint8, dev) if k > 1 else None
    crumbs = crumb_table(dev) if k == 4 else None  # 2 bits: a lookup, no third scratch
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        nb = num_blocks(m, block)
        padded = nb * block
        nbytes = packed_nbytes(m, bits)
        byte0 = start * bits // 8
        q = _signed_codes(codes[byte0 : byte0 + nbytes], bits, x_buf, w_buf, t_buf, None, crumbs)
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
            _copy_flat_range(ref, start, rs)
        vm = v[:m]
        vm.add_(rs)
        if dtype == torch.float32:
            torch.clamp(vm, -out_max, out_max, out=dst)
        else:
            vm.clamp_(-out_max, out_max)
            dst.copy_(vm)
    return out


def quantize_blockwise_cpu(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU encode: the compiled codec (:mod:`~tw_triton.codecs.native`) where it takes
    the tensors, else :func:`quantize_blockwise_torch`. Same signature, same bytes."""
    n = x.numel()
    dev = x.device
    out, (codes, scales) = encode_outputs(out, dev, _blockwise_specs(n, bits, block))
    flat = x.reshape(-1) if x.is_contiguous() else x
    ref = reference.reshape(-1) if reference is not None and reference.is_contiguous() else reference
    if native.encode_blockwise(flat, ref, bits, block, check_qmax(bits, qmax), codes, scales):
        return out
    return quantize_blockwise_torch(x, reference, bits, block, out=out, qmax=qmax)


def dequantize_blockwise_cpu(
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
    """The CPU decode: the compiled codec where it takes the tensors, else
    :func:`dequantize_blockwise_torch` (which also finishes any blocks the compiled one
    leaves, see :func:`~tw_triton.codecs.native.decode_blockwise`). Same signature, same
    values; ``out`` may be ``reference`` itself."""
    out, flat_out = decode_output(out, numel, dtype, codes.device)
    ref = reference.reshape(-1) if reference is not None and reference.is_contiguous() else reference
    left = native.decode_blockwise(codes, scales, numel, bits, block, ref, flat_out)
    if left is None:
        return dequantize_blockwise_torch(codes, scales, numel, bits, block, reference, dtype, out=out)
    for start, stop in left:
        code_bytes, blocks = native.range_slices(start, stop, bits, block)
        dequantize_blockwise_torch(
            codes[code_bytes], scales[blocks], stop - start, bits, block,
            None if ref is None else ref[start:stop], dtype, out=flat_out[start:stop],
        )
    return out


# --------------------------------------------------------------------------------------
# Public tensor-level API
# --------------------------------------------------------------------------------------


def _nonfinite(scales: torch.Tensor) -> torch.Tensor:
    """The device flag of blocks that held NaN or Inf: their scale is infinite."""
    return torch.isinf(scales).any()


def _use_kernels(device: torch.device) -> bool:
    return device.type == "cuda"


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = 128,
    reference: torch.Tensor | None = None,
    qmax: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        qmax: largest code magnitude, default ``2**(bits-1) - 1``; fewer levels in the same
            container (``bits=4, qmax=3``) decode the same way (:func:`check_qmax`).
        out: ``(codes, scales)`` to write into, for a CPU ``x`` (see
            :func:`quantize_blockwise_torch`); the kernels allocate their own.

    Returns:
        A :class:`QuantizedTensor` on ``x``'s device.

    Raises:
        QuantizationError: unsupported dtype, bits or block, or a mismatched reference.
    """
    _check_input(x, reference)
    check_params(bits, block)
    qmax = check_qmax(bits, qmax)
    if _use_kernels(x.device):
        from ..kernels import quantize_blockwise

        rc = reference.contiguous() if reference is not None else None
        codes, scales = quantize_blockwise(x.contiguous(), rc, bits, block, qmax)
    else:
        # The torch path reads strided tensors chunk by chunk: no full-size copy.
        codes, scales = quantize_blockwise_cpu(x, reference, bits, block, qmax=qmax, out=out)
    # A block is unquantizable exactly when its scale is infinite (NaN/Inf in it). A block
    # whose qmax * scale overflows fp32 is not: the decode saturates the product, and x is
    # finite, so that only moves the value towards x. The flag stays on the device.
    nonfinite = _nonfinite(scales)
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
        flat = dequantize_blockwise_cpu(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    return flat.view(q.shape)


def stored_codes(entry: EncodedEntry, context: str) -> tuple[int, int, torch.Tensor]:
    """``(bits, block, codes)`` of a stored entry of a packed-code codec, checked.

    Checks what every codec with LSB-first packed codes shares: ``bits`` and ``block``,
    the packing, a float dtype, and a ``codes`` buffer of the right size.

    Raises:
        CheckpointError: naming ``context`` and what was expected.
    """
    params = entry.params
    check_packed_params(params, context)
    bits, block = params["bits"], params["block"]
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


def check_packed_params(params: Mapping[str, Any], context: str) -> None:
    """The stored params every packed-code codec shares: ``bits``, ``block``, ``packing``.

    Raises:
        CheckpointError: naming ``context``, the param and what was expected.
    """
    bits, block = params.get("bits"), params.get("block")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise param_error(context, "bits", bits, f"one of {list(SUPPORTED_BITS)}")
    try:
        check_params(bits, block)
    except QuantizationError:
        raise param_error(context, "block", block, f"a power of two from {MIN_BLOCK} to {MAX_BLOCK}") from None
    if params.get("packing") != PACKING or not isinstance(params.get("packing"), str):
        raise param_error(context, "packing", params.get("packing"), repr(PACKING))


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
    _KEYS = frozenset({"bits", "block", "packing", "delta", "qmax"})
    # The params a file records: ``qmax`` only where it narrows the container, ``ref_fp``
    # (the state API's fingerprint of the reference) only on a delta.
    _STORED = frozenset({"bits", "block", "packing", "delta"})
    _STORED_OPTIONAL = frozenset({"qmax", "ref_fp"})

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
        if params.get("qmax") is not None and check_qmax(out["bits"], params["qmax"]) != qmax_for(out["bits"]):
            out["qmax"] = params["qmax"]  # recorded only when it narrows the container
        return out

    def accepts(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in FLOAT_DTYPES and tensor.numel() > 0

    def encode(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Encoded:
        return self._encoded(x, params, reference, None)

    def encode_with(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        allocate: Allocator,
    ) -> Encoded:
        n = x.numel()
        out = host_outputs(
            x, allocate, [(packed_nbytes(n, params["bits"]), torch.uint8), (num_blocks(n, params["block"]), torch.float32)]
        )
        return self._encoded(x, params, reference, out)  # type: ignore[arg-type]

    def batch_key(
        self, x: torch.Tensor, params: Mapping[str, Any], reference: torch.Tensor | None
    ) -> Hashable | None:
        if not batchable(x, params["block"], reference):
            return None
        return (x.dtype, None if reference is None else reference.dtype)

    def batch_layout(self, params: Mapping[str, Any]) -> BatchLayout:
        # Blocks never span two tensors (each is whole blocks): every block's scale and
        # codes are what the tensor alone gives, at an offset.
        bits, block = params["bits"], params["block"]
        return BatchLayout(lambda n: {"codes": n * bits // 8, "scales": n // block}, lambda b: _nonfinite(b["scales"]))

    def _encoded(
        self,
        x: torch.Tensor,
        params: Mapping[str, Any],
        reference: torch.Tensor | None,
        out: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Encoded:
        q = quantize(
            x, bits=params["bits"], block=params["block"], reference=reference, qmax=params.get("qmax"), out=out
        )
        stored = {
            "bits": q.bits,
            "block": q.block,
            "packing": PACKING,
            "delta": reference is not None,
        }
        if "qmax" in params:
            stored["qmax"] = params["qmax"]
        entry = EncodedEntry(
            codec=self.name,
            params=stored,
            shape=q.shape,
            dtype=q.dtype,
            buffers={"codes": q.codes, "scales": q.scales},
        )
        return Encoded(entry, unusable=q.nonfinite)

    def check_stored_params(self, params: Mapping[str, Any], context: str) -> None:
        check_param_names(params, self.name, self._STORED, self._STORED_OPTIONAL, context)
        check_packed_params(params, context)
        if not isinstance(params["delta"], bool):
            raise param_error(context, "delta", params["delta"], "true or false")
        if "qmax" in params:
            # The decode does not need it, but a value the encoder cannot have written
            # means the manifest is not what was written.
            try:
                check_qmax(params["bits"], params["qmax"])
            except QuantizationError:
                raise param_error(
                    context, "qmax", params["qmax"], f"an int from 1 to {qmax_for(params['bits'])}"
                ) from None
        check_ref_fp(params, context)

    def _stored(self, entry: EncodedEntry, context: str) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """``(bits, block, codes, scales)`` of a stored entry, checked."""
        self.check_stored_params(entry.params, context)
        bits, block, codes = stored_codes(entry, context)
        scales = per_block_buffer(entry, "scales", torch.float32, block, context)
        return bits, block, codes, scales

    def decode(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor | None,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        bits, block, codes, scales = self._stored(entry, context)
        delta = self.uses_reference(entry.params)
        if delta and reference is None:
            raise CheckpointError(f"{context}: delta entry decoded without its reference tensor")
        dev = codes.device if device is None else device
        q = QuantizedTensor(
            codes=move_to(codes.reshape(-1), dev),
            scales=move_to(scales.reshape(-1), dev),
            shape=tuple(entry.shape),
            dtype=entry.dtype,
            bits=bits,  # type: ignore[arg-type]
            block=block,  # type: ignore[arg-type]
            nonfinite=torch.zeros((), dtype=torch.bool, device=dev),
        )
        ref = move_to(reference, dev) if reference is not None else None
        return dequantize(q, reference=ref if delta else None)

    def decode_over(
        self,
        entry: EncodedEntry,
        reference: torch.Tensor,
        device: torch.device | None,
        context: str,
    ) -> torch.Tensor:
        """Decode a delta into ``reference`` itself, where the torch path can (see
        :func:`dequantize_blockwise_torch`'s ``out``): a contiguous host tensor of the
        entry's dtype and shape. Anything else (a device, another dtype) allocates."""
        dev = reference.device if device is None else device
        if (
            not self.uses_reference(entry.params)
            or dev.type != "cpu"
            or reference.device != dev
            or reference.dtype != entry.dtype
            or tuple(reference.shape) != tuple(entry.shape)
            or not reference.is_contiguous()
        ):
            return self.decode(entry, reference, device, context)
        bits, block, codes, scales = self._stored(entry, context)
        dequantize_blockwise_cpu(
            move_to(codes.reshape(-1), dev), move_to(scales.reshape(-1), dev), reference.numel(), bits,
            block, reference, entry.dtype, out=reference,
        )
        return reference
