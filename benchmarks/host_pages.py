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
"""

from __future__ import annotations

import argparse
import time

import torch


def touch_seconds(nbytes: int) -> float:
    """Seconds to allocate ``nbytes`` and write every page (then free it)."""
    t0 = time.perf_counter()
    buf = torch.empty(nbytes, dtype=torch.uint8)
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


if __name__ == "__main__":
    main()
