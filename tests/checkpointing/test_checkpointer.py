"""Checkpointer: save/restore equivalence (exact and delta), RNG, retention, listing, resume."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tw_triton import format as fmt
from tw_triton.checkpointer import (
    Checkpointer,
    capture_rng_state,
    checkpoint_name,
    parse_checkpoint_name,
    restore_rng_state,
)
from tw_triton.errors import CheckpointError, QuantizationError
from tw_triton.format import read_manifest


def make_run(seed: int):
    """A tiny model with dropout (uses the torch RNG), AdamW, a scheduler and a scaler."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(128, 8)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return model, opt, sched, scaler


def train(model, opt, sched, steps: int) -> list[float]:
    """Steps whose data draw on torch, numpy and Python RNGs, so all three must be restored."""
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32)
        noise = torch.from_numpy(np.random.standard_normal((16, 8)).astype(np.float32))
        scale = random.random()
        loss = (model(x) - scale * noise).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@pytest.mark.parametrize("async_write", [True, False])
def test_restore_from_keyframe_continues_bit_for_bit(tmp_path, async_write):
    # rules="default" keeps the optimizer moments exact, so a keyframe is the whole state.
    seed_all(0)
    model, opt, sched, scaler = make_run(0)
    train(model, opt, sched, 4)
    with Checkpointer(tmp_path, async_write=async_write, fsync=False, rules="default") as ckpt:
        ckpt.save(4, model=model, optimizer=opt, scheduler=sched, scaler=scaler, note="hello")
        assert ckpt.infos()[0].kind == "keyframe"
    expected = train(model, opt, sched, 5)
    expected_params = [p.detach().clone() for p in model.parameters()]

    seed_all(123)  # the RNGs must come back from the checkpoint, not from here
    model2, opt2, sched2, scaler2 = make_run(99)
    state = Checkpointer(tmp_path).restore(model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert state["step"] == 4 and state["note"] == "hello"
    assert train(model2, opt2, sched2, 5) == expected
    for a, b in zip(expected_params, model2.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("delta", ["open", "closed"])
def test_restore_from_delta_is_close(tmp_path, delta):
    seed_all(1)
    model, opt, sched, scaler = make_run(1)
    # int8 weight deltas: this toy's weights move a lot in 6 steps at lr 1e-2. (The default
    # preset's 2-bit deltas are judged by the resume benchmarks against a noise floor.)
    ckpt = Checkpointer(tmp_path, keyframe_every=100, fsync=False, rules="small", delta=delta)
    ckpt.save(0, model=model, optimizer=opt, scheduler=sched)
    train(model, opt, sched, 6)
    ckpt.save(6, model=model, optimizer=opt, scheduler=sched)
    ckpt.close()
    infos = {i.step: i for i in Checkpointer(tmp_path).infos()}
    assert infos[6].kind == "delta" and infos[6].reference_id == infos[0].checkpoint_id
    expected = train(model, opt, sched, 4)

    seed_all(5)
    model2, opt2, sched2, _ = make_run(5)
    Checkpointer(tmp_path).restore(model=model2, optimizer=opt2, scheduler=sched2)
    got = train(model2, opt2, sched2, 4)
    # Deltas of the 4096-element weights: the run continues within quantization error.
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.allclose(a, b, atol=1e-2)
    # The exact parts came back exactly: optimizer moments and the scheduler.
    assert sched2.state_dict() == sched.state_dict()


@pytest.mark.parametrize("delta", ["open", "closed"])
@pytest.mark.parametrize("latest", [True, False])
def test_restore_decodes_into_the_models_own_tensors(tmp_path, delta, latest):
    seed_all(3)
    model, opt, sched, _ = make_run(3)
    with Checkpointer(tmp_path, keyframe_every=10, fsync=False, delta=delta) as ckpt:
        for step in range(3):  # a keyframe, then deltas of the large weights
            ckpt.save(step, model=model, optimizer=opt)
            train(model, opt, sched, 2)
    want = Checkpointer(tmp_path).load(2)
    model2, opt2, _, _ = make_run(8)
    # With state in the optimizer too: its exact tensors ("step") are read in place as well.
    train(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, step_size=3), 1)
    before = {k: v.data_ptr() for k, v in model2.state_dict().items()}
    steps_before = [s["step"].data_ptr() for s in opt2.state.values()]
    state = Checkpointer(tmp_path).restore(None if latest else 2, model=model2, optimizer=opt2)
    live = model2.state_dict()
    for name, t in want["model"].items():
        assert torch.equal(live[name], t), name
        assert live[name].data_ptr() == before[name]  # still the model's own memory
        # The loaded state is that memory: nothing was decoded elsewhere and copied.
        assert state["model"][name].data_ptr() == before[name], name
    assert [s["step"] for s in opt2.state.values()] == [
        s["step"] for s in want["optimizer"]["state"].values()
    ]
    assert steps_before == [s["step"].data_ptr() for s in opt2.state.values()]
    for got, exp in zip(opt2.state.values(), want["optimizer"]["state"].values()):
        assert torch.equal(got["exp_avg"], exp["exp_avg"]) and torch.equal(
            got["exp_avg_sq"], exp["exp_avg_sq"]
        )


def test_load_into_objects_fills_their_tensors_without_load_state_dict(tmp_path):
    seed_all(5)
    model, opt, sched, _ = make_run(5)
    with Checkpointer(tmp_path, fsync=False, rules="default") as ckpt:
        ckpt.save(0, model=model, optimizer=opt)
    fresh, _, _, _ = make_run(6)
    calls = []
    fresh.load_state_dict = lambda *a, **k: calls.append(a)  # must not be needed
    state = Checkpointer(tmp_path).load(into={"model": fresh})
    assert calls == []
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]) and state["model"][name].data_ptr() == t.data_ptr()
    # Without into, nothing is shared.
    other = Checkpointer(tmp_path).load()
    assert all(other["model"][n].data_ptr() != t.data_ptr() for n, t in fresh.state_dict().items())


def test_restore_into_tied_or_mismatched_tensors_still_loads_exactly(tmp_path):
    seed_all(4)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    model[1].weight = model[0].weight  # tied: one tensor under two names
    with Checkpointer(tmp_path, fsync=False, rules="default") as ckpt:
        ckpt.save(0, model=model)
    fresh = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False))
    fresh[1].weight = fresh[0].weight
    state = Checkpointer(tmp_path).restore(model=fresh, rng=False)
    assert torch.equal(fresh[0].weight, model[0].weight) and fresh[1].weight is fresh[0].weight
    assert state["model"]["0.weight"].data_ptr() != fresh[0].weight.data_ptr()  # copied by load_state_dict
    # A model in another dtype: the checkpoint's float32 is not read into bfloat16 memory.
    half = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)).bfloat16()
    half[1].weight = half[0].weight
    Checkpointer(tmp_path).restore(model=half, rng=False)
    assert torch.equal(half[0].weight, model[0].weight.bfloat16())


def test_restore_never_writes_into_a_tensor_of_another_shape(tmp_path):
    saved = torch.nn.Linear(4, 8)  # weight (8, 4)
    with Checkpointer(tmp_path, fsync=False, rules="default") as ckpt:
        ckpt.save(0, model=saved)
    changed = torch.nn.Linear(8, 4)  # weight (4, 8): the same size, another shape
    before = changed.weight.detach().clone()
    with pytest.raises(CheckpointError, match="size mismatch"):
        Checkpointer(tmp_path).restore(model=changed, rng=False)
    assert torch.equal(changed.weight.detach(), before)


def test_restore_falls_back_whole_when_the_newest_file_fails_after_reading_into_the_model(tmp_path, caplog):
    seed_all(6)
    model, opt, sched, _ = make_run(6)
    with Checkpointer(tmp_path, keyframe_every=1, fsync=False, rules="default") as ckpt:
        ckpt.save(0, model=model)
        older = {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, sched, 3)
        ckpt.save(1, model=model)
    path = ckpt.path_for(1)
    # The last byte of the first layer's weight: the whole buffer is read into the model
    # before its checksum fails.
    blob = bytearray(open(path, "rb").read())
    end = read_manifest(path)["entries"]["model/0.weight"]["buffers"]["data"]["data_offsets"][1]
    blob[8 + int.from_bytes(blob[:8], "little") + end - 1] ^= 0x01
    open(path, "wb").write(bytes(blob))
    fresh, _, _, _ = make_run(9)
    state = Checkpointer(tmp_path).restore(model=fresh, rng=False)
    assert state["step"] == 0 and "step-00000001" in caplog.text
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, older[name]), name


def test_restore_of_the_latest_reads_each_file_once(tmp_path, monkeypatch):
    seed_all(2)
    model, opt, sched, _ = make_run(2)
    with Checkpointer(tmp_path, keyframe_every=10, fsync=False) as ckpt:
        ckpt.save(0, model=model, optimizer=opt)
        train(model, opt, sched, 2)
        ckpt.save(2, model=model, optimizer=opt)  # a delta: restoring it needs both files
    reads: list[str] = []

    def counting(real):
        def wrapper(path, *args, **kwargs):
            reads.append(os.path.basename(path))
            return real(path, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(fmt, "verify_file", counting(fmt.verify_file))
    monkeypatch.setattr(fmt, "read_file", counting(fmt.read_file))
    model2, opt2, _, _ = make_run(7)
    state = Checkpointer(tmp_path).restore(model=model2, optimizer=opt2)
    assert sorted(reads) == [checkpoint_name(0), checkpoint_name(2)]
    monkeypatch.undo()
    # Same result as loading that step by name (the path that reads the files itself).
    by_step = Checkpointer(tmp_path).load(2)
    assert state["step"] == 2
    for name, t in by_step["model"].items():
        assert torch.equal(state["model"][name], t), name
    for a, b in zip(model2.parameters(), by_step["model"].values()):
        assert torch.equal(a.detach(), b)


def test_delta_stores_model_weights_quantized_and_optimizer_exact(tmp_path):
    model, opt, sched, _ = make_run(2)
    train(model, opt, sched, 2)
    with Checkpointer(tmp_path, keyframe_every=5, fsync=False, rules="default") as ckpt:
        ckpt.save(1, model=model, optimizer=opt)
        train(model, opt, sched, 1)
        ckpt.save(2, model=model, optimizer=opt)
        # The reference holds the keyframe's delta-coded tensors only: the two weights
        # of >= 4096 elements (32x128 and 128x8 = 1024 is too small), fp32.
        assert ckpt.reference_nbytes == 32 * 128 * 4
    manifest = fmt.read_manifest(tmp_path / checkpoint_name(2))
    entries = manifest["entries"]
    assert entries["model/0.weight"]["codec"] == "blockwise"
    assert entries["model/0.weight"]["params"]["delta"] is True
    assert entries["optimizer/state/0/exp_avg"]["codec"] == "exact"
    assert manifest["metadata"]["kind"] == "delta" and manifest["metadata"]["reference_step"] == 1
    assert manifest["metadata"]["step"] == 2
    kf = fmt.read_manifest(tmp_path / checkpoint_name(1))
    assert all(e["codec"] == "exact" for e in kf["entries"].values())
    assert manifest["reference_id"] == kf["checkpoint_id"]


def test_no_delta_mode_keeps_no_reference(tmp_path):
    model, opt, sched, _ = make_run(3)
    with Checkpointer(tmp_path, delta=False, keyframe_every=3, fsync=False, rules="small") as ckpt:
        for step in range(4):
            train(model, opt, sched, 1)
            ckpt.save(step, model=model, optimizer=opt)
            assert ckpt.reference_nbytes == 0
        infos = ckpt.infos()
    assert [i.kind for i in infos] == ["keyframe", "standalone", "standalone", "keyframe"][-len(infos) :]
    assert all(i.reference_id is None for i in infos)
    state = Checkpointer(tmp_path).load(2)
    assert torch.allclose(state["model"]["0.weight"], model[0].weight, atol=0.1)


def test_rng_state_round_trip():
    seed_all(7)
    saved = capture_rng_state()
    a = (torch.rand(3), np.random.rand(3), random.random())
    seed_all(8)
    restore_rng_state(saved)
    b = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]
    with pytest.raises(CheckpointError, match="RNG"):
        restore_rng_state({"torch": saved["torch"]})


def test_retention_with_many_saves_never_drops_a_needed_keyframe(tmp_path):
    model = torch.nn.Linear(64, 64)  # 4096 weights: delta-coded
    keep_last, every = 3, 4
    # Closed loop (the default): a kept delta needs every delta back to its keyframe.
    ckpt = Checkpointer(tmp_path, keyframe_every=every, keep_last=keep_last, fsync=False, rules="small")
    saved_weights = {}
    for step in range(0, 30):
        with torch.no_grad():
            model.weight.add_(0.01 * torch.randn_like(model.weight))
        saved_weights[step] = model.weight.detach().clone()
        ckpt.save(step, model=model)
        ckpt.flush()
        infos = {i.step: i for i in ckpt.infos()}
        newest = sorted(infos)[-keep_last:]
        assert newest == [s for s in range(max(0, step - keep_last + 1), step + 1)]
        ids = {i.checkpoint_id for i in infos.values()}
        for info in infos.values():
            assert info.reference_id is None or info.reference_id in ids
        # nothing else survives: the newest keep_last and the chains they need
        by_id = {i.checkpoint_id: i for i in infos.values()}
        needed, frontier = set(), [infos[s] for s in newest]
        while frontier:
            ref = frontier.pop().reference_id
            if ref is not None and ref not in needed:
                needed.add(ref)
                frontier.append(by_id[ref])
        extra = [s for s in infos if s not in newest]
        assert all(infos[s].checkpoint_id in needed for s in extra)
    ckpt.close()
    reader = Checkpointer(tmp_path)
    for step in reader.steps():
        w = reader.load(step)["model"]["weight"]
        assert torch.allclose(w, saved_weights[step], atol=2e-3), step
    assert reader.latest() == 29


def test_keep_last_none_keeps_everything(tmp_path):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path, keep_last=None, keyframe_every=2, async_write=False, fsync=False) as ckpt:
        for step in range(5):
            ckpt.save(step, model=model)
        assert ckpt.steps() == [0, 1, 2, 3, 4]


def test_resume_in_existing_directory_continues_the_chain(tmp_path):
    """After restore() the next save is a delta against the restored checkpoint
    (tests/checkpointing/test_chain_restart.py has the rest); a Checkpointer that did not
    restore starts with a keyframe."""
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=10, fsync=False) as first:
        for step in range(3):
            first.save(step, model=model)
    again = Checkpointer(tmp_path, keyframe_every=10, keep_last=10, fsync=False)
    assert again.steps() == [0, 1, 2]
    assert again.latest() == 2
    state = again.restore(model=torch.nn.Linear(64, 64))
    assert state["step"] == 2
    assert again.reference_id == {i.step: i for i in again.infos()}[2].checkpoint_id
    again.save(3, model=model)
    again.save(4, model=model)
    again.close()
    infos = {i.step: i for i in again.infos()}
    assert [infos[s].kind for s in range(5)] == ["keyframe", "delta", "delta", "delta", "delta"]
    assert infos[3].reference_id == infos[2].checkpoint_id
    assert infos[4].reference_id == infos[3].checkpoint_id
    with Checkpointer(tmp_path, keyframe_every=10, keep_last=10, fsync=False) as third:
        third.save(5, model=model)
    assert {i.step: i for i in third.infos()}[5].kind == "keyframe"


def test_saving_a_step_again_replaces_it(tmp_path):
    with Checkpointer(tmp_path, async_write=False, fsync=False) as ckpt:
        ckpt.save(5, value=torch.tensor([1.0]))
        ckpt.save(5, value=torch.tensor([2.0]))
        assert ckpt.steps() == [5]
        assert ckpt.load(5)["value"].item() == 2.0


def test_names_and_errors(tmp_path):
    assert checkpoint_name(100) == "step-00000100.tw.safetensors"
    assert parse_checkpoint_name("step-00000100.tw.safetensors") == 100
    assert parse_checkpoint_name(".step-00000100.tw.safetensors.0123456789abcdef.tmp") is None
    ckpt = Checkpointer(tmp_path, fsync=False)
    with pytest.raises(CheckpointError, match="reserved"):
        ckpt.save(1, rng=1)
    with pytest.raises(CheckpointError, match="no complete"):
        ckpt.load()
    ckpt.save(1, model=torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="no state named 'optimizer'"):
        ckpt.restore(optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="no load_state_dict"):
        ckpt.restore(model=42)
    with pytest.raises(CheckpointError, match="step 7"):
        ckpt.load(7)
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(2, x=1)


def _run_example(tmp_path, *extra):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(root, "examples", "train_with_checkpoints.py")
    # The checkout first on the path: the example must run against this tree, installed or not.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(
        [sys.executable, script, "--quick", "--dir", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    keyframe = [ln for ln in lines if "(keyframe): loss gap" in ln]
    delta = [ln for ln in lines if "(delta): loss gap" in ln]
    assert keyframe and delta  # the latest checkpoint of the crashed run is a delta
    assert any("torch.save" in ln for ln in lines)
    gap = lambda ln: float(ln.split("max ")[1].split(",")[0])  # noqa: E731
    return gap(keyframe[0]), gap(delta[0])


def test_example_quick_mode_resumes_close_under_the_default_rules(tmp_path):
    keyframe_gap, delta_gap = _run_example(tmp_path)
    # Coded moments: close to the reference run, but not the same bits.
    assert 0.0 < keyframe_gap < 0.05
    assert delta_gap < 0.05


def test_example_quick_mode_resumes_exactly_from_an_exact_keyframe(tmp_path):
    keyframe_gap, delta_gap = _run_example(tmp_path, "--rules", "default")
    assert keyframe_gap == 0.0
    assert delta_gap < 0.05


@pytest.mark.cuda
def test_cuda_run_restores_on_device(tmp_path):
    seed_all(0)
    model, opt, sched, _ = make_run(0)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 32, device="cuda")
    with Checkpointer(tmp_path, keyframe_every=2) as ckpt:
        for step in range(3):  # keyframe, delta, keyframe
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ckpt.save(step, model=model, optimizer=opt)
            if step == 0:
                # The delta-coded tensors: the large weight, and its exp_avg_sq, which the
                # default preset codes log2-temporal (against the previous save's value).
                assert ckpt.reference_nbytes == 2 * 32 * 128 * 4
    model2 = make_run(1)[0].cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    Checkpointer(tmp_path).restore(1, model=model2, optimizer=opt2)
    assert next(model2.parameters()).is_cuda
    state = Checkpointer(tmp_path).load(2, device="cuda")
    for k, v in model.state_dict().items():
        assert torch.equal(state["model"][k], v)


@pytest.mark.parametrize("async_write", [True, False])
def test_default_keyframe_keeps_weights_exact_and_codes_the_moments(tmp_path, async_write):
    """Under the default preset a keyframe stores the weights (the deltas' reference) exact
    and the large AdamW moments coded: exp_avg blockwise in the update's domain, exp_avg_sq by log2 (never below
    zero, zero exactly where it was zero). The next delta decodes against exact weights."""
    seed_all(2)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    with Checkpointer(tmp_path, async_write=async_write, fsync=False) as ckpt:
        ckpt.save(1, model=model, optimizer=opt)
        ckpt.save(2, model=model, optimizer=opt)
        ckpt.flush()
        assert [i.kind for i in ckpt.infos()] == ["keyframe", "delta"]
        codecs = {p: e["codec"] for p, e in read_manifest(ckpt.path_for(1))["entries"].items()}
    assert codecs["model/0.weight"] == "exact" and codecs["model/2.weight"] == "exact"
    assert codecs["optimizer/state/0/exp_avg"] == "blockwise-update"
    assert codecs["optimizer/state/0/exp_avg_sq"] == "log2"
    assert codecs["optimizer/state/1/exp_avg_sq"] == "exact"  # a bias: below 4096 elements
    for step in (1, 2):
        state = Checkpointer(tmp_path).load(step)
        for name, p in model.state_dict().items():
            if step == 1:
                assert torch.equal(state["model"][name], p)
            else:
                assert float((state["model"][name] - p).abs().max()) <= float(p.abs().max()) / 100
        for i, s in opt.state_dict()["state"].items():
            v, v_hat = s["exp_avg_sq"], state["optimizer"]["state"][i]["exp_avg_sq"]
            assert bool(((v == 0) == (v_hat == 0)).all()) and bool((v_hat >= 0).all())


@pytest.mark.parametrize("async_write", [True, False])
def test_retention_unlinks_on_the_writer_thread_and_leaves_no_temp_files(tmp_path, monkeypatch, async_write):
    """A file retention drops leaves the listing at once (renamed); its unlink, slow for a
    large file, runs on the writer thread, not in the loop's save()."""
    import threading

    unlinked: dict[str, str] = {}
    real_unlink = os.unlink

    def spy(path, *args, **kwargs):
        unlinked[os.path.basename(os.fspath(path))] = threading.current_thread().name
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", spy)
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path, keyframe_every=3, keep_last=2, async_write=async_write, fsync=False) as ckpt:
        for step in range(8):
            ckpt.save(step, model=model)
        ckpt.flush()
        kept = ckpt.steps()
        # Once flush() returns, every dropped file is gone (not only renamed).
        assert sorted(os.listdir(tmp_path)) == [f"step-{s:08d}.tw.safetensors" for s in kept]
    assert unlinked, "retention deleted nothing: the test proves nothing"
    assert all(fmt.is_temp_file(name) for name in unlinked)  # renamed before the unlink
    threads = set(unlinked.values())
    assert threads == ({"tw_triton-writer"} if async_write else {threading.current_thread().name})
    # After flush() every dropped file is gone: only the kept checkpoints remain.
    assert sorted(os.listdir(tmp_path)) == [f"step-{s:08d}.tw.safetensors" for s in kept]
    assert len(kept) < 8


def test_a_discarded_file_already_gone_is_not_an_error(tmp_path):
    from tw_triton.writer import AsyncWriter

    with AsyncWriter() as writer:
        writer.discard(tmp_path / "never-written")
        (tmp_path / "there").write_bytes(b"x")
        writer.discard(tmp_path / "there")
        writer.flush()
        assert not (tmp_path / "there").exists()


def test_a_writer_task_runs_on_the_writer_thread_and_its_error_is_only_logged(tmp_path, caplog):
    import threading

    from tw_triton.writer import AsyncWriter

    ran: list[str] = []

    def fail() -> None:
        raise RuntimeError("task broke")

    with AsyncWriter() as writer:
        writer.call(lambda: ran.append(threading.current_thread().name))
        with caplog.at_level("WARNING", logger="tw_triton.writer"):
            writer.call(fail)
            writer.flush()  # waits for both, raises nothing
        assert ran == ["tw_triton-writer"]
        assert "task broke" in caplog.text


def test_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path / "ck", async_write=False) as ck:
        for bad, match in (
            (1.5, "step must be an integer, got 1.5 \\(float\\)"),
            ("3", "got '3'"),
            (-1, "non-negative"),
        ):
            with pytest.raises(CheckpointError, match=match):
                ck.save(bad, model=model)
        ck.save(np.int64(3), model=model)
        assert ck.steps() == [3]


def test_load_and_restore_refuse_a_bad_step_or_device_naming_it(tmp_path):
    """restore(step="3") was a raw ValueError from formatting the file name, a device
    torch cannot parse a raw RuntimeError."""
    model = torch.nn.Linear(4, 4)
    with Checkpointer(tmp_path / "ck", async_write=False) as ck:
        ck.save(3, model=model)
        for bad, match in (("3", "got '3'"), (1.5, "got 1.5"), (-1, "non-negative")):
            with pytest.raises(CheckpointError, match=match):
                ck.restore(bad, model=model)
            with pytest.raises(CheckpointError, match=match):
                ck.load(bad)
        for call in (lambda: ck.restore(model=model, device="nope"), lambda: ck.load(device="nope")):
            with pytest.raises(CheckpointError, match="device 'nope'"):
                call()
        assert ck.restore(np.int64(3), model=model)["model"] is not None


def test_rules_bits_or_block_no_save_could_use_are_refused_by_the_constructor(tmp_path):
    """Each was accepted, and every save then failed on the writer thread (bits=3: the
    Future's error, logged, and again at close)."""
    for kw, match in (
        ({"bits": 3}, "bits must be one of"),
        ({"block": 100}, "block must be a power of two"),
        ({"rules": "nope"}, "unknown rules preset 'nope'"),
        ({"rules": [("model/*", "nope")]}, "rule 0: unknown codec 'nope'"),
    ):
        with pytest.raises(QuantizationError, match=match):
            Checkpointer(tmp_path / "ck", **kw)
    assert not (tmp_path / "ck").exists()
