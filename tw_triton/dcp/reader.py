"""``StorageReader``: reads a :class:`~tw_triton.dcp.StorageWriter` checkpoint for DCP.

Every file is validated and its checksums verified as it is read; its checkpoint id and
chunk table must match ``tw_dcp.json``. Loaded values are the decoded chunks, narrowed to
what each rank asks for, so any number of ranks gets the same values; each is decoded on
its target's device. Non-tensor items
must be plain data (``torch.load(weights_only=True)``) before DCP unpickles them. See
docs/distributed.md.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from ..errors import CheckpointError, ReferenceMismatchError
from ..format import MAX_EXPANSION, HeaderCache, one_ring, read_file, read_manifest
from ..lowbit import outer_path
from ..state import dequantize_entries, dequantize_state_dict
from ..state.entries import wants_pinned
from ..tree import join_path
from .chunks import CHUNK_TABLE_KEY, is_delta_entry, nest
from .directory import complete_record, find_keyframe
from .keyframe import Keyframe, open_reference
from .meta import METADATA_NAME


class StorageReader(FileSystemReader):
    """A DCP ``StorageReader`` for checkpoints written by :class:`StorageWriter`.

    Every file is validated and its checksums verified as it is read; its checkpoint id
    and chunk table must match ``tw_dcp.json``. Loaded values are the decoded chunks,
    narrowed to what each rank asks for, so any number of ranks gets the same values.

    Args:
        path: the checkpoint directory.
        reference: the keyframe directory (or :class:`Keyframe`) of a delta checkpoint;
            default: the checkpoint with the recorded keyframe id, looked for beside
            ``path`` first, then at the recorded path (see :func:`find_keyframe`).
        verify: check per-buffer CRC-32 while reading.
        max_expansion: the bound on what a file's compressed buffers may decode to, times
            its size, checked before anything is decompressed (the keyframe's files too);
            ``None`` lifts it (:func:`tw_triton.format.read_file`).

    Raises (during ``dcp.load``):
        CheckpointError: not a tw_triton DCP checkpoint (e.g. plain DCP), a missing rank
            file, files that do not match the metadata, corrupted data.
        ReferenceMismatchError: a delta checkpoint whose keyframe is missing or different.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        reference: str | os.PathLike | Keyframe | None = None,
        verify: bool = True,
        max_expansion: float | None = MAX_EXPANSION,
    ) -> None:
        super().__init__(path)
        self._reference_arg = reference
        self.verify = verify
        self.max_expansion = max_expansion
        self._record = None
        self._keyframe: Keyframe | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self._record = None

    def _load_record(self):
        if self._record is None:
            self._record = complete_record(self.path)
        return self._record

    def preflight(self) -> None:
        """Check the metadata, that every rank file is there, and the keyframe of a delta.

        Raises:
            CheckpointError, ReferenceMismatchError: as ``dcp.load`` would, but unwrapped.
        """
        rec = self._load_record()
        if rec.reference is not None:
            self._reference()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._load_record().metadata
        md.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=self.load_id)
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._load_record()

    def _reference(self) -> Keyframe:
        rec = self._record
        want = rec.reference["checkpoint_id"]
        directory = os.fspath(self.path)
        if self._keyframe is None:
            ref = self._reference_arg
            if ref is None:
                ref = find_keyframe(directory, rec.reference)
            try:
                self._keyframe = open_reference(ref, max_expansion=self.max_expansion)
            except ReferenceMismatchError:
                raise
            except CheckpointError as exc:
                raise ReferenceMismatchError(
                    f"{directory} is a delta from keyframe checkpoint {want!r}, and the "
                    f"reference cannot be read: {exc}"
                ) from exc
        if self._keyframe.checkpoint_id != want:
            raise ReferenceMismatchError(
                f"{directory} is a delta from keyframe checkpoint {want!r}, but reference "
                f"{self._keyframe.path} is checkpoint {self._keyframe.checkpoint_id!r}"
            )
        return self._keyframe

    def _decode(
        self, name: str, wanted: dict[str, torch.device]
    ) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
        """Decode the entries of rank file ``name`` in ``wanted``, each on its device (the
        keyframe regions of delta entries too); ``{entry: (tensor, chunk table row)}``.

        The entries bound for one CUDA device are read straight there through the ring of
        pinned slots (:func:`~tw_triton.format.read_file` with ``device``); the others,
        and a file that holds a tensor subclass (rebuilt from the whole file on the host),
        are read into host memory."""
        rec = self._record
        path = os.path.join(os.fspath(self.path), name)
        headers = HeaderCache()  # the manifest read first is every read's header too
        manifest = read_manifest(path, headers=headers)
        if manifest["checkpoint_id"] != rec.checkpoint_id:
            raise CheckpointError(
                f"{path}: file of checkpoint {manifest['checkpoint_id']!r}, but {METADATA_NAME} "
                f"describes checkpoint {rec.checkpoint_id!r} (files and metadata do not match)"
            )
        table = manifest["metadata"].get(CHUNK_TABLE_KEY, {}).get("chunks")
        entries, aliases = manifest["entries"], manifest["aliases"]
        stored = {outer_path(p) for p in (*entries, *aliases)}
        if not isinstance(table, dict) or set(table) != stored:
            raise CheckpointError(f"{path}: no valid DCP chunk table in the manifest metadata")
        by_device: dict[torch.device, list[str]] = {}
        subclassed: dict[str, torch.device] = {}  # stored as its inner entries (lowbit)
        for p, dev in wanted.items():
            if p not in table:  # a missing entry is the caller's to report, with its request
                continue
            if p in entries or p in aliases:
                by_device.setdefault(dev, []).append(p)
            else:
                subclassed[p] = dev

        def read(only: set[str] | None, device: torch.device | None) -> Any:
            return read_file(
                path,
                verify=self.verify,
                max_expansion=self.max_expansion,
                headers=headers,
                entries=only,
                device=device,
            )

        whole = read(None, None) if subclassed else None
        decoded: dict[str, torch.Tensor] = {}
        for dev, paths in by_device.items():
            targets = {aliases.get(p, p) for p in paths}
            qstate = whole if whole is not None else read(targets, dev if wants_pinned(dev) else None)
            delta = sorted(p for p in targets if is_delta_entry(qstate.entries[p]))
            reference = self._regions_of(qstate, table, delta, dev, path)
            decoded.update(
                dequantize_entries(
                    qstate, paths, reference=reference, device=dev, source=path, verify=self.verify
                )
            )
        if subclassed:
            decoded.update(self._decode_subclassed(whole, table, subclassed, path))
        return {p: (t, table[p]) for p, t in decoded.items()}

    def _regions_of(
        self, qstate: Any, table: dict[str, Any], delta: list[str], device: torch.device, path: str
    ) -> Any:
        """The keyframe regions the ``delta`` entries of rank file ``path`` are coded
        against, nested as the file's state, on ``device``; ``None`` without any."""
        if not delta:
            return None
        kf = self._reference()
        if qstate.reference_id != kf.checkpoint_id:
            raise ReferenceMismatchError(
                f"{path}: deltas from {qstate.reference_id!r}, reference is {kf.checkpoint_id!r}"
            )
        keys = [(table[p]["fqn"], tuple(table[p]["offsets"]), tuple(qstate.entries[p].shape)) for p in delta]
        regions = kf.regions(keys, device)
        return nest({tuple(table[p]["obj_path"]): r for p, r in zip(delta, regions)})

    def _decode_subclassed(
        self, qstate: Any, table: dict[str, Any], wanted: dict[str, torch.device], path: str
    ) -> dict[str, torch.Tensor]:
        """The tensor subclasses (a low-bit optimizer's state) in ``wanted``, rebuilt from the
        whole file's skeleton (its delta entries decoded too), each moved to its device."""
        delta = [p for p, e in qstate.entries.items() if is_delta_entry(e)]
        reference = self._regions_of(qstate, table, delta, torch.device("cpu"), path)
        leaves: dict[str, Any] = {}
        _leaves(
            dequantize_state_dict(qstate, reference=reference, source=path, verify=self.verify), "", leaves
        )
        return {p: leaves[p].to(dev) for p, dev in wanted.items()}

    @one_ring()  # the rank files and keyframe files read here share one ring of pinned slots
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rec = self._record
        md = rec.metadata
        host = torch.device("cpu")
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = md.storage_data.get(req.storage_index)
            if info is None:
                raise CheckpointError(f"{self.path}: {METADATA_NAME} has no storage for {req.storage_index}")
            # Each chunk is decoded where its target lives: on a GPU rank the encoded bytes
            # go to the device, not the decoded values.
            target = None if req.type == LoadItemType.BYTE_IO else planner.resolve_tensor(req).detach()
            per_file.setdefault(info.file, []).append((req, info, target))
        for name, reqs in per_file.items():
            wanted: dict[str, torch.device] = {}
            for _, info, target in reqs:
                wanted.setdefault(info.entry, host if target is None else target.device)
            decoded = self._decode(name, wanted)
            fpath = os.path.join(os.fspath(self.path), name)
            for req, info, target in reqs:
                got = decoded.get(info.entry)
                if got is None:
                    raise CheckpointError(
                        f"{fpath}: no entry {info.entry!r} for {req.storage_index.fqn!r} ({METADATA_NAME} names it)"
                    )
                tensor, row = got
                if row["fqn"] != req.storage_index.fqn:
                    raise CheckpointError(
                        f"{fpath}: entry {info.entry!r} holds {row['fqn']!r}, {METADATA_NAME} says {req.storage_index.fqn!r}"
                    )
                if req.type == LoadItemType.BYTE_IO:
                    raw = tensor.numpy().tobytes()
                    # DCP's planner unpickles these bytes; refuse anything beyond plain data.
                    try:
                        torch.load(io.BytesIO(raw), weights_only=True)
                    except Exception as exc:
                        raise CheckpointError(
                            f"{fpath}: entry {info.entry!r}: not plain data, refused: {exc}"
                        ) from exc
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                off = req.storage_index.offset
                want = tuple(off) if off is not None else (0,) * tensor.dim()
                if tuple(row["offsets"]) != want:
                    raise CheckpointError(
                        f"{fpath}: entry {info.entry!r} is the chunk at {row['offsets']}, {METADATA_NAME} says {list(want)}"
                    )
                for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    # A whole dimension stays as it is: a low-bit optimizer's state (torchao)
                    # narrows along its first dimension only.
                    if o != 0 or n != tensor.size(dim):
                        tensor = tensor.narrow(dim, o, n)
                if target.size() != tensor.size():
                    raise CheckpointError(
                        f"{fpath}: entry {info.entry!r}: read {tuple(tensor.size())}, the target needs {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _leaves(node: Any, path: str, out: dict[str, Any]) -> None:
    """The leaves of a decoded file by entry path, a tensor subclass (a low-bit optimizer's
    state, rebuilt) as one leaf: what a chunk's ``copy_`` takes."""
    if isinstance(node, dict):
        for key, value in node.items():
            _leaves(value, join_path(path, str(key)), out)
    else:
        out[path] = node


__all__ = ["StorageReader"]
