"""Grouped blockwise-update decode: ``m_hat = u_hat * (sqrt(v_hat) + eps)``, many tensors in
two launches.

The grouped blockwise decode (``dequantize_blockwise_grouped``, whose table row and code
loads ``grouped_decode_row`` and ``load_codes_tile`` it calls) without a reference, with
the update's denominator applied in the tile: each program decodes a ``(ROWS, BLOCK)`` tile
of ``u_hat`` to fp32 with the blockwise tile arithmetic (``dequantize_tile``), loads the
same tile of its partner's decode ``v_hat`` (fp32), forms ``sqrt(v_hat) + eps`` with
correctly rounded fp32 ops (``sqrt.rn``, an add), multiplies (rounded on its own: the
launcher passes ``enable_fp_fusion=False``), then saturates to the output dtype's finite
range and rounds to it (``to_output``): the bits of the codec's per-tensor torch path
(``BlockwiseUpdateCodec.decode_with_partner``), whatever the number of tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequantize_blockwise import dequantize_tile, to_output
from .dequantize_blockwise_grouped import grouped_decode_row, load_codes_tile, store_tile
from .tiles import group_outputs, launch_grouped


@triton.jit(do_not_specialize_on_alignment=["flags_ptr", "out_type_ptr"])
def dequantize_blockwise_update_grouped_kernel(
    table_ptr,
    flags_ptr,
    out_type_ptr,
    eps,
    T,
    LOG_T: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Decode one tile of one tensor of the table (``T`` rows: addresses of codes, scales,
    v_hat and the output); ``eps`` is fp32. ``out_type_ptr`` only carries the output's
    element type; ``flags_ptr`` is not used."""
    row, n, first_row, codes_ptr, scales_ptr = grouped_decode_row(table_ptr, T, LOG_T, ROWS)
    v_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(tl.float32), bitcast=True), 16)
    out_ptr = tl.multiple_of(tl.load(row + 3).to(out_type_ptr.dtype, bitcast=True), 16)
    offs, in_bounds, packed, scale = load_codes_tile(
        codes_ptr, scales_ptr, first_row, n, MASKED, BITS, BLOCK, ROWS
    )
    if MASKED:
        v = tl.load(v_ptr + offs, mask=in_bounds, other=0.0)
    else:
        v = tl.load(v_ptr + offs)
    u = dequantize_tile(packed, scale, 0.0, False, BITS, BLOCK, ROWS, tl.float32)
    den = tl.sqrt_rn(v) + tl.full((ROWS, BLOCK), eps, tl.float32)
    y = to_output(u * den, out_type_ptr.dtype.element_ty)
    store_tile(out_ptr, offs, y, in_bounds, MASKED)


def dequantize_blockwise_update_grouped(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    numels: list[int],
    vs: list[torch.Tensor],
    eps: float,
    bits: int,
    block: int,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Decode ``u_hat * (sqrt(vs[i]) + eps)`` of each tensor to ``dtype`` (codes, scales
    and the fp32 ``vs`` contiguous and 16-byte aligned) with one table copy and at most two
    launches.

    Returns:
        Each flat decoded tensor, a view of one buffer.
    """
    device = codes[0].device
    views, out_addrs = group_outputs(numels, [(dtype, lambda n: n)], device)
    addresses = [
        [c.data_ptr(), s.data_ptr(), v.data_ptr(), out_addrs[i][0]]
        for i, (c, s, v) in enumerate(zip(codes, scales, vs))
    ]
    launch_grouped(
        dequantize_blockwise_update_grouped_kernel,
        addresses,
        numels,
        block,
        torch.empty(0, dtype=torch.int64, device=device),
        [0] * len(codes),
        (views[0][0], float(eps)),
        BITS=bits,
    )
    return [v[0] for v in views]
