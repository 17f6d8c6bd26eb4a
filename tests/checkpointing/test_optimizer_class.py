"""A checkpoint records the class of each optimizer saved, and a restore (or a load into
objects) refuses an optimizer that is not of that class or a subclass of it, naming the file,
the state's name, both classes and what to do instead; ``allow_optimizer_mismatch=True``
loads it anyway, and a restore without the optimizer restores the rest."""

from __future__ import annotations

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.checkpointer import Checkpointer, checkpoint_name
from tw_triton.errors import CheckpointError


class MyAdamW(torch.optim.AdamW):
    """A user's optimizer: AdamW with its own step, the same state."""


def mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))


def trained(directory, opt_class=torch.optim.AdamW, steps: int = 2):
    """A model and optimizer trained ``steps`` steps, saved after each (a keyframe, then a delta)."""
    model = mlp()
    opt = opt_class(model.parameters(), lr=1e-2)
    with Checkpointer(directory, keyframe_every=2, fsync=False) as ckpt:
        for step in range(steps):
            opt.zero_grad()
            model(torch.randn(8, 64)).square().mean().backward()
            opt.step()
            ckpt.save(step, model=model, optimizer=opt)
    return model, opt


def stepped(opt_class, **kwargs):
    """A fresh model and an optimizer of ``opt_class`` over it that has state (one step)."""
    model = mlp(1)
    opt = opt_class(model.parameters(), **kwargs)
    model(torch.randn(8, 64)).square().mean().backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def adamw_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("adamw")
    model, opt = trained(directory)
    return directory, model, opt


def test_every_file_records_the_class_of_each_optimizer_by_name(tmp_path):
    model = mlp()
    gen, disc = torch.optim.AdamW(model[0].parameters()), torch.optim.SGD(model[2].parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(gen, 1)
    with Checkpointer(tmp_path, keyframe_every=2, fsync=False) as ckpt:
        for step in range(2):
            ckpt.save(step, model=model, gen=gen, disc=disc, scheduler=sched, epoch=1)
    for step, kind in ((0, "keyframe"), (1, "delta")):
        metadata = fmt.read_manifest(tmp_path / checkpoint_name(step))["metadata"]
        assert metadata["kind"] == kind
        assert metadata["optimizers"] == {"gen": "torch.optim.AdamW", "disc": "torch.optim.SGD"}


@pytest.mark.parametrize("step", [0, 1], ids=["keyframe", "delta"])
def test_an_adamw_checkpoint_restored_into_sgd_is_refused_naming_file_name_and_classes(adamw_dir, step):
    directory, _, _ = adamw_dir
    model = mlp(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(directory).restore(step, model=model, optimizer=opt)
    message = str(err.value)
    assert str(directory / checkpoint_name(step)) in message
    assert "'optimizer'" in message
    assert "'torch.optim.AdamW'" in message and "'torch.optim.SGD'" in message
    assert "restore(model=model, ...)" in message and "allow_optimizer_mismatch=True" in message


@pytest.mark.parametrize("given", [torch.optim.Adam, torch.optim.SGD, torch.optim.RMSprop])
def test_a_refused_optimizer_is_left_as_it_was(adamw_dir, given):
    """Adam's state has AdamW's paths: the restore must not have decoded into it first."""
    directory, _, _ = adamw_dir
    model, opt = stepped(given, lr=0.1)
    before = opt.state_dict()
    held = {(i, k): (v.clone(), v.data_ptr()) for i, s in before["state"].items() for k, v in s.items()}
    with pytest.raises(CheckpointError, match="'torch.optim.AdamW'"):
        Checkpointer(directory).restore(model=model, optimizer=opt)
    after = opt.state_dict()["state"]
    for (i, k), (value, ptr) in held.items():
        assert after[i][k].data_ptr() == ptr and torch.equal(after[i][k], value), (i, k)


def test_the_same_class_restores_the_saved_state(adamw_dir):
    directory, model, opt = adamw_dir
    model2, opt2 = stepped(torch.optim.AdamW, lr=0.5)
    state = Checkpointer(directory).restore(model=model2, optimizer=opt2)
    assert state["step"] == 1
    assert opt2.param_groups[0]["lr"] == 1e-2
    saved, got = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert torch.equal(got[0]["step"], saved[0]["step"])
    for k in ("exp_avg", "exp_avg_sq"):  # the delta codes the moments: within its error
        torch.testing.assert_close(got[0][k], saved[0][k], rtol=0.05, atol=1e-3)


def test_the_override_loads_the_saved_state_into_another_class(adamw_dir):
    directory, _, opt = adamw_dir
    model2 = mlp(1)
    sgd = torch.optim.SGD(model2.parameters(), lr=0.1)
    Checkpointer(directory).restore(model=model2, optimizer=sgd, allow_optimizer_mismatch=True)
    assert set(sgd.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # what torch does


def test_restoring_without_the_optimizer_restores_the_weights(adamw_dir):
    directory, model, _ = adamw_dir
    model2 = mlp(1)
    Checkpointer(directory).restore(model=model2)
    for got, want in zip(model2.parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=0.01, atol=1e-3)  # a delta: within its error


def test_a_load_into_an_optimizer_of_another_class_is_refused_and_leaves_it(adamw_dir):
    directory, _, _ = adamw_dir
    model, adam = stepped(torch.optim.Adam)
    exp_avg = adam.state_dict()["state"][0]["exp_avg"].clone()
    with pytest.raises(
        CheckpointError, match=r"(?s)'optimizer'.*'torch.optim.AdamW'.*'torch.optim.Adam'.*into="
    ):
        Checkpointer(directory).load(into={"model": model, "optimizer": adam})
    assert torch.equal(adam.state_dict()["state"][0]["exp_avg"], exp_avg)
    state = Checkpointer(directory).load(into={"model": model})  # the state, without decoding into it
    assert set(state["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}


# (class saved, class given, restores): a subclass is an instance of its base, not the
# other way round; torch's own optimizers are distinct even where torch derives one from
# another (AdamW from Adam).
SUBCLASS_CASES = [
    (torch.optim.AdamW, MyAdamW, True),
    (MyAdamW, MyAdamW, True),
    (MyAdamW, torch.optim.AdamW, False),
    (torch.optim.Adam, torch.optim.AdamW, False),
    (torch.optim.AdamW, torch.optim.Adam, False),
]


@pytest.mark.parametrize(
    "saved, given, restores",
    SUBCLASS_CASES,
    ids=[f"{s.__name__}-into-{g.__name__}" for s, g, _ in SUBCLASS_CASES],
)
def test_a_subclass_restores_its_bases_checkpoint_not_the_reverse(tmp_path, saved, given, restores):
    trained(tmp_path, saved, steps=1)
    model, opt = stepped(given)
    if restores:
        Checkpointer(tmp_path).restore(model=model, optimizer=opt)
        return
    with pytest.raises(CheckpointError, match="neither that class nor a subclass of it"):
        Checkpointer(tmp_path).restore(model=model, optimizer=opt)


def test_a_subclass_is_recorded_by_its_module_and_qualified_name(tmp_path):
    trained(tmp_path, MyAdamW, steps=1)
    recorded = fmt.read_manifest(tmp_path / checkpoint_name(0))["metadata"]["optimizers"]
    assert recorded == {"optimizer": f"{__name__}.MyAdamW"}


def test_an_optimizer_saved_as_a_state_dict_is_not_checked(tmp_path):
    model, opt = stepped(torch.optim.AdamW)
    with Checkpointer(tmp_path, fsync=False) as ckpt:
        ckpt.save(0, model=model, optimizer=opt.state_dict())
    assert "optimizers" not in fmt.read_manifest(tmp_path / checkpoint_name(0))["metadata"]
    model2, sgd = stepped(torch.optim.SGD, lr=0.1)
    Checkpointer(tmp_path).restore(model=model2, optimizer=sgd)  # nothing to compare: as before


@pytest.mark.parametrize("record", ["torch.optim.AdamW", ["torch.optim.AdamW"], {"optimizer": 3}])
def test_a_malformed_record_is_a_checkpoint_error_naming_the_file(tmp_path, record):
    model, opt = stepped(torch.optim.AdamW)
    state = {"step": 0, "model": model.state_dict(), "optimizer": opt.state_dict(), "rng": {}}
    q = tw_triton.quantize_state_dict(state, metadata={"step": 0, "kind": "keyframe", "optimizers": record})
    path = tmp_path / checkpoint_name(0)
    tw_triton.save(q, path, fsync=False)
    with pytest.raises(CheckpointError, match=rf"(?s){checkpoint_name(0)}.*'optimizers' must map names"):
        Checkpointer(tmp_path).restore(model=model, optimizer=opt, rng=False)
    # The record matters to optimizers only: the rest loads and restores.
    assert Checkpointer(tmp_path).load()["step"] == 0
    Checkpointer(tmp_path).restore(model=model, rng=False)
