"""``DistributedCheckpointer``: keyframes, deltas, retention and ``latest()`` across ranks.

Layout: ``<directory>/step_<step, 8 digits>/``, each a DCP checkpoint written by
:class:`~tw_triton.dcp.StorageWriter`. Crash safety comes from the order of writes:

* every rank writes its own files atomically (temp file, fsync, rename);
* DCP gathers every rank's write results on the coordinator, which only then writes
  ``tw_dcp.json``, so a directory with valid metadata and every listed file is complete,
  and a save killed on any rank leaves no metadata (:func:`is_complete` is false);
* rank 0 deletes old checkpoints only after the save returned on every rank (DCP's final
  collective, plus a barrier for synchronous saves), and never a keyframe a kept delta
  needs, nor the checkpoint ``latest()`` would return.

So a rank killed mid-save leaves the previous checkpoint loadable. See docs/distributed.md.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .. import interval_rules
from ..arguments import as_int, as_path
from ..checkpoint_dir import LISTINGS
from ..errors import CheckpointError
from ..format import MAX_EXPANSION, check_max_expansion, verify_file
from ..format.files import io_error
from ..resume import as_step
from ..rules import check_rules
from . import api
from .directory import find_keyframe, is_complete
from .keyframe import Keyframe
from .meta import read_record
from .writer import StorageWriter

_STEP_RE = re.compile(r"step_(\d{8,})")
logger = logging.getLogger(__name__)


def chain_problem(
    path: str, *, verify: bool = False, max_expansion: float | None = MAX_EXPANSION
) -> str | None:
    """Why the complete checkpoint in ``path`` cannot be loaded, or ``None`` if it can.

    Args:
        path: a complete checkpoint directory.
        verify: also read every rank file of the checkpoint and of its keyframe and check
            their checksums.
        max_expansion: with ``verify``, the decoded-size bound of each file.

    Returns:
        ``None``, or the reason: a delta whose keyframe (a complete checkpoint with the id
        it records) is not found, or with ``verify`` a file that fails its checks.
    """
    try:
        rec = read_record(path)
        chain = [path]
        if rec.reference is not None:
            chain.append(find_keyframe(path, rec.reference))
        if verify:
            for directory in chain:
                for name in read_record(directory).files:
                    verify_file(os.path.join(directory, name), max_expansion=max_expansion)
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:  # a file removed or unreadable while it is checked
        return f"{path}: {exc}"
    return None


def _with_tw_errors(fut: Future) -> Future:
    """A future that completes as ``fut`` does, its failure as :func:`api.tw_error`."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.cancelled():
            out.cancel()
            return
        exc = f.exception()
        if exc is None:
            out.set_result(f.result())
        else:
            out.set_exception(api.tw_error(exc))

    fut.add_done_callback(done)
    return out


class DistributedCheckpointer:
    """Periodic sharded checkpoints of a training state through DCP.

    Args:
        directory: where the ``step_*`` checkpoint directories go (shared by all ranks).
        rules, bits, block: as for :class:`StorageWriter`; the default ``"auto"`` codes a
            save with ``"small"`` when it is fewer than 100 steps after the save before it
            (or the checkpoint loaded; the first save: after step 0) and with ``"safe"``
            from there (docs/distributed.md).
        keyframe_every: a keyframe every this many saves; the saves between are deltas
            against the last keyframe (1: every save is a keyframe).
        keep: how many complete checkpoints to keep (plus keyframes they need).
        process_group: the group DCP uses (default: the default group, if initialized).
        max_expansion: the bound on what a file's compressed buffers may decode to, times
            its size, for every load and verification (:func:`tw_triton.format.read_file`);
            ``None`` lifts it, for states that hold large constant tensors on purpose.

    Raises:
        CheckpointError: ``keyframe_every`` or ``keep`` below 1.
        QuantizationError: ``rules`` do not resolve (an unknown preset or codec, a
            malformed rule).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        rules: Any = interval_rules.AUTO,
        bits: int = 8,
        block: int = 128,
        keyframe_every: int = 4,
        keep: int = 2,
        process_group: Any = None,
        max_expansion: float | None = MAX_EXPANSION,
    ) -> None:
        keyframe_every = as_int(keyframe_every, "keyframe_every", minimum=1)
        keep = as_int(keep, "keep", minimum=1)
        check_max_expansion(max_expansion)
        for candidate in interval_rules.candidates(rules, short=interval_rules.DCP_SHORT_INTERVAL_PRESET):
            check_rules(candidate, bits=bits, block=block)  # refused now, not at the first save
        self.directory = as_path(directory, "directory")
        self.rules, self.bits, self.block = rules, bits, block
        self.keyframe_every, self.keep = keyframe_every, keep
        self.process_group = process_group
        self.max_expansion = max_expansion
        self._keyframe: Keyframe | None = None
        self._since_keyframe = 0
        self._pending: Future | None = None
        # The step of the last save made or checkpoint loaded ("auto": the next interval).
        self._last_step: int | None = None
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:  # a file of that name, or in its parents; no permission
            raise io_error(
                exc, f"{self.directory}: cannot be made or used as a checkpoint directory"
            ) from exc
        # Temp files of killed saves go, unless another rank or writer holds the directory.
        from ..checkpoint_dir import DirectoryClaim, dcp_temp_files

        self._claim = DirectoryClaim(self.directory)
        self._claim.sweep(lambda: dcp_temp_files(self.directory))

    # -- queries (any process, no collectives) ---------------------------------------
    def path_for(self, step: int) -> str:
        """The directory of ``step``'s checkpoint.

        Raises:
            CheckpointError: ``step`` is not a non-negative integer.
        """
        return os.path.join(self.directory, f"step_{as_step(step):08d}")

    def complete(self) -> list[tuple[int, str]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        out = []
        for name in os.listdir(self.directory):
            m = _STEP_RE.fullmatch(name)
            path = os.path.join(self.directory, name)
            if m and is_complete(path):
                out.append((int(m.group(1)), path))
        return sorted(out)

    def latest(self, *, verify: bool = False) -> str | None:
        """The newest checkpoint that loads, or ``None``.

        A checkpoint loads when it is complete and, for a delta, when a complete keyframe
        with the id it records is found (:func:`~tw_triton.dcp.directory.find_keyframe`). A
        complete delta whose keyframe lost or truncated a rank file is skipped with a
        logged warning, and the next older one is tried.

        Args:
            verify: also check the checksums of every rank file of the candidate and its
                keyframe (one process reads every rank's files: off by default, as the
                load that follows checks them anyway).
        """
        for _, path in reversed(self.complete()):
            problem = chain_problem(path, verify=verify, max_expansion=self.max_expansion)
            if problem is None:
                return path
            logger.warning("skipping checkpoint %s: %s", path, problem)
        return None

    # -- saving ----------------------------------------------------------------------
    def rules_for(self, step: int) -> Any:
        """The rules a save of ``step`` codes with: ``rules`` itself, or for ``"auto"`` the
        preset of its interval since the last save made or checkpoint loaded (the first:
        since step 0; a step not after it: ``"small"``)."""
        short = interval_rules.DCP_SHORT_INTERVAL_PRESET
        return interval_rules.rules_after(self.rules, step, self._last_step, short=short)

    def _rank(self) -> int:
        return dist.get_rank(self.process_group) if dist.is_initialized() else 0

    def save(self, state: dict[str, Any], step: int, *, asynchronous: bool = False) -> Future | None:
        """Save ``state`` (collective: call on every rank) as ``step``.

        With ``asynchronous``, encoding happens now (``StorageWriter.stage``) and the write
        in the background; the returned future completes when it is on disk. Retention for
        it runs at the next ``save`` or ``wait``.

        Raises:
            CheckpointError: ``step`` is not a non-negative integer (nothing is written).
            TwTritonError: the lowest failing rank's tw_triton error (e.g. a
                ``CheckpointIOError`` naming the directory), as ``tw_triton.dcp.save``;
                for an asynchronous save, from the future and from ``wait``.
        """
        path = self.path_for(step)  # a bad step is refused before the pending save is waited on
        self.wait()
        is_keyframe = self._keyframe is None or self._since_keyframe >= self.keyframe_every - 1
        writer = StorageWriter(
            path,
            rules=self.rules_for(step),
            bits=self.bits,
            block=self.block,
            reference=None if is_keyframe else self._keyframe,
            as_keyframe=is_keyframe,
        )
        no_dist = not dist.is_initialized()
        try:
            if asynchronous:
                fut = dcp.async_save(
                    state, storage_writer=writer, process_group=self.process_group, no_dist=no_dist
                )
                self._pending = _with_tw_errors(fut)
            else:
                dcp.save(state, storage_writer=writer, process_group=self.process_group, no_dist=no_dist)
        except CheckpointException as exc:
            raise api.tw_error(exc) from exc
        if not asynchronous and not no_dist:
            dist.barrier(self.process_group)
        self._last_step = step
        if is_keyframe:
            self._pending_keyframe = path
            self._since_keyframe = 0
        else:
            self._pending_keyframe = None
            self._since_keyframe += 1
        if not asynchronous:
            self._finish_save()
            return None
        return self._pending

    def wait(self) -> None:
        """Wait for a pending asynchronous save, then run retention."""
        if self._pending is not None:
            fut, self._pending = self._pending, None
            fut.result()
            self._finish_save()

    def _finish_save(self) -> None:
        if self._pending_keyframe is not None:
            self._keyframe = Keyframe(self._pending_keyframe, max_expansion=self.max_expansion)
            self._pending_keyframe = None
        if self._rank() == 0:
            self.retain()

    def retain(self) -> None:
        """Delete the checkpoints retention no longer keeps (rank 0 runs it after each save).

        Kept: the ``keep`` newest complete checkpoints, the one :meth:`latest` returns, the
        keyframes these need and the current keyframe. Incomplete directories go too.
        """
        done = self.complete()
        kept = [p for _, p in done[-self.keep :]]
        latest = self.latest()
        if latest is not None:
            # Older than the newest complete ones when their keyframe broke: keep it too.
            kept.append(latest)
        needed = set(kept)
        for p in kept:
            ref = read_record(p).reference
            if ref is not None:
                needed.update(q for _, q in done if read_record(q).checkpoint_id == ref["checkpoint_id"])
        if self._keyframe is not None:
            needed.add(self._keyframe.path)
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if _STEP_RE.fullmatch(name) and path not in needed:
                # Incomplete directories (crashed saves) go too: a complete newer one exists.
                shutil.rmtree(path, ignore_errors=True)

    # -- loading ---------------------------------------------------------------------
    def load(self, state: dict[str, Any], path: str | None = None) -> int | None:
        """Load the checkpoint :meth:`latest` returns (or ``path``) into ``state`` in place.

        Without ``path``, on one process, a checkpoint that goes while it is read (a live
        writer's retention in another process) is followed by the newest one then, up to
        ``LISTINGS`` times.

        Returns:
            The step loaded, or ``None`` when no checkpoint loads.
        """
        given = path
        # Ranks list the directory each on their own: only a single process may choose again.
        alone = not dist.is_initialized() or dist.get_world_size(self.process_group) == 1
        for attempt in range(LISTINGS if alone else 1):
            path = given or self.latest()
            if path is None:
                return None
            try:
                api.load(state, path, no_dist=not dist.is_initialized(), max_expansion=self.max_expansion)
                break
            except CheckpointError:
                # A live writer's retention (another process) may have removed it, or its
                # keyframe, while it was read: then the newest is another one, loaded over it.
                if given is not None or not alone or attempt == LISTINGS - 1 or self.latest() in (None, path):
                    raise
                logger.info("%s went while it was read (a live writer's retention): loading the newest", path)
        self._continue_from(path)
        m = _STEP_RE.fullmatch(os.path.basename(path))
        step = int(m.group(1)) if m else None
        if step is not None:
            self._last_step = step
        return step

    def _continue_from(self, path: str) -> None:
        """After loading ``path``: the next saves are deltas against its keyframe (read from
        its files, as before the restart), counted on from the deltas of that keyframe in
        the directory; unless ``path`` is not the newest complete checkpoint (the saves
        after it would mix two histories), then the next save is a keyframe, and a warning
        says that ``latest()`` picks the newer ones until a save passes them.
        Retention may have removed deltas of the keyframe: the count is then low, and the
        chain runs longer than ``keyframe_every`` once (docs/distributed.md)."""
        self._keyframe, self._since_keyframe = None, 0
        done = self.complete()
        if done and os.path.abspath(done[-1][1]) != os.path.abspath(path):
            logger.warning(
                "loaded %s, not the newest checkpoint (%s): the next save is a keyframe, and until "
                "a save passes step %d, latest() and load() without a path pick the newer "
                "checkpoints again; remove them to abandon that run",
                path,
                done[-1][1],
                done[-1][0],
            )
            return
        ref = read_record(path).reference
        if ref is None:
            keyframe, since = path, 0
        else:
            keyframe = find_keyframe(path, ref)
            since = sum(
                1
                for _, p in done
                if (r := read_record(p).reference) is not None and r["checkpoint_id"] == ref["checkpoint_id"]
            )
        self._keyframe = Keyframe(keyframe, max_expansion=self.max_expansion)
        self._since_keyframe = since


__all__ = ["DistributedCheckpointer"]
