"""The async writer: put encoded checkpoints on disk while training goes on.

:class:`AsyncWriter` takes a :class:`~tw_triton.qstate.QuantizedState` (or a function
that encodes one on the writer thread) and a path, and returns a
:class:`concurrent.futures.Future` at once. One background thread writes the saves in
submission order through :func:`tw_triton.format.write_file` (temp file, fsync, rename),
so a file under its final name is always complete. CUDA buffers are staged through
pinned memory (:mod:`tw_triton.pinned_staging`); CPU buffers are written as they are.

Errors: a failed save's Future holds the original exception, and the failure is raised
again, once, at the next :meth:`~AsyncWriter.submit`, :meth:`~AsyncWriter.flush` or
:meth:`~AsyncWriter.close` (a :class:`~tw_triton.errors.CheckpointIOError` with the same
``errno`` for an ``OSError``). Dependencies: a save submitted ``after=`` earlier saves (a
delta's keyframe and links) is not written if one of them failed, and its Future fails.
Why: docs/training-loop.md ("Crash safety, errors and backpressure").
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from . import format as _format
from .arguments import as_int
from .codecs import entropy as _entropy
from .cuda_threads import wait_event
from .errors import CheckpointError, CheckpointIOError
from .pinned_staging import (  # noqa: F401 - re-exported: their documented home was here
    PINNED_ALIGN,
    PINNED_GRANULE,
    DeviceStaging,
    PinnedPool,
    carve,
    staging_nbytes,
)
from .qstate import QuantizedState

logger = logging.getLogger(__name__)

# submit() logs a wait for backpressure only when it is longer than this (seconds).
WAIT_LOG_THRESHOLD_S = 0.001


@dataclass
class _Job:
    """One submitted save, from the caller's thread to the writer thread."""

    qstate: QuantizedState | None  # what to write; its buffers are host tensors
    path: str
    future: Future
    encode: Callable[[], QuantizedState] | None = None  # makes qstate on the writer thread
    copy_done: list = field(default_factory=list)  # CUDA events the D2H copies record
    device_state: QuantizedState | None = None  # keeps device buffers alive until copied
    pinned: torch.Tensor | None = None  # pool buffer to give back after the write
    after: tuple[tuple[Future, str], ...] = ()  # earlier saves (Future, path) it depends on


@dataclass
class _Task:
    """Work for the writer thread between saves (see :meth:`AsyncWriter.call`)."""

    fn: Callable[[], Any]
    future: Future


class AsyncWriter:
    """Writes :class:`QuantizedState` snapshots to disk on a background thread.

    Use it as a context manager, or call :meth:`close` at the end; at interpreter exit
    a writer still open finishes its pending saves (or, past ``exit_timeout``, logs a
    warning naming the files that were not written).

    Args:
        max_pending: most saves submitted and not yet written; ``submit`` blocks while
            this many are in flight (default 1: one save is written while the loop
            trains, and the next waits for it).
        pinned_bytes: cap on the pinned host memory used to stage CUDA buffers, or
            ``None`` to let ``max_pending`` alone bound it (one buffer per pending save,
            each as large as the largest save seen). Ignored without CUDA buffers.
        fsync: fsync the file and its directory (turn off only for tests and benchmarks
            of the page cache).
        exit_timeout: seconds to wait for pending saves at interpreter exit; ``None``
            waits until they are written.
        entropy: the lossless stage of :func:`tw_triton.format.write_file` (``"auto"``,
            ``None``/``"none"``, or an ``EntropyPolicy``); it runs on the writer thread,
            after the device-to-host copy.
    """

    def __init__(
        self,
        *,
        max_pending: int = 1,
        pinned_bytes: int | None = None,
        fsync: bool = True,
        exit_timeout: float | None = None,
        entropy: str | _entropy.EntropyPolicy | None = "auto",
    ) -> None:
        max_pending = as_int(max_pending, "max_pending", minimum=1)
        # Checked here, so that a bad value fails at construction, not on the first save.
        _entropy.resolve_policy(entropy)
        self.entropy = entropy
        self.max_pending = max_pending
        self.fsync = fsync
        self.exit_timeout = exit_timeout
        # CUDA buffers go to the host through pinned memory; CPU buffers are written as they are.
        self.staging = DeviceStaging(pinned_bytes, wait_log_threshold_s=WAIT_LOG_THRESHOLD_S)
        self._slots = threading.BoundedSemaphore(max_pending)
        self._lock = threading.Lock()
        self._pending: dict[Future, str] = {}
        # Paths of submitted saves, for the message of a save whose dependency failed; a
        # weak map, so a Future forgotten by everyone else is forgotten here too.
        self._paths: weakref.WeakKeyDictionary[Future, str] = weakref.WeakKeyDictionary()
        self._tasks: set[Future] = set()
        # A staged save's copy events (weakly, by its Future), and the device bytes of its
        # buffers the writer holds until the thread has waited for those copies.
        self._copies: weakref.WeakKeyDictionary[Future, list] = weakref.WeakKeyDictionary()
        self._device_held: dict[Future, int] = {}
        self._errors: list[tuple[str, BaseException]] = []
        self._closed = False
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # A daemon thread never holds up interpreter exit on its own; the exit hook
        # below is what drains the queue, so the policy (finish or warn) is ours.
        self._thread = threading.Thread(target=self._run, name="tw_triton-writer", daemon=True)
        self._thread.start()
        # The hook holds only a weak reference, so an unclosed writer can still be freed.
        self._exit_hook = functools.partial(_drain_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    # ----------------------------------------------------------------- public API

    def submit(
        self,
        qstate: QuantizedState | Callable[[], QuantizedState],
        path: str | os.PathLike,
        *,
        after: Iterable[Future] = (),
        live: bool = False,
    ) -> Future:
        """Queue ``qstate`` to be written to ``path``; return a Future of the bytes written.

        ``qstate`` may also be a function that returns it, called on the writer thread just
        before the write (an encode taken off the training loop's path). It must work on a
        private snapshot of host tensors only, and its exceptions go on the Future like a
        failed write's.

        Blocks only for backpressure (``max_pending`` saves in flight, or the pinned pool
        full), and logs how long it waited. On CUDA it also enqueues the device-to-host
        copies (asynchronous; no sync with the training stream). The caller must not
        modify ``qstate``'s buffers afterwards; a fresh snapshot per save is what
        ``quantize_state_dict`` returns anyway.

        ``after``: Futures of saves submitted earlier to this writer that this one needs
        (a delta's keyframe and earlier links). If one of them failed when this one's turn
        comes, this one is neither encoded nor written, and its Future fails with a
        :class:`~tw_triton.errors.CheckpointError` naming the file it needed.

        ``live``: some of ``qstate``'s CUDA buffers are the training state's own tensors,
        not copies (exact entries): the current stream waits for their copy to the host
        before any work queued after this call (:meth:`DeviceStaging.stage`).

        Returns:
            A Future that resolves to the number of bytes written, or holds the exception
            that made the save fail.

        Raises:
            CheckpointError: an earlier save failed (chained from its original error; the
                ``qstate`` of this call is then *not* queued), also one that failed while
                this call waited for backpressure, or the writer is closed.
        """
        path = os.fspath(path)
        self._raise_pending_errors()
        if self._closed:
            raise CheckpointError(f"cannot save '{path}': the writer is closed")
        with self._lock:
            dependencies = tuple((f, self._paths.get(f, "an earlier save")) for f in after)
        start = time.perf_counter()
        self._slots.acquire()
        try:
            # A save that failed while this one waited (the keyframe it is a delta of, say)
            # reaches the loop now, not one save later.
            self._raise_pending_errors()
        except BaseException:
            self._slots.release()
            raise
        waited = time.perf_counter() - start
        if waited > WAIT_LOG_THRESHOLD_S:
            logger.info(
                "backpressure: save of '%s' waited %.3f s for one of %d pending saves to finish",
                path,
                waited,
                self.max_pending,
            )
        future: Future = Future()
        try:
            if callable(qstate):
                job = _Job(qstate=None, path=path, future=future, encode=qstate)
            else:
                job = self._stage(qstate, path, future, live)
        except BaseException:
            self._slots.release()
            raise
        job.after = dependencies
        with self._lock:
            self._pending[future] = path
            self._paths[future] = path
        self._queue.put(job)
        return future

    def discard(self, path: str | os.PathLike) -> None:
        """Delete ``path`` on the writer thread, after the saves queued before it.

        Why: unlinking a large file frees its page cache, which takes time, and retention
        deletes a whole keyframe cycle at once: on the loop's thread that would be a pause.
        A file already gone is fine; another failure is logged. :meth:`flush` and
        :meth:`close` wait for it. A closed writer deletes it here and now.
        """
        self.call(functools.partial(_format.remove_quietly, os.fspath(path)))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the writer thread, after the saves queued before it.

        For work the loop should not wait for (deleting files, faulting in memory a later
        save will use). :meth:`flush` and :meth:`close` wait for it; an exception it raises
        is logged, not raised. A closed writer runs it here and now.

        Returns:
            A Future that is done once ``fn`` has run (its result is not kept).
        """
        future: Future = Future()
        if self._closed:
            _run_logged(fn)
            future.set_result(None)
            return future
        with self._lock:
            self._tasks.add(future)
        self._queue.put(_Task(fn, future))
        return future

    def check(self) -> None:
        """Raise a failed save's error not yet raised, without waiting for anything.

        Raises:
            CheckpointError: as :meth:`submit` would.
        """
        self._raise_pending_errors()

    def flush(self) -> None:
        """Wait until every submitted save is written.

        Raises:
            CheckpointError: a save failed since the last error was raised (chained).
        """
        with self._lock:
            pending = list(self._pending) + list(self._tasks)
        wait_futures(pending)
        self._raise_pending_errors()

    def close(self) -> None:
        """Drain the queue, stop the writer thread, and raise a failure not yet raised.

        Closing twice is harmless. A closed writer refuses new saves.
        """
        if self._closed:
            self._raise_pending_errors()
            return
        try:
            self.flush()
        finally:
            self._stop()

    def pending(self) -> int:
        """Number of saves submitted and not yet written (or failed)."""
        with self._lock:
            return len(self._pending)

    def copy_events(self, future: Future) -> list | None:
        """The events of the device-to-host copies of the save ``future`` is of (``None``:
        it had no CUDA buffers, or is unknown): once they have fired, its write reads only
        host memory."""
        with self._lock:
            return self._copies.get(future)

    @property
    def device_bytes_held(self) -> int:
        """Device bytes of encoded buffers (codes, per-block values; not the state's own
        tensors) that queued saves hold until the writer thread has waited for their copies."""
        with self._lock:
            return sum(self._device_held.values())

    @property
    def pinned_bytes_held(self) -> int:
        """Pinned host bytes the pool holds now (0 when no CUDA buffer was ever saved)."""
        return self.staging.pool.held_bytes

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is already on its way out: drain, but do not hide it behind a
        # write error. The write error is logged here and stays on its Future.
        try:
            self.close()
        except CheckpointError as err:
            logger.error("while handling %s: %s", exc_type.__name__, err)

    # ------------------------------------------------------------- caller thread

    def _stage(self, qstate: QuantizedState, path: str, future: Future, live: bool = False) -> _Job:
        """Build the job; on CUDA, enqueue the D2H copies into a pinned buffer."""
        staged = self.staging.stage(qstate, path, live=live)
        if staged is None:
            return _Job(qstate=qstate, path=path, future=future)
        device_bytes = sum(
            t.numel() * t.element_size()
            for e in qstate.entries.values()
            for t in e.buffers.values()
            if t.device.type != "cpu" and not (live and e.codec == "exact")  # live: the state's own
        )
        with self._lock:
            self._copies[future] = staged.copy_done
            self._device_held[future] = device_bytes
        return _Job(
            qstate=staged.qstate,
            path=path,
            future=future,
            copy_done=staged.copy_done,
            device_state=qstate,
            pinned=staged.pinned,
        )

    def _raise_pending_errors(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if not errors:
            return
        path, first = errors[0]
        more = f" ({len(errors) - 1} later save(s) failed too, see the log)" if len(errors) > 1 else ""
        message = f"async save to '{path}' failed: {type(first).__name__}: {first}{more}"
        if isinstance(first, OSError) and first.errno is not None:
            # Also an OSError with the same errno, so `except OSError` and errno checks work.
            raise CheckpointIOError(first.errno, message) from first
        raise CheckpointError(message) from first

    def _stop(self, *, at_exit: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        if not at_exit:  # the exit hooks are running already; leave their list alone
            atexit.unregister(self._exit_hook)

    # ------------------------------------------------------------- writer thread

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _Task):
                try:
                    _run_logged(job.fn)
                finally:
                    # Even past a KeyboardInterrupt-like escape: flush() must not wait forever.
                    with self._lock:
                        self._tasks.discard(job.future)
                    job.future.set_result(None)
                continue
            self._write(job)

    def _write(self, job: _Job) -> None:
        error: BaseException | None = None
        nbytes = 0
        try:
            # Checked before the encode too: in closed loop it advances the reference,
            # which must not move past a link that is not on disk.
            _check_dependencies(job)
            for event in job.copy_done:
                wait_event(event)
            job.device_state = None  # the copies are done; let the device memory go
            with self._lock:
                self._device_held.pop(job.future, None)
            if job.encode is not None:
                job.qstate, job.encode = job.encode(), None
            nbytes = _format.write_file(job.qstate, job.path, fsync=self.fsync, entropy=self.entropy)
        except BaseException as err:  # noqa: BLE001 - every failure goes to the Future
            error = err
            logger.error("async save to '%s' failed: %s: %s", job.path, type(err).__name__, err)
        dependent = isinstance(error, _DependencyFailed)
        if dependent:
            # The copies into the pinned buffer may still run: it goes back only after them.
            for event in job.copy_done:
                wait_event(event)
        # Free the slot and the pinned buffer before resolving the Future, so that a
        # caller who waits on it can submit again at once without blocking.
        job.qstate = None
        job.encode = None
        job.device_state = None
        with self._lock:
            self._device_held.pop(job.future, None)
        if job.pinned is not None:
            self.staging.pool.release(job.pinned)
            job.pinned = None
        with self._lock:
            self._pending.pop(job.future, None)
            # A save lost for a failed dependency is a consequence of an error that is
            # raised once already: raising it again would stop the loop a second time.
            if error is not None and not dependent:
                self._errors.append((job.path, error))
        self._slots.release()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(nbytes)


def _check_dependencies(job: _Job) -> None:
    """Return when every save ``job`` depends on is written.

    Raises:
        CheckpointError: one of them failed (named, with its error); ``job`` must then not
            be written, as its file could never be loaded.
    """
    if not job.after:
        return
    # Submitted earlier to the same in-order thread, so they are done; waiting costs nothing.
    wait_futures([f for f, _ in job.after])
    for future, path in job.after:
        if future.cancelled():
            reason = "was cancelled"
        elif future.exception() is not None:
            err = future.exception()
            reason = f"failed ({type(err).__name__}: {err})"
        else:
            continue
        raise _DependencyFailed(
            f"checkpoint '{job.path}' was not written: it is coded against '{path}', whose "
            f"save {reason}, so it could never be loaded; the next keyframe starts over"
        )


class _DependencyFailed(CheckpointError):
    """A save not written because a save it depends on failed (see :meth:`AsyncWriter.submit`)."""


def _run_logged(fn: Callable[[], Any]) -> None:
    """Run ``fn()``; log what it raises (a task between saves has no caller to raise to)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - logged: nothing waits for this task's result
        logger.warning("writer task %r failed: %s: %s", fn, type(exc).__name__, exc)


def _drain_at_exit(ref: weakref.ReferenceType[AsyncWriter]) -> None:
    """Interpreter-exit hook: finish a writer's pending saves, or warn that it could not."""
    writer = ref()
    if writer is None or writer._closed:
        return
    with writer._lock:
        pending = dict(writer._pending)
    if pending:
        logger.info("finishing %d pending checkpoint save(s) at exit", len(pending))
    _, not_done = wait_futures(list(pending), timeout=writer.exit_timeout)
    if not_done:
        logger.warning(
            "interpreter exit: %d checkpoint save(s) not finished after %s s and abandoned "
            "(their temp files may remain): %s",
            len(not_done),
            writer.exit_timeout,
            ", ".join(sorted(pending[f] for f in not_done)),
        )
        return
    with writer._lock:
        errors, writer._errors = writer._errors, []
    for path, err in errors:
        logger.warning(
            "interpreter exit: checkpoint save to '%s' failed: %s: %s", path, type(err).__name__, err
        )
    writer._stop(at_exit=True)
