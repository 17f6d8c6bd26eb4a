"""Every optimizer of torch.optim through the Checkpointer's defaults: its state coded by role
(tw_triton.roles), saved, restored into fresh objects, within 1% of the saved weights, and
trained on."""

from __future__ import annotations

import fnmatch
import inspect
import logging
import math

import pytest
import torch

import tw_triton
from tw_triton import roles
from tw_triton.checkpointer import Checkpointer

TORCH_OPTIMIZERS = sorted(
    n
    for n, c in vars(torch.optim).items()
    if inspect.isclass(c) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
)
# Options that give each optimizer every state it can have (momentum buffers, centered RMSprop, amsgrad).
OPTIONS = {
    "SGD": {"lr": 0.1, "momentum": 0.9},
    "RMSprop": {"momentum": 0.9, "centered": True},
    "Adam": {"amsgrad": True},
    "Muon": {"lr": 0.02},
}
STEPS, EVERY = 12, 2


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "SparseAdam":
        model = torch.nn.Embedding(256, 32, sparse=True)
    else:
        # Muon takes matrices only; every weight is over the 4096-element floor of the presets.
        bias = name != "Muon"
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128, bias=bias), torch.nn.Tanh(), torch.nn.Linear(128, 64, bias=bias)
        )
    opt = getattr(torch.optim, name)(model.parameters(), **OPTIONS.get(name, {}))
    return model, opt


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    if isinstance(model, torch.nn.Embedding):
        return model(torch.randint(0, 256, (16,), generator=g)).square().mean()
    x = torch.randn(32, 64, generator=g)
    return (model(x) - x.flip(1)).square().mean()


def train_step(model, opt, step: int) -> float:
    def closure():
        opt.zero_grad()
        loss = loss_of(model, step)
        loss.backward()
        return loss

    return float(opt.step(closure))


def test_the_table_covers_every_torch_optimizer():
    assert sorted(roles.OPTIMIZER_STATES) == TORCH_OPTIMIZERS


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_every_state_name_has_a_role(name):
    model, opt = build(name)
    train_step(model, opt, 0)
    names = {n for s in opt.state_dict()["state"].values() for n in s}
    assert names and names <= roles.OPTIMIZER_STATES[name].keys()


def coded_as(name: str) -> dict[str, str]:
    model, opt = build(name)
    for step in range(2):
        train_step(model, opt, step)
    q = tw_triton.quantize_state_dict(
        {"model": model.state_dict(), "optimizer": opt.state_dict()}, rules="smallest"
    )
    out = {}
    for path, entry in q.entries.items():
        parts = path.split("/")
        if parts[0] == "optimizer" and parts[1] == "state" and math.prod(entry.shape) >= 4096:
            out[parts[3]] = entry.codec
    return out


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_large_state_is_coded_by_its_role(name):
    # Non-negative float32 moments of a delta: their change over time (log2-temporal).
    expected = {
        roles.SIGNED: {"blockwise"},
        roles.NON_NEGATIVE: {"log2", "log2-temporal"},
        roles.EXACT: {"exact", "bitmask"},  # lossless either way
    }
    for state_name, codec in coded_as(name).items():
        if state_name == "exp_avg" and name != "Adamax":
            # Adam's first moment: the update m / (sqrt(v_hat) + eps), with its exp_avg_sq.
            assert codec == "blockwise-update", name
            continue
        assert codec in expected[roles.role_of(state_name)], state_name


def test_roles_of_the_moments():
    assert roles.role_of("momentum_buffer") == roles.role_of("grad_avg") == roles.SIGNED
    for n in (
        "exp_avg_sq",
        "max_exp_avg_sq",
        "square_avg",
        "sum",
        "acc_delta",
        "row_var",
        "col_var",
        "exp_inf",
    ):
        assert roles.role_of(n) == roles.NON_NEGATIVE, n
    for n in ("step", "mu_product", "eta", "mu", "ax", "prev", "step_size", "old_dirs"):
        assert roles.role_of(n) == roles.EXACT, n
    assert roles.role_of("hessian") is None
    # A whole path component: a model tensor whose key ends with a state name is not matched.
    globs = roles.role_globs(roles.NON_NEGATIVE)
    assert "*/state/*/sum" in globs and not any(fnmatch.fnmatchcase("model/variance", g) for g in globs)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("name", TORCH_OPTIMIZERS)
def test_save_restore_continue(tmp_path, name):
    model, opt = build(name)
    saved = {}
    with Checkpointer(tmp_path, keyframe_every=4, fsync=False, async_write=False) as ckpt:
        for step in range(STEPS):
            train_step(model, opt, step)
            if step % EVERY == EVERY - 1:
                ckpt.save(step, model=model, optimizer=opt)
                saved = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = build(name, seed=1)
    state = Checkpointer(tmp_path).restore(model=fresh, optimizer=fresh_opt)
    assert state["step"] == STEPS - 1
    for key, value in fresh.state_dict().items():
        assert relative_error(value, saved[key]) < 0.01, key
    for step in range(STEPS, STEPS + 3):
        assert torch.isfinite(torch.tensor(train_step(fresh, fresh_opt, step)))


def test_negative_second_moment_is_stored_exact_and_logged(caplog):
    state = {"optimizer": {"state": {0: {"square_avg": torch.rand(8192)}}}}
    state["optimizer"]["state"][0]["square_avg"][5] = -1.0
    with caplog.at_level(logging.WARNING):
        q = tw_triton.quantize_state_dict(state, rules="smallest")
    assert q.entries["optimizer/state/0/square_avg"].codec == "exact"
    assert "negative" in caplog.text and "square_avg" in caplog.text


def test_unknown_state_is_exact_and_logged_once_per_name(caplog, monkeypatch):
    monkeypatch.setattr(roles, "_logged_unknown", set())
    state = {"optimizer": {"state": {0: {"hessian": torch.rand(8192)}, 1: {"hessian": torch.rand(8192)}}}}
    with caplog.at_level(logging.WARNING):
        q = tw_triton.quantize_state_dict(state, rules="smallest")
        tw_triton.quantize_state_dict(state, rules="small")
    assert q.entries["optimizer/state/0/hessian"].codec == "exact"
    assert caplog.text.count("'hessian' has no role") == 1
