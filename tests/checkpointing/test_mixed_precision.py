"""Mixed precision through the Checkpointer's defaults: a bf16 model whose optimizer keeps fp32
master weights, and an fp32 model trained under autocast with a GradScaler (docs/training-loop.md,
"Mixed precision")."""

from __future__ import annotations

import io

import torch

from tw_triton.checkpointer import Checkpointer
from tw_triton.format import read_manifest


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))


def batch(step: int) -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(step))


class MasterWeights:
    """A bf16 model for the forward and backward, fp32 master weights for AdamW."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.master = mlp()
        self.model = mlp().to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=1e-3)
        self.sync()

    def sync(self) -> None:
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.master.parameters()):
                p.copy_(m)

    def step(self, i: int) -> None:
        x = batch(i).to(torch.bfloat16)
        self.model.zero_grad()
        (self.model(x) - x).float().square().mean().backward()
        for p, m in zip(self.model.parameters(), self.master.parameters()):
            m.grad = p.grad.float()
        self.opt.step()
        self.sync()


def test_bf16_model_with_fp32_master_weights(tmp_path):
    run = MasterWeights(0)
    with Checkpointer(tmp_path, keyframe_every=3, fsync=False, async_write=False) as ckpt:
        for i in range(6):
            run.step(i)
            if i % 2 == 1:
                # The master weights are the model's state; the bf16 copy is their rounding.
                ckpt.save(i, model=run.master, optimizer=run.opt)
        infos = ckpt.infos()
    delta = infos[-1]
    assert delta.kind == "delta"
    entries = read_manifest(delta.path)["entries"]
    assert (
        entries["model/0.weight"]["codec"] == "blockwise" and entries["model/0.weight"]["dtype"] == "float32"
    )
    assert entries["optimizer/state/0/exp_avg_sq"]["codec"] == "log2-temporal"  # fp32 moments of a delta
    buf = io.BytesIO()
    torch.save({"model": run.master.state_dict(), "optimizer": run.opt.state_dict()}, buf)
    assert delta.nbytes * 5 < len(buf.getvalue())

    fresh = MasterWeights(1)
    Checkpointer(tmp_path).restore(model=fresh.master, optimizer=fresh.opt)
    fresh.sync()
    for a, b in zip(fresh.master.parameters(), run.master.parameters()):
        assert float((a - b).norm() / b.norm()) < 0.01
    for a, b in zip(fresh.model.parameters(), run.model.parameters()):
        assert a.dtype == torch.bfloat16 and float((a.float() - b.float()).norm() / b.float().norm()) < 0.01
    for i in range(6, 10):
        fresh.step(i)
        run.step(i)
    for a, b in zip(fresh.master.parameters(), run.master.parameters()):
        assert float((a - b).norm() / b.norm()) < 0.02


def test_autocast_with_grad_scaler(tmp_path):
    def build(seed):
        torch.manual_seed(seed)
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
        return model, opt, scaler

    def step(model, opt, scaler, i):
        x = batch(i)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = (model(x) - x).float().square().mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    model, opt, scaler = build(0)
    with Checkpointer(tmp_path, keyframe_every=3, fsync=False, async_write=False) as ckpt:
        for i in range(6):
            step(model, opt, scaler, i)
            if i % 2 == 1:
                ckpt.save(i, model=model, optimizer=opt, scaler=scaler)
    entries = read_manifest(ckpt.infos()[-1].path)["entries"]
    assert (
        entries["model/0.weight"]["dtype"] == "float32" and entries["model/0.weight"]["codec"] == "blockwise"
    )
    fresh, fresh_opt, fresh_scaler = build(1)
    Checkpointer(tmp_path).restore(model=fresh, optimizer=fresh_opt, scaler=fresh_scaler)
    assert fresh_scaler.state_dict() == scaler.state_dict()
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert float((a - b).norm() / b.norm()) < 0.01
    for i in range(6, 10):
        step(fresh, fresh_opt, fresh_scaler, i)
        step(model, opt, scaler, i)
    assert fresh_scaler.state_dict() == scaler.state_dict()
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert float((a - b).norm() / b.norm()) < 0.02
