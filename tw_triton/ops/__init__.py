"""The codec operations, each declared once and dispatched by the device of its input.

Six ops do the numeric work of the packed-code codecs (:mod:`tw_triton.codecs`):
:func:`quantize_blockwise`, :func:`dequantize_blockwise`, :func:`quantize_log2`,
:func:`dequantize_log2`, :func:`quantize_log2_temporal` and :func:`dequantize_log2_temporal`
(whose codes :func:`log2_temporal_code_errors` checks first), and the bitmask codec's choice
reads :func:`sparsity_counts` and the weight-delta bits :func:`delta_statistics`
(:mod:`~tw_triton.ops.statistics`), and the ``blockwise-update`` codec its
:func:`update_root`, :func:`update_divide` and :func:`update_multiply`; thirteen serve many device tensors with a fixed
number of launches, twelve a save:
:func:`quantize_blockwise_many`, :func:`quantize_blockwise_update_many`, :func:`quantize_log2_many`,
:func:`quantize_log2_temporal_many`, :func:`fingerprints`, :func:`copy_many`,
:func:`dequantize_blockwise_many` and :func:`dequantize_log2_temporal_many` (the
closed-loop advance, in place over the reference), :func:`dequantize_log2_many` (a
keyframe's second moments, decoded to the reference its deltas are coded against),
:func:`sparsity_counts_many` and :func:`bitmask_encode_many` (a save's sparse candidates,
:mod:`~tw_triton.ops.bitmask_many`), :func:`delta_statistics_many` (a save's weight-delta
bits), and one a load (:func:`dequantize_blockwise_update_many`: the ``blockwise-update``
entries with their partners); the grouped decodes are declared in
:mod:`~tw_triton.ops.grouped_decodes` and re-exported here. Two more
split a sparse tensor into a bitmask and its non-zero values and back
(:func:`bitmask_encode`, :func:`bitmask_decode`). Each has one reference implementation in plain torch
(:mod:`tw_triton.ops.reference`, the spec, serving any device) and backends registered per
device type: the compiled C codec for ``"cpu"`` (:mod:`~tw_triton.ops.backends.cpu`,
falling back to the reference where it does not take a tensor) and the Triton kernels for
``"cuda"`` (:mod:`~tw_triton.ops.backends.triton`, which imports triton on first use). Every
backend gives the reference's bytes and decoded values, bit for bit. The ops check no
parameters: the codecs do. Rules and layout: docs/codecs.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import registry
from .backends import cpu as cpu_backend
from .backends import triton as triton_backend
from .bitmask_many import bitmask_encode_many
from .grouped_decodes import (
    dequantize_blockwise_many,
    dequantize_blockwise_update_many,
    dequantize_log2_many,
    dequantize_log2_temporal_many,
)
from .reference import REFERENCE
from .reference.log2_temporal import check_min_step
from .registry import OPS, backends, lookup, register, using
from .statistics import delta_statistics, delta_statistics_many, sparsity_counts, sparsity_counts_many

for _op, _fn in REFERENCE.items():
    registry.register_reference(_op, _fn)
for _backend in (cpu_backend, triton_backend):
    for _op, _fn in _backend.BACKEND.items():
        register(_op, _backend.DEVICE_TYPE, _fn)


def quantize_blockwise(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``x`` (minus ``reference``) blockwise, on ``x``'s device.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape and strides (read in row-major order).
        reference: ``None`` or a float tensor of ``x``'s shape on its device.
        bits: 8, 4 or 2.
        block: a power of two from 32 to 4096.
        out: optional ``(codes, scales)`` to write into (contiguous, of the sizes below);
            honoured on the CPU, where a snapshot pool supplies them.
        qmax: largest code magnitude (default ``2**(bits-1) - 1``).

    Returns:
        ``(codes, scales)``: ``uint8`` of ``ceil(n * bits / 8)`` bytes and fp32 of
        ``ceil(n / block)`` values, on ``x``'s device.
    """
    return lookup("quantize_blockwise", x.device.type)(x, reference, bits, block, out=out, qmax=qmax)


def dequantize_blockwise(
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
    """Decode blockwise codes to a flat tensor of ``numel`` elements, on ``codes``' device.

    Args:
        codes, scales: as :func:`quantize_blockwise` returns them.
        numel, bits, block: of the encoding.
        reference: ``None`` or a tensor of ``numel`` elements on the codes' device.
        dtype: float32, float16 or bfloat16.
        out: optional contiguous output of ``numel`` elements of ``dtype``; it may be
            ``reference`` itself (the decode reads each chunk before writing it).

    Returns:
        The decoded flat tensor (``out`` when given).
    """
    return lookup("dequantize_blockwise", codes.device.type)(
        codes, scales, numel, bits, block, reference, dtype, out=out
    )


def quantize_log2(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """Encode a non-negative tensor with the log2 codec, on ``x``'s device.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape and strides.
        bits, block: code width (8, 4, 2) and elements per block.
        out: optional ``(codes, lo, hi)`` to write into (honoured on the CPU).

    Returns:
        ``(codes, lo, hi)``: ``uint8`` packed codes and int32 bounds per block (``-1, -1``
        for a block holding a negative, NaN or infinite element).
    """
    return lookup("quantize_log2", x.device.type)(x, bits, block, out=out)


def dequantize_log2(
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
    """Decode log2 codes to a flat tensor of ``numel`` elements of ``dtype``, on ``codes``'
    device (``out``, a contiguous tensor of that size and dtype, when given)."""
    return lookup("dequantize_log2", codes.device.type)(codes, lo, hi, numel, bits, block, dtype, out=out)


def quantize_blockwise_many(
    xs: list[torch.Tensor],
    references: list[torch.Tensor] | None,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | Sequence[int | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`quantize_blockwise` of many tensors on one device, in a number of kernel
    launches that does not grow with their count (on CUDA: two per pair of dtypes,
    whatever their ``qmax``).

    Args:
        xs: float tensors on one device (any shapes and strides).
        references: ``None``, or one float tensor per ``xs`` of its shape on its device.
        bits, block: as for :func:`quantize_blockwise`, shared by all.
        qmax: as for :func:`quantize_blockwise`: one for all, or one per tensor.
        flags: int64, ``len(xs)`` elements on the device, zero where nothing raised them:
            ``flags[i]`` becomes nonzero where tensor ``i`` has a NaN/Inf block (its scale
            is infinite); nothing is read back here.

    Returns:
        ``(codes, scales)`` per tensor, the bytes :func:`quantize_blockwise` gives it alone
        (on CUDA, views of one buffer per dtype pair).
    """
    if not xs:
        return []
    return lookup("quantize_blockwise_many", xs[0].device.type)(
        xs, references, bits, block, flags=flags, qmax=qmax
    )


def quantize_blockwise_update_many(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`quantize_blockwise` of each ``u = ms[i] / (sqrt(vs[i]) + eps)`` (the
    blockwise-update codec's update, each fp32 op correctly rounded, ``eps`` rounded to
    fp32), in a number of launches that does not grow with the count (on CUDA: two per
    dtype of ``ms``).

    Args:
        ms: float tensors on one device; vs: float32 tensors of their shapes there.
        eps, bits, block, qmax: shared by all.
        flags: as for :func:`quantize_blockwise_many`, raised where ``u`` has a NaN/Inf
            block or ``sqrt(vs[i]) + eps`` an infinite element.

    Returns:
        ``(codes, scales)`` per tensor.
    """
    if not ms:
        return []
    return lookup("quantize_blockwise_update_many", ms[0].device.type)(
        ms, vs, eps, bits, block, flags=flags, qmax=qmax
    )


def quantize_log2_many(
    xs: list[torch.Tensor], bits: int, block: int, *, flags: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`quantize_log2` of many tensors on one device, in a number of launches that
    does not grow with their count (on CUDA: two per dtype). ``flags`` as for
    :func:`quantize_blockwise_many`, raised where a tensor has a negative, NaN or Inf."""
    if not xs:
        return []
    return lookup("quantize_log2_many", xs[0].device.type)(xs, bits, block, flags=flags)


def fingerprints(ts: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """Fingerprints of reference tensors (:func:`~tw_triton.ops.reference.fingerprint_torch`)
    into ``out`` (int64, one per tensor, on the tensors' device), in a number of launches
    that does not grow with their count (on CUDA: one per dtype). Returns ``out``."""
    if not ts:
        return out
    return lookup("fingerprints", ts[0].device.type)(ts, out=out)


def copy_many(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A contiguous copy of each of ``xs`` (tensors of any dtypes on one device), in a
    number of launches that does not grow with their count (on CUDA: at most two)."""
    if not xs:
        return []
    return lookup("copy_many", xs[0].device.type)(xs)


def bitmask_encode(
    x: torch.Tensor, *, nnz: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``x`` into a bitmask of its non-zero elements and their values, on ``x``'s device.

    Args:
        x: float32, float16 or bfloat16 tensor, any shape and strides (row-major order).
            Zero is the all-zero bit pattern: ``-0.0`` and NaN are values.
        nnz: the count of non-zero elements (``reference.nonzero_count``), which sizes
            ``values``; without it the op counts, a host sync on a GPU.
        out: optional ``(mask, values)`` to write into (honoured on the CPU).

    Returns:
        ``(mask, values)``: ``uint8`` of ``ceil(n / 8)`` bytes, bit ``i % 8`` of byte
        ``i // 8`` set where element ``i`` is not zero; the ``nnz`` non-zero elements in
        order, in ``x``'s dtype.
    """
    return lookup("bitmask_encode", x.device.type)(x, nnz=nnz, out=out)


def bitmask_decode(
    mask: torch.Tensor, values: torch.Tensor, numel: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The flat tensor of ``numel`` elements of ``values``' dtype that ``(mask, values)``
    encode, on ``mask``'s device (``out``, contiguous of that size and dtype, when given).
    The mask must hold ``values.numel()`` set bits among its first ``numel``."""
    return lookup("bitmask_decode", mask.device.type)(mask, values, numel, out=out)


def mask_popcount(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """What a decode checks of a bitmask of ``ceil(numel / 8)`` bytes, on its device: int64
    ``[set bits among the first numel, 1 if a padding bit past numel is set else 0]``, for
    the caller to read in one transfer."""
    return lookup("mask_popcount", mask.device.type)(mask, numel)


def quantize_log2_temporal(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Encode a non-negative float32 tensor against ``reference`` (the reconstruction of the
    last save) with the temporal codec, on ``x``'s device.

    Args:
        x, reference: float32 tensors of one shape on one device.
        bits, block: the absolute codes' width (8, 4, 2) and elements per block.
        min_step: the floor of the temporal step, in fp32 bit-pattern units.
        out: optional ``(codes, lo, hi)`` to write into (honoured on the CPU).

    Returns:
        ``(codes, lo, hi)``: ``uint8``, one per element, and int32 per block (``0, 0`` for a
        temporal block, ``-1, -1`` for one holding a negative, NaN or infinite element).
    """
    check_min_step(min_step, "quantize_log2_temporal")
    return lookup("quantize_log2_temporal", x.device.type)(x, reference, bits, block, min_step, out=out)


def quantize_log2_temporal_many(
    xs: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    *,
    flags: torch.Tensor,
    out: list[tuple[torch.Tensor, ...]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`quantize_log2_temporal` of many tensors on one device, each against its
    reference, in a number of launches that does not grow with their count (on CUDA: two).

    Args:
        xs, references: float32 tensors on one device, ``references[i]`` of ``xs[i]``'s shape.
        bits, block, min_step: as for :func:`quantize_log2_temporal`, shared by all.
        flags: as for :func:`quantize_blockwise_many`, raised where a tensor has a
            negative, NaN or Inf (a block with bounds ``-1``).
        out: optional ``(codes, lo, hi)`` per tensor to write into (on CUDA written in
            place where ``hi`` follows ``lo`` and the codes are 16-byte aligned).

    Returns:
        ``(codes, lo, hi)`` per tensor (``out``'s when given), the bytes
        :func:`quantize_log2_temporal` gives it alone.
    """
    check_min_step(min_step, "quantize_log2_temporal_many")
    if not xs:
        return []
    return lookup("quantize_log2_temporal_many", xs[0].device.type)(
        xs, references, bits, block, min_step, flags=flags, out=out
    )


def dequantize_log2_temporal(
    codes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    reference: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode temporal codes against ``reference`` to a flat float32 tensor of ``numel``
    elements on ``codes``' device (``out`` when given; it may be ``reference`` itself)."""
    check_min_step(min_step, "dequantize_log2_temporal")
    return lookup("dequantize_log2_temporal", codes.device.type)(
        codes, lo, hi, reference, numel, bits, block, min_step, out=out
    )


def log2_temporal_code_errors(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> str | None:
    """Check temporal codes before a decode writes anything: ``None`` when they hold only
    what an encoder writes, else what is wrong (the first bad block or element). A decode
    in place over ``reference`` must not start from codes that fail this."""
    return lookup("log2_temporal_code_errors", codes.device.type)(codes, lo, hi, reference, bits, block)


def log2_temporal_code_flags_many(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
) -> torch.Tensor:
    """:func:`log2_temporal_code_errors` of many tensors on one device as flags: int64, one
    per tensor (1: its codes hold what no encoder writes), in a number of launches that
    does not grow with their count (on CUDA: a table copy and two) and read by nothing
    here: a grouped load reads them in one transfer, and asks
    :func:`log2_temporal_code_errors` what is wrong only where one is set."""
    if not codes:
        return torch.zeros(0, dtype=torch.int64)
    return lookup("log2_temporal_code_flags_many", codes[0].device.type)(
        codes, lo, hi, references, bits, block
    )


def update_root(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v) + eps`` in fp32 on ``v``'s device, each op correctly rounded on its own
    (the ``blockwise-update`` codec's denominator: the same bits on every device)."""
    return lookup("update_root", v.device.type)(v, eps)


def update_divide(x: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / (sqrt(v) + eps)`` in fp32 (a new tensor; ``x`` and ``v`` of one shape and
    device), each op correctly rounded: the update ``blockwise-update`` codes."""
    return lookup("update_divide", x.device.type)(x, v, eps)


def update_multiply(u: torch.Tensor, v: torch.Tensor, eps: float, big: float) -> torch.Tensor:
    """``u * (sqrt(v) + eps)`` in place on the fp32 ``u``, each op correctly rounded, then
    saturated to ``[-big, big]`` (NaN stays NaN): a decoded ``blockwise-update`` moment.
    Returns ``u``."""
    return lookup("update_multiply", u.device.type)(u, v, eps, big)


__all__ = [
    "OPS",
    "backends",
    "bitmask_decode",
    "bitmask_encode",
    "bitmask_encode_many",
    "copy_many",
    "delta_statistics",
    "delta_statistics_many",
    "dequantize_blockwise",
    "dequantize_blockwise_many",
    "dequantize_blockwise_update_many",
    "dequantize_log2",
    "dequantize_log2_many",
    "dequantize_log2_temporal",
    "dequantize_log2_temporal_many",
    "fingerprints",
    "log2_temporal_code_errors",
    "log2_temporal_code_flags_many",
    "lookup",
    "mask_popcount",
    "quantize_blockwise",
    "quantize_blockwise_many",
    "quantize_blockwise_update_many",
    "quantize_log2",
    "quantize_log2_many",
    "quantize_log2_temporal",
    "quantize_log2_temporal_many",
    "register",
    "sparsity_counts",
    "sparsity_counts_many",
    "update_divide",
    "update_multiply",
    "update_root",
    "using",
]
