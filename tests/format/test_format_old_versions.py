"""Files written by earlier format versions (tests/data: version 1 made by make_v1_files.py
at the last version-1 commit, version 2 by make_v2_files.py at the last version-2 commit)
still read and load, bit for bit, whatever the writer writes today."""

from __future__ import annotations

import os
import shutil

import pytest
import safetensors
import safetensors.torch
import torch

import tw_triton
from tw_triton import format as fmt
from tw_triton.tree import flatten

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def data(name: str) -> str:
    return os.path.join(DATA, name)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (so NaN payloads and -0.0 count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def test_v1_files_are_version_1():
    for name in ("v1_format", "v1_keyframe", "v1_delta"):
        manifest = fmt.read_manifest(data(f"{name}.safetensors"))
        assert manifest["version"] == 1
        for entry in manifest["entries"].values():
            for buf in entry["buffers"].values():
                assert "stage" not in buf


def test_v1_format_file_reads_every_buffer_back():
    got = fmt.read_file(data("v1_format.safetensors"))
    expected = safetensors.torch.load_file(data("v1_format_expected.safetensors"))
    keys = {fmt.tensor_key(p, n) for p, e in got.entries.items() for n in e.buffers}
    assert keys == set(expected)
    for path, entry in got.entries.items():
        for name, buf in entry.buffers.items():
            assert same_bytes(buf, expected[fmt.tensor_key(path, name)]), (path, name)
    assert got.checkpoint_id == "v1-format-0001" and got.reference_id == "v1-keyframe-0000"
    assert got.aliases == {"model/w8_tied": "model/w8"}
    assert got.entries["model/w4"].params == {"bits": 4, "block": 32, "packing": "lsb-first", "delta": False}
    assert got.entries["model/w4"].dtype == torch.bfloat16
    assert got.skeleton["betas"] == {"__tuple__": [0.9, 0.999]}
    fmt.verify_file(data("v1_format.safetensors"))


@pytest.mark.parametrize("name", ["v2_format", "v2_keyframe", "v2_delta"])
def test_v2_files_store_the_manifest_as_json(name):
    with safetensors.safe_open(data(f"{name}.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert set(meta) == {fmt.MANIFEST_KEY, fmt.MANIFEST_CRC_KEY}
    manifest = fmt.read_manifest(data(f"{name}.safetensors"))
    assert manifest["version"] == 2
    assert fmt.is_checkpoint_metadata(meta)


def test_v2_format_file_reads_every_buffer_back():
    path = data("v2_format.safetensors")
    headers = fmt.HeaderCache()
    got = fmt.read_file(path, headers=headers)
    expected = safetensors.torch.load_file(data("v2_format_expected.safetensors"))
    keys = {fmt.tensor_key(p, n) for p, e in got.entries.items() for n in e.buffers}
    assert keys == set(expected)
    for entry_path, entry in got.entries.items():
        for name, buf in entry.buffers.items():
            assert same_bytes(buf, expected[fmt.tensor_key(entry_path, name)]), (entry_path, name)
    manifest = fmt.read_manifest(path, headers=headers)
    staged = [n for e in manifest["entries"].values() for n, b in e["buffers"].items() if "stage" in b]
    assert staged, "the sample must hold a staged buffer"
    assert got.checkpoint_id == "v2-format-0001" and got.reference_id == "v2-keyframe-0000"
    assert got.aliases == {"model/w8_tied": "model/w8"}
    assert got.metadata["note"] == "format version 2"
    fmt.verify_file(path, headers=headers)
    assert len(headers) == 1


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("kind, reference", [("keyframe", None), ("delta", "keyframe")])
def test_old_training_states_load_bit_for_bit(version, kind, reference):
    ref = data(f"{version}_{reference}.safetensors") if reference else None
    state = tw_triton.load(data(f"{version}_{kind}.safetensors"), reference=ref)
    flat, _ = flatten(state)
    expected = safetensors.torch.load_file(data(f"{version}_{kind}_expected.safetensors"))
    assert set(flat) == set(expected)
    for path, tensor in flat.items():
        assert same_bytes(tensor, expected[path]), path
    assert state["step"] == (8 if reference else 5)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_old_keyframe_serves_as_reference_for_a_new_delta(tmp_path, version):
    """A delta written today (the current version) against an old keyframe loads against it."""
    key = tmp_path / "key.safetensors"
    shutil.copyfile(data(f"{version}_keyframe.safetensors"), key)
    state = tw_triton.load(key)
    state["model"]["0.weight"] = state["model"]["0.weight"] + 0.01
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    q = tw_triton.quantize_state_dict(state, reference=str(key), rules=rules)
    tw_triton.save(q, tmp_path / "delta.safetensors", fsync=False)
    assert fmt.read_manifest(tmp_path / "delta.safetensors")["version"] == fmt.FORMAT_VERSION
    back = tw_triton.load(tmp_path / "delta.safetensors", reference=str(key))
    err = (back["model"]["0.weight"] - state["model"]["0.weight"]).abs().max()
    assert err < 1e-3
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])


@pytest.fixture
def pre_record_dir(tmp_path):
    """The Checkpointer files written before files recorded optimizer classes (tests/data/
    make_v3_checkpointer_files.py), copied (a Checkpointer holds its directory)."""
    shutil.copytree(data("v3_checkpointer"), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_checkpointer_files_without_the_optimizer_record_restore_as_before(pre_record_dir):
    for name in os.listdir(pre_record_dir):
        assert "optimizers" not in fmt.read_manifest(pre_record_dir / name)["metadata"]
    expected = safetensors.torch.load_file(data("v3_checkpointer_expected.safetensors"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    state = tw_triton.Checkpointer(pre_record_dir).restore(model=model, optimizer=opt)
    assert state["step"] == 8
    flat, _ = flatten({"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert set(flat) == set(expected)
    for path, tensor in flat.items():
        assert same_bytes(tensor, expected[path]), path
    # Nothing recorded, nothing compared: another class loads as torch's load_state_dict lets it.
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    tw_triton.Checkpointer(pre_record_dir).restore(5, model=model, optimizer=sgd)
    assert set(sgd.state_dict()["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert tw_triton.Checkpointer(pre_record_dir).load(into={"optimizer": sgd})["step"] == 8
