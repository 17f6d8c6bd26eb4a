"""The Checkpointer's delta reference: which checkpoint the next delta is coded against.

:class:`ReferenceChain` counts the saves since the keyframe, holds the current
:class:`~tw_triton.deltas.Reference` (the keyframe; in closed loop the last delta, each a
*link* of the chain) and the write Futures a delta depends on (:func:`depends_on`: its
keyframe and every link since, so that no Future reports success for a file that could
never load). A reference whose keyframe or link was not written is dropped, and the next
save is a new keyframe. Why: docs/training-loop.md ("Keyframes and deltas", "Closed loop").
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

import torch

from .deltas import Reference, make_reference
from .snapshot_pool import SavePool, SnapshotLease

logger = logging.getLogger(__name__)


class ReferenceChain:
    """The delta reference of one Checkpointer, and when the next keyframe is due.

    Args:
        mode: ``"open"``, ``"closed"`` or ``"none"`` (:func:`~tw_triton.deltas.delta_mode`).
        keyframe_every: one save in this many is a keyframe.
        saves: the pool the reference's host buffers go back to once it is retired.
    """

    def __init__(self, mode: str, keyframe_every: int, saves: SavePool) -> None:
        self.mode = mode
        self.keyframe_every = keyframe_every
        self.saves = saves
        self.reference: Reference | None = None
        self.since_keyframe: int | None = None  # None: the next save is a keyframe
        self.rules: Any = None  # the rules the reference's saves were coded with

    @property
    def delta(self) -> bool:
        """Whether the saves between keyframes are deltas (not ``"none"``)."""
        return self.mode != "none"

    def keyframe_due(self) -> bool:
        """Whether the next save is a keyframe."""
        return self.since_keyframe is None or self.since_keyframe + 1 >= self.keyframe_every

    def kept_bytes(self) -> int:
        """Pooled bytes the reference keeps beyond the saves' own (a delta copies the whole
        state while the reference is held)."""
        ref = self.reference
        return ref.lease.nbytes if ref is not None and ref.lease is not None else 0

    def start(
        self,
        checkpoint_id: str,
        ref_values: dict[str, torch.Tensor],
        step: int,
        future: Future,
        lease: SnapshotLease | None,
    ) -> None:
        """A keyframe was just saved: it is the reference of the deltas that follow.

        ``ref_values``: its tensors the rules delta-code; ``lease``: the save's pooled
        buffers, of which the reference keeps those under its tensors (they outlive the
        keyframe's write).
        """
        self.since_keyframe = 0
        self.reference = (
            make_reference(checkpoint_id, ref_values, step, future, closed=self.mode == "closed")
            if self.delta
            else None
        )
        if self.reference is not None and lease is not None:
            self.reference.lease = lease.split(list(leaves(self.reference.tree)))

    def add_delta(
        self,
        reference: Reference | None,
        checkpoint_id: str,
        reference_id: str | None,
        step: int,
        future: Future,
    ) -> None:
        """A save between keyframes was just queued; in closed loop it becomes a link.

        Its encode (now, or on the writer thread before the next save's) advances the
        reference's tensors over the keyframe's pooled buffers
        (:func:`~tw_triton.deltas.advance`): those stay with the reference until it is
        retired, as in open loop.
        """
        self.since_keyframe = (self.since_keyframe or 0) + 1
        if reference is not None and reference.closed and reference_id is not None:
            reference.checkpoint_id, reference.step = checkpoint_id, step
            reference.links.append(future)

    def retire(self) -> None:
        """Drop the reference; its buffers go back to the pool once its keyframe is written."""
        ref, self.reference = self.reference, None
        if ref is not None and ref.lease is not None:
            # The writer runs saves in order: when the last one that reads the reference is
            # done, so are the keyframe and every other one.
            self.saves.track(ref.last_use or ref.future, ref.lease, own=False)

    def restart(self) -> None:
        """Retire the reference and make the next save a keyframe."""
        self.retire()
        self.since_keyframe = None

    def drop_if_lost(self) -> None:
        """A keyframe or link whose write failed cannot serve as a reference: start over."""
        ref = self.reference
        if ref is not None and ref.lost():
            logger.warning(
                "a save that the next delta would build on (step %d or its keyframe) was not "
                "written; the next save will be a new keyframe",
                ref.step,
            )
            self.restart()

    def drop_advanced(self, step: int) -> None:
        """Closed loop: the save of ``step`` advanced the reference to its reconstruction
        and then was not written. The next delta would name the link before it while being
        coded against it, and load wrong: start a new keyframe instead."""
        logger.warning(
            "the save of step %d failed after the closed-loop reference moved on to it; "
            "the next save will be a new keyframe",
            step,
        )
        self.restart()


def depends_on(reference: Reference | None) -> list[Future]:
    """The writes a delta coded against ``reference`` needs on disk: its keyframe and, in
    closed loop, every link since."""
    return [] if reference is None else [reference.future, *reference.links]


def ref_at(reference: Reference | None) -> tuple[str, int] | None:
    """The id and step of the checkpoint a delta saved now is coded against."""
    return None if reference is None else (reference.checkpoint_id, reference.step)


def leaves(tree: Any):
    """The tensors of a tree of nested dicts (a reference tree)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from leaves(value)
    elif isinstance(tree, torch.Tensor):
        yield tree


__all__ = ["ReferenceChain", "depends_on", "ref_at"]
