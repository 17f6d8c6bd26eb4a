"""The Checkpointer's default rules, ``"auto"`` (tw_triton.interval_rules): ``smallest`` for
saves fewer than ``LONG_INTERVAL_STEPS`` steps apart, ``safe`` from there, keyed to the
steps since the last save made or restored, or for a first save since the newest
checkpoint before it in the directory (never since step 0)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton import interval_rules
from tw_triton.checkpointer import DEFAULT_RULES
from tw_triton.rules import keyframe_rules, resolve_rules, rules_as_specs

LONG = interval_rules.LONG_INTERVAL_STEPS


def objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 96)).square().mean().backward()
    opt.step()  # AdamW makes its moments now
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(1000 + step)
    opt.zero_grad()
    model(torch.randn(4, 96)).square().mean().backward()
    opt.step()


def tree(model, opt, step):
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def recorded(directory, step: int) -> tuple[str, list]:
    """The kind and the recorded rules of the checkpoint of ``step``."""
    manifest = fmt.read_manifest(os.path.join(directory, f"step-{step:08d}.tw.safetensors"))
    return manifest["metadata"]["kind"], manifest["rules"]


def rules_of(preset: str, state, kind: str) -> list:
    rule_list = resolve_rules(preset, state, bits=8, block=128)
    if kind == "keyframe":
        rule_list = resolve_rules(rules_as_specs(keyframe_rules(rule_list)), state, bits=8, block=128)
    return [r.to_json() for r in rule_list]


def test_auto_is_the_default_and_picks_a_preset_by_the_interval():
    assert DEFAULT_RULES == interval_rules.AUTO
    assert interval_rules.rules_at("auto", None) == "smallest"
    assert interval_rules.rules_at("auto", LONG - 1) == "smallest"
    assert interval_rules.rules_at("auto", LONG) == "safe"
    for other in ("smallest", "safe", None, [("*", "exact")]):
        assert interval_rules.rules_at(other, 10 * LONG) == other
        assert interval_rules.candidates(other) == [other]
    # Without an interval (quantize_state_dict), "auto" is the short interval's preset.
    model, opt = objects()
    state = tree(model, opt, 0)
    assert rules_of("auto", state, "delta") == rules_of("smallest", state, "delta")


def save_at(directory, steps, model, opt, **options) -> None:
    options = {"keyframe_every": 4, "keep_last": None, "async_write": False, "fsync": False, **options}
    with tw_triton.Checkpointer(directory, **options) as ck:
        for step in steps:
            train(model, opt, step)
            ck.save(step, model=model, optimizer=opt)


@pytest.mark.parametrize("every", [10, LONG, 2 * LONG])
def test_the_saves_code_with_the_preset_of_their_interval(tmp_path, every):
    model, opt = objects()
    steps = [every * (i + 1) for i in range(5)]
    save_at(tmp_path, steps, model, opt)
    state = tree(model, opt, 0)
    # The first save counts from step 0 (nothing before it here): one preset throughout.
    preset = "safe" if every >= LONG else "smallest"
    kinds = ["keyframe"] + ["delta"] * 3 + ["keyframe"]
    expected = [(kind, preset) for kind in kinds]
    got = [recorded(tmp_path, step) for step in steps]
    assert got == [(kind, rules_of(preset, state, kind)) for kind, preset in expected]


@pytest.mark.parametrize("first", [1000, 100_000])
def test_a_first_save_far_from_step_0_in_an_empty_directory_counts_from_step_0(tmp_path, first):
    """Runs start at step 0: a first save far from it, with nothing before it in the
    directory, takes the long interval's preset, and the second (50 steps on) starts a
    keyframe of the short one's. (Counting such a save as of no known interval instead
    would give every fresh run saving 100 or more steps apart an extra keyframe.)"""
    model, opt = objects()
    steps = [first + 50 * i for i in range(4)]
    save_at(tmp_path, steps, model, opt)
    state = tree(model, opt, 0)
    expected = [("keyframe", "safe"), ("keyframe", "smallest"), ("delta", "smallest"), ("delta", "smallest")]
    assert [recorded(tmp_path, s) for s in steps] == [(k, rules_of(p, state, k)) for k, p in expected]


@pytest.mark.parametrize("every", [50, 2 * LONG])
def test_a_first_save_without_restore_counts_from_the_newest_checkpoint_there(tmp_path, every):
    """A process resumed without restore() (its state loaded otherwise) that saves on in the
    same directory: its first save is ``every`` steps after the newest checkpoint there (not
    10 000 and more after step 0, nor an unknown interval)."""
    model, opt = objects()
    steps = [10_000 + every * i for i in range(4)]
    save_at(tmp_path, steps[:2], model, opt)
    save_at(tmp_path, steps[2:], model, opt)  # a new Checkpointer, nothing restored
    preset = "safe" if every >= LONG else "smallest"
    state = tree(model, opt, 0)
    assert recorded(tmp_path, steps[2]) == ("keyframe", rules_of(preset, state, "keyframe"))
    assert recorded(tmp_path, steps[3]) == ("delta", rules_of(preset, state, "delta"))


def test_a_change_of_preset_starts_a_keyframe(tmp_path, caplog):
    """The presets delta-code other entries (safe keeps exp_avg_sq out of the chain)."""
    model, opt = objects()
    steps = [10, 20, 20 + LONG, 30 + LONG, 40 + LONG]
    with caplog.at_level(logging.INFO, logger="tw_triton.save_pipeline"):
        save_at(tmp_path, steps, model, opt)
    state = tree(model, opt, 0)
    got = [recorded(tmp_path, s) for s in steps]
    presets = ["smallest", "smallest", "safe", "smallest", "smallest"]
    kinds = ["keyframe", "delta", "keyframe", "keyframe", "delta"]
    assert got == [(k, rules_of(p, state, k)) for k, p in zip(kinds, presets)]
    assert sum("starts a keyframe" in r.getMessage() for r in caplog.records) == 2
    with tw_triton.Checkpointer(tmp_path) as ck:
        assert ck.load()["step"] == steps[-1]


def test_a_restore_counts_the_interval_from_the_restored_step(tmp_path):
    model, opt = objects()
    save_at(tmp_path, [0, LONG, 2 * LONG], model, opt)
    # A save LONG steps after the restored one continues its chain (same preset); 5 steps
    # after a restored save is a short interval, whatever its step.
    for seed, step in ((1, 3 * LONG), (2, 3 * LONG + 5)):
        model, opt = objects(seed=seed)
        with tw_triton.Checkpointer(tmp_path, keyframe_every=4, keep_last=None, fsync=False) as ck:
            ck.restore(model=model, optimizer=opt)
            train(model, opt, step)
            ck.save(step, model=model, optimizer=opt).result()
    state = tree(model, opt, 0)
    assert recorded(tmp_path, 2 * LONG) == ("delta", rules_of("safe", state, "delta"))
    assert recorded(tmp_path, 3 * LONG) == ("delta", rules_of("safe", state, "delta"))
    assert recorded(tmp_path, 3 * LONG + 5) == ("keyframe", rules_of("smallest", state, "keyframe"))


def test_the_device_memory_bound_of_auto_covers_both_presets(tmp_path):
    model, opt = objects()
    bounds = {}
    for rules in ("auto", "smallest", "safe"):
        with tw_triton.Checkpointer(tmp_path / str(rules), rules=rules, fsync=False) as ck:
            bounds[rules] = ck.device_memory_bound(model=model, optimizer=opt)
    for part, value in bounds["auto"].items():
        assert value == max(bounds["smallest"][part], bounds["safe"][part]), part
