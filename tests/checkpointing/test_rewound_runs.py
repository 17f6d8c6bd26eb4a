"""A run gone back to an older step (``restore(step)`` of an older checkpoint, or a new run in
an old directory) leaves the newer checkpoints of the abandoned run. Retention does not count
them for ``keep_last`` (they never displace the new run's own), keeps them while they are
newer than every save of the new run (``restore()`` without a step picks them until then),
and drops them like any older checkpoint once the new run passes them."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from tw_triton import format as fmt
from tw_triton.checkpoint_dir import checkpoint_name
from tw_triton.checkpointer import Checkpointer


def options(**extra):
    return {"keep_last": 2, "fsync": False, **extra}


def save_steps(ck: Checkpointer, steps, model: torch.nn.Module) -> None:
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)
        ck.save(step, model=model)
    ck.flush()


@pytest.mark.parametrize("keyframe_every", [1, 3])
@pytest.mark.parametrize("async_write", [False, True])
def test_a_rewound_run_keeps_its_own_newest_and_the_abandoned_ones_until_passed(
    tmp_path, caplog, keyframe_every, async_write
):
    model = torch.nn.Linear(64, 64)
    kw = options(keyframe_every=keyframe_every, async_write=async_write)
    with Checkpointer(tmp_path, **kw) as ck:
        save_steps(ck, [10, 20, 30, 40, 50], model)
        assert ck.steps()[-2:] == [40, 50]
    with Checkpointer(tmp_path, **kw) as ck:
        ck.restore(40, model=model)
        with caplog.at_level(logging.WARNING, logger="tw_triton.retention"):
            save_steps(ck, [41, 42, 43], model)
        # keep_last=2 of the new run's saves, not 43 and the abandoned 50 (which dropped 42)
        own = [s for s in ck.steps() if s < 50]
        assert own[-2:] == [42, 43]
        assert (41 in own) == (keyframe_every == 3)  # closed loop: 42 is a delta of 41
        assert ck.steps()[-1] == 50 and ck.latest() == 50  # kept whole: still loadable
        warned = [r.getMessage() for r in caplog.records if "saving step 41" in r.getMessage()]
        assert len(warned) == 1 and "steps 50" in warned[0] and "keep_last" in warned[0]
        assert "restore() without a step picks them again" in warned[0]
        assert not any("saving step 42" in r.getMessage() for r in caplog.records)  # once
        save_steps(ck, [51], model)  # passes 50: now an older checkpoint like any other
        assert 50 not in ck.steps() and ck.steps()[-2:] == [43, 51]


def test_a_run_rewound_in_the_same_process_keeps_its_own_newest(tmp_path):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, **options(keyframe_every=1, async_write=False, keep_last=3)) as ck:
        save_steps(ck, [10, 20, 30, 40, 50], model)
        ck.restore(30, model=model)
        save_steps(ck, [31, 32, 33], model)
        assert ck.steps() == [31, 32, 33, 40, 50]
        save_steps(ck, [40], model)  # the same step: replaces the abandoned file
        assert ck.steps() == [32, 33, 40, 50] and ck.latest() == 50


def test_a_new_run_in_an_old_directory_keeps_its_own_checkpoints(tmp_path):
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, **options(keyframe_every=1, async_write=False)) as ck:
        save_steps(ck, [100, 200], model)
    with Checkpointer(tmp_path, **options(keyframe_every=1, async_write=False)) as ck:
        save_steps(ck, [0, 1, 2, 3], model)  # no restore: a new run from step 0
        assert ck.steps() == [2, 3, 100, 200]


def test_a_save_in_flight_that_a_rewind_abandons_does_not_count_as_the_runs_newest(tmp_path, monkeypatch):
    """Step 40 still being written when the run goes back to 25: the abandoned 30 is newer
    than every save of the run, so it stays (it was dropped: 40 counted as the run's)."""
    model = torch.nn.Linear(64, 64)
    real, gate = fmt.write_file, threading.Event()

    def held_write(qstate, path, **kw):
        if path.endswith(checkpoint_name(40)):
            assert gate.wait(10)
        return real(qstate, path, **kw)

    monkeypatch.setattr(fmt, "write_file", held_write)
    with Checkpointer(tmp_path, **options(keyframe_every=1, keep_last=1, max_pending=2)) as ck:
        save_steps(ck, [10, 20, 30], model)
        try:
            ck.save(40, model=model)
            ck.save(25, model=model)  # retention runs here, with 40 in flight
            assert os.path.exists(ck.path_for(30))
        finally:
            gate.set()
        ck.flush()
        assert ck.steps() == [25, 30, 40]


def test_a_rewound_run_that_keeps_every_checkpoint_is_warned_too(tmp_path, caplog):
    """With keep_last=None retention deletes nothing, but the save that mixes two runs
    (restore() without a step picks the newer files until passed) is the only WARNING of it."""
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, **options(keep_last=None, async_write=False)) as ck:
        save_steps(ck, [10, 20, 30], model)
        ck.restore(10, model=model)
        with caplog.at_level(logging.WARNING, logger="tw_triton"):
            save_steps(ck, [11, 12], model)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "saving step 11" in warned[0] and "steps 20, 30" in warned[0]
        assert ck.steps() == [10, 11, 12, 20, 30]
