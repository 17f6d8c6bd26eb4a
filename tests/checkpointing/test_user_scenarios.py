"""Training states users save, through the Checkpointer's defaults: saved as keyframes and
deltas, restored into freshly built objects from each file, and trained on. Weights come
back bit for bit from a keyframe and within the codec's error from a delta; everything that
is not a float (counters, steps, scheduler and scaler values) exactly; the coded moments
within their codecs' error (docs/training-loop.md, "What is saved")."""

from __future__ import annotations

import math
import os

import pytest
import torch
from safetensors.torch import save_file

from tw_triton.checkpointer import Checkpointer

L = torch.optim.lr_scheduler


def clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def assert_restored(got, want, path: str, keyframe: bool) -> None:
    """``got`` is ``want`` as the docs promise (see the module docstring)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and (got.dtype, got.shape) == (want.dtype, want.shape), path
        if not want.is_floating_point() or want.numel() == 0:
            assert torch.equal(got, want), path
        elif "/state/" in path and not path.endswith("/step"):  # a moment, coded by its role
            assert float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)) < 0.3, (
                path
            )
        elif keyframe or want.numel() < 4096:
            assert torch.equal(got, want), path
        else:
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 0.02, path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_restored(got[key], want[key], f"{path}/{key}", keyframe)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_restored(g, w, f"{path}/{i}", keyframe)
    else:
        assert type(got) is type(want), path
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got)), path


def save_restore_train(directory, build, train, steps: int = 6) -> dict:
    """Train ``steps`` steps saving each (keyframe_every=3: keyframes and deltas), then
    restore each file into fresh objects, check them, and train on. Returns the objects
    restored from the last file."""
    objects, saved = build(0), {}
    with Checkpointer(directory, keyframe_every=3, keep_last=None, fsync=False) as ckpt:
        for step in range(steps):
            train(objects, step)
            ckpt.save(step, **objects)
            saved[step] = {name: clone(obj.state_dict()) for name, obj in objects.items()}
    infos = Checkpointer(directory).infos()
    assert {i.kind for i in infos} == {"keyframe", "delta"}
    for info in infos:
        fresh = build(1)
        Checkpointer(directory).restore(info.step, **fresh)
        for name, obj in fresh.items():
            assert_restored(obj.state_dict(), saved[info.step][name], name, info.kind == "keyframe")
        for step in range(steps, steps + 2):
            assert math.isfinite(train(fresh, step))
    return fresh


def batch(step: int, n: int = 64) -> torch.Tensor:
    return torch.randn(16, n, generator=torch.Generator().manual_seed(step))


def mlp(*middle: torch.nn.Module) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(64, 128), *middle, torch.nn.Tanh(), torch.nn.Linear(128, 64))


def plain_train(objects, step: int) -> float:
    model, opt = objects["model"], objects["optimizer"]
    x = batch(step).to(next(model.parameters()).dtype)
    loss = (model(x).float() - x.float()).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def test_batchnorm_running_stats_and_counter(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = mlp(torch.nn.BatchNorm1d(128))
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}

    fresh = save_restore_train(tmp_path, build, plain_train)
    assert fresh["model"][1].num_batches_tracked.item() == 8  # 6 saved steps, 2 after


class TiedLM(torch.nn.Module):
    """GPT-2 style: the output head is the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(128, 64)
        self.mix = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 128, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.wte(tokens))))


def test_tied_embedding_and_head_stay_tied(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = TiedLM()
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2)}

    def train(objects, step):
        model, opt = objects["model"], objects["optimizer"]
        tokens = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    save_restore_train(tmp_path, build, train)
    for step in Checkpointer(tmp_path).steps():  # a keyframe and deltas
        model = build(2)["model"]
        Checkpointer(tmp_path).restore(step, model=model, rng=False)
        assert model.head.weight is model.wte.weight


SCHEDULERS = {
    "OneCycleLR": lambda opt: L.OneCycleLR(opt, max_lr=1e-2, total_steps=100),
    "LambdaLR": lambda opt: L.LambdaLR(opt, lambda epoch: 0.9**epoch),  # the lambda is not saved
    "ReduceLROnPlateau": lambda opt: L.ReduceLROnPlateau(opt, patience=1),
    "SequentialLR": lambda opt: L.SequentialLR(
        opt, [L.LinearLR(opt, 0.1, total_iters=3), L.CosineAnnealingLR(opt, 10)], milestones=[3]
    ),
    "CyclicLR": lambda opt: L.CyclicLR(opt, 1e-4, 1e-2, step_size_up=3),
    "MultiStepLR": lambda opt: L.MultiStepLR(opt, milestones=[2, 4, 4]),  # milestones: a Counter
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_lr_scheduler_and_grad_scaler(tmp_path, name):
    def build(seed):
        torch.manual_seed(seed)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return {"model": model, "optimizer": opt, "scheduler": SCHEDULERS[name](opt), "scaler": scaler}

    def train(objects, step):
        model, opt, sched, scaler = (objects[k] for k in ("model", "optimizer", "scheduler", "scaler"))
        x = batch(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x).float() - x).square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step(loss.item()) if isinstance(sched, L.ReduceLROnPlateau) else sched.step()
        return loss.item()

    fresh = save_restore_train(tmp_path, build, train)
    assert fresh["scaler"].get_scale() == 2.0**10 * 2**4  # grew every 2 of the 8 steps


def test_param_groups_frozen_parameters_and_a_group_added_later(tmp_path):
    """Groups with their own lr, weight decay and betas; a frozen layer in a group (no
    optimizer state); a group added after the first saves; a save before the first step."""

    def build(seed, late=False):
        torch.manual_seed(seed)
        model = torch.nn.ModuleDict({n: torch.nn.Linear(64, 96) for n in ("a", "b", "frozen", "late")})
        model["frozen"].requires_grad_(False)
        opt = torch.optim.AdamW(
            [
                {"params": model["a"].parameters(), "lr": 1e-3, "weight_decay": 0.0},
                {
                    "params": [*model["b"].parameters(), model["frozen"].weight],
                    "lr": 3e-3,
                    "betas": (0.8, 0.95),
                },
            ]
        )
        if late:
            opt.add_param_group({"params": model["late"].parameters(), "lr": 5e-4})
        return {"model": model, "optimizer": opt}

    def train(objects, step):
        model, opt = objects["model"], objects["optimizer"]
        if step == 3 and len(opt.param_groups) == 2:
            opt.add_param_group({"params": model["late"].parameters(), "lr": 5e-4})
        x = batch(step)
        loss = sum(model[n](x).square().mean() for n in ("a", "b", "frozen", "late"))
        opt.zero_grad()
        loss.backward()
        if step > 0:  # the first save holds no optimizer state
            opt.step()
        return loss.item()

    objects, saved = build(0), {}
    with Checkpointer(tmp_path, keyframe_every=3, keep_last=None, fsync=False) as ckpt:
        for step in range(6):
            train(objects, step)
            ckpt.save(step, **objects)
            saved[step] = {name: clone(obj.state_dict()) for name, obj in objects.items()}
    assert saved[0]["optimizer"]["state"] == {}
    for info in Checkpointer(tmp_path).infos():
        fresh = build(1, late=info.step >= 3)
        Checkpointer(tmp_path).restore(info.step, **fresh)
        for name, obj in fresh.items():
            assert_restored(obj.state_dict(), saved[info.step][name], name, info.kind == "keyframe")
        assert not fresh["model"]["frozen"].weight.requires_grad
        assert math.isfinite(train(fresh, 10))


class Buffers(torch.nn.Module):
    """fp32 parameters and low-precision buffers, large and small."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.register_buffer("table", torch.randn(80, 64).bfloat16())
        self.register_buffer("halves", torch.randn(70, 64).half())
        self.register_buffer("small", torch.randn(10).bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.table.float().mean(0) + self.halves.float().mean(0)


@pytest.mark.parametrize("kind", ["fp16 parameters", "bf16 buffers"])
def test_low_precision_parameters_and_buffers(tmp_path, kind):
    def build(seed):
        torch.manual_seed(seed)
        model = mlp().half() if kind == "fp16 parameters" else Buffers()
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)}

    def train(objects, step):
        loss = plain_train(objects, step)
        if isinstance(objects["model"], Buffers):
            with torch.no_grad():
                objects["model"].table.add_(0.01)
                objects["model"].halves.mul_(0.99)
        return loss

    save_restore_train(tmp_path, build, train)


OPTIMIZERS = {
    "Adam fused": lambda p: torch.optim.Adam(p, fused=True),
    "AdamW fused amsgrad": lambda p: torch.optim.AdamW(p, fused=True, amsgrad=True),
    "SGD fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adagrad fused": lambda p: torch.optim.Adagrad(p, fused=True),
    "Adam foreach=False": lambda p: torch.optim.Adam(p, foreach=False),
    "Adam tensor lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-3)),
    "LBFGS strong_wolfe": lambda p: torch.optim.LBFGS(
        p, lr=0.5, history_size=4, max_iter=3, line_search_fn="strong_wolfe"
    ),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_variants(tmp_path, name):
    """Options beyond tests/checkpointing/test_optimizers.py's: fused CPU kernels, the
    per-tensor loop, a tensor lr, and LBFGS's lists of directions with a line search."""

    def build(seed):
        torch.manual_seed(seed)
        model = mlp()
        return {"model": model, "optimizer": OPTIMIZERS[name](model.parameters())}

    def train(objects, step):
        model, opt = objects["model"], objects["optimizer"]
        x = batch(step)

        def closure():
            opt.zero_grad()
            loss = (model(x) - x.flip(1)).square().mean()
            loss.backward()
            return loss

        return opt.step(closure).item()

    save_restore_train(tmp_path, build, train)


class Odd(torch.nn.Module):
    """A 0-element and a 0-dim parameter, an empty buffer and a 0-dim integer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.empty = torch.nn.Parameter(torch.empty(0, 4))
        self.temperature = torch.nn.Parameter(torch.tensor(1.5))
        self.register_buffer("nothing", torch.empty(0))
        self.register_buffer("count", torch.tensor(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.temperature + self.empty.sum()


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD", "Adagrad"])
def test_zero_element_and_zero_dim_parameters(tmp_path, optimizer):
    def build(seed):
        torch.manual_seed(seed)
        model = Odd()
        return {"model": model, "optimizer": getattr(torch.optim, optimizer)(model.parameters(), lr=1e-2)}

    def train(objects, step):
        objects["model"].count += 1
        return plain_train(objects, step)

    fresh = save_restore_train(tmp_path, build, train)
    assert fresh["model"].count.item() == 8


def test_a_model_with_no_tensor_to_delta_code(tmp_path):
    """Nothing reaches the 4096-element floor: every save holds the whole state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(tmp_path, keyframe_every=3, keep_last=None, fsync=False) as ckpt:
        for step in range(4):
            loss = model(batch(step, 8)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.save(step, model=model, optimizer=opt)
    infos = Checkpointer(tmp_path).infos()
    assert [i.kind for i in infos] == ["keyframe", "standalone", "standalone", "keyframe"]
    for info in infos[1:3]:
        assert info.reference_id is None
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    Checkpointer(tmp_path).restore(2, model=fresh, rng=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), Checkpointer(tmp_path).load(2)["model"].values())
    )


def test_unrelated_entries_in_the_directory_are_left_alone(tmp_path):
    """Notes, subdirectories, a dangling link, stock safetensors files (one with a
    checkpoint's name), a directory with a checkpoint's name: listed never, kept always."""
    (tmp_path / "logs" / "inner").mkdir(parents=True)
    (tmp_path / "README.md").write_text("notes")
    (tmp_path / "step-00000001.tw.safetensors.bak").write_text("a backup")
    (tmp_path / "step-00000100.tw.safetensors").mkdir()
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    save_file({"w": torch.zeros(3)}, tmp_path / "model.safetensors")
    save_file({"w": torch.zeros(3)}, tmp_path / "step-00000060.tw.safetensors")
    before = set(os.listdir(tmp_path))

    def build(seed):
        torch.manual_seed(seed)
        model = mlp()
        return {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3)}

    save_restore_train(tmp_path, build, plain_train)
    ckpt = Checkpointer(tmp_path, keep_last=1)
    assert ckpt.steps() == list(range(6)) and ckpt.latest() == 5
    ckpt.save(6, **build(0))
    ckpt.close()
    left = set(os.listdir(tmp_path))
    assert before <= left and left - before == {"step-00000006.tw.safetensors"}


def _compiled(model):
    return torch.compile(model, backend="eager")  # the _orig_mod. prefix, without a compiler


@pytest.mark.parametrize(
    "saved_as,restored_as",
    [
        (_compiled, lambda m: m),  # compiled for training, restored before compiling again
        (lambda m: m, _compiled),  # restored into a model compiled first
        (torch.nn.DataParallel, lambda m: m),  # module. (as DDP writes it)
        (lambda m: m, torch.nn.DataParallel),
        (lambda m: _compiled(torch.nn.DataParallel(m)), lambda m: m),
    ],
)
def test_a_model_saved_and_restored_under_other_wrappers_restores(tmp_path, saved_as, restored_as):
    # torch.compile and DDP/DataParallel prefix every key ('_orig_mod.', 'module.'); the
    # model the checkpoint is restored into is often not wrapped the same way (compiled
    # after the restore, wrapped by DDP only on some runs). restore() refused it:
    # 'Missing key(s) ... Unexpected key(s)', for the same weights under another prefix.
    torch.manual_seed(0)
    inner = mlp()
    model = saved_as(inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with Checkpointer(tmp_path, keyframe_every=2, fsync=False) as ckpt:
        for step in range(3):  # 0 keyframe, 1 delta, 2 keyframe
            plain_train({"model": model, "optimizer": opt}, step)
            ckpt.save(step, model=model, optimizer=opt)
    fresh_inner = mlp()
    fresh = restored_as(fresh_inner)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = Checkpointer(tmp_path).restore(model=fresh, optimizer=fresh_opt)
    assert state["step"] == 2
    for got, want in zip(fresh_inner.state_dict().values(), inner.state_dict().values()):
        assert torch.equal(got, want)
    assert torch.equal(fresh_opt.state[fresh_opt.param_groups[0]["params"][0]]["step"], torch.tensor(3.0))


def test_a_model_that_differs_by_more_than_a_wrapper_is_still_refused(tmp_path):
    from tw_triton.errors import CheckpointError

    model = _compiled(mlp())
    with Checkpointer(tmp_path, fsync=False) as ckpt:
        ckpt.save(0, model=model)
    other = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 64)
    )
    with pytest.raises(CheckpointError, match="does not fit the Sequential"):
        Checkpointer(tmp_path).restore(model=other)
