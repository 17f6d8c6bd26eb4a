"""The state-level API: encode a whole training state, save it, load it back.

``quantize_state_dict`` takes any nested training state (a model ``state_dict()``, or
``{"model": ..., "optimizer": ..., "scheduler": ..., "scaler": ..., "step": ..., "rng": ...}``),
flattens it (:mod:`tw_triton.tree`), picks a codec per tensor (:mod:`tw_triton.rules`),
encodes every tensor on its own device (:mod:`tw_triton.codecs`) and returns a
:class:`~tw_triton.qstate.QuantizedState`: a consistent snapshot that ``save`` (or the async
writer) puts in one file.

Snapshot and syncs
    Exact entries are clones and quantized entries are fresh buffers, so changing the
    source tensors afterwards does not change the result. Whether a quantized tensor held a
    NaN/Inf is only known on the device; all these flags, and the reference fingerprints,
    are read with one ``torch.cat(...).cpu()`` per device: one host sync for a state on one
    GPU (none on the CPU). Flagged tensors are then stored exact, with a warning that names
    their path. With ``allocate`` (e.g. a lease of a
    :class:`~tw_triton.snapshot_pool.SnapshotPool`) the copies go into recycled host
    memory instead of fresh allocations; the bytes are the same.

Shared storage
    Tensors that are the same view of the same storage (same storage, offset, shape, stride
    and dtype, e.g. tied input/output embeddings) are stored once; the others are recorded
    as aliases and come back as the *same* tensor object under every key. Different views
    of one storage (e.g. two halves of one buffer) are stored separately and come back as
    independent tensors.

References
    With ``reference`` (a state of the same structure, or the path of a saved checkpoint),
    quantized entries store the delta from the reference tensor at the same path. The file
    records the reference's id (``reference_id``: the given id, else the reference file's
    checkpoint id, else ``"fp-"`` and a fingerprint of the reference) and, per delta entry,
    ``ref_fp``: a fingerprint of the reference tensor (2048 evenly spaced elements as fp32
    bits, weighted by position — cheap, deterministic on every device; it detects a wrong
    reference, it is not a checksum). Loading checks the id (for a reference given as a
    path), the presence and shape of every reference tensor, and every fingerprint, and
    raises :class:`~tw_triton.errors.ReferenceMismatchError` naming the file and entry. A
    state with no delta entry records no reference id: it does not depend on one.

    The reference used to encode must be what a loader will rebuild: pass the *decoded*
    keyframe (``load(keyframe_path)`` or ``dequantize_state_dict(keyframe_qstate)``), or
    its path, not the original tensors it was quantized from. A reference *file* may itself
    be a delta (a closed-loop chain, :mod:`tw_triton.deltas`): it is decoded against the
    checkpoint it names, found by id among the files in its directory, and so on back to a
    keyframe.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from .codecs.blockwise import FLOAT_DTYPES, check_params
from .codecs import Codec, Encoded, ExactCodec, get_codec
from .codecs.entropy import EntropyPolicy
from .errors import CheckpointError, QuantizationError, ReferenceMismatchError, TwTritonError, checkpoint_label
from .batching import group_batches
from .parallel import Background, parallel_map
from .qstate import EncodedEntry, QuantizedState
from .rules import resolve_rules, select_rule
from .snapshot_pool import Allocator
from .format import ENTRY_DTYPES
from .format import MAX_EXPANSION
from .tree import Flattened, check_skeleton, flatten, skeleton_ndarray_paths, unflatten

logger = logging.getLogger(__name__)

FINGERPRINT_SAMPLES = 2048
FINGERPRINT_PREFIX = "fp-"
MEMORY_SOURCE = "<in-memory state>"

Progress = Callable[[int, int], None]
PathLike = str | os.PathLike


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim int64 on ``t``'s device: position-weighted sum of sampled fp32 bit patterns.

    Integer arithmetic only (no overflow: |bits| < 2**31, weights <= 2048, 2048 terms), so
    every device gives the same value without a sync.
    """
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
    sample = flat[::step][:FINGERPRINT_SAMPLES].to(torch.float32)
    bits = sample.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
    return (bits * weights).sum() + flat.numel()


def _fp_hex(value: int) -> str:
    return format(value & 0xFFFFFFFFFFFFFFFF, "016x")


def _read_device_scalars(scalars: list[torch.Tensor]) -> list[int]:
    """Read 0-dim device scalars to Python ints with one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(scalars):
        by_device.setdefault(s.device, []).append(i)
    out = [0] * len(scalars)
    for dev, idx in by_device.items():
        host = torch.stack([scalars[i].to(torch.int64) for i in idx]).cpu().tolist()
        for i, v in zip(idx, host):
            out[i] = int(v)
    return out


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )


def _flat_reference(
    reference: Any,
    *,
    device: torch.device | None,
    verify: bool,
    expect_id: str | None = None,
    where: str = "",
    paths: Iterable[str] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> tuple[dict[str, torch.Tensor], str | None, str, bool]:
    """``(tensors by path, checkpoint id or None, description, owned)`` of a reference.

    ``owned``: the tensors were decoded here from a file, so nothing else holds them and a
    delta may be decoded over them.

    For a path, ``expect_id`` (a checkpoint id, not a fingerprint) is checked against the
    reference's manifest before its data is read, and with ``paths`` only those of its
    entries are read and decoded (a delta needs the tensors it is a delta of, not the
    reference's optimizer state); paths the file lacks are left out, for the caller to
    report. ``into``: tensors to read the reference file's exact entries into, and
    ``max_expansion``: the bound on its compressed buffers and on those of every earlier
    link it is decoded against (see :func:`~tw_triton.format.read_file`).
    """
    if isinstance(reference, (str, os.PathLike)):
        from .format import HeaderCache, read_file, read_manifest

        source = os.fspath(reference)
        headers = HeaderCache()  # the manifest read first is the read's header too
        manifest = read_manifest(reference, headers=headers)
        if expect_id is not None and not expect_id.startswith(FINGERPRINT_PREFIX):
            found = manifest.get("checkpoint_id")
            if found != expect_id:
                found_step = (manifest.get("metadata") or {}).get("step")
                raise ReferenceMismatchError(
                    f"{where} is a delta from reference checkpoint {expect_id!r}, but "
                    f"reference file {source!r} is {checkpoint_label(found, found_step)}"
                )
        wanted = None
        if paths is not None:
            held = set(manifest["entries"]) | set(manifest["aliases"])
            wanted = sorted(p for p in set(paths) if p in held)
        rq = read_file(reference, verify=verify, pin_memory=_wants_pinned(device), entries=wanted, headers=headers,
                       into=into, max_expansion=max_expansion)
        prev = None
        if delta_paths(rq, source):
            # A link of a closed-loop chain: it decodes against its own reference, found by
            # checkpoint id among the files beside it (recursively, back to a keyframe).
            prev = _find_checkpoint(os.path.dirname(source), rq.reference_id,
                                    f"{where or 'quantize_state_dict'}: reference file {source!r}",
                                    step=(rq.metadata or {}).get("reference_step"))
        if wanted is not None:
            tensors = dequantize_entries(
                rq, wanted, reference=prev, device=device, source=source, verify=verify, release_buffers=True,
                max_expansion=max_expansion,
            )
        else:
            state = dequantize_state_dict(
                rq, reference=prev, device=device, source=source, verify=verify, release_buffers=True,
                max_expansion=max_expansion,
            )
            tensors, _ = flatten(state)
        return tensors, rq.checkpoint_id, f"reference file {source!r}", True
    tensors, _ = flatten(reference)
    return tensors, None, "the in-memory reference", False


def _find_checkpoint(directory: str, checkpoint_id: str | None, where: str, step: Any = None) -> str:
    """The path of the checkpoint file in ``directory`` whose id is ``checkpoint_id``
    (``step``: its step where recorded, for the message).

    Raises:
        ReferenceMismatchError: no readable checkpoint file there has that id.
    """
    from .format import read_manifest

    directory = directory or "."
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise ReferenceMismatchError(f"{where}: cannot list {directory!r} to find checkpoint {checkpoint_id!r}: {e}") from e
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            if read_manifest(path).get("checkpoint_id") == checkpoint_id:
                return path
        except (CheckpointError, OSError):
            continue  # not a tw_triton checkpoint, or unreadable: not the one
    raise ReferenceMismatchError(
        f"{where} is itself a delta from {checkpoint_label(checkpoint_id, step)}, and no checkpoint "
        f"file in {directory!r} is that checkpoint"
    )


def _reference_tensor(
    ref_tensors: dict[str, torch.Tensor], path: str, x_shape: tuple[int, ...], where: str, what: str
) -> torch.Tensor:
    r = ref_tensors.get(path)
    if r is None:
        raise ReferenceMismatchError(f"{where}: entry {path!r} has no tensor in {what}")
    if tuple(r.shape) != tuple(x_shape):
        raise ReferenceMismatchError(
            f"{where}: entry {path!r} has shape {tuple(x_shape)} but {what} has "
            f"{tuple(r.shape)} there"
        )
    if r.dtype not in FLOAT_DTYPES:
        raise ReferenceMismatchError(
            f"{where}: entry {path!r}: {what} holds a {r.dtype} tensor there, expected a float tensor"
        )
    return r


def _batch_key(x: torch.Tensor, rule: Any, codec: Codec, ref: torch.Tensor | None) -> Any:
    """The key under which an entry's encode may share a call with others
    (:func:`tw_triton.batching.group_batches`), or ``None``: same codec, params and
    :meth:`Codec.batch_key`."""
    key = codec.batch_key(x, rule.params, ref)
    if key is None:
        return None
    try:
        frozen = tuple(sorted(rule.params.items()))
        hash(frozen)
    except TypeError:  # params holding lists or dicts: not worth a deep freeze
        return None
    return (rule.codec, frozen, key)


def _codec_or_raise(name: str, error: type[Exception], where: str) -> Codec:
    codec = get_codec(name)
    if codec is None:
        from .codecs import codec_names

        raise error(f"{where}: unknown codec {name!r}; registered: {', '.join(codec_names())}")
    return codec


def quantize_state_dict(
    state: Any,
    *,
    reference: Any = None,
    reference_id: str | None = None,
    rules: Any = None,
    bits: int = 8,
    block: int = 128,
    checkpoint_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    allocate: Allocator | None = None,
    copy: bool = True,
    max_expansion: float | None = MAX_EXPANSION,
) -> QuantizedState:
    """Encode a nested training state into a consistent, writable snapshot.

    Args:
        state: nested dict / list / tuple of tensors, numpy arrays and plain values, or
            that state already flattened (:class:`~tw_triton.tree.Flattened`).
        reference: ``None``, a state of the same structure, or the path of a saved
            checkpoint (read with :func:`load`); quantized entries become deltas from the
            reference tensor at the same path.
        reference_id: the id to record for an in-memory reference (e.g. the keyframe's
            checkpoint id); default: the reference file's id, or a fingerprint.
        rules: ``None`` (defaults), a preset name, or ``[(glob, codec spec), ...]``; see
            :mod:`tw_triton.rules`. Recorded in the result.
        bits, block: parameters of quantizing rules that do not set them.
        checkpoint_id: id of this checkpoint (default: a random UUID hex).
        metadata: small JSON-serializable metadata to record.
        progress: called as ``progress(done, total)`` after each tensor is encoded.
        allocate: where codecs put their output buffers, as ``allocate(shape, dtype,
            device)`` (:meth:`Codec.encode_with`): e.g. a
            :class:`~tw_triton.snapshot_pool.SnapshotLease`, so that the snapshot lands in
            host memory a previous save already faulted in. The result is the same; the
            caller must not recycle that memory while the result is still being read.
            ``None``: fresh buffers.
        copy: ``False`` when ``state`` is already a private snapshot that nothing changes
            until the result is written: exact entries of contiguous tensors then hold
            those tensors instead of copies.
        max_expansion: for a ``reference`` given as a path, the bound on that file's
            compressed buffers and those of its chain, as for :func:`load`.

    Returns:
        A :class:`QuantizedState`; its buffers live where the source tensors did.

    Raises:
        QuantizationError: an unsupported leaf (naming its path), bad rules or params.
        ReferenceMismatchError: a reference misses a quantized path, or has another shape.
    """
    check_params(bits, block)
    flat = Flattened.of(state)
    tensors, skeleton = flat.tensors, flat.skeleton
    rule_list = resolve_rules(rules, state, bits=bits, block=block)

    ref_tensors: dict[str, torch.Tensor] | None = None
    ref_file_id: str | None = None
    ref_what = ""
    if reference is not None:
        # A reference read from a file goes straight to the device the state lives on.
        ref_device = next((t.device for t in tensors.values() if t.device.type != "cpu"), None)
        ref_tensors, ref_file_id, ref_what, _ = _flat_reference(
            reference, device=ref_device, verify=True, max_expansion=max_expansion
        )

    aliases: dict[str, str] = {}
    first_by_storage: dict[tuple[Any, ...], str] = {}
    canonical: list[str] = []
    for path, t in tensors.items():
        key = _storage_key(t)
        if key is not None and key in first_by_storage:
            aliases[path] = first_by_storage[key]
            continue
        if key is not None:
            first_by_storage[key] = path
        canonical.append(path)

    def plan_one(path: str) -> tuple[torch.Tensor, Any, Codec, torch.Tensor | None]:
        x = tensors[path]
        rule = select_rule(rule_list, path, x)
        codec = _codec_or_raise(rule.codec, QuantizationError, f"entry {path!r}")
        ref = None
        if ref_tensors is not None and codec.uses_reference(rule.params):
            ref = _reference_tensor(ref_tensors, path, tuple(x.shape), "quantize_state_dict", ref_what)
            if ref.device != x.device:
                ref = ref.to(x.device, non_blocking=ref.is_pinned())
        return x, rule, codec, ref

    jobs = [plan_one(path) for path in canonical]

    def finish(i: int, enc: Encoded) -> tuple[Encoded, torch.Tensor | None]:
        _, rule, codec, ref = jobs[i]
        enc.entry.codec = rule.codec
        return enc, ref if ref is not None and codec.uses_reference(enc.entry.params) else None

    def encode_alone(i: int) -> tuple[Encoded, torch.Tensor | None]:
        x, rule, codec, ref = jobs[i]
        try:
            if not copy and isinstance(codec, ExactCodec) and x.is_contiguous():
                enc: Encoded = codec.wrap(x)
            elif allocate is None:
                enc = codec.encode(x, rule.params, ref)
            else:
                enc = codec.encode_with(x, rule.params, ref, allocate)
        except QuantizationError as e:
            raise QuantizationError(f"entry {canonical[i]!r} (codec {rule.codec!r}): {e}") from e
        return finish(i, enc)

    def encode_item(item: tuple[int, ...]) -> list[tuple[Encoded, torch.Tensor | None]]:
        if len(item) == 1:
            return [encode_alone(item[0])]
        _, rule, codec, ref = jobs[item[0]]
        refs = None if ref is None else [jobs[i][3] for i in item]
        try:
            encs = codec.encode_many([jobs[i][0] for i in item], rule.params, refs, allocate)
        except QuantizationError:
            # One at a time, so that the error names the entry it is about.
            return [encode_alone(i) for i in item]
        return [finish(i, enc) for i, enc in zip(item, encs)]

    # On the CPU the entries are encoded on several threads (each alone, or small ones of
    # one kind together: the bytes do not depend on it, see tw_triton.batching); device
    # tensors are encoded here, where their launches are queued.
    on_host = all(t.device.type == "cpu" for t in tensors.values())
    keys = [_batch_key(*job) if on_host else None for job in jobs]
    # Tuples of ints: the collector stops tracking them, so a save's few hundred work items
    # are not promoted towards a full collection while the encode runs.
    work = [tuple(item) for item in group_batches(keys, [job[0].numel() for job in jobs])]
    counted = [0]

    def report(k: int) -> None:
        for _ in work[k]:
            counted[0] += 1
            progress(counted[0], len(canonical))  # type: ignore[misc]

    results = parallel_map(
        encode_item, work,
        sizes=[sum(jobs[i][0].numel() * jobs[i][0].element_size() for i in item) for item in work],
        threads=None if on_host else 1,
        done=None if progress is None else report,
    )
    encoded: list[tuple[Encoded, torch.Tensor | None]] = [None] * len(canonical)  # type: ignore[list-item]
    for item, result in zip(work, results):
        for i, r in zip(item, result):
            encoded[i] = r

    entries: dict[str, EncodedEntry] = {}
    flagged: list[tuple[str, torch.Tensor]] = []
    fingerprinted: list[tuple[str, torch.Tensor]] = []
    exact = _codec_or_raise("exact", QuantizationError, "quantize_state_dict")
    for path, (enc, used_ref) in zip(canonical, encoded):
        entries[path] = enc.entry
        if enc.unusable is not None:
            flagged.append((path, enc.unusable))
        if used_ref is not None:
            fingerprinted.append((path, _fingerprint(used_ref)))

    # The one host sync: every NaN/Inf flag and every reference fingerprint together.
    values = _read_device_scalars([f for _, f in flagged] + [f for _, f in fingerprinted])
    for (path, _), bad in zip(flagged, values[: len(flagged)]):
        if bad:
            logger.warning(
                "entry %r holds NaN or Inf (in the tensor, its reference or their "
                "difference); stored exact instead of with codec %r",
                path,
                entries[path].codec,
            )
            x = tensors[path]
            if not copy and isinstance(exact, ExactCodec) and x.is_contiguous():
                entries[path] = exact.wrap(x).entry
            elif allocate is None:
                entries[path] = exact.encode(x, {}, None).entry
            else:
                entries[path] = exact.encode_with(x, {}, None, allocate).entry
            entries[path].codec = "exact"
    fp_parts = []
    for (path, _), fp in zip(fingerprinted, values[len(flagged):]):
        entry = entries[path]
        if entry.codec != "exact":
            # A copy: a codec may hand back its rule's params object, which must stay as is.
            entry.params = {**entry.params, "ref_fp": _fp_hex(fp)}
            fp_parts.append(f"{path}={entry.params['ref_fp']}")

    recorded_ref_id = None
    if fp_parts:
        if reference_id is not None:
            recorded_ref_id = reference_id
        elif ref_file_id is not None:
            recorded_ref_id = ref_file_id
        else:
            digest = hashlib.sha256("\n".join(sorted(fp_parts)).encode()).hexdigest()
            recorded_ref_id = FINGERPRINT_PREFIX + digest[:16]

    return QuantizedState(
        entries=entries,
        skeleton=skeleton,
        checkpoint_id=checkpoint_id or uuid.uuid4().hex,
        reference_id=recorded_ref_id,
        aliases=aliases,
        rules=[r.to_json() for r in rule_list],
        metadata=dict(metadata or {}),
    )


def delta_paths(qstate: QuantizedState, source: str) -> list[str]:
    """Paths of ``qstate``'s delta entries (those decoded against a reference).

    Raises:
        CheckpointError: an entry of an unknown codec (naming ``source`` and the entry).
    """
    out = []
    for path, entry in qstate.entries.items():
        codec = _codec_or_raise(entry.codec, CheckpointError, f"{source}: entry {path!r}")
        # Checked before uses_reference reads them: "delta": 1 is no answer to "is it a delta".
        codec.check_stored_params(entry.params, _entry_context(source, path, entry.codec))
        if codec.uses_reference(entry.params):
            out.append(path)
    return out


def _entry_context(source: str, path: str, codec: str) -> str:
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
        codec = _codec_or_raise(entry["codec"], CheckpointError, f"{source}: entry {path!r}")
        codec.check_stored_params(entry["params"], _entry_context(source, path, entry["codec"]))
        dtypes[path] = ENTRY_DTYPES[entry["dtype"]]
    for alias, target in manifest["aliases"].items():
        dtypes[alias] = dtypes[target]
    try:
        check_skeleton(manifest["skeleton"], dtypes)
    except CheckpointError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _wants_pinned(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda" and torch.cuda.is_available()


def dequantize_state_dict(
    qstate: QuantizedState,
    *,
    reference: Any = None,
    device: torch.device | str | None = None,
    source: str | None = None,
    progress: Progress | None = None,
    verify: bool = True,
    reuse_reference: bool = False,
    release_buffers: bool = False,
    max_expansion: float | None = MAX_EXPANSION,
) -> Any:
    """Decode a :class:`QuantizedState` back into its nested state.

    Args:
        qstate: the encoded state (from :func:`quantize_state_dict` or a file).
        reference: required when some entry is a delta: the same reference state that was
            used to encode, or the path of that reference checkpoint.
        device: where to put the tensors (``None``: where the buffers are). Numpy arrays
            come back as numpy arrays.
        source: the file name for error messages (default: an in-memory state).
        progress: called as ``progress(done, total)`` after each entry is decoded.
        verify: check checksums when reading a reference given as a path.
        reuse_reference: the in-memory ``reference`` is yours to give up: delta entries
            are decoded into its tensors (on the host, where the codec can), which then
            hold the result. Saves one full-size buffer per delta tensor. A reference read
            from a path is always reused this way (it is decoded for this call alone).
        release_buffers: ``qstate`` is yours to give up: each entry's stored buffers are
            dropped from it as soon as the entry is decoded, so the stored and the decoded
            bytes of the whole state are never held together (what :func:`load` does with
            the state it read). ``qstate``'s entries have no buffers afterwards.
        max_expansion: for a ``reference`` given as a path, the bound on what the
            compressed buffers of that file (and of each earlier link of its chain) may
            decode to, as for :func:`load`.

    Returns:
        The nested state with its original container, key and leaf types. Exact entries
        share memory with ``qstate``'s buffers when no device move is needed; tied tensors
        are the same object under every key.

    Raises:
        ReferenceMismatchError: a delta entry and no reference, a reference with another id,
            a missing or differently shaped reference tensor, or a fingerprint mismatch.
        CheckpointError: an unknown codec, or an entry whose params or buffers do not
            match its codec; the message names the file and the entry.
    """
    return _dequantize(
        qstate, reference, device, source, progress, verify, reuse_reference, release_buffers,
        max_expansion=max_expansion,
    )


def _dequantize(
    qstate: QuantizedState,
    reference: Any,
    device: torch.device | str | None,
    source: str | None,
    progress: Progress | None,
    verify: bool,
    reuse_reference: bool,
    release_buffers: bool,
    ref_into: Mapping[str, torch.Tensor] | None = None,
    *,
    max_expansion: float | None = MAX_EXPANSION,
) -> Any:
    """:func:`dequantize_state_dict`; ``ref_into``: tensors to read a reference given as a
    path into (its exact entries, see :func:`~tw_triton.format.read_file`)."""
    where = source or MEMORY_SOURCE
    dev = torch.device(device) if device is not None else None
    out = _decode_entries(
        qstate, None, reference, dev, where, progress, verify, reuse_reference, release_buffers, ref_into,
        max_expansion=max_expansion,
    )
    try:
        return unflatten(qstate.skeleton, out)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e


def disjoint_paths(tensors: dict[str, torch.Tensor], paths: Iterable[str]) -> set[str]:
    """The paths whose tensor shares no byte with another path's: those a delta may be
    decoded over without changing what another entry reads (tied tensors are one tensor
    under two paths)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), p) for p in paths if (t := tensors[p]).numel()
    )
    alone = set()
    reach = -1  # the furthest end of the spans before this one
    for i, (start, end, path) in enumerate(spans):
        if reach <= start and (i + 1 == len(spans) or spans[i + 1][0] >= end):
            alone.add(path)
        reach = max(reach, end)
    return alone


def dequantize_entries(
    qstate: QuantizedState,
    paths: Iterable[str],
    *,
    reference: Any = None,
    device: torch.device | str | None = None,
    source: str | None = None,
    verify: bool = True,
    reuse_reference: bool = False,
    release_buffers: bool = False,
    max_expansion: float | None = MAX_EXPANSION,
) -> dict[str, torch.Tensor]:
    """Decode only the entries at ``paths`` (aliases included) into ``{path: tensor}``.

    What a chain of deltas needs from each link but the last: the tensors the next link
    is a delta of, not the whole state. ``reference``, ``reuse_reference``,
    ``release_buffers`` and ``max_expansion`` are as for :func:`dequantize_state_dict`; a
    reference is needed only if one of ``paths`` is a delta entry.

    Raises:
        CheckpointError: a path with no entry, or anything :func:`dequantize_state_dict`
            raises for those entries.
    """
    where = source or MEMORY_SOURCE
    dev = torch.device(device) if device is not None else None
    wanted = set(paths)
    missing = sorted(p for p in wanted if p not in qstate.entries and p not in qstate.aliases)
    if missing:
        raise CheckpointError(f"{where}: has no entry {missing[0]!r} (needed to decode the next delta)")
    targets = {qstate.aliases.get(p, p) for p in wanted}
    out = _decode_entries(
        qstate, targets, reference, dev, where, None, verify, reuse_reference, release_buffers,
        max_expansion=max_expansion,
    )
    return {p: out[qstate.aliases.get(p, p)] for p in wanted}


def _decode_entries(
    qstate: QuantizedState,
    only: set[str] | None,
    reference: Any,
    dev: torch.device | None,
    where: str,
    progress: Progress | None,
    verify: bool,
    reuse_reference: bool = False,
    release_buffers: bool = False,
    ref_into: Mapping[str, torch.Tensor] | None = None,
    *,
    max_expansion: float | None = MAX_EXPANSION,
) -> dict[str, torch.Tensor]:
    """Decode the entries of ``qstate`` (those in ``only``, or all) and resolve aliases
    (``max_expansion``: the bound on a reference file, see :func:`load`).

    A delta entry is decoded over its reference tensor (:meth:`Codec.decode_over`) when the
    reference is owned (read from a file here, or ``reuse_reference``) and no other delta
    entry reads the same memory (tied tensors). On the host, a reference file is read on a
    thread of its own while the entries that need no reference (the optimizer's moments)
    are decoded; ``reference`` may also be that read already started
    (:class:`~tw_triton.parallel.Background`, see :func:`load`).
    """
    delta = set(delta_paths(qstate, where))
    if only is not None:
        delta &= only
    # Decoding on the host runs on several threads, as encoding does; on a device, here.
    on_host = (dev is None or dev.type == "cpu") and all(
        b.device.type == "cpu" for e in qstate.entries.values() for b in e.buffers.values()
    )
    pending = reference if isinstance(reference, Background) else None
    if delta and reference is None:
        first = sorted(delta)[0]
        more = f" (and {len(delta) - 1} more)" if len(delta) > 1 else ""
        raise ReferenceMismatchError(
            f"{where}: entry {first!r}{more} is stored as a delta from reference "
            f"{checkpoint_label(qstate.reference_id, (qstate.metadata or {}).get('reference_step'))}, "
            "and no reference was given (pass the reference checkpoint's path or its decoded state)"
        )
    if delta and on_host and pending is None and isinstance(reference, (str, os.PathLike)):
        pending = _read_reference(reference, qstate.reference_id, delta, dev, verify, where, ref_into, max_expansion)

    # numpy leaves come back as arrays: decode them on the host, not via the GPU.
    host_paths = set(skeleton_ndarray_paths(qstate.skeleton))
    host = torch.device("cpu")
    total = len(qstate.entries)
    indexed = [(i, path) for i, path in enumerate(qstate.entries) if only is None or path in only]
    ref_tensors: dict[str, torch.Tensor] = {}
    reusable: set[str] = set()

    def decode_one(item: tuple[int, str]) -> torch.Tensor:
        path = item[1]
        entry = qstate.entries[path]
        codec = _codec_or_raise(entry.codec, CheckpointError, f"{where}: entry {path!r}")
        context = _entry_context(where, path, entry.codec)
        target = host if path in host_paths and dev is not None else dev
        ref = ref_tensors.get(path) if path in delta else None
        try:
            if path in reusable:
                decoded = codec.decode_over(entry, ref, target, context)
            else:
                decoded = codec.decode(entry, ref, target, context)
        except QuantizationError as e:
            raise CheckpointError(f"{context}: {e}") from e
        except (TwTritonError, MemoryError, torch.OutOfMemoryError):
            raise
        except Exception as e:
            # The codec checked what it knows to check; anything else a crafted entry makes
            # it raise is still a file that cannot be decoded, and must say which entry.
            raise CheckpointError(f"{context}: cannot be decoded: {type(e).__name__}: {e}") from e
        if release_buffers:
            # A new dict, not clear(): one attribute store, and a reader of the old dict
            # (none here but this thread) would still see it whole.
            entry.buffers = {}
        return decoded

    decoded: dict[str, torch.Tensor] = {}

    def decode(items: list[tuple[int, str]]) -> None:
        # An exact entry decodes to a view of its buffer on the host: no work for a worker
        # (the snapshot that save() decodes is all exact, and it blocks the loop).
        count = len(decoded)
        results = parallel_map(
            decode_one, items,
            sizes=[0 if qstate.entries[p].codec == "exact" else qstate.entries[p].raw_nbytes for _, p in items],
            threads=None if on_host else 1,
            done=None if progress is None else (lambda k: progress(count + k + 1, total)),
        )
        decoded.update((path, t) for (_, path), t in zip(items, results))

    if pending is not None:
        try:
            decode([item for item in indexed if item[1] not in delta])
        except BaseException:
            pending.wait()
            raise
        reference = pending.result()
    if delta:
        ref_tensors, owned = _checked_reference(qstate, delta, reference, dev, verify, where, ref_into, max_expansion)
        reusable = disjoint_paths(ref_tensors, delta) if owned or reuse_reference else set()
    decode([item for item in indexed if item[1] not in decoded])
    out = {path: decoded[path] for _, path in indexed}
    for path, target in qstate.aliases.items():
        if only is not None and target not in only:
            continue
        if target not in out:
            raise CheckpointError(f"{where}: alias {path!r} points to {target!r}, which has no entry")
        out[path] = out[target]
    return out


def _read_reference(
    reference: PathLike,
    reference_id: str | None,
    delta: set[str],
    dev: torch.device | None,
    verify: bool,
    where: str,
    into: Mapping[str, torch.Tensor] | None,
    max_expansion: float | None = MAX_EXPANSION,
) -> Background[_ReadReference]:
    """Start reading and decoding the tensors of a reference file that ``delta`` needs, on a
    thread of its own (what :func:`_checked_reference` then takes)."""
    first = sorted(delta)[0]

    def run() -> _ReadReference:
        tensors, _, what, _ = _flat_reference(
            reference, device=dev, verify=verify, expect_id=reference_id,
            where=f"{where}: entry {first!r}", paths=delta, into=into, max_expansion=max_expansion,
        )
        return _ReadReference(tensors, what)

    return Background(run, name="tw_triton-reference")


@dataclass(frozen=True)
class _ReadReference:
    """The tensors of a reference file read by :func:`_read_reference` (owned: read for the
    one decode that takes them), and how messages name that file."""

    tensors: dict[str, torch.Tensor]
    what: str


def _checked_reference(
    qstate: QuantizedState,
    delta: set[str],
    reference: Any,
    dev: torch.device | None,
    verify: bool,
    where: str,
    into: Mapping[str, torch.Tensor] | None,
    max_expansion: float | None = MAX_EXPANSION,
) -> tuple[dict[str, torch.Tensor], bool]:
    """The reference tensors of the ``delta`` entries, on ``dev``, each checked against its
    entry (presence, shape, dtype, fingerprint), and whether they are owned (read from a
    file). ``reference``: a state, a path, or a :class:`_ReadReference`."""
    first = sorted(delta)[0]
    if isinstance(reference, _ReadReference):
        ref_tensors, ref_what, owned = reference.tensors, reference.what, True
    else:
        ref_tensors, _, ref_what, owned = _flat_reference(
            reference, device=dev, verify=verify, expect_id=qstate.reference_id, where=f"{where}: entry {first!r}",
            paths=delta, into=into, max_expansion=max_expansion,
        )
    rid = qstate.reference_id
    checks: list[tuple[str, torch.Tensor]] = []
    for path in sorted(delta):
        entry = qstate.entries[path]
        r = _reference_tensor(ref_tensors, path, tuple(entry.shape), where, ref_what)
        if dev is not None and r.device != dev:
            r = r.to(dev)
        ref_tensors[path] = r
        if "ref_fp" in entry.params:
            checks.append((path, _fingerprint(r)))
    for (path, _), fp in zip(checks, _read_device_scalars([f for _, f in checks])):
        want = qstate.entries[path].params["ref_fp"]
        if _fp_hex(fp) != want:
            raise ReferenceMismatchError(
                f"{where}: entry {path!r} is a delta from reference {rid!r}, but the "
                f"reference tensor given for it differs from the one it was encoded "
                f"against (fingerprint {_fp_hex(fp)}, expected {want}); {ref_what} is "
                "not that reference"
            )
    return ref_tensors, owned


def save(
    qstate: QuantizedState,
    path: PathLike,
    *,
    fsync: bool = True,
    entropy: str | EntropyPolicy | None = "auto",
) -> int:
    """Write ``qstate`` to one safetensors file at ``path`` (atomically); return its size.

    Buffers on a GPU are copied to the host first. ``entropy`` picks the lossless stage:
    ``"auto"`` (default policy), ``None``/``"none"`` (raw), or an
    :class:`~tw_triton.codecs.entropy.EntropyPolicy`. See :func:`tw_triton.format.write_file`.
    """
    from .format import write_file

    return write_file(qstate, path, fsync=fsync, entropy=entropy)


def load(
    path: PathLike,
    *,
    device: torch.device | str = "cpu",
    reference: Any = None,
    verify: bool = True,
    progress: Progress | None = None,
    into: Any = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> Any:
    """Load a checkpoint written by :func:`save` and decode it on ``device``.

    To a CUDA device the file is read into pinned host memory, copied with non-blocking
    H2D copies and decoded there by the Triton kernels. To the CPU, exact tensors are the
    buffers read from the file (no extra copy), and a reference given as a path is read on
    a thread of its own while this file is read and its entries that need no reference
    are decoded.

    Args:
        path: the checkpoint file.
        device: where the tensors go.
        reference: for a delta checkpoint, its reference: a path or a decoded state.
        verify: check per-buffer checksums while reading.
        progress: called as ``progress(done, total)`` after each entry is decoded.
        into: live objects laid out as the saved state (see :func:`decode_targets`):
            on the CPU, their tensors that the file (or, for a delta, its reference file)
            stores exact are filled in place, and the returned state holds them. If the
            load fails part way, they may hold part of what was read.
        max_expansion: the bound on what the compressed buffers of the file (and of a
            reference file given as a path, and of each earlier link of a closed-loop
            chain found beside it) may decode to: ``max_expansion`` times the
            file's size plus :data:`~tw_triton.format.EXPANSION_SLACK_BYTES`, checked before
            anything is decoded (see :func:`~tw_triton.format.read_file`). Raise it, or
            pass ``None``, for a file that stores large constant tensors on purpose.

    Raises:
        CheckpointError: the file is malformed, corrupted, uses an unknown codec, or its
            compressed buffers decode to more than ``max_expansion`` allows.
        ReferenceMismatchError: a delta checkpoint with a missing or different reference.
    """
    from .format import HeaderCache, read_file, read_manifest

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TwTritonError(f"cannot load {os.fspath(path)} to {dev}: CUDA is not available")
    source = os.fspath(path)
    targets = decode_targets(into) if into is not None and dev.type == "cpu" else None
    headers = HeaderCache()  # the manifest read first is the read's header too
    pending = None
    if dev.type == "cpu" and isinstance(reference, (str, os.PathLike)):
        # A reference file is read while this file is: the delta's manifest names the
        # entries it needs. (Alone, the delta file's hundreds of small buffers run on this
        # thread while a core waits for them.)
        manifest = read_manifest(source, headers=headers)
        delta = manifest_delta_paths(manifest)
        if delta:
            # A reference read from a path takes the targets too: the delta is decoded over them.
            pending = _read_reference(
                reference, manifest.get("reference_id"), delta, dev, verify, source, targets, max_expansion
            )
    try:
        qstate = read_file(
            path, verify=verify, pin_memory=_wants_pinned(dev), into=targets, headers=headers, max_expansion=max_expansion
        )
    except BaseException:
        if pending is not None:
            pending.wait()
        raise
    return _dequantize(
        qstate, pending or reference, dev, source, progress, verify, False, True, ref_into=targets,
        max_expansion=max_expansion,
    )


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


def state_of(value: Any) -> Any:
    """An object's ``state_dict()``, or a plain value (a tensor too) as it is."""
    state_dict = getattr(value, "state_dict", None)
    if callable(state_dict) and not isinstance(value, torch.Tensor):
        return state_dict()
    return value


def decode_targets(into: Any) -> dict[str, torch.Tensor]:
    """The tensors a load may decode into, by the paths of the saved state.

    ``into`` is laid out as the state that was saved: an object with ``state_dict()`` (a
    module, an optimizer) stands for its state dict, at the top or as a value of a dict
    (``{"model": model, "optimizer": opt}`` for ``{"model": model.state_dict(), ...}``);
    plain dicts, lists and tensors stand for themselves. Kept: contiguous CPU tensors of
    the plain ``torch.Tensor`` type (no subclass) that share no memory with another (tied
    weights are left out). A structure the format cannot hold gives none.
    """
    top = state_of(into)
    if isinstance(top, dict):
        top = {k: state_of(v) for k, v in top.items()}
    try:
        tensors, _ = flatten(top)
    except QuantizationError:
        return {}
    # Plain tensors only: a subclass (a DTensor's shard, a wrapper) may not own the memory
    # its data pointer shows; load_state_dict knows how to fill it.
    fit = {
        p: t for p, t in tensors.items()
        if type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and t.numel()
    }
    return {p: fit[p] for p in disjoint_paths(fit, fit)}


__all__ = ["quantize_state_dict", "dequantize_state_dict", "dequantize_entries", "decode_targets", "save", "load"]
