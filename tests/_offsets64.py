"""Check the kernels' int64 offset arithmetic past 2**31 and 2**32 elements.

Usage: ``python tests/_offsets64.py {encode,decode} {cpu,cuda} [--placement shifted|real]
[--small]`` (run by the kernel tests in a child process; prints ``checked N windows`` and
exits 0 when every window matches, exits 3 after ``not run: ...`` lines when a device has
too little free memory for a window).

The launchers take ``row0``, the first block of the launch, so one launch covers a small
window ``[row0 * block, n)`` of a tensor of ``n`` elements. Two ways to give the kernel
tensors whose addresses ``base + offset`` reach that window (:func:`place`):

* ``shifted`` (the CPU, under the interpreter): every tensor reports a ``data_ptr()``
  moved back by the window's offset in bytes, so the addresses land in small real buffers
  only if ``offset`` was computed without wrapping; with 32-bit offsets they land
  gigabytes away: a crash, or a mismatch. No memory is needed, but Triton's launcher on a
  real GPU checks every pointer argument (``cuPointerGetAttribute``) and rejects these.
* ``real`` (the default on CUDA): every tensor is a real allocation of its full size
  (:func:`bytes_needed`; up to 43 GiB for one window), filled with 0xFF bytes (NaN for
  floats) and holding the window's data at its offset. A wrapped offset reads NaN or
  writes outside the window, and the window differs from the torch path's.

On CUDA the windows are :func:`device_windows`: those a real allocation can hold on an
80 GB GPU. :func:`plan` runs those that fit in the free memory and names the others.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from tw_triton.codecs.blockwise import dequantize_blockwise_torch, quantize_blockwise_torch  # noqa: E402
from tw_triton.kernels.dequantize_blockwise import launch_dequantize  # noqa: E402
from tw_triton.kernels.quantize_blockwise import launch_quantize, rows_per_program  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _kernel_testing import grid_block  # noqa: E402

GRID_BLOCK = grid_block("blockwise")

GIB = 2**30
# Kept free beside the planned buffers: the window's own tensors, the CUDA context's
# workspace, the caching allocator's rounding.
RESERVE_BYTES = 2 * GIB


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


@dataclass(frozen=True)
class Window:
    """The elements ``[row0 * block, n)`` of a tensor of ``n`` elements: two whole tiles
    (the unmasked launch) and a partial one (the masked tail), ending past ``start``."""

    bits: int
    block: int
    dtype: torch.dtype
    ref_dtype: torch.dtype | None
    start: int

    @property
    def tile(self) -> int:
        return rows_per_program(self.block) * self.block

    @property
    def row0(self) -> int:
        return (self.start - 2 * self.tile) // self.block

    @property
    def m(self) -> int:
        """Elements in the window."""
        return 2 * self.tile + self.tile // 2 + 7

    @property
    def elem0(self) -> int:
        """Offset of the window's first element."""
        return self.row0 * self.block

    @property
    def n(self) -> int:
        return self.elem0 + self.m

    @property
    def first_byte(self) -> int:
        """Offset of the window's first packed code byte."""
        return self.elem0 * self.bits // 8

    def label(self) -> str:
        ref = str(self.ref_dtype).removeprefix("torch.") if self.ref_dtype else "noref"
        return f"bits {self.bits}, block {self.block}, {str(self.dtype).removeprefix('torch.')}, {ref}, at {self.elem0}"


def windows() -> list[Window]:
    """Every window, as checked under the interpreter.

    Windows start just before 2**31 and 2**32 elements (tile offsets cross both), past
    2**33 (2-bit code byte offsets cross 2**31), and at 2**37 elements with 32-element
    blocks (the block index itself passes 2**31).
    """
    out = [Window(bits, 128, torch.bfloat16, torch.float32, s) for bits in (8, 4, 2) for s in (2**31, 2**32)]
    out.append(Window(2, 4096, torch.float32, None, 2**33 + 2**31))
    out.append(Window(4, 32, torch.float16, torch.bfloat16, 2**37))
    return out


def device_windows() -> list[Window]:
    """The windows checked on a GPU with real allocations: all but the block-index one,
    whose fp16 tensor alone is 256 GiB (no GPU holds it; the interpreter checks it, and
    tests/ops/test_ptx.py checks that the program id is widened before any arithmetic).
    Each with the kernel parameters of a GPU grid variant (tests/_kernel_testing.py): the
    grid's block, a reference in the tensor's dtype; the offsets cross the same bounds."""
    return [
        Window(w.bits, GRID_BLOCK, w.dtype, w.dtype if w.ref_dtype is not None else None, w.start)
        for w in windows()
        if w.start < 2**36
    ]


def small_windows() -> list[Window]:
    """The windows' shapes a few tiles from the start, for the ``real`` placement on the
    CPU (the same code as on a GPU, with buffers of a few MiB)."""
    return [Window(w.bits, w.block, w.dtype, w.ref_dtype, 4 * w.tile + w.block) for w in windows()]


def bytes_needed(op: str, w: Window) -> int:
    """Bytes of the full-size buffers the ``real`` placement allocates for ``w``."""
    elem = torch.empty(0, dtype=w.dtype).element_size()
    ref = 0 if w.ref_dtype is None else torch.empty(0, dtype=w.ref_dtype).element_size()
    codes = -(-w.n * w.bits // 8)
    scales = -(-w.n // w.block) * 4
    return w.n * (elem + ref) + codes + scales  # encode: x, ref, codes, scales; decode: out for x


def plan(op: str, wins: list[Window], free_bytes: int) -> tuple[list[Window], list[str]]:
    """The windows whose buffers fit in ``free_bytes`` (less :data:`RESERVE_BYTES`), one at
    a time; and a line for each other one, saying what it needs."""
    run, reasons = [], []
    for w in wins:
        need = bytes_needed(op, w)
        if need + RESERVE_BYTES <= free_bytes:
            run.append(w)
        else:
            reasons.append(
                f"not run: window ({w.label()}) needs {need / GIB:.1f} GiB + {RESERVE_BYTES / GIB:.0f} GiB "
                f"reserve, {free_bytes / GIB:.1f} GiB free"
            )
    return run, reasons


def place(data: torch.Tensor, offset: int, total: int, device: torch.device, placement: str):
    """``(tensor for the kernel, the window's elements)``: ``data`` as the elements
    ``[offset, offset + len)`` of a ``total``-element tensor on ``device``."""
    if placement == "shifted":
        t = data.to(device)
        return shifted(t, offset * t.element_size()), t
    if placement != "real":
        raise ValueError(f"unknown placement {placement!r}")
    full = torch.empty(total, dtype=data.dtype, device=device)
    full.view(torch.uint8).fill_(0xFF)
    window = full[offset : offset + data.numel()]
    window.copy_(data)
    return full, window


def check_window(op: str, w: Window, device: torch.device, placement: str, gen: torch.Generator) -> bool:
    x = torch.randn(w.m, generator=gen).to(w.dtype)
    ref = None if w.ref_dtype is None else torch.randn(w.m, generator=gen).to(w.ref_dtype)
    codes, scales = quantize_blockwise_torch(x, ref, w.bits, w.block)
    n_codes, n_scales = -(-w.n * w.bits // 8), -(-w.n // w.block)
    ref_dev = None if ref is None else place(ref, w.elem0, w.n, device, placement)[0]
    if op == "encode":
        x_dev = place(x, w.elem0, w.n, device, placement)[0]
        c_dev, c_win = place(torch.zeros_like(codes), w.first_byte, n_codes, device, placement)
        s_dev, s_win = place(torch.full_like(scales, -1.0), w.row0, n_scales, device, placement)
        launch_quantize(x_dev, ref_dev, c_dev, s_dev, w.n, w.bits, w.block, w.row0)
        return torch.equal(c_win.cpu(), codes) and torch.equal(s_win.cpu(), scales)
    expected = dequantize_blockwise_torch(codes, scales, w.m, w.bits, w.block, ref, w.dtype)
    c_dev = place(codes, w.first_byte, n_codes, device, placement)[0]
    s_dev = place(scales, w.row0, n_scales, device, placement)[0]
    o_dev, o_win = place(torch.zeros(w.m, dtype=w.dtype), w.elem0, w.n, device, placement)
    launch_dequantize(c_dev, s_dev, ref_dev, o_dev, w.n, w.bits, w.block, w.row0)
    return torch.equal(o_win.cpu().view(torch.uint8), expected.view(torch.uint8))


def check(op: str, device: torch.device, placement: str, wins: list[Window]) -> int:
    """Check each window; the count checked, or -1 after printing the first that differs."""
    gen = torch.Generator().manual_seed(1234)
    for w in wins:
        ok = check_window(op, w, device, placement, gen)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()  # the next window's buffers need the memory
        if not ok:
            print(f"{op}: window ({w.label()}) differs ({placement} placement)")
            return -1
    return len(wins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("op", choices=("encode", "decode"))
    parser.add_argument("device")
    parser.add_argument("--placement", choices=("shifted", "real"), default=None)
    parser.add_argument("--small", action="store_true", help="small_windows(), for the CPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    placement = args.placement or ("real" if device.type == "cuda" else "shifted")
    wins = small_windows() if args.small else device_windows() if device.type == "cuda" else windows()
    skipped: list[str] = []
    if device.type == "cuda" and placement == "real":
        wins, skipped = plan(args.op, wins, torch.cuda.mem_get_info(device)[0])
    count = check(args.op, device, placement, wins)
    if count < 0:
        sys.exit(1)
    print(f"checked {count} windows ({placement} placement)")
    for line in skipped:
        print(line)
    if skipped:
        sys.exit(3)


if __name__ == "__main__":
    main()
