"""tw_triton.dcp: a delta finds its own keyframe, and ``latest()`` checks whole chains.

Item 9 of issue 28: a delta resolves its keyframe beside itself, by checkpoint id, before the
absolute path it recorded, so a copied or moved run never reads another run's keyframe.
Item 10: ``DistributedCheckpointer.latest()`` skips a delta whose keyframe lost or truncated a
rank file. The first tests run in one process; the chain tests use a 2-rank gloo run (one spawn).
"""

from __future__ import annotations

import json
import os
import shutil

import _dcp_workers as W
import pytest
import torch
import torch.multiprocessing as mp

import tw_triton.dcp as tw_dcp
from tw_triton.dcp import DistributedCheckpointer
from tw_triton.errors import CheckpointError, ReferenceMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

KEY, DELTA = "step_00000000", "step_00000001"


def fresh_state(seed: int = 7) -> dict:
    """A plain model + AdamW state to load into (one process, no process group)."""
    model = W.make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    W.train_step(model, opt, 0)
    return W.app_state(model, opt)


def make_run(directory: str, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Steps 0 (keyframe) and 1 (a delta of step 0) in one process; the saved tensors by step."""
    model = W.make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = DistributedCheckpointer(directory, rules="small", keyframe_every=2, keep=10)
    saved = {}
    for step in range(2):
        W.train_step(model, opt, seed * 10 + step)
        state = W.app_state(model, opt)
        ckpt.save(state, step)
        saved[step] = W.full_tensors(state)
    return saved


def load(path: str, **kw) -> dict[str, torch.Tensor]:
    state = fresh_state()
    tw_dcp.load(state, path, no_dist=True, **kw)
    return W.full_tensors(state)


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def checkpoint_id(path: str) -> str:
    with open(os.path.join(path, "tw_dcp.json")) as f:
        return json.load(f)["checkpoint_id"]


@pytest.fixture
def copied(tmp_path):
    """A run, a copy of it (and what the copy's delta decodes to while both are intact)."""
    run, copy = str(tmp_path / "run"), str(tmp_path / "copy")
    saved = make_run(run, seed=0)
    shutil.copytree(run, copy)
    expected = load(f"{copy}/{DELTA}")
    close = (expected["model.0.weight"] - saved[1]["model.0.weight"]).abs().max()
    assert 0 < close < 1e-3  # a quantized delta, decoded against the right keyframe
    return run, copy, expected


# -- item 9: the keyframe is found beside the delta, by id ---------------------------------


def test_copied_run_reads_its_own_keyframe_when_another_run_replaced_the_original(copied, tmp_path):
    run, copy, expected = copied
    shutil.rmtree(run)
    make_run(run, seed=1)  # a new run at the recorded path: other ids, other values
    assert checkpoint_id(f"{run}/{KEY}") != checkpoint_id(f"{copy}/{KEY}")
    assert_equal(load(f"{copy}/{DELTA}"), expected)
    # The checkpointer of the copy picks the copy's delta and loads it the same.
    ckpt = DistributedCheckpointer(copy)
    assert ckpt.latest() == f"{copy}/{DELTA}"
    state = fresh_state()
    assert ckpt.load(state) == 1
    assert_equal(W.full_tensors(state), expected)


def test_copy_loads_after_the_original_is_deleted(copied):
    run, copy, expected = copied
    shutil.rmtree(run)
    assert_equal(load(f"{copy}/{DELTA}"), expected)


def test_keyframe_beside_is_found_by_id_under_another_name(copied):
    run, copy, expected = copied
    shutil.rmtree(run)
    os.rename(f"{copy}/{KEY}", f"{copy}/renamed_keyframe")
    assert_equal(load(f"{copy}/{DELTA}"), expected)


def test_mismatching_keyframe_beside_is_refused(copied, tmp_path):
    run, copy, _ = copied
    other = str(tmp_path / "other")
    make_run(other, seed=1)
    shutil.rmtree(f"{copy}/{KEY}")
    shutil.copytree(f"{other}/{KEY}", f"{copy}/{KEY}")
    shutil.rmtree(run)
    found = checkpoint_id(f"{copy}/{KEY}")
    with pytest.raises(ReferenceMismatchError) as info:
        load(f"{copy}/{DELTA}")
    msg = str(info.value)
    # Names the delta, the id it needs, the keyframe passed over and its id, and the way out.
    assert f"{copy}/{DELTA}" in msg and f"{copy}/{KEY} is checkpoint {found!r}" in msg
    assert "no complete checkpoint with that id" in msg and "pass reference=" in msg
    want = json.load(open(f"{copy}/{DELTA}/tw_dcp.json"))["reference"]["checkpoint_id"]
    assert want != found and repr(want) in msg
    assert DistributedCheckpointer(copy).latest() == f"{copy}/{KEY}"


def test_keyframe_at_the_recorded_path_is_used_only_when_its_id_matches(copied, tmp_path):
    run, copy, expected = copied
    # Nothing beside the copy's delta: the recorded path still holds the right keyframe.
    shutil.rmtree(f"{copy}/{KEY}")
    assert_equal(load(f"{copy}/{DELTA}"), expected)
    # ... and once another run sits there, it is refused.
    shutil.rmtree(run)
    make_run(run, seed=1)
    with pytest.raises(ReferenceMismatchError, match=r"run/step_00000000 is checkpoint"):
        load(f"{copy}/{DELTA}")


def test_keyframe_rank_file_of_another_checkpoint_is_refused(copied, tmp_path):
    """A keyframe file from another save, under the keyframe's record, is never decoded."""
    _, copy, _ = copied
    other = str(tmp_path / "other")
    make_run(other, seed=1)
    name = "__0_0.tw.safetensors"
    shutil.copy(f"{other}/{KEY}/{name}", f"{copy}/{KEY}/{name}")
    meta = f"{copy}/{KEY}/tw_dcp.json"
    doc = json.load(open(meta))
    doc["files"][name]["bytes"] = os.path.getsize(f"{copy}/{KEY}/{name}")  # sizes agree
    json.dump(doc, open(meta, "w"))
    with pytest.raises(ReferenceMismatchError, match=r"__0_0.tw.safetensors: a file of checkpoint"):
        load(f"{copy}/{DELTA}")


# -- item 10: latest() checks the whole chain ----------------------------------------------


@W.rank_process
def main_chain(rank: int, world: int, port: int, root: str) -> None:
    """2 ranks: steps 0 (keyframe), 1 (delta of 0), 2 (keyframe), 3 (delta of 2)."""
    W.setup(rank, world, port)
    import torch.distributed as dist

    model, opt = W.fsdp_model_and_opt()
    ckpt = DistributedCheckpointer(f"{root}/run", rules="small", keyframe_every=2, keep=10)
    saved = {}
    for step in range(4):
        W.train_step(model, opt, step)
        state = W.app_state(model, opt)
        ckpt.save(state, step)
        saved[step] = W.full_tensors(state)
    if rank == 0:
        torch.save(saved, f"{root}/saved.pt")
    dist.barrier()


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("chain"))
    mp.start_processes(main_chain, args=(2, W.free_port(), root), nprocs=2, start_method="spawn", join=True)
    names = sorted(os.listdir(f"{root}/run"))
    assert names == [f"step_{i:08d}" for i in range(4)]
    for step in (0, 2):
        files = sorted(os.listdir(f"{root}/run/step_{step:08d}"))
        assert files == ["__0_0.tw.safetensors", "__1_0.tw.safetensors", "tw_dcp.json"]
    return root, torch.load(f"{root}/saved.pt")


@pytest.fixture
def run_copy(chain_run, tmp_path):
    """A copy of the 2-rank run whose deltas record their keyframes in the copy, as if
    saved there (else a broken keyframe would be found intact at the original's path)."""
    root, saved = chain_run
    run = str(tmp_path / "run")
    shutil.copytree(f"{root}/run", run)
    for name in os.listdir(run):
        meta = os.path.join(run, name, "tw_dcp.json")
        doc = json.load(open(meta))
        if doc["reference"] is not None:
            doc["reference"]["path"] = os.path.join(run, os.path.basename(doc["reference"]["path"]))
            json.dump(doc, open(meta, "w"))
    return run, saved


def assert_loads_step_1(ckpt: DistributedCheckpointer, saved: dict, path: str | None = None) -> None:
    """``load`` of ``path`` (default: what ``latest()`` returns): step 1, the delta of the
    intact keyframe 0."""
    state = fresh_state()
    assert ckpt.load(state, path) == 1
    got = W.full_tensors(state)
    err = (got["model.0.weight"] - saved[1]["model.0.weight"]).abs().max()
    assert 0 < err < 1e-3
    assert torch.equal(got["model.0.bias"], saved[1]["model.0.bias"])  # small: exact


def test_latest_skips_a_delta_whose_keyframe_lost_a_rank_file(run_copy, caplog):
    run, saved = run_copy
    ckpt = DistributedCheckpointer(run)
    assert ckpt.latest() == f"{run}/step_00000003"
    os.remove(f"{run}/step_00000002/__1_0.tw.safetensors")
    with caplog.at_level("WARNING", logger="tw_triton.dcp.checkpointer"):
        assert ckpt.latest() == f"{run}/step_00000001"
    assert (
        "step_00000003" in caplog.text
        and "__1_0.tw.safetensors (written by rank 1) is missing" in caplog.text
    )
    assert_loads_step_1(ckpt, saved)


def test_latest_skips_a_delta_whose_keyframe_has_a_truncated_rank_file(run_copy):
    run, saved = run_copy
    f = f"{run}/step_00000002/__0_0.tw.safetensors"
    os.truncate(f, os.path.getsize(f) - 100)
    ckpt = DistributedCheckpointer(run)
    assert ckpt.latest() == f"{run}/step_00000001"
    assert_loads_step_1(ckpt, saved)
    # Loading the broken chain itself is a clear error, not garbage.
    with pytest.raises(ReferenceMismatchError, match="replaced or truncated"):
        tw_dcp.load(fresh_state(), f"{run}/step_00000003", no_dist=True)


def test_latest_with_verify_skips_a_corrupted_keyframe(run_copy):
    """Same sizes, one flipped byte: found by checksums when ``verify`` is asked for."""
    run, saved = run_copy
    f = f"{run}/step_00000002/__1_0.tw.safetensors"
    data = bytearray(open(f, "rb").read())
    data[-3] ^= 0xFF
    open(f, "wb").write(bytes(data))
    ckpt = DistributedCheckpointer(run)
    assert ckpt.latest() == f"{run}/step_00000003"
    assert ckpt.latest(verify=True) == f"{run}/step_00000001"
    assert_loads_step_1(ckpt, saved, ckpt.latest(verify=True))


def test_retention_keeps_what_latest_returns(run_copy):
    """keep=1 keeps the newest complete delta, and also the chain latest() falls back to."""
    run, saved = run_copy
    os.remove(f"{run}/step_00000002/__0_0.tw.safetensors")
    ckpt = DistributedCheckpointer(run, keep=1)
    ckpt.retain()
    assert ckpt.latest() == f"{run}/step_00000001"
    assert_loads_step_1(ckpt, saved)


def test_no_loadable_checkpoint(run_copy):
    run, _ = run_copy
    for step in (0, 2):
        os.remove(f"{run}/step_{step:08d}/__0_0.tw.safetensors")
    ckpt = DistributedCheckpointer(run)
    assert ckpt.latest() is None
    assert ckpt.load(fresh_state()) is None
    with pytest.raises(CheckpointError):
        tw_dcp.load(fresh_state(), f"{run}/step_00000001", no_dist=True)
