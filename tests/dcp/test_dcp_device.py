"""DCP on a device, checked without one (issue 29, item 12).

Saving: the encoded buffers reach the host through the pinned staging (one ``stage`` call
for all of a save's buffers, one event the write waits on), never by a copy per buffer.
"meta" stands in for the GPU: the encoded buffers are moved there, so a plain per-buffer
``.to("cpu")`` would raise, and a fake staging hands the writer their real bytes.

Loading: every chunk is decoded on its target's device (encoded bytes to the device, not
decoded values), the keyframe regions of delta chunks too. A planner gives "meta" targets,
and a spy on the decode sees which device the reader asks for.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

import tw_triton.dcp as tw_dcp
import tw_triton.dcp.keyframe as dcp_keyframe
import tw_triton.dcp.reader as dcp_reader
import tw_triton.dcp.writer as dcp_writer
from tw_triton.dcp import Keyframe, StorageReader, StorageWriter
from tw_triton.pinned_staging import Staged
from tw_triton.qstate import EncodedEntry

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(shift: float = 0.0) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(96, 64, generator=g) + shift, "b": torch.randn(96, generator=g)},
        "optim": {"m": torch.randn(80, 64, generator=g), "v": torch.rand(80, 64, generator=g) + 0.1},
        "extra": {"lr": 0.1},
    }


def _zeros_like(state: dict) -> dict:
    out = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in state.items() if k != "extra"}
    out["extra"] = {"lr": 0.0}
    return out


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    return {f"{k}.{n}": t for k, v in state.items() if k != "extra" for n, t in v.items()}


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.handle = threading.Lock()  # a CUDA event does not pickle either

    def synchronize(self) -> None:
        self.log.append("sync")


class _Pool:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def release(self, buf: torch.Tensor) -> None:
        self.log.append("release")


class FakeStaging:
    """Stands in for :class:`DeviceStaging` on "meta" buffers: their real bytes are in
    ``host`` (filled by the patched encode), as a pinned copy's would be once done."""

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.pool = _Pool(log)
        self.lock = threading.Lock()  # nor does the real one (its pool's condition)
        self.host: dict[int, torch.Tensor] = {}
        self.staged_buffers: list[int] = []

    def stage(self, qstate, path):
        self.log.append("stage")
        entries = {}
        for name, e in qstate.entries.items():
            assert all(b.device.type == "meta" for b in e.buffers.values()), name
            self.staged_buffers.append(len(e.buffers))
            bufs = {b: self.host[id(t)] for b, t in e.buffers.items()}
            entries[name] = EncodedEntry(e.codec, e.params, e.shape, e.dtype, bufs)
        return Staged(dataclasses.replace(qstate, entries=entries), [_Event(self.log)], torch.empty(0))


@pytest.fixture
def plain(tmp_path) -> dict:
    """What a load of the same state saved without any patch gives."""
    path = str(tmp_path / "plain")
    dcp.save(_state(), storage_writer=StorageWriter(path, rules="small"), no_dist=True)
    want = _zeros_like(_state())
    tw_dcp.load(want, path, no_dist=True)
    return want


@pytest.fixture
def on_meta(monkeypatch):
    """The encode's buffers moved to "meta", a staging that hands over their bytes, and a
    log of stage / sync / write / release."""
    log: list[str] = []
    staging = FakeStaging(log)
    real_encode, real_write = dcp_writer.encode_chunks, dcp_writer.write_file

    def encode_to_meta(*args, **kwargs):
        qstate = real_encode(*args, **kwargs)
        for e in qstate.entries.values():
            moved = {b: t.to("meta") for b, t in e.buffers.items()}
            staging.host.update({id(moved[b]): t for b, t in e.buffers.items()})
            e.buffers = moved
        return qstate

    def write(*args, **kwargs):
        log.append("write")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(dcp_writer, "encode_chunks", encode_to_meta)
    monkeypatch.setattr(dcp_writer, "write_file", write)
    return staging, log


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_a_save_stages_all_device_buffers_at_once_and_writes_after_the_copy(plain, on_meta, tmp_path, mode):
    staging, log = on_meta
    state = _state()
    path = str(tmp_path / "ckpt")
    writer = StorageWriter(path, rules="small", staging=staging)
    if mode == "save":
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        dcp.async_save(state, storage_writer=writer, no_dist=True).result()
    # One staging of the 4 tensors' buffers (a pageable .to("cpu") of a meta buffer raises).
    assert log == ["stage", "sync", "write", "release"], log
    assert len(staging.staged_buffers) == 4 and sum(staging.staged_buffers) > 4
    got = _zeros_like(state)
    tw_dcp.load(got, path, no_dist=True)
    for k, t in _tensors(plain).items():
        assert torch.equal(_tensors(got)[k], t), k
    assert got["extra"] == {"lr": 0.1}


def test_the_pinned_buffer_goes_back_when_the_write_fails(on_meta, tmp_path, monkeypatch):
    staging, log = on_meta

    def fail(*args, **kwargs):
        log.append("write")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_writer, "write_file", fail)
    with pytest.raises(BaseException):  # noqa: B017 - DCP wraps it in CheckpointException
        dcp.save(_state(), storage_writer=StorageWriter(str(tmp_path / "c"), staging=staging), no_dist=True)
    assert log == ["stage", "sync", "write", "release"], log


class MetaTargets(DefaultLoadPlanner):
    """Gives the reader "meta" targets: the tensors of a GPU rank, on a machine without one."""

    def __init__(self) -> None:
        super().__init__()
        self.committed: list[str] = []

    def resolve_tensor(self, read_item):
        return torch.empty_like(super().resolve_tensor(read_item), device="meta")

    def commit_tensor(self, read_item, tensor):
        assert tensor.device.type == "meta"
        self.committed.append(read_item.dest_index.fqn)


def _spy(monkeypatch, module, name: str, calls: list, real_device=None):
    real = getattr(module, name)

    def spy(*args, device=None, **kwargs):
        out = real(*args, device=real_device or device, **kwargs)
        calls.append((torch.device(device), out))
        return out

    monkeypatch.setattr(module, name, spy)


def test_the_reader_decodes_each_chunk_on_its_targets_device(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=StorageWriter(path, rules="small"), no_dist=True)
    calls: list = []
    # The codecs' torch path reads scalars, which meta has not: decode on the CPU instead
    # of where the reader asks (the GPU tests decode there for real).
    _spy(monkeypatch, dcp_reader, "dequantize_entries", calls, real_device="cpu")
    planner = MetaTargets()
    state = _zeros_like(_state())
    dcp.load(state, storage_reader=StorageReader(path), planner=planner, no_dist=True)
    assert sorted(planner.committed) == sorted(_tensors(state))
    on_meta = sorted(p for dev, out in calls if dev.type == "meta" for p in out)
    assert on_meta == ["model/b", "model/w", "optim/m", "optim/v"]
    # Only the pickled non-tensor item is decoded on the host.
    assert [len(out) for dev, out in calls if dev.type == "cpu"] == [1]
    assert state["extra"] == {"lr": 0.1}


def test_the_entries_for_a_gpu_are_read_straight_to_it_and_the_others_to_the_host(tmp_path, monkeypatch):
    """A rank file's tensors bound for a GPU go there through the pinned ring (read_file
    with their device, only their entries); its non-tensor items are read to the host.
    "meta" stands for the GPU: the spy reads to the host instead, and the decode spy
    decodes there."""
    path = str(tmp_path / "ckpt")
    dcp.save(_state(), storage_writer=StorageWriter(path, rules="small"), no_dist=True)
    reads: list = []
    real_read = dcp_reader.read_file

    def read_file(*args, entries=None, device=None, **kwargs):
        reads.append((None if entries is None else sorted(entries), device))
        return real_read(*args, entries=entries, **kwargs)

    monkeypatch.setattr(dcp_reader, "read_file", read_file)
    monkeypatch.setattr(dcp_reader, "wants_pinned", lambda device: device.type == "meta")
    _spy(monkeypatch, dcp_reader, "dequantize_entries", [], real_device="cpu")
    planner = MetaTargets()
    dcp.load(_zeros_like(_state()), storage_reader=StorageReader(path), planner=planner, no_dist=True)
    assert len(planner.committed) == 4
    by_device = {str(device): entries for entries, device in reads}
    assert len(reads) == 2 and by_device["meta"] == ["model/b", "model/w", "optim/m", "optim/v"]
    assert len(by_device["None"]) == 1  # the pickled non-tensor item, to the host


def test_a_delta_and_its_keyframe_regions_are_decoded_on_the_targets_device(tmp_path, monkeypatch):
    key, delta = str(tmp_path / "key"), str(tmp_path / "delta")
    dcp.save(_state(), storage_writer=StorageWriter(key, rules="small", as_keyframe=True), no_dist=True)
    dcp.save(_state(0.01), storage_writer=StorageWriter(delta, rules="small", reference=key), no_dist=True)
    region_devices: list[torch.device] = []
    real_regions = Keyframe.regions

    def regions(self, wanted, device=None):
        region_devices.append(torch.device(device))
        return real_regions(self, wanted, "cpu")  # a fingerprint on meta has no value to check

    monkeypatch.setattr(Keyframe, "regions", regions)
    calls: list = []
    _spy(monkeypatch, dcp_reader, "dequantize_entries", calls, real_device="cpu")
    dcp.load(_zeros_like(_state()), storage_reader=StorageReader(delta), planner=MetaTargets(), no_dist=True)
    assert region_devices and {d.type for d in region_devices} == {"meta"}
    assert {d.type for d, _ in calls} == {"meta", "cpu"}


def test_a_delta_load_reads_its_rank_and_keyframe_files_through_one_ring(tmp_path, monkeypatch):
    """The rank file and the keyframe's file of a delta load are read inside one
    ``one_ring`` block: to a GPU, one ring of pinned slots for the whole ``read_data``."""
    from tw_triton.format import upload_ring

    key, delta = str(tmp_path / "key"), str(tmp_path / "delta")
    dcp.save(_state(), storage_writer=StorageWriter(key, rules="small", as_keyframe=True), no_dist=True)
    dcp.save(_state(0.01), storage_writer=StorageWriter(delta, rules="small", reference=key), no_dist=True)
    scopes: list = []
    for module in (dcp_reader, dcp_keyframe):
        real = module.read_file

        def read_file(*args, real=real, **kwargs):
            scopes.append(upload_ring._SHARED.get())
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "read_file", read_file)
    got = _zeros_like(_state())
    dcp.load(got, storage_reader=StorageReader(delta), no_dist=True)
    assert len(scopes) >= 2 and scopes[0] is not None and all(s is scopes[0] for s in scopes), scopes
    assert torch.allclose(got["model"]["w"], _state(0.01)["model"]["w"], atol=0.05)
    # A keyframe's regions asked for outside a load (a delta save's) share one too.
    scopes.clear()
    Keyframe(key).regions([("model.w", (0, 0), (96, 64)), ("optim.m", (0, 0), (80, 64))])
    assert scopes and scopes[0] is not None and all(s is scopes[0] for s in scopes), scopes


def test_keyframe_regions_are_decoded_where_they_are_asked_for(tmp_path, monkeypatch):
    key = str(tmp_path / "key")
    dcp.save(_state(), storage_writer=StorageWriter(key, rules="small", as_keyframe=True), no_dist=True)
    calls: list = []
    _spy(monkeypatch, dcp_keyframe, "dequantize_entries", calls)
    reads: list = []
    real_read = dcp_keyframe.read_file

    def read_file(*args, entries=None, device=None, **kwargs):
        reads.append((sorted(entries), str(device)))
        return real_read(*args, entries=entries, **kwargs)  # to the host: meta has no bytes

    monkeypatch.setattr(dcp_keyframe, "read_file", read_file)
    monkeypatch.setattr(dcp_keyframe, "wants_pinned", lambda device: device.type == "meta")
    kf = Keyframe(key)
    # Two regions of one chunk: the file is read once, only the entry they need, straight
    # to the device (meta standing for a GPU).
    (a, b) = kf.regions([("model.w", (0, 0), (10, 64)), ("model.w", (10, 0), (86, 64))], "meta")
    assert a.device.type == "meta" and b.device.type == "meta"
    assert [(d.type, sorted(out)) for d, out in calls] == [("meta", ["model/w"])]
    assert reads == [(["model/w"], "meta")]
    (full,) = kf.regions([("model.w", (0, 0), (96, 64))])
    assert torch.equal(full, _state()["model"]["w"])  # exact in a keyframe


def test_cpu_saves_share_the_process_staging_and_pin_nothing(tmp_path):
    from tw_triton.dcp.staging import shared_staging

    writers = [StorageWriter(str(tmp_path / name), rules="small") for name in ("a", "b")]
    assert writers[0].staging is writers[1].staging is shared_staging()
    dcp.save(_state(), storage_writer=writers[0], no_dist=True)
    dcp.async_save(_state(), storage_writer=writers[1], no_dist=True).result()
    assert shared_staging().pool.held_bytes == 0  # CPU buffers are written as they are


def test_a_staged_writer_travels_to_another_process_as_plain_bytes(plain, on_meta, tmp_path):
    """DCP's process-based async save pickles the writer after ``stage``: the staged bytes
    go along (no pinned buffer, stream or event), and the copy writes the same checkpoint."""
    import pickle

    staging, log = on_meta
    path = str(tmp_path / "ckpt")
    writer = StorageWriter(path, rules="small", staging=staging)
    staged = writer.stage(_state())
    moved = pickle.loads(pickle.dumps(writer))
    assert log == ["stage", "sync"] and moved.staging is not staging
    dcp.save(staged, storage_writer=moved, no_dist=True)
    got = _zeros_like(_state())
    tw_dcp.load(got, path, no_dist=True)
    for k, t in _tensors(plain).items():
        assert torch.equal(_tensors(got)[k], t), k
