"""Grouped ``log2`` decode: many tensors to one dtype in two launches.

The single-tensor decode (``dequantize_log2``) over a table of tensors (row ``j``: the
addresses of the codes, ``lo``, ``hi`` and the output; the table and the launches:
``tiles.launch_grouped``), with the same tile arithmetic (``log2_decode_tile``), so every
tensor decodes to the bits the single kernel gives it alone. A keyframe of the default
preset decodes its second moments this way: they are the reference its temporal deltas
are coded against (``deltas.keyframe_values``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tw_triton.errors import QuantizationError

from .dequantize_log2 import log2_decode_rows
from .tiles import aligned, find_entry, group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "out_type_ptr"])
def dequantize_log2_grouped_kernel(
    table_ptr,
    flags_ptr,
    out_type_ptr,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode one tile of one tensor of the table (``T`` rows). ``out_type_ptr`` only
    carries the element type; ``flags_ptr`` is not used."""
    pid = tl.program_id(0).to(tl.int64)
    row = table_ptr + find_entry(table_ptr, pid, T, LOG_T) * 8
    n = tl.load(row + 4)
    first_row = tl.load(row + 5) + (pid - tl.load(row + 6)) * ROWS
    # The codes and the output are 16-byte aligned; the bounds 4-byte only (views of a
    # stored buffer).
    codes_ptr = tl.multiple_of(tl.load(row + 0).to(tl.pointer_type(tl.uint8), bitcast=True), 16)
    lo_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int32), bitcast=True)
    hi_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int32), bitcast=True)
    out_ptr = tl.multiple_of(tl.load(row + 3).to(out_type_ptr.dtype, bitcast=True), 16)

    log2_decode_rows(codes_ptr, lo_ptr, hi_ptr, out_ptr, n, first_row, MASKED, BITS, BLOCK, ROWS)


def dequantize_log2_grouped(
    codes: list[torch.Tensor],
    lo: list[torch.Tensor],
    hi: list[torch.Tensor],
    numels: list[int],
    bits: int,
    block: int,
    dtype: torch.dtype,
    out: list[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Decode tensors (codes contiguous and 16-byte aligned; bounds contiguous int32) to
    ``dtype`` with one table copy and at most two launches.

    Args:
        out: per tensor, ``None`` or a flat tensor of ``dtype`` and its size to write
            into: in place where contiguous and 16-byte aligned, else copied in after the
            launches.

    Returns:
        Each flat decoded tensor (``out[i]`` when given, else a view of one buffer), the
        values :func:`dequantize_log2` gives each alone.

    Raises:
        QuantizationError: an unsupported dtype, or buffers of the wrong dtype or size.
    """
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise QuantizationError(f"dequantize_log2_grouped: cannot decode to {dtype}")
    for c, a, b, n in zip(codes, lo, hi, numels):
        nb = -(-n // block)
        if (
            c.dtype != torch.uint8
            or c.numel() != (n * bits + 7) // 8
            or any(x.dtype != torch.int32 or x.numel() != nb or not x.is_contiguous() for x in (a, b))
        ):
            raise QuantizationError(
                f"dequantize_log2_grouped: codes {c.dtype} x {c.numel()}, bounds {a.dtype} x {a.numel()} "
                f"and {b.dtype} x {b.numel()}; expected uint8 x {(n * bits + 7) // 8} and int32 x {nb}"
            )
    device = codes[0].device
    outs = [None] * len(codes) if out is None else list(out)
    direct = [
        o is not None and o.dtype == dtype and o.numel() == n and aligned(o) for o, n in zip(outs, numels)
    ]
    scratch = [i for i, d in enumerate(direct) if not d]
    views, out_addrs = group_outputs([numels[i] for i in scratch], [(dtype, lambda n: n)], device)
    results: list[torch.Tensor] = [None] * len(codes)  # type: ignore[list-item]
    targets = [0] * len(codes)
    for k, i in enumerate(scratch):
        results[i], targets[i] = views[k][0], out_addrs[k][0]
    for i, d in enumerate(direct):
        if d:
            results[i], targets[i] = outs[i], outs[i].data_ptr()  # type: ignore[union-attr]
    launch_grouped(
        dequantize_log2_grouped_kernel,
        [[c.data_ptr(), a.data_ptr(), b.data_ptr(), t] for c, a, b, t in zip(codes, lo, hi, targets)],
        numels,
        block,
        torch.empty(0, dtype=torch.int64, device=device),
        [0] * len(codes),
        (results[0],),
        BITS=bits,
    )
    for i in scratch:
        if outs[i] is not None:  # a caller's tensor the kernel cannot write in place
            outs[i].view(-1).copy_(results[i])  # type: ignore[union-attr]
            results[i] = outs[i]  # type: ignore[assignment]
    return results
