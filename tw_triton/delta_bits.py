"""Weight-delta codes that follow the change: per tensor, the fewest levels whose error bound fits.

A rule with ``max_error`` (``{"codec": "int2", "max_error": 0.01}``) codes each tensor it
matches with the smallest largest code ``qmax`` (codes ``-qmax .. qmax``), from its
``bits``' own (``2**(bits-1) - 1``: 1 at 2 bits) up to 127, that leaves the tensor within
``max_error`` of its value, measured as a relative norm ``||x_hat - x|| / ||x||``. The
blockwise codec's error is at most ``s / (2 * qmax)`` per element, ``s`` the block's largest
``|d|`` (``d`` the delta, or the tensor without a reference), so the bound at ``qmax`` is::

    e(qmax) = sqrt(block * sum_b s_b**2) / (2 * qmax * ||x||)

The codes go into the narrowest container that holds them (:func:`container`): ``qmax`` 1
in 2 bits, 2 to 7 in 4, 8 to 127 in 8. The entropy stage stores a container's unused
levels in about their entropy, and a tensor's stored bytes grow with ``qmax``, so the
smallest that fits is also the smallest file; every integer is a choice
(:data:`QMAX_CHOICES`; measurements against coarser ladders: docs/codecs.md). The encode
kernels take ``qmax`` as a value (the grouped one from its table, a column per tensor), so
no ``qmax`` compiles or launches anything its container's full range does not. An
optimizer whose steps are small relative to the weights (AdamW) keeps 2 bits; one with
large steps (SGD at a large learning rate, Adagrad early on) gets more levels, for the
tensors that moved. The entry's params record the container's ``bits`` and, where it
narrows it, ``qmax``.

The choice must be the same on every device, or a CPU and a GPU save of one state would
differ. Sums in floating point depend on their order, so the bound is computed from exact
quantities only: the maxima ``A = max_b s_b`` and ``B = max |x|`` (fp32, exact), and the
integer sums ``sum_b floor(s_b * (4096 / A))**2`` and ``sum_i floor(|x_i| * (256 / B))**2``
(exact: every fp32 operation is correctly rounded on every device, and the sums are of
integers small enough that fp32 and float64 add them exactly in any order); the bound at
each ``qmax`` is then the same float64 arithmetic on the host, whatever device computed
them. All of a state's statistics
are read with one transfer per device, before its tensors are encoded (the bits decide the
encode's launches and buffer sizes, so this read cannot join the save's one after it). On
a device whose launches are grouped the statistics are one grouped op per block size
(:func:`~tw_triton.ops.delta_statistics_many`), so their launches do not grow with the
number of tensors either.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import ops
from .ops.layout import SUPPORTED_BITS, qmax_for
from .ops.reference.delta_statistics import BLOCK_LEVELS, ELEMENT_LEVELS
from .parallel import parallel_map
from .state.fingerprints import read_device_scalars

# Code containers above a rule's own bits, in order (a width between two is coded with
# fewer levels in the wider: :func:`container`).
WIDER_BITS = (4, 8)
# The widest code: a tensor no narrower width fits gets it (the 8-bit container's full range).
WIDEST = 8
# The largest codes a max_error choice may take: every one from 1 to 127 (why not a
# coarser ladder: docs/codecs.md).
QMAX_CHOICES = tuple(range(1, qmax_for(WIDEST) + 1))
# Maxima below this make the statistics' ``scale / max`` overflow fp32 (from about 1e-35):
# such a tensor or delta gets the widest bits, whatever its sums.
TINY = 2.0**-100


def _as_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def container(qmax: int) -> int:
    """The codec's ``bits`` that hold codes up to ``qmax``: the narrowest of 2, 4 and 8."""
    return min(b for b in SUPPORTED_BITS if qmax_for(b) >= qmax)


def coded_params(params: dict[str, Any], qmax: int) -> dict[str, Any]:
    """A blockwise rule's ``params`` coding with codes up to ``qmax``: its container's
    ``bits`` and, where ``qmax`` narrows the container, ``qmax``."""
    out = {k: v for k, v in params.items() if k != "qmax"}
    out["bits"] = container(qmax)
    if qmax != qmax_for(out["bits"]):
        out["qmax"] = qmax
    return out


def error_bound(values: Sequence[int], block: int, bits: int, qmax: int | None = None) -> float:
    """The bound ``e`` (module doc) at ``bits`` with codes up to ``qmax`` (default: the
    container's full range) from :func:`tw_triton.ops.delta_statistics` read as ints:
    ``0`` for a zero delta; ``inf`` for a non-finite tensor or delta, and for a non-zero
    delta where either maximum is below :data:`TINY` (there the statistics' level scale
    overflows fp32, so their sums say nothing: the widest code)."""
    a, b = _as_float(values[0]), _as_float(values[1])
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    if a == 0.0:
        return 0.0
    if a < TINY or b < TINY or values[3] <= 0:
        return math.inf
    q = qmax_for(bits) if qmax is None else qmax
    delta_norm = a / BLOCK_LEVELS * math.sqrt(block * values[2])
    return delta_norm / (2 * q * b / ELEMENT_LEVELS * math.sqrt(values[3]))


def choose(
    values: Sequence[int], block: int, bits: int, max_error: float, choices: Sequence[int] | None = None
) -> tuple[int, int]:
    """``(bits, qmax)``: the smallest largest code ``qmax`` of ``choices`` (ascending;
    default :data:`QMAX_CHOICES`), from the rule's ``qmax_for(bits)`` up, whose bound is at
    most ``max_error`` (127 when none is), in the narrowest container that holds it
    (:func:`container`)."""
    for q in QMAX_CHOICES if choices is None else choices:
        if q >= qmax_for(bits) and error_bound(values, block, bits, q) <= max_error:
            return container(q), q
    return WIDEST, qmax_for(WIDEST)


def adapt(
    jobs: list[tuple[torch.Tensor, Any, Any, torch.Tensor | None]],
    grouped: Callable[[torch.device], bool] = lambda device: False,
) -> list[tuple[Any, ...]]:
    """``jobs`` (``(tensor, rule, codec, reference)`` of one encode) with the bits of each
    rule that sets ``max_error`` chosen for its tensor; one transfer per device. Tensors on
    a device where ``grouped`` (a save's ``groups_launches``) have their statistics
    computed by :func:`tw_triton.ops.delta_statistics_many`, in launches that do not grow
    with their number."""
    todo = [i for i, (x, rule, _, _) in enumerate(jobs) if rule.max_error is not None and x.numel()]
    if not todo:
        return jobs
    alone = [i for i in todo if not grouped(jobs[i][0].device)]
    buffers, slots = _grouped_statistics(jobs, [i for i in todo if grouped(jobs[i][0].device)])

    def stats(i: int) -> list[torch.Tensor]:
        return ops.delta_statistics(jobs[i][0], jobs[i][3], jobs[i][1].params["block"])

    # On the host the tensors' statistics are computed on worker threads, as encodes are;
    # on a device they are kernels queued in order.
    on_host = all(jobs[i][0].device.type == "cpu" for i in alone)
    per_job = parallel_map(
        stats, alone, sizes=[jobs[i][0].nbytes for i in alone], threads=None if on_host else 1
    )
    scalars = [s for got in per_job for s in got] + [s for i in slots for s in slots[i]]
    read = read_device_scalars(scalars, buffers)
    values = {i: read[4 * k : 4 * k + 4] for k, i in enumerate(alone + list(slots))}
    out = list(jobs)
    for i in todo:
        x, rule, codec, ref = jobs[i]
        bits, qmax = choose(values[i], rule.params["block"], rule.params["bits"], rule.max_error)
        if (bits, qmax) != (rule.params["bits"], qmax_for(bits)):
            params = coded_params(rule.params, qmax)
            rule = type(rule)(rule.pattern, rule.codec, params, rule.min_numel, rule.max_error)
        out[i] = (x, rule, codec, ref)
    return out


def _grouped_statistics(
    jobs: list[tuple[torch.Tensor, Any, Any, torch.Tensor | None]], todo: list[int]
) -> tuple[list[torch.Tensor], dict[int, list[torch.Tensor]]]:
    """The statistics of ``jobs[i]`` for each of ``todo`` in one zero-filled int64 buffer
    per device, one :func:`~tw_triton.ops.delta_statistics_many` per block size (a
    reference on another device is copied over and its tensor computed alone, as its
    encode moves it). Returns the buffers and each job's four slots (0-dim views)."""
    by_device: dict[torch.device, list[int]] = {}
    for i in todo:
        by_device.setdefault(jobs[i][0].device, []).append(i)
    buffers, slots = [], {}
    for device, members in by_device.items():
        moved = [i for i in members if jobs[i][3] is not None and jobs[i][3].device != device]
        kept = [i for i in members if jobs[i][3] is None or jobs[i][3].device == device]
        kept_set = set(kept)
        # Each block's members take consecutive slots: one grouped op each.
        order = sorted(kept, key=lambda i: jobs[i][1].params["block"]) + moved
        buf = torch.zeros(4 * len(order), dtype=torch.int64, device=device)
        views = buf.unbind()
        start = 0
        for block in sorted({jobs[i][1].params["block"] for i in kept}):
            part = [i for i in order if i in kept_set and jobs[i][1].params["block"] == block]
            refs = [jobs[i][3] for i in part]
            xs = [jobs[i][0] for i in part]
            ops.delta_statistics_many(xs, refs, block, out=buf[4 * start : 4 * (start + len(part))])
            start += len(part)
        for k, i in enumerate(moved, start=len(kept)):
            x, rule, _, ref = jobs[i]
            ref = ref.to(device, non_blocking=ref.is_pinned())  # type: ignore[union-attr]
            buf[4 * k : 4 * k + 4] = torch.stack(ops.delta_statistics(x, ref, rule.params["block"]))
        for k, i in enumerate(order):
            slots[i] = list(views[4 * k : 4 * k + 4])
        buffers.append(buf)
    return buffers, slots
