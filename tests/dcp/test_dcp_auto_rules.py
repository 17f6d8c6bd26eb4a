"""The DistributedCheckpointer's default rules, "auto": ``small`` for saves fewer than 100
steps apart, ``safe`` from there, the interval counted from the last save or load (one
process)."""

from __future__ import annotations

import os

import _dcp_workers as W
import pytest
import torch

from tw_triton import format as fmt
from tw_triton import interval_rules
from tw_triton.dcp import DistributedCheckpointer
from tw_triton.errors import QuantizationError


def fresh() -> dict:
    model = W.make_model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    W.train_step(model, opt, 0)
    return W.app_state(model, opt)


def moment_bits(path: str) -> set[int]:
    """The bits of every coded ``exp_avg`` entry in the checkpoint directory ``path``."""
    bits = set()
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            q = fmt.read_file(os.path.join(path, name))
            bits |= {
                e.params["bits"] for p, e in q.entries.items() if p.endswith("exp_avg") and "bits" in e.params
            }
    return bits


def test_the_preset_follows_the_interval_since_the_last_save(tmp_path):
    ckpt = DistributedCheckpointer(tmp_path, keyframe_every=3, keep=10)
    state = fresh()
    steps = [10, 20, 120, 130, 330]  # intervals 10 (from step 0), 10, 100, 10, 200
    for step in steps:
        ckpt.save(state, step)
    got = [moment_bits(ckpt.path_for(s)) for s in steps]
    assert got == [{4}, {4}, {8}, {4}, {8}]  # small's int4 first moment, safe's int8


def test_a_load_counts_the_interval_from_the_step_loaded(tmp_path):
    first = DistributedCheckpointer(tmp_path, keep=10)
    first.save(fresh(), 50)
    ckpt = DistributedCheckpointer(tmp_path, keep=10)
    state = fresh()
    assert ckpt.load(state) == 50
    assert ckpt.rules_for(60) == "small"
    assert ckpt.rules_for(150) == "safe"
    assert ckpt.rules_for(40) == "small"  # not after the step loaded: no interval
    ckpt.save(state, 250)
    assert moment_bits(ckpt.path_for(250)) == {8}


def test_rules_given_are_used_whatever_the_interval(tmp_path):
    ckpt = DistributedCheckpointer(tmp_path, rules="small", keep=10)
    state = fresh()
    ckpt.save(state, 500)
    assert ckpt.rules_for(1000) == "small"
    assert moment_bits(ckpt.path_for(500)) == {4}


def test_auto_is_checked_for_both_presets_when_made(tmp_path):
    assert interval_rules.candidates("auto", short=interval_rules.DCP_SHORT_INTERVAL_PRESET) == [
        "small",
        "safe",
    ]
    with pytest.raises(QuantizationError):
        DistributedCheckpointer(tmp_path, bits=5)
