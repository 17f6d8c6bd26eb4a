"""Snapshot buffer reuse: the pool's bookkeeping, same bytes with and without it, and the
Checkpointer never recycling a buffer that a pending write (or the delta reference) still
reads."""

from __future__ import annotations

import ctypes
import os
import sys
import threading

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton import quantize_state_dict, save_encode, save_pipeline
from tw_triton.checkpointer import Checkpointer, checkpoint_name
from tw_triton.errors import CheckpointError, QuantizationError
from tw_triton.snapshot_pool import MIN_POOLED_BYTES, SnapshotPool
from tw_triton.tree import flatten

CPU = torch.device("cpu")
BIG = 1 << 16  # fp32 elements: a 256 KiB tensor, pooled


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------ the pool itself


def test_released_buffers_are_reused_by_size_with_any_dtype_and_shape():
    pool = SnapshotPool()
    first = pool.lease()
    a = first((BIG,), torch.float32, CPU)
    assert a.shape == (BIG,) and a.dtype == torch.float32 and a.is_contiguous()
    assert pool.held_bytes == BIG * 4 and pool.free_bytes == 0
    first.release()
    assert pool.free_bytes == BIG * 4
    second = pool.lease()
    b = second((BIG // 8, 4), torch.float64, CPU)  # same bytes, other dtype and shape
    assert storage_ptr(b) == storage_ptr(a) and b.shape == (BIG // 8, 4) and b.dtype == torch.float64
    assert (pool.reused, pool.allocated) == (1, 1)
    c = second((BIG,), torch.float32, CPU)  # nothing free of that size any more: a new one
    assert storage_ptr(c) != storage_ptr(a) and pool.allocated == 2
    second.release()
    second.release()  # twice is harmless
    assert pool.free_bytes == pool.held_bytes == 2 * BIG * 4
    with pytest.raises(CheckpointError, match="released"):
        second((BIG,), torch.float32, CPU)


def test_small_and_device_buffers_are_not_pooled():
    pool = SnapshotPool()
    lease = pool.lease()
    small = lease((MIN_POOLED_BYTES // 4 - 1,), torch.float32, CPU)
    meta = lease((BIG,), torch.float32, torch.device("meta"))
    assert small.numel() == MIN_POOLED_BYTES // 4 - 1 and meta.device.type == "meta"
    assert pool.held_bytes == 0 and lease.nbytes == 0


def test_cap_drops_free_buffers_of_other_sizes_then_falls_back_to_fresh_memory():
    pool = SnapshotPool(cap_bytes=3 * BIG * 4)
    lease = pool.lease()
    lease((2 * BIG,), torch.float32, CPU)
    lease.release()
    assert pool.free_bytes == 2 * BIG * 4
    lease = pool.lease()
    x = lease((BIG,), torch.float32, CPU)  # fits beside the free 2*BIG buffer
    y = lease((BIG,), torch.float32, CPU)  # does not: the free 2*BIG buffer is dropped
    assert pool.free_bytes == 0 and pool.held_bytes == 2 * BIG * 4
    z = lease((2 * BIG,), torch.float32, CPU)  # over the cap with nothing to drop: unpooled
    assert pool.unpooled == 1 and pool.held_bytes == 2 * BIG * 4 and lease.nbytes == 2 * BIG * 4
    assert len({storage_ptr(t) for t in (x, y, z)}) == 3
    lease.release()
    assert pool.held_bytes <= pool.cap_bytes


def test_split_keeps_buffers_out_of_the_pool_until_their_own_release():
    pool = SnapshotPool()
    lease = pool.lease()
    kept = lease((BIG,), torch.float32, CPU)
    lease((BIG,), torch.float32, CPU)
    other = lease.split([kept])
    lease.release()
    assert pool.free_bytes == BIG * 4
    reuse = pool.lease()
    assert storage_ptr(reuse((BIG,), torch.float32, CPU)) != storage_ptr(kept)
    other.release()
    assert storage_ptr(reuse((BIG,), torch.float32, CPU)) == storage_ptr(kept)


# ------------------------------------------------------------- quantize_state_dict


def test_quantize_state_dict_with_a_lease_gives_the_same_entries():
    g = torch.Generator().manual_seed(0)
    state = {
        "model": {"w": torch.randn(512, 256, generator=g), "t": torch.randn(256, 512, generator=g).t()},
        "opt": {"m": torch.randn(BIG, generator=g).to(torch.bfloat16), "step": torch.tensor(3)},
    }
    pool = SnapshotPool()
    plain = quantize_state_dict(state, rules="exact", checkpoint_id="x")
    for _ in range(2):  # the second round reuses the first round's buffers
        lease = pool.lease()
        pooled = quantize_state_dict(state, rules="exact", checkpoint_id="x", allocate=lease)
        for path, entry in plain.entries.items():
            got = pooled.entries[path]
            assert (got.codec, got.shape, got.dtype) == (entry.codec, entry.shape, entry.dtype)
            assert torch.equal(got.buffers["data"], entry.buffers["data"]), path
            assert storage_ptr(got.buffers["data"]) != storage_ptr(state_leaf(state, path))
        lease.release()
    assert pool.reused >= 3  # w, t and m came from the pool the second time


def test_quantized_entries_take_their_codes_from_the_lease():
    """blockwise (a delta and not) and log2 write their buffers into the lease's memory, and
    those are the very bytes a plain encode makes."""
    g = torch.Generator().manual_seed(1)
    state = {
        "w": torch.randn(512, 256, generator=g),
        "d": torch.randn(BIG, generator=g),
        "v": torch.rand(BIG, generator=g) * 1e-6,
    }
    ref = {"w": state["w"] + 0.01, "d": torch.zeros(BIG), "v": torch.zeros(BIG)}
    rules = [
        ("w", "int8"),
        ("d", {"codec": "blockwise", "bits": 4, "delta": False}),
        ("v", {"codec": "log2", "bits": 8}),
    ]
    plain = quantize_state_dict(state, reference=ref, rules=rules, checkpoint_id="x")
    pool = SnapshotPool()
    lease = pool.lease()
    pooled = quantize_state_dict(state, reference=ref, rules=rules, checkpoint_id="x", allocate=lease)
    leased = {b.data_ptr() for b in lease._bufs}
    assert {e.codec for e in pooled.entries.values()} == {"blockwise", "log2"}
    for path, entry in plain.entries.items():
        got = pooled.entries[path]
        assert got.params == entry.params and got.buffers.keys() == entry.buffers.keys()
        for name, t in entry.buffers.items():
            assert torch.equal(got.buffers[name], t), (path, name)
            if t.numel() * t.element_size() >= MIN_POOLED_BYTES:
                assert storage_ptr(got.buffers[name]) in leased, (path, name)
    assert len(leased) == 2  # w's and v's codes; d's (4-bit: 32 KiB) and the per-block ones are small
    lease.release()


def test_the_writer_threads_codes_come_from_the_saves_lease(tmp_path, monkeypatch):
    """With the async writer, the codecs that encode a snapshot on the writer's threads take
    their codes from the save's lease (pooled memory, given back after the write), and
    every file is still what it should be."""
    from tw_triton.snapshot_pool import SnapshotLease

    taken = []
    real = SnapshotLease.__call__

    def spy(self, shape, dtype, device):
        taken.append((dtype, threading.current_thread() is threading.main_thread()))
        return real(self, shape, dtype, device)

    monkeypatch.setattr(SnapshotLease, "__call__", spy)
    torch.manual_seed(3)
    # 256 x 512 weights: their 4-bit codes (64 KiB) are large enough to be pooled.
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.Linear(256, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = Checkpointer(tmp_path, keyframe_every=4, keep_last=None, fsync=False)
    wants = {}
    for step in range(6):
        opt.zero_grad()
        model(torch.full((4, 512), float(step))).square().mean().backward()
        opt.step()
        ckpt.save(step, model=model, optimizer=opt)
        wants[step] = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.close()
    assert (torch.uint8, False) in taken  # codes, asked for on a writer thread
    assert (torch.int32, False) in taken  # log2 bounds too
    reader = Checkpointer(tmp_path)
    for step, want in wants.items():
        got = reader.load(step)["model"]
        for name, t in want.items():
            assert (got[name] - t).abs().max() <= 1e-2, (step, name)


def state_leaf(state, path):
    node = state
    for part in path.split("/"):
        node = node[part]
    return node


# ---------------------------------------------------------------------- Checkpointer


def make_run(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def train_step(model, opt, k: int) -> None:
    opt.zero_grad()
    (model(torch.full((4, 256), float(k))).square().mean()).backward()
    opt.step()


def aux_of(step: int) -> list[torch.Tensor]:
    """Exact-coded extras, as large as the weights, saved before them: in a delta they need
    more pooled buffers than the moments alone, so a reference buffer wrongly given back
    would be overwritten by them."""
    return [torch.full((256, 256), float(step * 10 + i)) for i in range(6)]


def expected_of(model, opt, step: int) -> dict:
    return {
        "aux": aux_of(step),
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "moments": {
            (i, name): t.clone()
            for i, s in opt.state_dict()["state"].items()
            for name, t in s.items()
            if torch.is_tensor(t) and t.dim() > 0
        },
    }


def check_file(ckpt: Checkpointer, step: int, want: dict, kind: str) -> None:
    got = ckpt.load(step)
    assert len(got["aux"]) == len(want["aux"])
    for a, b in zip(got["aux"], want["aux"]):
        assert torch.equal(a, b), step
    moments = got["optimizer"]["state"]
    for (i, name), t in want["moments"].items():  # exact in keyframes and deltas alike
        assert torch.equal(moments[i][name], t), (step, i, name)
    for name, t in want["model"].items():
        if kind == "keyframe" or t.numel() < 4096:
            assert torch.equal(got["model"][name], t), (step, name)
        else:  # int8 delta: within half a step of its block's scale
            assert (got["model"][name] - t).abs().max() <= 1e-3, (step, name)


@pytest.mark.parametrize("async_write", [True, False])
def test_buffers_come_back_only_after_the_write_with_a_slow_writer(tmp_path, monkeypatch, async_write):
    real = fmt.write_file
    permits = threading.Semaphore(0)

    def held_write(qstate, path, *, fsync=True, entropy="auto"):
        # Async: the write of save N waits until save N + 1 has taken its snapshot.
        assert not async_write or permits.acquire(timeout=20), "the test never let a write go"
        return real(qstate, path, fsync=fsync)

    monkeypatch.setattr(fmt, "write_file", held_write)
    model, opt = make_run()
    ckpt = Checkpointer(
        tmp_path,
        keyframe_every=3,
        keep_last=None,
        fsync=False,
        rules="default",
        async_write=async_write,
        max_pending=2,
    )
    wants, kinds, overlapped = {}, {}, 0
    for step in range(7):
        train_step(model, opt, step)
        if async_write:
            overlapped += ckpt._writer.pending() > 0
        ckpt.save(step, aux=aux_of(step), model=model, optimizer=opt)
        if async_write and step:
            permits.release()  # the previous save may be written now
        wants[step] = expected_of(model, opt, step)
        kinds[step] = "keyframe" if step % 3 == 0 else "delta"
    permits.release()
    ckpt.close()
    pool = ckpt._saves.pool
    assert pool.reused > 0, "nothing was reused: the test would not see an early release"
    if async_write:
        assert overlapped == 6  # every later snapshot was taken while a save was unwritten
    reader = Checkpointer(tmp_path)
    assert [i.kind for i in reader.infos()] == [kinds[s] for s in range(7)]
    for step in range(7):
        check_file(reader, step, wants[step], kinds[step])


def test_pool_stays_within_its_bound_and_close_gives_it_back(tmp_path):
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, keyframe_every=4, keep_last=2, fsync=False, max_pending=1)
    for step in range(10):
        train_step(model, opt, step)
        kept = ckpt._chain.kept_bytes()  # what the cap made room for when this save leased
        ckpt.save(step, model=model, optimizer=opt)
        # In closed loop the keyframe's buffers leave the reference after the first delta.
        lease = ckpt._chain.reference.lease
        ref = lease.nbytes if lease is not None else 0
        # The writer thread takes a save's codes from its lease after save() measured it,
        # so `largest` counts them from the next save on: within the first cycle (a
        # keyframe, then deltas, each a new layout) the pool may run ahead of it by one
        # save's codes. From the second cycle on every layout has been measured.
        slack = ckpt._saves.largest if step < 4 else 0
        assert ckpt.pool_bytes <= 2 * ckpt._saves.largest + max(kept, ref) + slack
    assert ckpt._saves.largest >= 4 * 256 * 256 * 4  # keyframe: 2 weights + 4 moments pooled
    assert ckpt._saves.pool.reused > 0
    ckpt.close()
    assert ckpt.pool_bytes == 0
    off = Checkpointer(tmp_path / "off", fsync=False, snapshot_pool_bytes=0)
    off.save(0, model=model, optimizer=opt)
    off.close()
    assert off.pool_bytes == 0
    with pytest.raises(CheckpointError, match="snapshot_pool_bytes"):
        Checkpointer(tmp_path / "bad", snapshot_pool_bytes=-1)


def test_a_failed_snapshot_gives_its_buffers_back(tmp_path):
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, fsync=False, async_write=False)
    ckpt.save(0, model=model, optimizer=opt)
    # A delta's buffers are not a keyframe's (its moments are log2-temporal codes, not
    # log2): one delta first, so that the pool holds what a delta needs.
    ckpt.save(1, model=model, optimizer=opt)
    held = ckpt.pool_bytes
    with pytest.raises(QuantizationError, match="complex"):
        ckpt.save(2, model=model, optimizer=opt, extra=torch.zeros(BIG, dtype=torch.complex64))
    # Nothing leaked: everything the pool holds is either the reference or free.
    assert ckpt._saves.pool.free_bytes + ckpt._chain.reference.lease.nbytes == ckpt.pool_bytes == held
    ckpt.save(2, model=model, optimizer=opt)
    ckpt.close()


def test_reference_buffers_outlive_a_delta_still_encoding_on_the_writer(tmp_path, monkeypatch):
    import tw_triton.save_pipeline as pipeline_mod

    real = pipeline_mod.encode_delta
    go = threading.Event()

    def held_encode(*args, **kwargs):
        assert go.wait(20), "the test never let the encode go"
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "encode_delta", held_encode)
    model, opt = make_run()
    ckpt = Checkpointer(
        tmp_path, keyframe_every=2, keep_last=None, fsync=False, max_pending=2, rules="default"
    )
    wants = {}
    go.set()
    ckpt.save(0, aux=aux_of(0), model=model, optimizer=opt)  # keyframe: the reference
    ckpt.flush()
    wants[0] = expected_of(model, opt, 0)
    go.clear()
    train_step(model, opt, 1)
    ckpt.save(1, aux=aux_of(1), model=model, optimizer=opt)  # delta: encode held on the writer
    wants[1] = expected_of(model, opt, 1)
    train_step(model, opt, 2)
    # A new keyframe retires the reference while the delta has not read it yet: its
    # buffers must not serve this snapshot.
    ckpt.save(2, aux=aux_of(2), model=model, optimizer=opt)
    wants[2] = expected_of(model, opt, 2)
    go.set()
    ckpt.close()
    assert ckpt._saves.pool.reused > 0
    reader = Checkpointer(tmp_path)
    for step, kind in ((0, "keyframe"), (1, "delta"), (2, "keyframe")):
        check_file(reader, step, wants[step], kind)


def test_a_state_that_cannot_be_a_delta_is_a_keyframe_decided_in_save(tmp_path):
    """A delta of another shape could not be encoded against the reference: ``save`` sees
    it before any copy and makes it a keyframe (test_model_changes_mid_chain.py has the
    rest); the pool serves it like any keyframe."""
    ckpt = Checkpointer(tmp_path, keyframe_every=10, keep_last=None, fsync=False)
    models = [torch.nn.Linear(256, 256), torch.nn.Linear(512, 128), torch.nn.Linear(256, 256)]
    for step, model in enumerate(models):
        ckpt.save(step, model=model)
    ckpt.save(3, model=models[2])
    ckpt.close()
    assert [i.kind for i in Checkpointer(tmp_path).infos()] == ["keyframe"] * 3 + ["delta"]
    for step, model in enumerate(models):
        assert torch.equal(Checkpointer(tmp_path).load(step)["model"]["weight"], model.weight.detach())


# ------------------------------------------------------------------ reserving ahead


def _resident_fraction(t: torch.Tensor) -> float:
    """Share of the whole pages under ``t`` that are resident (``mincore``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    start = -(-t.data_ptr() // page) * page
    pages = (t.data_ptr() + t.nbytes - start) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages


def test_reserve_adds_what_is_missing_within_the_cap_and_leases_reuse_it():
    pool = SnapshotPool(cap_bytes=5 * BIG * 4)
    small = MIN_POOLED_BYTES - 1
    assert pool.reserve([BIG * 4, BIG * 4, 2 * BIG * 4, small]) == 4 * BIG * 4
    assert pool.free_bytes == pool.held_bytes == 4 * BIG * 4 and pool.allocated == 3
    assert pool.reserve([BIG * 4, 2 * BIG * 4]) == 0  # already there
    # One more BIG fits under the cap, a second 2*BIG does not: skipped, not an error.
    assert pool.reserve([BIG * 4] * 3 + [2 * BIG * 4] * 2) == BIG * 4
    assert pool.held_bytes == 5 * BIG * 4 <= pool.cap_bytes
    lease = pool.lease()
    got = [lease((BIG,), torch.float32, CPU) for _ in range(3)] + [lease((2 * BIG,), torch.float32, CPU)]
    assert (pool.reused, pool.allocated, pool.free_bytes) == (4, 4, 0)
    assert len({storage_ptr(t) for t in got}) == 4
    lease.release()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore through ctypes")
def test_reserved_buffers_are_resident_before_any_save_touches_them(monkeypatch):
    import mmap

    # Fresh anonymous pages whatever malloc would do (the heap may hold resident memory).
    maps = []

    def fresh_empty(nbytes, dtype):
        maps.append(mmap.mmap(-1, nbytes))
        return torch.frombuffer(maps[-1], dtype=dtype)

    monkeypatch.setattr(torch, "empty", fresh_empty)
    nbytes = 4 << 20
    pool = SnapshotPool()
    assert _resident_fraction(torch.empty(nbytes, dtype=torch.uint8)) < 0.5
    assert pool.reserve([nbytes]) == nbytes
    monkeypatch.undo()
    assert _resident_fraction(pool._free[nbytes][0]) == 1.0


def test_prepare_lets_the_first_save_copy_into_reserved_buffers(tmp_path):
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path / "a", fsync=False, rules="default")
    reserved = ckpt.prepare(model=model, optimizer=opt)
    pooled = [
        t
        for t in [
            *model.state_dict().values(),
            *(m for s in opt.state_dict()["state"].values() for m in s.values()),
        ]
        if t.nbytes >= MIN_POOLED_BYTES
    ]
    # The two weights (the tensors "default" delta-codes) twice: the first delta copies
    # them again while the keyframe's copies stay held as its reference.
    weights = [t for t in model.state_dict().values() if t.nbytes >= MIN_POOLED_BYTES]
    assert len(weights) == 2
    assert reserved == sum(t.nbytes for t in pooled) + sum(t.nbytes for t in weights)
    assert ckpt.prepare(model=model, optimizer=opt) == 0  # nothing missing
    assert ckpt.pool_bytes == reserved
    allocated = ckpt._saves.pool.allocated
    ckpt.save(0, model=model, optimizer=opt).result()
    # Every pooled tensor of the snapshot took a reserved buffer; only the writer thread's
    # outputs (none here: the keyframe is exact) could have needed new ones.
    assert ckpt._saves.pool.reused == len(pooled) and ckpt._saves.pool.allocated == allocated
    plain = Checkpointer(tmp_path / "b", fsync=False, rules="default")
    plain.save(0, model=model, optimizer=opt).result()
    plain.close()
    # With the reference holding the keyframe's weights, a prepare adds nothing.
    assert ckpt.prepare(model=model, optimizer=opt) == 0
    train_step(model, opt, 1)
    ckpt.save(1, model=model, optimizer=opt).result()
    # The first delta's snapshot found reserved buffers too: no new memory in save(). The
    # writer thread's int8 codes of the two weights (64 KiB each) are pooled new buffers.
    assert ckpt._saves.pool.reused == 2 * len(pooled)
    assert ckpt._saves.pool.allocated - allocated <= len(weights)
    ckpt.close()
    a = Checkpointer(tmp_path / "a").load(0)
    b = Checkpointer(tmp_path / "b").load(0)
    for name, t in b["model"].items():
        assert torch.equal(a["model"][name], t), name


def test_prepare_without_deltas_reserves_one_snapshot(tmp_path):
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, fsync=False, rules="default", delta=False)
    pooled = [
        t
        for t in [
            *model.state_dict().values(),
            *(m for s in opt.state_dict()["state"].values() for m in s.values()),
        ]
        if t.nbytes >= MIN_POOLED_BYTES
    ]
    assert ckpt.prepare(model=model, optimizer=opt) == sum(t.nbytes for t in pooled)
    ckpt.close()


def test_prepare_reserves_nothing_where_saves_do_not_copy_into_the_pool(tmp_path):
    model, opt = make_run()
    assert Checkpointer(tmp_path / "s", async_write=False).prepare(model=model) == 0
    assert Checkpointer(tmp_path / "o", snapshot_pool_bytes=0).prepare(model=model) == 0
    capped = Checkpointer(tmp_path / "c", snapshot_pool_bytes=BIG * 4)
    assert capped.prepare(model=model) == BIG * 4  # one of the two weights fits
    with pytest.raises(CheckpointError, match="reserved name"):
        capped.prepare(step=3, model=model)
    capped.close()
    with pytest.raises(CheckpointError, match="closed"):
        capped.prepare(model=model)


def test_save_pool_gives_a_lease_back_only_when_its_future_is_done_and_caps_by_the_largest_own():
    from concurrent.futures import Future

    from tw_triton.snapshot_pool import SavePool

    saves = SavePool(None, 2)
    first, kept_lease = saves.lease(), saves.lease()
    first((BIG,), torch.float32, CPU)
    kept_lease((2 * BIG,), torch.float32, CPU)
    done, pending = Future(), Future()
    saves.track(pending, first)
    saves.track(done, kept_lease, own=False)  # not a save's own: the cap does not follow it
    assert saves.largest == BIG * 4
    done.set_result(0)
    saves.release_written()
    assert saves.pool.free_bytes == 2 * BIG * 4  # only the done one came back
    assert saves.lease(kept=100) is not None and saves.pool.cap_bytes == 2 * BIG * 4 + 100
    pending.set_result(0)
    saves.close()
    assert saves.held_bytes == 0
    off = SavePool(0, 2)
    assert off.lease() is None and off.reserve([BIG * 4]) == 0 and off.held_bytes == 0
    with pytest.raises(CheckpointError, match="snapshot_pool_bytes"):
        SavePool(-1, 2)


def test_the_first_delta_finds_its_buffers_without_prepare(tmp_path):
    """After the first keyframe the writer thread faults in room for the copy the first
    delta makes while the keyframe's weights stay held as its reference."""
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, fsync=False, rules="default")
    pooled = [
        t
        for t in [
            *model.state_dict().values(),
            *(m for s in opt.state_dict()["state"].values() for m in s.values()),
        ]
        if t.nbytes >= MIN_POOLED_BYTES
    ]
    weights = [t for t in model.state_dict().values() if t.nbytes >= MIN_POOLED_BYTES]
    ckpt.save(0, model=model, optimizer=opt).result()
    ckpt._writer.flush()  # the reservation runs on the writer thread after the keyframe
    assert ckpt.pool_bytes == sum(t.nbytes for t in pooled) + sum(t.nbytes for t in weights)
    allocated = ckpt._saves.pool.allocated
    train_step(model, opt, 1)
    ckpt.save(1, model=model, optimizer=opt).result()
    assert ckpt._saves.pool.reused == len(pooled)  # the delta's whole snapshot
    assert ckpt._saves.pool.allocated - allocated <= len(weights)  # the writer's int8 codes
    ckpt.close()


@pytest.mark.parametrize("async_write", [True, False])
def test_a_keyframe_encoded_in_save_decodes_its_reconstruction_off_the_loop(
    tmp_path, monkeypatch, async_write
):
    """The first keyframe, encoded in ``save()`` for want of pooled memory, leaves the decode
    of its log2-coded moments (what the chain's deltas are coded against) to the writer
    thread; the reference then holds exactly what a load of the keyframe gives."""
    threads: list[str] = []
    real = save_encode.keyframe_values

    def spy(q, values, *, in_place):
        threads.append(threading.current_thread().name)
        return real(q, values, in_place=in_place)

    monkeypatch.setattr(save_encode, "keyframe_values", spy)
    monkeypatch.setattr(save_pipeline, "keyframe_values", spy)
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, fsync=False, async_write=async_write)  # "smallest": log2 keyframe codes
    ckpt.save(0, model=model, optimizer=opt).result()
    assert threads == (["tw_triton-writer"] if async_write else [threading.current_thread().name])
    ref = flatten(ckpt._pipeline.chain.reference.tree)[0]
    loaded = flatten(tw_triton.load(tmp_path / checkpoint_name(0)))[0]
    lossy = [p for p in ref if p.endswith("exp_avg_sq")]
    assert lossy and all(torch.equal(ref[p], loaded[p]) for p in ref)
    ckpt.close()


def test_prepare_and_the_first_keyframe_reserve_the_reference_share_once(tmp_path):
    model, opt = make_run()
    ckpt = Checkpointer(tmp_path, fsync=False, rules="default")
    reserved = ckpt.prepare(model=model, optimizer=opt)
    ckpt.save(0, model=model, optimizer=opt).result()
    ckpt._writer.flush()
    assert ckpt.pool_bytes == reserved  # nothing reserved again after the keyframe
    ckpt.close()


@pytest.mark.parametrize("async_write", [True, False])
def test_prepare_runs_a_full_garbage_collection_unless_the_collector_is_off(
    tmp_path, async_write, gc_generations
):
    """Setup's objects bring Python's next full collection close; prepare() runs it then,
    not inside an early save. A process that turned the collector off keeps control."""
    import gc

    with Checkpointer(tmp_path / "on", async_write=async_write, fsync=False) as ckpt:
        gc_generations.clear()
        ckpt.prepare(model={"w": torch.zeros(128, 128)})
        assert 2 in gc_generations
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with Checkpointer(tmp_path / "off", async_write=async_write, fsync=False) as ckpt:
            gc_generations.clear()
            ckpt.prepare(model={"w": torch.zeros(128, 128)})
            assert gc_generations == []
    finally:
        if was_enabled:
            gc.enable()
