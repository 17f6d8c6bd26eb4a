"""A file no Checkpointer wrote (``tw_triton.save``'s), under a name like a step's, in a
Checkpointer's directory: ``latest()`` and ``restore()`` pass over it with a warning naming
it and why, ``load(step)`` of it says why, and retention neither counts nor deletes it."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import tw_triton
from tw_triton.checkpoint_dir import checkpoint_name
from tw_triton.checkpointer import Checkpointer
from tw_triton.errors import CheckpointError


def saved_run(directory, steps, **options) -> torch.nn.Linear:
    """A Checkpointer's saves of ``steps``; returns the model as saved last."""
    model = torch.nn.Linear(64, 32)
    options = {"keyframe_every": 2, "keep_last": None, "async_write": False, "fsync": False, **options}
    with Checkpointer(directory, **options) as ck:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            ck.save(step, model=model)
    return model


def foreign(step: int) -> dict:
    """A training state as a user might lay one out, step and RNG states included."""
    return {"step": step, "model": torch.nn.Linear(64, 32).state_dict(), "rng": {}}


@pytest.mark.parametrize("state", ["weights", "a whole state"])
def test_restore_passes_over_a_tw_triton_save_file_named_like_a_newer_step(tmp_path, caplog, state):
    model = saved_run(tmp_path, [1, 2, 3])
    path = os.path.join(tmp_path, checkpoint_name(9))
    value = torch.nn.Linear(64, 32).state_dict() if state == "weights" else foreign(9)
    tw_triton.save(tw_triton.quantize_state_dict(value), path)

    ck = Checkpointer(tmp_path, fsync=False)
    fresh = torch.nn.Linear(64, 32)
    with caplog.at_level(logging.WARNING):
        restored = ck.restore(model=fresh)
    assert restored["step"] == 3 and torch.equal(fresh.weight, model.weight)
    skipped = [r.getMessage() for r in caplog.records if path in r.getMessage()]
    assert skipped and all("not a Checkpointer's checkpoint" in m and "no kind" in m for m in skipped)
    assert "newer" not in caplog.text  # it is no rewound run's checkpoint either
    assert ck.latest() == 3 and ck.latest(verify=False) == 3 and ck.load()["step"] == 3
    assert [i.by_checkpointer for i in ck.infos()] == [True, True, True, False]
    with pytest.raises(CheckpointError, match="not a Checkpointer's checkpoint") as err:
        ck.load(9)
    assert path in str(err.value)
    ck.close()


def test_retention_neither_counts_nor_deletes_a_file_it_did_not_write(tmp_path):
    path = os.path.join(tmp_path, checkpoint_name(9))
    tw_triton.save(tw_triton.quantize_state_dict(foreign(9)), path)
    saved_run(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    with Checkpointer(tmp_path, fsync=False) as ck:
        assert ck.steps() == [4, 5, 9]  # keep_last=2 of its own; the other file is the user's
    assert os.path.exists(path)


def test_the_only_file_being_foreign_is_no_good_checkpoint_naming_why(tmp_path):
    path = os.path.join(tmp_path, checkpoint_name(4))
    tw_triton.save(tw_triton.quantize_state_dict(foreign(4)), path)
    with Checkpointer(tmp_path, fsync=False) as ck:
        assert ck.latest() is None
        with pytest.raises(CheckpointError, match="not a Checkpointer's checkpoint") as err:
            ck.restore(model=torch.nn.Linear(64, 32))
    assert path in str(err.value)
