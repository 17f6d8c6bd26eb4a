"""The denominator of the ``blockwise-update`` codec: the spec of :func:`tw_triton.ops.update_root`."""

from __future__ import annotations

import torch


def update_root_torch(v: torch.Tensor, eps: float) -> torch.Tensor:
    """``sqrt(v) + eps`` in fp32 (``v`` as fp32), each op correctly rounded on its own: the
    fp64 root rounded to fp32 is the correctly rounded fp32 root (53 >= 2 * 24 + 2 bits),
    the bits of CUDA's ``sqrt.rn``; torch's own fp32 ``sqrt`` on a CPU may be 1 ulp off."""
    return torch.sqrt(v.float().double()).float().add_(eps)


def update_divide_torch(x: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / (sqrt(v) + eps)`` in fp32 (a new tensor), each op correctly rounded."""
    return x.float() / update_root_torch(v, eps)


def update_multiply_torch(u: torch.Tensor, v: torch.Tensor, eps: float, big: float) -> torch.Tensor:
    """``u * (sqrt(v) + eps)`` in place on the fp32 ``u``, each op correctly rounded, then
    saturated to ``[-big, big]`` (NaN stays NaN); returns ``u``."""
    return u.mul_(update_root_torch(v, eps)).clamp_(-big, big)
