"""The statistics of the weight-delta bits choice in plain torch: the specification of
``delta_statistics`` (what :mod:`tw_triton.delta_bits` reads to choose a tensor's bits).

Every quantity is exact on every device: the maxima are fp32 values, and the sums are of
integers small enough that fp32 and float64 add them exactly in any order.
"""

from __future__ import annotations

import torch

BLOCK_LEVELS, ELEMENT_LEVELS = 4096.0, 256.0
_GROUP = 256
_CHUNK = 1 << 28


def _square_sum(q: torch.Tensor, group: int) -> torch.Tensor:
    """``sum(q**2)`` of integers held in fp32 whose squares, summed ``group`` at a time, stay
    below ``2**24``: those fp32 partial sums are exact in any order, and so are float64 sums of
    at most ``2**28`` of them; returned as an int64 0-dim tensor."""
    pad = (-q.numel()) % group
    q = torch.nn.functional.pad(q, (0, pad)) if pad else q
    partial = q.square_().view(-1, group).sum(dim=1)
    parts = [c.sum(dtype=torch.float64).to(torch.int64) for c in partial.split(_CHUNK)]
    return parts[0] if len(parts) == 1 else torch.stack(parts).sum()


def _levels(v: torch.Tensor, top: torch.Tensor, scale: float) -> torch.Tensor:
    """``floor(v * (scale / top))``: one correctly rounded quotient, then fp32 products, which
    are exact IEEE operations on every device; in place."""
    return v.mul_(scale / top.clamp_min(torch.finfo(torch.float32).tiny)).floor_()


def delta_statistics_torch(x: torch.Tensor, ref: torch.Tensor | None, block: int) -> list[torch.Tensor]:
    """The four exact 0-dim int64 device scalars of ``x`` (delta from ``ref``) that
    :func:`tw_triton.delta_bits.error_bound` takes: the fp32 bits of ``A`` and ``B``, and the two integer sums."""
    xf = x.detach().reshape(-1).float()
    d = xf.abs() if ref is None else torch.sub(xf, ref.detach().reshape(-1).float()).abs_()
    pad = (-d.numel()) % block
    if pad:
        d = torch.nn.functional.pad(d, (0, pad))
    s = d.view(-1, block).amax(dim=1)
    del d
    a = s.amax()
    xa = xf.abs()
    b = xa.amax()
    # Block maxima at 12 bits, one at a time (4096**2 < 2**24); elements at 8 bits, 256 at a time.
    qs = _square_sum(_levels(s, a, BLOCK_LEVELS), 1)
    qx = _square_sum(_levels(xa, b, ELEMENT_LEVELS), _GROUP)
    return [a.view(torch.int32).long(), b.view(torch.int32).long(), qs, qx]


def delta_statistics_many_torch(
    xs: list[torch.Tensor], references: list[torch.Tensor | None] | None, block: int, *, out: torch.Tensor
) -> torch.Tensor:
    """:func:`delta_statistics_torch` of each of ``xs`` (minus ``references[i]``, where
    given) into ``out[4i : 4i + 4]`` (int64, zero-filled by the caller; an empty tensor's
    stay zero). Returns ``out``."""
    for i, x in enumerate(xs):
        if x.numel():
            ref = None if references is None else references[i]
            out[4 * i : 4 * i + 4].copy_(torch.stack(delta_statistics_torch(x, ref, block)))
    return out


__all__ = ["BLOCK_LEVELS", "ELEMENT_LEVELS", "delta_statistics_many_torch", "delta_statistics_torch"]
