"""``StorageWriter``: DCP plans, tw_triton encodes and writes each rank's chunks.

Each rank writes its chunks as one tw_triton safetensors file (``__<rank>_0.tw.safetensors``;
a second file only if a rank holds two chunks of one tensor); non-tensor items (DCP
serializes them) are stored exact as bytes. The coordinator writes ``tw_dcp.json`` last
(:mod:`.meta`): a directory is a checkpoint only once it exists. As DCP's ``AsyncStager``,
``stage`` encodes every chunk on its own device and enqueues the copies of the encoded
buffers into pinned host memory (:mod:`.staging`); the write waits for them. See
docs/distributed.md.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointError, CheckpointIOError, QuantizationError
from ..format import write_file
from ..lowbit import outer_path
from ..pinned_staging import DeviceStaging
from ..qstate import QuantizedState
from ..state import quantize_state_dict
from . import compat
from .chunks import FILE_SUFFIX, Chunk, encode_chunks, entry_path, file_state, nest
from .keyframe import Keyframe, open_reference
from .meta import METADATA_NAME, StorageInfo, to_json, write_json
from .staging import HostCopy, shared_staging, start_host_copy


def check_plain_data(data: bytes, where: str) -> None:
    """Refuse a value DCP serialized that a load would refuse: anything
    ``torch.load(weights_only=True)`` rejects (the reader's check), so that a run does not
    find out at its resume.

    Raises:
        QuantizationError: names ``where`` and the type torch reports.
    """
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:
        lines = [line.strip() for line in str(exc).splitlines() if "global" in line.lower()]
        raise QuantizationError(
            f"{where}: not plain data, which a load refuses ({lines[0] if lines else exc}); store "
            "it as plain values (dict, list, str, numbers, tensors) and rebuild it after the load"
        ) from exc


@dataclass(frozen=True)
class PlanData:
    """What the coordinator hands every rank with its plan: file prefix and checkpoint id."""

    prefix: str
    checkpoint_id: str


class StorageWriter(FileSystemWriter):
    """A DCP ``StorageWriter`` (and ``AsyncStager``) that stores chunks with tw_triton codecs.

    Args:
        path: the checkpoint directory.
        rules: a preset name or ``[(glob, codec spec), ...]`` as for ``quantize_state_dict``,
            matched against each tensor's object path (``model/layer.weight``). ``"exact"``
            round-trips bit for bit.
        bits, block: parameters of quantizing rules that do not set them.
        reference: a keyframe checkpoint directory (or a :class:`Keyframe`, whose decoded
            regions stay cached on the device across saves): quantized entries become
            deltas from it.
        as_keyframe: store what the rules would delta-code exact instead (the reference
            of later deltas), keeping the codecs of entries coded on their own.
        sync_files: fsync every file and the directory.
        overwrite: replace a tw_triton checkpoint already in ``path``.
        staging: the pinned pool and side streams that copy encoded CUDA buffers to the
            host (default: one shared by the process's writers, so saves reuse its pinned
            buffers).

    Raises (during ``dcp.save``):
        CheckpointIOError: the directory cannot be made (``errno`` kept), a file not written.
        QuantizationError: bad rules or parameters, or a non-tensor value that is not plain
            data (a load would refuse it; names the entry).
        ReferenceMismatchError: the keyframe lacks a tensor region a delta needs.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rules: Any = None,
        bits: int = 8,
        block: int = 128,
        reference: str | os.PathLike | Keyframe | None = None,
        as_keyframe: bool = False,
        sync_files: bool = True,
        overwrite: bool = True,
        staging: DeviceStaging | None = None,
    ) -> None:
        super().__init__(path, sync_files=sync_files, overwrite=overwrite)
        self.as_keyframe = as_keyframe
        self.rules = rules
        self.bits = bits
        self.block = block
        self.keyframe = open_reference(reference)
        self.staging = staging if staging is not None else shared_staging()
        self._staged: dict[str, Chunk] | None = None
        self._staged_copy: HostCopy | None = None

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based async save sends the writer to another process: pinned
        # buffers, streams and events stay here, the staged bytes travel as plain tensors.
        state = self.__dict__.copy()
        state["staging"] = None
        if self._staged_copy is not None:
            host = self._staged_copy.wait()
            entries = {
                name: dataclasses.replace(e, buffers={k: v.clone() for k, v in e.buffers.items()})
                for name, e in host.entries.items()
            }
            state["_staged_copy"] = HostCopy(dataclasses.replace(host, entries=entries))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.staging is None:
            self.staging = shared_staging()

    # -- staging (AsyncStager) -------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Encode every local tensor now and return a state dict safe to plan from.

        The returned dict holds the same tensor objects (only their shapes and placements
        are read again, by the planner) and deep copies of every other leaf. The encoded
        buffers are what the save writes: on CUDA their copies into pinned host memory are
        enqueued behind the encode (no wait here), and ``write_data`` waits for them.
        """
        flat, mappings = compat.flatten_state_dict(state_dict)
        chunks = []
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                local, offsets = compat.local_chunk(value)
                chunks.append(Chunk(fqn, tuple(mappings[fqn]), offsets, local.detach(), tuple(value.shape)))
        encoded = encode_chunks(
            chunks,
            rules=self.rules,
            bits=self.bits,
            block=self.block,
            keyframe=self.keyframe,
            checkpoint_id="staged",
            as_keyframe=self.as_keyframe,
        )
        if self._staged_copy is not None:  # staged twice without a write: the first is moot
            self._staged_copy.release()
        self._staged_copy = start_host_copy(encoded, self.staging, f"{self.path} (staged)")
        self._staged = {c.fqn: c for c in chunks}
        memo = {id(v): v for v in flat.values() if isinstance(v, torch.Tensor)}
        return copy.deepcopy(state_dict, memo)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: the encode reads the state on its device's stream, ahead of
        whatever the loop queues next, and only the encoded buffers are copied afterwards."""

    # -- planning --------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:  # DCP makes the directory here
            return super().prepare_local_plan(plan)
        except OSError as exc:
            raise CheckpointIOError(
                exc.errno, f"{os.fspath(self.path)}: cannot make the checkpoint directory: {exc}"
            ) from exc

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        directory = os.fspath(self.path)
        if os.path.exists(os.path.join(directory, METADATA_NAME)):
            if not self.overwrite:
                raise CheckpointError(
                    f"{directory}: a tw_triton checkpoint is already there (overwrite=False)"
                )
            # The old record goes first, so no moment shows it next to the new files.
            os.remove(os.path.join(directory, METADATA_NAME))
        for name in os.listdir(directory):
            if name.endswith(FILE_SUFFIX):
                os.remove(os.path.join(directory, name))
        checkpoint_id = self._checkpoint_id = uuid.uuid4().hex
        return [
            dataclasses.replace(p, storage_data=PlanData(f"__{i}_", checkpoint_id))
            for i, p in enumerate(plans)
        ]

    # -- writing ---------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pdata: PlanData = plan.storage_data
        rank = int(pdata.prefix.strip("_"))
        staged, host_copy = self._staged, self._staged_copy
        self._staged, self._staged_copy = None, None
        try:
            tensor_chunks, byte_chunks, items = self._chunks(plan, planner, staged)
            ckpt_id = pdata.checkpoint_id
            if host_copy is None:
                encoded = encode_chunks(
                    tensor_chunks,
                    rules=self.rules,
                    bits=self.bits,
                    block=self.block,
                    keyframe=self.keyframe,
                    checkpoint_id=ckpt_id,
                    as_keyframe=self.as_keyframe,
                )
                host_copy = start_host_copy(encoded, self.staging, os.fspath(self.path))
            encoded = host_copy.wait()
            if byte_chunks:
                raw = quantize_state_dict(nest({c.obj_path: c.tensor for c in byte_chunks}), rules="exact")
                encoded = dataclasses.replace(encoded, entries={**encoded.entries, **raw.entries})
            results = self._write_files(pdata, rank, items, encoded)
        finally:
            # After the files are written (or failed): the pinned buffer serves the next save.
            if host_copy is not None:
                host_copy.release()
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _chunks(
        self, plan: SavePlan, planner: SavePlanner, staged: dict[str, Chunk] | None
    ) -> tuple[list[Chunk], list[Chunk], list[tuple[Any, Chunk]]]:
        """The plan's tensor chunks, its non-tensor items (as uint8 chunks), and every
        ``(write item, chunk)``; tensor chunks are the staged ones when ``stage`` ran."""
        mappings = getattr(planner, "mappings", None) or {}
        tensor_chunks: list[Chunk] = []
        byte_chunks: list[Chunk] = []
        items: list[tuple[Any, Chunk]] = []
        for item in plan.items:
            fqn = item.index.fqn
            obj_path = tuple(mappings.get(fqn, (fqn,)))
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item).getvalue()
                check_plain_data(data, f"{os.fspath(self.path)}: {fqn!r}")
                t = (
                    torch.frombuffer(bytearray(data), dtype=torch.uint8)
                    if data
                    else torch.empty(0, dtype=torch.uint8)
                )
                chunk = Chunk(fqn, obj_path, (0,), t, tuple(t.shape))
                byte_chunks.append(chunk)
            else:
                offsets = tuple(int(o) for o in item.tensor_data.chunk.offsets)
                if staged is not None:
                    chunk = staged.get(fqn)
                    if chunk is None or chunk.offsets != offsets:
                        raise CheckpointError(
                            f"tw_triton DCP: the plan writes {fqn!r} at {list(offsets)}, which "
                            "stage() did not encode on this rank"
                        )
                else:
                    chunk = Chunk(
                        fqn,
                        obj_path,
                        offsets,
                        planner.resolve_data(item).detach(),
                        tuple(int(n) for n in item.tensor_data.size),
                    )
                tensor_chunks.append(chunk)
            items.append((item, chunk))
        return tensor_chunks, byte_chunks, items

    def _write_files(
        self, pdata: PlanData, rank: int, items: list[tuple[Any, Chunk]], encoded: QuantizedState
    ) -> list[WriteResult]:
        """Write this rank's file(s) from the host ``encoded`` state; their write results."""
        ckpt_id = pdata.checkpoint_id
        ref_id = self.keyframe.checkpoint_id if self.keyframe is not None else None

        # One file per rank, unless a rank holds two chunks of one tensor.
        seen: Counter[str] = Counter()
        per_file: dict[int, list[tuple[Any, Chunk]]] = {}
        for item, chunk in items:
            per_file.setdefault(seen[chunk.fqn], []).append((item, chunk))
            seen[chunk.fqn] += 1
        results: list[WriteResult] = []
        for k, group in per_file.items():
            name = f"{pdata.prefix}{k}{FILE_SUFFIX}"
            fstate = file_state(
                [c for _, c in group], encoded, checkpoint_id=ckpt_id, reference_id=ref_id, rank=rank
            )
            write_file(fstate, os.path.join(os.fspath(self.path), name), fsync=self.sync_files)
            nbytes: Counter[str] = Counter()
            for path, entry in fstate.entries.items():
                nbytes[outer_path(path)] += entry.nbytes  # a subclass: its inner entries
            for item, chunk in group:
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=nbytes[entry_path(chunk.obj_path)],
                        storage_data=StorageInfo(name, entry_path(chunk.obj_path)),
                    )
                )
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``tw_dcp.json`` (coordinator only, after every rank's files are durable)."""
        directory = os.fspath(self.path)
        storage = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_data = storage
        files: dict[str, dict[str, int]] = {}
        for info in storage.values():
            if info.file not in files:
                try:
                    size = os.stat(os.path.join(directory, info.file)).st_size
                except OSError as exc:
                    raise CheckpointIOError(
                        exc.errno, f"{directory}: rank file {info.file} is missing at finish: {exc}"
                    ) from exc
                files[info.file] = {"rank": int(info.file[2:].split("_")[0]), "bytes": size}
        doc = to_json(
            metadata,
            checkpoint_id=self._checkpoint_id,
            reference=None
            if self.keyframe is None
            else {"checkpoint_id": self.keyframe.checkpoint_id, "path": os.path.abspath(self.keyframe.path)},
            files=files,
        )
        write_json(doc, os.path.join(directory, METADATA_NAME), fsync=self.sync_files)


__all__ = ["StorageWriter", "FILE_SUFFIX"]
