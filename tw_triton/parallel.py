"""CPU worker threads for work over independent tensors and buffers.

The CPU path of a save or a load is many independent pieces: entries to encode or decode,
buffers to entropy-code or to read and check. Each piece runs in torch ops, zstd and
``zlib.crc32``, which all release the GIL on large inputs, so a few Python threads keep
every core busy; torch's own intra-op threads barely help here, because most ops are on
one chunk of a few MiB and the zstd stage and the checksum are serial.

:func:`parallel_map` runs a function over items on :func:`cpu_threads` threads, largest
piece first (so one big tensor does not start last and finish alone), and returns the
results in the items' order. The bytes produced never depend on the thread count: each
piece is computed alone, and the caller lays the results out in its own order. Torch ops on
a worker use one intra-op thread (the workers are the parallelism); the calling thread
keeps its own count.

The number of threads is ``TW_TRITON_THREADS`` when set (``1`` turns parallelism off:
for a training loop that needs every core itself), else the machine's cores, at most
:data:`MAX_THREADS`. Why threads, and how many: docs/training-loop.md ("CPU threads").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

from .errors import TwTritonError

T = TypeVar("T")
R = TypeVar("R")

ENV_THREADS = "TW_TRITON_THREADS"
# Beyond this the pieces of one checkpoint (a few hundred tensors, the largest tens of
# MiB) stop dividing evenly, and memory bandwidth is the bound anyway.
MAX_THREADS = 8
# Items smaller than this run on the calling thread: handing one to a worker costs tens of
# microseconds and a GIL hand-over, more than a small copy or encode.
MIN_PARALLEL_SIZE = 1 << 18


def cpu_threads() -> int:
    """Worker threads for the CPU path: ``TW_TRITON_THREADS``, or the cores (at most 8).

    Raises:
        TwTritonError: ``TW_TRITON_THREADS`` is set but not a positive integer.
    """
    raw = os.environ.get(ENV_THREADS, "").strip()
    if raw:
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1:
            raise TwTritonError(f"{ENV_THREADS} must be a positive integer, found {raw!r}")
        return value
    return max(1, min(os.cpu_count() or 1, MAX_THREADS))


def parallel_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    *,
    sizes: Sequence[int] | None = None,
    threads: int | None = None,
    done: Callable[[int], None] | None = None,
) -> list[R]:
    """``[fn(item) for item in items]``, computed on up to ``threads`` threads.

    Args:
        fn: applied to each item; it must not depend on what other calls do.
        items: the pieces of work.
        sizes: a cost per item in bytes; larger ones are started first, and those under
            :data:`MIN_PARALLEL_SIZE` run on the calling thread. ``None``: all on workers.
        threads: worker threads (default :func:`cpu_threads`). With 1, or one item, the
            calls run here, in order.
        done: called as ``done(i)`` in the calling thread, in order, once item ``i``'s
            result is ready (for progress callbacks, which users expect on their thread).

    Returns:
        The results, in the order of ``items``.

    Raises:
        The exception of the first item (in ``items`` order) whose call raised; items not
        yet started when a call fails are not started.
    """
    n = len(items)
    big = [i for i in range(n) if sizes is None or sizes[i] >= MIN_PARALLEL_SIZE]
    workers = min(cpu_threads() if threads is None else threads, len(big))
    if workers <= 1:
        return _in_order(fn, items, done)
    order = sorted(big, key=lambda i: -sizes[i]) if sizes is not None else big
    intraop = torch.get_num_threads()
    try:
        with ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="tw_triton-cpu", initializer=_one_intraop_thread
        ) as pool:
            try:
                futures = {i: pool.submit(fn, items[i]) for i in order}
            except RuntimeError as e:
                if "interpreter shutdown" not in str(e):
                    raise
                # Interpreter exit has begun (the writer's exit hook finishing a save):
                # concurrent.futures takes no new work, so the same calls run here.
                return _in_order(fn, items, done)
            try:
                results = []
                for i in range(n):
                    # Small items run here meanwhile, in order.
                    results.append(futures[i].result() if i in futures else fn(items[i]))
                    if done is not None:
                        done(i)
                return results
            except BaseException:
                for f in futures.values():
                    f.cancel()
                raise
    finally:
        # torch.set_num_threads also sets the default that threads inherit when they first
        # run a torch op; the workers set it to 1, so it is put back (this thread's own
        # count is the same value: nothing changes for it).
        torch.set_num_threads(intraop)


def _in_order(fn: Callable[[T], R], items: Sequence[T], done: Callable[[int], None] | None) -> list[R]:
    results = []
    for i, item in enumerate(items):
        results.append(fn(item))
        if done is not None:
            done(i)
    return results


class Background(Generic[R]):
    """``fn()`` running on a thread of its own while the caller does other work.

    What a load uses to read a delta's reference file while it decodes the entries that
    need no reference: both sides run :func:`parallel_map`, so for a while there are
    twice the worker threads; the pieces are large and release the GIL, and the cores are
    shared rather than left idle at either side's tail.

    :meth:`result` (or :meth:`wait`) must be called: it joins the thread, and puts back
    the caller's intra-op thread count as the default for new threads (the background
    side's workers set it to 1, and its :func:`parallel_map` may finish last).
    """

    def __init__(self, fn: Callable[[], R], name: str = "tw_triton-background") -> None:
        self._intraop = torch.get_num_threads()
        self._future: Future[R] = Future()
        self._future.set_running_or_notify_cancel()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], R]) -> None:
        try:
            self._future.set_result(fn())
        except BaseException as exc:  # handed to the caller by result()
            self._future.set_exception(exc)

    def result(self) -> R:
        """``fn()``'s value, once its thread has ended; raises what ``fn`` raised."""
        try:
            self._thread.join()
            return self._future.result()
        finally:
            torch.set_num_threads(self._intraop)

    def wait(self) -> None:
        """Wait for ``fn`` to finish, dropping its value or its exception: what a caller
        that fails on its side does before it raises, so that no read goes on behind it."""
        try:
            self.result()
        except Exception:  # the caller's own error is the one to report
            pass


def _one_intraop_thread() -> None:
    """Worker start: torch ops of this thread run on one core. The workers are the
    parallelism; with torch's intra-op threads as well, N workers would start N times the
    cores' threads, which wait on each other."""
    torch.set_num_threads(1)


__all__ = ["Background", "ENV_THREADS", "MAX_THREADS", "MIN_PARALLEL_SIZE", "cpu_threads", "parallel_map"]
