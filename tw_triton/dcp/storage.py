"""``StorageWriter`` / ``StorageReader``: DCP plans and reshards, tw_triton encodes the bytes.

Each rank writes its chunks as one tw_triton safetensors file (``__<rank>_0.tw.safetensors``;
a second file only if a rank holds two chunks of one tensor). Each chunk is an entry named
by the tensor's object path (``model/layer.weight``, ``optim/state/layer.weight/exp_avg``),
so rules and presets select codecs exactly as they do for ``quantize_state_dict`` on the
same nested state. Non-tensor items (DCP serializes them itself) are stored exact as bytes.
The coordinator writes ``tw_dcp.json`` last (see :mod:`._meta`): a directory counts as a
checkpoint only once it exists, and it lists every rank's file.

Async saves: the writer is DCP's ``AsyncStager``. ``stage`` encodes every local chunk on its
own device (Triton kernels on CUDA, the bit-identical torch path on CPU) and copies only the
*encoded* buffers to the host; ``dcp.async_save`` returns after that, and the background
save writes them.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import os
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..codecs import get_codec
from ..errors import CheckpointError, CheckpointIOError, ReferenceMismatchError
from ..format import read_file, write_file
from ..qstate import EncodedEntry, QuantizedState
from ..rules import Rule, keyframe_rules, resolve_rules, rules_as_specs, select_rule, warn_if_too_coarse
from ..state import dequantize_state_dict, quantize_state_dict
from ..tree import escape_component, flatten
from . import _compat
from ._meta import METADATA_NAME, Record, StorageInfo, read_record, to_json, write_json
from .keyframe import Keyframe, open_reference

FILE_SUFFIX = ".tw.safetensors"
_DCP_KEY = "dcp"


@dataclass(frozen=True)
class _PlanData:
    """What the coordinator hands every rank with its plan: file prefix and checkpoint id."""

    prefix: str
    checkpoint_id: str


@dataclass
class _Chunk:
    fqn: str
    obj_path: tuple[Any, ...]
    offsets: tuple[int, ...]
    tensor: torch.Tensor  # this rank's data: a tensor chunk, or uint8 bytes
    global_shape: tuple[int, ...]


def _tw_path(obj_path: tuple[Any, ...]) -> str:
    return "/".join(escape_component(str(c)) for c in obj_path)


def _nest(leaves: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """Nested dicts with str keys whose ``tree.flatten`` paths are ``_tw_path(obj_path)``."""
    root: dict[str, Any] = {}
    for obj_path, value in leaves.items():
        node = root
        for c in obj_path[:-1]:
            node = node.setdefault(str(c), {})
        node[str(obj_path[-1])] = value
    return root


def _encode_chunks(
    chunks: list[_Chunk],
    *,
    rules: Any,
    bits: int,
    block: int,
    keyframe: Keyframe | None,
    checkpoint_id: str,
    as_keyframe: bool = False,
) -> QuantizedState:
    """Encode this rank's chunks, each with the rule its *whole* tensor selects.

    Rules are matched on the global tensor (a meta tensor of its full shape), so a size
    floor such as ``min_numel`` gives the same codec on any number of ranks. Chunks are
    then encoded in one ``quantize_state_dict`` call per selected rule, with the
    keyframe's regions as the reference of the delta ones.
    """
    full = {
        c.obj_path: torch.empty(c.global_shape, dtype=c.tensor.dtype, device="meta") for c in chunks
    }
    rule_list = resolve_rules(rules, _nest(full), bits=bits, block=block)
    if as_keyframe:
        rule_list = keyframe_rules(rule_list)
    elif keyframe is not None:
        # DCP deltas are open loop (against the keyframe directory).
        warn_if_too_coarse(rule_list, "open", f"checkpoint {checkpoint_id}")
    groups: dict[int, tuple[Rule, list[_Chunk]]] = {}
    for c in chunks:
        rule = select_rule(rule_list, _tw_path(c.obj_path), full[c.obj_path])
        groups.setdefault(id(rule), (rule, []))[1].append(c)
    entries: dict[str, EncodedEntry] = {}
    aliases: dict[str, str] = {}
    for rule, cs in groups.values():
        codec = get_codec(rule.codec)
        reference = None
        if keyframe is not None and codec is not None and codec.uses_reference(rule.params):
            ref_leaves: dict[tuple[Any, ...], torch.Tensor] = {}
            by_device: dict[torch.device, list[_Chunk]] = {}
            for c in cs:
                by_device.setdefault(c.tensor.device, []).append(c)
            for dev, dcs in by_device.items():
                keys = [(c.fqn, c.offsets, tuple(c.tensor.shape)) for c in dcs]
                for c, r in zip(dcs, keyframe.regions(keys, dev)):
                    ref_leaves[c.obj_path] = r
            reference = _nest(ref_leaves)
        part = quantize_state_dict(
            _nest({c.obj_path: c.tensor for c in cs}),
            reference=reference,
            reference_id=keyframe.checkpoint_id if reference is not None else None,
            rules=rules_as_specs([Rule("*", rule.codec, rule.params, 0)]),
            bits=bits,
            block=block,
            checkpoint_id=checkpoint_id,
        )
        entries.update(part.entries)
        aliases.update(part.aliases)
    return QuantizedState(
        entries=entries,
        skeleton=None,
        checkpoint_id=checkpoint_id,
        aliases=aliases,
        rules=[r.to_json() for r in rule_list],
    )


def _to_host(qstate: QuantizedState) -> QuantizedState:
    for entry in qstate.entries.values():
        entry.buffers = {k: v.to("cpu") for k, v in entry.buffers.items()}
    return qstate


def _is_delta(entry: EncodedEntry) -> bool:
    codec = get_codec(entry.codec)
    return codec is not None and codec.uses_reference(entry.params)


def _file_state(
    chunks: list[_Chunk], encoded: QuantizedState, *, checkpoint_id: str, reference_id: str | None, rank: int
) -> QuantizedState:
    """The entries of ``chunks`` from ``encoded``, as one file's state."""
    entries: dict[str, EncodedEntry] = {}
    table: dict[str, Any] = {}
    for c in chunks:
        path = _tw_path(c.obj_path)
        entry = encoded.entries.get(path)
        if entry is None:
            # Shared storage (tied weights) was encoded once; this file needs its own copy.
            entry = encoded.entries[encoded.aliases[path]]
        if tuple(entry.shape) != tuple(c.tensor.shape):
            raise CheckpointError(
                f"tw_triton DCP: {c.fqn!r} was staged with shape {tuple(entry.shape)} but the "
                f"plan writes a chunk of shape {tuple(c.tensor.shape)} (state changed after stage?)"
            )
        entries[path] = entry
        table[path] = {"fqn": c.fqn, "obj_path": list(c.obj_path), "offsets": list(c.offsets)}
    _, skeleton = flatten(_nest({c.obj_path: torch.empty(0) for c in chunks}))
    has_delta = any(_is_delta(e) for e in entries.values())
    return QuantizedState(
        entries=entries,
        skeleton=skeleton,
        checkpoint_id=checkpoint_id,
        reference_id=reference_id if has_delta else None,
        rules=encoded.rules,
        metadata={_DCP_KEY: {"rank": rank, "chunks": table}},
    )


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

    Raises (during ``dcp.save``):
        QuantizationError: bad rules or parameters.
        ReferenceMismatchError: the keyframe lacks a tensor region a delta needs.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        rules: Any = None,
        bits: int = 8,
        block: int = 128,
        reference: "str | os.PathLike | Keyframe | None" = None,
        as_keyframe: bool = False,
        sync_files: bool = True,
        overwrite: bool = True,
    ) -> None:
        super().__init__(path, sync_files=sync_files, overwrite=overwrite)
        self.as_keyframe = as_keyframe
        self.rules = rules
        self.bits = bits
        self.block = block
        self.keyframe = open_reference(reference)
        self._staged: dict[str, _Chunk] | None = None
        self._staged_qstate: QuantizedState | None = None

    # -- staging (AsyncStager) -------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Encode every local tensor now and return a state dict safe to plan from.

        The returned dict holds the same tensor objects (only their shapes and placements
        are read again, by the planner) and deep copies of every other leaf; the encoded
        buffers, already on the host, are what the save writes.
        """
        flat, mappings = _compat.flatten_state_dict(state_dict)
        chunks = []
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                local, offsets = _compat.local_chunk(value)
                chunks.append(_Chunk(fqn, tuple(mappings[fqn]), offsets, local.detach(), tuple(value.shape)))
        encoded = _encode_chunks(
            chunks, rules=self.rules, bits=self.bits, block=self.block,
            keyframe=self.keyframe, checkpoint_id="staged", as_keyframe=self.as_keyframe,
        )
        self._staged_qstate = _to_host(encoded)
        self._staged = {c.fqn: c for c in chunks}
        memo = {id(v): v for v in flat.values() if isinstance(v, torch.Tensor)}
        return copy.deepcopy(state_dict, memo)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the encoded buffers are on the host."""

    # -- planning --------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        self._is_coordinator = is_coordinator

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        directory = os.fspath(self.path)
        if os.path.exists(os.path.join(directory, METADATA_NAME)):
            if not self.overwrite:
                raise CheckpointError(f"{directory}: a tw_triton checkpoint is already there (overwrite=False)")
            # The old record goes first, so no moment shows it next to the new files.
            os.remove(os.path.join(directory, METADATA_NAME))
        for name in os.listdir(directory):
            if name.endswith(FILE_SUFFIX):
                os.remove(os.path.join(directory, name))
        checkpoint_id = self._checkpoint_id = uuid.uuid4().hex
        return [
            dataclasses.replace(p, storage_data=_PlanData(f"__{i}_", checkpoint_id))
            for i, p in enumerate(plans)
        ]

    # -- writing ---------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pdata: _PlanData = plan.storage_data
        rank = int(pdata.prefix.strip("_"))
        mappings = getattr(planner, "mappings", None) or {}
        staged, staged_qstate = self._staged, self._staged_qstate
        self._staged = self._staged_qstate = None

        tensor_chunks: list[_Chunk] = []
        byte_chunks: list[_Chunk] = []
        items: list[tuple[Any, _Chunk]] = []
        for item in plan.items:
            fqn = item.index.fqn
            obj_path = tuple(mappings.get(fqn, (fqn,)))
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item).getvalue()
                t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
                chunk = _Chunk(fqn, obj_path, (0,), t, tuple(t.shape))
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
                    chunk = _Chunk(fqn, obj_path, offsets, planner.resolve_data(item).detach(),
                                   tuple(int(n) for n in item.tensor_data.size))
                tensor_chunks.append(chunk)
            items.append((item, chunk))

        ckpt_id = pdata.checkpoint_id
        if staged_qstate is not None:
            encoded = staged_qstate
        else:
            encoded = _to_host(_encode_chunks(
                tensor_chunks, rules=self.rules, bits=self.bits, block=self.block,
                keyframe=self.keyframe, checkpoint_id=ckpt_id, as_keyframe=self.as_keyframe,
            ))
        if byte_chunks:
            raw = quantize_state_dict(_nest({c.obj_path: c.tensor for c in byte_chunks}), rules="exact")
            encoded = dataclasses.replace(encoded, entries={**encoded.entries, **raw.entries})
        ref_id = self.keyframe.checkpoint_id if self.keyframe is not None else None

        # One file per rank, unless a rank holds two chunks of one tensor.
        seen: Counter[str] = Counter()
        per_file: dict[int, list[tuple[Any, _Chunk]]] = {}
        for item, chunk in items:
            per_file.setdefault(seen[chunk.fqn], []).append((item, chunk))
            seen[chunk.fqn] += 1
        results: list[WriteResult] = []
        for k, group in per_file.items():
            name = f"{pdata.prefix}{k}{FILE_SUFFIX}"
            fstate = _file_state(
                [c for _, c in group], encoded, checkpoint_id=ckpt_id, reference_id=ref_id, rank=rank
            )
            write_file(fstate, os.path.join(os.fspath(self.path), name), fsync=self.sync_files)
            for item, chunk in group:
                entry = fstate.entries[_tw_path(chunk.obj_path)]
                results.append(WriteResult(index=item.index, size_in_bytes=entry.nbytes,
                                           storage_data=StorageInfo(name, _tw_path(chunk.obj_path))))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

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
                    raise CheckpointIOError(exc.errno, f"{directory}: rank file {info.file} is missing at finish: {exc}") from exc
                files[info.file] = {"rank": int(info.file[2:].split("_")[0]), "bytes": size}
        doc = to_json(
            metadata,
            checkpoint_id=self._checkpoint_id,
            reference=None if self.keyframe is None else {
                "checkpoint_id": self.keyframe.checkpoint_id, "path": os.path.abspath(self.keyframe.path)},
            files=files,
        )
        write_json(doc, os.path.join(directory, METADATA_NAME), fsync=self.sync_files)


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint: valid metadata, every rank file there.

    The coordinator writes the metadata only after every rank's files are durable, so a
    save killed on any rank leaves a directory for which this is false.
    """
    try:
        complete_record(path)
    except CheckpointError:
        return False
    return True


def complete_record(path: str | os.PathLike) -> Record:
    """The record of the checkpoint in ``path``, once every rank file it lists is there
    with the size it recorded.

    Raises:
        CheckpointError: no valid metadata, or a rank file missing, replaced or truncated.
    """
    directory = os.fspath(path)
    rec = read_record(directory)
    for name, info in rec.files.items():
        fpath = os.path.join(directory, name)
        try:
            size = os.path.getsize(fpath)
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory}: rank file {name} (written by rank {info['rank']}) is missing"
            ) from None
        except OSError as exc:
            raise CheckpointIOError(exc.errno, f"{directory}: cannot stat rank file {name}: {exc}") from exc
        if size != info["bytes"]:
            raise CheckpointError(
                f"{directory}: rank file {name} has {size} bytes, {METADATA_NAME} "
                f"recorded {info['bytes']} (replaced or truncated)"
            )
    return rec


def find_keyframe(path: str | os.PathLike, reference: dict[str, str]) -> str:
    """The directory of the keyframe that the delta checkpoint in ``path`` records.

    Looked for by checkpoint id beside ``path`` first (the directory with the recorded
    keyframe's name, then the others), so a copied or moved run reads its own keyframe
    even where another run now sits at the recorded path; the recorded absolute path is
    the last resort. A directory with another id, or one that is not complete, is never
    returned.

    Args:
        path: the delta checkpoint's directory.
        reference: its record's ``{"checkpoint_id", "path"}``.

    Returns:
        The keyframe's directory.

    Raises:
        ReferenceMismatchError: no complete checkpoint with that id; the message names the
            candidates looked at and why each was passed over.
    """
    want, recorded = reference["checkpoint_id"], reference["path"]
    here = os.path.abspath(os.fspath(path))
    named = os.path.join(os.path.dirname(here), os.path.basename(recorded))
    passed_over: list[str] = []
    for cand, always_say in _keyframe_candidates(here, named, recorded):
        if not os.path.exists(cand):
            passed_over.append(f"{cand} is not there")
            continue
        try:
            found_id = read_record(cand).checkpoint_id
        except CheckpointError as exc:
            if always_say:
                passed_over.append(f"{cand}: {exc}")
            continue
        if found_id != want:
            if always_say:
                passed_over.append(f"{cand} is checkpoint {found_id!r}")
            continue
        try:
            complete_record(cand)
        except CheckpointError as exc:
            passed_over.append(f"{cand} is that checkpoint but incomplete: {exc}")
            continue
        return cand
    raise ReferenceMismatchError(
        f"{path} is a delta from keyframe checkpoint {want!r} (recorded at {recorded}); no "
        f"complete checkpoint with that id beside it or at the recorded path"
        + (f" ({'; '.join(passed_over)})" if passed_over else "") + "; pass reference="
    )


def _keyframe_candidates(here: str, named: str, recorded: str) -> Iterator[tuple[str, bool]]:
    """Directories that may hold a delta's keyframe, in the order :func:`find_keyframe`
    tries them, each with whether it is named in the error when passed over (the other
    siblings of ``here`` are tried only if they hold a record, and named only if their id
    matches)."""
    parent = os.path.dirname(here)
    try:
        siblings = sorted(os.listdir(parent))
    except OSError:
        siblings = []
    order = [(named, True)] + [(os.path.join(parent, n), False) for n in siblings]
    order.append((os.path.abspath(recorded), True))
    seen = {here}
    for cand, always_say in order:
        if cand in seen:
            continue
        seen.add(cand)
        if always_say or os.path.isfile(os.path.join(cand, METADATA_NAME)):
            yield cand, always_say


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

    Raises (during ``dcp.load``):
        CheckpointError: not a tw_triton DCP checkpoint (e.g. plain DCP), a missing rank
            file, files that do not match the metadata, corrupted data.
        ReferenceMismatchError: a delta checkpoint whose keyframe is missing or different.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        reference: "str | os.PathLike | Keyframe | None" = None,
        verify: bool = True,
    ) -> None:
        super().__init__(path)
        self._reference_arg = reference
        self.verify = verify
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

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
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
                self._keyframe = open_reference(ref)
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

    def _decode(self, name: str) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
        rec = self._record
        path = os.path.join(os.fspath(self.path), name)
        qstate = read_file(path, verify=self.verify)
        if qstate.checkpoint_id != rec.checkpoint_id:
            raise CheckpointError(
                f"{path}: file of checkpoint {qstate.checkpoint_id!r}, but {METADATA_NAME} "
                f"describes checkpoint {rec.checkpoint_id!r} (files and metadata do not match)"
            )
        table = qstate.metadata.get(_DCP_KEY, {}).get("chunks")
        if not isinstance(table, dict) or set(table) != set(qstate.entries) | set(qstate.aliases):
            raise CheckpointError(f"{path}: no valid DCP chunk table in the manifest metadata")
        reference = None
        if qstate.reference_id is not None:
            kf = self._reference()
            if qstate.reference_id != kf.checkpoint_id:
                raise ReferenceMismatchError(
                    f"{path}: deltas from {qstate.reference_id!r}, reference is {kf.checkpoint_id!r}"
                )
            delta = [p for p, e in qstate.entries.items() if _is_delta(e)]
            keys = [(table[p]["fqn"], tuple(table[p]["offsets"]), tuple(qstate.entries[p].shape)) for p in delta]
            regions = kf.regions(keys)
            reference = _nest({tuple(table[p]["obj_path"]): r for p, r in zip(delta, regions)})
        decoded, _ = flatten(dequantize_state_dict(qstate, reference=reference, source=path, verify=self.verify))
        return {p: (decoded[p], table[p]) for p in decoded}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        rec = self._record
        md = rec.metadata
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            info = md.storage_data.get(req.storage_index)
            if info is None:
                raise CheckpointError(f"{self.path}: {METADATA_NAME} has no storage for {req.storage_index}")
            per_file.setdefault(info.file, []).append((req, info))
        for name, reqs in per_file.items():
            decoded = self._decode(name)
            fpath = os.path.join(os.fspath(self.path), name)
            for req, info in reqs:
                got = decoded.get(info.entry)
                if got is None:
                    raise CheckpointError(f"{fpath}: no entry {info.entry!r} for {req.storage_index.fqn!r} ({METADATA_NAME} names it)")
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
                        raise CheckpointError(f"{fpath}: entry {info.entry!r}: not plain data, refused: {exc}") from exc
                    planner.load_bytes(req, io.BytesIO(raw))
                    continue
                off = req.storage_index.offset
                want = tuple(off) if off is not None else (0,) * tensor.dim()
                if tuple(row["offsets"]) != want:
                    raise CheckpointError(
                        f"{fpath}: entry {info.entry!r} is the chunk at {row['offsets']}, {METADATA_NAME} says {list(want)}"
                    )
                for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, o, n)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(
                        f"{fpath}: entry {info.entry!r}: read {tuple(tensor.size())}, the target needs {tuple(target.size())}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


__all__ = ["StorageWriter", "StorageReader", "FILE_SUFFIX", "is_complete", "complete_record", "find_keyframe"]
