"""Saves in flight and retention: which checkpoint files a Checkpointer keeps.

:class:`InFlight` tracks the saves submitted and not yet seen done, and lists each file
written from what its encode noted (:class:`NotedFile`), so that retention parses no
header on the loop's thread. :func:`retain` keeps the ``keep_last`` newest complete
checkpoints, every save in flight, and every checkpoint a kept one or the next delta
needs (a closed-loop chain back to its keyframe); it never deletes a needed reference,
nor a file no Checkpointer wrote. Checkpoints newer than a save (:func:`abandon`: a run
gone back) are not counted, and kept until the run passes them.
Why: docs/training-loop.md ("Retention").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

from . import format as _format
from .checkpoint_dir import CheckpointDirectory, CheckpointInfo
from .deltas import with_references
from .qstate import QuantizedState
from .writer import AsyncWriter

logger = logging.getLogger(__name__)


class NotedFile:
    """What a save's file says of itself (id, reference id, kind), noted when its encode
    ran, for :meth:`InFlight.collect` to list it without reading its header."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.info: tuple[str, str | None, str] | None = None

    def note(self, q: QuantizedState) -> None:
        """Note the fields of ``q``, the state the file is written from."""
        self.info = (q.checkpoint_id, q.reference_id, (q.metadata or {}).get("kind", "unknown"))

    def noting(self, encode: Callable[[], QuantizedState]) -> Callable[[], QuantizedState]:
        """``encode``, noting the fields of the state it returns."""

        def encode_and_note() -> QuantizedState:
            q = encode()
            self.note(q)
            return q

        return encode_and_note


@dataclass
class SaveInFlight:
    """One save submitted and not yet seen done."""

    future: Future
    checkpoint_id: str
    reference_id: str | None
    noted: NotedFile


class InFlight:
    """The saves of one Checkpointer not yet seen done, by step.

    Args:
        directory: where their files are listed once written.
    """

    def __init__(self, directory: CheckpointDirectory) -> None:
        self.directory = directory
        self.saves: dict[int, SaveInFlight] = {}

    def add(self, step: int, save: SaveInFlight) -> None:
        """Track the save of ``step`` (a step saved again replaces the earlier one)."""
        self.saves[step] = save

    def collect(self) -> None:
        """Forget the saves that are done; list those written (see :class:`NotedFile`)."""
        for step, save in list(self.saves.items()):
            future = save.future
            if not future.done():
                continue
            del self.saves[step]
            noted = save.noted
            if noted.info is None or future.cancelled() or future.exception() is not None:
                continue
            self.directory.note(step, noted.path, future.result(), noted.info)

    def wait(self) -> None:
        """Wait for every save in flight (without raising their errors), then collect."""
        wait_futures([s.future for s in self.saves.values()])
        self.collect()


def retain(
    directory: CheckpointDirectory,
    keep_last: int | None,
    inflight: InFlight,
    reference_id: str | None,
    writer: AsyncWriter | None,
    abandoned: set[str],
    saving: int | None = None,
) -> None:
    """Delete the checkpoints that are neither among the newest nor needed by a kept one.

    A save of a step older than checkpoints already here (a run gone back: ``restore`` of
    an older step, or a new run in an old directory) abandons those newer ones: they are
    not counted for ``keep_last``, so they never displace the run's own; they are kept
    while newer than every save of the run (``restore()`` without a step picks them until
    then), and dropped like any older checkpoint once it passes them.

    Args:
        directory: the checkpoint directory.
        keep_last: how many of the newest complete checkpoints to keep; ``None``: all.
        inflight: the saves in flight (all kept, with the checkpoints they need).
        reference_id: the checkpoint the next delta is coded against (kept), or ``None``.
        writer: the thread that unlinks the files dropped; ``None``: unlink here.
        abandoned: ids of the checkpoints abandoned so far (updated here).
        saving: the step of the save about to be made, if any (what it abandons is noted).
    """
    pending = inflight.saves
    if keep_last is None and saving is None:
        return
    # A file in flight can be renamed into place before its Future is done; it is kept
    # anyway and noted once collected, so its header is not parsed on the loop's thread.
    listed = directory.scan(writing={s.noted.path for s in pending.values()})
    # A file no Checkpointer wrote (tw_triton.save's, named like a step) is not retention's.
    found = {step: info for step, info in listed.items() if info.by_checkpointer}
    if saving is not None:
        abandon(directory, found, pending, saving, abandoned)
    if keep_last is None:  # nothing to delete; the save that goes back was warned of above
        return
    abandoned &= {info.checkpoint_id for info in found.values()} | {s.checkpoint_id for s in pending.values()}
    own = [s for s in found if found[s].checkpoint_id not in abandoned]
    complete = [s for s in sorted(own, reverse=True) if s not in pending]
    newest = max([*own, *(s for s, p in pending.items() if p.checkpoint_id not in abandoned)], default=-1)
    keep = set(complete[:keep_last]) | set(pending)
    keep |= {s for s in found if s > newest}  # abandoned, and newer than every save of the run
    needed = {s.reference_id for s in pending.values() if s.reference_id is not None}
    if reference_id is not None:
        needed.add(reference_id)
    needed |= {found[s].reference_id for s in keep if s in found and found[s].reference_id}
    needed = with_references(needed, {info.checkpoint_id: info for info in found.values()})
    for step, info in found.items():
        if step in keep or info.checkpoint_id in needed:
            continue
        # Renamed out of the listing here (a metadata update), unlinked on the writer
        # thread: the unlink of a large file is slow (see AsyncWriter.discard). A crash
        # in between leaves a temp file that remove_temp_files() deletes.
        doomed = directory.discard(info)
        if doomed is None:
            continue
        if writer is not None:
            writer.discard(doomed)
        else:
            _format.remove_quietly(doomed)
        logger.debug("retention removed %s", info.path)


def abandon(
    directory: CheckpointDirectory,
    found: dict[int, CheckpointInfo],
    pending: dict[int, SaveInFlight],
    step: int,
    abandoned: set[str],
) -> None:
    """Add to ``abandoned`` the checkpoints newer than ``step``, the save about to be made
    (listed, or in flight), logging those newly abandoned."""
    newer = {s: info.checkpoint_id for s, info in found.items() if s > step}
    newer.update({s: save.checkpoint_id for s, save in pending.items() if s > step})
    fresh = sorted(s for s, checkpoint_id in newer.items() if checkpoint_id not in abandoned)
    abandoned.update(newer.values())
    if fresh:
        logger.warning(
            "saving step %d in %s, which holds newer checkpoints (steps %s): until a save passes "
            "step %d, restore() without a step picks them again, and retention keeps them without "
            "counting them for keep_last; remove them to abandon that run",
            step,
            directory.path,
            ", ".join(map(str, fresh)),
            max(newer),
        )


__all__ = ["InFlight", "NotedFile", "SaveInFlight", "abandon", "retain"]
