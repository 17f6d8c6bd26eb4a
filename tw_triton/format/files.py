"""The file-system side of the format: temporary names, atomic replacement, OS errors.

A file is written to ``.<final name>.<16 hex>.tmp`` beside its destination and renamed over
it (see :func:`tw_triton.format.write_file`); failures of the operating system become
:class:`~tw_triton.errors.CheckpointIOError`, an ``OSError`` that keeps the ``errno``.
Why: docs/format.md.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
from typing import Any, BinaryIO

import torch

from ..errors import CheckpointError, CheckpointIOError

logger = logging.getLogger(__name__)

# Reads, writes and checksums go in chunks of this size: large enough that syscalls are
# cheap, small enough that the CRC of a chunk runs while the chunk is still in cache.
IO_CHUNK_BYTES = 8 << 20

_TEMP_RANDOM_BYTES = 8
_TEMP_NAME_RE = re.compile(rf"\..+\.[0-9a-f]{{{2 * _TEMP_RANDOM_BYTES}}}\.tmp", re.DOTALL)


def temp_path_for(path: str | os.PathLike) -> str:
    """A fresh temporary name next to ``path``: ``.<final name>.<16 hex>.tmp``.

    Kept in the same directory so that ``os.replace`` is an atomic rename on one filesystem.
    """
    path = os.fspath(path)
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{secrets.token_hex(_TEMP_RANDOM_BYTES)}.tmp")


def is_temp_file(name: str | os.PathLike) -> bool:
    """Whether ``name`` (a file name or a path) is a temporary file left by a write.

    A writer that crashed mid-write leaves such a file; retention may delete it, and
    checkpoint listings must skip it.
    """
    return _TEMP_NAME_RE.fullmatch(os.path.basename(os.fspath(name))) is not None


def remove_quietly(path: str) -> None:
    """Delete ``path``: a file already gone is fine, another failure is logged, not raised
    (a failed write's own error matters more; a retired checkpoint has no caller to raise
    to)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def fsync_directory(directory: str) -> None:
    """fsync a directory, so that a rename in it survives a crash (nothing on Windows,
    which cannot open a directory and journals its renames)."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def require_little_endian(path: str) -> None:
    """Raise :class:`CheckpointError` on a big-endian machine: the format is little-endian."""
    if sys.byteorder != "little":
        raise CheckpointError(
            f"checkpoint {path}: the format is little-endian and this machine is big-endian"
        )


def io_error(exc: OSError, message: str) -> CheckpointIOError:
    """``exc`` as a :class:`CheckpointIOError` saying ``message`` (the ``errno`` kept)."""
    detail = exc.strerror or str(exc)
    if exc.errno is None:
        return CheckpointIOError(f"{message}: {detail}")
    return CheckpointIOError(exc.errno, f"{message}: {detail}")


class open_for_reading:
    """``open(path, "rb", buffering=0)`` whose OS errors become CheckpointIOError."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        require_little_endian(self.path)
        try:
            self.file = open(self.path, "rb", buffering=0)
        except OSError as exc:
            raise io_error(exc, f"cannot open checkpoint {self.path}") from exc
        return self.file

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.file is not None
        self.file.close()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise io_error(exc, f"cannot read checkpoint {self.path}") from exc


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
