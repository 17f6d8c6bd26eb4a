"""The bitmask ops in plain torch: the specification of the sparse codec's layout.

A tensor of ``n`` elements becomes

* ``mask``: ``ceil(n / 8)`` bytes, bit ``i % 8`` of byte ``i // 8`` (LSB first) set where
  element ``i`` (row-major order) is not zero, the padding bits of the last byte clear;
* ``values``: the elements whose bit is set, in order, in the tensor's dtype.

"Zero" is the all-zero bit pattern only: ``-0.0`` and every NaN are values, so a decode
gives back every bit of the input. Both ops work through :data:`CHUNK_ELEMENTS` elements at
a time, so their temporaries stay a few MiB whatever the tensor size.
"""

from __future__ import annotations

import torch

from ...errors import QuantizationError
from .buffers import CHUNK_ELEMENTS, copy_flat_range

# The integer dtype of each element width: the ops compare and move bit patterns only.
_BIT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WEIGHTS = [1 << j for j in range(8)]


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the signed integer dtype of its width (same storage)."""
    return t.view(_BIT_VIEW[t.element_size()])


def mask_nbytes(numel: int) -> int:
    """Bytes of the mask of ``numel`` elements."""
    return (numel + 7) // 8


# Elements per step of :func:`sparsity_counts_torch`: its temporaries stay a few MiB (on a
# GPU too, at save time, where a whole-tensor mask of a large embedding could run out).
COUNT_CHUNK = 1 << 22


def sparsity_counts_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nnz, runs)`` of ``x`` in row-major order: the number of elements whose bit
    pattern is not zero and the number of runs of consecutive zeros, as 0-dim int64 tensors
    on ``x``'s device (no host sync)."""
    flat = bit_view(x).reshape(-1)
    n = flat.numel()
    nnz = torch.zeros((), dtype=torch.int64, device=x.device)
    runs = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, n, COUNT_CHUNK):
        stop = min(n, start + COUNT_CHUNK)
        first = max(start - 1, 0)  # the element before the chunk: does a run start at ``start``?
        zero = flat[first:stop] == 0
        nnz += (stop - start) - zero[start - first :].sum()
        if start == 0:
            runs += zero[:1].sum()
        runs += (zero[1:] & ~zero[:-1]).sum()
    return nnz, runs


def sparsity_counts_many_torch(xs: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """Add each tensor's :func:`tw_triton.ops.sparsity_counts` (the single op, dispatched by
    device) to ``out`` (int64, ``2 * len(xs)`` elements): ``out[2i] += nnz``,
    ``out[2i + 1] += runs`` of ``xs[i]``. Returns ``out``."""
    from .. import sparsity_counts  # the single op, dispatched by device

    if xs:
        counts = [c.to(out.device) for x in xs for c in sparsity_counts(x)]
        out.add_(torch.stack(counts))
    return out


def nonzero_count(x: torch.Tensor) -> torch.Tensor:
    """The number of elements of ``x`` whose bit pattern is not zero: a 0-dim int64 tensor
    on ``x``'s device (one reduction, no host sync)."""
    return torch.count_nonzero(bit_view(x))


def _chunks(n: int):
    # Whole mask bytes per chunk, so that chunks never share a byte.
    step = CHUNK_ELEMENTS - CHUNK_ELEMENTS % 8
    for start in range(0, n, step):
        yield start, min(n, start + step)


def pack_mask(nz: torch.Tensor) -> torch.Tensor:
    """Bool flags to LSB-first bytes (the last byte padded with clear bits)."""
    pad = (-nz.numel()) % 8
    if pad:
        nz = torch.cat([nz, nz.new_zeros(pad)])
    weights = torch.tensor(_WEIGHTS, dtype=torch.uint8, device=nz.device)
    return (nz.view(-1, 8).to(torch.uint8) * weights).sum(1, dtype=torch.uint8)


def unpack_mask(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """LSB-first bytes to ``numel`` bool flags (padding bits dropped)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return ((mask.view(-1, 1) >> shifts) & 1).view(-1)[:numel].bool()


def bitmask_encode_torch(
    x: torch.Tensor, *, nnz: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` into its mask and its non-zero values (see the module doc).

    Args:
        x: a tensor of any dtype with an integer of its width, any shape and strides.
        nnz: the number of non-zero elements, if known (:func:`nonzero_count`); counted
            otherwise.
        out: optional ``(mask, values)`` to write into (contiguous, of the sizes below).

    Returns:
        ``(mask, values)``: ``uint8`` of ``ceil(n / 8)`` bytes and ``nnz`` elements of
        ``x``'s dtype, on ``x``'s device.

    Raises:
        QuantizationError: ``nnz`` or ``out`` do not fit ``x``.
    """
    n = x.numel()
    if nnz is None:
        nnz = int(nonzero_count(x))
    if out is None:
        out = (
            torch.empty(mask_nbytes(n), dtype=torch.uint8, device=x.device),
            torch.empty(nnz, dtype=x.dtype, device=x.device),
        )
    mask, values = out
    if mask.numel() != mask_nbytes(n) or values.numel() != nnz or values.dtype != x.dtype:
        raise QuantizationError(
            f"bitmask_encode: outputs of {mask.numel()} mask bytes and {values.numel()} {values.dtype} "
            f"values do not fit {n} elements of {x.dtype} with {nnz} non-zero"
        )
    flat_mask, flat_values = mask.view(-1), bit_view(values.view(-1))
    chunk = None
    filled = 0
    for start, stop in _chunks(n):
        if x.is_contiguous():
            part = bit_view(x.reshape(-1)[start:stop])
        else:
            if chunk is None:
                chunk = torch.empty(stop - start, dtype=x.dtype, device=x.device)
            part = chunk[: stop - start]
            copy_flat_range(x, start, part)
            part = bit_view(part)
        nz = part != 0
        flat_mask[start // 8 : mask_nbytes(stop)] = pack_mask(nz)
        kept = part[nz]
        if filled + kept.numel() > nnz:
            raise QuantizationError(f"bitmask_encode: more than nnz={nnz} non-zero elements")
        flat_values[filled : filled + kept.numel()] = kept
        filled += kept.numel()
    if filled != nnz:
        raise QuantizationError(f"bitmask_encode: {filled} non-zero elements, nnz={nnz} was given")
    return mask, values


def bitmask_encode_many_torch(
    xs: list[torch.Tensor],
    nnzs: list[int],
    *,
    out: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tw_triton.ops.bitmask_encode` (the single op, dispatched by device) of each of
    ``xs`` with its count ``nnzs[i]``, into ``out[i]`` where given: the spec of the grouped
    encode, whose bytes are those of one call per tensor."""
    from .. import bitmask_encode  # the single op, dispatched by device

    outs = out if out is not None else [None] * len(xs)
    return [bitmask_encode(x, nnz=nnz, out=o) for x, nnz, o in zip(xs, nnzs, outs)]


# Set bits of each byte value.
_POPCOUNT = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int64)


def mask_popcount_torch(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """``[set bits among the first numel, 1 if a padding bit past numel is set else 0]``
    (int64, on ``mask``'s device) of a mask of ``ceil(numel / 8)`` bytes."""
    flat = mask.reshape(-1)
    table = _POPCOUNT.to(flat.device)
    count = (torch.bincount(flat, minlength=256) * table).sum()
    tail = numel % 8
    if tail and flat.numel():
        padding = table[flat[-1].to(torch.int64) >> tail]
    else:
        padding = torch.zeros((), dtype=torch.int64, device=flat.device)
    return torch.stack([count - padding, (padding != 0).to(torch.int64)])


def bitmask_decode_torch(
    mask: torch.Tensor, values: torch.Tensor, numel: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Scatter ``values`` back to the set bits of ``mask``: a flat tensor of ``numel``
    elements of ``values``' dtype, zero (all bits clear) elsewhere.

    The mask must hold ``values.numel()`` set bits among its first ``numel`` (the codec
    checks it); ``out``, if given, is a contiguous tensor of that size and dtype.
    """
    if out is None:
        out = torch.empty(numel, dtype=values.dtype, device=values.device)
    flat_out, flat_values, flat_mask = bit_view(out.view(-1)), bit_view(values.view(-1)), mask.view(-1)
    taken = 0
    for start, stop in _chunks(numel):
        nz = unpack_mask(flat_mask[start // 8 : mask_nbytes(stop)], stop - start)
        part = flat_out[start:stop]
        part.zero_()
        count = int(nz.sum())
        part[nz] = flat_values[taken : taken + count]
        taken += count
    return out
