"""The CRC-32 a file stores for its manifest and each buffer: ``zlib.crc32``'s (polynomial
0xEDB88320), computed by ISA-L (the ``isal`` package) where it is installed.

ISA-L folds with carry-less multiplies, several times faster than zlib; both give the same
values and release the GIL. Where ``isal`` is missing (a platform without its wheels), zlib
computes the same checksums, slower. Measured: docs/format.md ("Checksums").
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - the platforms isal has no wheels for
    from zlib import crc32

# Which library computes them, for the logs and benchmark environments.
CRC32_LIBRARY = "isal" if crc32.__module__.startswith("isal") else "zlib"

__all__ = ["CRC32_LIBRARY", "crc32"]
