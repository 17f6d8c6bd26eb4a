"""The shapes every packed-code op shares: supported widths and blocks, sizes of buffers.

Code widths (``bits``), block sizes, the largest code magnitude and the byte and block
counts of a tensor, checked once here for the ops, their backends and the codecs. The
layout itself (LSB-first packing, one scale or bound pair per block) is specified in
docs/codecs.md.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import QuantizationError

SUPPORTED_BITS = (8, 4, 2)
MIN_BLOCK = 32
MAX_BLOCK = 4096
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
        raise QuantizationError(
            f"qmax must be an int from 1 to {qmax_for(bits)} for {bits} bits, got {qmax!r}"
        )
    return qmax


def check_qmaxes(bits: int, qmax: Any, count: int) -> list[int]:
    """A grouped op's ``qmax`` (one for all ``count`` tensors, ``None`` included, or a
    sequence of one per tensor) as one checked :func:`check_qmax` per tensor.

    Raises:
        QuantizationError: a value :func:`check_qmax` refuses, or not one per tensor.
    """
    if qmax is None or isinstance(qmax, int):
        return [check_qmax(bits, qmax)] * count
    each = list(qmax)
    if len(each) != count:
        raise QuantizationError(f"qmax must be one value or one per tensor ({count}), got {len(each)}")
    return [check_qmax(bits, q) for q in each]


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


def blockwise_buffers(numel: int, bits: int, block: int) -> list[tuple[str, int, torch.dtype]]:
    """``(name, elements, dtype)`` of a blockwise encoding's buffers: codes, scales."""
    return [
        ("codes", packed_nbytes(numel, bits), torch.uint8),
        ("scales", num_blocks(numel, block), torch.float32),
    ]


def log2_buffers(numel: int, bits: int, block: int) -> list[tuple[str, int, torch.dtype]]:
    """``(name, elements, dtype)`` of a log2 encoding's buffers: codes, lo, hi."""
    nblocks = num_blocks(numel, block)
    return [
        ("codes", packed_nbytes(numel, bits), torch.uint8),
        ("lo", nblocks, torch.int32),
        ("hi", nblocks, torch.int32),
    ]
