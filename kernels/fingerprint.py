"""Fingerprints of many reference tensors of one dtype in one launch.

The spec is ``tw_triton.ops.reference.fingerprints_torch``: for a tensor of ``n``
elements, ``step = max(1, n // SAMPLES)``, the samples are elements ``k * step`` for
``k < min(SAMPLES, ceil(n / step))``, and the fingerprint is ``n + sum((k + 1) *
bits32(fp32(sample_k)))`` in int64. Integer arithmetic only (no overflow: see the spec),
so the order of the sum does not matter and every device gives the same value. One
program per tensor, over a table of int64 rows ``(address, n, step, count)``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .dequantize_blockwise import codes_to_f32
from .quantize_blockwise import widen_to_f32
from .tiles import NUM_WARPS

# A table row (int64, 5 columns: the kernel reads row pid * 5): address, length, sampling
# step, number of samples, output slot.


@triton.jit(do_not_specialize_on_alignment=["out_ptr", "type_ptr"])
def fingerprint_kernel(table_ptr, out_ptr, type_ptr, SAMPLES: tl.constexpr):
    """Write tensor ``pid``'s fingerprint to ``out_ptr[slot]``."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + pid * 5
    base = tl.load(row).to(type_ptr.dtype, bitcast=True)
    n = tl.load(row + 1)
    step = tl.load(row + 2)
    count = tl.load(row + 3)
    k = tl.arange(0, SAMPLES).to(tl.int64)
    valid = k < count
    v = tl.load(base + k * step, mask=valid, other=0.0)
    bits = widen_to_f32(v).to(tl.int32, bitcast=True).to(tl.int64)
    # The weights k + 1 through fp32 (exact): as int arithmetic LLVM narrows them to packed
    # 16-bit adds, which ptxas 12.8 has miscompiled (see codes_to_f32).
    weight = codes_to_f32(tl.arange(0, SAMPLES), -1).to(tl.int64)
    total = tl.sum(tl.where(valid, bits * weight, 0), axis=0)
    tl.store(out_ptr + tl.load(row + 4), total + n)


def fingerprints(
    ts: list[torch.Tensor], out: torch.Tensor, samples: int, slots: list[int] | None = None
) -> None:
    """Write the fingerprint of each of ``ts`` (contiguous, one dtype, one device) to
    ``out[slots[i]]`` (int64; ``slots`` default ``0, 1, ..``) with one launch."""
    rows = []
    for i, t in enumerate(ts):
        n = t.numel()
        step = max(1, n // samples)
        rows += [t.data_ptr(), n, step, min(samples, -(-n // step)), i if slots is None else slots[i]]
    host = torch.tensor(rows, dtype=torch.int64)
    device = out.device
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        fingerprint_kernel[(len(ts),)](
            table, out, ts[0], SAMPLES=samples, num_warps=NUM_WARPS, enable_fp_fusion=False
        )
