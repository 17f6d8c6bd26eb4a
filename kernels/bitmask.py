"""Bitmask encode and decode (the sparse codec): a mask of the non-zero elements and their
values, compacted in order.

The spec is ``tw_triton.ops.reference.bitmask``. The kernels move bit patterns only (the
launchers view every float tensor as the integer of its width), so ``-0.0`` and NaN
payloads pass through unchanged and no float operation is involved. Compacting needs each
tile's place in the values buffer, so both directions run in two passes over tiles of
``TILE`` elements:

* encode: (1) per tile, the packed mask bytes and the count of non-zero elements;
  exclusive cumulative sum of the counts (torch, on the device); (2) per tile, each
  non-zero element's rank inside the tile (``tl.cumsum``) plus the tile's start gives its
  place in ``values``;
* decode: (1) per tile, the popcount of its mask bytes; the cumulative sum; (2) per tile,
  the same ranks, now to gather from ``values``.

Whole tiles run unmasked, the partial last tile as one masked program; offsets are int64.
Every store into ``values`` and load from it is bounded by its length, so a mask that holds
more set bits than there are values cannot reach outside the buffer.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

TILE = 4096
NUM_WARPS = 8
_BIT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


@triton.jit
def load_tile(x_ptr, tile, n, MASKED: tl.constexpr, TILE: tl.constexpr):
    """Tile ``tile`` of the integer view at ``x_ptr`` (0 past ``n``) and its non-zero
    elements as an int32 0/1 vector: what both encode passes read (the grouped ones too)."""
    offs = tile * TILE + tl.arange(0, TILE)
    if MASKED:
        v = tl.load(x_ptr + offs, mask=offs < n, other=0)
    else:
        v = tl.load(x_ptr + offs)
    return v, (v != 0).to(tl.int32)


@triton.jit
def mask_tile(x_ptr, mask_ptr, tile, n, MASKED: tl.constexpr, TILE: tl.constexpr):
    """Pass 1's tile body: the mask bytes of tile ``tile`` stored (bit ``i`` of byte ``j``:
    element ``8 j + i`` is non-zero); returns its non-zero vector (:func:`load_tile`)."""
    _, nz = load_tile(x_ptr, tile, n, MASKED, TILE)
    flags = tl.reshape(nz, (TILE // 8, 8)) << tl.arange(0, 8)[None, :]
    packed = tl.sum(flags, axis=1).to(tl.uint8)
    byte_offs = tile * (TILE // 8) + tl.arange(0, TILE // 8)
    if MASKED:
        tl.store(mask_ptr + byte_offs, packed, mask=byte_offs * 8 < n)
    else:
        tl.store(mask_ptr + byte_offs, packed)
    return nz


@triton.jit(do_not_specialize=["tile0"])
def bitmask_mask_kernel(x_ptr, mask_ptr, counts_ptr, n, tile0, MASKED: tl.constexpr, TILE: tl.constexpr):
    """Pass 1 of the encode: mask bytes and the non-zero count of tile ``tile0 + pid``."""
    tile = tile0 + tl.program_id(0).to(tl.int64)
    nz = mask_tile(x_ptr, mask_ptr, tile, n, MASKED, TILE)
    tl.store(counts_ptr + tile, tl.sum(nz, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["nnz", "tile0"])
def bitmask_scatter_kernel(
    x_ptr, starts_ptr, values_ptr, n, nnz, tile0, MASKED: tl.constexpr, TILE: tl.constexpr
):
    """Pass 2 of the encode: the non-zero elements of a tile to their places in ``values``."""
    tile = tile0 + tl.program_id(0).to(tl.int64)
    v, nz = load_tile(x_ptr, tile, n, MASKED, TILE)
    rank = tl.cumsum(nz, axis=0) - nz
    dest = tl.load(starts_ptr + tile) + rank.to(tl.int64)
    tl.store(values_ptr + dest, v, mask=(nz != 0) & (dest < nnz))


@triton.jit(do_not_specialize=["tile0"])
def bitmask_popcount_kernel(mask_ptr, counts_ptr, n, tile0, MASKED: tl.constexpr, TILE: tl.constexpr):
    """Pass 1 of the decode: the set bits of tile ``tile0 + pid`` (bits past ``n`` ignored)."""
    tile = tile0 + tl.program_id(0).to(tl.int64)
    nz = _unpack(mask_ptr, tile, n, MASKED, TILE)
    tl.store(counts_ptr + tile, tl.sum(nz, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["nnz", "tile0"])
def bitmask_gather_kernel(
    mask_ptr, starts_ptr, values_ptr, out_ptr, n, nnz, tile0, MASKED: tl.constexpr, TILE: tl.constexpr
):
    """Pass 2 of the decode: a tile of the output from its mask bits and ``values``."""
    tile = tile0 + tl.program_id(0).to(tl.int64)
    nz = _unpack(mask_ptr, tile, n, MASKED, TILE)
    rank = tl.cumsum(nz, axis=0) - nz
    src = tl.load(starts_ptr + tile) + rank.to(tl.int64)
    v = tl.load(values_ptr + src, mask=(nz != 0) & (src < nnz), other=0)
    offs = tile * TILE + tl.arange(0, TILE)
    if MASKED:
        tl.store(out_ptr + offs, v, mask=offs < n)
    else:
        tl.store(out_ptr + offs, v)


@triton.jit
def _unpack(mask_ptr, tile, n, MASKED: tl.constexpr, TILE: tl.constexpr):
    """The tile's mask bits as an int32 0/1 vector of ``TILE`` elements (0 past ``n``)."""
    byte_offs = tile * (TILE // 8) + tl.arange(0, TILE // 8)
    if MASKED:
        packed = tl.load(mask_ptr + byte_offs, mask=byte_offs * 8 < n, other=0)
    else:
        packed = tl.load(mask_ptr + byte_offs)
    bits = (packed.to(tl.int32)[:, None] >> tl.arange(0, 8)[None, :]) & 1
    nz = tl.reshape(bits, (TILE,))
    if MASKED:
        offs = tile * TILE + tl.arange(0, TILE)
        nz = tl.where(offs < n, nz, 0)
    return nz


def launch_tiles(kernel, pointers: tuple, n: int, *scalars: int, device: torch.device) -> None:
    """``kernel`` over the whole tiles of ``n`` elements (unmasked), then the partial one."""
    full = n // TILE
    meta = dict(TILE=TILE, num_warps=NUM_WARPS)
    # Triton launches on the current device: make it the tensors' device.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        if full:
            kernel[(full,)](*pointers, n, *scalars, 0, MASKED=False, **meta)
        if full * TILE < n:
            kernel[(1,)](*pointers, n, *scalars, full, MASKED=True, **meta)


def _starts(counts: torch.Tensor) -> torch.Tensor:
    # Exclusive prefix sum: where each tile's elements begin in ``values``.
    return torch.cumsum(counts, 0) - counts


def _bits(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype not in _BIT_VIEW or not t.is_contiguous():
        raise QuantizationError(
            f"{what} must be a contiguous float32, float16 or bfloat16 tensor, got {t.dtype}"
            f"{'' if t.is_contiguous() else ' (not contiguous)'}"
        )
    return t.view(_BIT_VIEW[t.dtype]).view(-1)


def bitmask_encode(x: torch.Tensor, nnz: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and non-zero values of a contiguous tensor; the torch path's contract.

    ``nnz`` (the count of non-zero elements) sizes ``values``; without it the launcher reads
    the counts back (a host sync).

    Raises:
        QuantizationError: an input the kernels cannot read as a flat contiguous tensor.
    """
    flat = _bits(x, "bitmask_encode: x")
    n = flat.numel()
    ntiles = -(-n // TILE)
    mask = torch.empty((n + 7) // 8, dtype=torch.uint8, device=x.device)
    counts = torch.empty(ntiles, dtype=torch.int64, device=x.device)  # pass 1 writes every tile
    if n:
        launch_tiles(bitmask_mask_kernel, (flat, mask, counts), n, device=x.device)
    if nnz is None:
        nnz = int(counts.sum())
    values = torch.empty(nnz, dtype=x.dtype, device=x.device)
    if n and nnz:
        starts = _starts(counts)
        launch_tiles(bitmask_scatter_kernel, (flat, starts, values.view(flat.dtype)), n, nnz, device=x.device)
    return mask, values


def mask_popcount(mask: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[set bits among the first n, 1 if a bit past n is set else 0]`` of a mask of
    ``ceil(n / 8)`` bytes (``tw_triton.ops.mask_popcount``'s contract).

    Raises:
        QuantizationError: a mask of the wrong dtype or size.
    """
    if mask.dtype != torch.uint8 or mask.numel() != (n + 7) // 8 or not mask.is_contiguous():
        raise QuantizationError(
            f"mask_popcount: mask must be {(n + 7) // 8} contiguous uint8 bytes, got {mask.numel()} of {mask.dtype}"
        )
    flat = mask.view(-1)
    counts = torch.empty(-(-n // TILE), dtype=torch.int64, device=mask.device)  # every tile written
    if n:
        launch_tiles(bitmask_popcount_kernel, (flat, counts), n, device=mask.device)
    tail = n % 8
    if tail:
        padded = (flat[-1:].to(torch.int32) >> tail) != 0
    else:
        padded = torch.zeros(1, dtype=torch.bool, device=mask.device)
    return torch.cat([counts.sum().view(1), padded.to(torch.int64)])


def bitmask_decode(mask: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """The flat tensor of ``n`` elements that ``(mask, values)`` encode.

    Raises:
        QuantizationError: buffers of the wrong dtype or size.
    """
    vals = _bits(values, "bitmask_decode: values")
    if mask.dtype != torch.uint8 or mask.numel() != (n + 7) // 8 or not mask.is_contiguous():
        raise QuantizationError(
            f"bitmask_decode: mask must be {(n + 7) // 8} contiguous uint8 bytes, "
            f"got {mask.numel()} of {mask.dtype}"
        )
    out = torch.empty(n, dtype=values.dtype, device=mask.device)
    if n:
        counts = torch.empty(-(-n // TILE), dtype=torch.int64, device=mask.device)  # every tile written
        launch_tiles(bitmask_popcount_kernel, (mask, counts), n, device=mask.device)
        starts = _starts(counts)
        pointers = (mask, starts, vals, out.view(vals.dtype))
        launch_tiles(bitmask_gather_kernel, pointers, n, vals.numel(), device=mask.device)
    return out
