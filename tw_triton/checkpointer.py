"""The Checkpointer: small checkpoints inside a training loop, retention, crash-safe resume.

Usage::

    ckpt = Checkpointer("runs/ckpt", keyframe_every=10, keep_last=3)
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    ckpt.close()

    # after a restart, into fresh objects:
    state = Checkpointer("runs/ckpt").restore(model=model, optimizer=opt, scheduler=sched)
    start = state["step"] + 1

``save(step, **state)`` stores ``{"step": step, <your names>: ..., "rng": ...}``; every
``keyframe_every``-th save is a keyframe, the others deltas. A save's Future succeeds only
when its file and every file it needs are written. It delegates to
:mod:`tw_triton.save_pipeline`, :mod:`~tw_triton.reference_chain`,
:mod:`~tw_triton.retention` and :mod:`~tw_triton.checkpoint_dir`; the why:
docs/training-loop.md.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from typing import Any

import torch

from . import format as _format
from .arguments import as_int
from .chain_restart import check_seeded, seed_chain
from .checkpoint_dir import (
    CheckpointDirectory,
    CheckpointInfo,
    checkpoint_name,
    parse_checkpoint_name,
)
from .deltas import delta_mode
from .device_memory import bound_of, held_nbytes
from .directory_claim import DirectoryClaim
from .errors import CheckpointError, TwTritonError
from .optimizer_classes import LOAD_ADVICE, check_file, class_record, targets_of
from .reference_chain import ReferenceChain, leaves
from .resume import as_step, check_restorable, default_device, load_from, named_state, restore_into
from .retention import InFlight, retain
from .rng import capture_rng_state, restore_rng_state
from .rules import check_rules
from .save_encode import KIND_DELTA, KIND_KEYFRAME, KIND_STANDALONE  # noqa: F401 - re-exported
from .save_pipeline import SavePipeline, collect_setup_garbage  # noqa: F401 - re-exported
from .snapshot_pool import SavePool
from .writer import AsyncWriter

logger = logging.getLogger(__name__)


# The Checkpointer's default preset and delta mode (docs/training-loop.md).
DEFAULT_RULES = "auto"
DEFAULT_DELTA = "closed"


class Checkpointer:
    """Saves training state into a directory of small checkpoints, and restores it.

    Args:
        directory: where the checkpoints go (created if missing).
        keyframe_every: one save in this many is a keyframe (1: no deltas).
        keep_last: how many of the newest checkpoints retention keeps (plus the keyframes
            they need, and those of a run gone back, newer than its saves); ``None``: all.
        rules: which tensors are coded how, as in :func:`tw_triton.quantize_state_dict`:
            a preset name (default ``"auto"``, :data:`DEFAULT_RULES`: ``"smallest"``,
            or ``"safe"`` for saves 100 or more steps apart), ``None`` (the
            library defaults, optimizer exact) or ``[(glob, codec spec), ...]``. Paths
            start with the names given to :meth:`save` (``model/...``, ``optimizer/...``).
        bits, block: parameters of the quantizing rules.
        async_write: write on a background thread (``save`` returns a pending Future);
            ``False`` writes before ``save`` returns.
        delta: how the saves between keyframes are coded (:mod:`tw_triton.deltas`):
            ``"closed"`` (default) as deltas from the previous save's reconstruction,
            ``"open"`` (or ``True``) as deltas from the last keyframe; both keep one copy
            of the delta-coded tensors on their device. ``"none"`` (or ``False``) keeps
            nothing and quantizes those saves on their own.
        max_pending: saves in flight before ``save`` blocks (async only).
        pinned_bytes: cap on the writer's pinned host memory (async only; see
            :class:`~tw_triton.writer.AsyncWriter`).
        fsync: fsync files and the directory (leave on outside of tests).
        snapshot_pool_bytes: cap on the host memory kept to reuse for CPU snapshots
            (docs/training-loop.md, "Memory"); ``None``: ``max_pending + 1`` times the
            largest snapshot so far (1 time with ``async_write=False``), plus the
            reference; ``0``: no reuse, every snapshot in fresh memory.
        max_expansion: the bound on what a checkpoint file's compressed buffers may
            decode to (see :func:`~tw_triton.format.read_file`), for every file
            :meth:`latest`, :meth:`load` and :meth:`restore` read, a delta's keyframe and
            links included, so that the checkpoint ``latest()`` picks is the one
            ``restore()`` loads. A state holding a large constant tensor on purpose needs
            a larger value, or ``None`` for no bound.
        reference_device: where a device state's delta reference lives: ``None`` (default)
            on its devices; ``"cpu"``: in host memory, where device memory is tight (same
            files; docs/training-loop.md, "Memory").
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keyframe_every: int = 10,
        keep_last: int | None = 3,
        rules: Any = DEFAULT_RULES,
        bits: int = 8,
        block: int = 128,
        async_write: bool = True,
        delta: bool | str = DEFAULT_DELTA,
        max_pending: int = 1,
        pinned_bytes: int | None = None,
        fsync: bool = True,
        snapshot_pool_bytes: int | None = None,
        max_expansion: float | None = _format.MAX_EXPANSION,
        reference_device: str | None = None,
    ) -> None:
        self.delta_mode = delta_mode(delta)
        check_rules(rules, bits=bits, block=block)  # here, not as every save's error on the writer
        if reference_device not in (None, "cpu"):
            raise CheckpointError(f"reference_device must be None or 'cpu', got {reference_device!r}")
        keyframe_every = as_int(keyframe_every, "keyframe_every", minimum=1)
        keep_last = as_int(keep_last, "keep_last", minimum=1, optional=True)
        max_pending = as_int(max_pending, "max_pending", minimum=1)  # checked unused too
        pinned_bytes = as_int(pinned_bytes, "pinned_bytes", minimum=1, optional=True)
        self._dir = CheckpointDirectory(directory, max_expansion=max_expansion)
        self.directory = self._dir.path
        self.max_expansion = max_expansion
        self._claim = DirectoryClaim(self.directory)
        self._claim.sweep(self._dir.temp_files)
        self.keyframe_every, self.keep_last = keyframe_every, keep_last
        self.rules, self.bits, self.block, self.reference_device = rules, bits, block, reference_device
        self.delta = self.delta_mode != "none"
        self.fsync = fsync
        self._writer = (
            AsyncWriter(max_pending=max_pending, pinned_bytes=pinned_bytes, fsync=fsync)
            if async_write
            else None
        )
        # Each save's pooled buffers, until its write is done (then back to the pool).
        self._saves = SavePool(snapshot_pool_bytes, (max_pending + 1) if async_write else 1)
        self._chain = ReferenceChain(self.delta_mode, keyframe_every, self._saves)
        self._inflight, self._abandoned = InFlight(self._dir), set()  # retention's
        self._pipeline = SavePipeline(
            self._writer,
            self._saves,
            self._chain,
            self._inflight,
            rules=rules,
            bits=bits,
            block=block,
            fsync=fsync,
            directory=self.directory,
            host_reference=reference_device == "cpu",
        )
        self._closed = False
        self._seeded = False  # the chain continues from a restore (chain_restart)

    # ------------------------------------------------------------------- saving

    def save(self, step: int, **state: Any) -> Future:
        """Snapshot and encode ``state`` now; write it (in the background if async).

        The loop pauses for the snapshot and the encode (on CUDA: the kernel launches and
        one sync; on the CPU with ``async_write``: a copy, whose encode runs on the writer
        thread, or for a keyframe with no pooled memory to copy into, the encode itself),
        and for backpressure when ``max_pending`` saves are still being written.

        Args:
            step: the training step; names the file (a step saved again is replaced).
            **state: objects with ``state_dict()`` and plain values, by name.

        Returns:
            A Future that resolves to the bytes written (already resolved when
            ``async_write=False``).

        Raises:
            CheckpointError: an earlier async save failed (raised once, chained from the
                original; an ``OSError`` arrives as ``CheckpointIOError`` with its errno),
                a reserved name was used, or the Checkpointer is closed.
            QuantizationError: a value the format cannot store (names its path).
        """
        if self._closed:
            raise CheckpointError(
                f"cannot save step {step}: the Checkpointer of {self.directory!r} is closed"
            )
        step = as_step(step)
        named = named_state(state)
        self._collect_finished()
        if self._writer is not None:
            try:
                self._writer.check()
            except TwTritonError:
                self._chain.drop_if_lost()
                raise
        self._retain(saving=step)
        self._pipeline.count_first_interval(step, self._dir.written_steps)
        tree: dict[str, Any] = {"step": step, **named, "rng": capture_rng_state()}
        if self._seeded:  # the first save after a restore: does the state fit it?
            self._seeded = False
            rules = self._pipeline.rules_for(step)
            check_seeded(self._chain, tree, rules=rules, bits=self.bits, block=self.block)
        future = self._pipeline.save(step, tree, self._dir.path_for(step), class_record(state))
        if self._writer is None:
            self._collect_finished()
            self._retain()
        return future

    def prepare(self, **state: Any) -> int:
        """Fault in the host memory the first save will copy ``state`` into, now.

        On the CPU with ``async_write`` a save copies the state into pooled buffers; the
        first save of a process finds the pool empty. Call ``prepare`` with the same objects
        as :meth:`save` once they have their final shapes (after the optimizer's first
        step: AdamW creates its moments then). Before the first keyframe it also reserves
        a second copy of the tensors the rules delta-code (the first delta copies the state
        while the keyframe's copies stay held as its reference); reserving again adds only
        what is missing; ``snapshot_pool_bytes`` caps it. It also runs Python's full garbage
        collection now (unless disabled), so that it does not run inside an early save, and,
        for a CUDA state, compiles the kernels the first keyframe and delta will launch.
        Why: docs/training-loop.md ("The first save", "Python's garbage collector").

        Returns:
            Bytes reserved now: 0 when there is nothing to reserve (``snapshot_pool_bytes=0``,
            ``async_write=False``, which copies only what it stores exact, or a state with
            tensors off the CPU, whose snapshot the device allocators serve).

        Raises:
            CheckpointError: a reserved name, or the Checkpointer is closed.
            QuantizationError: a value the format cannot store (names its path).
        """
        if self._closed:
            raise CheckpointError(f"cannot prepare: the Checkpointer of {self.directory!r} is closed")
        tree = named_state(state)
        collect_setup_garbage()
        self._pipeline.precompile({**tree, "rng": capture_rng_state()})  # as save() lays it out
        if not self._pipeline.copies(tree):
            return 0
        self._collect_finished()  # written saves' buffers are free again: count them
        return self._pipeline.reserve(tree)

    def flush(self) -> None:
        """Wait for every pending save, apply retention, and raise a failed save's error.

        When it returns, the files retention dropped are deleted, not only out of the listing.
        """
        if self._writer is not None:
            try:
                self._writer.flush()
            finally:
                self._collect_finished()
        self._retain()
        if self._writer is not None:
            self._writer.flush()  # the deletions that retention just queued

    def close(self) -> None:
        """Flush, stop the writer thread, and drop the reference. Closing twice is harmless."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._chain.retire()
            try:
                if self._writer is not None:
                    self._writer.close()
            finally:
                self._saves.close()
                self._claim.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except TwTritonError as err:  # do not hide the loop's own exception
            logger.error("while handling %s: %s", exc_type.__name__, err)

    @property
    def reference_nbytes(self) -> int:
        """Bytes the current keyframe reference holds on its devices (0 without one)."""
        ref = self._chain.reference
        return ref.nbytes if ref is not None else 0

    def device_memory(self) -> dict[str, int]:
        """Bytes held beside the state on its devices (a CPU state's: the host), by part:
        ``reference`` (0 with ``reference_device="cpu"``), ``staging`` (encoded buffers of
        queued saves not yet copied to the host). See :meth:`device_memory_bound`."""
        ref, host = self._chain.reference, self.reference_device == "cpu"
        staging = self._writer.device_bytes_held if self._writer is not None else 0
        return {"reference": held_nbytes(leaves(ref.tree)) if ref and not host else 0, "staging": staging}

    def device_memory_bound(self, **state: Any) -> dict[str, int]:
        """The bound on what saving ``state`` holds on its devices, by part, ``peak`` the most
        at any moment (:class:`~tw_triton.device_memory.DeviceMemoryBound`)."""
        tree = {"step": 0, **named_state(state)}
        pending = self._writer.max_pending if self._writer is not None else 0
        return bound_of(
            tree, self.rules, self.bits, self.block, self.delta_mode, pending, self.reference_device
        )

    @property
    def reference_id(self) -> str | None:
        """Id of the checkpoint the next delta will be coded against (``None``: the next
        save is a keyframe). In closed loop, the last delta; else the last keyframe."""
        ref = self._chain.reference
        return ref.checkpoint_id if ref is not None else None

    @property
    def pool_bytes(self) -> int:
        """Host bytes the snapshot pool holds now: in saves not yet written, in the
        reference, and free for the next save (0 with ``snapshot_pool_bytes=0``)."""
        return self._saves.held_bytes

    # ------------------------------------------------------------------ listing

    def steps(self) -> list[int]:
        """Steps of the complete checkpoint files in the directory, oldest first.

        Temp files are not listed; files are not verified (see :meth:`latest`). Waits for
        this Checkpointer's pending saves first (without raising their errors).
        """
        self._wait_inflight()
        return sorted(self._dir.scan())

    def infos(self) -> list[CheckpointInfo]:
        """:class:`CheckpointInfo` of every complete checkpoint file, oldest first."""
        self._wait_inflight()
        found = self._dir.scan()
        return [found[s] for s in sorted(found)]

    def latest(self, *, verify: bool = True) -> int | None:
        """The newest step whose checkpoint (and the keyframe it needs) is good, or ``None``.

        With ``verify`` every candidate file is read and its checksums checked; a file that
        fails (corrupted, or over the Checkpointer's ``max_expansion``), a delta whose keyframe
        is missing or fails, and a file no Checkpointer wrote (``tw_triton.save``'s) are
        skipped with a logged warning, and the next older one is tried. Waits for pending saves.
        """
        self._wait_inflight()
        return self._dir.latest(verify=verify)

    def path_for(self, step: int) -> str:
        """Path of the checkpoint file of ``step`` (whether or not it exists)."""
        return self._dir.path_for(as_step(step))

    def remove_temp_files(self) -> list[str]:
        """Delete the temp files that interrupted writes left here; return their paths.

        Retention renames a checkpoint it drops to such a name before the writer thread
        unlinks it, so a crash in between leaves one too.

        A new Checkpointer does this when it opens the directory, if no other writer holds
        it. This method does not look: call it only when nothing else is writing here.
        """
        return self._dir.remove_temp_files()

    # ------------------------------------------------------------------ loading

    def load(
        self,
        step: int | None = None,
        *,
        device: torch.device | str = "cpu",
        verify: bool = True,
        into: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Load a checkpoint (default: :meth:`latest`) as the nested state that was saved.

        Args:
            step: which checkpoint; ``None`` for the latest good one.
            device: where the tensors are loaded.
            verify: check the checksums (and, for the latest, skip checkpoints that fail).
            into: objects by the names used in ``save`` (``{"model": model}``), to decode
                into on the CPU: a tensor of an object's ``state_dict()`` that is
                contiguous, of the stored dtype and shape, sharing no memory with another
                one, and stored exact (or decoded over such a one) is filled in place, and
                the returned state holds it (see :meth:`restore`, which does this for the
                objects it restores). ``load_state_dict`` is not called. If the load fails
                part way, they may hold part of what was read. An optimizer of a class
                other than the one saved is refused, as by :meth:`restore`.

        Returns:
            ``{"step": int, <names given to save>: their state dicts or values,
            "rng": {...}}``, tensors on ``device``.

        Raises:
            CheckpointError: no good checkpoint (the message says why the newest was
                passed over), no checkpoint for ``step``, or a bad file (naming the file
                and the entry), a file over the Checkpointer's ``max_expansion`` included.
            ReferenceMismatchError: the keyframe a delta needs is missing or different.
        """
        targets = targets_of(self._dir, into) if into and torch.device(device).type == "cpu" else None
        state, info = self._load(step, device=device, verify=verify, into=targets)
        check_file(info.path, into or {}, LOAD_ADVICE, self._dir.headers)
        return state

    def _load(
        self,
        step: int | None,
        *,
        device: torch.device | str,
        verify: bool,
        into: dict[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, Any], CheckpointInfo]:
        """:meth:`load`, and the info of the file it loaded (after the saves in flight)."""
        self._wait_inflight()
        return load_from(self._dir, step, device=device, verify=verify, into=into)

    def restore(
        self,
        step: int | None = None,
        *,
        device: torch.device | str | None = None,
        rng: bool = True,
        allow_optimizer_mismatch: bool = False,
        **objects: Any,
    ) -> dict[str, Any]:
        """Load a checkpoint (default: :meth:`latest`) back into live objects.

        ``ckpt.restore(model=model, optimizer=opt, scheduler=sched, scaler=scaler)`` calls
        each object's ``load_state_dict`` with the state saved under the same name, and
        (with ``rng``) puts back the RNG states, so that the run continues as the saved one
        would have: bit for bit from a keyframe, within quantization error from a delta.
        The next save continues the restored checkpoint's chain as a delta against it where
        that writes what a run that never stopped would (:mod:`tw_triton.chain_restart`);
        where not, it is a keyframe and the reason is logged.

        On the CPU, tensors are decoded into the objects' own where they can be (contiguous,
        sharing no memory with another, stored exact or decoded over such a one; see
        docs/training-loop.md), and the returned state shares them. If restoring fails,
        the objects may hold part of what was read: restore again, or rebuild them.

        Args:
            step: which checkpoint; ``None`` for the latest good one.
            device: where the tensors are loaded before ``load_state_dict``; default: the
                device of the first parameter of the object named ``model`` (or of any
                module given), else the CPU.
            rng: restore the RNG states too.
            allow_optimizer_mismatch: load an optimizer's state even into an optimizer of a
                class other than the one it was saved from (docs/training-loop.md).
            **objects: objects with ``load_state_dict``, by the names used in ``save``.

        Returns:
            The loaded state (as :meth:`load`), e.g. ``state["step"]`` and plain values.

        Raises:
            CheckpointError: a name that the checkpoint lacks, an object without
                ``load_state_dict`` or whose ``load_state_dict`` refuses its state (the
                object's error chained), an optimizer of another class than the one saved
                (``allow_optimizer_mismatch``), or anything :meth:`load` raises.
        """
        check_restorable(objects)
        device = default_device(objects, device, self.directory)
        into = targets_of(self._dir, objects) if device.type == "cpu" else None
        state, info = self._load(step, device=device, verify=True, into=into)
        mismatch_ok, headers = allow_optimizer_mismatch, self._dir.headers  # headers: parsed once
        restore_into(state, info.path, objects, rng=rng, any_optimizer=mismatch_ok, headers=headers)
        self._pipeline.last_step = info.step  # "auto" rules: the next save's interval
        self._seeded = seed_chain(
            self._chain,
            self._dir,
            info,
            state,
            rules=self.rules,
            bits=self.bits,
            block=self.block,
            host_reference=self.reference_device == "cpu",
        )
        return state

    # ---------------------------------------------------------------- internals

    def _collect_finished(self) -> None:
        self._inflight.collect()
        self._chain.drop_if_lost()
        self._saves.release_written()

    def _wait_inflight(self) -> None:
        self._inflight.wait()
        self._collect_finished()

    def _retain(self, saving: int | None = None) -> None:
        args = self._dir, self.keep_last, self._inflight, self.reference_id, self._writer
        retain(*args, self._abandoned, saving)  # saving: the step save() is about to write


__all__ = ["Checkpointer", "CheckpointInfo", "checkpoint_name", "parse_checkpoint_name"]
__all__ += ["capture_rng_state", "restore_rng_state"]
