"""tw_triton.dcp: sharded saves through torch.distributed.checkpoint, 2 ranks on CPU (gloo).

One spawn runs the FSDP2 checks (save/load, async_save with a delta, 1 -> 2); the parent
checks 2 -> 1, references and bad input on the files it left, in a single process.
"""

from __future__ import annotations

import json
import os
import shutil

import _dcp_workers as W
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException

import tw_triton.dcp as tw_dcp
from tw_triton.dcp import StorageReader, StorageWriter
from tw_triton.errors import CheckpointError, ReferenceMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def plain_state(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model = W.make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    W.train_step(model, opt, 0)
    return model, opt, W.app_state(model, opt)


def single_load(path: str, **kw) -> dict[str, torch.Tensor]:
    """A single-process decode (no process group) into a plain model + AdamW."""
    model, opt, state = plain_state(seed=7)
    tw_dcp.load(state, path, no_dist=True, **kw)
    return W.full_tensors(state)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    # 1 -> 2: single-process checkpoints for the ranks to load.
    _, _, state = plain_state()
    expected_one = {}
    for name in ("exact", "small"):
        dcp.save(state, storage_writer=StorageWriter(f"{root}/one_{name}", rules=name), no_dist=True)
        expected_one[name] = single_load(f"{root}/one_{name}")
    mp.start_processes(
        W.main_sharded, args=(2, W.free_port(), root), nprocs=2, start_method="spawn", join=True
    )
    out = torch.load(f"{root}/rank0.pt")
    return root, out, W.full_tensors(state), expected_one


def assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_exact_round_trip_bit_for_bit(sharded):
    root, out, _, _ = sharded
    assert any(v.dim() == 2 and v.shape[0] % 2 for v in out["full1"].values())  # uneven shards
    assert_equal(out["loaded"], out["full1"])
    # Each rank wrote one tw_triton file; the metadata is JSON.
    names = sorted(os.listdir(f"{root}/key"))
    assert names == ["__0_0.tw.safetensors", "__1_0.tw.safetensors", "tw_dcp.json"]


def test_resharding_2_to_1_exact(sharded):
    root, out, _, _ = sharded
    assert_equal(single_load(f"{root}/key"), out["full1"])


def test_resharding_1_to_2_matches_single_process_decode(sharded):
    root, out, state1, expected = sharded
    assert_equal(out["loaded_one"]["exact"], state1)
    assert_equal(out["loaded_one"]["small"], expected["small"])
    w = "model.0.weight"
    assert not torch.equal(expected["small"][w], state1[w])  # it was quantized


def test_async_delta_against_keyframe(sharded):
    root, out, _, _ = sharded
    full2, got = out["full2"], out["loaded_delta"]
    record = json.load(open(f"{root}/delta/tw_dcp.json"))
    key_id = json.load(open(f"{root}/key/tw_dcp.json"))["checkpoint_id"]
    assert record["reference"]["checkpoint_id"] == key_id
    for name in ("model.0.weight", "model.2.weight"):
        delta = full2[name] - out["full1"][name]
        err = (got[name] - full2[name]).abs().max().item()
        # int8 deltas: within half a step of the largest delta (plus rounding slack).
        assert 0 < err <= delta.abs().max().item() / 127 * 0.51 + 1e-7, name
    # Staged before the parameters moved by +1: the checkpoint holds the step-2 values.
    assert (got["model.0.bias"] - full2["model.0.bias"]).abs().max() == 0
    # 2 -> 1 gives exactly what the 2 ranks decoded.
    assert_equal(single_load(f"{root}/delta"), got)


def test_delta_reference_errors(sharded, tmp_path):
    root, out, _, _ = sharded
    with pytest.raises(ReferenceMismatchError, match="is checkpoint"):
        single_load(f"{root}/delta", reference=f"{root}/one_exact")
    with pytest.raises(ReferenceMismatchError, match="cannot be read"):
        single_load(f"{root}/delta", reference=str(tmp_path / "nope"))
    # Both moved together: the recorded path is gone, the keyframe is found beside it.
    shutil.copytree(f"{root}/key", tmp_path / "key")
    shutil.copytree(f"{root}/delta", tmp_path / "delta")
    meta = tmp_path / "delta" / "tw_dcp.json"
    doc = json.loads(meta.read_text())
    doc["reference"]["path"] = str(tmp_path / "gone" / "key")
    meta.write_text(json.dumps(doc))
    assert_equal(single_load(str(tmp_path / "delta")), out["loaded_delta"])
    shutil.rmtree(tmp_path / "key")
    with pytest.raises(ReferenceMismatchError, match="not there"):
        single_load(str(tmp_path / "delta"))


def test_plain_dcp_directory_is_refused(sharded, tmp_path):
    _, _, state = plain_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")), no_dist=True)
    with pytest.raises(CheckpointError, match="plain torch.distributed.checkpoint"):
        single_load(str(tmp_path / "plain"))


def test_missing_rank_file(sharded, tmp_path):
    root, _, _, _ = sharded
    shutil.copytree(f"{root}/key", tmp_path / "c")
    os.remove(tmp_path / "c" / "__1_0.tw.safetensors")
    with pytest.raises(CheckpointError, match=r"__1_0.tw.safetensors \(written by rank 1\) is missing"):
        single_load(str(tmp_path / "c"))


def test_metadata_that_does_not_match_the_files(sharded, tmp_path):
    root, _, _, _ = sharded
    shutil.copytree(f"{root}/key", tmp_path / "c")
    # The files of another save with the same layout, under this save's metadata.
    shutil.copy(f"{root}/delta/tw_dcp.json", tmp_path / "c" / "tw_dcp.json")
    with pytest.raises(CheckpointError, match="replaced or truncated|do not match"):
        single_load(str(tmp_path / "c"))
    # Same sizes, other checkpoint id: caught by the id every file records.
    doc = json.load(open(f"{root}/key/tw_dcp.json"))
    doc["checkpoint_id"] = "0" * 32
    json.dump(doc, open(tmp_path / "c" / "tw_dcp.json", "w"))
    with pytest.raises(CheckpointError, match="files and metadata do not match"):
        single_load(str(tmp_path / "c"))
    # A corrupted byte in a rank file: the CRC check names the file.
    f = tmp_path / "c" / "__0_0.tw.safetensors"
    shutil.copy(f"{root}/key/tw_dcp.json", tmp_path / "c" / "tw_dcp.json")
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="__0_0.tw.safetensors.*checksum mismatch"):
        single_load(str(tmp_path / "c"))


def test_plain_dcp_load_carries_the_tw_triton_error(sharded, tmp_path):
    """Through dcp.load itself, DCP's CheckpointException holds the reader's error."""
    root, _, _, _ = sharded
    _, _, state = plain_state()
    with pytest.raises(CheckpointException) as info:
        dcp.load(
            state, storage_reader=StorageReader(f"{root}/delta", reference=f"{root}/one_exact"), no_dist=True
        )
    ((err, _),) = info.value.failures.values()
    assert isinstance(err, ReferenceMismatchError)


def test_checkpointer_retention_and_killed_rank(tmp_path):
    root = str(tmp_path)
    ctx = mp.start_processes(
        W.main_checkpointer, args=(2, W.free_port(), root), nprocs=2, start_method="spawn", join=False
    )
    for p in ctx.processes:
        p.join(timeout=90)
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
    assert codes[1] == 17 and codes[0] not in (0, None), codes  # rank 0 saw the failure
    from tw_triton.dcp import DistributedCheckpointer, is_complete

    ckpt = DistributedCheckpointer(f"{root}/run")
    names = sorted(os.listdir(f"{root}/run"))
    # keep=2 kept steps 2 and 3, and keyframe 0 that step 2 is a delta of; step 1 went.
    # Step 4 was killed: its directory holds rank 1's file and no metadata.
    assert names == ["step_00000000", "step_00000002", "step_00000003", "step_00000004"]
    assert not is_complete(f"{root}/run/step_00000004")
    assert "__1_0.tw.safetensors" in os.listdir(f"{root}/run/step_00000004")
    assert ckpt.latest() == f"{root}/run/step_00000003"
    saved = torch.load(f"{root}/saved.pt")
    key = json.load(open(f"{root}/run/step_00000000/tw_dcp.json"))["checkpoint_id"]
    assert json.load(open(f"{root}/run/step_00000002/tw_dcp.json"))["reference"]["checkpoint_id"] == key
    # The previous checkpoints load in one process; step 3 is a keyframe: weights exact.
    _, _, state = plain_state(seed=5)
    assert ckpt.load(state) == 3
    got = W.full_tensors(state)
    assert torch.equal(got["model.0.weight"], saved[3]["model.0.weight"])
    # Step 2 (async, a delta of step 0) decodes close to what was saved.
    _, _, state = plain_state(seed=5)
    assert ckpt.load(state, f"{root}/run/step_00000002") == 2
    err = (W.full_tensors(state)["model.0.weight"] - saved[2]["model.0.weight"]).abs().max()
    assert 0 < err < 1e-3
