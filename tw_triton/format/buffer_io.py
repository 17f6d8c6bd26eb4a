"""Reading one buffer of a validated file: raw bytes straight into a tensor, a staged
buffer decoded from its stored bytes, each checked against its CRC-32 on the way; to a
device, either one a slot of a pinned ring at a time.

Used by :mod:`tw_triton.format.reader`, which validates the header first, so every read
here is bounded by the file's size or by the staged buffer's recorded raw size.
Why: docs/format.md.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, BinaryIO

import torch

from ..errors import CheckpointError
from .checksum import crc32
from .files import IO_CHUNK_BYTES, byte_view
from .manifest import BufferSpec

logger = logging.getLogger(__name__)

# Positional reads let worker threads read one file at once; without them (Windows) the
# file position is shared and one thread reads.
POSITIONAL_READS = hasattr(os, "preadv")


def read_exact_into(f: BinaryIO, view: memoryview, offset: int, path: str, spec: BufferSpec) -> None:
    """Fill ``view`` from byte ``offset`` of ``f``: a positional read where the OS has one
    (threads may read one file at once), else seek and read.

    Raises:
        CheckpointError: the file ends first (naming ``spec``'s entry and buffer).
    """
    got = 0
    n = len(view)
    while got < n:
        if POSITIONAL_READS:
            k = os.preadv(f.fileno(), [view[got:]], offset + got)
        else:
            f.seek(offset + got)
            k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(
                f"{spec.where(path)}: file ended before the buffer's {spec.nbytes} bytes "
                "(truncated or modified while read)"
            )
        got += k


def can_pin(path: str) -> bool:
    """Whether buffers can be allocated pinned (CUDA is there); logs why not."""
    if torch.cuda.is_available():
        return True
    logger.warning("read_file(%s, pin_memory=True): no CUDA, so buffers are not pinned", path)
    return False


def unmap_pages(mapped: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop the pages of ``mapped`` that cover these bytes from the process (they stay in the
    page cache): a mapped page counts in the resident size, and a load would otherwise hold
    the whole file resident next to the state it decodes. Another thread still reading a
    page it shares at an end faults it back in: the mapping is read-only and file-backed."""
    if nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(mapped)) - start)


def read_raw(
    f: BinaryIO,
    spec: BufferSpec,
    offset: int,
    path: str,
    *,
    verify: bool,
    pin: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read a raw buffer straight into a new tensor (or ``out``), checking its CRC as it goes."""
    # Bounded: validation proved that all buffers together fit in the file.
    tensor = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=pin) if out is None else out
    view = byte_view(tensor)
    crc = 0
    for start in range(0, len(view), IO_CHUNK_BYTES):
        chunk = view[start : start + IO_CHUNK_BYTES]
        read_exact_into(f, chunk, offset + start, path, spec)
        if verify:
            crc = crc32(chunk, crc)
    if verify:
        check_crc(path, spec, crc)
    return tensor


def check_staged(stored: memoryview, spec: BufferSpec, path: str, *, verify: bool) -> str:
    """What precedes a staged buffer's decode: its CRC-32 (with ``verify``), then the
    stage's check of the stored bytes against the raw size. Returns the buffer's name for
    errors."""
    assert spec.stage is not None and spec.stage_params is not None
    where = spec.where(path)
    if verify:
        check_crc(path, spec, crc32(stored))
    spec.stage.check(stored, spec.stage_params, spec.raw_nbytes, where)
    return where


def decode_staged(
    stored: memoryview,
    spec: BufferSpec,
    path: str,
    *,
    verify: bool,
    pin: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check a staged buffer's stored bytes and decode them into a new tensor (or ``out``).

    The stage checks its frame against the raw size before the tensor is allocated, so a
    manifest that promises more than the stored bytes can make allocates nothing. With
    ``verify`` the CRC-32 of the stored bytes is checked first, whatever checksum the stage
    carries itself, so that a read accepts exactly the bytes
    :func:`~tw_triton.format.verify_file` accepts, and corruption stops before the decoder
    runs.
    """
    where = check_staged(stored, spec, path, verify=verify)
    tensor = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=pin) if out is None else out
    spec.stage.decode(stored, spec.stage_params, byte_view(tensor), where)
    return tensor


def upload_raw(
    f: BinaryIO,
    spec: BufferSpec,
    offset: int,
    path: str,
    *,
    verify: bool,
    ring: Any,
    device: torch.device,
) -> torch.Tensor:
    """Read a raw buffer into a new tensor on ``device`` through ``ring`` (a
    :class:`~tw_triton.pinned_memory.PinnedRing`): chunk by chunk into a pinned slot, each
    copied on from there, its CRC checked as it goes."""
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    crc = [0]

    def fill(view: torch.Tensor, at: int) -> None:
        chunk = byte_view(view)
        read_exact_into(f, chunk, offset + at, path, spec)
        if verify:
            crc[0] = crc32(chunk, crc[0])

    ring.upload(tensor, fill)
    if verify:
        check_crc(path, spec, crc[0])
    return tensor


def upload_staged(
    stored: memoryview,
    spec: BufferSpec,
    path: str,
    *,
    verify: bool,
    ring: Any,
    device: torch.device,
) -> torch.Tensor:
    """Check a staged buffer's stored bytes (as :func:`decode_staged` does) and decode them
    into a new tensor on ``device`` through ``ring``: each piece is decoded straight into a
    pinned slot and copied on from there, so the host never holds the decoded buffer."""
    where = check_staged(stored, spec, path, verify=verify)
    stream = spec.stage.stream(stored, spec.stage_params, spec.raw_nbytes, where)
    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    ring.upload(tensor, lambda view, at: stream.fill(byte_view(view)))
    stream.finish()
    return tensor


def check_crc(path: str, spec: BufferSpec, crc: int) -> None:
    """Raise :class:`CheckpointError` unless ``crc`` is the buffer's recorded CRC-32."""
    if crc != spec.crc32:
        raise CheckpointError(
            f"{spec.where(path)}: checksum mismatch "
            f"(expected crc32 {spec.crc32:08x}, computed {crc:08x}): the data is corrupted"
        )
