"""Resident memory and durability probes for the save/load benchmarks (Linux ``/proc``).

:func:`reset_peak` then :func:`peak_bytes` give the resident high-water mark of a region;
:func:`fsync_path` makes a plain save as durable as tw_triton's writer.
"""

from __future__ import annotations

import os


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _status_kib("VmRSS") * 1024


def reset_peak() -> None:
    """Reset the resident high-water mark (Linux: write 5 to /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def peak_bytes() -> int:
    """Resident high-water mark since the last :func:`reset_peak`."""
    return _status_kib("VmHWM") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file and then its directory, so that a plain save is as durable as
    tw_triton's writer, which does both (a new file survives a crash only once the
    directory entry that names it is on disk too)."""
    for target in (path, os.path.dirname(os.path.abspath(path))):
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
