"""The checkpoint-level record of a tw_triton DCP checkpoint, as JSON (never pickle).

Plain DCP pickles its ``Metadata`` into ``.metadata``; loading an untrusted checkpoint
would then run code. tw_triton writes the same information as JSON in ``tw_dcp.json``
instead, and this module converts both ways and validates what it reads. Every field is
checked before use, and every error names the file (docs/distributed.md).

Schema, version 1::

    {"format": "tw_triton.dcp", "version": 1, "checkpoint_id": str,
     "reference": null | {"checkpoint_id": str, "path": str},
     "files": {name: {"rank": int, "bytes": int}},
     "tensors": {fqn: {"dtype": str, "size": [int], "requires_grad": bool,
                       "chunks": [{"offsets": [int], "sizes": [int]}]}},
     "bytes": [fqn, ...],
     "planner_data": null | {fqn: [str | int, ...]},
     "storage": [{"fqn": str, "offset": null | [int], "index": null | int,
                  "file": str, "entry": str}]}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CheckpointError, CheckpointIOError
from ..format import ENTRY_DTYPES

METADATA_NAME = "tw_dcp.json"
FORMAT = "tw_triton.dcp"
VERSION = 1
_DTYPE_NAMES = {dt: name for name, dt in ENTRY_DTYPES.items()}


@dataclass(frozen=True)
class StorageInfo:
    """Where one DCP storage item lives: a tw_triton file and the entry path inside it."""

    file: str
    entry: str


@dataclass(frozen=True)
class Record:
    """The parsed ``tw_dcp.json``: DCP's ``Metadata`` plus what tw_triton adds."""

    metadata: Metadata
    checkpoint_id: str
    reference: dict[str, str] | None
    files: dict[str, dict[str, int]]


def _ints(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise CheckpointError(f"{where}: expected a list of ints, found {v!r}")
    return v


def to_json(
    metadata: Metadata,
    *,
    checkpoint_id: str,
    reference: dict[str, str] | None,
    files: dict[str, dict[str, int]],
) -> dict[str, Any]:
    """The JSON document for ``metadata`` (whose ``storage_data`` holds :class:`StorageInfo`).

    Raises:
        CheckpointError: something DCP recorded has no JSON form here (a non-strided layout,
            a planner whose ``planner_data`` is not a map of object paths).
    """
    tensors: dict[str, Any] = {}
    byte_items: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        props = md.properties
        if props.layout != torch.strided or props.dtype not in _DTYPE_NAMES:
            raise CheckpointError(
                f"tw_triton DCP: tensor {fqn!r} has layout {props.layout} and dtype "
                f"{props.dtype}; only strided tensors of {sorted(ENTRY_DTYPES)} are stored"
            )
        tensors[fqn] = {
            "dtype": _DTYPE_NAMES[props.dtype],
            "size": list(md.size),
            "requires_grad": bool(props.requires_grad),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    planner_data = metadata.planner_data
    if planner_data is not None:
        ok = isinstance(planner_data, dict) and all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(c, (str, int)) for c in v)
            for k, v in planner_data.items()
        )
        if not ok:
            raise CheckpointError(
                "tw_triton DCP: the save planner's planner_data is not a map of fqn to object "
                "path (DefaultSavePlanner's); tw_triton stores it as JSON and cannot store this"
            )
        planner_data = {k: list(v) for k, v in planner_data.items()}
    storage = []
    for index, info in metadata.storage_data.items():
        storage.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "index": index.index,
                "file": info.file,
                "entry": info.entry,
            }
        )
    return {
        "format": FORMAT,
        "version": VERSION,
        "checkpoint_id": checkpoint_id,
        "reference": reference,
        "files": files,
        "tensors": tensors,
        "bytes": byte_items,
        "planner_data": planner_data,
        "storage": storage,
    }


def write_json(doc: dict[str, Any], path: str, *, fsync: bool = True) -> None:
    """Write ``doc`` to ``path`` atomically (temp file, fsync, rename, fsync the directory)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    except OSError as exc:
        raise CheckpointIOError(exc.errno, f"cannot write DCP metadata {path}: {exc}") from exc


def read_record(directory: str) -> Record:
    """Read and validate ``directory/tw_dcp.json``.

    Raises:
        CheckpointError: no such file (naming a plain DCP checkpoint when that is what the
            directory holds), or a malformed document.
    """
    path = os.path.join(directory, METADATA_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        if os.path.exists(os.path.join(directory, ".metadata")):
            raise CheckpointError(
                f"{directory}: a plain torch.distributed.checkpoint directory (it has "
                f".metadata but no {METADATA_NAME}); read it with DCP's FileSystemReader"
            ) from exc
        raise CheckpointError(
            f"{directory}: no {METADATA_NAME}: not a tw_triton DCP checkpoint, or a save "
            "that did not complete"
        ) from exc
    except OSError as exc:
        raise CheckpointIOError(exc.errno, f"cannot read {path}: {exc}") from exc
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from exc
    return _parse(doc, path)


def _parse(doc: Any, where: str) -> Record:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{where}: expected format {FORMAT!r}")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{where}: unknown version {doc.get('version')!r}, expected {VERSION}")
    for key, typ in (
        ("checkpoint_id", str),
        ("files", dict),
        ("tensors", dict),
        ("bytes", list),
        ("storage", list),
    ):
        if not isinstance(doc.get(key), typ):
            raise CheckpointError(f"{where}: field {key!r} must be a {typ.__name__}")
    ref = doc.get("reference")
    if ref is not None and not (
        isinstance(ref, dict)
        and isinstance(ref.get("checkpoint_id"), str)
        and isinstance(ref.get("path"), str)
    ):
        raise CheckpointError(f"{where}: reference must be null or {{checkpoint_id, path}}")
    files: dict[str, dict[str, int]] = {}
    for name, info in doc["files"].items():
        if os.path.basename(name) != name or name.startswith("."):
            raise CheckpointError(f"{where}: file name {name!r} is not a plain file name")
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: file {name!r}: expected an object")
        rank, size = info.get("rank"), info.get("bytes")
        _ints([rank, size], f"{where}: file {name!r}")
        files[name] = {"rank": rank, "bytes": size}
    sd_md: dict[str, Any] = {}
    for fqn, t in doc["tensors"].items():
        tw = f"{where}: tensor {fqn!r}"
        if not isinstance(t, dict) or t.get("dtype") not in ENTRY_DTYPES:
            raise CheckpointError(f"{tw}: unknown dtype {t.get('dtype') if isinstance(t, dict) else t!r}")
        if not isinstance(t.get("chunks"), list):
            raise CheckpointError(f"{tw}: chunks must be a list")
        size = _ints(t.get("size"), tw)
        chunks = []
        for c in t["chunks"]:
            if not isinstance(c, dict):
                raise CheckpointError(f"{tw}: a chunk must be an object")
            off, sz = _ints(c.get("offsets"), tw), _ints(c.get("sizes"), tw)
            if (
                len(off) != len(size)
                or len(sz) != len(size)
                or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(off, sz, size))
            ):
                raise CheckpointError(f"{tw}: chunk {off}+{sz} does not fit size {size}")
            chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(sz)))
        props = TensorProperties(dtype=ENTRY_DTYPES[t["dtype"]], requires_grad=bool(t.get("requires_grad")))
        sd_md[fqn] = TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
    for fqn in doc["bytes"]:
        if not isinstance(fqn, str):
            raise CheckpointError(f"{where}: bytes items must be fqn strings")
        sd_md[fqn] = BytesStorageMetadata()
    planner_data = doc.get("planner_data")
    if planner_data is not None:
        if not isinstance(planner_data, dict) or not all(
            isinstance(v, list) and all(isinstance(c, (str, int)) for c in v) for v in planner_data.values()
        ):
            raise CheckpointError(f"{where}: planner_data must map fqn to an object path")
        planner_data = {k: tuple(v) for k, v in planner_data.items()}
    storage: dict[MetadataIndex, StorageInfo] = {}
    for s in doc["storage"]:
        if not isinstance(s, dict) or not isinstance(s.get("fqn"), str):
            raise CheckpointError(f"{where}: storage items need an fqn")
        sw = f"{where}: storage item {s['fqn']!r}"
        if s["fqn"] not in sd_md:
            raise CheckpointError(f"{sw}: not in the tensors or bytes of the checkpoint")
        if s.get("file") not in files or not isinstance(s.get("entry"), str):
            raise CheckpointError(f"{sw}: names file {s.get('file')!r}, which is not in 'files'")
        offset = s.get("offset")
        index = s.get("index")
        idx = MetadataIndex(
            s["fqn"],
            None if offset is None else torch.Size(_ints(offset, sw)),
            index if isinstance(index, int) else None,
        )
        storage[idx] = StorageInfo(s["file"], s["entry"])
    md = Metadata(state_dict_metadata=sd_md, planner_data=planner_data, storage_data=storage)
    return Record(md, doc["checkpoint_id"], ref, files)


__all__ = ["METADATA_NAME", "StorageInfo", "Record", "to_json", "write_json", "read_record"]
