"""AsyncWriter: round trips, ordering, backpressure, error propagation, draining, exit hook."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading
import uuid

import pytest
import torch

from tw_triton import format as fmt
from tw_triton.errors import CheckpointError, TwTritonError
from tw_triton.pinned_staging import PinnedPool
from tw_triton.qstate import EncodedEntry, QuantizedState
from tw_triton.writer import AsyncWriter


def make_state(seed: int, n: int = 1000) -> QuantizedState:
    """A small exact-coded state whose every value depends on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "model/w": torch.randn(n, generator=g),
        "model/b": torch.randn(7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }
    entries = {
        k: EncodedEntry(codec="exact", params={}, shape=tuple(t.shape), dtype=t.dtype, buffers={"data": t})
        for k, t in tensors.items()
    }
    return QuantizedState(
        entries=entries, skeleton={"seed": seed}, checkpoint_id=uuid.uuid4().hex, metadata={"seed": seed}
    )


def assert_same_state(path, expected: QuantizedState) -> None:
    got = fmt.read_file(path)
    assert got.checkpoint_id == expected.checkpoint_id
    assert set(got.entries) == set(expected.entries)
    for k, e in expected.entries.items():
        for b, t in e.buffers.items():
            assert torch.equal(got.entries[k].buffers[b], t), (path, k, b)


def temp_files(directory) -> list[str]:
    return [n for n in os.listdir(directory) if fmt.is_temp_file(n)]


class GatedWrite:
    """Replaces format.write_file: each call blocks until the test opens the gate."""

    def __init__(self, real):
        self.real = real
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls: list[str] = []

    def __call__(self, qstate, path, *, fsync=True, entropy="auto"):
        self.calls.append(os.fspath(path))
        self.started.set()
        assert self.gate.wait(10), "test never opened the gate"
        return self.real(qstate, path, fsync=fsync)


def test_round_trip_and_future_result(tmp_path):
    q = make_state(1)
    with AsyncWriter() as w:
        fut = w.submit(q, tmp_path / "a.tw.safetensors")
        nbytes = fut.result(timeout=30)
    assert nbytes == os.path.getsize(tmp_path / "a.tw.safetensors")
    assert nbytes > q.nbytes
    assert_same_state(tmp_path / "a.tw.safetensors", q)
    assert temp_files(tmp_path) == []


def test_many_saves_in_order_each_with_its_own_content(tmp_path, monkeypatch):
    order: list[str] = []
    real = fmt.write_file

    def recording(qstate, path, *, fsync=True, entropy="auto"):
        order.append(os.path.basename(path))
        return real(qstate, path, fsync=fsync)

    monkeypatch.setattr(fmt, "write_file", recording)
    states = [make_state(s) for s in range(6)]
    names = [f"s{i}.tw.safetensors" for i in range(6)]
    with AsyncWriter(max_pending=3, fsync=False) as w:
        futures = [w.submit(q, tmp_path / n) for q, n in zip(states, names)]
        assert w.pending() <= 3
    assert all(f.done() for f in futures)
    assert order == names
    for q, n in zip(states, names):
        assert_same_state(tmp_path / n, q)


class SlotWatch:
    """Stands in for an AsyncWriter's slot semaphore: records in ``order`` whether each
    submit found a slot free or had to wait for one, and advances the writer's clock
    ``clock`` by a second when one waits (so its backpressure log does not depend on how
    fast this machine is)."""

    def __init__(self, slots, order, clock):
        self.slots, self.order, self.clock = slots, order, clock
        self.settled = threading.Event()  # a submit waits (or the test's thread returned)

    def acquire(self, blocking=True, timeout=None):
        if self.slots.acquire(blocking=False):
            self.order.append("slot free")
            return True
        self.order.append("submit waits")
        self.clock[0] += 1.0
        self.settled.set()
        return self.slots.acquire(blocking, timeout)

    def release(self, n=1):
        self.slots.release(n)


def watch_slots(monkeypatch, w, order):
    from types import SimpleNamespace

    from tw_triton import writer as writer_mod

    clock = [0.0]
    monkeypatch.setattr(writer_mod, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    w._slots = SlotWatch(w._slots, order, clock)
    return w._slots


def test_backpressure_blocks_submit_and_keeps_saves_apart(tmp_path, monkeypatch, caplog):
    gated = GatedWrite(fmt.write_file)
    monkeypatch.setattr(fmt, "write_file", gated)
    q1, q2 = make_state(11), make_state(22)
    w = AsyncWriter(max_pending=1)
    order: list[str] = []
    slots = watch_slots(monkeypatch, w, order)
    caplog.set_level(logging.INFO, logger="tw_triton.writer")
    f1 = w.submit(q1, tmp_path / "one.tw.safetensors")
    order.append("first submit returned")
    assert not f1.done()  # the first save does not wait for its write (held at the gate)
    assert gated.started.wait(10)

    box = {}

    def second():
        box["future"] = w.submit(q2, tmp_path / "two.tw.safetensors")
        order.append("second submit returned")
        slots.settled.set()

    th = threading.Thread(target=second)
    th.start()
    # While the first write is held at the gate, the second submit must block.
    assert slots.settled.wait(10)
    assert not f1.done()
    order.append("first write released")
    gated.gate.set()
    th.join(10)
    assert order == [
        "slot free",
        "first submit returned",
        "submit waits",
        "first write released",
        "second submit returned",
    ]
    assert f1.result(timeout=10) > 0
    assert box["future"].result(timeout=10) > 0
    w.close()
    assert gated.calls == [str(tmp_path / "one.tw.safetensors"), str(tmp_path / "two.tw.safetensors")]
    assert_same_state(tmp_path / "one.tw.safetensors", q1)
    assert_same_state(tmp_path / "two.tw.safetensors", q2)
    waits = [r.getMessage() for r in caplog.records if "backpressure" in r.getMessage()]
    assert len(waits) == 1 and "two.tw.safetensors" in waits[0] and "waited 1.000 s" in waits[0]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
def test_write_error_goes_on_future_and_is_raised_at_next_submit(tmp_path, monkeypatch, code):
    real = fmt.write_file

    def failing(qstate, path, *, fsync=True, entropy="auto"):
        raise OSError(code, os.strerror(code), os.fspath(path))

    w = AsyncWriter()
    monkeypatch.setattr(fmt, "write_file", failing)
    bad = w.submit(make_state(1), tmp_path / "bad.tw.safetensors")
    err = bad.exception(timeout=10)
    assert isinstance(err, OSError) and err.errno == code
    monkeypatch.setattr(fmt, "write_file", real)
    with pytest.raises(CheckpointError) as info:
        w.submit(make_state(2), tmp_path / "next.tw.safetensors")
    assert isinstance(info.value, TwTritonError)
    assert "bad.tw.safetensors" in str(info.value)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
    assert isinstance(info.value, OSError) and info.value.errno == code
    # The call that raised did not queue its state; the error is raised once only.
    assert not (tmp_path / "next.tw.safetensors").exists()
    ok = w.submit(make_state(3), tmp_path / "ok.tw.safetensors")
    assert ok.result(timeout=10) > 0
    w.close()


def test_write_error_is_raised_at_flush_and_at_close(tmp_path, monkeypatch):
    def failing(qstate, path, *, fsync=True, entropy="auto"):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))

    monkeypatch.setattr(fmt, "write_file", failing)
    w = AsyncWriter()
    w.submit(make_state(1), tmp_path / "a.tw.safetensors")
    with pytest.raises(CheckpointError, match="a.tw.safetensors"):
        w.flush()
    w.flush()  # already raised once: nothing new
    w.submit(make_state(2), tmp_path / "b.tw.safetensors")
    with pytest.raises(CheckpointError, match="b.tw.safetensors") as info:
        w.close()
    assert info.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(CheckpointError, match="closed"):
        w.submit(make_state(3), tmp_path / "c.tw.safetensors")


def test_two_failures_are_both_reported(tmp_path, monkeypatch):
    both_queued = threading.Event()

    def failing(qstate, path, *, fsync=True, entropy="auto"):
        assert both_queued.wait(10)
        raise OSError(errno.EIO, "I/O error", os.fspath(path))

    monkeypatch.setattr(fmt, "write_file", failing)
    w = AsyncWriter(max_pending=2)
    futs = [w.submit(make_state(i), tmp_path / f"{i}.tw.safetensors") for i in range(2)]
    both_queued.set()
    for f in futs:
        assert isinstance(f.exception(timeout=10), OSError)
    with pytest.raises(CheckpointError, match="1 later save"):
        w.close()


def test_close_drains_a_slow_write(tmp_path, monkeypatch):
    from tw_triton import writer as writer_mod

    real = fmt.write_file
    release = threading.Event()
    order: list[str] = []

    def slow(qstate, path, *, fsync=True, entropy="auto"):
        assert release.wait(10), "close() never waited for the write"
        nbytes = real(qstate, path, fsync=fsync)
        order.append("written")
        return nbytes

    monkeypatch.setattr(fmt, "write_file", slow)
    q = make_state(5)
    w = AsyncWriter()
    fut = w.submit(q, tmp_path / "slow.tw.safetensors")
    real_wait = writer_mod.wait_futures

    def waiting(fs, *args, **kwargs):
        if fut in fs:  # close() waits for the held write: only now may it finish
            order.append("close waits")
            release.set()
        return real_wait(fs, *args, **kwargs)

    monkeypatch.setattr(writer_mod, "wait_futures", waiting)
    assert not fut.done()
    w.close()
    order.append("closed")
    assert order == ["close waits", "written", "closed"]
    assert fut.done() and fut.result() > 0
    assert_same_state(tmp_path / "slow.tw.safetensors", q)
    w.close()  # idempotent


def test_context_manager_does_not_mask_the_loop_exception(tmp_path, monkeypatch, caplog):
    def failing(qstate, path, *, fsync=True, entropy="auto"):
        raise OSError(errno.ENOSPC, "No space left on device", os.fspath(path))

    monkeypatch.setattr(fmt, "write_file", failing)
    with pytest.raises(KeyError):
        with AsyncWriter() as w:
            w.submit(make_state(1), tmp_path / "x.tw.safetensors")
            raise KeyError("training loop failed")
    assert any("x.tw.safetensors" in r.getMessage() for r in caplog.records)


def test_pinned_pool_reuses_and_bounds_bytes(monkeypatch):
    from types import SimpleNamespace

    from tw_triton import pinned_staging

    clock = [0.0]  # the pool's clock moves on a second each time acquire() waits
    monkeypatch.setattr(pinned_staging, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    pool = PinnedPool(3 << 20, pin_memory=False)
    a, waited = pool.acquire(1000)
    assert a.numel() >= 1000 and waited == 0.0
    pool.release(a)
    b, _ = pool.acquire(500)
    assert b.data_ptr() == a.data_ptr()  # reused, not reallocated
    c, _ = pool.acquire(2 << 20)  # b is in use: a second buffer fits under the cap
    assert pool.held_bytes <= 3 << 20

    got = {}

    settled = threading.Event()  # the taker waits (or returned without)
    real_wait = pool._cond.wait

    def wait(timeout=None):
        clock[0] += 1.0
        settled.set()
        return real_wait(timeout)

    pool._cond.wait = wait

    def taker():
        got["buf"], got["waited"] = pool.acquire(2 << 20)
        settled.set()

    th = threading.Thread(target=taker)
    th.start()
    assert settled.wait(10)
    assert "buf" not in got  # no room under the cap until c comes back
    pool.release(c)
    th.join(5)
    assert not th.is_alive() and got["buf"].data_ptr() == c.data_ptr()
    assert got["waited"] >= 1.0
    with pytest.raises(CheckpointError, match="pinned_bytes cap"):
        pool.acquire(4 << 20)


def test_pinned_pool_drops_too_small_buffers_before_growing():
    pool = PinnedPool(None, pin_memory=False)
    small, _ = pool.acquire(10)
    pool.release(small)
    big, _ = pool.acquire(5 << 20)
    assert pool.held_bytes == big.numel()


EXIT_SCRIPT = """
import sys, time, uuid, torch
from tw_triton import format as fmt
from tw_triton.qstate import EncodedEntry, QuantizedState
from tw_triton.writer import AsyncWriter
real = fmt.write_file
delay = float(sys.argv[2])
def slow(q, p, *, fsync=True, entropy="auto"):
    time.sleep(delay)
    return real(q, p, fsync=fsync)
fmt.write_file = slow
t = torch.arange(100, dtype=torch.float32)
q = QuantizedState({"t": EncodedEntry("exact", {}, (100,), torch.float32, {"data": t})}, {}, uuid.uuid4().hex)
w = AsyncWriter(exit_timeout=float(sys.argv[3]))
w.submit(q, sys.argv[1])
print("submitted", flush=True)
# no close(): the exit hook decides
"""


def test_exit_hook_finishes_or_warns(tmp_path):
    script = tmp_path / "exit_script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = tmp_path / "done.tw.safetensors"
    r = subprocess.run(
        [sys.executable, str(script), str(done), "0.5", "30"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert done.exists()
    t = fmt.read_file(done).entries["t"].buffers["data"]
    assert torch.equal(t, torch.arange(100, dtype=torch.float32))

    late = tmp_path / "late.tw.safetensors"
    r = subprocess.run(
        [sys.executable, str(script), str(late), "5", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert not late.exists()
    assert "not finished" in r.stderr and "late.tw.safetensors" in r.stderr


UNCLOSED_CHECKPOINTER = """
import sys, torch
from tw_triton import Checkpointer
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024)  # 4 MiB tensors: encoded on a thread pool
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 1024)).sum().backward()
opt.step()
ckpt = Checkpointer(sys.argv[1], fsync=False)
ckpt.save(0, model=model, optimizer=opt)
ckpt.save(1, model=model, optimizer=opt)
torch.save(model.state_dict(), sys.argv[2])
# no close(): the exit hook finishes the saves, step 1 encoded at exit
"""


def test_saves_a_script_leaves_unclosed_are_encoded_and_written_at_exit(tmp_path):
    # The exit hook ran the last save's encode after concurrent.futures had stopped taking
    # work: "cannot schedule new futures after interpreter shutdown", the file lost, a log
    # line the only trace.
    script = tmp_path / "unclosed.py"
    script.write_text(textwrap.dedent(UNCLOSED_CHECKPOINTER))
    env = dict(os.environ, PYTHONUNBUFFERED="1", TW_TRITON_THREADS="2")
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, str(script), str(run), str(tmp_path / "model.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr, r.stderr
    from tw_triton import Checkpointer

    reader = Checkpointer(run)
    assert reader.steps() == [0, 1]
    model = torch.nn.Linear(1024, 1024)
    assert reader.restore(1, model=model)["step"] == 1
    want = torch.load(tmp_path / "model.pt")
    # Step 1 is a delta of weights that did not move since the keyframe: exact too.
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    reader.close()


@pytest.mark.cuda
def test_cuda_buffers_are_staged_through_a_reused_pinned_pool(tmp_path):
    states = []
    for s in range(3):
        q = make_state(s, n=100_000)
        for e in q.entries.values():
            e.buffers = {k: v.cuda() for k, v in e.buffers.items()}
        states.append(q)
    with AsyncWriter() as w:
        for i, q in enumerate(states):
            w.submit(q, tmp_path / f"{i}.tw.safetensors").result(timeout=60)
            held = w.pinned_bytes_held
            assert held > 0
        assert w.pinned_bytes_held == held  # the same buffer served every save
    for i, q in enumerate(states):
        got = fmt.read_file(tmp_path / f"{i}.tw.safetensors")
        for k, e in q.entries.items():
            assert torch.equal(got.entries[k].buffers["data"], e.buffers["data"].cpu())


def test_carve_gives_aligned_views_of_every_dtype_and_shape():
    from tw_triton.pinned_staging import PINNED_ALIGN, carve, staging_nbytes

    g = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=g),  # fp32
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.tensor(3, dtype=torch.int64),  # 0-dim
        torch.zeros(0, 4),  # empty
        torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
        torch.tensor([True, False, True]),
        torch.randn(4, 6, generator=g).t(),  # non-contiguous source
        torch.randn(5, generator=g).to(torch.float16),
    ]
    buf = torch.zeros(staging_nbytes(tensors), dtype=torch.uint8)
    views = carve(buf, tensors)
    for v, t in zip(views, tensors):
        assert v.dtype == t.dtype and v.shape == t.shape and v.is_contiguous()
        assert (v.data_ptr() - buf.data_ptr()) % PINNED_ALIGN == 0
        v.copy_(t)
    for v, t in zip(views, tensors):  # no view overlaps another
        assert torch.equal(v, t)
    with pytest.raises(CheckpointError, match="cannot hold"):
        carve(buf[:-1], tensors)


def test_submit_of_a_function_encodes_on_the_writer_thread(tmp_path):
    q = make_state(5)
    threads = []

    def encode():
        threads.append(threading.current_thread().name)
        return q

    def broken():
        raise RuntimeError("encode failed")

    with AsyncWriter() as w:
        assert w.submit(encode, tmp_path / "a.tw.safetensors").result(timeout=30) > q.nbytes
        fut = w.submit(broken, tmp_path / "b.tw.safetensors")
        with pytest.raises(RuntimeError, match="encode failed"):
            fut.result(timeout=30)
        with pytest.raises(CheckpointError, match="b.tw.safetensors.*encode failed"):
            w.flush()
    assert threads == ["tw_triton-writer"]
    assert_same_state(tmp_path / "a.tw.safetensors", q)
    assert not os.path.exists(tmp_path / "b.tw.safetensors") and temp_files(tmp_path) == []
