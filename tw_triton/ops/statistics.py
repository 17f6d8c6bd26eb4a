"""The statistics ops: what a save reads back to decide how to code a tensor, without a
host sync of their own.

:func:`sparsity_counts` (the bitmask codec's choice) and :func:`delta_statistics` (the
weight-delta bits of a rule with ``max_error``, :mod:`tw_triton.delta_bits`), one tensor at
a time, and their grouped forms :func:`sparsity_counts_many` and
:func:`delta_statistics_many`, which a device save issues in a number of launches that
does not grow with its number of tensors (docs/design.md, "Launches and syncs per save").
Declared here, re-exported by :mod:`tw_triton.ops`; dispatched by :func:`~.registry.lookup`.
"""

from __future__ import annotations

import torch

from .registry import lookup


def delta_statistics(x: torch.Tensor, reference: torch.Tensor | None, block: int) -> list[torch.Tensor]:
    """The four exact int64 0-dim scalars on ``x``'s device from which
    :mod:`tw_triton.delta_bits` bounds the error of coding ``x`` (minus ``reference``) at
    each width: the fp32 bits of the largest block maximum of ``|x - reference|`` and of
    the largest ``|x|``, and two integer sums of squared levels. No host sync."""
    return lookup("delta_statistics", x.device.type)(x, reference, block)


def sparsity_counts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nnz, runs)`` of ``x`` (any dtype of 2, 4 or 8 bytes, any strides) in row-major
    order: the elements whose bit pattern is not zero and the runs of consecutive zero
    patterns, as 0-dim int64 tensors on ``x``'s device, without a host sync (what the
    bitmask codec's choice reads; docs/codecs.md, "The sparse codec")."""
    return lookup("sparsity_counts", x.device.type)(x)


def sparsity_counts_many(xs: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """:func:`sparsity_counts` of many tensors on one device, added to ``out`` (int64,
    ``2 * len(xs)`` elements on their device, zero-filled by the caller: a save's scalars
    buffer): ``out[2i]`` and ``out[2i + 1]`` grow by ``xs[i]``'s ``nnz`` and ``runs``. On
    CUDA a table copy and at most two launches per element width, whatever the number of
    tensors (docs/design.md, "Launches and syncs per save"); nothing is read back. Returns
    ``out``."""
    if not xs:
        return out
    return lookup("sparsity_counts_many", xs[0].device.type)(xs, out=out)


def delta_statistics_many(
    xs: list[torch.Tensor],
    references: list[torch.Tensor | None] | None,
    block: int,
    *,
    out: torch.Tensor,
) -> torch.Tensor:
    """:func:`delta_statistics` of many tensors on one device into ``out`` (int64,
    ``4 * len(xs)`` elements on their device, zero-filled by the caller): ``out[4i : 4i + 4]``
    receive ``xs[i]``'s four integers (minus ``references[i]`` where that is given; an
    empty tensor's stay zero). On CUDA a table copy and at most four launches per pair of
    dtypes, whatever the number of tensors; nothing is read back. The two sums are the
    spec's wherever the spec's are defined (a maximum whose level factor is finite: what
    :func:`tw_triton.delta_bits.error_bound` reads). Returns ``out``."""
    if not xs:
        return out
    return lookup("delta_statistics_many", xs[0].device.type)(xs, references, block, out=out)


__all__ = ["delta_statistics", "delta_statistics_many", "sparsity_counts", "sparsity_counts_many"]
