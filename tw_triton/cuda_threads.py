"""CUDA runtime calls that do not depend on the calling thread's current device.

A thread that never chose a device has device 0 current, and a runtime call there that needs
a context (``cudaEventSynchronize``, ``cudaHostRegister``) makes one on device 0: hundreds of
MiB on a GPU that a rank of a multi-GPU job may not otherwise touch. The writer and reading
threads are such threads, and so is a training thread that moved its model to ``cuda:3``
without ``torch.cuda.set_device``. Why: docs/design.md (invariant 10).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def registering_device(device: torch.device | int | None = None) -> int:
    """The CUDA device whose context (un)registers host memory: a portable registration
    serves every context, so any will do, as long as none is made for it.

    Args:
        device: the device the memory is for (its index is taken when it has one).

    Returns:
        ``device``'s index; else the current device if it has a context, else the first
        device with one, else the current device.
    """
    if isinstance(device, int):
        return device
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    current = torch.cuda.current_device()
    if _has_context(current):
        return current
    for index in range(torch.cuda.device_count()):
        if _has_context(index):
            return index
    return current


def _has_context(index: int) -> bool:
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(has(index)) if has is not None else False


def in_own_thread(fn: Callable[[], int], device: int | None = None) -> int:
    """Run one CUDA runtime call in a thread of its own, with ``device`` made current there
    first (``None``: none), and return its error code.

    A failed runtime call stays recorded as its thread's last error, and torch's next kernel
    launch on that thread would raise it as its own; in a thread that then ends, it goes
    with the thread."""
    box: list[Any] = []

    def run() -> None:
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box.append(fn())
        except BaseException as exc:  # handed to the caller
            box.append(exc)

    try:
        thread = threading.Thread(target=run, name="tw-triton-cuda-call", daemon=True)
        thread.start()
    except RuntimeError:  # no new threads (the interpreter is shutting down): call here
        run()
    else:
        thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def wait_event(event: Any) -> None:
    """Block until a recorded CUDA event has fired, with its device current (torch's
    ``Event.synchronize`` uses whichever device the thread has current)."""
    device = getattr(event, "device", None)
    if device is None or getattr(device, "type", None) != "cuda":
        event.synchronize()
        return
    with torch.cuda.device(device):
        event.synchronize()


__all__ = ["in_own_thread", "registering_device", "wait_event"]
