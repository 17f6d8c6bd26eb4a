"""CUDA calls from any thread: the device they run on never depends on the device a
thread happens to have current (device 0 in a thread that never chose one).

Without a GPU, torch's device functions are replaced by spies."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

from tw_triton import cuda_threads


@pytest.fixture
def devices(monkeypatch):
    """Four CUDA devices, device 0 current, and a settable set of those with a context."""
    with_context: set[int] = set()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(cuda_threads, "_has_context", lambda i: i in with_context)
    return with_context


def test_the_registering_device_is_never_one_without_a_context_when_another_has_one(devices):
    # The device named wins, as a device or an index.
    assert cuda_threads.registering_device(torch.device("cuda", 3)) == 3
    assert cuda_threads.registering_device(1) == 1
    # None named: device 0 is current, but only device 2 has a context (a rank on GPU 2 whose
    # thread never chose a device): the runtime would make a context on GPU 0.
    devices.add(2)
    assert cuda_threads.registering_device(None) == 2
    assert cuda_threads.registering_device(torch.device("cuda")) == 2
    devices.add(0)
    assert cuda_threads.registering_device(None) == 0  # the current one, when it has a context
    devices.clear()
    assert cuda_threads.registering_device(None) == 0  # none has one: a context must be made


def test_a_call_that_cannot_have_a_thread_runs_in_the_callers(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    assert cuda_threads.in_own_thread(threading.get_ident) == threading.get_ident()
    with pytest.raises(KeyError):
        cuda_threads.in_own_thread(lambda: {}["x"])


class _Event:
    """A recorded CUDA event's stand-in: logs the device current when it is waited on."""

    def __init__(self, device, log):
        self.device = device
        self.log = log

    def synchronize(self):
        self.log.append(("sync", self.device, _CURRENT[-1]))


_CURRENT = [0]


class _DeviceGuard:
    def __init__(self, device):
        self.index = device.index if isinstance(device, torch.device) else device

    def __enter__(self):
        _CURRENT.append(self.index)

    def __exit__(self, *exc):
        _CURRENT.pop()


def test_an_event_is_waited_on_with_its_device_current(monkeypatch):
    """torch's ``Event.synchronize`` runs on the thread's current device, which the runtime
    would give a context; ``wait_event`` makes the event's device current first."""
    monkeypatch.setattr(torch.cuda, "device", _DeviceGuard)
    log: list = []
    cuda_threads.wait_event(_Event(torch.device("cuda", 3), log))
    assert log == [("sync", torch.device("cuda", 3), 3)] and _CURRENT == [0]

    class Plain:  # a CPU stand-in, or an event never recorded: no device to make current
        device = None

        def synchronize(self):
            log.append(("plain", _CURRENT[-1]))

    cuda_threads.wait_event(Plain())
    assert log[-1] == ("plain", 0)


def _event_waits(source: str) -> list[int]:
    """Lines of ``X.synchronize()`` calls in ``source`` whose ``X`` is not a stream (torch's
    ``Stream.synchronize`` guards its device; ``Event.synchronize`` does not)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "synchronize"
            and not node.args
            and "stream" not in ast.unparse(node.func.value).lower()
        ):
            lines.append(node.lineno)
    return lines


def test_the_library_waits_on_events_only_through_wait_event():
    package = Path(cuda_threads.__file__).parent
    found = [
        f"{path.relative_to(package)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "cuda_threads.py"
        for line in _event_waits(path.read_text())
    ]
    assert not found, f"events waited on with whatever device the thread has current: {found}"
    # The check can fail.
    assert _event_waits("done.synchronize()\nside.stream.synchronize()\nx = 1\n") == [1]


@pytest.mark.cuda
def test_on_a_gpu_an_event_is_waited_on_from_a_thread_that_never_chose_a_device():
    torch.cuda._sleep(50_000_000)  # the event fires well after the wait starts
    done = torch.cuda.Event(blocking=True)
    done.record()
    waited: list = []
    thread = threading.Thread(target=lambda: waited.append(cuda_threads.wait_event(done) or done.query()))
    thread.start()
    thread.join()
    assert waited == [True]
