"""Writing a checkpoint file: :func:`write_file`, atomic and durable.

The state is planned first (:mod:`tw_triton.format.plan`: checks, entropy stage,
checksums, layout), then the header is written once and the buffers are streamed from the
tensors after it, into a temporary file that is fsynced and renamed over the destination.
Why: docs/format.md.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from ..codecs.entropy import EntropyPolicy, resolve_policy
from ..errors import CheckpointError
from ..qstate import QuantizedState
from .compact import manifest_metadata
from .files import (
    IO_CHUNK_BYTES,
    fsync_directory,
    io_error,
    remove_quietly,
    require_little_endian,
    temp_path_for,
)
from .manifest import json_ints, manifest_json, quote, to_json
from .plan import Plan, plan_file
from .spec import MAX_HEADER_BYTES
from .writeback import can_start_writeback, start_writeback


def write_file(
    qstate: QuantizedState,
    path: str | os.PathLike,
    *,
    fsync: bool = True,
    entropy: str | EntropyPolicy | None = "auto",
) -> int:
    """Write ``qstate`` to ``path`` as one safetensors file, atomically.

    The bytes go to a temporary file in the same directory (see
    :func:`~tw_triton.format.temp_path_for`), which is flushed and fsynced, renamed over
    ``path`` with ``os.replace``, and then the directory is fsynced so the rename itself
    survives a crash. On any error the temporary file is removed and a file already at
    ``path`` is left untouched.

    Buffers are written straight from the tensors (no copy of the whole file in memory),
    in file order with large sequential writes, after the header. With ``fsync``, Linux is
    asked to start writing each chunk to the disk as soon as it is written
    (:mod:`tw_triton.format.writeback`), so the final fsync waits for less. Buffers that
    are not on the CPU are copied there first (the async writer hands over pinned host
    copies already). The entropy stage runs while planning: each buffer the policy picks
    is compressed in memory, and kept only if it saved enough
    (:mod:`tw_triton.codecs.entropy`).

    Args:
        qstate: the encoded state. Its skeleton, params, rules and metadata must be
            JSON-serializable; buffer names must match ``[A-Za-z0-9_.-]+``.
        path: destination file.
        fsync: fsync the file and its directory (turn off only for throwaway files).
        entropy: ``"auto"`` (the default policy of :mod:`tw_triton.codecs.entropy`),
            ``None`` or ``"none"`` (every buffer raw, as format version 1 stored them), or
            an :class:`~tw_triton.codecs.entropy.EntropyPolicy`.

    Returns:
        The number of bytes in the file.

    Raises:
        CheckpointError: ``qstate`` cannot be represented (bad names, dtypes, non-JSON
            fields, a header over 100 MB).
        CheckpointIOError: the operating system failed (``errno`` kept; the original
            ``OSError`` is chained).
    """
    path = os.fspath(path)
    require_little_endian(path)
    try:
        policy = resolve_policy(entropy)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    plan = plan_file(qstate, path, policy)
    tmp = temp_path_for(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            # The checksums were taken while planning, so the header is final: one pass.
            header = encode_header(plan, path)
            f.write(header)
            write_buffers(f, plan, len(header), writeback=fsync)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            size = f.seek(0, os.SEEK_END)
        os.replace(tmp, path)
    except BaseException as exc:
        remove_quietly(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise io_error(exc, f"cannot write checkpoint {path}") from exc
        raise
    if fsync:
        try:
            fsync_directory(os.path.dirname(os.path.abspath(path)))
        except OSError as exc:
            raise io_error(
                exc, f"checkpoint {path} was written but its directory could not be fsynced"
            ) from exc
    return size


def encode_header(plan: Plan, path: str) -> bytes:
    """The length prefix and the padded JSON header of a planned file (the same bytes as
    ``json.dumps`` of the header's dicts, written as text: see
    :func:`~tw_triton.format.manifest.manifest_json`).

    Raises:
        CheckpointError: the header is over the safetensors limit, or a part of the
            manifest is not JSON.
    """
    manifest = manifest_json(plan, path)
    metadata = manifest_metadata(manifest)
    parts = ['{"__metadata__":', to_json(metadata)]
    for b in plan.buffers:
        parts.append(
            f',{quote(b.key)}:{{"dtype":{quote(b.table_dtype)},"shape":{json_ints(b.table_shape)},'
            f'"data_offsets":[{b.begin},{b.end}]}}'
        )
    parts.append("}")
    raw = "".join(parts).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint {path}: header is {len(raw)} bytes, above the {MAX_HEADER_BYTES}-byte "
            "limit of safetensors (a very large skeleton or metadata?)"
        )
    return struct.pack("<Q", len(raw)) + raw


def write_buffers(f: BinaryIO, plan: Plan, offset: int, *, writeback: bool) -> None:
    """Write the buffers in file order, the first at ``offset``. With ``writeback``, the
    kernel is asked to start putting each ``IO_CHUNK_BYTES`` on the disk as soon as it is
    written (:mod:`tw_triton.format.writeback`), so the fsync after waits for less."""
    # File writes release the GIL on large chunks, so a training thread keeps running
    # while the writer thread works.
    writeback = writeback and can_start_writeback()
    unsynced = offset  # where the bytes not yet handed to writeback begin
    for b in plan.buffers:
        view = b.data
        for start in range(0, len(view), IO_CHUNK_BYTES):
            chunk = view[start : start + IO_CHUNK_BYTES]
            f.write(chunk)
            offset += len(chunk)
            if writeback and offset - unsynced >= IO_CHUNK_BYTES:
                f.flush()  # small buffers wait in the file object's buffer otherwise
                start_writeback(f.fileno(), unsynced, offset - unsynced)
                unsynced = offset
