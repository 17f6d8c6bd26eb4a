"""Crafted checkpoint files (issue 28, items 3 and 8): a skeleton leaf out of its numpy
dtype's range and other malformed skeletons raise CheckpointError naming the file and the
path, and a Checkpointer passes such a file over as it does a corrupted one; a file whose
compressed buffers would decode to far more than its size is refused before anything is
decoded, unless the caller lifts the bound.

Files are edited with a valid manifest checksum, so the edits reach the checks behind it.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import Checkpointer, tree
from tw_triton import format as fmt
from tw_triton.codecs import entropy
from tw_triton.errors import CheckpointError


def edit_manifest(path: Path, edit) -> None:
    """Rewrite ``path`` with ``edit(manifest)`` applied and the manifest checksum fixed."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    manifest = json.loads(fmt.manifest_text(header["__metadata__"], str(path))[0])
    edit(manifest)
    header["__metadata__"] = fmt.manifest_metadata(json.dumps(manifest))
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n :])


def _leaf_pair(manifest: dict, key: str) -> list:
    """The [key, node] pair of the skeleton's top-level dict at ``key``."""
    return next(p for p in manifest["skeleton"]["dict"] if p[0] == key)


# --------------------------------------------------------------------------------------
# Item 3: skeleton leaves
# --------------------------------------------------------------------------------------

BAD_LEAVES = [
    ({"npscalar": "<i8", "value": 1e20}, "int64 value 1e\\+20, expected an int from"),
    ({"npscalar": "<i8", "value": 2**63}, "int64 value 9223372036854775808"),
    ({"npscalar": "|u1", "value": 256}, "uint8 value 256, expected an int from 0 to 255"),
    ({"npscalar": "<u4", "value": -1}, "uint32 value -1"),
    ({"npscalar": "<i8", "value": {"float": "inf"}}, "int64 value"),
    ({"npscalar": "<f2", "value": 1e20}, "float16 value 1e\\+20, expected a number within"),
    ({"npscalar": "<f8", "value": 10**400}, "float64 value"),
    ({"npscalar": "|b1", "value": 2}, "bool value 2, expected true or false"),
    ({"npscalar": "<c16", "value": 1.0}, "numpy dtype '<c16'"),
    ({"npscalar": "not a dtype", "value": 1}, "numpy dtype 'not a dtype'"),
    ({"npscalar": "<i8"}, "malformed node"),
    ({"float": "1.5"}, "float '1.5', expected 'nan', 'inf' or '-inf'"),
    ({"bytes": "xyz"}, "bytes 'xyz', expected a string of hex digit pairs"),
    ({"tensor": "no/such/entry"}, "names tensor 'no/such/entry', which has no entry"),
    ({"tensor": "model/w", "extra": 1}, "a 'tensor' node with keys"),
    ({"ndarray": "model/w", "dtype": "<U3"}, "numpy dtype '<U3'"),
    ({"list": {"not": "a list"}}, "expected a list"),
    ({"dict": [[{"float": "nan"}, 1]]}, "unsupported dict key nan"),
    ({"dict": [[1, 1], [1.0, 2]]}, "key 1.0 appears twice"),
    ([1, 2], "malformed node"),
]


@pytest.fixture
def saved(tmp_path) -> Path:
    """A file of the state API with a tensor and a few plain leaves at the top level."""
    state = {"model": {"w": torch.randn(4, 8)}, "count": np.int64(3), "lr": 0.5}
    path = tmp_path / "s.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state), path, fsync=False)
    return path


@pytest.mark.parametrize("leaf, match", BAD_LEAVES, ids=[json.dumps(b[0])[:40] for b in BAD_LEAVES])
def test_a_crafted_skeleton_leaf_raises_checkpoint_error_naming_file_and_path(saved, leaf, match):
    edit_manifest(saved, lambda m: _leaf_pair(m, "count").__setitem__(1, leaf))
    with pytest.raises(CheckpointError, match=match) as info:
        tw_triton.load(saved)
    assert str(saved) in str(info.value) and "'count'" in str(info.value)
    # What choosing a checkpoint checks, from the header alone, says the same.
    with pytest.raises(CheckpointError, match=match):
        tw_triton.state.check_manifest(fmt.read_manifest(saved), str(saved))


def test_a_numpy_array_leaf_of_a_dtype_numpy_lacks_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "bf.safetensors"
    tw_triton.save(
        tw_triton.quantize_state_dict({"w": torch.ones(3, dtype=torch.bfloat16)}, rules="exact"),
        path,
        fsync=False,
    )
    edit_manifest(path, lambda m: _leaf_pair(m, "w").__setitem__(1, {"ndarray": "w", "dtype": "<f4"}))
    with pytest.raises(CheckpointError, match="numpy has no such dtype"):
        tw_triton.load(path)


def test_every_leaf_flatten_writes_still_loads(tmp_path):
    """The strict checks refuse nothing flatten writes: extremes of every numpy kind."""
    state = {
        "ints": [np.int8(-128), np.uint8(255), np.int64(-(2**63)), np.uint64(2**64 - 1), np.uint32(0)],
        "floats": [np.float16(65504.0), np.float32(-3.4e38), np.float32(np.inf), np.float16(np.nan), 1e308],
        "other": [np.bool_(True), b"\x00\xff", float("-inf"), None, "s", (1, 2)],
        1.5: {None: 1, True: 2, 2.5: 3},
    }
    path = tmp_path / "ok.safetensors"
    tw_triton.save(tw_triton.quantize_state_dict(state), path, fsync=False)
    back = tw_triton.load(path)
    assert repr(back) == repr(state)
    assert [type(v) for v in back["ints"] + back["floats"]] == [
        type(v) for v in state["ints"] + state["floats"]
    ]


def _bad_latest(tmp_path: Path) -> tuple[Checkpointer, torch.Tensor]:
    """Steps 1 and 2 saved by a Checkpointer; step 2's skeleton holds a uint8 of 256. Also
    returns the weight saved at step 1."""
    model = torch.nn.Linear(8, 4)
    ck = Checkpointer(tmp_path, keyframe_every=1, async_write=False, fsync=False)
    ck.save(1, model=model, extra={"n": np.uint8(1)})
    first = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.save(2, model=model, extra={"n": np.uint8(2)})

    def edit(m):
        extra = _leaf_pair(m, "extra")[1]
        extra["dict"][0][1] = {"npscalar": "|u1", "value": 256}

    edit_manifest(Path(ck.path_for(2)), edit)
    return ck, first


def test_latest_and_restore_pass_over_a_file_whose_skeleton_cannot_be_decoded(tmp_path):
    ck, first = _bad_latest(tmp_path)
    assert ck.latest() == 1
    problems = ck._dir.problems(verify=True)
    assert problems[1] is None and "uint8 value 256" in problems[2]
    fresh = torch.nn.Linear(8, 4)
    state = ck.restore(model=fresh, rng=False)
    assert state["step"] == 1 and state["extra"]["n"] == np.uint8(1)
    assert torch.equal(fresh.weight, first)
    assert ck.load()["step"] == 1
    # Asked for by step, the file is an error naming it, not another exception.
    with pytest.raises(CheckpointError, match="uint8 value 256") as info:
        ck.load(2)
    assert ck.path_for(2) in str(info.value)
    ck.close()


def test_a_file_with_bad_codec_params_is_passed_over_too(tmp_path):
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer(tmp_path, keyframe_every=2, async_write=False, fsync=False)
    ck.save(1, model=model)
    ck.save(2, model=model)  # a delta: its weight is blockwise
    edited = []

    def edit(m):
        for entry in m["entries"].values():
            if entry["codec"] == "blockwise":
                entry["params"]["bits"] = 3
                edited.append(entry)

    edit_manifest(Path(ck.path_for(2)), edit)
    assert edited
    assert ck.latest() == 1
    assert ck.load()["step"] == 1
    ck.close()


# Hypothesis: any JSON value at a skeleton leaf, or as the whole skeleton.
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=6)
    | st.sampled_from(["<i8", "|u1", "<f2", "<f8", "|b1", "<c8", "O", "nan", "inf", "-inf", "ff", "model/w"]),
    lambda c: (
        st.lists(c, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "npscalar",
                    "value",
                    "float",
                    "bytes",
                    "tensor",
                    "ndarray",
                    "dtype",
                    "list",
                    "tuple",
                    "dict",
                    "odict",
                    "meta",
                    "x",
                ]
            ),
            c,
            max_size=3,
        )
    ),
    max_leaves=8,
)


@settings(max_examples=250, deadline=None)
@given(leaf=_JSON)
def test_property_any_skeleton_raises_only_checkpoint_error(leaf):
    """unflatten of any JSON returns or raises CheckpointError, and check_skeleton (what
    choosing a checkpoint runs) agrees with it."""
    tensors = {"model/w": torch.zeros(2)}
    for skeleton in (leaf, {"dict": [["k", leaf]]}, {"list": [leaf, {"tensor": "model/w"}]}):
        try:
            tree.unflatten(skeleton, tensors)
        except CheckpointError:
            with pytest.raises(CheckpointError):
                tree.check_skeleton(skeleton, {"model/w": torch.float32})
            continue
        tree.check_skeleton(skeleton, {"model/w": torch.float32})


# --------------------------------------------------------------------------------------
# Item 8: decompression bombs
# --------------------------------------------------------------------------------------

BOMB_BYTES = 96 << 20  # declared zeros (above the 64 MiB slack); the file itself is a few KB


@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> Path:
    """A tiny file whose one exact uint8 entry declares BOMB_BYTES of zeros, written by the
    library itself (so every frame is genuine: only the size is hostile)."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.safetensors"
    state = {"zeros": torch.zeros(BOMB_BYTES, dtype=torch.uint8)}
    tw_triton.save(tw_triton.quantize_state_dict(state, rules="exact"), path, fsync=False)
    return path


def test_a_decompression_bomb_is_refused_before_decompressing(bomb, monkeypatch):
    size = bomb.stat().st_size
    assert size * 1000 < BOMB_BYTES
    calls = []
    for name in ("decode", "verify"):
        for stage_name in entropy.stage_names():
            stage = entropy.get_stage(stage_name)
            real = getattr(type(stage), name)
            monkeypatch.setattr(
                type(stage),
                name,
                lambda self, *a, _real=real, **k: (calls.append(1), _real(self, *a, **k))[1],
            )
    real_empty = torch.empty

    def bounded_empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        assert t.numel() * t.element_size() <= fmt.EXPANSION_SLACK_BYTES, "allocated before refusing"
        return t

    monkeypatch.setattr(torch, "empty", bounded_empty)
    for read in (lambda: fmt.read_file(bomb), lambda: fmt.verify_file(bomb), lambda: tw_triton.load(bomb)):
        with pytest.raises(
            CheckpointError, match=f"decode to {BOMB_BYTES} bytes, more than 32 times"
        ) as info:
            read()
        assert str(bomb) in str(info.value)
    assert calls == []


def test_the_bound_scales_with_the_file_and_can_be_lifted(bomb, tmp_path):
    size = bomb.stat().st_size
    # Just below and above the bound set by a factor.
    at = (BOMB_BYTES - fmt.EXPANSION_SLACK_BYTES) / size
    with pytest.raises(CheckpointError, match="max_expansion"):
        fmt.read_file(bomb, max_expansion=math.floor(at) - 1)
    fmt.verify_file(bomb, max_expansion=math.ceil(at))
    back = tw_triton.load(bomb, max_expansion=None)
    assert back["zeros"].shape == (BOMB_BYTES,) and not back["zeros"].any()


def test_real_checkpoints_are_far_below_the_bound(tmp_path):
    """A keyframe and closed-loop deltas of a small model with a zero-initialised matrix
    and a mask buffer (the kinds of constant tensors real states hold) load under the
    default bound, and decode to a few times their size at most."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    torch.nn.init.zeros_(model[1].weight)
    model.register_buffer("mask", torch.tril(torch.ones(256, 256, dtype=torch.bool)))
    opt = torch.optim.AdamW(model.parameters())
    ck = Checkpointer(tmp_path, keyframe_every=3, async_write=False, fsync=False, keep_last=None)
    for step in range(6):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        ck.save(step, model=model, optimizer=opt)
    for step in ck.steps():
        layout_ratio = _decoded_ratio(Path(ck.path_for(step)))
        assert layout_ratio < fmt.MAX_EXPANSION / 4
    assert ck.load()["step"] == 5
    ck.close()


def _decoded_ratio(path: Path) -> float:
    manifest = fmt.read_manifest(path)
    staged = sum(
        b["stage"]["raw_nbytes"]
        for e in manifest["entries"].values()
        for b in e["buffers"].values()
        if "stage" in b
    )
    return staged / path.stat().st_size


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "32", True, [32]])
def test_a_max_expansion_that_is_not_a_bound_is_refused_naming_it(tmp_path, bad):
    """NaN compared false with every size (the bound was silently off), a string was
    repeated by the file's size; each is refused by every reader before a file is read."""
    path = tmp_path / "small.tw"
    tw_triton.save(tw_triton.quantize_state_dict({"w": torch.ones(64)}), path, fsync=False)
    for read in (
        lambda: fmt.read_file(path, max_expansion=bad),
        lambda: fmt.verify_file(path, max_expansion=bad),
        lambda: tw_triton.load(path, max_expansion=bad),
        lambda: Checkpointer(tmp_path / "run", max_expansion=bad),
    ):
        with pytest.raises(CheckpointError, match="max_expansion must be None or a number"):
            read()
    assert torch.equal(tw_triton.load(path, max_expansion=0)["w"], torch.ones(64))
    assert torch.equal(tw_triton.load(path, max_expansion=math.inf)["w"], torch.ones(64))
