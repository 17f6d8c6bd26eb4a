"""The Triton launchers of the ``log2-temporal`` codec's ops: its encode, decode and code
check, single and grouped (registered by :mod:`~tw_triton.ops.backends.triton`)."""

from __future__ import annotations

import torch

from ..reference import log2_temporal_code_errors_torch
from .triton_launch import kernels, readable, write_out


def quantize_log2_temporal_cuda(
    x: torch.Tensor,
    reference: torch.Tensor,
    bits: int,
    block: int,
    min_step: int,
    *,
    out: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, ...]:
    """The fused temporal encode kernel on contiguous copies. ``out`` is ignored."""
    return kernels().quantize_log2_temporal(x.contiguous(), reference.contiguous(), bits, block, min_step)


def quantize_log2_temporal_many_cuda(
    xs: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
    min_step: int,
    *,
    flags: torch.Tensor,
    out: list[tuple[torch.Tensor, ...]] | None = None,
) -> list[tuple[torch.Tensor, ...]]:
    """The grouped temporal encode kernel: one table copy and at most two launches, written
    into ``out`` in place where its layout is the codec's (bounds, then 16-byte aligned
    codes)."""
    k = kernels()
    gx = [readable(x) for x in xs]
    gr = [readable(r if r.dtype == torch.float32 else r.float()) for r in references]
    return k.quantize_log2_temporal_grouped(gx, gr, bits, block, min_step, flags, out=out)


def dequantize_log2_temporal_cuda(
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
    """The fused temporal decode kernel (``out`` may be ``reference``: the kernel writes a
    fresh tensor, copied in afterwards)."""
    return write_out(
        kernels().dequantize_log2_temporal(codes, lo, hi, reference, numel, bits, block, min_step), out
    )


def _bounds(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``lo`` then ``hi`` as the grouped decode reads them: ``lo`` where ``hi`` follows it
    directly (the codec's stored buffer), else a copy of both."""
    nb = lo.numel()
    if lo.is_contiguous() and hi.is_contiguous() and hi.data_ptr() == lo.data_ptr() + 4 * nb:
        return torch.as_strided(lo, (2 * nb,), (1,))
    return torch.cat([lo.reshape(-1), hi.reshape(-1)])


def dequantize_log2_temporal_many_cuda(
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
    """The grouped temporal decode kernel: one table copy and at most two launches, written
    in place into ``out[i]`` where it is contiguous and 16-byte aligned (the reference
    itself, in a closed-loop advance). Copies only what it cannot read in place."""
    k = kernels()
    got = k.dequantize_log2_temporal_grouped(
        [readable(c) for c in codes],
        [_bounds(a, b) for a, b in zip(lo, hi)],
        [readable(r.detach().reshape(-1)) for r in references],
        bits,
        block,
        min_step,
        out=None if out is None else [None if o is None else o.view(-1) for o in out],
    )
    return [t if out is None or out[i] is None else out[i] for i, t in enumerate(got)]  # type: ignore[misc]


def log2_temporal_code_errors_cuda(
    codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, reference: torch.Tensor, bits: int, block: int
) -> str | None:
    """The check kernel's flag, read back once (a sync); the torch spec names the culprit
    only when the flag is set."""
    flag = kernels().log2_temporal_check(codes, lo, hi, reference.float(), bits, block)
    if not int(flag.item()):
        return None
    return log2_temporal_code_errors_torch(codes, lo, hi, reference, bits, block)


def log2_temporal_code_flags_many_cuda(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    references: list[torch.Tensor],
    bits: int,
    block: int,
) -> torch.Tensor:
    """The grouped check kernel's flags, left on the device (no sync): a table copy and at
    most two launches."""
    return kernels().log2_temporal_check_grouped(codes, lo, hi, [r.float() for r in references], bits, block)
