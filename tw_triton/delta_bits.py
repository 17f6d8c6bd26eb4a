"""Weight-delta bits that follow the change: per tensor, the fewest bits whose error bound fits.

A rule with ``max_error`` (``{"codec": "int2", "max_error": 0.01}``) codes each tensor it
matches with its ``bits`` only if that leaves the tensor within ``max_error`` of its value,
measured as a relative norm ``||x_hat - x|| / ||x||``; otherwise with 4, else 8 bits. The
blockwise codec's error is at most ``s / (2 * qmax)`` per element, ``s`` the block's largest
``|d|`` (``d`` the delta, or the tensor without a reference) and ``qmax`` 1, 7 or 127 for 2, 4
or 8 bits, so the bound at ``bits`` is::

    e(bits) = sqrt(block * sum_b s_b**2) / (2 * qmax(bits) * ||x||)

An optimizer whose steps are small relative to the weights (AdamW) keeps 2 bits; one with
large steps (SGD at a large learning rate, Adagrad early on) gets more, for the tensors that
moved. The entry's params record the bits chosen.

The choice must be the same on every device, or a CPU and a GPU save of one state would
differ. Sums in floating point depend on their order, so the bound is computed from exact
quantities only: the maxima ``A = max_b s_b`` and ``B = max |x|`` (fp32, exact), and the
integer sums ``sum_b floor(s_b * (4096 / A))**2`` and ``sum_i floor(|x_i| * (256 / B))**2``
(exact: every fp32 operation is correctly rounded on every device, and the sums are of
integers small enough that fp32 and float64 add them exactly in any order). All of a state's statistics
are read with one transfer per device, before its tensors are encoded.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from .ops.layout import qmax_for
from .state.fingerprints import read_device_scalars

# Candidate bits above a rule's own, in order.
WIDER_BITS = (4, 8)
_BLOCK_LEVELS, _ELEMENT_LEVELS, _GROUP = 4096.0, 256.0, 256
_CHUNK = 1 << 28


def _as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


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


def statistics(x: torch.Tensor, ref: torch.Tensor | None, block: int) -> list[torch.Tensor]:
    """The four exact 0-dim int64 device scalars of ``x`` (delta from ``ref``) that
    :func:`error_bound` takes: the fp32 bits of ``A`` and ``B``, and the two integer sums."""
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
    qs = _square_sum(_levels(s, a, _BLOCK_LEVELS), 1)
    qx = _square_sum(_levels(xa, b, _ELEMENT_LEVELS), _GROUP)
    return [a.view(torch.int32).long(), b.view(torch.int32).long(), qs, qx]


def error_bound(values: Sequence[int], block: int, bits: int) -> float:
    """The bound ``e(bits)`` (module doc) from :func:`statistics` read as ints: ``0`` for
    a zero delta, ``inf`` for a zero or non-finite tensor with a non-zero delta."""
    a, b = _as_float(values[0]), _as_float(values[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if a == 0.0:
        return 0.0
    if b == 0.0 or values[3] == 0:
        return math.inf
    delta_norm = a / _BLOCK_LEVELS * math.sqrt(block * values[2])
    return delta_norm / (2 * qmax_for(bits) * b / _ELEMENT_LEVELS * math.sqrt(values[3]))


def choose(values: Sequence[int], block: int, bits: int, max_error: float) -> int:
    """The fewest bits, from ``bits`` up through :data:`WIDER_BITS`, whose bound is at most
    ``max_error`` (the widest when none is)."""
    candidates = [bits] + [b for b in WIDER_BITS if b > bits]
    for b in candidates:
        if error_bound(values, block, b) <= max_error:
            return b
    return candidates[-1]


def adapt(jobs: list[tuple[torch.Tensor, Any, Any, torch.Tensor | None]]) -> list[tuple[Any, ...]]:
    """``jobs`` (``(tensor, rule, codec, reference)`` of one encode) with the bits of each
    rule that sets ``max_error`` chosen for its tensor; one transfer per device."""
    todo = [i for i, (x, rule, _, _) in enumerate(jobs) if rule.max_error is not None and x.numel()]
    if not todo:
        return jobs
    scalars = [s for i in todo for s in statistics(jobs[i][0], jobs[i][3], jobs[i][1].params["block"])]
    values = read_device_scalars(scalars)
    out = list(jobs)
    for k, i in enumerate(todo):
        x, rule, codec, ref = jobs[i]
        bits = choose(values[4 * k : 4 * k + 4], rule.params["block"], rule.params["bits"], rule.max_error)
        if bits != rule.params["bits"]:
            rule = type(rule)(
                rule.pattern, rule.codec, {**rule.params, "bits": bits}, rule.min_numel, rule.max_error
            )
        out[i] = (x, rule, codec, ref)
    return out
