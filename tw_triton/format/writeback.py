"""Starting a file's writeback to the disk while the file is still being written (Linux).

A write ends with ``fsync``, which waits until the disk holds every dirty page; written all
at once and synced after, those pages only start for the disk at the ``fsync``.
``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE`` asks the kernel to start writing a range
out now and returns without waiting, so the disk works on the first chunks of a file while
the later ones are copied.

It is only a hint. Durability still comes from the ``fsync`` that follows, which also
reports any error, so a failure of the hint changes nothing and is not reported; where the
call does not exist (not Linux, no such libc symbol) nothing is done. Why: docs/format.md.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

# From <linux/fs.h>: start writeback of the dirty pages in the range, do not wait.
SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Any:
    """libc's ``sync_file_range`` as a ctypes function (it releases the GIL while it runs),
    or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# Looked up once at import: a function pointer, constant for the life of the process.
_SYNC_FILE_RANGE = _load_sync_file_range()


def can_start_writeback() -> bool:
    """Whether :func:`start_writeback` does anything on this system."""
    return _SYNC_FILE_RANGE is not None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``[offset, offset + nbytes)`` of the open file
    ``fd`` to its disk, without waiting. Bytes still in a user-space buffer are not seen:
    flush first. A no-op where :func:`can_start_writeback` is false or ``nbytes <= 0``."""
    if _SYNC_FILE_RANGE is not None and nbytes > 0:
        _SYNC_FILE_RANGE(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)


__all__ = ["SYNC_FILE_RANGE_WRITE", "can_start_writeback", "start_writeback"]
