"""The ``blockwise-update`` codec's elementwise steps in C (``tw_triton/csrc/update_root.c``):
its denominator ``sqrt(v) + eps``, the update ``x / (sqrt(v) + eps)`` and the decoded
moment ``u * (sqrt(v) + eps)``, each op correctly rounded as the torch specs
(:mod:`tw_triton.ops.reference.update_root`) have them, split over threads."""

from __future__ import annotations

import torch

from ...errors import TwTritonError
from .native import block_ranges, enabled, library, run_ranges


def _f32(*ts: torch.Tensor) -> bool:
    n = ts[0].numel()
    return all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n
        for t in ts
    )


def _run(name: str, n: int, call) -> None:
    if n and min(run_ranges(lambda r: call(r[0], r[1] - r[0]), block_ranges(n, 1))) < 0:
        raise TwTritonError(f"the compiled {name} refused {n} elements")


def update_root_native(v: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``sqrt(v) + eps`` of a contiguous fp32 CPU tensor; ``None`` if the C code does not take it."""
    if not (_f32(v) and enabled()):
        return None
    d, lib = torch.empty_like(v), library()
    _run(
        "update root",
        v.numel(),
        lambda s, k: lib.tw_update_root(v.data_ptr() + 4 * s, k, eps, d.data_ptr() + 4 * s),
    )
    return d


def update_divide_native(x: torch.Tensor, v: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``x / (sqrt(v) + eps)`` of contiguous fp32 CPU tensors; ``None`` if the C code does not take them."""
    if not (_f32(x, v) and enabled()):
        return None
    u, lib = torch.empty_like(x), library()

    def one(s: int, k: int) -> int:
        return lib.tw_update_divide(x.data_ptr() + 4 * s, v.data_ptr() + 4 * s, k, eps, u.data_ptr() + 4 * s)

    _run("update divide", x.numel(), one)
    return u


def update_multiply_native(u: torch.Tensor, v: torch.Tensor, eps: float, big: float) -> bool:
    """``u *= sqrt(v) + eps``, saturated to ``[-big, big]``, in place on contiguous fp32 CPU
    tensors; ``False`` (nothing done) if the C code does not take them."""
    if not (_f32(u, v) and enabled()):
        return False
    lib = library()

    def one(s: int, k: int) -> int:
        return lib.tw_update_multiply(u.data_ptr() + 4 * s, v.data_ptr() + 4 * s, k, eps, big)

    _run("update multiply", u.numel(), one)
    return True


__all__ = ["update_divide_native", "update_multiply_native", "update_root_native"]
