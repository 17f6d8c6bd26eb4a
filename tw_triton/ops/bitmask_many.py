"""The grouped bitmask encode, declared apart from :mod:`tw_triton.ops` (which re-exports
it) to keep that module small: the sparse candidates a device save stores by the
``bitmask`` codec, encoded in a number of launches that does not grow with their count
(docs/design.md, "Launches and syncs per save")."""

from __future__ import annotations

import torch

from .registry import lookup


def bitmask_encode_many(
    xs: list[torch.Tensor],
    nnzs: list[int],
    *,
    out: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~tw_triton.ops.bitmask_encode` of many tensors on one device.

    Args:
        xs: float32, float16 or bfloat16 tensors on one device, any shapes and strides.
        nnzs: each tensor's count of non-zero bit patterns (read back with the save's
            choice), which sizes its ``values``: nothing is read back here.
        out: optional ``(mask, values)`` per tensor to write into (honoured on the CPU).

    Returns:
        ``(mask, values)`` per tensor, the bytes :func:`~tw_triton.ops.bitmask_encode` gives
        it alone. On CUDA two table copies, at most four launches and a scan of two torch
        ops per element width, whatever the number of tensors.
    """
    if not xs:
        return []
    return lookup("bitmask_encode_many", xs[0].device.type)(xs, list(nnzs), out=out)


__all__ = ["bitmask_encode_many"]
