"""Files written by format version 2 (tests/data, made by make_v2_files.py at the last
version-2 commit: the manifest as plain JSON) still read, verify and load bit for bit."""

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


@pytest.mark.parametrize("name, reference", [("v2_keyframe", None), ("v2_delta", "v2_keyframe")])
def test_v2_training_states_load_bit_for_bit(name, reference):
    ref = data(f"{reference}.safetensors") if reference else None
    state = tw_triton.load(data(f"{name}.safetensors"), reference=ref)
    flat, _ = flatten(state)
    expected = safetensors.torch.load_file(data(f"{name}_expected.safetensors"))
    assert set(flat) == set(expected)
    for path, tensor in flat.items():
        assert same_bytes(tensor, expected[path]), path
    assert state["step"] == (8 if reference else 5)


def test_a_v2_keyframe_serves_as_reference_for_a_new_delta(tmp_path):
    """A delta written today (the compact version) against a v2 keyframe loads against it."""
    key = tmp_path / "key.safetensors"
    shutil.copyfile(data("v2_keyframe.safetensors"), key)
    state = tw_triton.load(key)
    state["model"]["0.weight"] = state["model"]["0.weight"] + 0.01
    rules = [("model/*.weight", {"codec": "blockwise", "bits": 8, "block": 32, "min_numel": 0})]
    q = tw_triton.quantize_state_dict(state, reference=str(key), rules=rules)
    tw_triton.save(q, tmp_path / "delta.safetensors", fsync=False)
    assert fmt.read_manifest(tmp_path / "delta.safetensors")["version"] == fmt.FORMAT_VERSION
    back = tw_triton.load(tmp_path / "delta.safetensors", reference=str(key))
    assert (back["model"]["0.weight"] - state["model"]["0.weight"]).abs().max() < 1e-3
