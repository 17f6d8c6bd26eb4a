"""What a page of fresh memory costs on this machine, the first time and again.

    python benchmarks/host_pages.py            # touch 2 GiB, free it, touch it again
    python benchmarks/host_pages.py --gib 8

On a virtual machine, guest memory that the host has not backed yet (never touched since
boot, or handed back to the host by free page reporting / a balloon) costs a host-side
fault on its first touch, on top of the guest kernel's own. Every method of
``speed_compare.py`` that writes new memory pays it (a snapshot, decoded tensors, the page
cache of a written file), but only where it happens to get such pages, so it shows up as
noise between runs. This script puts a number on it: the same allocation touched twice,
freed in between. It prints seconds per GiB and microseconds per 4 KiB page.

It then times the same touch in memory advised to use 2 MiB transparent huge pages
(an anonymous private map, ``madvise(MADV_HUGEPAGE)``), alternating with plain
``torch.empty`` (4 KiB pages): what fresh memory would cost a save's snapshot and a load's
output if they asked for huge pages. Linux only; skipped where the kernel refuses.
"""

from __future__ import annotations

import argparse
import time

import mmap
from typing import Callable

import torch

HUGE_PAGE = 2 << 20


def _plain(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _huge(nbytes: int) -> torch.Tensor:
    """``nbytes`` of a private anonymous map whose 2 MiB-aligned part is advised to use huge
    pages (the tensor keeps the map alive)."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE
    m.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)


def touch_seconds(nbytes: int, allocate: Callable[[int], torch.Tensor] = _plain) -> float:
    """Seconds to allocate ``nbytes`` with ``allocate`` and write every page (then free it)."""
    t0 = time.perf_counter()
    buf = allocate(nbytes)
    buf.fill_(1)
    seconds = time.perf_counter() - t0
    del buf
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="GiB to touch (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="touches after the first (default 3)")
    args = p.parse_args()
    torch.set_num_threads(1)
    nbytes = int(args.gib * (1 << 30))
    pages = nbytes // 4096
    for label, seconds in [("first touch", touch_seconds(nbytes))] + [
        (f"again ({i + 1})", touch_seconds(nbytes)) for i in range(args.rounds)
    ]:
        print(f"{label:>12}: {seconds:7.3f} s for {args.gib:g} GiB = {seconds / args.gib:6.3f} s/GiB, "
              f"{seconds / pages * 1e6:6.2f} us/page")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        print("no MADV_HUGEPAGE here: huge pages not measured")
        return
    for i in range(args.rounds):
        for label, allocate in (("4 KiB pages", _plain), ("huge pages", _huge)):
            seconds = touch_seconds(nbytes, allocate)
            print(f"{label:>12}: {seconds:7.3f} s for {args.gib:g} GiB = {seconds / args.gib:6.3f} s/GiB")


if __name__ == "__main__":
    main()
