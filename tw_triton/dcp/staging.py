"""How a rank's encoded DCP buffers reach the host: pinned memory and one event per device.

The encoded buffers of a save are copied to the host the way the Checkpointer's writer
does it (:class:`~tw_triton.pinned_staging.DeviceStaging`): non-blocking copies into one
pinned buffer, on a side stream ordered after the encode, and one event per device that
the write waits on. CPU buffers are written as they are. See docs/distributed.md.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ..cuda_threads import wait_event
from ..pinned_staging import DeviceStaging
from ..qstate import QuantizedState

_shared: DeviceStaging | None = None
_lock = threading.Lock()
_stage_lock = threading.Lock()

# Devices with pinned staging (CUDA), none to copy (the CPU), or no bytes at all (meta,
# which the staging refuses by name); any other device's buffers are copied plainly.
_STAGED_TYPES = ("cpu", "cuda", "meta")


def shared_staging() -> DeviceStaging:
    """The process's staging for DCP saves: one pool, so that successive writers reuse its
    pinned buffers (at most the largest save's encoded bytes per save in flight)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = DeviceStaging(None)
        return _shared


@dataclass
class HostCopy:
    """A save's encoded state on its way to the host; :meth:`wait` before reading it."""

    qstate: QuantizedState  # its buffers: host tensors (pinned views once the copy is done)
    device_state: QuantizedState | None = None  # keeps the device buffers alive until copied
    copy_done: list = field(default_factory=list)
    pinned: torch.Tensor | None = None
    staging: DeviceStaging | None = None

    def wait(self) -> QuantizedState:
        """Block until the device-to-host copies are done; return the host state."""
        for event in self.copy_done:
            wait_event(event)
        self.copy_done = []
        self.device_state = None
        return self.qstate

    def release(self) -> None:
        """Give the pinned buffer back (after the write; waits for the copies first)."""
        self.wait()
        if self.pinned is not None and self.staging is not None:
            self.staging.pool.release(self.pinned)
        self.pinned = None


def start_host_copy(qstate: QuantizedState, staging: DeviceStaging, where: str) -> HostCopy:
    """Enqueue the copies of ``qstate``'s device buffers into pinned host memory.

    Args:
        qstate: the encoded state; its buffers must not change until :meth:`HostCopy.wait`.
        staging: the pinned pool and side streams (:func:`shared_staging` by default).
        where: names the save in errors and logs.

    Raises:
        CheckpointError: more pinned bytes than the staging's cap.
    """
    for entry in qstate.entries.values():
        if any(b.device.type not in _STAGED_TYPES for b in entry.buffers.values()):
            entry.buffers = {
                k: v if v.device.type in _STAGED_TYPES else v.to("cpu") for k, v in entry.buffers.items()
            }
    with _stage_lock:  # the staging's side streams are created on first use, by one thread
        staged = staging.stage(qstate, where)
    if staged is None:
        return HostCopy(qstate)
    return HostCopy(staged.qstate, qstate, list(staged.copy_done), staged.pinned, staging)


__all__ = ["HostCopy", "shared_staging", "start_host_copy"]
