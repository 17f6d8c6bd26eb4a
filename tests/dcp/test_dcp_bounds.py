"""The decompression-bomb bound on DCP loads: files of the checkpoint and of its keyframe."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tw_triton.dcp as tw_dcp
import tw_triton.state.encode
from tw_triton.dcp import Keyframe, StorageWriter
from tw_triton.errors import CheckpointError, TwTritonError
from tw_triton.format import reader


def _state() -> dict[str, torch.Tensor]:
    # 4 MiB of zeros: a few KB once compressed, far over the bound with a small slack.
    return {
        "zeros": torch.zeros(1 << 20),
        "w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),
    }


@pytest.fixture
def saved(tmp_path, monkeypatch):
    monkeypatch.setattr(reader, "EXPANSION_SLACK_BYTES", 1 << 20)
    # Stored exact, not by the sparse codec: the zstd frame of its zeros is what is large.
    monkeypatch.setattr(tw_triton.state.encode, "sparse_candidate", lambda x: False)
    key, delta = str(tmp_path / "key"), str(tmp_path / "delta")
    dcp.save(_state(), storage_writer=StorageWriter(key, rules="exact"), no_dist=True)
    ref = Keyframe(key, max_expansion=None)
    state = _state()
    state["w"] += 0.01
    dcp.save(state, storage_writer=StorageWriter(delta, rules="small", reference=ref), no_dist=True)
    return key, delta


def _empty() -> dict[str, torch.Tensor]:
    return {"zeros": torch.ones(1 << 20), "w": torch.empty(64, 64)}


@pytest.mark.parametrize("which", ["key", "delta"])
def test_a_dcp_load_over_the_bound_is_refused_naming_max_expansion(saved, which):
    path = saved[0] if which == "key" else saved[1]
    with pytest.raises(CheckpointError, match="max_expansion"):
        tw_dcp.load(_empty(), path, no_dist=True)


@pytest.mark.parametrize("bound", [None, 1e9])
def test_a_larger_bound_loads_the_checkpoint_and_its_keyframe(saved, bound):
    """Both files are over the default bound: the delta loads only if its keyframe is read
    with the reader's bound too."""
    state = _empty()
    tw_dcp.load(state, saved[1], no_dist=True, max_expansion=bound)
    assert torch.equal(state["zeros"], torch.zeros(1 << 20))
    assert (state["w"] - (_state()["w"] + 0.01)).abs().max() < 0.01


def test_the_constructor_refuses_a_bound_or_rules_no_load_or_save_could_use(tmp_path):
    """NaN turned the expansion bound off; bits, block or rules no save could resolve failed
    only inside the first save."""
    for kw, match in (
        ({"max_expansion": float("nan")}, "max_expansion must be None or a number"),
        ({"bits": 3}, "bits must be one of"),
        ({"rules": "nope"}, "unknown rules preset 'nope'"),
    ):
        with pytest.raises(TwTritonError, match=match):
            tw_dcp.DistributedCheckpointer(tmp_path / "run", **kw)
    assert not (tmp_path / "run").exists()
