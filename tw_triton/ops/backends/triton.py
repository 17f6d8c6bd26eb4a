"""The Triton kernels as the "cuda" backend of the codec ops.

Importing this module imports neither triton nor the kernels: :func:`kernels` does, on the
first CUDA tensor coded, so that ``import tw_triton`` and every CPU path work where triton
is not installed. The kernels take contiguous tensors and allocate their outputs; they give
the reference's bytes and values (docs/codecs.md, "Bit-exact across devices").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import check_qmax, check_qmaxes

# The grouped counts and statistics a save reads before and after its encode, and the
# log2-temporal launchers (modules of their own for their size).
from .triton_counts import (
    bitmask_encode_many_cuda,
    delta_statistics_many_cuda,
    sparsity_counts_many_cuda,
)
from .triton_launch import (  # noqa: F401 (check_triton_version, MIN_TRITON: this backend's API)
    KERNEL_DTYPES,
    MIN_TRITON,
    check_triton_version,
    kernels,
    readable,
    write_out,
)
from .triton_temporal import (
    dequantize_log2_temporal_cuda,
    dequantize_log2_temporal_many_cuda,
    log2_temporal_code_errors_cuda,
    log2_temporal_code_flags_many_cuda,
    quantize_log2_temporal_cuda,
    quantize_log2_temporal_many_cuda,
)

DEVICE_TYPE = "cuda"


def quantize_blockwise_cuda(
    x: torch.Tensor,
    reference: torch.Tensor | None,
    bits: int,
    block: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused encode kernel (delta, absmax, rounding and packing in one pass) on
    contiguous copies of the inputs. ``out`` is ignored: the kernel allocates."""
    rc = reference.contiguous() if reference is not None else None
    return kernels().quantize_blockwise(x.contiguous(), rc, bits, block, check_qmax(bits, qmax))


def dequantize_blockwise_cuda(
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
    """The fused decode kernel (unpack, scale, add the reference, cast)."""
    rc = reference.contiguous() if reference is not None else None
    return write_out(kernels().dequantize_blockwise(codes, scales, numel, bits, block, rc, dtype), out)


def quantize_log2_cuda(
    x: torch.Tensor, bits: int, block: int, *, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """The fused log2 encode kernel on a contiguous copy. ``out`` is ignored."""
    return kernels().quantize_log2(x.contiguous(), bits, block)


def dequantize_log2_cuda(
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
    """The fused log2 decode kernel."""
    return write_out(kernels().dequantize_log2(codes, lo, hi, numel, bits, block, dtype), out)


def _by_dtypes(xs: list[torch.Tensor], refs: list[torch.Tensor] | None) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i, x in enumerate(xs):
        key = (x.dtype, None if refs is None else refs[i].dtype)
        groups.setdefault(key, []).append(i)
    return groups


def quantize_blockwise_many_cuda(
    xs: list[torch.Tensor],
    references: list[torch.Tensor] | None,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | Sequence[int | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The grouped encode kernel: one table copy and at most two launches per pair of
    (input, reference) dtypes, whatever the number of tensors and their ``qmax`` (a
    column of the table)."""
    k = kernels()
    q = check_qmaxes(bits, qmax, len(xs))
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(xs)  # type: ignore[list-item]
    for members in _by_dtypes(xs, references).values():
        gx = [readable(xs[i]) for i in members]
        gr = None if references is None else [readable(references[i]) for i in members]
        gq = [q[i] for i in members]
        for i, pair in zip(members, k.quantize_blockwise_grouped(gx, gr, bits, block, gq, flags, members)):
            out[i] = pair
    return out


def quantize_blockwise_update_many_cuda(
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    *,
    flags: torch.Tensor,
    qmax: int | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The grouped update encode kernel: one table copy and at most two launches per
    dtype of ``ms``, whatever the number of tensors."""
    k = kernels()
    q = check_qmax(bits, qmax)
    out: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(ms)  # type: ignore[list-item]
    for members in _by_dtypes(ms, None).values():
        gm = [readable(ms[i]) for i in members]
        gv = [readable(vs[i].float()) for i in members]
        for i, pair in zip(
            members, k.quantize_blockwise_update_grouped(gm, gv, eps, bits, block, q, flags, members)
        ):
            out[i] = pair
    return out


def quantize_log2_many_cuda(
    xs: list[torch.Tensor], bits: int, block: int, *, flags: torch.Tensor
) -> list[tuple[torch.Tensor, ...]]:
    """The grouped log2 encode kernel: one table copy and at most two launches per dtype."""
    k = kernels()
    out: list[tuple[torch.Tensor, ...]] = [None] * len(xs)  # type: ignore[list-item]
    for members in _by_dtypes(xs, None).values():
        gx = [readable(xs[i]) for i in members]
        for i, triple in zip(members, k.quantize_log2_grouped(gx, bits, block, flags, members)):
            out[i] = triple
    return out


def dequantize_blockwise_many_cuda(
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
    """The grouped decode kernel: one table copy and at most two launches per reference
    dtype, written in place into ``out[i]`` where it is contiguous and 16-byte aligned
    (the reference itself, in a closed-loop advance)."""
    k = kernels()
    result: list[torch.Tensor] = [None] * len(codes)  # type: ignore[list-item]
    for members in _by_dtypes(codes, references).values():
        decoded = k.dequantize_blockwise_grouped(
            [readable(codes[i]) for i in members],
            [readable(scales[i]) for i in members],
            [numels[i] for i in members],
            bits,
            block,
            None if references is None else [readable(references[i]) for i in members],
            dtype,
            None if out is None else [out[i] for i in members],
        )
        for i, t in zip(members, decoded):
            result[i] = t
    return result


def dequantize_blockwise_update_many_cuda(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """The grouped update decode kernel: one table copy and at most two launches, whatever
    the number of tensors. Copies only what it cannot read in place."""
    return kernels().dequantize_blockwise_update_grouped(
        [readable(c.reshape(-1)) for c in codes],
        [readable(s.reshape(-1)) for s in scales],
        list(numels),
        [readable(v.detach().reshape(-1).float()) for v in vs],
        eps,
        bits,
        block,
        dtype,
    )


def copy_many_cuda(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The grouped copy kernel for the tensors it can read in place (contiguous, 16-byte
    aligned): one table copy and at most two launches; a clone for each other one."""
    k = kernels()
    out: list[torch.Tensor] = [None] * len(xs)  # type: ignore[list-item]
    members = []
    for i, x in enumerate(xs):
        if k.aligned(x):
            members.append(i)
        else:
            out[i] = x.detach().clone(memory_format=torch.contiguous_format)
    if members:
        for i, copy in zip(members, k.copy_grouped([xs[i].detach() for i in members])):
            out[i] = copy
    return out


def fingerprints_cuda(ts: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """The grouped fingerprint kernel: one table copy and one launch per dtype."""
    from ..reference import FINGERPRINT_SAMPLES, fingerprint_torch

    k = kernels()
    for (dtype, _), members in _by_dtypes(ts, None).items():
        if dtype in KERNEL_DTYPES:
            k.fingerprints([readable(ts[i].detach()) for i in members], out, FINGERPRINT_SAMPLES, members)
        else:  # no kernel reads it: the reference, per tensor
            for i in members:
                out[i] = fingerprint_torch(ts[i])
    return out


def bitmask_encode_cuda(
    x: torch.Tensor, *, nnz: int | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-pass bitmask encode (mask and counts, then the scatter of the values) on a
    contiguous copy. ``out`` is ignored: the kernels allocate."""
    return kernels().bitmask_encode(x.contiguous(), nnz)


def bitmask_decode_cuda(
    mask: torch.Tensor, values: torch.Tensor, numel: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The two-pass bitmask decode (popcounts, then the gather of the values)."""
    return write_out(kernels().bitmask_decode(mask.contiguous(), values.contiguous(), numel), out)


def mask_popcount_cuda(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """Per-tile popcounts (the decode's first pass) summed, and the padding bits (no
    ``bincount``: its atomics all hit one bin on a dense or empty mask)."""
    return kernels().mask_popcount(mask.contiguous(), numel)


def update_root_cuda(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v) + eps`` with torch's CUDA ops (``sqrt.rn``, then one rounded add)."""
    return torch.sqrt(v.float()).add_(eps)


def update_divide_cuda(x: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / (sqrt(v) + eps)`` with torch's CUDA ops (each rounded on its own)."""
    return x.float() / update_root_cuda(v, eps)


def update_multiply_cuda(u: torch.Tensor, v: torch.Tensor, eps: float, big: float) -> torch.Tensor:
    """``u * (sqrt(v) + eps)`` in place with torch's CUDA ops, saturated to ``[-big, big]``."""
    return u.mul_(update_root_cuda(v, eps)).clamp_(-big, big)


def dequantize_log2_many_cuda(
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
    """The grouped log2 decode kernel: one table copy and at most two launches, written in
    place into ``out[i]`` where it is contiguous and 16-byte aligned. Copies only what it
    cannot read in place."""
    got = kernels().dequantize_log2_grouped(
        [readable(c.reshape(-1)) for c in codes],
        [a.reshape(-1).contiguous() for a in lo],
        [b.reshape(-1).contiguous() for b in hi],
        list(numels),
        bits,
        block,
        dtype,
        None if out is None else [None if o is None else o.view(-1) for o in out],
    )
    return [t if out is None or out[i] is None else out[i] for i, t in enumerate(got)]  # type: ignore[misc]


# Ops served by torch's own CUDA ops (each correctly rounded), with no Triton kernel.
TORCH_OPS = frozenset({"update_root", "update_divide", "update_multiply"})

BACKEND = {
    "update_root": update_root_cuda,
    "update_divide": update_divide_cuda,
    "update_multiply": update_multiply_cuda,
    "quantize_blockwise": quantize_blockwise_cuda,
    "dequantize_blockwise": dequantize_blockwise_cuda,
    "quantize_log2": quantize_log2_cuda,
    "dequantize_log2": dequantize_log2_cuda,
    "quantize_blockwise_many": quantize_blockwise_many_cuda,
    "quantize_blockwise_update_many": quantize_blockwise_update_many_cuda,
    "quantize_log2_many": quantize_log2_many_cuda,
    "fingerprints": fingerprints_cuda,
    "copy_many": copy_many_cuda,
    "dequantize_blockwise_many": dequantize_blockwise_many_cuda,
    "bitmask_encode": bitmask_encode_cuda,
    "bitmask_decode": bitmask_decode_cuda,
    "mask_popcount": mask_popcount_cuda,
    "quantize_log2_temporal": quantize_log2_temporal_cuda,
    "quantize_log2_temporal_many": quantize_log2_temporal_many_cuda,
    "dequantize_log2_temporal": dequantize_log2_temporal_cuda,
    "log2_temporal_code_errors": log2_temporal_code_errors_cuda,
    "log2_temporal_code_flags_many": log2_temporal_code_flags_many_cuda,
    "sparsity_counts_many": sparsity_counts_many_cuda,
    "dequantize_log2_temporal_many": dequantize_log2_temporal_many_cuda,
    "dequantize_log2_many": dequantize_log2_many_cuda,
    "dequantize_blockwise_update_many": dequantize_blockwise_update_many_cuda,
    "delta_statistics_many": delta_statistics_many_cuda,
    "bitmask_encode_many": bitmask_encode_many_cuda,
}
