"""The encode of one save, as ``save()`` or the writer thread runs it: a keyframe, a delta
from the chain's reference (advancing a closed-loop reference to its reconstruction), or a
save on its own; and the ``kind`` each writes into the file's metadata."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .checkpoint_files import KIND_DELTA, KIND_KEYFRAME, KIND_STANDALONE
from .deltas import Reference, advance, keyframe_values
from .qstate import QuantizedState
from .snapshot_pool import SnapshotLease
from .state import quantize_state_dict


def encode_delta(
    snapshot: Any,
    reference: Reference | None,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    checkpoint_id: str | None,
    *,
    allocate: SnapshotLease | None = None,
    ref_at: tuple[str, int] | None = None,
    live: bool = False,
) -> QuantizedState:
    """Encode a save between keyframes: a delta from ``reference``, or on its own without.

    With ``checkpoint_id`` it runs on the writer thread over ``snapshot``, a private copy of
    the state (exact entries then hold the copy's tensors, no second copy); without, it
    runs in ``save`` over the live state (copies into ``allocate``). ``ref_at`` is the id
    and step of the reference as they were at ``save`` (in closed loop the main thread
    moves them on before the writer thread gets here). A closed-loop reference is advanced
    to this delta's reconstruction before returning. ``live``: exact entries hold the live
    state's tensors, which the writer copies to the host before the loop goes on.
    """
    encode = functools.partial(encode_save, snapshot, rules, bits, block, meta, checkpoint_id, allocate, live)
    if reference is not None:
        ref_id, ref_step = ref_at if ref_at is not None else (reference.checkpoint_id, reference.step)
        q = encode(reference=reference.tree, reference_id=ref_id)
        q.metadata["kind"] = KIND_DELTA if q.reference_id is not None else KIND_STANDALONE
        if q.reference_id is not None:
            q.metadata["reference_step"] = ref_step
            if reference.closed:
                q.metadata["delta_mode"] = "closed"
                advance(reference, q)
    else:
        q = encode()
        q.metadata["kind"] = KIND_STANDALONE
    q.decoded.clear()  # (what no advance took)
    return q


def encode_keyframe(
    snapshot: Any,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    checkpoint_id: str | None,
    *,
    allocate: SnapshotLease | None = None,
    live: bool = False,
    reconstruct: dict[str, torch.Tensor] | None = None,
) -> QuantizedState:
    """Encode a keyframe with ``rules`` (the keyframe rules: delta-coded tensors exact).

    With ``checkpoint_id`` it runs on the writer thread over ``snapshot``, a private copy
    (exact entries hold its tensors); without, in ``save`` over the live state (``live``:
    exact entries hold its tensors, which the writer copies to the host).
    ``reconstruct``: the snapshot's tensors the next deltas are coded against, overwritten
    with their reconstruction where the keyframe codes them lossily
    (:func:`~tw_triton.deltas.keyframe_values`).
    """
    q = encode_save(snapshot, rules, bits, block, meta, checkpoint_id, allocate, live)
    q.metadata["kind"] = KIND_KEYFRAME
    if reconstruct:
        keyframe_values(q, reconstruct, in_place=True)
    elif checkpoint_id is not None:
        q.decoded.clear()  # (in save, the caller's keyframe_values takes them)
    return q


def keyframe_values_then(q: QuantizedState, values: dict[str, torch.Tensor]) -> QuantizedState:
    """Decode keyframe ``q``'s reconstruction into ``values`` (host tensors, by path; see
    :func:`~tw_triton.deltas.keyframe_values`), then hand ``q`` on to be written."""
    keyframe_values(q, values, in_place=True)
    return q


def encode_save(
    snapshot: Any,
    rules: Any,
    bits: int,
    block: int,
    meta: dict[str, Any],
    checkpoint_id: str | None,
    allocate: SnapshotLease | None,
    live: bool = False,
    **reference: Any,
) -> QuantizedState:
    """:func:`quantize_state_dict` of a save: on the writer thread (``checkpoint_id`` given)
    over a private snapshot, kept as it is; in ``save`` over the live state, copied, unless
    ``live`` (the writer copies a device state's exact entries to the host)."""
    return quantize_state_dict(
        snapshot,
        **reference,
        rules=rules,
        bits=bits,
        block=block,
        metadata=meta,
        checkpoint_id=checkpoint_id,
        allocate=allocate,
        copy=checkpoint_id is None and not live,
        keep_decoded=True,  # taken by advance / keyframe_values, which decode them otherwise
    )


__all__ = [
    "KIND_DELTA",
    "KIND_KEYFRAME",
    "KIND_STANDALONE",
    "encode_delta",
    "encode_keyframe",
    "keyframe_values_then",
]
