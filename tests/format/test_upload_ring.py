"""One ring of pinned slots for all the reads of a load (``format.upload_ring.one_ring``).

Making a ring page-locks its slab on a GPU machine; a chain load reads a file per link. A
CPU destination stands for the device here (``MappedCheckpoint`` takes any device; its ring
is then plain memory), and a spy counts the rings made and closed.
"""

from __future__ import annotations

import threading

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.format import upload_ring
from tw_triton.format.reader import MappedCheckpoint
from tw_triton.pinned_memory import PinnedRing


@pytest.fixture
def rings(monkeypatch) -> list:
    """Every ring made, each counting its ``close`` calls."""
    made: list = []

    class Counted(PinnedRing):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.closed = 0
            made.append(self)

        def close(self) -> None:
            self.closed += 1
            super().close()

    monkeypatch.setattr(upload_ring, "PinnedRing", Counted)
    return made


def _files(tmp_path, n: int) -> list:
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(n):
        state = {"w": torch.randn(200, 64, generator=g), "b": torch.randn(64, generator=g)}
        path = tmp_path / f"{i}.tw.safetensors"
        fmt.write_file(tw_triton.quantize_state_dict(state, rules="small"), path, fsync=False)
        paths.append(path)
    return paths


def _read_to_device(path) -> dict:
    with MappedCheckpoint(str(path), verify=True, pin=False, entries=None, device=torch.device("cpu")) as ck:
        return {(s.entry, s.name): ck.read_buffer(s) for s in ck.layout.buffers}


def test_the_reads_of_one_block_share_one_ring_closed_when_it_ends(tmp_path, rings) -> None:
    paths = _files(tmp_path, 3)
    with fmt.one_ring():
        got = [_read_to_device(p) for p in paths]
        with fmt.one_ring():  # a block inside another: the outer one's ring
            got.append(_read_to_device(paths[0]))
        assert len(rings) == 1 and rings[0].closed == 0
    assert rings[0].closed == 1
    # Outside a block each read makes its own ring and closes it.
    alone = [_read_to_device(p) for p in paths]
    assert len(rings) == 4 and [r.closed for r in rings] == [1, 1, 1, 1]
    for shared, own in zip(got, alone + alone[:1]):
        assert shared.keys() == own.keys()
        for key, t in own.items():
            assert torch.equal(shared[key], t), key


def test_a_block_without_a_read_to_a_device_pins_nothing(tmp_path, rings) -> None:
    (path,) = _files(tmp_path, 1)
    with fmt.one_ring():
        fmt.read_file(path)  # to the host: no ring
    assert rings == []


def test_the_ring_is_closed_when_a_read_in_the_block_fails(tmp_path, rings) -> None:
    (path,) = _files(tmp_path, 1)
    with pytest.raises(tw_triton.CheckpointError, match="no entry"):
        with fmt.one_ring():
            _read_to_device(path)
            with MappedCheckpoint(
                str(path), verify=True, pin=False, entries=["nope"], device=torch.device("cpu")
            ):
                pass
    assert len(rings) == 1 and rings[0].closed == 1


def test_another_thread_outside_the_block_makes_its_own_ring(tmp_path, rings) -> None:
    """A block is this thread's (a context variable): a thread started without its context
    does not borrow a ring the block may close under it."""
    (path,) = _files(tmp_path, 1)
    with fmt.one_ring():
        _read_to_device(path)
        worker = threading.Thread(target=_read_to_device, args=(path,))
        worker.start()
        worker.join()
        assert len(rings) == 2 and rings[1].closed == 1 and rings[0].closed == 0
    assert rings[0].closed == 1


def test_a_chain_load_reads_every_link_inside_one_block(tmp_path, monkeypatch) -> None:
    """Checkpointer.load and tw_triton.load read their files (the links verified, then
    decoded) inside one block: to a GPU, one ring for the whole load."""
    scopes: list = []
    real = fmt.read_file

    def read_file(*args, **kwargs):
        scopes.append(upload_ring._SHARED.get())
        return real(*args, **kwargs)

    monkeypatch.setattr(fmt, "read_file", read_file)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g)
    with tw_triton.Checkpointer(tmp_path, keyframe_every=10, async_write=False, fsync=False) as ck:
        for step in range(3):
            ck.save(step, model={"w": w + step / 100})
        ck.load(2)
    assert len(scopes) >= 3 and scopes[0] is not None and all(s is scopes[0] for s in scopes), scopes
    scopes.clear()
    tw_triton.load(
        tmp_path / "step-00000002.tw.safetensors", reference=tmp_path / "step-00000001.tw.safetensors"
    )
    assert scopes and scopes[0] is not None, scopes  # the file's own read
    assert upload_ring._SHARED.get() is None  # the blocks have ended


@pytest.mark.cuda
def test_a_chain_load_to_a_gpu_pins_one_ring(tmp_path, monkeypatch) -> None:
    """A keyframe and two closed-loop deltas loaded to the GPU: one slab registered for
    the whole load (not one per file), unregistered by the end, and the values those of a
    load to the CPU."""
    from tw_triton import pinned_memory

    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g)
    with tw_triton.Checkpointer(tmp_path, keyframe_every=10, fsync=False) as ck:
        for step in range(3):
            ck.save(step, model={"w": w + step / 100})
    registered: list = []
    unregistered: list = []
    real_register, real_unregister = pinned_memory.register_host, pinned_memory.unregister_host

    def register(ptr, nbytes, device=None):
        registered.append((ptr, nbytes, device))
        real_register(ptr, nbytes, device)

    def unregister(ptr, device=None):
        unregistered.append(ptr)
        real_unregister(ptr, device)

    monkeypatch.setattr(pinned_memory, "register_host", register)
    monkeypatch.setattr(pinned_memory, "unregister_host", unregister)
    with tw_triton.Checkpointer(tmp_path, keyframe_every=10, fsync=False) as ck:
        on_gpu = ck.load(2, device="cuda")["model"]["w"]
        on_cpu = ck.load(2)["model"]["w"]
    assert len(registered) == 1 and unregistered == [registered[0][0]], (registered, unregistered)
    assert registered[0][1] == upload_ring.ring_slots() * upload_ring.RING_SLOT_BYTES
    # Registered by the context of the device loaded to, not whichever device is current.
    assert registered[0][2] == torch.device("cuda", torch.cuda.current_device())
    assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
