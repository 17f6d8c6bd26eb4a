"""Saving a step again, or a step below the last one: every file written loads, within the
codec's error of what was saved (a delta is never coded against the file it replaces, nor
against a later step whose chain a rewound run overwrites)."""

from __future__ import annotations

import pytest
import torch

from tw_triton.checkpointer import Checkpointer


def model_at(value: float) -> torch.nn.Linear:
    """A model over the 4096-element floor of the presets (its weight is delta-coded)."""
    model = torch.nn.Linear(64, 128)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, 128 * 64).reshape(128, 64) * value)
        model.bias.fill_(value)
    return model


def assert_every_file_loads_what_was_saved(directory, saved: dict[int, float]) -> None:
    ckpt = Checkpointer(directory)
    assert ckpt.steps() == sorted(saved)
    for step, value in saved.items():
        weight = ckpt.load(step)["model"]["weight"]
        want = model_at(value).weight.detach()
        assert (weight - want).norm() / want.norm() < 0.02, step
    assert ckpt.latest() == max(saved)


SAVES = {
    "a delta's step": [(0, 1.0), (1, 1.1), (2, 1.2), (2, 1.3), (3, 1.4)],
    "the keyframe's step": [(0, 1.0), (0, 1.1), (1, 1.2)],
}


@pytest.mark.parametrize("async_write", [True, False])
@pytest.mark.parametrize("delta", ["closed", "open"])
@pytest.mark.parametrize("again", SAVES)
def test_a_step_saved_again_loads(tmp_path, async_write, delta, again):
    saved = {}
    with Checkpointer(
        tmp_path, keyframe_every=10, keep_last=None, delta=delta, async_write=async_write
    ) as ck:
        for step, value in SAVES[again]:
            ck.save(step, model=model_at(value))
            saved[step] = value
    assert_every_file_loads_what_was_saved(tmp_path, saved)


@pytest.mark.parametrize("async_write", [True, False])
def test_a_run_rewound_to_a_lower_step_writes_files_that_load(tmp_path, async_write):
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=None, async_write=async_write) as ck:
        for step in range(4):
            ck.save(step, model=model_at(1 + step / 10))
        # Back to step 1 (as after restoring an old checkpoint by hand): steps 1 and 2 again.
        ck.save(1, model=model_at(2.0))
        ck.save(2, model=model_at(2.1))
    ckpt = Checkpointer(tmp_path)
    for step, value in [(0, 1.0), (1, 2.0), (2, 2.1)]:
        weight = ckpt.load(step)["model"]["weight"]
        want = model_at(value).weight.detach()
        assert (weight - want).norm() / want.norm() < 0.02, step


def test_the_step_just_restored_saved_again_loads(tmp_path):
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=None) as ck:
        for step in range(3):
            ck.save(step, model=model_at(1 + step / 10))
    again = Checkpointer(tmp_path, keyframe_every=10, keep_last=None)
    again.restore(model=model_at(0.0))
    again.save(2, model=model_at(1.5))
    again.save(3, model=model_at(1.6))
    again.close()
    assert_every_file_loads_what_was_saved(tmp_path, {0: 1.0, 1: 1.1, 2: 1.5, 3: 1.6})
