"""The ring of pinned slots a read to a device streams through, and :func:`one_ring`, which
lets the reads of one load share a ring instead of making one per file.

Making a ring page-locks its slab (``cudaHostRegister``, a cost that grows with its size)
and closing it unlocks it; a load that reads several files (a delta chain, a file a link;
the DCP reader, a rank file each) pays that once inside :func:`one_ring`. Why the sizes:
docs/training-loop.md ("Pinned host memory").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from ..parallel import cpu_threads
from ..pinned_memory import PinnedRing
from .buffer_io import POSITIONAL_READS

# One slot per reading thread, which holds its slot while it reads or decodes a piece into
# it, and RING_SPARE_SLOTS more whose copies to the device may still be in flight.
RING_SLOT_BYTES = 4 << 20
RING_SPARE_SLOTS = 2


def ring_slots() -> int:
    """How many slots a ring has: the reading threads plus the spares."""
    return (cpu_threads() if POSITIONAL_READS else 1) + RING_SPARE_SLOTS


def new_ring(device: torch.device | None = None) -> PinnedRing:
    """A ring of :func:`ring_slots` slots of :data:`RING_SLOT_BYTES` for copies to ``device``."""
    return PinnedRing(ring_slots(), RING_SLOT_BYTES, device=device)


class _Shared:
    """The ring of one :func:`one_ring` block, made at the first read that needs it."""

    def __init__(self) -> None:
        self.ring: PinnedRing | None = None
        self._lock = threading.Lock()

    def get(self, device: torch.device | None) -> PinnedRing:
        with self._lock:
            if self.ring is None:
                self.ring = new_ring(device)
            return self.ring


_SHARED: ContextVar[_Shared | None] = ContextVar("tw_triton_shared_ring", default=None)


@contextlib.contextmanager
def one_ring() -> Iterator[None]:
    """Within this block, the reads to a device (on this thread, or in a context copied from
    it) stream through one ring, made at the first of them and closed when the block ends
    (after the copies still reading its slots). A block inside another uses the outer one's
    ring; a block with no read to a device pins nothing."""
    if _SHARED.get() is not None:
        yield
        return
    shared = _Shared()
    token = _SHARED.set(shared)
    try:
        yield
    finally:
        _SHARED.reset(token)
        if shared.ring is not None:
            shared.ring.close()


def ring_for_read(device: torch.device | None = None) -> tuple[PinnedRing, bool]:
    """The ring for one file read to ``device``, and whether that read owns it (closes it
    when it ends): the enclosing :func:`one_ring` block's, or a new one."""
    shared = _SHARED.get()
    if shared is None:
        return new_ring(device), True
    return shared.get(device), False


__all__ = ["RING_SLOT_BYTES", "RING_SPARE_SLOTS", "new_ring", "one_ring", "ring_for_read", "ring_slots"]
