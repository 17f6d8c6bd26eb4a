"""A checkpoint file's header: parsed and validated, into the layout of its buffers.

What :mod:`tw_triton.format` specifies (its module docs hold the layout and the manifest
schema) is checked here, before a reader allocates anything: the header length against the
file size, the JSON (no duplicate keys, no NaN outside the skeleton), the manifest's checksum,
schema and version, every buffer's dtype, shape, offsets and stage record, that the
manifest and the safetensors tensor table agree key by key, and the manifest's stats. The
result, :class:`_Layout`, is what the readers of :mod:`tw_triton.format` read buffers by.

Every failure is a :class:`~tw_triton.errors.CheckpointError` naming the file and, where it
applies, the entry and buffer and what was expected.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .codecs.entropy import Stage, get_stage, stage_names
from .errors import CheckpointError, CheckpointIOError

FORMAT_NAME = "tw_triton"
FORMAT_VERSION = 2
# Versions this reader reads: 1 (no entropy stage) and 2 (buffers may carry a stage).
READABLE_VERSIONS = (1, 2)

# Keys of the safetensors ``__metadata__`` map.
MANIFEST_KEY = "tw_triton"
MANIFEST_CRC_KEY = "tw_triton.crc32"
CHECKSUM_NAME = "crc32"

# safetensors refuses headers above this size; staying under it keeps files readable there.
MAX_HEADER_BYTES = 100_000_000

BUFFER_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_CRC_RE = re.compile(r"[0-9a-f]{8}")

# safetensors dtype names and the torch dtypes they hold (only those this torch has).
_SAFETENSORS_DTYPE_NAMES = (
    ("F64", "float64"),
    ("F32", "float32"),
    ("F16", "float16"),
    ("BF16", "bfloat16"),
    ("I64", "int64"),
    ("I32", "int32"),
    ("I16", "int16"),
    ("I8", "int8"),
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("U8", "uint8"),
    ("BOOL", "bool"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("C64", "complex64"),
)
BUFFER_DTYPES: dict[str, torch.dtype] = {
    st: getattr(torch, name) for st, name in _SAFETENSORS_DTYPE_NAMES if hasattr(torch, name)
}
_BUFFER_DTYPE_NAMES: dict[torch.dtype, str] = {dt: st for st, dt in BUFFER_DTYPES.items()}
# An entry's original dtype is only recorded (the codec decodes to it), so it may be any
# dtype a buffer may be, plus complex128 (an exact codec can store it as a float64 view).
ENTRY_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in [n for _, n in _SAFETENSORS_DTYPE_NAMES] + ["complex128"]
    if hasattr(torch, name)
}
_ENTRY_DTYPE_NAMES: dict[torch.dtype, str] = {dt: n for n, dt in ENTRY_DTYPES.items()}

# Any tensor torch can hold has fewer bytes than this.
_MAX_TENSOR_BYTES = 1 << 63
# Dimensions below this take _check_shape's fast path (two of them multiply to under 2**62).
_SMALL_DIM = 1 << 31

_MANIFEST_FIELDS = (
    "format",
    "version",
    "checkpoint_id",
    "reference_id",
    "checksum",
    "entries",
    "aliases",
    "skeleton",
    "rules",
    "metadata",
    "stats",
)
_ENTRY_FIELDS = ("codec", "params", "dtype", "shape", "buffers")
_BUFFER_FIELDS = ("key", "dtype", "shape", "data_offsets", "crc32")
_STAGE_FIELDS = ("name", "params", "raw_nbytes")
# The safetensors dtype of a staged buffer's stored bytes.
_STAGED_DTYPE = "U8"
_TENSOR_INFO_FIELDS = ("dtype", "shape", "data_offsets")
_STATS_FIELDS = ("raw_bytes", "stored_bytes", "entries", "buffers")
_ENTRY_FIELD_SET = frozenset(_ENTRY_FIELDS)
_BUFFER_FIELD_SET = frozenset(_BUFFER_FIELDS)


def tensor_key(entry_path: str, buffer_name: str) -> str:
    """The safetensors key of one buffer: ``"<entry path>:<buffer name>"``."""
    return f"{entry_path}:{buffer_name}"


def _io_error(exc: OSError, message: str) -> CheckpointIOError:
    detail = exc.strerror or str(exc)
    if exc.errno is None:
        return CheckpointIOError(f"{message}: {detail}")
    return CheckpointIOError(exc.errno, f"{message}: {detail}")


# Not frozen: a header of hundreds of buffers makes one each, and a frozen dataclass's
# __init__ costs five times as much. Nothing changes a spec once made.
@dataclass(slots=True)
class _BufferSpec:
    entry: str
    name: str
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    crc32: int  # of the stored bytes
    stage: Stage | None = None
    stage_params: dict[str, Any] | None = None
    raw_nbytes: int = 0  # the decoded size of a staged buffer

    @property
    def nbytes(self) -> int:
        """Stored bytes in the file."""
        return self.end - self.begin


def _where(path: str, spec: _BufferSpec) -> str:
    return _buffer_where(path, spec.entry, spec.name)


def _buffer_where(path: str, entry: str, name: str) -> str:
    return f"checkpoint {path}: entry {entry!r} buffer {name!r}"


class _Where:
    """A message's "where" made only when a message needs it (str() of it)."""

    __slots__ = ("path", "entry", "name")

    def __init__(self, path: str, entry: str, name: str) -> None:
        self.path, self.entry, self.name = path, entry, name

    def __str__(self) -> str:
        return _buffer_where(self.path, self.entry, self.name)


@dataclass(frozen=True)
class _Layout:
    manifest: dict[str, Any]
    buffers: list[_BufferSpec]  # in file order
    data_start: int
    data_size: int


def _read_exact(f: BinaryIO, n: int, path: str, what: str) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(
                f"checkpoint {path}: truncated: {what} needs {n} bytes, only {got} left"
            )
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


def _read_layout(f: BinaryIO, path: str) -> _Layout:
    try:
        file_size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise _io_error(exc, f"cannot stat checkpoint {path}") from exc
    if file_size < 8:
        raise CheckpointError(
            f"checkpoint {path}: file is {file_size} bytes, too short for the 8-byte header length"
        )
    (header_len,) = struct.unpack("<Q", _read_exact(f, 8, path, "the header length"))
    if header_len > file_size - 8:
        raise CheckpointError(
            f"checkpoint {path}: header length {header_len} is larger than the "
            f"{file_size - 8} bytes that follow it (truncated or not a safetensors file)"
        )
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint {path}: header length {header_len} exceeds the "
            f"{MAX_HEADER_BYTES}-byte limit"
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
    if MANIFEST_KEY not in meta:
        raise CheckpointError(
            f"checkpoint {path}: no {MANIFEST_KEY!r} manifest in __metadata__ "
            "(a plain safetensors file, not a tw_triton checkpoint)"
        )
    manifest_text = meta[MANIFEST_KEY]
    stored_crc = meta.get(MANIFEST_CRC_KEY)
    if not isinstance(stored_crc, str) or not _CRC_RE.fullmatch(stored_crc):
        raise CheckpointError(
            f"checkpoint {path}: expected __metadata__[{MANIFEST_CRC_KEY!r}] to be 8 hex digits"
        )
    actual_crc = zlib.crc32(manifest_text.encode("utf-8", "surrogatepass"))
    if actual_crc != int(stored_crc, 16):
        raise CheckpointError(
            f"checkpoint {path}: manifest checksum mismatch (expected crc32 {stored_crc}, "
            f"computed {actual_crc:08x}): the header is corrupted"
        )
    manifest = _parse_json(manifest_text, path, "the manifest", allow_nan=True)
    buffers = _validate_manifest(manifest, path)
    _validate_tensor_table(header, buffers, data_size, path)
    _check_stats(manifest, buffers, data_size, path)
    buffers.sort(key=lambda s: (s.begin, s.end))
    return _Layout(manifest, buffers, data_start, data_size)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_fields(obj: Any, fields: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    missing = [k for k in fields if k not in obj]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")


def _check_shape(shape: Any, itemsize: int, where: str | _Where) -> int:
    """Validate a shape; return its element count.

    The bound is on the product of the dimensions counting zeros as ones: torch computes
    strides from it, so ``[0, 2**40, 2**40]`` (no elements) would still overflow them.
    """
    if type(shape) is list and len(shape) <= 2:
        # Most buffers and entries: a vector or a matrix of ints read from JSON. With both
        # dimensions under 2**31 the bound below is the same test on the product itself (a
        # zero dimension leaves the other, far under it).
        if all(type(s) is int and 0 <= s < _SMALL_DIM for s in shape):
            n = 1
            for s in shape:
                n *= s
            if n * itemsize < _MAX_TENSOR_BYTES:
                return n
    if not isinstance(shape, (list, tuple)) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(
            f"{where}: shape must be a list of non-negative ints, found {shape!r}"
        )
    extent = 1
    for s in shape:
        extent *= max(s, 1)
        # Stop multiplying early, so an absurd shape costs no time.
        if extent * itemsize >= _MAX_TENSOR_BYTES:
            raise CheckpointError(
                f"{where}: shape {list(shape)} spans 2**63 bytes or more of "
                f"{itemsize}-byte elements"
            )
    return math.prod(shape)


def _validate_manifest(manifest: Any, path: str) -> list[_BufferSpec]:
    where = f"checkpoint {path}: manifest"
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: expected a JSON object")
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(
            f"{where}: expected format {FORMAT_NAME!r}, found {manifest.get('format')!r}"
        )
    version = manifest.get("version")
    if not _is_int(version) or version not in READABLE_VERSIONS:
        newer = _is_int(version) and version > FORMAT_VERSION
        raise CheckpointError(
            f"{where}: unknown format version {version!r}, this tw_triton reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
            + (" (written by a newer tw_triton?)" if newer else "")
        )
    _check_fields(manifest, _MANIFEST_FIELDS, where)
    if not isinstance(manifest["checkpoint_id"], str):
        raise CheckpointError(f"{where}: checkpoint_id must be a string")
    if manifest["reference_id"] is not None and not isinstance(manifest["reference_id"], str):
        raise CheckpointError(f"{where}: reference_id must be a string or null")
    if manifest["checksum"] != CHECKSUM_NAME:
        raise CheckpointError(
            f"{where}: expected checksum {CHECKSUM_NAME!r}, found {manifest['checksum']!r}"
        )
    if not isinstance(manifest["rules"], list):
        raise CheckpointError(f"{where}: rules must be a list")
    if not isinstance(manifest["metadata"], dict):
        raise CheckpointError(f"{where}: metadata must be an object")
    entries = manifest["entries"]
    if not isinstance(entries, dict):
        raise CheckpointError(f"{where}: entries must be an object")
    specs: list[_BufferSpec] = []
    # The messages' "where" strings are made only for a buffer that fails: a manifest holds
    # hundreds of buffers, and this runs before anything of a load can start.
    for entry_path, entry in entries.items():
        if type(entry) is not dict or not entry.keys() >= _ENTRY_FIELD_SET:
            _check_fields(entry, _ENTRY_FIELDS, f"checkpoint {path}: entry {entry_path!r}")
        if not isinstance(entry["codec"], str) or not entry["codec"]:
            raise CheckpointError(f"checkpoint {path}: entry {entry_path!r}: codec must be a non-empty string")
        if not isinstance(entry["params"], dict):
            raise CheckpointError(f"checkpoint {path}: entry {entry_path!r}: params must be an object")
        dtype = ENTRY_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(
                f"checkpoint {path}: entry {entry_path!r}: unknown dtype {entry['dtype']!r}, "
                f"expected one of {sorted(ENTRY_DTYPES)}"
            )
        _check_shape(entry["shape"], dtype.itemsize, f"checkpoint {path}: entry {entry_path!r}")
        if not isinstance(entry["buffers"], dict):
            raise CheckpointError(f"checkpoint {path}: entry {entry_path!r}: buffers must be an object")
        for name, buf in entry["buffers"].items():
            if not BUFFER_NAME_RE.fullmatch(name):
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: buffer names must match [A-Za-z0-9_.-]+"
                )
            if type(buf) is not dict or not buf.keys() >= _BUFFER_FIELD_SET:
                _check_fields(buf, _BUFFER_FIELDS, _buffer_where(path, entry_path, name))
            key = tensor_key(entry_path, name)
            if buf["key"] != key:
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: expected tensor key {key!r}, "
                    f"found {buf['key']!r}"
                )
            bdtype = BUFFER_DTYPES.get(buf["dtype"]) if isinstance(buf["dtype"], str) else None
            if bdtype is None:
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: unknown dtype {buf['dtype']!r}, "
                    f"expected one of {sorted(BUFFER_DTYPES)}"
                )
            shape = buf["shape"]
            numel = _check_shape(shape, bdtype.itemsize, _Where(path, entry_path, name))
            offsets = buf["data_offsets"]
            if not (
                isinstance(offsets, list) and len(offsets) == 2
                and (type(offsets[0]) is int or _is_int(offsets[0]))
                and (type(offsets[1]) is int or _is_int(offsets[1]))
            ):
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: data_offsets must be [begin, end], "
                    f"found {offsets!r}"
                )
            begin, end = offsets
            stage = None
            if "stage" in buf:
                bwhere = _buffer_where(path, entry_path, name)
                if version < 2:
                    raise CheckpointError(
                        f"{bwhere}: a stage record needs format version 2, the file says {version}"
                    )
                stage = _validate_stage(buf["stage"], bdtype.itemsize, numel * bdtype.itemsize, buf, bwhere)
                if not 0 <= begin <= end:
                    raise CheckpointError(f"{bwhere}: data_offsets {offsets} are not [begin, end]")
            elif not 0 <= begin <= end or end - begin != numel * bdtype.itemsize:
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: data_offsets {offsets} do not span "
                    f"shape {buf['shape']} of {buf['dtype']} ({numel * bdtype.itemsize} bytes)"
                )
            crc = buf["crc32"]
            if not isinstance(crc, str) or not _CRC_RE.fullmatch(crc):
                raise CheckpointError(
                    f"{_buffer_where(path, entry_path, name)}: crc32 must be 8 lowercase hex "
                    f"digits, found {crc!r}"
                )
            specs.append(
                _BufferSpec(
                    entry_path, name, key, bdtype, tuple(shape), begin, end, int(crc, 16),
                    *(() if stage is None else (stage, buf["stage"]["params"], buf["stage"]["raw_nbytes"])),
                )
            )
    aliases = manifest["aliases"]
    if not isinstance(aliases, dict):
        raise CheckpointError(f"{where}: aliases must be an object")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in entries:
            raise CheckpointError(
                f"checkpoint {path}: alias {alias!r} must name an entry, found {target!r}"
            )
        if alias in entries:
            raise CheckpointError(f"checkpoint {path}: alias {alias!r} is also an entry")
    return specs


def _validate_stage(record: Any, itemsize: int, raw_nbytes: int, buf: dict[str, Any], where: str) -> Stage:
    """A buffer's stage record: a known stage, its params, and the raw size its shape gives."""
    swhere = f"{where} stage"
    _check_fields(record, _STAGE_FIELDS, swhere)
    if len(record) != len(_STAGE_FIELDS):
        raise CheckpointError(f"{swhere}: unexpected fields {sorted(set(record) - set(_STAGE_FIELDS))}")
    name = record["name"]
    stage = get_stage(name) if isinstance(name, str) else None
    if stage is None:
        raise CheckpointError(f"{swhere}: unknown entropy stage {name!r}, expected one of {stage_names()}")
    if not _is_int(record["raw_nbytes"]) or record["raw_nbytes"] != raw_nbytes:
        raise CheckpointError(
            f"{swhere}: raw_nbytes {record['raw_nbytes']!r} does not match shape {buf['shape']} of "
            f"{buf['dtype']} ({raw_nbytes} bytes)"
        )
    stage.check_params(record["params"], itemsize, swhere)
    return stage


def _validate_tensor_table(
    header: dict[str, Any], specs: list[_BufferSpec], data_size: int, path: str
) -> None:
    """The safetensors tensor table must describe exactly the manifest's buffers."""
    by_key = {s.key: s for s in specs}
    for key, info in header.items():
        spec = by_key.get(key)
        if spec is None:
            raise CheckpointError(
                f"checkpoint {path}: tensor {key!r} is in the file but no manifest entry names it"
            )
        bwhere = f"checkpoint {path}: entry {spec.entry!r} buffer {spec.name!r}"
        _check_fields(info, _TENSOR_INFO_FIELDS, f"{bwhere} (tensor table)")
        if len(info) != len(_TENSOR_INFO_FIELDS):
            raise CheckpointError(
                f"{bwhere}: unexpected fields in the tensor table: {sorted(info)}"
            )
        staged = spec.stage is not None
        expected = {
            "dtype": _STAGED_DTYPE if staged else _BUFFER_DTYPE_NAMES[spec.dtype],
            "shape": [spec.nbytes] if staged else list(spec.shape),
            "data_offsets": [spec.begin, spec.end],
        }
        for field_name, value in expected.items():
            if info[field_name] != value or (
                field_name != "dtype" and not all(_is_int(v) for v in info[field_name])
            ):
                raise CheckpointError(
                    f"{bwhere}: tensor table says {field_name} {info[field_name]!r}, "
                    f"the manifest says {value!r}"
                )
    missing = [s for s in specs if s.key not in header]
    if missing:
        s = missing[0]
        raise CheckpointError(
            f"checkpoint {path}: entry {s.entry!r} buffer {s.name!r}: tensor {s.key!r} is "
            f"missing from the file ({len(missing)} missing in all)"
        )
    # Buffers must tile the data section exactly: in range, no overlap, no gap, no tail.
    # Range first, so that the message names the buffer that points outside the file.
    for s in specs:
        if s.end > data_size:
            raise CheckpointError(
                f"checkpoint {path}: entry {s.entry!r} buffer {s.name!r}: data_offsets end at "
                f"{s.end}, past the {data_size} data bytes in the file (truncated?)"
            )
    pos = 0
    for s in sorted(specs, key=lambda s: (s.begin, s.end)):
        if s.begin != pos:
            kind = "overlaps the previous buffer" if s.begin < pos else "leaves a gap before it"
            raise CheckpointError(
                f"checkpoint {path}: entry {s.entry!r} buffer {s.name!r}: data_offsets "
                f"[{s.begin}, {s.end}] {kind} (expected it to begin at {pos})"
            )
        pos = s.end
    if pos != data_size:
        raise CheckpointError(
            f"checkpoint {path}: buffers cover {pos} data bytes but the file holds {data_size} "
            "(truncated, or bytes appended)"
        )


def _check_stats(
    manifest: dict[str, Any], specs: list[_BufferSpec], data_size: int, path: str
) -> None:
    stats = manifest["stats"]
    where = f"checkpoint {path}: manifest stats"
    _check_fields(stats, _STATS_FIELDS, where)
    if not all(_is_int(stats[k]) and stats[k] >= 0 for k in _STATS_FIELDS):
        raise CheckpointError(f"{where}: expected non-negative ints, found {stats!r}")
    expected = {
        "stored_bytes": data_size,
        "entries": len(manifest["entries"]),
        "buffers": len(specs),
    }
    for k, v in expected.items():
        if stats[k] != v:
            raise CheckpointError(f"{where}: expected {k} {v}, found {stats[k]}")
