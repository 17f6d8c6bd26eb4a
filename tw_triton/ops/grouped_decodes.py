"""The grouped decodes of :mod:`tw_triton.ops` (declared here, re-exported there): many
tensors of one device in a number of launches that does not grow with their count.

:func:`dequantize_blockwise_many` and :func:`dequantize_log2_temporal_many` advance a
closed-loop reference in place, :func:`dequantize_log2_many` decodes a keyframe's second
moments to the reference its deltas are coded against, and
:func:`dequantize_blockwise_update_many` decodes a load's ``blockwise-update`` entries
with their partners. Each has a torch reference that decodes one tensor at a time (the
spec, :mod:`tw_triton.ops.reference.grouped`); the Triton backend gives the same bits in a
table copy and at most two launches per group (docs/design.md, "Launches and syncs per save").
"""

from __future__ import annotations

import torch

from .registry import lookup


def dequantize_blockwise_many(
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
    """:func:`dequantize_blockwise` of many tensors on one device (flat results of
    ``dtype``), in a number of launches that does not grow with their count (on CUDA: two
    per reference dtype).

    Args:
        out: optional, per tensor ``None`` or a contiguous tensor of its ``numel`` elements
            of ``dtype`` to decode into; it may be the tensor's reference itself (each
            block's reference values are read before its outputs are written), so a
            closed-loop advance holds no second copy of its reference.

    Returns:
        The flat decoded tensors (``out[i]`` where given).
    """
    if not codes:
        return []
    return lookup("dequantize_blockwise_many", codes[0].device.type)(
        codes, scales, numels, bits, block, references, dtype, out=out
    )


def dequantize_log2_many(
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
    """:func:`dequantize_log2` of many tensors on one device (flat results of ``dtype``), in
    a number of launches that does not grow with their count (on CUDA: a table copy and two).

    Args:
        codes, lo, hi: per tensor, as :func:`quantize_log2` returns them.
        numels: each tensor's element count.
        bits, block: of the encoding, shared by all.
        dtype: of the decoded tensors.
        out: optional, per tensor ``None`` or a contiguous tensor of its ``numel`` elements
            of ``dtype`` to decode into.

    Returns:
        The flat decoded tensors (``out[i]`` where given).
    """
    if not codes:
        return []
    return lookup("dequantize_log2_many", codes[0].device.type)(
        codes, lo, hi, numels, bits, block, dtype, out=out
    )


def dequantize_log2_temporal_many(
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
    """:func:`dequantize_log2_temporal` of many tensors on one device, each over its
    reference (``numel`` is each one's code count), in a number of launches that does not
    grow with their count (on CUDA: a table copy and two). Like the single op it checks no
    codes: a caller decoding codes it did not encode itself runs
    :func:`log2_temporal_code_errors` first.

    Args:
        codes, lo, hi: per tensor, as :func:`quantize_log2_temporal` returns them.
        references: float32 tensors of the codes' sizes on their device.
        bits, block, min_step: of the encoding, shared by all.
        out: optional, per tensor ``None`` or a contiguous float32 tensor of its size to
            decode into; it may be ``references[i]`` itself.

    Returns:
        The flat decoded float32 tensors (``out[i]`` where given).
    """
    if not codes:
        return []
    return lookup("dequantize_log2_temporal_many", codes[0].device.type)(
        codes, lo, hi, references, bits, block, min_step, out=out
    )


def dequantize_blockwise_update_many(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The blockwise-update codec's decode of many tensors on one device: each
    ``u_hat * (sqrt(vs[i]) + eps)``, ``u_hat`` the fp32 :func:`dequantize_blockwise` of
    its codes (no reference), each fp32 op correctly rounded (``eps`` rounded to fp32),
    then saturated to ``dtype``'s finite range and rounded to it; in a number of launches
    that does not grow with the count (on CUDA: a table copy and two).

    Args:
        codes, scales: per tensor, as :func:`quantize_blockwise` returns them.
        numels: each tensor's element count.
        vs: float32 tensors of those sizes on the codes' device (the partners' decodes).
        eps, bits, block: of the encoding, shared by all.
        dtype: of the decoded tensors.

    Returns:
        The flat decoded tensors.
    """
    if not codes:
        return []
    return lookup("dequantize_blockwise_update_many", codes[0].device.type)(
        codes, scales, numels, vs, eps, bits, block, dtype
    )


__all__ = [
    "dequantize_blockwise_many",
    "dequantize_blockwise_update_many",
    "dequantize_log2_many",
    "dequantize_log2_temporal_many",
]
