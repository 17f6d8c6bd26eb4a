"""Recycled host memory for snapshot copies, so that a save does not page-fault fresh memory.

A CPU snapshot copies every exact tensor (and a delta its moments) into new memory. glibc
serves such large blocks with fresh ``mmap()`` pages and unmaps them when they are freed,
so every save pays to fault its whole snapshot in again, which can be most of the time
``save()`` blocks the loop. A :class:`SnapshotPool` keeps those buffers instead and hands
them to the next save, whose copy then lands in memory that is already mapped. Why:
docs/training-loop.md ("Memory").

How it is used::

    pool = SnapshotPool(cap_bytes=2 << 30)
    lease = pool.lease()                       # one per save
    q = quantize_state_dict(state, allocate=lease)
    save(q, path)                              # or: a writer's Future completes
    lease.release()                            # only when nothing reads q's buffers any more

Only a lease's :meth:`~SnapshotLease.release` returns memory to the pool, and only whoever
knows that the snapshot has been written can call it: releasing earlier would let the next
save overwrite bytes that are still being written. The :class:`~tw_triton.Checkpointer`
releases a save's lease when its Future is done, and keeps the buffers of a keyframe that
serves as the delta reference until that reference is replaced.

Only CPU buffers of at least ``min_bytes`` are pooled. Smaller ones come from the heap
without page faults anyway, and device memory is already recycled by the CUDA caching
allocator; both are plain ``torch.empty`` allocations here.

Buffers are keyed by their size in bytes and handed out as views of a ``uint8`` buffer
with the requested dtype and shape, so a weight's buffer can serve a moment of the same
size in the next save. The pool holds at most ``cap_bytes`` (in use and free together):
when a request does not fit, free buffers of other sizes are dropped first, and if it still
does not fit the request gets fresh memory that is not pooled (the behaviour without a pool;
results never change, only where the bytes live).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import torch

from .arguments import as_int
from .errors import CheckpointError

logger = logging.getLogger(__name__)

# Below this a buffer comes from the heap arena, which glibc keeps mapped: nothing to gain.
MIN_POOLED_BYTES = 1 << 16

Allocator = Callable[[Sequence[int], torch.dtype, torch.device], torch.Tensor]
"""``allocate(shape, dtype, device)``: an uninitialized contiguous tensor a codec writes its
output into (see :meth:`tw_triton.codecs.Codec.encode_with`)."""


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


class SnapshotPool:
    """Host byte buffers reused across saves, bounded by a byte cap.

    Args:
        cap_bytes: most bytes the pool holds at once, handed out and free together;
            ``None`` for no cap (the owner bounds it, e.g. by setting :attr:`cap_bytes`
            after it has seen how large a save is).
        min_bytes: smaller requests are not pooled.

    Thread-safe: leases may be released from another thread than the one that took them.
    """

    def __init__(self, cap_bytes: int | None = None, *, min_bytes: int = MIN_POOLED_BYTES) -> None:
        cap_bytes = as_int(cap_bytes, "cap_bytes", optional=True)
        self.cap_bytes = cap_bytes
        self.min_bytes = min_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._held = 0
        self._lock = threading.Lock()
        self.reused = 0  # requests served from a free buffer (statistics for tests and logs)
        self.allocated = 0  # pooled buffers created
        self.unpooled = 0  # pooled-size requests that got fresh memory because of the cap

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds now: handed out to leases not yet released, plus free ones."""
        with self._lock:
            return self._held

    @property
    def free_bytes(self) -> int:
        """Bytes of free buffers waiting for the next save."""
        with self._lock:
            return sum(k * len(v) for k, v in self._free.items())

    def lease(self) -> SnapshotLease:
        """A new lease: the allocator of one save, and the record of what it took."""
        return SnapshotLease(self)

    def clear(self) -> None:
        """Drop the free buffers (leased ones come back and stay until cleared again)."""
        with self._lock:
            for size, bufs in self._free.items():
                self._held -= size * len(bufs)
            self._free.clear()

    def reserve(self, sizes: Iterable[int], *, beside_free: bool = False) -> int:
        """Add free buffers of these byte sizes, with their pages faulted in, now.

        The first save of a process otherwise copies into fresh memory and pays for every
        page fault inside ``save()``. A size is reserved as many times as it appears, less
        the free buffers of that size already here (reserving twice adds nothing), or
        beside them with ``beside_free`` (for buffers the next save needs on top of the
        free ones). Sizes under ``min_bytes`` are skipped (they are not pooled), and a size
        that would take the pool over its cap is skipped too: what could not be reserved is
        allocated by the save that needs it, as without a reservation.

        Returns:
            The bytes added.
        """
        wanted = Counter(int(n) for n in sizes if int(n) >= self.min_bytes)
        added = 0
        for nbytes, count in sorted(wanted.items(), reverse=True):
            with self._lock:
                if not beside_free:
                    count -= len(self._free.get(nbytes, ()))
                cap = self.cap_bytes
                if cap is not None:
                    count = min(count, (cap - self._held) // nbytes)
                if count <= 0:
                    continue
                self._held += nbytes * count
                self.allocated += count
            bufs = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(count)]
            for buf in bufs:
                buf.zero_()  # the page faults happen here, not in the save that reuses it
            with self._lock:
                self._free.setdefault(nbytes, []).extend(bufs)
            added += nbytes * count
        return added

    def reusable_bytes(self, sizes: Iterable[int]) -> int:
        """Bytes of buffers of these byte sizes that free buffers could serve now (each
        free buffer once; sizes under ``min_bytes`` are not pooled and count nothing)."""
        wanted = Counter(int(n) for n in sizes if int(n) >= self.min_bytes)
        with self._lock:
            return sum(n * min(count, len(self._free.get(n, ()))) for n, count in wanted.items())

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """A pooled ``uint8`` buffer of exactly ``nbytes``, or ``None`` if the cap forbids it."""
        with self._lock:
            bufs = self._free.get(nbytes)
            if bufs:
                buf = bufs.pop()
                if not bufs:
                    del self._free[nbytes]
                self.reused += 1
                return buf
            cap = self.cap_bytes
            if cap is not None and self._held + nbytes > cap:
                # Free buffers of other sizes are what a past save needed; this one needs
                # room now. Largest first, so the fewest buffers are dropped.
                for size in sorted(self._free, reverse=True):
                    while self._free[size] and self._held + nbytes > cap:
                        self._free[size].pop()
                        self._held -= size
                    if not self._free[size]:
                        del self._free[size]
                    if self._held + nbytes <= cap:
                        break
                if self._held + nbytes > cap:
                    self.unpooled += 1
                    return None
            self._held += nbytes
            self.allocated += 1
        # Allocated outside the lock: a large empty() is cheap, but no reason to hold it.
        return torch.empty(nbytes, dtype=torch.uint8)

    def _give_back(self, bufs: list[torch.Tensor]) -> None:
        with self._lock:
            for buf in bufs:
                if self.cap_bytes is not None and self._held > self.cap_bytes:
                    self._held -= buf.numel()  # the cap was lowered meanwhile: let it go
                    continue
                self._free.setdefault(buf.numel(), []).append(buf)


class SnapshotLease:
    """What one save took from a :class:`SnapshotPool`; call it as an :data:`Allocator`.

    Created by :meth:`SnapshotPool.lease`. Every pooled buffer it hands out stays the
    lease's until :meth:`release` (back to the pool) or :meth:`split` (moved to another
    lease, e.g. the buffers a delta reference keeps).
    """

    def __init__(self, pool: SnapshotPool) -> None:
        self._pool = pool
        self._bufs: list[torch.Tensor] = []
        self._released = False
        # A save's codecs take buffers on the writer's threads while save() may split off
        # the reference's: the list changes under this lock only.
        self._lock = threading.Lock()

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous tensor of ``shape`` and ``dtype`` on ``device``."""
        shape = tuple(int(s) for s in shape)
        dev = torch.device(device)
        nbytes = _nbytes(shape, dtype)
        if dev.type != "cpu" or nbytes < self._pool.min_bytes:
            return torch.empty(shape, dtype=dtype, device=dev)
        if self._released:
            raise CheckpointError("a released snapshot lease cannot hand out buffers")
        buf = self._pool._take(nbytes)
        if buf is None:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            if self._released:
                self._pool._give_back([buf])
                raise CheckpointError("a released snapshot lease cannot hand out buffers")
            self._bufs.append(buf)
        return buf.view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        """Pooled bytes this lease holds."""
        with self._lock:
            return sum(b.numel() for b in self._bufs)

    def buffer_sizes(self) -> list[int]:
        """The byte size of each pooled buffer this lease holds."""
        with self._lock:
            return [b.numel() for b in self._bufs]

    def split(self, tensors: Sequence[torch.Tensor]) -> SnapshotLease:
        """Move the buffers under ``tensors`` into a new lease of the same pool.

        For tensors that must outlive the save (a keyframe kept as the delta reference):
        the rest of this lease can be released when the save is written, the new lease
        when those tensors are no longer needed. Tensors not from this lease are ignored.
        """
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        other = SnapshotLease(self._pool)
        with self._lock:
            other._bufs = [b for b in self._bufs if b.data_ptr() in ptrs]
            self._bufs = [b for b in self._bufs if b.data_ptr() not in ptrs]
        return other

    def release(self) -> None:
        """Give every buffer back to the pool. Call only when nothing reads them any more.

        Releasing twice is harmless; a released lease hands out nothing more.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
            bufs, self._bufs = self._bufs, []
        self._pool._give_back(bufs)


class SavePool:
    """The snapshot memory of a saver that writes in the background (the
    :class:`~tw_triton.Checkpointer`, Lightning's ``TwCheckpointIO``).

    One :class:`SnapshotLease` per save, tracked with that save's Future and given back to
    the pool only once the Future is done: until then the writer may still read its
    buffers. The pool's cap follows the largest save so far unless one is given.

    Args:
        cap_bytes: ``None``: ``saves_in_flight`` times the largest save so far, plus what
            the caller keeps (see :meth:`lease`); ``0``: no pool (every lease is ``None``
            and a save allocates fresh memory); otherwise a fixed cap.
        saves_in_flight: snapshots that can exist at once (pending writes plus the one
            being taken).

    Raises:
        CheckpointError: a negative ``cap_bytes``.
    """

    def __init__(self, cap_bytes: int | None, saves_in_flight: int) -> None:
        cap_bytes = as_int(cap_bytes, "snapshot_pool_bytes", optional=True)
        self.pool = SnapshotPool(cap_bytes) if cap_bytes != 0 else None
        self._auto = cap_bytes is None
        self._saves = saves_in_flight
        self.largest = 0  # pooled bytes of the largest save so far
        # (Future, lease, own): ``own`` when the lease is a save's own snapshot, whose size
        # the cap follows (not one moved here from a kept reference).
        self._pending: list[tuple[Future, SnapshotLease, bool]] = []

    @property
    def held_bytes(self) -> int:
        """Bytes the pool holds: in saves not yet written, kept, and free (0 without one)."""
        return self.pool.held_bytes if self.pool is not None else 0

    def lease(self, kept: int = 0) -> SnapshotLease | None:
        """The allocator of the next save (``None`` without a pool), with the cap brought up
        to date; ``kept``: pooled bytes the caller holds beyond the saves (a reference)."""
        if self.pool is None:
            return None
        self._update_cap(kept)
        return self.pool.lease()

    def track(self, future: Future, lease: SnapshotLease, *, own: bool = True) -> None:
        """Give ``lease`` back to the pool once ``future`` is done (see :meth:`release_written`)."""
        self._pending.append((future, lease, own))
        if own:
            self.largest = max(self.largest, lease.nbytes)

    def release_written(self) -> None:
        """Give the leases of every save whose Future is done (written or failed) back."""
        still = []
        for future, lease, own in self._pending:
            if future.done():
                if own:
                    # The writer thread's codes and scales came from the lease too, after
                    # the save had measured it: the cap makes room for them next time.
                    self.largest = max(self.largest, lease.nbytes)
                lease.release()
            else:
                still.append((future, lease, own))
        self._pending = still

    def reserve(self, sizes: Sequence[int], kept: int = 0, extra: Sequence[int] = ()) -> int:
        """:meth:`SnapshotPool.reserve` for a save of buffers of ``sizes`` bytes, the cap
        first made room for it; returns the bytes added (0 without a pool).

        ``extra``: more buffers to reserve beside the save's, for memory the caller will
        keep (a delta reference holds its keyframe's copies while the next save copies the
        state again); the cap makes room for them as it does for ``kept``.
        """
        if self.pool is None:
            return 0
        self.make_room(sizes, kept, extra)
        return self.pool.reserve([*sizes, *extra])

    def make_room(self, sizes: Sequence[int], kept: int = 0, extra: Sequence[int] = ()) -> None:
        """Bring an automatic cap up to a save of buffers of ``sizes`` bytes (plus ``kept``
        and ``extra`` as in :meth:`reserve`), reserving nothing: the owner's thread calls
        it before the writer thread adds the buffers with :meth:`reserve_beside`."""
        if self.pool is not None and self._auto:
            self.largest = max(self.largest, sum(sizes))
            self._update_cap(kept + sum(extra))

    def warm_for(self, sizes: Sequence[int]) -> bool:
        """Whether a copy of buffers of ``sizes`` bytes would land mostly (at least half of
        its pooled bytes) in free buffers, memory already faulted in. ``False`` without a
        pool; ``True`` when nothing in it is large enough to be pooled."""
        if self.pool is None:
            return False
        pooled = sum(int(n) for n in sizes if int(n) >= self.pool.min_bytes)
        return pooled == 0 or 2 * self.pool.reusable_bytes(sizes) >= pooled

    def reserve_beside(self, sizes: Sequence[int]) -> int:
        """Add free buffers of ``sizes`` beside those free already, within the cap; returns
        the bytes added (0 without a pool). Thread-safe: the writer thread calls it."""
        if self.pool is None:
            return 0
        return self.pool.reserve(sizes, beside_free=True)

    def close(self) -> None:
        """Give back what is written and drop the free buffers (call once nothing is pending)."""
        self.release_written()
        if self.pool is not None:
            self.pool.clear()

    def _update_cap(self, kept: int) -> None:
        if self.pool is not None and self._auto and self.largest:
            self.pool.cap_bytes = self._saves * self.largest + kept


__all__ = ["Allocator", "SnapshotPool", "SnapshotLease", "SavePool", "MIN_POOLED_BYTES"]
