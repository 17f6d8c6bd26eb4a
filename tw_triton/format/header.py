"""A file's header, parsed and validated into the :class:`Layout` of its buffers, before a
reader allocates anything; and :class:`HeaderCache`, which parses each file once.

:func:`read_layout` checks the header length against the file size, the JSON (no duplicate
keys, no NaN outside the skeleton), the manifest's checksum, then the manifest
(:mod:`tw_triton.format.manifest`), that the safetensors tensor table agrees with it key by
key, and that the buffers tile the data section exactly. Every failure is a
:class:`~tw_triton.errors.CheckpointError` naming the file and, where it applies, the entry
and buffer. Why: docs/format.md.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from ..errors import CheckpointError
from .compact import manifest_text as stored_manifest
from .files import io_error
from .manifest import BufferSpec, check_fields, check_stats, validate_manifest
from .spec import (
    BUFFER_DTYPE_NAMES,
    COMPACT_VERSION,
    MANIFEST_ZSTD_KEY,
    MAX_HEADER_BYTES,
    STAGED_DTYPE,
    TENSOR_INFO_FIELDS,
    is_int,
)


@dataclass(frozen=True)
class Layout:
    """A validated header: the manifest, and every buffer's place in the file."""

    manifest: dict[str, Any]
    buffers: list[BufferSpec]  # in file order
    data_start: int
    data_size: int


def _read_exact(f: BinaryIO, n: int, path: str, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(f"checkpoint {path}: truncated: {what} needs {n} bytes, only {got} left")
        got += k
    return bytes(buf)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)  # in C; a duplicate shows as a shorter dict
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k!r}")
            seen.add(k)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _parse_json(text: str, path: str, what: str, allow_nan: bool) -> Any:
    try:
        return json.loads(
            text,
            object_pairs_hook=_reject_duplicates,
            **({} if allow_nan else {"parse_constant": _reject_constant}),
        )
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path}: {what} is not valid JSON: {exc}") from exc


def read_layout(f: BinaryIO, path: str) -> Layout:
    """Read and validate the header of the open file ``f``.

    Args:
        f: the file, positioned at its start.
        path: its path, for messages.

    Returns:
        The validated :class:`Layout`; its buffers are sorted by offset.

    Raises:
        CheckpointError: the header is malformed; CheckpointIOError if it cannot be read.
    """
    try:
        file_size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise io_error(exc, f"cannot stat checkpoint {path}") from exc
    if file_size < 8:
        raise CheckpointError(
            f"checkpoint {path}: file is {file_size} bytes, too short for the 8-byte header length"
        )
    head = _read_exact(f, 8, path, "the header length")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > file_size - 8:
        if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
            what = (
                "a zip archive (what torch.save writes)"
                if head[:1] == b"P"
                else "a pickle (torch.save's legacy format)"
            )
            raise CheckpointError(
                f"checkpoint {path}: the file is {what}, not a tw_triton checkpoint (a safetensors "
                "file); `tw convert` makes one from a weights-only torch file"
            )
        raise CheckpointError(
            f"checkpoint {path}: header length {header_len} is larger than the "
            f"{file_size - 8} bytes that follow it (truncated or not a safetensors file)"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint {path}: header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit"
        )
    raw = _read_exact(f, header_len, path, "the header")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"checkpoint {path}: header is not UTF-8: {exc}") from exc
    header = _parse_json(text, path, "the header", allow_nan=False)
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {path}: header must be a JSON object")
    data_start = 8 + header_len
    data_size = file_size - data_start

    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise CheckpointError(
            f"checkpoint {path}: expected __metadata__ to be a map of str to str "
            "(not a tw_triton checkpoint?)"
        )
    manifest_text, version = stored_manifest(meta, path)
    manifest = _parse_json(manifest_text, path, "the manifest", allow_nan=True)
    buffers = validate_manifest(manifest, path)
    if version is not None and manifest.get("version") != version:
        raise CheckpointError(
            f"checkpoint {path}: __metadata__ says format version {version}, the manifest "
            f"says {manifest.get('version')!r}"
        )
    if version is None and manifest.get("version", 0) >= COMPACT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: a format version {manifest['version']} manifest must be stored compressed "
            f"under __metadata__[{MANIFEST_ZSTD_KEY!r}]"
        )
    _validate_tensor_table(header, buffers, data_size, path)
    check_stats(manifest, buffers, data_size, path)
    buffers.sort(key=lambda s: (s.begin, s.end))
    return Layout(manifest, buffers, data_start, data_size)


def _validate_tensor_table(
    header: dict[str, Any], specs: list[BufferSpec], data_size: int, path: str
) -> None:
    """The safetensors tensor table must describe exactly the manifest's buffers."""
    by_key = {s.key: s for s in specs}
    for key, info in header.items():
        spec = by_key.get(key)
        if spec is None:
            raise CheckpointError(
                f"checkpoint {path}: tensor {key!r} is in the file but no manifest entry names it"
            )
        bwhere = spec.where(path)
        check_fields(info, TENSOR_INFO_FIELDS, f"{bwhere} (tensor table)")
        if len(info) != len(TENSOR_INFO_FIELDS):
            raise CheckpointError(f"{bwhere}: unexpected fields in the tensor table: {sorted(info)}")
        staged = spec.stage is not None
        expected = {
            "dtype": STAGED_DTYPE if staged else BUFFER_DTYPE_NAMES[spec.dtype],
            "shape": [spec.nbytes] if staged else list(spec.shape),
            "data_offsets": [spec.begin, spec.end],
        }
        for field_name, value in expected.items():
            if info[field_name] != value or (
                field_name != "dtype" and not all(is_int(v) for v in info[field_name])
            ):
                raise CheckpointError(
                    f"{bwhere}: tensor table says {field_name} {info[field_name]!r}, "
                    f"the manifest says {value!r}"
                )
    missing = [s for s in specs if s.key not in header]
    if missing:
        s = missing[0]
        raise CheckpointError(
            f"{s.where(path)}: tensor {s.key!r} is missing from the file ({len(missing)} missing in all)"
        )
    # Buffers must tile the data section exactly: in range, no overlap, no gap, no tail.
    # Range first, so that the message names the buffer that points outside the file.
    for s in specs:
        if s.end > data_size:
            raise CheckpointError(
                f"{s.where(path)}: data_offsets end at {s.end}, past the {data_size} data "
                "bytes in the file (truncated?)"
            )
    pos = 0
    for s in sorted(specs, key=lambda s: (s.begin, s.end)):
        if s.begin != pos:
            kind = "overlaps the previous buffer" if s.begin < pos else "leaves a gap before it"
            raise CheckpointError(
                f"{s.where(path)}: data_offsets [{s.begin}, {s.end}] {kind} (expected it to begin at {pos})"
            )
        pos = s.end
    if pos != data_size:
        raise CheckpointError(
            f"checkpoint {path}: buffers cover {pos} data bytes but the file holds {data_size} "
            "(truncated, or bytes appended)"
        )


class HeaderCache:
    """Validated headers of checkpoint files, kept while each file stays the same.

    Loading a checkpoint reads headers more than once: a directory listing reads every
    file's manifest (ids, kinds), then the reads of a chain read those of its files again.
    :func:`~tw_triton.format.read_manifest`, :func:`~tw_triton.format.read_file` and
    :func:`~tw_triton.format.verify_file` given a cache parse each file once. A file is the
    same while its device, inode, size and modification time (ns) are: a rewrite or a rename
    over it is a new file, and a cached header is only used for the file descriptor it was
    checked against.

    The manifests are shared by everything read through the cache: treat them as read-only.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._layouts: dict[str, tuple[tuple[int, int, int, int], Layout]] = {}
        self._lock = threading.Lock()

    def layout(self, f: BinaryIO, path: str) -> Layout:
        """The validated header of the open file ``f`` (at ``path``), parsed at most once."""
        try:
            st = os.fstat(f.fileno())
        except OSError as exc:
            raise io_error(exc, f"cannot stat checkpoint {path}") from exc
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._layouts.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        layout = read_layout(f, path)
        with self._lock:
            self._layouts[path] = (key, layout)
        return layout

    def retain(self, paths: Iterable[str]) -> None:
        """Forget the headers of every file but ``paths`` (say, those still listed)."""
        keep = set(paths)
        with self._lock:
            for path in [p for p in self._layouts if p not in keep]:
                del self._layouts[path]

    def __len__(self) -> int:
        with self._lock:
            return len(self._layouts)


def layout_of(f: BinaryIO, path: str, headers: HeaderCache | None) -> Layout:
    """The validated header of ``f``: from ``headers`` if given, else parsed now."""
    return read_layout(f, path) if headers is None else headers.layout(f, path)
