"""Staging of CUDA buffers for the writer: pinned host buffers and the D2H copies into them.

:class:`PinnedPool` holds pinned byte buffers reused across saves under a byte cap (its
``acquire`` blocks while the cap leaves no room: backpressure on memory); :func:`carve`
splits one into aligned tensor views; :class:`DeviceStaging` enqueues a save's
device-to-host copies on a side stream ordered after the producing stream. CPU buffers are
never staged. Why: docs/training-loop.md ("The writer on its own").
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from .arguments import as_int
from .errors import CheckpointError
from .pinned_memory import HostSlab
from .qstate import EncodedEntry, QuantizedState

logger = logging.getLogger(__name__)

# Offsets of tensors carved from one pinned buffer are rounded up to this, so every dtype
# view is aligned and copies start on a cache line.
PINNED_ALIGN = 64

# A save smaller than a pooled buffer reuses it; a new buffer is rounded up to a multiple
# of this so that saves of slightly different sizes (a keyframe, then deltas) share it.
PINNED_GRANULE = 1 << 20


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def staging_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of one staging buffer that :func:`carve` can split into all ``tensors``."""
    return sum(_align(t.numel() * t.element_size(), PINNED_ALIGN) for t in tensors)


def carve(buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the ``uint8`` ``buffer``, one per tensor, with its dtype and shape
    (contiguous), back to back, each starting ``PINNED_ALIGN``-aligned.

    Raises:
        CheckpointError: ``buffer`` is smaller than :func:`staging_nbytes` of ``tensors``.
    """
    need = staging_nbytes(tensors)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < need:
        raise CheckpointError(
            f"staging buffer of {buffer.numel()} {buffer.dtype} elements cannot hold {need} bytes"
        )
    views = []
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(buffer[offset : offset + n].view(t.dtype).view(t.shape))
        offset += _align(n, PINNED_ALIGN)
    return views


class PinnedPool:
    """Pinned host byte buffers, reused across saves, bounded by a byte cap.

    One save takes one buffer (large enough for all its CUDA buffers, which are carved
    from it as tensor views) and gives it back when its file is written. ``acquire``
    blocks while the cap leaves no room, which is the writer's backpressure on memory.

    Args:
        cap_bytes: most pinned bytes held at once (in use or free), or ``None`` for no
            byte cap (then ``max_pending`` of the writer alone bounds the pool: at most
            that many buffers exist).
        pin_memory: page-lock the buffers (the point of the pool; ``False`` only lets its
            bookkeeping be tested on a machine without CUDA). Each buffer is a
            :class:`~tw_triton.pinned_memory.HostSlab`, registered with CUDA, not from the
            caching host allocator: exactly the size asked (a whole number of
            :data:`PINNED_GRANULE`), and given back to the system when the pool drops it.
    """

    def __init__(self, cap_bytes: int | None, *, pin_memory: bool = True) -> None:
        cap_bytes = as_int(cap_bytes, "pinned_bytes", minimum=1, optional=True)
        self.cap_bytes = cap_bytes
        self.pin_memory = pin_memory
        self._free: list[torch.Tensor] = []
        self._slabs: dict[int, HostSlab] = {}  # by data pointer: every buffer the pool made
        self._held_bytes = 0
        self._cond = threading.Condition()

    @property
    def held_bytes(self) -> int:
        """Pinned bytes the pool holds now, free or in use."""
        with self._cond:
            return self._held_bytes

    def acquire(self, nbytes: int, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
        """Return a pinned ``uint8`` buffer of at least ``nbytes`` and the seconds waited
        (``device``: the one its copies come from, whose context registers a new buffer).

        Raises:
            CheckpointError: ``nbytes`` is larger than the cap, so it could never fit.
        """
        if self.cap_bytes is not None and nbytes > self.cap_bytes:
            raise CheckpointError(
                f"a save needs {nbytes} bytes of pinned host memory for its device "
                f"buffers, more than the writer's pinned_bytes cap of {self.cap_bytes}; "
                f"raise the cap"
            )
        want = _align(max(nbytes, 1), PINNED_GRANULE)
        if self.cap_bytes is not None:
            want = min(want, self.cap_bytes)
        start = time.perf_counter()
        with self._cond:
            while True:
                fits = [b for b in self._free if b.numel() >= nbytes]
                if fits:
                    best = min(fits, key=lambda b: b.numel())
                    self._free.remove(best)
                    return best, time.perf_counter() - start
                # Buffers too small for this save would only pin memory: drop them
                # before pinning a new one, so at most max_pending buffers exist.
                for b in self._free:
                    self._held_bytes -= b.numel()
                    self._slabs.pop(b.data_ptr()).close()
                self._free.clear()
                if self.cap_bytes is None or self._held_bytes + want <= self.cap_bytes:
                    slab = HostSlab(want, register=self.pin_memory, device=device)
                    self._slabs[slab.tensor.data_ptr()] = slab
                    self._held_bytes += want
                    return slab.tensor, time.perf_counter() - start
                self._cond.wait()

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back for reuse by a later save."""
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()


@dataclass
class Staged:
    """A save whose CUDA buffers are being copied to ``pinned``.

    Attributes:
        qstate: the save with its CUDA buffers replaced by views of ``pinned``.
        copy_done: one CUDA event per device, fired when its copies are done.
        pinned: the pool buffer, to give back once the copies are done and the file written.
    """

    qstate: QuantizedState
    copy_done: list
    pinned: torch.Tensor


class DeviceStaging:
    """Copies the CUDA buffers of saves into pinned host memory, on one side stream per device.

    Args:
        pinned_bytes: cap of the :class:`PinnedPool` (``None``: no byte cap).
        wait_log_threshold_s: a wait for pinned memory longer than this is logged.
    """

    def __init__(self, pinned_bytes: int | None, *, wait_log_threshold_s: float = 0.001) -> None:
        self.pool = PinnedPool(pinned_bytes)
        self.side_streams: dict[int, torch.cuda.Stream] = {}
        self.wait_log_threshold_s = wait_log_threshold_s

    def stage(self, qstate: QuantizedState, path: str, *, live: bool = False) -> Staged | None:
        """Enqueue the D2H copies of ``qstate``'s CUDA buffers; ``None``: it has none.

        ``live``: some buffers are the training state's own tensors (exact entries not
        copied on the device): the current stream then waits for the copies before any
        later work, so that the next step cannot change them first.

        Raises:
            CheckpointError: buffers on a device that is neither the CPU nor CUDA, or more
                than the pool's cap.
        """
        device_bufs = [
            (name, bname, t)
            for name, entry in qstate.entries.items()
            for bname, t in entry.buffers.items()
            if t.device.type != "cpu"
        ]
        if not device_bufs:
            return None
        other = {t.device.type for _, _, t in device_bufs} - {"cuda"}
        if other:
            raise CheckpointError(
                f"cannot save '{path}': buffers on device type(s) {sorted(other)}; "
                f"the writer stages only CUDA and CPU tensors"
            )
        tensors = [t for _, _, t in device_bufs]
        pinned, waited = self.pool.acquire(staging_nbytes(tensors), tensors[0].device)
        if waited > self.wait_log_threshold_s:
            logger.info(
                "backpressure: save of '%s' waited %.3f s for pinned host memory (cap %s bytes)",
                path,
                waited,
                self.pool.cap_bytes,
            )
        try:
            views = carve(pinned, tensors)
            events = self.copy_to_host(tensors, views, live=live)
        except BaseException:
            # Copies enqueued before the failure (e.g. for another device) still write into
            # the buffer: it goes back to the pool only once they are done.
            self.drain()
            self.pool.release(pinned)
            raise
        by_key = {(name, bname): v for (name, bname, _), v in zip(device_bufs, views)}
        entries = {}
        for name, entry in qstate.entries.items():
            bufs = {b: by_key.get((name, b), t) for b, t in entry.buffers.items()}
            entries[name] = EncodedEntry(entry.codec, entry.params, entry.shape, entry.dtype, bufs)
        return Staged(replace(qstate, entries=entries), events, pinned)

    def copy_to_host(
        self, tensors: list[torch.Tensor], views: list[torch.Tensor], *, live: bool = False
    ) -> list:
        """Enqueue each CUDA tensor's copy into its pinned view, per device on a side stream
        that first waits for the work already queued on the current stream (the encode
        kernels that produced the buffers). Returns one event per device marking the copies
        done; the caller keeps the device tensors alive until they have fired. ``live``: the
        current stream waits for them too (see :meth:`stage`)."""
        by_device: dict[int, list[int]] = {}
        for i, t in enumerate(tensors):
            by_device.setdefault(t.device.index, []).append(i)
        events = []
        for index, members in by_device.items():
            producer = torch.cuda.current_stream(index)
            side = self.side_stream(index)
            side.wait_stream(producer)
            with torch.cuda.stream(side):
                for i in members:
                    views[i].copy_(tensors[i], non_blocking=True)
            # A blocking event: the writer thread sleeps in synchronize() instead of spinning
            # a CPU core that the training loop may need while the copy runs.
            done = torch.cuda.Event(blocking=True)
            done.record(side)
            if live:
                producer.wait_event(done)
            events.append(done)
        return events

    def drain(self) -> None:
        """Wait for every copy enqueued on the side streams (an error path only)."""
        for stream in self.side_streams.values():
            stream.synchronize()

    def side_stream(self, index: int) -> torch.cuda.Stream:
        stream = self.side_streams.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=index)
            self.side_streams[index] = stream
        return stream
