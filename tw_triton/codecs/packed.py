"""Stored entries of the packed-code codecs (``blockwise``, ``log2``): the checks they share.

Both codecs store LSB-first packed codes of ``bits`` each with per-block values beside them;
a file's entry is checked here (params, dtype, buffer sizes) before any byte is decoded, so
that a manifest edited to say something else is refused. Layout: docs/format.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError, QuantizationError
from ..ops.layout import (
    FLOAT_DTYPES,
    MAX_BLOCK,
    MIN_BLOCK,
    SUPPORTED_BITS,
    check_params,
    num_blocks,
    packed_nbytes,
)
from ..qstate import EncodedEntry
from .base import entry_buffer, param_error

PACKING = "lsb-first"


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


def check_bits_block(params: Mapping[str, Any], context: str) -> None:
    """Stored ``bits`` and ``block``: a supported width and a power of two in range.

    Raises:
        CheckpointError: naming ``context``, the param and what was expected.
    """
    bits, block = params.get("bits"), params.get("block")
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise param_error(context, "bits", bits, f"one of {list(SUPPORTED_BITS)}")
    try:
        check_params(bits, block)
    except QuantizationError:
        raise param_error(
            context, "block", block, f"a power of two from {MIN_BLOCK} to {MAX_BLOCK}"
        ) from None


def check_packed_params(params: Mapping[str, Any], context: str) -> None:
    """The stored params every packed-code codec shares: ``bits``, ``block``, ``packing``.

    Raises:
        CheckpointError: naming ``context``, the param and what was expected.
    """
    check_bits_block(params, context)
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
