"""Pinned host memory: registered slabs instead of the caching host allocator, and the
bounded ring a load to a device streams through.

Without a GPU, registration is replaced by spies and the ring runs on plain memory with a
CPU destination (the same code; only the copies are synchronous)."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import format as fmt
from tw_triton import pinned_memory
from tw_triton.errors import CheckpointError
from tw_triton.format.reader import MappedCheckpoint
from tw_triton.pinned_memory import HostSlab, PinnedRing
from tw_triton.pinned_staging import PINNED_GRANULE, PinnedPool


class _Events:
    """An event factory that logs record and synchronize, by event number."""

    def __init__(self):
        self.log: list[tuple[str, int]] = []
        self.count = 0

    def __call__(self):
        n = self.count
        self.count += 1
        log = self.log

        class Event:
            def record(self, stream=None):
                log.append(("record", n))

            def synchronize(self):
                log.append(("sync", n))

        return Event()


@settings(max_examples=30, deadline=None)
@given(nbytes=st.integers(0, 700), slots=st.integers(1, 3), slot_bytes=st.integers(1, 100))
def test_the_ring_copies_everything_in_order_through_its_slots_only(nbytes, slots, slot_bytes):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    events = _Events()
    ring = PinnedRing(slots, slot_bytes, register=False, event=events)
    seen = []
    base = ring.slab.tensor.data_ptr()

    def fill(view, at):
        # Every chunk lands in the one slab, in a slot of its own size at most.
        assert base <= view.data_ptr() < base + slots * slot_bytes and view.numel() <= slot_bytes
        seen.append((at, view.data_ptr()))
        view.copy_(src[at : at + view.numel()])

    out = ring.upload(torch.empty(nbytes, dtype=torch.uint8), fill)
    assert torch.equal(out, src)
    assert [at for at, _ in seen] == list(range(0, nbytes, slot_bytes))
    assert ring.slab.nbytes == slots * slot_bytes and ring.in_use_peak <= 1
    # A slot is filled again only after the event behind its last copy has fired.
    chunks = len(seen)
    assert [e for e in events.log if e[0] == "record"] == [("record", k) for k in range(chunks)]
    for k in range(chunks):
        reuse = [j for j in range(k) if seen[j][1] == seen[k][1]]
        if reuse:
            assert events.log.index(("sync", reuse[-1])) < events.log.index(("record", k))
    ring.close()


def test_the_ring_bounds_the_slots_held_by_concurrent_readers():
    ring = PinnedRing(2, 16, register=False, event=_Events())
    held, peak, lock = [0], [0], threading.Lock()
    srcs = [torch.arange(200, dtype=torch.int32) * (k + 1) for k in range(6)]
    outs = [None] * len(srcs)

    def reader(k):
        flat = srcs[k].view(torch.uint8)

        def fill(view, at):
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            view.copy_(flat[at : at + view.numel()])
            with lock:
                held[0] -= 1

        outs[k] = ring.upload(torch.empty_like(srcs[k]), fill)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(len(srcs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(outs, srcs))
    assert peak[0] <= 2 and ring.in_use_peak <= 2


def test_a_failing_fill_gives_its_slot_back():
    ring = PinnedRing(1, 8, register=False)

    def fill(view, at):
        raise CheckpointError("boom")

    with pytest.raises(CheckpointError):
        ring.upload(torch.empty(20, dtype=torch.uint8), fill)
    assert torch.equal(
        ring.upload(torch.empty(3, dtype=torch.uint8), lambda v, at: v.fill_(7)), torch.full((3,), 7)
    )


@pytest.fixture
def registry(monkeypatch):
    """Registration spies: {ptr: nbytes} registered now, and every call."""
    live: dict[int, int] = {}
    calls: list = []

    def register(ptr, nbytes, device=None):
        calls.append(("register", ptr, nbytes, device))
        live[ptr] = nbytes

    def unregister(ptr, device=None):
        calls.append(("unregister", ptr, device))
        del live[ptr]

    monkeypatch.setattr(pinned_memory, "register_host", register)
    monkeypatch.setattr(pinned_memory, "unregister_host", unregister)
    monkeypatch.setattr(pinned_memory, "can_register", lambda: True)
    return live, calls


def test_a_slab_registers_exactly_its_size_and_unregisters_once(registry):
    live, calls = registry
    slab = HostSlab(1000)
    assert live == {slab.tensor.data_ptr(): 1000}
    slab.close()
    slab.close()
    assert live == {} and [c[0] for c in calls] == ["register", "unregister"]
    gone = HostSlab(3000)
    ptr = gone.tensor.data_ptr()
    del gone  # collected: unregistered too
    assert ptr not in live


def test_the_staging_pool_pins_registered_slabs_and_lets_dropped_ones_go(registry):
    live, _ = registry
    pool = PinnedPool(None)
    small, _ = pool.acquire(1000)
    # Registered, at the pool's granule (not the caching allocator's power of two).
    assert live == {small.data_ptr(): PINNED_GRANULE}
    pool.release(small)
    big, _ = pool.acquire(3 * PINNED_GRANULE + 1)
    # The too-small buffer is unregistered (and freed), not kept by an allocator.
    assert live == {big.data_ptr(): 4 * PINNED_GRANULE} and pool.held_bytes == 4 * PINNED_GRANULE


def test_slabs_register_and_unregister_with_the_device_of_their_copies(registry):
    _, calls = registry
    slab = HostSlab(1000, device=torch.device("cuda", 1))
    slab.close()
    assert [(c[0], c[-1]) for c in calls] == [
        ("register", torch.device("cuda", 1)),
        ("unregister", torch.device("cuda", 1)),
    ]
    calls.clear()
    pool = PinnedPool(None)
    pool.acquire(10, torch.device("cuda", 2))
    ring = PinnedRing(2, 8, device=torch.device("cuda", 3))
    assert [c[-1] for c in calls] == [torch.device("cuda", 2), torch.device("cuda", 3)]
    ring.close()


class _Runtime:
    """A stand-in for torch's CUDA runtime binding: logs each call with its thread."""

    def __init__(self, rc=0):
        self.rc = rc
        self.log: list = []

    def set_device(self, index):
        self.log.append(("set_device", threading.get_ident(), index))

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.log.append(("register", threading.get_ident(), ptr, nbytes, flags))
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.log.append(("unregister", threading.get_ident(), ptr))
        return self.rc


@pytest.mark.parametrize("rc", [0, 712])
def test_registration_runs_on_its_device_in_a_thread_that_then_ends(monkeypatch, rc):
    """A refused registration stays the thread's last CUDA error, which torch's next kernel
    launch there would raise as its own: each call runs in a thread of its own, after making
    its device current there."""
    runtime = _Runtime(rc)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "set_device", runtime.set_device)
    me = threading.get_ident()
    if rc:
        with pytest.raises(CheckpointError, match=r"100 bytes .*device 2.*cudaHostRegister error 712"):
            pinned_memory.register_host(4096, 100, torch.device("cuda", 2))
    else:
        pinned_memory.register_host(4096, 100, torch.device("cuda", 2))
    pinned_memory.unregister_host(4096, 2)  # an error here is ignored
    (set1, t1, i1), reg, (set2, t2, i2), unreg = runtime.log
    assert (set1, i1, reg[0], reg[2:]) == ("set_device", 2, "register", (4096, 100, 1))
    assert (set2, i2, unreg[0], unreg[2]) == ("set_device", 2, "unregister", 4096)
    assert t1 == reg[1] != me and t2 == unreg[1] != me


@pytest.mark.parametrize("torch_pins", [True, False])
def test_a_refused_registration_falls_back_logs_and_the_slab_still_works(monkeypatch, caplog, torch_pins):
    """Where CUDA refuses to page-lock a slab, it comes from torch's pinned allocator, or
    stays pageable when that fails too (copies then block, with the same bytes); the first
    such slab is a warning, later ones are logged at DEBUG."""

    def refuse(ptr, nbytes, device=None):
        raise CheckpointError(
            f"cannot page-lock {nbytes} bytes of host memory (device 0): cudaHostRegister error 801"
        )

    def unregister(ptr, device=None):
        raise AssertionError("a slab that was not registered is unregistered")

    pinned_by_torch: list = []

    def by_torch(shape, dtype):
        if not torch_pins:
            raise RuntimeError("no pinned memory allocator")
        pinned_by_torch.append(torch.empty(shape, dtype=dtype))
        return pinned_by_torch[-1]

    monkeypatch.setattr(pinned_memory, "can_register", lambda: True)
    monkeypatch.setattr(pinned_memory, "register_host", refuse)
    monkeypatch.setattr(pinned_memory, "unregister_host", unregister)
    monkeypatch.setattr(pinned_memory, "_pinned_by_torch", by_torch)
    monkeypatch.setattr(pinned_memory, "_fallback_logged", False)
    with caplog.at_level("DEBUG", logger="tw_triton.pinned_memory"):
        ring = PinnedRing(2, 8)
        second = HostSlab(64)
    assert not ring.slab.registered and ring.slab.pinned == torch_pins
    if torch_pins:
        assert ring.slab.tensor is pinned_by_torch[0] and second.tensor is pinned_by_torch[1]
    levels = [(r.levelname, "error 801" in r.getMessage()) for r in caplog.records]
    assert levels == [("WARNING", True), ("DEBUG", True)]
    assert ("torch's pinned allocator instead" if torch_pins else "left pageable") in caplog.records[
        0
    ].getMessage()
    src = torch.arange(40, dtype=torch.uint8)
    out = ring.upload(torch.empty(40, dtype=torch.uint8), lambda v, at: v.copy_(src[at : at + v.numel()]))
    assert torch.equal(out, src)
    ring.close()
    second.close()


def _file(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g).bfloat16()},
        "optimizer": {"m": torch.randn(300, 70, generator=g), "step": torch.tensor(4)},
    }
    q = tw_triton.quantize_state_dict(state, rules="smallest")
    path = tmp_path / "a.tw.safetensors"
    fmt.write_file(q, path, fsync=False)
    return path


@pytest.mark.parametrize("entropy", ["auto", "none"])
def test_a_read_to_a_device_through_the_ring_gives_the_same_buffers(tmp_path, monkeypatch, entropy):
    path = _file(tmp_path)
    if entropy == "none":
        fmt.write_file(fmt.read_file(path), path, fsync=False, entropy=None)
    monkeypatch.setattr(fmt.upload_ring, "RING_SLOT_BYTES", 4096)  # many pieces per buffer
    monkeypatch.setenv("TW_TRITON_THREADS", "3")
    want = fmt.read_file(path)
    with MappedCheckpoint(path, verify=True, pin=False, entries=None, device=torch.device("cpu")) as ck:
        # A slot for each of the 3 reading threads, and the spares.
        assert fmt.upload_ring.ring_slots() == 3 + fmt.upload_ring.RING_SPARE_SLOTS
        assert ck.ring is not None and ck.ring.slab.nbytes == fmt.upload_ring.ring_slots() * 4096
        got = dict(
            zip(
                [(s.entry, s.name) for s in ck.layout.buffers],
                tw_triton.parallel.parallel_map(ck.read_buffer, ck.layout.buffers, threads=3),
            )
        )
        assert ck.ring.in_use_peak <= 3
    for (entry, name), t in got.items():
        assert torch.equal(t, want.entries[entry].buffers[name]), (entry, name)


def test_a_compressed_buffer_goes_to_the_device_a_slot_at_a_time(tmp_path, monkeypatch):
    """A load to a device never holds a compressed buffer's decoded bytes on the host: each
    piece is decoded straight into a pinned slot. The whole-buffer decodes are made to fail,
    and every buffer streams (no one-shot frames)."""
    g = torch.Generator().manual_seed(1)
    # Floats get zstd-planes, the codes zstd: both stages that stream.
    state = {
        "w": torch.randn(256, 1024, generator=g) * 1e-3,
        "c": torch.randint(0, 3, (1 << 18,), generator=g).to(torch.uint8),
    }
    path = tmp_path / "s.tw.safetensors"
    fmt.write_file(tw_triton.quantize_state_dict(state, rules="exact"), path, fsync=False)
    want = fmt.read_file(path)
    monkeypatch.setattr(fmt.upload_ring, "RING_SLOT_BYTES", 4096 + 3)  # pieces that split elements
    monkeypatch.setattr(tw_triton.codecs.entropy.zstd, "ONE_SHOT_MAX_BYTES", 0)
    uploads = []  # bytes of each buffer sent through the ring

    def no_whole_decode(*args, **kwargs):
        raise AssertionError("a whole buffer decoded on the host")

    for stage in ("zstd", "zstd-planes"):
        monkeypatch.setattr(type(tw_triton.codecs.entropy.get_stage(stage)), "decode", no_whole_decode)
    monkeypatch.setattr(fmt.reader, "decode_staged", no_whole_decode)
    real_upload = PinnedRing.upload

    def upload(self, dest, fill_slot):
        uploads.append(dest.nbytes)
        return real_upload(self, dest, fill_slot)

    monkeypatch.setattr(PinnedRing, "upload", upload)
    with MappedCheckpoint(path, verify=True, pin=False, entries=None, device=torch.device("cpu")) as ck:
        staged = [s for s in ck.layout.buffers if s.stage is not None]
        assert {s.stage.name for s in staged} == {"zstd", "zstd-planes"}
        got = {(s.entry, s.name): ck.read_buffer(s) for s in staged}
    assert len(uploads) == len(staged) and min(uploads) > 4096 * 4  # several slots each
    for (entry, name), t in got.items():
        assert torch.equal(t, want.entries[entry].buffers[name]), (entry, name)


def test_a_corrupted_buffer_read_through_the_ring_is_refused(tmp_path):
    path = _file(tmp_path)
    fmt.write_file(fmt.read_file(path), path, fsync=False, entropy=None)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        with MappedCheckpoint(path, verify=True, pin=False, entries=None, device=torch.device("cpu")) as ck:
            for s in ck.layout.buffers:
                ck.read_buffer(s)


def test_a_read_to_cuda_uploads_on_the_callers_device_and_stream(tmp_path, monkeypatch):
    """The uploads run on worker threads, whose current CUDA device and stream are their
    own (device 0, its default stream): read_file fixes the caller's. Without that, a rank
    on cuda:3 loading to "cuda" put its buffers on cuda:0, and a caller inside a stream
    context had its decode kernels race the uploads. CUDA is faked: its current device
    and stream, and a MappedCheckpoint that records what it was given."""
    path = _file(tmp_path)
    seen = {}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))

    class Given(Exception):
        pass

    def recording(*args, **kwargs):
        seen.update(kwargs)
        raise Given

    monkeypatch.setattr(fmt.reader, "MappedCheckpoint", recording)
    with pytest.raises(Given):
        fmt.read_file(path, device="cuda")
    assert seen["device"] == torch.device("cuda", 3)
    assert seen["stream"] == ("stream of", torch.device("cuda", 3))
    with pytest.raises(Given):
        fmt.read_file(path, device="cuda:1")
    assert seen["device"] == torch.device("cuda", 1)
    assert seen["stream"] == ("stream of", torch.device("cuda", 1))


def test_the_ring_uploads_run_on_the_stream_given(tmp_path, monkeypatch):
    """Every upload of a MappedCheckpoint runs inside ``torch.cuda.stream`` of the stream it
    was given, on whatever thread reads it (faked: a recorder stands for the context)."""
    path = _file(tmp_path)
    want = fmt.read_file(path)
    entered = []
    inside = threading.local()

    class Context:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            entered.append(self.stream)
            inside.on = True

        def __exit__(self, *exc):
            inside.on = False

    monkeypatch.setattr(torch.cuda, "stream", Context)
    real_upload = fmt.reader.upload_raw

    def upload_raw(*args, **kwargs):
        assert getattr(inside, "on", False), "an upload outside the caller's stream"
        return real_upload(*args, **kwargs)

    monkeypatch.setattr(fmt.reader, "upload_raw", upload_raw)
    real_staged = fmt.reader.upload_staged

    def upload_staged(*args, **kwargs):
        assert getattr(inside, "on", False), "an upload outside the caller's stream"
        return real_staged(*args, **kwargs)

    monkeypatch.setattr(fmt.reader, "upload_staged", upload_staged)
    cpu = torch.device("cpu")
    with MappedCheckpoint(path, verify=True, pin=False, entries=None, device=cpu, stream="S") as ck:
        got = tw_triton.parallel.parallel_map(ck.read_buffer, ck.layout.buffers, threads=4)
    assert entered == ["S"] * len(ck.layout.buffers)
    for s, t in zip(ck.layout.buffers, got):
        assert torch.equal(t, want.entries[s.entry].buffers[s.name])


@pytest.mark.cuda
def test_on_a_gpu_slabs_are_pinned_and_a_read_to_the_device_is_the_same(tmp_path):
    slab = HostSlab(3 << 20)
    assert slab.registered and slab.tensor.is_pinned()
    slab.close()
    path = _file(tmp_path)
    want = fmt.read_file(path)
    got = fmt.read_file(path, device="cuda")
    for name, entry in want.entries.items():
        for b, t in entry.buffers.items():
            assert got.entries[name].buffers[b].is_cuda
            assert torch.equal(got.entries[name].buffers[b].cpu(), t), (name, b)


@pytest.mark.cuda
def test_on_a_gpu_a_refused_registration_leaves_no_error_for_the_next_launch():
    """Registering memory twice is refused (cudaErrorHostMemoryAlreadyRegistered); the
    error goes with the registering thread, so this thread's next kernel launch, which
    checks the runtime's last error, runs."""
    slab = HostSlab(1 << 20)
    assert slab.registered and slab.tensor.is_pinned()
    with pytest.raises(CheckpointError, match="cudaHostRegister error"):
        pinned_memory.register_host(slab.tensor.data_ptr(), 1 << 20)
    x = torch.ones(1 << 10, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    assert float(x.sum()) == 2 * (1 << 10)
    slab.close()


def test_an_unregistration_that_fails_is_logged_not_raised(monkeypatch, caplog):
    """A slab collected at the interpreter's exit may find CUDA gone: nothing to undo."""

    def gone(index):
        raise RuntimeError("CUDA driver is shutting down")

    monkeypatch.setattr(torch.cuda, "set_device", gone)
    with caplog.at_level("DEBUG", logger="tw_triton.pinned_memory"):
        pinned_memory.unregister_host(4096, 0)
    assert "shutting down" in caplog.text


def test_pinned_empty_falls_back_to_pageable_memory_and_says_so(monkeypatch, caplog):
    """The small pinned buffers of a save's fingerprint reads come from torch's pinned
    allocator; where it fails, the read still works, on pageable memory, logged once."""
    monkeypatch.setattr(pinned_memory, "_fallback_logged", False)
    monkeypatch.setattr(
        pinned_memory, "_pinned_by_torch", lambda shape, dtype: torch.empty(shape, dtype=dtype)
    )
    with caplog.at_level("DEBUG", logger="tw_triton.pinned_memory"):
        t, pinned = pinned_memory.pinned_empty((3, 2), torch.int64)
    assert t.shape == (3, 2) and t.dtype == torch.int64 and pinned and not caplog.records  # nothing to say

    def fails(shape, dtype):
        raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(pinned_memory, "_pinned_by_torch", fails)
    with caplog.at_level("DEBUG", logger="tw_triton.pinned_memory"):
        t, pinned = pinned_memory.pinned_empty(5, torch.float32)
        pinned_memory.pinned_empty(5, torch.float32)
    assert t.shape == (5,) and not pinned
    assert [r.levelname for r in caplog.records] == ["WARNING", "DEBUG"]
    assert "20 bytes left pageable" in caplog.records[0].getMessage() and "out of memory" in caplog.text
