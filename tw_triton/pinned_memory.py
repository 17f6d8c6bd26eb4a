"""Page-locked host memory without the caching host allocator, and a bounded upload ring.

:class:`HostSlab` is one plain host allocation of exactly the size asked, registered with
CUDA (``cudaHostRegister``) so that device copies from and to it run asynchronously, and
unregistered and freed when it is closed. ``torch.empty(..., pin_memory=True)`` goes
through the caching host allocator instead, which rounds every size up to a power of two
and keeps whatever is freed for later reuse: pinned memory that no one asked for.
:class:`PinnedRing` streams host bytes to a device through a fixed number of slots of one
slab, each reused only once the device has copied out of it, so a load to a GPU pins a few
chunks instead of the whole file. Where CUDA refuses to page-lock memory, a slab comes from
torch's pinned allocator, or stays pageable (:func:`pinned_empty`): slower, never different
bytes. Without CUDA nothing is registered and the same code runs on plain memory (the tests
run it so). Why: docs/training-loop.md ("Memory").
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .cuda_threads import in_own_thread, registering_device, wait_event
from .errors import CheckpointError

logger = logging.getLogger(__name__)

# cudaHostRegisterPortable: page-locked for every CUDA context, not only the current one.
_REGISTER_PORTABLE = 1

_fallback_logged = False


def register_host(ptr: int, nbytes: int, device: torch.device | int | None = None) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for CUDA.

    Args:
        ptr, nbytes: the memory.
        device: the device it is for (see :func:`registering_device`).

    Raises:
        CheckpointError: CUDA refused (it says why, by its error code).
    """
    index = registering_device(device)
    rc = in_own_thread(
        lambda: int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE)), index
    )
    if rc != 0:
        raise CheckpointError(
            f"cannot page-lock {nbytes} bytes of host memory (device {index}): cudaHostRegister error {rc}"
        )


def unregister_host(ptr: int, device: torch.device | int | None = None) -> None:
    """Undo :func:`register_host`. An error is logged and ignored: the memory is freed right
    after, and a slab collected at the interpreter's exit may find CUDA already gone."""
    try:
        rc = in_own_thread(
            lambda: int(torch.cuda.cudart().cudaHostUnregister(ptr)), registering_device(device)
        )
    except Exception as exc:  # noqa: BLE001 - nothing to undo; the memory goes anyway
        logger.debug("cudaHostUnregister of %#x failed: %s", ptr, exc)
        return
    if rc != 0:
        logger.debug("cudaHostUnregister of %#x: error %d", ptr, rc)


def can_register() -> bool:
    """Whether host memory can be page-locked here (CUDA is there)."""
    return torch.cuda.is_available()


def _pinned_by_torch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned_empty(
    shape: int | tuple[int, ...], dtype: torch.dtype, *, refused: str | None = None
) -> tuple[torch.Tensor, bool]:
    """An uninitialized host tensor from torch's pinned allocator, or a pageable one where
    that fails: copies to and from it then block the thread that queues them, with the same
    bytes. The first fallback of a process is logged at WARNING, later ones at DEBUG.

    Args:
        shape, dtype: the tensor's.
        refused: why a registration was refused, when this replaces a registered slab
            (then a success is logged too).

    Returns:
        The tensor, and whether it is page-locked.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        tensor, pinned = _pinned_by_torch(shape, dtype), True
        how = f"{nbytes} bytes taken from torch's pinned allocator instead"
    except RuntimeError as exc:
        tensor, pinned = torch.empty(shape, dtype=dtype), False
        how = f"{nbytes} bytes left pageable (torch's pinned allocator failed: {exc}); copies will block"
    if refused is not None or not pinned:
        _log_fallback(f"{refused}; {how}" if refused is not None else how)
    return tensor, pinned


def _log_fallback(message: str) -> None:
    global _fallback_logged
    # Once at WARNING (what a run needs to know), then at DEBUG: a ring is made per load.
    level = logging.DEBUG if _fallback_logged else logging.WARNING
    _fallback_logged = True
    logger.log(level, "%s", message)


class HostSlab:
    """One host allocation of ``nbytes``, page-locked for CUDA when ``register``.

    ``tensor`` is the ``uint8`` view of it; :meth:`close` (or the slab's collection)
    unregisters it, and the memory goes back to the system with the tensor. Where CUDA
    refuses the registration, the slab is logged and taken from torch's pinned allocator
    instead, or, if that fails too, left pageable: device copies from and to it then block
    the thread that queues them, and give the same bytes.

    Args:
        nbytes: the size, exactly (no rounding).
        register: page-lock it (``None``: where CUDA is available).
        device: the device its copies go to or come from (the context that registers it).

    Attributes:
        registered: registered by this slab (unregistered by :meth:`close`).
        pinned: page-locked, by this slab or torch's pinned allocator.
    """

    def __init__(
        self, nbytes: int, *, register: bool | None = None, device: torch.device | int | None = None
    ) -> None:
        if nbytes < 0:
            raise CheckpointError(f"a host slab cannot have {nbytes} bytes")
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)
        self.registered = False
        self.pinned = False
        if (can_register() if register is None else register) and nbytes:
            try:
                register_host(self.tensor.data_ptr(), nbytes, device)
            except CheckpointError as exc:
                self.tensor, self.pinned = pinned_empty(nbytes, torch.uint8, refused=str(exc))
            else:
                self.registered = self.pinned = True
                self._finalizer = weakref.finalize(self, unregister_host, self.tensor.data_ptr(), device)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        """Unregister now (the caller drops its views; then the memory is freed)."""
        if self.registered:
            self.registered = False
            self._finalizer()


class PinnedRing:
    """A fixed number of slots carved from one :class:`HostSlab`, through which host bytes
    are copied to a device chunk by chunk.

    A slot is filled on the host, copied to the device without blocking, and refilled only
    after the event recorded behind that copy has fired; so at most ``slots * slot_bytes``
    bytes are pinned whatever the size of what goes through. Thread-safe: several readers
    may upload at once, each holding one slot at a time.

    Args:
        slots: how many slots (2: one filled while the other is copied).
        slot_bytes: the size of each.
        register: page-lock the slab (``None``: where CUDA is available).
        device: the device the slots are copied to (the context that registers the slab).
        event: makes the event recorded after a slot's copy (``None``: a CUDA event for a
            CUDA destination, none otherwise, where the copy is done when it returns).
    """

    def __init__(
        self,
        slots: int = 2,
        slot_bytes: int = 8 << 20,
        *,
        register: bool | None = None,
        device: torch.device | int | None = None,
        event: Callable[[], Any] | None = None,
    ) -> None:
        if slots < 1 or slot_bytes < 1:
            raise CheckpointError(f"a ring needs at least one slot of one byte, got {slots} x {slot_bytes}")
        self.slab = HostSlab(slots * slot_bytes, register=register, device=device)
        self.slot_bytes = slot_bytes
        self._views = [self.slab.tensor[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
        self._pending: list[Any] = [None] * slots  # the event behind each slot's last copy
        self._free = list(range(slots))
        self._cond = threading.Condition()
        self._event = event
        self.in_use_peak = 0  # most slots held at once (tests, logs)

    @property
    def slots(self) -> int:
        return len(self._views)

    def upload(self, dest: torch.Tensor, fill: Callable[[torch.Tensor, int], None]) -> torch.Tensor:
        """Copy into ``dest`` (a contiguous tensor, typically on a device) the bytes that
        ``fill(view, offset)`` writes into ``view`` (a slot's ``uint8`` view, as many bytes
        as go at that byte offset of ``dest``), in order, one slot at a time.

        Returns:
            ``dest``; its copies are queued on the current stream (a kernel queued after
            reads them in order).
        """
        out = dest.reshape(-1).view(torch.uint8)
        for offset in range(0, out.numel(), self.slot_bytes):
            n = min(self.slot_bytes, out.numel() - offset)
            slot = self._acquire()
            try:
                view = self._views[slot][:n]
                fill(view, offset)
                out[offset : offset + n].copy_(view, non_blocking=out.device.type != "cpu")
                event = self._record(out.device)
            except BaseException:
                self._release(slot, None)
                raise
            self._release(slot, event)
        return dest

    def close(self) -> None:
        """Wait for the copies still reading the slots, then unpin the slab."""
        for event in self._pending:
            if event is not None:
                wait_event(event)
        self.slab.close()

    def _acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            slot = self._free.pop(0)
            self.in_use_peak = max(self.in_use_peak, self.slots - len(self._free))
            event, self._pending[slot] = self._pending[slot], None
        if event is not None:
            wait_event(event)  # the device has read the slot's last bytes
        return slot

    def _release(self, slot: int, event: Any) -> None:
        with self._cond:
            self._pending[slot] = event
            self._free.append(slot)
            self._cond.notify()

    def _record(self, device: torch.device) -> Any:
        if self._event is not None:
            event = self._event()
        elif device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            return event
        else:
            return None
        event.record()
        return event


__all__ = ["HostSlab", "PinnedRing", "can_register", "pinned_empty", "register_host", "unregister_host"]
