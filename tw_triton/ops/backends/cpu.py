"""The "cpu" backend of the codec ops: the compiled codec where it takes the tensors, else
the plain-torch reference.

The reference serves without the built library, with ``TW_TRITON_NATIVE=0``, for float16, a
non-contiguous tensor or another device: slower then, never different (docs/codecs.md).
"""

from __future__ import annotations

import torch

from ..layout import blockwise_buffers, check_qmax, log2_buffers
from ..reference import (
    delta_statistics_torch,
    dequantize_blockwise_torch,
    dequantize_log2_temporal_torch,
    dequantize_log2_torch,
    log2_temporal_code_errors_torch,
    quantize_blockwise_torch,
    quantize_log2_temporal_torch,
    quantize_log2_torch,
    sparsity_counts_torch,
    update_divide_torch,
    update_multiply_torch,
    update_root_torch,
)
from ..reference.buffers import decode_output, encode_outputs
from ..reference.log2_temporal import temporal_buffers
from . import native_update
from .native import (
    count_sparsity,
    decode_blockwise,
    decode_log2,
    delta_statistics_native,
    encode_blockwise,
    encode_log2,
    range_slices,
)
from .native_temporal import check_log2_temporal, decode_log2_temporal, encode_log2_temporal

DEVICE_TYPE = "cpu"


def quantize_blockwise_cpu(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU encode: the compiled codec where it takes the tensors, else
    :func:`~tw_triton.ops.reference.quantize_blockwise_torch`. Same signature, same bytes."""
    n = x.numel()
    dev = x.device
    out, (codes, scales) = encode_outputs(out, dev, blockwise_buffers(n, bits, block))
    flat = x.reshape(-1) if x.is_contiguous() else x
    ref = reference.reshape(-1) if reference is not None and reference.is_contiguous() else reference
    if encode_blockwise(flat, ref, bits, block, check_qmax(bits, qmax), codes, scales):
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
    :func:`~tw_triton.ops.reference.dequantize_blockwise_torch` (which also finishes any
    blocks the compiled one leaves, see :func:`decode_blockwise`). Same signature, same
    values; ``out`` may be ``reference`` itself."""
    out, flat_out = decode_output(out, numel, dtype, codes.device)
    ref = reference.reshape(-1) if reference is not None and reference.is_contiguous() else reference
    left = decode_blockwise(codes, scales, numel, bits, block, ref, flat_out)
    if left is None:
        return dequantize_blockwise_torch(codes, scales, numel, bits, block, reference, dtype, out=out)
    for start, stop in left:
        code_bytes, blocks = range_slices(start, stop, bits, block)
        dequantize_blockwise_torch(
            codes[code_bytes],
            scales[blocks],
            stop - start,
            bits,
            block,
            None if ref is None else ref[start:stop],
            dtype,
            out=flat_out[start:stop],
        )
    return out


def quantize_log2_cpu(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """The CPU encode: the compiled codec where it takes the tensor, else
    :func:`~tw_triton.ops.reference.quantize_log2_torch`. Same signature, same bytes."""
    out, (codes, lo, hi) = encode_outputs(out, x.device, log2_buffers(x.numel(), bits, block))
    if encode_log2(x.reshape(-1) if x.is_contiguous() else x, bits, block, codes, lo, hi):
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
    :func:`~tw_triton.ops.reference.dequantize_log2_torch` (which also finishes any blocks
    the compiled one leaves). Same signature, same values."""
    out, flat_out = decode_output(out, numel, dtype, codes.device)
    left = decode_log2(codes, lo, hi, numel, bits, block, flat_out)
    if left is None:
        return dequantize_log2_torch(codes, lo, hi, numel, bits, block, dtype, out=out)
    for start, stop in left:
        code_bytes, blocks = range_slices(start, stop, bits, block)
        dequantize_log2_torch(
            codes[code_bytes],
            lo[blocks],
            hi[blocks],
            stop - start,
            bits,
            block,
            dtype,
            out=flat_out[start:stop],
        )
    return out


def quantize_log2_temporal_cpu(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The CPU encode: the compiled codec where it takes the tensors, else
    :func:`~tw_triton.ops.reference.quantize_log2_temporal_torch`. Same signature, same bytes."""
    out, (codes, lo, hi) = encode_outputs(out, x.device, temporal_buffers(x.numel(), block))
    flat = x.reshape(-1) if x.is_contiguous() else x
    ref = reference.reshape(-1) if reference.is_contiguous() else reference
    if encode_log2_temporal(flat, ref, bits, block, min_step, codes, lo, hi):
        return out
    return quantize_log2_temporal_torch(x, reference, bits, block, min_step, out=out)


def dequantize_log2_temporal_cpu(
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
    """The CPU decode: the compiled codec where it takes the tensors, else
    :func:`~tw_triton.ops.reference.dequantize_log2_temporal_torch` (which also finishes any
    blocks the compiled one leaves). Same signature, same values; ``out`` may be
    ``reference`` itself."""
    out, flat_out = decode_output(out, numel, torch.float32, codes.device)
    ref = reference.reshape(-1) if reference.is_contiguous() else reference
    left = decode_log2_temporal(codes, lo, hi, ref, numel, bits, block, min_step, flat_out)
    if left is None:
        return dequantize_log2_temporal_torch(codes, lo, hi, reference, numel, bits, block, min_step, out=out)
    for start, stop in left:
        code_bytes, blocks = range_slices(start, stop, 8, block)
        dequantize_log2_temporal_torch(
            codes[code_bytes],
            lo[blocks],
            hi[blocks],
            ref[start:stop],
            stop - start,
            bits,
            block,
            min_step,
            out=flat_out[start:stop],
        )
    return out


def log2_temporal_code_errors_cpu(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> str | None:
    """The check in C where it takes the tensors; the message (and any tensors it does not
    take) from :func:`~tw_triton.ops.reference.log2_temporal_code_errors_torch`."""
    ref = reference.reshape(-1) if reference.is_contiguous() else reference
    if check_log2_temporal(codes, lo, hi, ref, bits, block):
        return None
    return log2_temporal_code_errors_torch(codes, lo, hi, reference, bits, block)


def sparsity_counts_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The counts in C where it takes ``x``, else
    :func:`~tw_triton.ops.reference.sparsity_counts_torch`."""
    counts = count_sparsity(x)
    return sparsity_counts_torch(x) if counts is None else counts


def update_root_cpu(v: torch.Tensor, eps: float) -> torch.Tensor:
    """The root in C where it takes ``v`` (contiguous fp32), else
    :func:`~tw_triton.ops.reference.update_root_torch`."""
    got = native_update.update_root_native(v, eps)
    return update_root_torch(v, eps) if got is None else got


def update_divide_cpu(x: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """The update in C where it takes ``x`` and ``v`` (contiguous fp32), else the spec."""
    got = native_update.update_divide_native(x, v, eps)
    return update_divide_torch(x, v, eps) if got is None else got


def update_multiply_cpu(u: torch.Tensor, v: torch.Tensor, eps: float, big: float) -> torch.Tensor:
    """The decoded moment in C, in place, where it takes ``u`` and ``v``, else the spec."""
    if native_update.update_multiply_native(u, v, eps, big):
        return u
    return update_multiply_torch(u, v, eps, big)


def delta_statistics_cpu(x: torch.Tensor, reference: torch.Tensor | None, block: int) -> list[torch.Tensor]:
    """The statistics in C where it takes the tensors and their values stay finite, else
    :func:`~tw_triton.ops.reference.delta_statistics_torch`."""
    got = delta_statistics_native(x, reference, block)
    if got is None:
        return delta_statistics_torch(x, reference, block)
    return [torch.tensor(v, dtype=torch.int64) for v in got]


def delta_statistics_many_cpu(
    xs: list[torch.Tensor], references: list[torch.Tensor | None] | None, block: int, *, out: torch.Tensor
) -> torch.Tensor:
    """:func:`delta_statistics_cpu` of each tensor (in C where it takes them), written into
    ``out`` once."""
    values = []
    for i, x in enumerate(xs):
        ref = None if references is None else references[i]
        got = delta_statistics_native(x, ref, block) if x.numel() else [0, 0, 0, 0]
        if got is None:
            got = [int(v) for v in delta_statistics_torch(x, ref, block)]
        values += got
    out[: len(values)].copy_(torch.tensor(values, dtype=torch.int64))
    return out


# The ops this backend serves on DEVICE_TYPE (registered by tw_triton.ops).
BACKEND = {
    "quantize_blockwise": quantize_blockwise_cpu,
    "dequantize_blockwise": dequantize_blockwise_cpu,
    "quantize_log2": quantize_log2_cpu,
    "dequantize_log2": dequantize_log2_cpu,
    "quantize_log2_temporal": quantize_log2_temporal_cpu,
    "dequantize_log2_temporal": dequantize_log2_temporal_cpu,
    "log2_temporal_code_errors": log2_temporal_code_errors_cpu,
    "sparsity_counts": sparsity_counts_cpu,
    "delta_statistics": delta_statistics_cpu,
    "update_root": update_root_cpu,
    "update_divide": update_divide_cpu,
    "update_multiply": update_multiply_cpu,
    "delta_statistics_many": delta_statistics_many_cpu,
}


__all__ = [
    "BACKEND",
    "DEVICE_TYPE",
    "delta_statistics_cpu",
    "update_divide_cpu",
    "update_multiply_cpu",
    "update_root_cpu",
    "delta_statistics_many_cpu",
    "dequantize_blockwise_cpu",
    "dequantize_log2_cpu",
    "log2_temporal_code_errors_cpu",
    "sparsity_counts_cpu",
    "dequantize_log2_temporal_cpu",
    "quantize_blockwise_cpu",
    "quantize_log2_cpu",
    "quantize_log2_temporal_cpu",
]
