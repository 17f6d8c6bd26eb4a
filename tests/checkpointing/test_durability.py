"""Issue 28, durability: a Future that reports success belongs to a checkpoint that loads.

A delta is only as durable as the saves it is coded against (its keyframe and, in closed
loop, every link since). The writer's failures here are injected by replacing
``format.write_file`` for chosen files; a failing write waits on an event the test sets,
so which saves are queued behind it is decided by the test, not by timing.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from tw_triton import format as fmt
from tw_triton.checkpointer import Checkpointer, checkpoint_name
from tw_triton.errors import CheckpointError, CheckpointIOError

N = 8192  # delta-coded under the "small" rules (a float tensor of >= 4096 elements)


def weights(step: int) -> torch.Tensor:
    """The model weight saved at ``step``: a base plus a step-dependent drift."""
    base = torch.randn(N, generator=torch.Generator().manual_seed(0))
    drift = torch.randn(N, generator=torch.Generator().manual_seed(1))
    return base + 0.01 * step * drift


def state(step: int, w: torch.Tensor | None = None) -> dict:
    """What the tests save at ``step`` (``w``: another weight than :func:`weights`)."""
    return {"model": {"w": (weights(step) if w is None else w).clone()}, "extra": torch.tensor([step])}


class FailingWrites:
    """Replaces ``format.write_file``: the files of ``steps`` fail with ENOSPC, each once
    ``gate`` is set (set it up front for a failure at once)."""

    def __init__(self, real, directory, steps):
        self.real = real
        self.doomed = {os.path.join(os.fspath(directory), checkpoint_name(s)) for s in steps}
        self.gate = threading.Event()
        self.failed: list[str] = []

    def __call__(self, qstate, path, *, fsync=True, entropy="auto"):
        path = os.fspath(path)
        if path in self.doomed:
            assert self.gate.wait(30), "the test never opened the gate"
            self.failed.append(path)
            raise CheckpointIOError(errno.ENOSPC, f"cannot write checkpoint {path}: No space left on device")
        return self.real(qstate, path, fsync=fsync, entropy=entropy)


class OpensGateWhenBlocked:
    """Wraps the writer's slots: a ``submit`` about to wait for backpressure opens
    ``gate`` first, so the failure it waits for happens during the wait."""

    def __init__(self, slots, gate):
        self.slots = slots
        self.gate = gate
        self.blocked = 0

    def acquire(self, blocking=True, timeout=None):
        if self.slots.acquire(blocking=False):
            return True
        self.blocked += 1
        self.gate.set()
        return self.slots.acquire(timeout=30)

    def release(self):
        self.slots.release()


def assert_loads_as_saved(directory, futures: dict[int, object], saved: dict[int, torch.Tensor]) -> None:
    """Every save whose Future reports success loads (chain and all) to what was saved."""
    reader = Checkpointer(directory, async_write=False)
    for step, future in futures.items():
        if future.exception() is not None:
            continue
        got = reader.load(step)
        assert int(got["extra"][0]) == step
        err = (got["model"]["w"] - saved[step]).abs().max().item()
        assert err < 1e-3, f"step {step} reported written but loads {err} away from what was saved"
    reader.close()


def save_all(ckpt, steps, saved, futures, weight=None):
    for s in steps:
        saved[s] = weights(s) if weight is None else weight(s)
        futures[s] = ckpt.save(s, **state(s, saved[s]))


@pytest.mark.parametrize("delta", ["closed", "open"])
@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_saves_queued_behind_a_failed_write_never_report_success(tmp_path, monkeypatch, delta, fail_at):
    """Four saves in flight (a keyframe and three deltas); one fails while the later ones
    wait in the queue. Those that need it fail too, the error reaches the loop once, and
    the next save is a keyframe that loads."""
    fake = FailingWrites(fmt.write_file, tmp_path, [fail_at])
    monkeypatch.setattr(fmt, "write_file", fake)
    ckpt = Checkpointer(
        tmp_path, keyframe_every=10, keep_last=None, rules="small", delta=delta, max_pending=4, fsync=False
    )
    saved, futures = {}, {}
    save_all(ckpt, range(4), saved, futures)
    fake.gate.set()
    with pytest.raises(CheckpointIOError) as info:
        ckpt.flush()
    assert info.value.errno == errno.ENOSPC and checkpoint_name(fail_at) in str(info.value)
    needs_failed = {
        0: {1, 2, 3},
        1: {2, 3} if delta == "closed" else set(),
        2: {3} if delta == "closed" else set(),
    }
    for s in needs_failed[fail_at]:
        with pytest.raises(CheckpointError, match=checkpoint_name(fail_at)):
            futures[s].result()
        assert not os.path.exists(ckpt.path_for(s)), f"step {s} is on disk but cannot load"
    for s in set(range(4)) - needs_failed[fail_at] - {fail_at}:
        assert futures[s].result() > 0
    save_all(ckpt, [4, 5], saved, futures)
    ckpt.close()  # the lost deltas' errors are not raised a second time
    lost_reference = fail_at == 0 or delta == "closed"  # open loop keeps its keyframe
    kind = {i.step: i.kind for i in Checkpointer(tmp_path).infos()}[4]
    assert kind == ("keyframe" if lost_reference else "delta")
    assert_loads_as_saved(tmp_path, futures, saved)
    assert Checkpointer(tmp_path).latest() == 5


def test_a_save_waiting_for_backpressure_sees_the_keyframe_fail(tmp_path, monkeypatch):
    """max_pending=1: the delta's save waits for the keyframe's write, which fails during
    the wait. The save raises that error instead of queueing a delta of a file that does not
    exist, and the next save is a keyframe that loads."""
    fake = FailingWrites(fmt.write_file, tmp_path, [0])
    monkeypatch.setattr(fmt, "write_file", fake)
    ckpt = Checkpointer(
        tmp_path, keyframe_every=10, keep_last=None, rules="small", max_pending=1, fsync=False
    )
    ckpt._writer._slots = slots = OpensGateWhenBlocked(ckpt._writer._slots, fake.gate)
    saved, futures = {}, {}
    save_all(ckpt, [0], saved, futures)
    with pytest.raises(CheckpointIOError) as info:
        save_all(ckpt, [1], saved, futures)
    assert slots.blocked == 1 and info.value.errno == errno.ENOSPC
    assert checkpoint_name(0) in str(info.value)
    assert 1 not in futures and not os.path.exists(ckpt.path_for(1))
    save_all(ckpt, [2, 3], saved, futures)
    ckpt.close()
    infos = {i.step: i for i in Checkpointer(tmp_path).infos()}
    assert sorted(infos) == [2, 3] and infos[2].kind == "keyframe"
    assert_loads_as_saved(tmp_path, futures, saved)


def test_deltas_after_a_delta_whose_keyframe_failed(tmp_path, monkeypatch):
    """max_pending=2: the keyframe fails while a delta is queued behind it and a second
    delta waits for backpressure; neither delta reports success."""
    fake = FailingWrites(fmt.write_file, tmp_path, [0])
    monkeypatch.setattr(fmt, "write_file", fake)
    ckpt = Checkpointer(
        tmp_path, keyframe_every=10, keep_last=None, rules="small", max_pending=2, fsync=False
    )
    ckpt._writer._slots = OpensGateWhenBlocked(ckpt._writer._slots, fake.gate)
    saved, futures = {}, {}
    save_all(ckpt, [0, 1], saved, futures)
    with pytest.raises(CheckpointIOError):
        save_all(ckpt, [2], saved, futures)
    with pytest.raises(CheckpointError, match=checkpoint_name(0)):
        futures[1].result(timeout=30)
    save_all(ckpt, [3, 4], saved, futures)
    ckpt.close()
    assert sorted(i.step for i in Checkpointer(tmp_path).infos()) == [3, 4]
    assert_loads_as_saved(tmp_path, futures, saved)


@pytest.mark.parametrize("async_write", [False, True])
def test_a_failed_closed_loop_delta_does_not_move_the_reference(tmp_path, monkeypatch, async_write):
    """The write of a closed-loop delta fails after its encode made its reconstruction the
    reference. The next save must not be coded against that reconstruction while naming the
    link before it (it would load silently wrong): it is a keyframe."""
    far = {2: weights(2) + 5.0}  # the lost save is far from its neighbours
    fake = FailingWrites(fmt.write_file, tmp_path, [2])
    fake.gate.set()
    monkeypatch.setattr(fmt, "write_file", fake)
    ckpt = Checkpointer(
        tmp_path, keyframe_every=10, keep_last=None, rules="small", async_write=async_write, fsync=False
    )
    saved, futures = {}, {}
    save_all(ckpt, [0, 1], saved, futures)
    ckpt.flush()
    with pytest.raises(CheckpointIOError):
        save_all(ckpt, [2], saved, futures, weight=lambda s: far.get(s, weights(s)))
        ckpt.flush()
    save_all(ckpt, [3, 4], saved, futures)
    ckpt.close()
    assert_loads_as_saved(tmp_path, futures, saved)
    infos = {i.step: i for i in Checkpointer(tmp_path).infos()}
    assert sorted(infos) == [0, 1, 3, 4] and infos[3].kind == "keyframe"


# ------------------------------------------------------------ temp files of killed saves

OWN_TEMP = "." + checkpoint_name(7) + ".0123456789abcdef.tmp"
UNRELATED = [
    "notes.txt",
    ".notes.txt.0123456789abcdef.tmp",  # write_file's temp naming, not for a checkpoint
    "." + checkpoint_name(7) + ".tmp",  # no random part: not write_file's
    "step-x.tw.safetensors.0123456789abcdef.tmp",  # no leading dot
]


def plant(directory, names, nbytes=100) -> None:
    for name in names:
        with open(os.path.join(directory, name), "wb") as f:
            f.write(b"x" * nbytes)


def sweep_records(caplog):
    return [r for r in caplog.records if "temp file" in r.getMessage() and r.name.startswith("tw_triton")]


def test_open_removes_temp_files_of_dead_writers_only(tmp_path, caplog):
    with Checkpointer(tmp_path, async_write=False, fsync=False) as ckpt:
        ckpt.save(1, **state(1))
    retired = "." + checkpoint_name(3) + ".fedcba9876543210.tmp"  # retention's rename, then a kill
    plant(tmp_path, [OWN_TEMP, retired], nbytes=300)
    plant(tmp_path, UNRELATED)
    os.mkdir(tmp_path / ("." + checkpoint_name(8) + ".0123456789abcdef.tmp"))  # not a file
    caplog.set_level(logging.INFO, logger="tw_triton")
    ckpt = Checkpointer(tmp_path)
    left = set(os.listdir(tmp_path))
    assert OWN_TEMP not in left and retired not in left
    assert set(UNRELATED) <= left and checkpoint_name(1) in left
    [record] = sweep_records(caplog)
    assert record.levelno == logging.WARNING
    assert "2 temp file(s) of 600 bytes" in record.getMessage() and str(tmp_path) in record.getMessage()
    assert ckpt.load()["extra"].item() == 1
    ckpt.close()


def test_a_temp_file_of_an_open_checkpointer_is_kept(tmp_path, caplog):
    """A second Checkpointer (in this process) on a directory that another one holds leaves
    the temp files alone: they may be the other one's write in progress."""
    caplog.set_level(logging.INFO, logger="tw_triton")
    writing = Checkpointer(tmp_path, fsync=False)
    plant(tmp_path, [OWN_TEMP])
    Checkpointer(tmp_path).close()
    assert OWN_TEMP in os.listdir(tmp_path) and sweep_records(caplog) == []
    writing.close()
    Checkpointer(tmp_path).close()
    assert OWN_TEMP not in os.listdir(tmp_path)
    assert len(sweep_records(caplog)) == 1


HOLDER = textwrap.dedent("""
    import os, sys
    from tw_triton.checkpointer import Checkpointer
    ckpt = Checkpointer(sys.argv[1], fsync=False)
    with open(os.path.join(sys.argv[1], sys.argv[2]), "wb") as f:
        f.write(b"half a keyframe")
    print("ready", flush=True)
    sys.stdin.readline()  # held until the test says so, or killed
""")


def test_a_live_writer_in_another_process_keeps_its_temp_file_until_killed(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path), OWN_TEMP],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        Checkpointer(tmp_path).close()
        assert OWN_TEMP in os.listdir(tmp_path), "removed a live writer's temp file"
    finally:
        child.kill()  # SIGKILL: no close, no atexit; the kernel drops its lock
        child.wait()
    Checkpointer(tmp_path).close()
    assert OWN_TEMP not in os.listdir(tmp_path)


def test_without_a_lock_nothing_is_removed(tmp_path, monkeypatch):
    """A filesystem that refuses flock: the open works and removes nothing (it cannot know
    whether a writer is live)."""
    import tw_triton.directory_claim as claim

    def refused(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(claim.fcntl, "flock", refused)
    plant(tmp_path, [OWN_TEMP])
    with Checkpointer(tmp_path, async_write=False, fsync=False) as ckpt:
        ckpt.save(1, **state(1))
    assert OWN_TEMP in os.listdir(tmp_path)


def test_distributed_checkpointer_removes_temp_files_of_dead_ranks(tmp_path, caplog):
    from tw_triton.dcp import DistributedCheckpointer

    step = tmp_path / "step_00000004"
    step.mkdir()
    own = [
        ".__0_0.tw.safetensors.0123456789abcdef.tmp",
        ".__1_0.tw.safetensors.fedcba9876543210.tmp",
        "tw_dcp.json.tmp",
    ]
    plant(step, own)
    plant(step, ["__1_0.tw.safetensors", "notes.tmp", ".notes.0123456789abcdef.tmp"])
    plant(tmp_path, [".__0_0.tw.safetensors.0123456789abcdef.tmp", "tw_dcp.json.tmp"])  # not in a step dir
    caplog.set_level(logging.INFO, logger="tw_triton")
    held = DistributedCheckpointer(tmp_path)
    assert sorted(os.listdir(step)) == sorted(
        ["__1_0.tw.safetensors", "notes.tmp", ".notes.0123456789abcdef.tmp"]
    )
    assert len(os.listdir(tmp_path)) == 3
    [record] = sweep_records(caplog)
    assert "3 temp file(s) of 300 bytes" in record.getMessage()
    plant(step, own[:1])
    DistributedCheckpointer(tmp_path)  # another rank, while this one holds the directory
    assert own[0] in os.listdir(step)
    del held
