"""accelerate: the Checkpointer route resumes a prepared loop; why the save_state hooks are not used."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'tw-triton[hf]'")

from accelerate import Accelerator  # noqa: E402

import tw_triton  # noqa: E402
from tw_triton.integrations.accelerate import load_state, save_state  # noqa: E402

STEPS = 6


def setup(seed: int = 0, accumulate: int = 1):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    return accelerator, model, opt, sched


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 64, generator=g)
    return x, x[:, :1]


def train(accelerator, model, opt, sched, steps, ckpt=None, save_at=()):
    """Returns the batches after which the optimizer stepped."""
    stepped = []
    for step in steps:
        x, y = batch(step)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            stepped.append(step)
        if step in save_at:
            save_state(accelerator, ckpt, step, model=model, optimizer=opt, scheduler=sched)
    return stepped


def test_checkpointer_route_resumes_bit_for_bit(tmp_path):
    acc, model, opt, sched = setup()
    ckpt = tw_triton.Checkpointer(tmp_path, keyframe_every=1, rules="default", fsync=False)
    train(acc, model, opt, sched, range(STEPS), ckpt, save_at={2})
    ckpt.close()
    want = {k: v.clone() for k, v in model.state_dict().items()}

    acc2, model2, opt2, sched2 = setup(seed=99)  # different init: the checkpoint must overwrite it
    state = load_state(
        acc2,
        tw_triton.Checkpointer(tmp_path, rules="default"),
        model=model2,
        optimizer=opt2,
        scheduler=sched2,
    )
    assert state["step"] == 2
    # Dropout draws from the torch RNG, which the checkpoint restored.
    train(acc2, model2, opt2, sched2, range(state["step"] + 1, STEPS))
    for k, v in model2.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_a_prepared_optimizer_is_recorded_and_checked_as_the_one_it_wraps(tmp_path):
    acc, model, opt, sched = setup()
    assert type(opt).__name__ == "AcceleratedOptimizer"
    with tw_triton.Checkpointer(tmp_path, fsync=False) as ckpt:
        train(acc, model, opt, sched, range(2), ckpt, save_at={1})
    recorded = tw_triton.format.read_manifest(tmp_path / "step-00000001.tw.safetensors")["metadata"]
    assert recorded["optimizers"] == {"optimizer": "torch.optim.AdamW"}

    acc2 = Accelerator(cpu=True)
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1))
    model2, sgd = acc2.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    with pytest.raises(tw_triton.CheckpointError, match=r"(?s)'torch.optim.AdamW'.*'torch.optim.SGD'"):
        load_state(acc2, tw_triton.Checkpointer(tmp_path), model=model2, optimizer=sgd)
    load_state(
        acc2, tw_triton.Checkpointer(tmp_path), model=model2, optimizer=sgd, allow_optimizer_mismatch=True
    )
    assert set(sgd.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_resume_keeps_the_phase_of_gradient_accumulation(tmp_path):
    # With 2 batches per optimizer step the accelerator counts batches (accelerator.step,
    # which accelerate's own save_state keeps) to know which ones step. A save after batch
    # 2 falls between two steps: a resume that counted from 0 again would step after
    # batches 4 and 6 where the uninterrupted run steps after 3 and 5.
    acc, model, opt, sched = setup(accumulate=2)
    ckpt = tw_triton.Checkpointer(tmp_path, keyframe_every=1, rules="default", fsync=False)
    stepped = train(acc, model, opt, sched, range(STEPS + 1), ckpt, save_at={2})
    ckpt.close()
    assert stepped == [1, 3, 5]

    acc2, model2, opt2, sched2 = setup(seed=99, accumulate=2)
    state = load_state(acc2, tw_triton.Checkpointer(tmp_path), model=model2, optimizer=opt2, scheduler=sched2)
    assert state["step"] == 2 and acc2.step == 3  # batches 0, 1 and 2 counted
    assert train(acc2, model2, opt2, sched2, range(3, STEPS + 1)) == [3, 5]


class Counter:
    """An object a loop registers with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.seen = 0
        self.history = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": self.history.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.history = state["seen"], state["history"]


def test_objects_registered_for_checkpointing_are_saved_and_restored(tmp_path):
    acc, model, opt, sched = setup()
    counter = Counter()
    acc.register_for_checkpointing(counter)
    counter.seen, counter.history = 7, torch.arange(3.0)
    ckpt = tw_triton.Checkpointer(tmp_path, fsync=False, async_write=False)
    save_state(acc, ckpt, 1, model=model, optimizer=opt)
    ckpt.close()

    acc2, model2, opt2, _ = setup(seed=99)
    again = Counter()
    acc2.register_for_checkpointing(again)
    load_state(acc2, tw_triton.Checkpointer(tmp_path), model=model2, optimizer=opt2)
    assert again.seen == 7 and torch.equal(again.history, torch.arange(3.0))

    with pytest.raises(tw_triton.TwTritonError, match="custom_checkpoint_0"):
        save_state(acc2, tw_triton.Checkpointer(tmp_path / "b"), 1, custom_checkpoint_0=again)
    acc2.register_for_checkpointing(Counter())  # a second one, which the file lacks
    with pytest.raises(tw_triton.CheckpointError, match="custom_checkpoint_1"):
        load_state(acc2, tw_triton.Checkpointer(tmp_path), model=model2, optimizer=opt2)


def test_save_state_hooks_cannot_keep_the_optimizer_out(tmp_path):
    """The why-not in tw_triton.integrations.accelerate, checked against the installed accelerate."""
    acc, model, opt, sched = setup()
    train(acc, model, opt, sched, range(1))
    seen = []

    def hook(models, weights, output_dir):
        seen.append(len(weights))
        weights.clear()  # what a hook can do: take the model weights over

    acc.register_save_state_pre_hook(hook)
    acc.save_state(str(tmp_path))
    assert seen == [1]
    names = set(os.listdir(tmp_path))
    assert not any(n.startswith("model") for n in names)
    assert "optimizer.bin" in names  # still written with torch.save: the hooks never see it


from _readme import readme_example  # noqa: E402


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "readme"}
    exec(compile(readme_example("accelerate"), "README.md", "exec"), scope)
    assert scope["start"] == 16  # the last save was at step 15
