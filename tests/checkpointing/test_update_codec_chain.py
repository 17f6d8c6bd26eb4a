"""``blockwise-update`` in a Checkpointer's chain: ``exp_avg`` coded with the second moment
of the same file (log2 in keyframes, log2-temporal deltas between them), closed and open
loop, sync and async; restore() puts back what load() returns, and a run restarted after
every save writes the same codes as one that never stopped."""

from __future__ import annotations

import os

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.codecs import get_codec
from tw_triton.rules import resolve_rules, rules_as_specs
from tw_triton.tree import flatten

STEPS = 8
M, V = "optimizer/state/0/exp_avg", "optimizer/state/0/exp_avg_sq"


def update_rules() -> list:
    """``smallest``'s rules with ``exp_avg`` coded in the update's domain at 3 bits."""
    z = torch.zeros(64, 64)
    template = {"model": {"w": z}, "optimizer": {"state": {0: {"exp_avg": z, "exp_avg_sq": z}}}}
    spec = {"codec": "blockwise-update", "bits": 3, "block": 128, "min_numel": 4096}
    return [("*exp_avg", spec), *rules_as_specs(resolve_rules("smallest", template, bits=8, block=128))]


def make_objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 80))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def set_values(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """The training values of ``step``, whatever was restored before: moments of the same
    gradients, the second one drifting slowly (temporal codes between keyframes)."""
    base = torch.Generator().manual_seed(1)
    drift = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=base) + 0.02 * step * torch.randn(p.shape, generator=drift)
            )
            g = torch.randn(p.shape, generator=base) * torch.exp2(torch.randn(p.shape, generator=base))
            st = opt.state[p]
            st["step"].fill_(step + 1)
            st["exp_avg"].copy_(1e-3 * g * torch.randn(p.shape, generator=drift))
            st["exp_avg_sq"].copy_(1e-6 * g.square() * (1 + 0.05 * step))


def run(directory, restart_every: int | None, **options) -> None:
    options = {"keyframe_every": 4, "keep_last": None, "fsync": False, "rules": update_rules(), **options}
    model, opt = make_objects()
    ck = tw_triton.Checkpointer(directory, **options)
    for step in range(STEPS):
        if restart_every is not None and step and step % restart_every == 0:
            ck.close()
            ck = tw_triton.Checkpointer(directory, **options)
            model, opt = make_objects(seed=step)
            assert ck.restore(model=model, optimizer=opt)["step"] == step - 1
        set_values(model, opt, step)
        ck.save(step, model=model, optimizer=opt).result()
    ck.close()


def codes(path) -> dict:
    q = fmt.read_file(path)
    return {
        p: (e.codec, e.params, {n: b.numpy().tobytes() for n, b in e.buffers.items()})
        for p, e in q.entries.items()
    }


@pytest.mark.parametrize("async_write", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("delta", ["closed", "open"])
def test_update_codes_through_keyframes_and_deltas(tmp_path, async_write, delta):
    run(tmp_path / "a", None, async_write=async_write, delta=delta)
    names = sorted(os.listdir(tmp_path / "a"))
    assert len(names) == STEPS
    for name in names:
        m = fmt.read_manifest(tmp_path / "a" / name)
        kind, entries = m["metadata"]["kind"], m["entries"]
        for k in range(4):
            moment = entries[f"optimizer/state/{k}/exp_avg"]
            partner = f"optimizer/state/{k}/exp_avg_sq"
            if k % 2:  # the biases are under min_numel
                assert moment["codec"] == "exact"
                continue
            assert moment["codec"] == "blockwise-update" and moment["params"]["partner"] == partner, name
            want = "log2" if kind == "keyframe" else "log2-temporal"
            assert entries[partner]["codec"] == want, name
    # restore() puts back exactly what load() returns, for the newest (a delta) and a keyframe.
    for step in (STEPS - 1, 4):
        ck = tw_triton.Checkpointer(tmp_path / "a", keep_last=None)
        loaded = ck.load(step)
        model, opt = make_objects(seed=99)
        ck.restore(step, model=model, optimizer=opt)
        ck.close()
        restored = opt.state_dict()["state"]
        for k, st in loaded["optimizer"]["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(restored[k][key], st[key]), (step, k, key)


@pytest.mark.parametrize("async_write", [True, False], ids=["async", "sync"])
def test_a_run_restarted_after_every_save_writes_the_same_codes(tmp_path, async_write):
    run(tmp_path / "a", None, async_write=async_write)
    run(tmp_path / "b", 1, async_write=async_write)
    for name in sorted(os.listdir(tmp_path / "a")):
        assert codes(tmp_path / "a" / name) == codes(tmp_path / "b" / name), name


@pytest.mark.parametrize("async_write", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("prepare", [False, True], ids=["first-save", "prepared"])
def test_a_save_decodes_each_second_moment_once(tmp_path, monkeypatch, async_write, prepare):
    """The encode decodes ``exp_avg_sq`` to code ``exp_avg`` with it; the closed loop's
    reference (a keyframe's reconstruction, a delta's advance) takes that decode instead of
    decoding the entry again, and ends up what a loader decodes."""
    decoded: list[str] = []
    for name in ("log2", "log2-temporal"):
        cls = type(get_codec(name))
        for method in ("decode", "decode_over"):
            original = getattr(cls, method)

            def spy(self, entry, reference, device, context, _original=original):
                decoded.append(context)
                return _original(self, entry, reference, device, context)

            monkeypatch.setattr(cls, method, spy)
    model, opt = make_objects()
    partnered = sum(p.numel() >= 4096 for p in model.parameters())  # (update_rules' min_numel)
    ck = tw_triton.Checkpointer(
        tmp_path, keyframe_every=4, keep_last=None, fsync=False, rules=update_rules(), async_write=async_write
    )
    if prepare:
        ck.prepare(model=model, optimizer=opt)
    for step in range(3):  # a keyframe, then two deltas
        set_values(model, opt, step)
        decoded.clear()
        ck.save(step, model=model, optimizer=opt).result()
        assert len([c for c in decoded if "exp_avg_sq" in c]) == partnered, (step, decoded)
    reference = ck._pipeline.chain.reference  # noqa: SLF001 - the closed loop's reference
    ck.close()
    loaded = tw_triton.load(ck.path_for(2), reference=ck.path_for(1))
    assert torch.equal(flatten(reference.tree)[0][V], loaded["optimizer"]["state"][0]["exp_avg_sq"])
