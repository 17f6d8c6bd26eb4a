"""The grouped Triton launchers of a save's counts and statistics: the sparse candidates'
counts and bitmask encode, the weight-delta statistics (registered by
:mod:`~tw_triton.ops.backends.triton`)."""

from __future__ import annotations

import torch

from .triton_launch import KERNEL_DTYPES, kernels, readable


def bitmask_encode_many_cuda(
    xs: list[torch.Tensor],
    nnzs: list[int],
    *,
    out: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The grouped bitmask encode for the tensors it reads in place (contiguous, 16-byte
    aligned): per element width two table copies, at most four launches and a scan; the
    single op for each other one (no copy of a whole tensor). ``out`` is ignored."""
    from ..registry import lookup

    k = kernels()
    got: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(xs)  # type: ignore[list-item]
    widths: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        if x.element_size() in (2, 4) and k.aligned(x):
            widths.setdefault(x.element_size(), []).append(i)
        else:
            got[i] = lookup("bitmask_encode", x.device.type)(x, nnz=nnzs[i])
    for members in widths.values():
        encoded = k.bitmask_encode_grouped([xs[i].detach() for i in members], [nnzs[i] for i in members])
        for i, enc in zip(members, encoded):
            got[i] = enc
    return got


def sparsity_counts_many_cuda(xs: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """The grouped count kernel for the tensors it reads in place (contiguous, 16-byte
    aligned, 2 or 4 bytes an element): one table copy and at most two launches per element
    width; the single op for each other one (no copy of a whole tensor)."""
    from ..registry import lookup

    k = kernels()
    widths: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        if x.element_size() in (2, 4) and k.aligned(x):
            widths.setdefault(x.element_size(), []).append(i)
        else:
            out[2 * i : 2 * i + 2] += torch.stack(lookup("sparsity_counts", x.device.type)(x))
    for members in widths.values():
        k.sparsity_counts_grouped([xs[i].detach() for i in members], out, [2 * i for i in members])
    return out


def delta_statistics_many_cuda(
    xs: list[torch.Tensor], references: list[torch.Tensor | None] | None, block: int, *, out: torch.Tensor
) -> torch.Tensor:
    """The grouped statistics kernel: one table copy and at most four launches per pair of
    (input, reference) dtypes, whatever the number of tensors. A tensor the kernel does not
    read (a dtype other than fp32/fp16/bf16, a block that is not a power of two up to
    4096) gets the spec, alone."""
    from ..reference import delta_statistics_torch

    k = kernels()
    refs = [None] * len(xs) if references is None else list(references)
    groups: dict[tuple, list[int]] = {}
    tiled = block & (block - 1) == 0 and 1 <= block <= 4096
    for i, x in enumerate(xs):
        r = refs[i]
        if not x.numel():
            continue
        if tiled and x.dtype in KERNEL_DTYPES and (r is None or r.dtype in KERNEL_DTYPES):
            groups.setdefault((x.dtype, None if r is None else r.dtype), []).append(i)
        else:
            out[4 * i : 4 * i + 4] = torch.stack(delta_statistics_torch(x, r, block))
    for (_, ref_dtype), members in groups.items():
        gx = [readable(xs[i].detach()) for i in members]
        gr = None if ref_dtype is None else [readable(refs[i].detach()) for i in members]
        k.delta_statistics_grouped(gx, gr, block, out, [4 * i for i in members])
    return out
