"""torchao's and bitsandbytes' low-bit optimizers (issue 32, item 2): their states save and
restore through tw_triton.save/load, the Checkpointer and the DCP plug-in, the steps after a
restore match an uninterrupted run bit for bit where the weights were stored exact, their
already-quantized states are stored exact under any preset, and the file is no larger than
torch.save of the same state. Each case runs on the CPU and is skipped without its package
(pip install 'tw-triton[lowbit]'); crafted files and unknown subclasses:
tests/format/test_lowbit_subclasses.py.
"""

from __future__ import annotations

import importlib
import io
import warnings

import pytest
import torch

import tw_triton
from tw_triton import Checkpointer, lowbit

# case -> (module, optimizer class)
CASES = {
    "torchao-AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "torchao-AdamW4bit": ("torchao.optim", "AdamW4bit"),
    "torchao-AdamWFp8": ("torchao.optim", "AdamWFp8"),
    "bnb-AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
    "bnb-Lion8bit": ("bitsandbytes.optim", "Lion8bit"),
}
STEPS = 3


def make(case: str, seed: int = 0):
    module, name = CASES[case]
    pytest.importorskip(
        module.split(".")[0], reason=f"{module} is not installed: pip install 'tw-triton[lowbit]'"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(importlib.import_module(module), name)
    torch.manual_seed(seed)
    # Weights of 4096+ elements get quantized moments (smaller ones plain float states).
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 64))
    return model, cls(model.parameters(), lr=1e-2)


def train(model, opt, steps) -> None:
    for step in steps:
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def state_of(model, opt) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def assert_same_run(a, b) -> None:
    """Same weights and same optimizer state, inner tensors included, bit for bit."""
    (ma, oa), (mb, ob) = a, b
    assert all(torch.equal(x, y) for x, y in zip(ma.parameters(), mb.parameters()))
    ta, _ = tw_triton.tree.flatten(oa.state_dict())
    tb, _ = tw_triton.tree.flatten(ob.state_dict())
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def quantized_paths(tensors: dict) -> list[str]:
    return [p for p in tensors if lowbit.stored_as_is(p)]


@pytest.mark.parametrize("case", CASES)
def test_save_load_resumes_bit_for_bit_and_is_no_larger_than_torch_save(tmp_path, case):
    run = make(case)
    train(*run, range(STEPS))
    state = state_of(*run)
    q = tw_triton.quantize_state_dict(state, rules="exact")
    path = tmp_path / "a.tw.safetensors"
    size = tw_triton.save(q, path)
    buf = io.BytesIO()
    torch.save(state, buf)
    assert size <= buf.tell()

    loaded = tw_triton.load(path)
    for key in ("exp_avg", "exp_avg_sq"):
        if case.startswith("torchao") and key in state["optimizer"]["state"][0]:
            assert type(loaded["optimizer"]["state"][0][key]) is type(state["optimizer"]["state"][0][key])
    resumed = make(case, seed=1)
    resumed[0].load_state_dict(loaded["model"])
    resumed[1].load_state_dict(loaded["optimizer"])
    assert_same_run(run, resumed)
    train(*run, range(STEPS, 2 * STEPS))
    train(*resumed, range(STEPS, 2 * STEPS))
    assert_same_run(run, resumed)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("preset", ["smallest", [("*", "int4")]], ids=["smallest", "all-int4"])
def test_already_quantized_states_are_stored_exact_under_any_rules(tmp_path, case, preset):
    run = make(case)
    train(*run, range(STEPS))
    state = state_of(*run)
    flat, _ = tw_triton.tree.flatten(state)
    inner = quantized_paths(flat)
    assert len(inner) >= 4  # the quantized moments of the 128x128 weight
    q = tw_triton.quantize_state_dict(state, rules=preset)
    assert {q.entries[q.aliases.get(p, p)].codec for p in inner} == {"exact"}
    assert q.entries["model/0.weight"].codec == "blockwise"  # the preset did apply
    tw_triton.save(q, tmp_path / "s.tw.safetensors")
    back, _ = tw_triton.tree.flatten(tw_triton.load(tmp_path / "s.tw.safetensors")["optimizer"])
    assert all(torch.equal(back[p.removeprefix("optimizer/")], flat[p]) for p in inner)


@pytest.mark.parametrize("case", CASES)
def test_checkpointer_restores_a_keyframe_bit_for_bit(tmp_path, case):
    run = make(case)
    with Checkpointer(tmp_path / "run", keyframe_every=2) as ckpt:  # preset "smallest"
        for step in range(STEPS):  # keyframes at 0 and 2, a delta at 1
            train(*run, [step])
            ckpt.save(step, model=run[0], optimizer=run[1])
    resumed = make(case, seed=1)
    # States already there: restore reads the stored inner tensors into them in place.
    train(*resumed, [100])
    got = Checkpointer(tmp_path / "run").restore(model=resumed[0], optimizer=resumed[1])
    assert got["step"] == STEPS - 1
    assert_same_run(run, resumed)
    train(*run, range(STEPS, 2 * STEPS))
    train(*resumed, range(STEPS, 2 * STEPS))
    assert_same_run(run, resumed)
    # The delta between the keyframes holds the moments as they were, too.
    delta = Checkpointer(tmp_path / "run").load(1)
    assert quantized_paths(tw_triton.tree.flatten(delta)[0])


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("preset", ["exact", "small", [("*", "int4")]], ids=["exact", "small", "all-int4"])
def test_dcp_save_load_resumes_bit_for_bit(tmp_path, case, preset):
    # DCP's own state-dict API: parameters named by FQN, a fresh optimizer's states created.
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tw_triton import dcp

    run = make(case)
    train(*run, range(STEPS))
    model_sd, optim_sd = get_state_dict(*run)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, tmp_path / "dcp", no_dist=True, rules=preset)
    resumed = make(case, seed=1)
    model_sd, optim_sd = get_state_dict(*resumed)
    target = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(target, tmp_path / "dcp", no_dist=True)
    set_state_dict(*resumed, model_state_dict=target["model"], optim_state_dict=target["optimizer"])
    if preset != "exact":
        # The weights (and a catch-all rule's plain float states) are quantized; the states
        # the optimizer quantized come back as they were.
        ta, tb = (tw_triton.tree.flatten(r[1].state_dict())[0] for r in (run, resumed))
        assert quantized_paths(ta) and all(torch.equal(ta[k], tb[k]) for k in quantized_paths(ta))
        return
    assert_same_run(run, resumed)
    train(*run, range(STEPS, 2 * STEPS))
    train(*resumed, range(STEPS, 2 * STEPS))
    assert_same_run(run, resumed)


@pytest.mark.parametrize("case", ["torchao-AdamW4bit", "bnb-AdamW8bit"])
@pytest.mark.parametrize("preset", ["small", [("*", "int8")]], ids=["small", "all-int8-deltas"])
def test_distributed_checkpointer_async_delta_and_keyframe_restore(tmp_path, case, preset):
    """DistributedCheckpointer: an asynchronous delta (DCP's stager encodes the states) keeps
    the states the optimizer quantized as they were, never as deltas from the keyframe (a
    catch-all delta rule included); a keyframe resumes bit for bit."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from tw_triton.dcp import DistributedCheckpointer

    run = make(case)
    ckpt = DistributedCheckpointer(tmp_path / "run", keyframe_every=2, rules=preset)
    saved = {}
    for step in range(STEPS):  # keyframes at 0 and 2, an asynchronous delta at 1
        train(*run, [step])
        model_sd, optim_sd = get_state_dict(*run)
        saved[step] = {k: v.clone() for k, v in tw_triton.tree.flatten(run[1].state_dict())[0].items()}
        future = ckpt.save({"model": model_sd, "optim": optim_sd}, step=step, asynchronous=step == 1)
        if future is not None:
            future.result()
    for step in (1, STEPS - 1):
        resumed = make(case, seed=1)
        model_sd, optim_sd = get_state_dict(*resumed)
        target = {"model": model_sd, "optim": optim_sd}
        assert ckpt.load(target, ckpt.path_for(step)) == step
        set_state_dict(*resumed, model_state_dict=target["model"], optim_state_dict=target["optim"])
        got = tw_triton.tree.flatten(resumed[1].state_dict())[0]
        keys = quantized_paths(got) if step == 1 else [k for k in got if "param_groups" not in k]
        assert keys and all(torch.equal(got[k], saved[step][k]) for k in keys)
    train(*run, range(STEPS, 2 * STEPS))
    train(*resumed, range(STEPS, 2 * STEPS))
    assert_same_run(run, resumed)


def test_tw_convert_reads_a_torch_save_of_a_low_bit_state(tmp_path):
    """``tw convert`` (in a fresh process, where nothing imported torchao yet) lets
    torch.load(weights_only=True) build the allowlisted subclasses, and stores them as they
    are."""
    import subprocess
    import sys

    run = make("torchao-AdamW8bit")
    train(*run, range(STEPS))
    state = state_of(*run)
    torch.save(state, tmp_path / "in.pt")
    out = tmp_path / "out.tw.safetensors"
    done = subprocess.run(
        [sys.executable, "-m", "tw_triton", "convert", str(tmp_path / "in.pt"), str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    got = tw_triton.load(out)["optimizer"]["state"][0]["exp_avg"]
    want = state["optimizer"]["state"][0]["exp_avg"]
    assert (
        type(got) is type(want) and torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
    )
