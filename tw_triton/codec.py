"""Blockwise absmax delta codec: the tensor-level API and its plain-torch reference.

The torch functions in this module are the *specification* of the codec. The Triton
kernels in :mod:`tw_triton.kernels` implement the same signatures and must produce the same
bytes (codes and scales) and decode to the same tensors, bit for bit. See DESIGN.md,
"The codec" and "Bit-exact across devices".

Encoding of one block of ``B`` elements (flattened, row-major order):

* ``d = fp32(x) - fp32(ref)`` (or ``fp32(x)`` without a reference);
* ``absmax = max |d|``, or ``+inf`` when any ``d`` in the block is NaN or infinite;
* ``scale = absmax / qmax`` in fp32 (correctly rounded), ``qmax = 2**(bits-1) - 1``;
* ``q = clamp(rne(d / scale), -qmax, qmax)``, or ``0`` where ``scale`` is 0 or infinite;
* the stored code is ``u = q + 2**(bits-1)`` (so 0 is never used), packed LSB-first,
  ``k = 8 // bits`` codes to a byte: element ``i`` sits at bits ``(i % k) * bits``.

Decoding: ``x_hat = cast(fp32(ref) + fp32(q) * scale)``, the multiply and the add rounded
separately (never an FMA). A block whose scale is infinite decodes to NaN: such a tensor
could not be quantized, which :attr:`QuantizedTensor.nonfinite` reports without a sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import QuantizationError

SUPPORTED_BITS = (8, 4, 2)
MIN_BLOCK = 32
MAX_BLOCK = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# The torch path works on this many elements at a time, so that encoding a large tensor
# needs temporaries of a few chunks only, and each pass stays in cache.
CHUNK_ELEMENTS = 1 << 16


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
        nonfinite: a 0-dim bool tensor on the codes' device, true when some block held a
            NaN or an infinity (in ``x``, in the reference, or in their difference) and
            the tensor must therefore be stored exact. Reading it as a Python bool syncs.
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
    if bits not in SUPPORTED_BITS:
        raise QuantizationError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if (
        not isinstance(block, int)
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


def _pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (length a multiple of 8 // bits) LSB-first."""
    k = 8 // bits
    if k == 1:
        return u
    u = u.view(-1, k)
    packed = u[:, 0].clone()
    for j in range(1, k):
        packed |= u[:, j] << (j * bits)
    return packed


def _unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_codes`: one uint8 code per element."""
    k = 8 // bits
    if k == 1:
        return packed
    mask = (1 << bits) - 1
    out = torch.empty((packed.numel(), k), dtype=torch.uint8, device=packed.device)
    for j in range(k):
        torch.bitwise_and(packed >> (j * bits), mask, out=out[:, j])
    return out.view(-1)


def quantize_blockwise_torch(
    x: torch.Tensor, reference: torch.Tensor | None, bits: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode a contiguous tensor: the plain-torch reference of the encode kernel.

    Args:
        x: contiguous float32, float16 or bfloat16 tensor (any shape; read flattened).
        reference: ``None`` or a contiguous float tensor with ``x.numel()`` elements.
        bits: 8, 4 or 2.
        block: power of two from 32 to 4096.

    Returns:
        ``(codes, scales)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and fp32 of
        ``ceil(n / block)`` values, on ``x``'s device.
    """
    n = x.numel()
    qmax = float(qmax_for(bits))
    offset = float(1 << (bits - 1))
    flat = x.reshape(-1)
    ref = reference.reshape(-1) if reference is not None else None
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    scales = torch.empty(num_blocks(n, block), dtype=torch.float32, device=x.device)
    chunk = max(block, CHUNK_ELEMENTS // block * block)
    d_buf = torch.empty(chunk, dtype=torch.float32, device=x.device)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        padded = -(-m // block) * block
        d = d_buf[:padded]
        # Zero padding: it never raises the absmax and is never stored.
        if padded != m:
            d[m:].zero_()
        d[:m].copy_(flat[start : start + m])
        if ref is not None:
            # fp32 - fp32: ref is upcast exactly before the subtraction.
            d[:m].sub_(ref[start : start + m])
        rows = d.view(-1, block)
        absmax = rows.abs().amax(dim=1)
        # NaN or Inf anywhere in the block makes the block unquantizable: absmax = +inf.
        absmax.masked_fill_(~torch.isfinite(absmax), math.inf)
        scale = absmax.div_(qmax)
        b0 = start // block
        scales[b0 : b0 + padded // block] = scale
        usable = (scale > 0) & (scale < math.inf)
        q = rows.div(scale.unsqueeze(1))
        q.round_().clamp_(-qmax, qmax)
        q.masked_fill_(~usable.unsqueeze(1), 0.0)
        u = q.add_(offset).to(torch.uint8).view(-1)
        nbytes = packed_nbytes(m, bits)
        codes[start * bits // 8 : start * bits // 8 + nbytes] = _pack_codes(u, bits)[:nbytes]
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

    ``x_hat = cast(fp32(ref) + fp32(q) * scale)``: the product is rounded to fp32 before
    the add. ``reference`` is ``None`` or a contiguous tensor with ``numel`` elements.
    """
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    offset = float(1 << (bits - 1))
    ref = reference.reshape(-1) if reference is not None else None
    chunk = max(block, CHUNK_ELEMENTS // block * block)
    for start in range(0, numel, chunk):
        m = min(chunk, numel - start)
        padded = -(-m // block) * block
        byte0 = start * bits // 8
        packed = codes[byte0 : byte0 + packed_nbytes(m, bits)]
        # Pad the final partial byte/block with code `offset` (q = 0).
        need = padded * bits // 8
        if packed.numel() != need:
            full = torch.full((need,), 0, dtype=torch.uint8, device=codes.device)
            full[: packed.numel()] = packed
            packed = full
        u = _unpack_codes(packed, bits)
        v = u.to(torch.float32).sub_(offset).view(-1, block)
        b0 = start // block
        v.mul_(scales[b0 : b0 + padded // block].unsqueeze(1))
        v = v.view(-1)[:m]
        if ref is not None:
            v.add_(ref[start : start + m])
        out[start : start + m] = v
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
            read in their logical (row-major) order.
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
    xc = x.contiguous()
    rc = reference.contiguous() if reference is not None else None
    if _use_kernels(x.device):
        from .kernels import quantize_blockwise

        codes, scales = quantize_blockwise(xc, rc, bits, block)
    else:
        codes, scales = quantize_blockwise_torch(xc, rc, bits, block)
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
        from .kernels import dequantize_blockwise

        flat = dequantize_blockwise(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    else:
        flat = dequantize_blockwise_torch(q.codes, q.scales, q.numel, q.bits, q.block, rc, out_dtype)
    return flat.view(q.shape)
