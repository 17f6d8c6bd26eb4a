"""A model that changes between two saves of a chain (grown and given a new param group,
an embedding resized, a part removed, a weight reshaped, the optimizer's state reset): the
save after the change is a keyframe, logged, and every save is written and loads within the
codec's error (it was an error at every save until the next scheduled keyframe)."""

from __future__ import annotations

import logging

import pytest
import torch

from tw_triton.checkpointer import Checkpointer


def build():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(100, 64), "head": torch.nn.Linear(64, 100)})
    model["extra"] = torch.nn.Linear(64, 80)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def grow(model, opt):
    model["more"] = torch.nn.Linear(64, 90)
    opt.add_param_group({"params": list(model["more"].parameters())})


def resize(model, opt):
    # As resize_token_embeddings: a new, larger table whose rows start as the old ones.
    old, new = model["emb"].weight, torch.nn.Embedding(120, 64)
    with torch.no_grad():
        new.weight[:100] = old
    model["emb"] = new
    group = opt.param_groups[0]
    group["params"] = [new.weight if p is old else p for p in group["params"]]
    opt.state.pop(old, None)


def remove(model, opt):
    gone = set(model["extra"].parameters())
    del model["extra"]
    group = opt.param_groups[0]
    group["params"] = [p for p in group["params"] if p not in gone]
    for p in gone:
        opt.state.pop(p, None)


def reshape(model, opt):
    remove(model, opt)
    model["extra"] = torch.nn.Linear(32, 160)  # as many elements, another shape
    opt.add_param_group({"params": list(model["extra"].parameters())})


def reset_optimizer(model, opt):
    opt.state.clear()


CHANGES = {f.__name__: f for f in (grow, resize, remove, reshape, reset_optimizer)}


def train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 100, (8,), generator=g)
    y = model["head"](model["emb"](x))
    loss = y.square().mean() + sum(p.square().mean() for n, p in model.named_parameters() if "head" not in n)
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("async_write", [True, False])
@pytest.mark.parametrize("delta", ["closed", "open"])
@pytest.mark.parametrize("change", CHANGES)
def test_a_model_changed_mid_chain_starts_a_keyframe(tmp_path, caplog, change, delta, async_write):
    model, opt = build()
    saved = {}
    with caplog.at_level(logging.INFO, logger="tw_triton"):
        with Checkpointer(
            tmp_path, keyframe_every=10, keep_last=None, delta=delta, async_write=async_write
        ) as ck:
            for step in range(5):
                if step == 2:
                    CHANGES[change](model, opt)
                    if change == "reset_optimizer":  # the state as saved: no moments yet
                        ck.save(step, model=model, optimizer=opt)
                        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
                        continue
                train(model, opt, step)
                ck.save(step, model=model, optimizer=opt)
                saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert "does not fit the reference" in caplog.text
    ckpt = Checkpointer(tmp_path)
    kinds = {i.step: i.kind for i in ckpt.infos()}
    assert kinds == {0: "keyframe", 1: "delta", 2: "keyframe", 3: "delta", 4: "delta"}
    for step, want in saved.items():
        got = ckpt.load(step)["model"]
        assert got.keys() == want.keys(), step
        for name, value in want.items():
            err = (got[name] - value).norm() / value.norm()
            assert err < 0.02, (step, name, float(err))
    # Training goes on from the newest, in fresh objects changed as the model was.
    fresh, fresh_opt = build()
    if change != "reset_optimizer":
        CHANGES[change](fresh, fresh_opt)
    train(fresh, fresh_opt, 100)
    ckpt.restore(model=fresh, optimizer=fresh_opt)
    for name, value in fresh.state_dict().items():
        assert (value - saved[4][name]).norm() / saved[4][name].norm() < 0.02, name
    train(fresh, fresh_opt, 101)


def test_a_state_of_the_last_saves_layout_is_not_checked_again(tmp_path, monkeypatch):
    """The check selects a rule per entry; a save laid out as the last one (same paths,
    shapes and dtypes) against the same reference fits it, so a steady run never pays it."""
    from tw_triton import save_pipeline

    calls = []
    check = save_pipeline.reference_misfit
    monkeypatch.setattr(save_pipeline, "reference_misfit", lambda *a: calls.append(1) or check(*a))
    model, opt = build()
    with Checkpointer(tmp_path, keyframe_every=4, keep_last=None, fsync=False) as ck:
        for step in range(6):
            train(model, opt, step)
            ck.save(step, model=model, optimizer=opt)
        assert calls == []
        grow(model, opt)
        train(model, opt, 6)
        ck.save(6, model=model, optimizer=opt)  # checked: a keyframe
        assert calls == [1]
        for step in range(7, 9):
            train(model, opt, step)
            ck.save(step, model=model, optimizer=opt)
    assert calls == [1]
    kinds = [i.kind for i in Checkpointer(tmp_path).infos()]
    assert kinds == ["keyframe", "delta", "delta", "delta", "keyframe", "delta", "keyframe", "delta", "delta"]


def test_the_fit_check_does_not_keep_a_dropped_reference_alive(tmp_path):
    """It remembers the reference it checked against weakly: a reference the chain drops
    (a keyframe, a restart) must free its tensors, on a GPU its device memory."""
    import gc
    import weakref

    model, opt = build()
    with Checkpointer(tmp_path, keyframe_every=4, keep_last=None, fsync=False, async_write=False) as ck:
        for step in range(2):
            train(model, opt, step)
            ck.save(step, model=model, optimizer=opt)
        chain = ck._pipeline.chain
        dropped = weakref.ref(chain.reference)
        chain.restart()
        gc.collect()
        assert dropped() is None
        train(model, opt, 2)
        ck.save(2, model=model, optimizer=opt)  # a keyframe, after the restart
        assert chain.reference is not None
