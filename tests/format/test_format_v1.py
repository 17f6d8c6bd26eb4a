"""Files written by format version 1 (tests/data, made by make_v1_files.py at the last
version-1 commit) still read and load, bit for bit, whatever the writer writes today."""

from __future__ import annotations

import os
import shutil

import pytest
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


@pytest.mark.parametrize("name, reference", [("v1_keyframe", None), ("v1_delta", "v1_keyframe")])
def test_v1_training_states_load_bit_for_bit(name, reference):
    ref = data(f"{reference}.safetensors") if reference else None
    state = tw_triton.load(data(f"{name}.safetensors"), reference=ref)
    flat, _ = flatten(state)
    expected = safetensors.torch.load_file(data(f"{name}_expected.safetensors"))
    assert set(flat) == set(expected)
    for path, tensor in flat.items():
        assert same_bytes(tensor, expected[path]), path
    assert state["step"] == (8 if reference else 5)


def test_a_v1_keyframe_serves_as_reference_for_a_new_delta(tmp_path):
    """A delta written today against a v1 keyframe loads against it."""
    key = tmp_path / "key.safetensors"
    shutil.copyfile(data("v1_keyframe.safetensors"), key)
    state = tw_triton.load(key)
    state["model"]["0.weight"] = state["model"]["0.weight"] + 0.01
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    q = tw_triton.quantize_state_dict(state, reference=str(key), rules=rules)
    tw_triton.save(q, tmp_path / "delta.safetensors", fsync=False)
    back = tw_triton.load(tmp_path / "delta.safetensors", reference=str(key))
    err = (back["model"]["0.weight"] - state["model"]["0.weight"]).abs().max()
    assert err < 1e-3
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
