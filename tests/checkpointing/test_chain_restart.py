"""A chain of deltas survives a restart (tw_triton.chain_restart): after ``restore`` the next
save is a delta against the restored state, and a run restarted after every save writes the
same codes as one that never stopped, given the same training values."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import tw_triton
from tw_triton import chain_restart
from tw_triton import format as fmt

STEPS = 12


def make_objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 80))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW makes its moments now
    return model, opt


def set_values(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """The training values of ``step``: the same whatever was restored before."""
    base = torch.Generator().manual_seed(1)
    drift = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=base) + 0.02 * step * torch.randn(p.shape, generator=drift)
            )
            st = opt.state[p]
            st["step"].fill_(step + 1)
            st["exp_avg"].copy_(1e-3 * torch.randn(p.shape, generator=drift))
            st["exp_avg_sq"].copy_(1e-6 * torch.rand(p.shape, generator=drift))


def run(directory, restart_every: int | None, steps: int = STEPS, **options) -> list[int]:
    """Save ``steps`` times; with ``restart_every``, a fresh Checkpointer and fresh objects
    restore the latest checkpoint after every that many saves. Returns the bytes written."""
    options = {"keyframe_every": 4, "keep_last": None, "fsync": False, **options}
    torch.manual_seed(0)
    model, opt = make_objects()
    ck = tw_triton.Checkpointer(directory, **options)
    sizes = []
    for step in range(steps):
        if restart_every is not None and step and step % restart_every == 0:
            ck.close()
            ck = tw_triton.Checkpointer(directory, **options)
            model, opt = make_objects(seed=step)
            assert ck.restore(model=model, optimizer=opt)["step"] == step - 1
        set_values(model, opt, step)
        sizes.append(ck.save(step, model=model, optimizer=opt).result())
    ck.close()
    return sizes


def codes(path: str) -> dict:
    """What a file codes: every entry's codec, params, dtype, shape and buffer bytes, its
    kind and reference step (not its ids or time)."""
    q = fmt.read_file(path)
    entries = {
        p: (e.codec, e.params, e.dtype, e.shape, {n: b.numpy().tobytes() for n, b in e.buffers.items()})
        for p, e in q.entries.items()
    }
    meta = q.metadata
    return {
        "entries": entries,
        "aliases": q.aliases,
        "rules": q.rules,
        "skeleton": q.skeleton,
        "kind": meta["kind"],
        "reference_step": meta.get("reference_step"),
        "delta_mode": meta.get("delta_mode"),
    }


def kinds(directory) -> list[str]:
    return [
        fmt.read_manifest(os.path.join(directory, n))["metadata"]["kind"]
        for n in sorted(os.listdir(directory))
    ]


@pytest.mark.parametrize("async_write", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("delta", ["closed", "open"])
def test_a_run_restarted_after_every_save_writes_the_same_codes(tmp_path, async_write, delta):
    a, b = tmp_path / "a", tmp_path / "b"
    run(a, None, async_write=async_write, delta=delta)
    run(b, 1, async_write=async_write, delta=delta)
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b)) and len(names) == STEPS
    expected_kinds = ["keyframe", "delta", "delta", "delta"] * (STEPS // 4)
    if delta == "open":
        # An open-loop delta's reference is its keyframe, which a restore of it does not
        # hold: only a restored keyframe continues.
        assert kinds(a) == expected_kinds
        assert kinds(b) == ["keyframe", "delta"] * (STEPS // 2)
        return
    assert kinds(a) == kinds(b) == expected_kinds  # keyframe_every counts across restarts
    for name in names:
        assert codes(str(a / name)) == codes(str(b / name)), name
    # And the restarted run's newest checkpoint loads as the other's does.
    ca, cb = tw_triton.Checkpointer(a), tw_triton.Checkpointer(b)
    la, lb = ca.load(), cb.load()
    for key in la["model"]:
        assert torch.equal(la["model"][key], lb["model"][key])


def test_a_host_reference_continues_the_chain_across_restarts(tmp_path, monkeypatch):
    """reference_device="cpu": a restore keeps its copy in host memory and the chain goes
    on, with the codes of the run that never stopped."""
    seen = []
    real = chain_restart.seed_chain
    monkeypatch.setattr(
        tw_triton.checkpointer,
        "seed_chain",
        lambda *a, **k: seen.append(k.get("host_reference")) or real(*a, **k),
    )
    run(tmp_path / "a", None, steps=6, reference_device="cpu")
    run(tmp_path / "b", 1, steps=6, reference_device="cpu")
    assert seen and all(seen)
    assert (
        kinds(tmp_path / "b")
        == kinds(tmp_path / "a")
        == ["keyframe", "delta", "delta", "delta"]
        + [
            "keyframe",
            "delta",
        ]
    )
    for name in sorted(os.listdir(tmp_path / "a")):
        assert codes(str(tmp_path / "a" / name)) == codes(str(tmp_path / "b" / name)), name


def test_every_entry_the_chain_keeps_as_reference_is_restored(tmp_path):
    """Rules that delta-code a first moment too: the restored chain keeps it as reference
    like the weights, and the codes are still those of the run that never stopped."""
    rules = [("optimizer/state/*/exp_avg", {"codec": "blockwise", "bits": 8, "delta": True, "min_numel": 0})]
    run(tmp_path / "a", None, steps=6, rules=rules)
    run(tmp_path / "b", 1, steps=6, rules=rules)
    for name in sorted(os.listdir(tmp_path / "a")):
        a, b = codes(str(tmp_path / "a" / name)), codes(str(tmp_path / "b" / name))
        assert a == b, name
        moment = a["entries"]["optimizer/state/0/exp_avg"]
        assert moment[0] == "blockwise" if a["kind"] == "delta" else moment[0] == "exact"
    # What a restore keeps: the large weights (the default rules) and every first moment.
    model, opt = make_objects()
    ck = tw_triton.Checkpointer(tmp_path / "b", keep_last=None, rules=rules)
    ck.restore(model=model, optimizer=opt)
    weights = [p for p in model.parameters() if p.numel() >= 4096]
    assert ck.reference_nbytes == 4 * (
        sum(p.numel() for p in weights) + sum(p.numel() for p in model.parameters())
    )
    ck.close()


def test_a_preempted_run_writes_at_most_a_quarter_more(tmp_path):
    """Restored after every 5th save, with the defaults but for the keyframe interval."""
    plain = run(tmp_path / "a", None, steps=30, keyframe_every=10)
    preempted = run(tmp_path / "b", 5, steps=30, keyframe_every=10)
    assert sum(preempted) <= 1.25 * sum(plain)  # the goal
    # It is the same files: but for the ids in the headers, the same bytes (a preempted run
    # that starts a keyframe at each restore writes 18% more on this state).
    assert abs(sum(preempted) - sum(plain)) <= 0.001 * sum(plain)
    assert kinds(tmp_path / "b") == kinds(tmp_path / "a")


def test_keyframe_every_counts_links_across_restarts(tmp_path):
    run(tmp_path, 3, steps=11, keyframe_every=5)
    assert kinds(tmp_path) == ["keyframe", "delta", "delta", "delta", "delta"] * 2 + ["keyframe"]


def restore_then_save(directory, caplog, step, *, model=None, **options):
    ck = tw_triton.Checkpointer(directory, fsync=False, keep_last=None, **options)
    m, opt = make_objects(seed=5)
    with caplog.at_level(logging.INFO, logger="tw_triton"):
        ck.restore(model=m, optimizer=opt)
        set_values(m, opt, step)
        ck.save(step, model=model if model is not None else m, optimizer=opt).result()
    ck.close()
    return fmt.read_manifest(ck.path_for(step))["metadata"]["kind"]


def test_other_rules_start_a_keyframe_and_say_why(tmp_path, caplog):
    run(tmp_path, None, steps=2)
    assert restore_then_save(tmp_path, caplog, 2, keyframe_every=4, block=64) == "keyframe"
    assert "other rules" in caplog.text


def test_restoring_an_older_step_starts_a_keyframe(tmp_path, caplog):
    run(tmp_path, None, steps=3)
    ck = tw_triton.Checkpointer(tmp_path, fsync=False, keep_last=None, keyframe_every=4)
    m, opt = make_objects()
    with caplog.at_level(logging.INFO, logger="tw_triton"):
        ck.restore(1, model=m, optimizer=opt)
        ck.save(5, model=m, optimizer=opt).result()
    ck.close()
    assert "not the newest checkpoint" in caplog.text
    assert fmt.read_manifest(ck.path_for(5))["metadata"]["kind"] == "keyframe"
    # The restore says that restore() without a step goes back to the newer files, at INFO:
    # restoring an older step to look at it is no mistake; a save before them warns
    # (tests/checkpointing/test_rewound_runs.py), this one (step 5) passes them.
    told = [r for r in caplog.records if "but step 2 is newer" in r.getMessage()]
    assert len(told) == 1 and "restored step 1 of" in told[0].getMessage()
    assert told[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_restoring_the_newest_step_warns_of_nothing(tmp_path, caplog):
    run(tmp_path, None, steps=3)
    ck = tw_triton.Checkpointer(tmp_path, fsync=False, keep_last=None, keyframe_every=4)
    m, opt = make_objects()
    with caplog.at_level(logging.WARNING, logger="tw_triton"):
        ck.restore(model=m, optimizer=opt)
    ck.close()
    assert "is newer" not in caplog.text


def test_a_state_that_changed_after_the_restore_starts_a_keyframe(tmp_path, caplog):
    run(tmp_path, None, steps=2)
    other = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.ReLU(), torch.nn.Linear(256, 81))
    assert restore_then_save(tmp_path, caplog, 2, keyframe_every=4, model=other) == "keyframe"
    assert "does not fit" in caplog.text


def test_a_chain_at_its_end_restores_to_a_keyframe(tmp_path, caplog):
    run(tmp_path, None, steps=4)  # keyframe and 3 deltas: the next is a keyframe
    assert restore_then_save(tmp_path, caplog, 4, keyframe_every=4) == "keyframe"
    assert restore_then_save(tmp_path, caplog, 5, keyframe_every=4) == "delta"


def test_retention_keeps_every_link_the_continued_chain_needs(tmp_path):
    run(tmp_path, 1, steps=7, keep_last=1, keyframe_every=6)
    ck = tw_triton.Checkpointer(tmp_path)
    # Step 6 is a keyframe: the chain of step 5 went with it; before that save, every link
    # from the keyframe of step 0 was kept however many restarts there were.
    assert ck.steps() == [6]
    run(tmp_path / "b", 1, steps=6, keep_last=1, keyframe_every=6)
    ck = tw_triton.Checkpointer(tmp_path / "b")
    assert ck.steps() == [0, 1, 2, 3, 4, 5]
    assert ck.load()["step"] == 5
