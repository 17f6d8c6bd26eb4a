"""Check the kernels' int64 offset arithmetic past 2**31 and 2**32 without allocating 8 GB.

Usage: ``python tests/_offsets64.py {encode,decode} {cpu,cuda}`` (run by the kernel tests in
a child process; prints ``checked N windows`` and exits 0 when every window matches).

How: the launchers take ``row0``, the first block of the launch, so one launch covers a
small window ``[row0 * block, n)`` of a virtual tensor of ``n`` elements. Every tensor
handed to the kernel reports a ``data_ptr()`` moved back by the window's offset in bytes,
so the addresses the kernel computes, ``base + offset``, land in the small real buffers
only if ``offset`` was computed without wrapping. With 32-bit offsets the address lands
gigabytes away: a crash, or a mismatch against the torch path on the window's data.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from tw_triton.codecs.blockwise import dequantize_blockwise_torch, quantize_blockwise_torch  # noqa: E402
from tw_triton.kernels.dequantize_blockwise import launch_dequantize  # noqa: E402
from tw_triton.kernels.quantize_blockwise import launch_quantize, rows_per_program  # noqa: E402


class _ShiftedPointer(torch.Tensor):
    """A tensor whose ``data_ptr()`` is ``SHIFT`` bytes before its real storage.

    The shift is a class attribute because the interpreter re-creates the tensor (as the
    same subclass) before reading its pointer.
    """

    SHIFT = 0

    def data_ptr(self) -> int:
        return (super().data_ptr() - type(self).SHIFT) % 2**64


def shifted(t: torch.Tensor, shift_bytes: int) -> torch.Tensor:
    cls = type(f"Shifted{shift_bytes}", (_ShiftedPointer,), {"SHIFT": shift_bytes})
    return t.as_subclass(cls)


def windows() -> list[tuple[int, int, torch.dtype, torch.dtype | None, int]]:
    """(bits, block, dtype, ref dtype, first element) of each window to check.

    Windows start just before 2**31 and 2**32 elements (tile offsets cross both), past
    2**33 (2-bit code byte offsets cross 2**31), and at 2**37 elements with 32-element
    blocks (the block index itself passes 2**31).
    """
    out = []
    for bits in (8, 4, 2):
        for start in (2**31, 2**32):
            out.append((bits, 128, torch.bfloat16, torch.float32, start))
    out.append((2, 4096, torch.float32, None, 2**33 + 2**31))
    out.append((4, 32, torch.float16, torch.bfloat16, 2**37))
    return out


def check(op: str, device: torch.device) -> int:
    gen = torch.Generator().manual_seed(1234)
    count = 0
    for bits, block, dtype, ref_dtype, start in windows():
        rows = rows_per_program(block)
        tile = rows * block
        # Two whole tiles then a partial one, ending past `start`.
        row0 = (start - 2 * tile) // block
        m = 2 * tile + tile // 2 + 7
        n = row0 * block + m
        x = torch.randn(m, generator=gen).to(dtype)
        ref = None if ref_dtype is None else torch.randn(m, generator=gen).to(ref_dtype)
        codes, scales = quantize_blockwise_torch(x, ref, bits, block)
        first_byte = row0 * block * bits // 8
        ref_dev = None
        if ref is not None:
            ref_dev = shifted(ref.to(device), row0 * block * ref.element_size())
        if op == "encode":
            k_codes = torch.zeros_like(codes, device=device)
            k_scales = torch.full_like(scales, -1.0, device=device)
            launch_quantize(
                shifted(x.to(device), row0 * block * x.element_size()),
                ref_dev,
                shifted(k_codes, first_byte),
                shifted(k_scales, row0 * 4),
                n,
                bits,
                block,
                row0,
            )
            ok = torch.equal(k_codes.cpu(), codes) and torch.equal(k_scales.cpu(), scales)
        else:
            expected = dequantize_blockwise_torch(codes, scales, m, bits, block, ref, dtype)
            out = torch.zeros(m, dtype=dtype, device=device)
            launch_dequantize(
                shifted(codes.to(device), first_byte),
                shifted(scales.to(device), row0 * 4),
                ref_dev,
                shifted(out, row0 * block * out.element_size()),
                n,
                bits,
                block,
                row0,
            )
            ok = torch.equal(out.cpu().view(torch.uint8), expected.view(torch.uint8))
        if not ok:
            print(f"{op}: window at element {row0 * block} (bits {bits}, block {block}) differs")
            return -1
        count += 1
    return count


def main() -> None:
    op, device = sys.argv[1], torch.device(sys.argv[2])
    count = check(op, device)
    if count < 0:
        sys.exit(1)
    print(f"checked {count} windows")


if __name__ == "__main__":
    main()
