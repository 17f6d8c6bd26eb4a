"""Decode a :class:`~tw_triton.qstate.QuantizedState` back into its nested state.

:func:`dequantize_state_dict` decodes every entry (a delta entry against its reference,
checked by id, shape and fingerprint); :func:`dequantize_entries` only some, as a link of
a closed-loop chain needs. Why deltas decode over their reference: docs/design.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..codecs.arguments import parse_device
from ..errors import (
    CheckpointError,
    QuantizationError,
    ReferenceMismatchError,
    TwTritonError,
    checkpoint_label,
)
from ..format import MAX_EXPANSION
from ..parallel import Background, parallel_map
from ..qstate import QuantizedState
from ..tree import skeleton_ndarray_paths, unflatten
from .entries import MEMORY_SOURCE, codec_or_raise, delta_paths, disjoint_paths, entry_context, entry_facts
from .grouped import decode_grouped, groups_launches
from .partners import decode_grouped_with_partners, partner_map
from .references import checked_reference, read_reference

Progress = Callable[[int, int], None]


def decode_device(device: Any, where: str, no_cuda: type[TwTritonError] | None = None) -> torch.device | None:
    """The device a decode puts its tensors on (``None``: where the buffers are).

    Raises:
        CheckpointError: as :func:`~tw_triton.codecs.arguments.parse_device`, naming
            ``where`` and the device (``no_cuda``, if given, where CUDA is not available).
    """
    return (
        None if device is None else parse_device(device, where, CheckpointError, meta=True, no_cuda=no_cuda)
    )


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
    return decode_state(
        qstate,
        reference,
        device,
        source,
        progress,
        verify,
        reuse_reference,
        release_buffers,
        max_expansion=max_expansion,
    )


def decode_state(
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
    if not isinstance(qstate, QuantizedState):
        raise CheckpointError(f"{where}: expected a QuantizedState, got {type(qstate).__name__}")
    dev = decode_device(device, where)
    out = decode_entries(
        qstate,
        None,
        reference,
        dev,
        where,
        progress,
        verify,
        reuse_reference,
        release_buffers,
        ref_into,
        max_expansion=max_expansion,
    )
    try:
        return unflatten(qstate.skeleton, out)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from e


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
    if not isinstance(qstate, QuantizedState):
        raise CheckpointError(f"{where}: expected a QuantizedState, got {type(qstate).__name__}")
    dev = decode_device(device, where)
    wanted = set(paths)
    missing = sorted(p for p in wanted if p not in qstate.entries and p not in qstate.aliases)
    if missing:
        raise CheckpointError(f"{where}: has no entry {missing[0]!r} (needed to decode the next delta)")
    targets = {qstate.aliases.get(p, p) for p in wanted}
    out = decode_entries(
        qstate,
        targets,
        reference,
        dev,
        where,
        None,
        verify,
        reuse_reference,
        release_buffers,
        max_expansion=max_expansion,
    )
    return {p: out[qstate.aliases.get(p, p)] for p in wanted}


def host_leaf_paths(qstate: QuantizedState) -> set[str]:
    """The entries decoded on the host whatever the device: numpy leaves, and the 0-dim
    ``step`` of each parameter in an optimizer state dict (a dict with ``state`` and
    ``param_groups``).

    torch.optim keeps ``step`` on the CPU unless the group is capturable or fused, and its
    ``load_state_dict`` moves state to the parameter's device except ``step`` for those
    others (``Optimizer._process_value_according_to_param_policy``); a ``step`` loaded to
    the GPU would cost a ``.item()`` sync per parameter at every later step.
    """
    out = set(skeleton_ndarray_paths(qstate.skeleton))
    nodes = [qstate.skeleton]
    while nodes:
        node = nodes.pop()
        pairs = _pairs(node)
        state = next((v for k, v in pairs if k == "state"), None)
        if any(k == "param_groups" for k, _ in pairs):
            for _, param_state in _pairs(state):
                for key, leaf in _pairs(param_state):
                    path = leaf.get("tensor") if key == "step" and isinstance(leaf, dict) else None
                    entry = qstate.entries.get(path) if isinstance(path, str) else None
                    if entry is not None and tuple(entry.shape) == ():
                        out.add(path)
        nodes.extend(v for _, v in pairs)
        if isinstance(node, dict):
            nodes.extend(v for key in ("list", "tuple") if isinstance(node.get(key), list) for v in node[key])
    return out


def _pairs(node: Any) -> list[tuple[Any, Any]]:
    # The (key, value) pairs of a skeleton's dict node; none for anything else (malformed
    # nodes included: unflatten() reports those).
    items = node.get("dict", node.get("odict")) if isinstance(node, dict) else None
    if not isinstance(items, list):
        return []
    return [(p[0], p[1]) for p in items if isinstance(p, (list, tuple)) and len(p) == 2]


def decode_entries(
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
    # Entries coded with a partner's decoded tensor are decoded last, their partners with them.
    partners = partner_map(entry_facts(qstate.entries), where)
    if only is not None:
        only = only | {partners[p] for p in only if p in partners}
        partners = {p: q for p, q in partners.items() if p in only}
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
        pending = read_reference(
            reference, qstate.reference_id, delta, dev, verify, where, ref_into, max_expansion
        )

    # numpy leaves come back as arrays: decode them on the host, not via the GPU; so do
    # optimizers' 0-dim steps (see host_leaf_paths).
    host_paths = host_leaf_paths(qstate)
    host = torch.device("cpu")
    total = len(qstate.entries)
    indexed = [(i, path) for i, path in enumerate(qstate.entries) if only is None or path in only]
    ref_tensors: dict[str, torch.Tensor] = {}
    reusable: set[str] = set()

    def decode_one(item: tuple[int, str]) -> torch.Tensor:
        path = item[1]
        entry = qstate.entries[path]
        codec = codec_or_raise(entry.codec, CheckpointError, f"{where}: entry {path!r}")
        context = entry_context(where, path, entry.codec)
        target = host if path in host_paths and dev is not None else dev
        ref = ref_tensors.get(path) if path in delta else None
        try:
            if path in partners:
                decoded = codec.decode_with_partner(entry, done[partners[path]], target, context)
            elif path in reusable:
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
    done = decoded  # what decode_one reads a partner from (decoded in an earlier phase)
    # On a device, entries of a codec with a grouped decode share its launches (and one
    # host read for the checks of a group's codes); on the host, worker threads.
    grouping = dev is not None and groups_launches(dev)

    def decode_on_device(items: list[tuple[int, str]]) -> None:
        count = len(decoded)
        alone = [item for item in items if item[1] in host_paths]
        items = [item for item in items if item[1] not in host_paths]
        jobs = [
            (
                qstate.entries[p],
                ref_tensors.get(p) if p in delta else None,
                dev,
                entry_context(where, p, qstate.entries[p].codec),
            )
            for _, p in items
        ]
        outs = [ref_tensors[p] if p in reusable else None for _, p in items]
        results = decode_grouped(jobs, lambda k: decode_one(items[k]), outs, check=True)
        results += [decode_one(item) for item in alone]
        for k, ((_, path), t) in enumerate(zip(items + alone, results)):
            decoded[path] = t
            if release_buffers:
                qstate.entries[path].buffers = {}
            if progress is not None:
                progress(count + k + 1, total)

    def decode(items: list[tuple[int, str]]) -> None:
        if grouping:
            decode_on_device(items)
            return
        # An exact entry decodes to a view of its buffer on the host: no work for a worker
        # (the snapshot that save() decodes is all exact, and it blocks the loop).
        count = len(decoded)
        results = parallel_map(
            decode_one,
            items,
            sizes=[
                0 if qstate.entries[p].codec == "exact" else qstate.entries[p].raw_nbytes for _, p in items
            ],
            threads=None if on_host else 1,
            done=None if progress is None else (lambda k: progress(count + k + 1, total)),
        )
        decoded.update((path, t) for (_, path), t in zip(items, results))

    if pending is not None:
        try:
            decode([item for item in indexed if item[1] not in delta and item[1] not in partners])
        except BaseException:
            pending.wait()
            raise
        reference = pending.result()
    if delta:
        ref_tensors, owned = checked_reference(
            qstate, delta, reference, dev, verify, where, ref_into, max_expansion
        )
        reusable = disjoint_paths(ref_tensors, delta) if owned or reuse_reference else set()
    decode([item for item in indexed if item[1] not in decoded and item[1] not in partners])
    dependent = [item for item in indexed if item[1] in partners]
    # On a device, the entries coded with a partner decode in grouped launches.
    devices = {p: dev if dev is not None else done[partners[p]].device for _, p in dependent}
    grouped = [item for item in dependent if groups_launches(devices[item[1]]) and item[1] not in host_paths]
    if grouped:
        count = len(decoded)
        items = [
            (
                qstate.entries[p],
                done[partners[p]],
                devices[p],
                entry_context(where, p, qstate.entries[p].codec),
            )
            for _, p in grouped
        ]
        results = decode_grouped_with_partners(items, lambda k: decode_one(grouped[k]))
        for k, ((_, path), t) in enumerate(zip(grouped, results)):
            decoded[path] = t
            if release_buffers:
                qstate.entries[path].buffers = {}
            if progress is not None:
                progress(count + k + 1, total)
    decode([item for item in dependent if item[1] not in decoded])
    out = {path: decoded[path] for _, path in indexed}
    for path, target in qstate.aliases.items():
        if only is not None and target not in only:
            continue
        if target not in out:
            raise CheckpointError(f"{where}: alias {path!r} points to {target!r}, which has no entry")
        out[path] = out[target]
    return out
