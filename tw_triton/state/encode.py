"""Encode a whole training state into a :class:`~tw_triton.qstate.QuantizedState`.

:func:`quantize_state_dict` flattens the state (:mod:`tw_triton.tree`), picks a codec per
tensor (:mod:`tw_triton.rules`), encodes each on its own device (:mod:`tw_triton.codecs`)
and returns a consistent snapshot; tied tensors are stored once, NaN/Inf tensors exact,
and sparse tensors that the rules store exact by the lossless ``bitmask`` codec.
Why one host sync per state and how references are recorded: docs/design.md.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..batching import group_batches
from ..codecs import Codec, Encoded, ExactCodec, get_codec
from ..codecs.bitmask import BitmaskCodec, sparse_candidate, sparse_pays, sparsity_counts
from ..codecs.blockwise import check_params
from ..delta_bits import adapt as adapt_delta_bits
from ..errors import QuantizationError
from ..format import MAX_EXPANSION, check_max_expansion
from ..parallel import parallel_map
from ..qstate import EncodedEntry, QuantizedState
from ..rules import keyframe_rule, resolve_rules, select_rule
from ..snapshot_pool import Allocator
from ..tree import Flattened
from . import fingerprints
from .entries import codec_or_raise
from .fingerprints import FINGERPRINT_PREFIX
from .grouped import DeviceEncode, groups_launches
from .partners import encode_partnered, encode_pending, plan_partners, settle
from .references import flat_reference, reference_tensor

logger = logging.getLogger(__name__)
# The flags of a group that raises none (exact copies).
FLAGLESS = torch.zeros(0, dtype=torch.int64)

Progress = Callable[[int, int], None]


def storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
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


def batch_key(x: torch.Tensor, rule: Any, codec: Codec, ref: torch.Tensor | None) -> Any:
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


def decided_after_sync(on_host: bool) -> bool:
    """Whether the sparse candidates of a state are counted into the one host sync and
    encoded after it (a state with device tensors), rather than each counted where it is
    encoded (a state on the host, where reading a count costs nothing)."""
    return not on_host


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
    sparse: bool = True,
    keep_decoded: bool = False,
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
        sparse: store a float tensor that the rules store exact with the lossless
            ``bitmask`` codec where that is smaller (docs/codecs.md, "The sparse codec");
            ``False``: exact, as the rules say (a snapshot that must stay a plain copy).
        keep_decoded: keep the host tensors the encode decodes anyway in the result's
            ``decoded`` (for :func:`~tw_triton.deltas.advance` and
            :func:`~tw_triton.deltas.keyframe_values`, which take them).

    Returns:
        A :class:`QuantizedState`; its buffers live where the source tensors did.

    Raises:
        QuantizationError: an unsupported leaf (naming its path), bad rules or params, an
            id that is not a str, ``metadata`` that is not a mapping.
        CheckpointError: a ``max_expansion`` that is not a bound.
        ReferenceMismatchError: a reference misses a quantized path, or has another shape.
    """
    check_params(bits, block)
    for name, value in (("checkpoint_id", checkpoint_id), ("reference_id", reference_id)):
        if value is not None and not isinstance(value, str):
            raise QuantizationError(f"{name} must be a str or None, got {value!r} ({type(value).__name__})")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise QuantizationError(f"metadata must be a mapping or None, got {type(metadata).__name__}")
    check_max_expansion(max_expansion)  # used only with a reference path: checked always
    flat = Flattened.of(state)
    tensors, skeleton = flat.tensors, flat.skeleton
    rule_list = resolve_rules(rules, state, bits=bits, block=block)

    ref_tensors: dict[str, torch.Tensor] | None = None
    ref_file_id: str | None = None
    ref_what = ""
    if reference is not None:
        # A reference read from a file goes straight to the device the state lives on.
        ref_device = next((t.device for t in tensors.values() if t.device.type != "cpu"), None)
        ref_tensors, ref_file_id, ref_what, _ = flat_reference(
            reference, device=ref_device, verify=True, max_expansion=max_expansion
        )

    aliases: dict[str, str] = {}
    first_by_storage: dict[tuple[Any, ...], str] = {}
    canonical: list[str] = []
    for path, t in tensors.items():
        key = storage_key(t)
        if key is not None and key in first_by_storage:
            aliases[path] = first_by_storage[key]
            continue
        if key is not None:
            first_by_storage[key] = path
        canonical.append(path)

    def plan_one(path: str) -> tuple[torch.Tensor, Any, Codec, torch.Tensor | None]:
        x = tensors[path]
        rule = select_rule(rule_list, path, x)
        codec = codec_or_raise(rule.codec, QuantizationError, f"entry {path!r}")
        ref = None
        if ref_tensors is None and codec.reference_optional and codec.uses_reference(rule.params):
            # No reference at all (a keyframe-less, standalone save): code it as a keyframe
            # would (log2-temporal: its absolute log2 codes, half the bytes of codes vs zero).
            rule = keyframe_rule(rule)
            codec = codec_or_raise(rule.codec, QuantizationError, f"entry {path!r}")
        if ref_tensors is not None and codec.uses_reference(rule.params):
            r = ref_tensors.get(path)
            if codec.reference_optional and (r is None or tuple(r.shape) != tuple(x.shape)):
                return x, rule, codec, None  # coded on its own, stored as no delta
            ref = reference_tensor(ref_tensors, path, tuple(x.shape), "quantize_state_dict", ref_what)
        return x, rule, codec, ref

    # Rules with max_error pick each tensor's bits here (one transfer per device; where
    # launches are grouped, grouped statistics).
    jobs = adapt_delta_bits([plan_one(path) for path in canonical], grouped=groups_launches)
    partners = plan_partners(canonical, jobs, aliases)  # encoded last (encode_partnered)
    exact = codec_or_raise("exact", QuantizationError, "quantize_state_dict")
    bitmask = get_codec("bitmask") if sparse else None
    # Tensors the rules store exact that may be sparse: on the host each is counted and
    # decided where it is encoded; on a device their counts join the one host sync below,
    # and they are encoded after it.
    sparse_jobs = {
        i
        for i, (x, _, codec, _) in enumerate(jobs)
        if isinstance(bitmask, BitmaskCodec) and isinstance(codec, ExactCodec) and sparse_candidate(x)
    }
    # Where the launches are grouped (a device state) the counts join the one host read.
    on_host = all(not groups_launches(t.device) for t in tensors.values())
    deferred = sorted(sparse_jobs) if decided_after_sync(on_host) else []
    later = set(deferred)
    # A device's are counted by the grouped encode, into its buffer (one grouped op).
    counts = [c for i in deferred for c in sparsity_counts(jobs[i][0])] if on_host else []

    def exact_entry(x: torch.Tensor) -> EncodedEntry:
        if not copy and isinstance(exact, ExactCodec) and x.is_contiguous():
            entry = exact.wrap(x).entry
        elif allocate is None:
            entry = exact.encode(x, {}, None).entry
        else:
            entry = exact.encode_with(x, {}, None, allocate).entry
        entry.codec = "exact"
        return entry

    def exact_entries(xs: list[torch.Tensor]) -> list[EncodedEntry]:
        """:func:`exact_entry` of each; on a device, the copies in one grouped op per device."""
        out: dict[int, EncodedEntry] = {}
        by_device: dict[torch.device, list[int]] = {}
        for k, x in enumerate(xs):
            if on_host or not isinstance(exact, ExactCodec) or (not copy and x.is_contiguous()):
                out[k] = exact_entry(x)
            else:
                by_device.setdefault(x.device, []).append(k)
        for members in by_device.values():
            encs = exact.encode_group([xs[k] for k in members], {}, None, FLAGLESS)  # type: ignore[union-attr]
            for k, enc in zip(members, encs):
                enc.entry.codec = "exact"
                out[k] = enc.entry
        return [out[k] for k in range(len(xs))]

    def sparse_entry(x: torch.Tensor, nnz: int, runs: int) -> EncodedEntry | None:
        if not sparse_pays(x.numel(), nnz, x.element_size(), runs):
            return None
        return bitmask.encode_counted(x, nnz, allocate).entry  # type: ignore[union-attr]

    def on_device(ref: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
        # Moved only while its tensor is encoded: a host reference of a device state is
        # never on the device whole (docs/training-loop.md, "Memory").
        if ref is None or ref.device == x.device:
            return ref
        return ref.to(x.device, non_blocking=ref.is_pinned())

    def finish(
        i: int, enc: Encoded, ref: torch.Tensor | None, fp: torch.Tensor | None = None
    ) -> tuple[Encoded, torch.Tensor | None]:
        """The entry, and the fingerprint of the reference it used (a device scalar)."""
        _, rule, codec, _ = jobs[i]
        enc.entry.codec = rule.codec
        if ref is None or not codec.uses_reference(enc.entry.params):
            return enc, None
        return enc, fingerprints.fingerprint(ref) if fp is None else fp

    def encode_alone(i: int) -> tuple[Encoded | None, torch.Tensor | None]:
        """Entry ``i`` by itself, and its reference's fingerprint (the host path)."""
        if i in sparse_jobs and i not in later:
            x = jobs[i][0]
            entry = sparse_entry(x, *(int(c) for c in sparsity_counts(x)))
            if entry is not None:
                return Encoded(entry), None
        enc, ref = encode_one(i)
        return (None, None) if enc is None else finish(i, enc, ref)

    def encode_one(i: int) -> tuple[Encoded | None, torch.Tensor | None]:
        """Entry ``i`` by itself and the reference it used; ``None`` for one decided after
        the host read (a device's sparse candidates)."""
        x, rule, codec, ref = jobs[i]
        if i in later or i in partners:
            return None, None
        ref = on_device(ref, x)
        try:
            if not copy and isinstance(codec, ExactCodec) and x.is_contiguous():
                enc: Encoded = codec.wrap(x)
            elif allocate is None:
                enc = codec.encode(x, rule.params, ref)
            else:
                enc = codec.encode_with(x, rule.params, ref, allocate)
        except QuantizationError as e:
            raise QuantizationError(f"entry {canonical[i]!r} (codec {rule.codec!r}): {e}") from e
        return enc, ref

    def encode_item(item: tuple[int, ...]) -> list[tuple[Encoded, torch.Tensor | None]]:
        if len(item) == 1:
            return [encode_alone(item[0])]
        _, rule, codec, ref = jobs[item[0]]
        refs = None if ref is None else [on_device(jobs[i][3], jobs[i][0]) for i in item]
        try:
            encs = codec.encode_many([jobs[i][0] for i in item], rule.params, refs, allocate)
        except QuantizationError:
            # One at a time, so that the error names the entry it is about.
            return [encode_alone(i) for i in item]
        return [
            finish(i, enc, None if refs is None else refs[k]) for k, (i, enc) in enumerate(zip(item, encs))
        ]

    # On the CPU the entries are encoded on several threads (each alone, or small ones of
    # one kind together: the bytes do not depend on it, see tw_triton.batching); device
    # tensors are encoded here, where their launches are queued, in groups (grouped.py).
    encoded: list[tuple[Encoded, torch.Tensor | None]] = [None] * len(canonical)  # type: ignore[list-item]
    fps: dict[int, torch.Tensor] = {}
    scalar_buffers: list[torch.Tensor] = []
    if on_host:
        keys = [batch_key(*job) for job in jobs]
        # Tuples of ints: the collector stops tracking them, so a save's few hundred work
        # items are not promoted towards a full collection while the encode runs.
        work = [tuple(item) for item in group_batches(keys, [job[0].numel() for job in jobs])]
        counted = [0]

        def report(k: int) -> None:
            for _ in work[k]:
                counted[0] += 1
                progress(counted[0], len(canonical))  # type: ignore[misc]

        results = parallel_map(
            encode_item,
            work,
            sizes=[sum(jobs[i][0].numel() * jobs[i][0].element_size() for i in item) for item in work],
            done=None if progress is None else report,
        )
        for item, result in zip(work, results):
            for i, r in zip(item, result):
                encoded[i] = r
    else:
        # An exact entry kept as it is (a private snapshot) is no copy: not grouped.
        # A sparse candidate is decided after the sync: not grouped either.
        def kept(i: int) -> bool:
            return i in sparse_jobs or (
                not copy and isinstance(jobs[i][2], ExactCodec) and jobs[i][0].is_contiguous()
            )

        grouped = DeviceEncode(jobs, lambda i: encode_one(i)[0], kept, deferred)
        encs, fps = grouped.run()
        counts = grouped.counts
        scalar_buffers = list(grouped.buffers.values())
        for i, enc in enumerate(encs):
            encoded[i] = (None, None) if enc is None else finish(i, enc, jobs[i][3], fps.get(i))
            if progress is not None:
                progress(i + 1, len(canonical))

    entries: dict[str, EncodedEntry] = {}
    flagged: list[tuple[str, torch.Tensor]] = []
    fingerprinted: list[tuple[str, torch.Tensor]] = []
    for path, (enc, ref_fp) in zip(canonical, encoded):
        if enc is None:
            continue
        entries[path] = enc.entry
        if enc.unusable is not None:
            flagged.append((path, enc.unusable))
        if ref_fp is not None:
            fingerprinted.append((path, ref_fp))

    # On a device the entries coded with a partner are encoded before the host sync, with
    # their partners as encoded, so that their flags join it; one whose partner the sync
    # then stores exact is encoded again after it (docs/design.md).
    early: list[tuple[int, Encoded]] = []
    decoded: dict[str, torch.Tensor] = {}
    if partners and not on_host and all(canonical[j] in entries for j in partners.values()):
        early = encode_pending(entries, partners, jobs, canonical, allocate, grouped=True)
    # The one host sync: every NaN/Inf flag, reference fingerprint and sparsity count
    # together, one copy per device and an event that fires when it is done.
    values = fingerprints.read_device_scalars(
        [f for _, f in flagged] + [f for _, f in fingerprinted] + counts + [e.unusable for _, e in early],
        scalar_buffers,
    )
    read = values[len(flagged) + len(fingerprinted) : len(values) - len(early)]
    # The candidates that pay are encoded together (one grouped encode per device), the
    # others copied together.
    paid, dense = [], []
    for i, nnz, runs in zip(deferred, read[0::2], read[1::2]):
        x = jobs[i][0]
        if sparse_pays(x.numel(), nnz, x.element_size(), runs):
            paid.append((i, nnz))
        else:
            dense.append(i)
    if paid:
        xs, nnzs = [jobs[i][0] for i, _ in paid], [nnz for _, nnz in paid]
        for (i, _), enc in zip(paid, bitmask.encode_counted_many(xs, nnzs, allocate)):  # type: ignore[union-attr]
            entries[canonical[i]] = enc.entry
    for i, entry in zip(dense, exact_entries([jobs[i][0] for i in dense])):
        entries[canonical[i]] = entry
    if deferred:  # (the entries coded with a partner come later: encode_partnered)
        entries = {path: entries[path] for path in canonical if path in entries}
    stored_exact = set()
    for (path, _), bad in zip(flagged, values[: len(flagged)]):
        if bad:
            stored_exact.add(path)
            # log2 also refuses a negative value (a "non-negative" state that is not).
            why = "a negative value, NaN or Inf" if entries[path].codec.startswith("log2") else "NaN or Inf"
            logger.warning(
                "entry %r holds %s (in the tensor, its reference or their "
                "difference); stored exact instead of with codec %r",
                path,
                why,
                entries[path].codec,
            )
            entries[path] = exact_entry(tensors[path])
    fp_parts = []
    for (path, _), fp in zip(fingerprinted, values[len(flagged) : len(flagged) + len(fingerprinted)]):
        entry = entries[path]
        if entry.codec != "exact":
            # A copy: a codec may hand back its rule's params object, which must stay as is.
            entry.params = {**entry.params, "ref_fp": fingerprints.fp_hex(fp)}
            fp_parts.append(f"{path}={entry.params['ref_fp']}")

    if early:
        again = {i for i, _ in early if canonical[partners[i]] in stored_exact}
        kept = [(k, pair) for k, pair in enumerate(early) if pair[0] not in again]
        bad = values[len(values) - len(early) :]
        settle(entries, [pair for _, pair in kept], [bad[k] for k, _ in kept], jobs, canonical, exact_entry)
        partners = {i: partners[i] for i in again}
    if partners:  # coded with their partners' entries, now final
        encode_partnered(
            entries,
            partners,
            jobs,
            canonical,
            exact_entry,
            allocate,
            grouped=not on_host,
            decoded=decoded if keep_decoded else None,
        )
    if partners or early:
        entries = {path: entries[path] for path in canonical}

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
        decoded=decoded,
        entries=entries,
        skeleton=skeleton,
        checkpoint_id=checkpoint_id or uuid.uuid4().hex,
        reference_id=recorded_ref_id,
        aliases=aliases,
        rules=[r.to_json() for r in rule_list],
        metadata=dict(metadata or {}),
    )
