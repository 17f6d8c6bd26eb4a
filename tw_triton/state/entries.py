"""What decoding needs of stored entries: their codecs, their delta paths, manifest checks.

Shared by encoding, decoding and the checkpoint directory's verification: an entry names
a registered codec and params that codec records; :func:`delta_paths` are the entries
decoded against a reference. Why the checks: docs/format.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..codecs import Codec, get_codec
from ..errors import CheckpointError
from ..format import ENTRY_DTYPES
from ..qstate import QuantizedState
from ..tree import check_skeleton
from .partners import partner_map

MEMORY_SOURCE = "<in-memory state>"


def codec_or_raise(name: str, error: type[Exception], where: str) -> Codec:
    codec = get_codec(name)
    if codec is None:
        from ..codecs import codec_names

        raise error(f"{where}: unknown codec {name!r}; registered: {', '.join(codec_names())}")
    return codec


def delta_paths(qstate: QuantizedState, source: str) -> list[str]:
    """Paths of ``qstate``'s delta entries (those decoded against a reference).

    Raises:
        CheckpointError: an entry of an unknown codec (naming ``source`` and the entry).
    """
    out = []
    for path, entry in qstate.entries.items():
        codec = codec_or_raise(entry.codec, CheckpointError, f"{source}: entry {path!r}")
        # Checked before uses_reference reads them: "delta": 1 is no answer to "is it a delta".
        codec.check_stored_params(entry.params, entry_context(source, path, entry.codec))
        if codec.uses_reference(entry.params):
            out.append(path)
    return out


def entry_context(source: str, path: str, codec: str) -> str:
    return f"{source}: entry {path!r} (codec {codec!r})"


def check_manifest(manifest: Mapping[str, Any], source: str) -> None:
    """Check what decoding a checkpoint needs of its manifest beyond what the format checks
    (:func:`~tw_triton.format.read_manifest`): every entry's codec is registered and its
    params are ones that codec records, and the skeleton is one that
    :func:`~tw_triton.tree.unflatten` rebuilds from the entries and aliases. Reads no data.

    What choosing a checkpoint to restore needs, so that a file that would fail to decode
    is passed over like a corrupted one.

    Raises:
        CheckpointError: naming ``source``, the entry (or the skeleton's path) and what was
            expected.
    """
    dtypes: dict[str, torch.dtype] = {}
    for path, entry in manifest["entries"].items():
        codec = codec_or_raise(entry["codec"], CheckpointError, f"{source}: entry {path!r}")
        codec.check_stored_params(entry["params"], entry_context(source, path, entry["codec"]))
        dtypes[path] = ENTRY_DTYPES[entry["dtype"]]
    partner_map(
        {
            p: (e["codec"], e["params"], ENTRY_DTYPES[e["dtype"]], tuple(e["shape"]))
            for p, e in manifest["entries"].items()
        },
        source,
    )
    for alias, target in manifest["aliases"].items():
        dtypes[alias] = dtypes[target]
    try:
        check_skeleton(manifest["skeleton"], dtypes)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e


def entry_facts(entries: Mapping[str, Any]) -> dict[str, tuple[str, Any, torch.dtype, tuple[int, ...]]]:
    """``{path: (codec, params, dtype, shape)}`` of encoded entries, for
    :func:`~tw_triton.state.partners.partner_map`."""
    return {p: (e.codec, e.params, e.dtype, tuple(e.shape)) for p, e in entries.items()}


def wants_pinned(device: torch.device | None) -> bool:
    """Whether reads for ``device`` go to it through the ring of pinned slots (CUDA, when
    available; see :func:`tw_triton.format.read_file`'s ``device``)."""
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


def disjoint_paths(tensors: dict[str, torch.Tensor], paths: Iterable[str]) -> set[str]:
    """The paths whose tensor shares no byte with another path's: those a delta may be
    decoded over without changing what another entry reads (tied tensors are one tensor
    under two paths)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), p)
        for p in paths
        if (t := tensors[p]).numel()
    )
    alone = set()
    reach = -1  # the furthest end of the spans before this one
    for i, (start, end, path) in enumerate(spans):
        if reach <= start and (i + 1 == len(spans) or spans[i + 1][0] >= end):
            alone.add(path)
        reach = max(reach, end)
    return alone


def manifest_delta_paths(manifest: Mapping[str, Any]) -> set[str]:
    """The delta entries of a validated manifest (:func:`~tw_triton.format.read_manifest`),
    what :func:`delta_paths` gives once the file is read; empty where an entry's codec is
    unknown (the read that follows reports it)."""
    paths = set()
    for path, entry in manifest["entries"].items():
        codec = get_codec(entry["codec"])
        if codec is None:
            return set()
        if codec.uses_reference(entry["params"]):
            paths.add(path)
    return paths
