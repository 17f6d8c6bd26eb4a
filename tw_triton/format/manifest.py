"""The manifest, both ways: its JSON text as the writer writes it, its validation as the
reader checks it (into the :class:`BufferSpec` of every buffer), and a validated manifest
with its buffers as a :class:`~tw_triton.qstate.QuantizedState`.

The schema is in :mod:`tw_triton.format.spec`; the header around the manifest is
:mod:`tw_triton.format.header`. Every failure is a :class:`~tw_triton.errors.CheckpointError`
naming the file and, where it applies, the entry and buffer. Why: docs/format.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

# What json.dumps does with a str under ensure_ascii (the same C function), without the
# encoder object each json.dumps call builds: a header quotes thousands of strings. Only
# for values known to be str; anything else goes through to_json.
from json.encoder import encode_basestring_ascii as quote
from typing import TYPE_CHECKING, Any

import torch

from ..codecs.entropy import Stage, get_stage, stage_names
from ..errors import CheckpointError
from ..qstate import EncodedEntry, QuantizedState
from .spec import (
    BUFFER_DTYPES,
    BUFFER_FIELDS,
    BUFFER_NAME_RE,
    CHECKSUM_NAME,
    CRC_RE,
    ENTRY_DTYPE_NAMES,
    ENTRY_DTYPES,
    ENTRY_FIELDS,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FIELDS,
    READABLE_VERSIONS,
    STAGE_FIELDS,
    STATS_FIELDS,
    check_shape,
    is_int,
    tensor_key,
)

if TYPE_CHECKING:
    from .plan import Plan

_ENTRY_FIELD_SET = frozenset(ENTRY_FIELDS)
_BUFFER_FIELD_SET = frozenset(BUFFER_FIELDS)


# Not frozen: a header of hundreds of buffers makes one each, and a frozen dataclass's
# __init__ costs five times as much. Nothing changes a spec once made.
@dataclass(slots=True)
class BufferSpec:
    """One buffer of a validated file: where its stored bytes are and what they decode to."""

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

    def where(self, path: str) -> str:
        """``"checkpoint <path>: entry <entry> buffer <name>"``, for messages."""
        return buffer_where(path, self.entry, self.name)


def buffer_where(path: str, entry: str, name: str) -> str:
    """How a message names one buffer of one file."""
    return f"checkpoint {path}: entry {entry!r} buffer {name!r}"


class _Where:
    """A message's "where" made only when a message needs it (str() of it)."""

    __slots__ = ("path", "entry", "name")

    def __init__(self, path: str, entry: str, name: str) -> None:
        self.path, self.entry, self.name = path, entry, name

    def __str__(self) -> str:
        return buffer_where(self.path, self.entry, self.name)


# --------------------------------------------------------------------------------------
# Writing: the manifest's JSON text
# --------------------------------------------------------------------------------------


def to_json(value: Any) -> str:
    """Compact, ASCII-only JSON text of ``value``: how every part of a header is written."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def json_ints(values: Iterable[int]) -> str:
    """A JSON array of ints, as :func:`to_json` writes it."""
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def checked_json(value: Any, what: str, path: str) -> str:
    """:func:`to_json` of one part of the manifest; a failure names that part."""
    try:
        return to_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path}: {what} is not JSON-serializable: {exc}") from exc


# Param values that equal each other only when json.dumps writes them alike (not floats:
# -0.0 == 0.0; not containers: (1,) == (True,)).
_MEMO_TYPES = frozenset({str, int, bool, type(None)})


def params_json(params: dict[str, Any], memo: dict[Any, str], what: str, path: str) -> str:
    """:func:`checked_json` of an entry's params, once per distinct params dict of str keys
    and plain scalar values (most entries of a state share a handful, and most have none)."""
    if type(params) is not dict or not all(
        type(k) is str and type(v) in _MEMO_TYPES for k, v in params.items()
    ):
        return checked_json(params, what, path)
    key = tuple((k, type(v), v) for k, v in params.items())
    text = memo.get(key)
    if text is None:
        text = memo[key] = checked_json(params, what, path)
    return text


# The manifest is written as JSON text piece by piece, the same bytes as json.dumps of the
# nested dicts would give (tests/format/test_format.py checks it): a dict and two lists per buffer
# and per entry, built all at once, would be thousands of objects alive together while the
# writer thread runs, which Python's collector then promotes towards a full collection.
# Strings are not tracked by the collector.
def manifest_json(plan: Plan, path: str) -> str:
    """The manifest's JSON text of a planned file (see :mod:`tw_triton.format.spec`)."""
    q = plan.qstate
    parts = [
        '{"format":',
        to_json(FORMAT_NAME),
        ',"version":',
        to_json(FORMAT_VERSION),
        ',"checkpoint_id":',
        to_json(q.checkpoint_id),
        ',"reference_id":',
        to_json(q.reference_id),
        ',"checksum":',
        to_json(CHECKSUM_NAME),
        ',"entries":{',
    ]
    memo: dict[Any, str] = {}
    # The plan checked that entry paths, codecs and buffer names are str; keys and dtype
    # names are made here.
    for i, (entry_path, entry) in enumerate(q.entries.items()):
        params = params_json(entry.params, memo, f"entry {entry_path!r} params", path)
        parts.append(
            f'{"," if i else ""}{quote(entry_path)}:{{"codec":{quote(entry.codec)},"params":{params},'
            f'"dtype":{quote(ENTRY_DTYPE_NAMES[entry.dtype])},"shape":{json_ints(entry.shape)},"buffers":{{'
        )
        for j, (name, b) in enumerate(plan.by_entry[entry_path].items()):
            stage = "" if b.stage is None else ',"stage":' + to_json(b.stage)
            parts.append(
                f'{"," if j else ""}{quote(name)}:{{"key":{quote(b.key)},"dtype":{quote(b.st_dtype)},'
                f'"shape":{json_ints(b.tensor.shape)},"data_offsets":[{b.begin},{b.end}],'
                f'"crc32":"{b.crc32:08x}"{stage}}}'
            )
        parts.append("}}")
    stats = {
        "raw_bytes": sum(e.raw_nbytes for e in q.entries.values()),
        "stored_bytes": plan.data_size,
        "entries": len(q.entries),
        "buffers": len(plan.buffers),
    }
    parts += [
        '},"aliases":',
        to_json(dict(q.aliases)),
        ',"skeleton":',
        checked_json(q.skeleton, "skeleton", path),
        ',"rules":',
        checked_json(q.rules, "rules", path),
        ',"metadata":',
        checked_json(q.metadata, "metadata", path),
        ',"stats":',
        to_json(stats),
        "}",
    ]
    return "".join(parts)


# --------------------------------------------------------------------------------------
# Reading: validation
# --------------------------------------------------------------------------------------


def check_fields(obj: Any, fields: tuple[str, ...], where: str) -> None:
    """Raise unless ``obj`` is a JSON object holding every one of ``fields``."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    missing = [k for k in fields if k not in obj]
    if missing:
        raise CheckpointError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")


def validate_manifest(manifest: Any, path: str) -> list[BufferSpec]:
    """Check a parsed manifest against the schema (fields, version, every entry and buffer
    record, every stage record, the aliases).

    Args:
        manifest: the manifest's parsed JSON.
        path: the file, for messages.

    Returns:
        The spec of every buffer, in manifest order (not yet checked against the tensor
        table or the file's size: :func:`tw_triton.format.header.read_layout` does that).

    Raises:
        CheckpointError: the first thing found wrong, naming it.
    """
    where = f"checkpoint {path}: manifest"
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where}: expected a JSON object")
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{where}: expected format {FORMAT_NAME!r}, found {manifest.get('format')!r}")
    version = manifest.get("version")
    if not is_int(version) or version not in READABLE_VERSIONS:
        newer = is_int(version) and version > FORMAT_VERSION
        raise CheckpointError(
            f"{where}: unknown format version {version!r}, this tw_triton reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
            + (" (written by a newer tw_triton?)" if newer else "")
        )
    check_fields(manifest, MANIFEST_FIELDS, where)
    if not isinstance(manifest["checkpoint_id"], str):
        raise CheckpointError(f"{where}: checkpoint_id must be a string")
    if manifest["reference_id"] is not None and not isinstance(manifest["reference_id"], str):
        raise CheckpointError(f"{where}: reference_id must be a string or null")
    if manifest["checksum"] != CHECKSUM_NAME:
        raise CheckpointError(f"{where}: expected checksum {CHECKSUM_NAME!r}, found {manifest['checksum']!r}")
    if not isinstance(manifest["rules"], list):
        raise CheckpointError(f"{where}: rules must be a list")
    if not isinstance(manifest["metadata"], dict):
        raise CheckpointError(f"{where}: metadata must be an object")
    entries = manifest["entries"]
    if not isinstance(entries, dict):
        raise CheckpointError(f"{where}: entries must be an object")
    specs: list[BufferSpec] = []
    # The messages' "where" strings are made only for a buffer that fails: a manifest holds
    # hundreds of buffers, and this runs before anything of a load can start.
    for entry_path, entry in entries.items():
        if type(entry) is not dict or not entry.keys() >= _ENTRY_FIELD_SET:
            check_fields(entry, ENTRY_FIELDS, f"checkpoint {path}: entry {entry_path!r}")
        if not isinstance(entry["codec"], str) or not entry["codec"]:
            raise CheckpointError(
                f"checkpoint {path}: entry {entry_path!r}: codec must be a non-empty string"
            )
        if not isinstance(entry["params"], dict):
            raise CheckpointError(f"checkpoint {path}: entry {entry_path!r}: params must be an object")
        dtype = ENTRY_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise CheckpointError(
                f"checkpoint {path}: entry {entry_path!r}: unknown dtype {entry['dtype']!r}, "
                f"expected one of {sorted(ENTRY_DTYPES)}"
            )
        check_shape(entry["shape"], dtype.itemsize, f"checkpoint {path}: entry {entry_path!r}")
        if not isinstance(entry["buffers"], dict):
            raise CheckpointError(f"checkpoint {path}: entry {entry_path!r}: buffers must be an object")
        for name, buf in entry["buffers"].items():
            specs.append(_validate_buffer(path, entry_path, name, buf, version))
    aliases = manifest["aliases"]
    if not isinstance(aliases, dict):
        raise CheckpointError(f"{where}: aliases must be an object")
    for alias, target in aliases.items():
        if not isinstance(target, str) or target not in entries:
            raise CheckpointError(f"checkpoint {path}: alias {alias!r} must name an entry, found {target!r}")
        if alias in entries:
            raise CheckpointError(f"checkpoint {path}: alias {alias!r} is also an entry")
    return specs


def _validate_buffer(path: str, entry_path: str, name: str, buf: Any, version: int) -> BufferSpec:
    """One buffer record of an entry, as a :class:`BufferSpec`."""
    if not BUFFER_NAME_RE.fullmatch(name):
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: buffer names must match [A-Za-z0-9_.-]+"
        )
    if type(buf) is not dict or not buf.keys() >= _BUFFER_FIELD_SET:
        check_fields(buf, BUFFER_FIELDS, buffer_where(path, entry_path, name))
    key = tensor_key(entry_path, name)
    if buf["key"] != key:
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: expected tensor key {key!r}, found {buf['key']!r}"
        )
    bdtype = BUFFER_DTYPES.get(buf["dtype"]) if isinstance(buf["dtype"], str) else None
    if bdtype is None:
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: unknown dtype {buf['dtype']!r}, "
            f"expected one of {sorted(BUFFER_DTYPES)}"
        )
    shape = buf["shape"]
    numel = check_shape(shape, bdtype.itemsize, _Where(path, entry_path, name))
    offsets = buf["data_offsets"]
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and (type(offsets[0]) is int or is_int(offsets[0]))
        and (type(offsets[1]) is int or is_int(offsets[1]))
    ):
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: data_offsets must be [begin, end], found {offsets!r}"
        )
    begin, end = offsets
    stage = None
    if "stage" in buf:
        bwhere = buffer_where(path, entry_path, name)
        if version < 2:
            raise CheckpointError(f"{bwhere}: a stage record needs format version 2, the file says {version}")
        stage = _validate_stage(buf["stage"], bdtype.itemsize, numel * bdtype.itemsize, buf, bwhere)
        if not 0 <= begin <= end:
            raise CheckpointError(f"{bwhere}: data_offsets {offsets} are not [begin, end]")
    elif not 0 <= begin <= end or end - begin != numel * bdtype.itemsize:
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: data_offsets {offsets} do not span "
            f"shape {buf['shape']} of {buf['dtype']} ({numel * bdtype.itemsize} bytes)"
        )
    crc = buf["crc32"]
    if not isinstance(crc, str) or not CRC_RE.fullmatch(crc):
        raise CheckpointError(
            f"{buffer_where(path, entry_path, name)}: crc32 must be 8 lowercase hex digits, found {crc!r}"
        )
    return BufferSpec(
        entry_path,
        name,
        key,
        bdtype,
        tuple(shape),
        begin,
        end,
        int(crc, 16),
        *(() if stage is None else (stage, buf["stage"]["params"], buf["stage"]["raw_nbytes"])),
    )


def _validate_stage(record: Any, itemsize: int, raw_nbytes: int, buf: dict[str, Any], where: str) -> Stage:
    """A buffer's stage record: a known stage, its params, and the raw size its shape gives."""
    swhere = f"{where} stage"
    check_fields(record, STAGE_FIELDS, swhere)
    if len(record) != len(STAGE_FIELDS):
        raise CheckpointError(f"{swhere}: unexpected fields {sorted(set(record) - set(STAGE_FIELDS))}")
    name = record["name"]
    stage = get_stage(name) if isinstance(name, str) else None
    if stage is None:
        raise CheckpointError(f"{swhere}: unknown entropy stage {name!r}, expected one of {stage_names()}")
    if not is_int(record["raw_nbytes"]) or record["raw_nbytes"] != raw_nbytes:
        raise CheckpointError(
            f"{swhere}: raw_nbytes {record['raw_nbytes']!r} does not match shape {buf['shape']} of "
            f"{buf['dtype']} ({raw_nbytes} bytes)"
        )
    stage.check_params(record["params"], itemsize, swhere)
    return stage


def check_stats(manifest: dict[str, Any], specs: list[BufferSpec], data_size: int, path: str) -> None:
    """The manifest's stats must count what the file holds."""
    stats = manifest["stats"]
    where = f"checkpoint {path}: manifest stats"
    check_fields(stats, STATS_FIELDS, where)
    if not all(is_int(stats[k]) and stats[k] >= 0 for k in STATS_FIELDS):
        raise CheckpointError(f"{where}: expected non-negative ints, found {stats!r}")
    expected = {
        "stored_bytes": data_size,
        "entries": len(manifest["entries"]),
        "buffers": len(specs),
    }
    for k, v in expected.items():
        if stats[k] != v:
            raise CheckpointError(f"{where}: expected {k} {v}, found {stats[k]}")


def to_qstate(
    manifest: dict[str, Any], tensors: dict[tuple[str, str], torch.Tensor], only: set[str] | None = None
) -> QuantizedState:
    """A validated manifest and its buffers, by ``(entry, buffer name)``, as the state they
    were written from (``only``: these entries, and the aliases of them)."""
    entries: dict[str, EncodedEntry] = {}
    for entry_path, entry in manifest["entries"].items():
        if only is not None and entry_path not in only:
            continue
        entries[entry_path] = EncodedEntry(
            codec=entry["codec"],
            params=dict(entry["params"]),  # the manifest may be a HeaderCache's: not shared
            shape=tuple(entry["shape"]),
            dtype=ENTRY_DTYPES[entry["dtype"]],
            buffers={name: tensors[(entry_path, name)] for name in entry["buffers"]},
        )
    return QuantizedState(
        entries=entries,
        skeleton=manifest["skeleton"],
        checkpoint_id=manifest["checkpoint_id"],
        reference_id=manifest["reference_id"],
        aliases={a: t for a, t in manifest["aliases"].items() if only is None or t in only},
        rules=manifest["rules"],
        metadata=dict(manifest["metadata"]),
    )
