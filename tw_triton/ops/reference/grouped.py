"""The grouped ops' reference: one tensor at a time.

:func:`quantize_blockwise_many_torch`, :func:`quantize_blockwise_update_many_torch`,
:func:`quantize_log2_many_torch` and
:func:`quantize_log2_temporal_many_torch` (and the decodes
:func:`dequantize_blockwise_many_torch`, :func:`dequantize_log2_temporal_many_torch`,
:func:`dequantize_log2_many_torch`, :func:`dequantize_blockwise_update_many_torch`) are
the single-tensor ops applied to each tensor (their bytes are the spec), with each tensor's
flag raised in the caller's buffer;
:func:`fingerprints_torch` is :func:`fingerprint_torch` of each tensor. The Triton backend
does each in a fixed number of launches (docs/design.md, "Launches and syncs per save").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import check_qmaxes
from .update_root import update_multiply_torch, update_root_torch

# Elements sampled by a fingerprint.
FINGERPRINT_SAMPLES = 2048


def quantize_blockwise_many_torch(
    xs: list[torch.Tensor],
    references: list[torch.Tensor] | None,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | Sequence[int | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tw_triton.ops.quantize_blockwise` of each tensor (with its ``qmax``, where
    one is given per tensor); ``flags[i]`` (int64) is raised to 1 where tensor ``i`` has a
    block with an infinite scale (a NaN/Inf block)."""
    from .. import quantize_blockwise  # the single op, dispatched by device

    qmaxes = check_qmaxes(bits, qmax, len(xs))
    out = []
    bad = []
    for i, x in enumerate(xs):
        codes, scales = quantize_blockwise(
            x, None if references is None else references[i], bits, block, qmax=qmaxes[i]
        )
        out.append((codes, scales))
        bad.append(torch.isinf(scales).any())
    if bad:
        flags.copy_(torch.maximum(flags, torch.stack(bad).to(flags.device, torch.int64)))
    return out


def quantize_blockwise_update_many_torch(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`tw_triton.ops.quantize_blockwise` of each ``u = m / (sqrt(v) + eps)`` (fp32,
    each op rounded on its own); ``flags[i]`` (int64) is raised to 1 where tensor ``i`` has
    a block with an infinite scale or an infinite ``sqrt(v) + eps``."""
    from .. import quantize_blockwise  # the single op, dispatched by device

    out = []
    bad = []
    for m, v in zip(ms, vs):
        den = update_root_torch(v, eps)
        codes, scales = quantize_blockwise(m.float() / den, None, bits, block, qmax=qmax)
        out.append((codes, scales))
        bad.append(torch.isinf(scales).any() | torch.isinf(den).any())
    if bad:
        flags.copy_(torch.maximum(flags, torch.stack(bad).to(flags.device, torch.int64)))
    return out


def quantize_log2_many_torch(
    xs: list[torch.Tensor], bits: int, block: int, *, flags: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`tw_triton.ops.quantize_log2` of each tensor; ``flags[i]`` (int64) is raised
    to 1 where tensor ``i`` has a block with bounds ``-1`` (a negative, NaN or Inf)."""
    from .. import quantize_log2  # the single op, dispatched by device

    out = [quantize_log2(x, bits, block) for x in xs]
    if out:
        bad = torch.stack([(hi < 0).any() for _, _, hi in out]).to(flags.device, torch.int64)
        flags.copy_(torch.maximum(flags, bad))
    return out


def quantize_log2_temporal_many_torch(
    xs: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    *,
    flags: torch.Tensor,
    out: list[tuple[torch.Tensor, ...]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """:func:`tw_triton.ops.quantize_log2_temporal` of each tensor against its reference
    (into ``out[i]`` when given); ``flags[i]`` (int64) is raised to 1 where tensor ``i``
    has a block with bounds ``-1`` (a negative, NaN or Inf)."""
    from .. import quantize_log2_temporal  # the single op, dispatched by device

    results = []
    for i, (x, r) in enumerate(zip(xs, references)):
        dst = None if out is None else out[i]
        got = quantize_log2_temporal(x, r, bits, block, min_step, out=dst)
        if dst is not None:
            for view, t in zip(dst, got):
                if t.data_ptr() != view.data_ptr():  # a backend that allocates its own
                    view.copy_(t)
            got = dst
        results.append(got)
    if results:
        bad = torch.stack([(hi < 0).any() for _, _, hi in results]).to(flags.device, torch.int64)
        flags.copy_(torch.maximum(flags, bad))
    return results


def dequantize_blockwise_many_torch(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    bits: int,
    block: int,
    references: list[torch.Tensor] | None,
    dtype: torch.dtype,
    *,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:func:`tw_triton.ops.dequantize_blockwise` of each tensor (flat results), into
    ``out[i]`` where given (it may be ``references[i]``: the single op reads each chunk
    before it writes it)."""
    from .. import dequantize_blockwise  # the single op, dispatched by device

    return [
        dequantize_blockwise(
            c,
            s,
            n,
            bits,
            block,
            None if references is None else references[i],
            dtype,
            out=None if out is None else out[i],
        )
        for i, (c, s, n) in enumerate(zip(codes, scales, numels))
    ]


def dequantize_blockwise_update_many_torch(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The blockwise-update decode of each tensor (flat results): the fp32
    :func:`tw_triton.ops.dequantize_blockwise` of its codes times ``sqrt(v) + eps`` (fp32,
    each op rounded on its own), saturated to ``dtype``'s finite range, then cast."""
    from .. import dequantize_blockwise  # the single op, dispatched by device

    big = torch.finfo(dtype).max
    out = []
    for c, s, n, v in zip(codes, scales, numels, vs):
        u = dequantize_blockwise(c, s, n, bits, block, None, torch.float32)
        out.append(update_multiply_torch(u, v.reshape(-1), eps, big).to(dtype))
    return out


def dequantize_log2_many_torch(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    numels: list[int],
    bits: int,
    block: int,
    dtype: torch.dtype,
    *,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:func:`tw_triton.ops.dequantize_log2` of each tensor (flat results), into ``out[i]``
    where given."""
    from .. import dequantize_log2  # the single op, dispatched by device

    return [
        dequantize_log2(c, a, b, n, bits, block, dtype, out=None if out is None else out[i])
        for i, (c, a, b, n) in enumerate(zip(codes, lo, hi, numels))
    ]


def dequantize_log2_temporal_many_torch(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    *,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """:func:`tw_triton.ops.dequantize_log2_temporal` of each tensor (flat results), into
    ``out[i]`` where given (it may be ``references[i]``)."""
    from .. import dequantize_log2_temporal  # the single op, dispatched by device

    return [
        dequantize_log2_temporal(
            c,
            lo[i],
            hi[i],
            references[i],
            c.numel(),
            bits,
            block,
            min_step,
            out=None if out is None else out[i],
        )
        for i, c in enumerate(codes)
    ]


def copy_many_torch(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A contiguous copy of each tensor (the exact entries of a save)."""
    return [x.detach().clone(memory_format=torch.contiguous_format) for x in xs]


def fingerprint_torch(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 on ``t``'s device: position-weighted sum of sampled fp32 bit patterns.

    Integer arithmetic only (no overflow: |bits| < 2**31, weights <= 2048, 2048 terms), so
    every device gives the same value.
    """
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    sample = flat[::step][:FINGERPRINT_SAMPLES].to(torch.float32)
    bits = sample.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return (bits * weights).sum() + flat.numel()


def fingerprints_torch(ts: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """Write :func:`fingerprint_torch` of each of ``ts`` to ``out`` (int64, one per tensor)."""
    if ts:
        out.copy_(torch.stack([fingerprint_torch(t).to(out.device) for t in ts]))
    return out
