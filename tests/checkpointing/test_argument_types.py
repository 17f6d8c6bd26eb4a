"""Wrongly typed arguments of the public API (tw_triton's exports, and tw_triton.dcp's
DistributedCheckpointer) are errors of the library's family naming the argument and what
was expected, never a raw TypeError from deep inside. A bool is not an integer anywhere
(as ``bits=True`` was refused already)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tw_triton
from tw_triton import AsyncWriter, Checkpointer, SnapshotPool, TwTritonError


def qstate():
    return tw_triton.quantize_state_dict({"w": torch.zeros(8)})


def ckpt(tmp_path, **options):
    return lambda: Checkpointer(tmp_path / "ck", fsync=False, **options).close()


def dcp_checkpointer(directory, **options):
    from tw_triton.dcp import DistributedCheckpointer  # imports torch.distributed: only here

    return DistributedCheckpointer(directory, **options)


CASES = {
    "save path int": (lambda tmp: tw_triton.save(qstate(), 3), "path must be a path.*got 3 \\(int\\)"),
    "save path None": (lambda tmp: tw_triton.save(qstate(), None), "path must be a path.*None"),
    "save path bytes": (lambda tmp: tw_triton.save(qstate(), b"x.tw"), "path must be a path.*bytes"),
    "load path int": (lambda tmp: tw_triton.load(3), "path must be a path.*got 3"),
    "directory int": (lambda tmp: Checkpointer(3), "directory must be a path.*got 3 \\(int\\)"),
    "keyframe_every str": (
        lambda tmp: ckpt(tmp, keyframe_every="3")(),
        "keyframe_every must be an integer, got '3'",
    ),
    "keyframe_every float": (
        lambda tmp: ckpt(tmp, keyframe_every=3.0)(),
        "keyframe_every must be an integer, got 3.0",
    ),
    "keyframe_every bool": (
        lambda tmp: ckpt(tmp, keyframe_every=True)(),
        "keyframe_every must be an integer, got True",
    ),
    "keep_last str": (
        lambda tmp: ckpt(tmp, keep_last="3")(),
        "keep_last must be an integer or None, got '3'",
    ),
    "keep_last bool": (
        lambda tmp: ckpt(tmp, keep_last=True)(),
        "keep_last must be an integer or None, got True",
    ),
    "keep_last 0": (lambda tmp: ckpt(tmp, keep_last=0)(), "keep_last must be at least 1 or None, got 0"),
    "max_pending str": (lambda tmp: ckpt(tmp, max_pending="1")(), "max_pending must be an integer, got '1'"),
    "max_pending unused": (
        lambda tmp: ckpt(tmp, max_pending="1", async_write=False)(),
        "max_pending must be an integer",
    ),
    "pinned_bytes str": (
        lambda tmp: ckpt(tmp, pinned_bytes="1")(),
        "pinned_bytes must be an integer or None",
    ),
    "snapshot_pool_bytes str": (
        lambda tmp: ckpt(tmp, snapshot_pool_bytes="1")(),
        "snapshot_pool_bytes must be an integer or None, got '1'",
    ),
    "snapshot_pool_bytes -1": (
        lambda tmp: ckpt(tmp, snapshot_pool_bytes=-1)(),
        "snapshot_pool_bytes must be non-negative or None, got -1",
    ),
    "bits str": (lambda tmp: ckpt(tmp, bits="8")(), "bits must be one of"),
    "bits bool": (lambda tmp: ckpt(tmp, bits=True)(), "bits must be one of"),
    "block str": (lambda tmp: ckpt(tmp, block="128")(), "block must be a power of two"),
    "max_expansion str": (
        lambda tmp: ckpt(tmp, max_expansion="3")(),
        "max_expansion must be None or a number",
    ),
    "path_for str": (
        lambda tmp: Checkpointer(tmp / "p", fsync=False).path_for("3"),
        "step must be an integer, got '3'",
    ),
    "save step bool": (
        lambda tmp: Checkpointer(tmp / "s", fsync=False).save(True, w=torch.nn.Linear(2, 2)),
        "step must be an integer, got True",
    ),
    "dcp directory int": (lambda tmp: dcp_checkpointer(3), "directory must be a path.*got 3"),
    "dcp keyframe_every str": (
        lambda tmp: dcp_checkpointer(tmp / "d", keyframe_every="3"),
        "keyframe_every must be an integer, got '3'",
    ),
    "dcp keep bool": (
        lambda tmp: dcp_checkpointer(tmp / "d", keep=True),
        "keep must be an integer, got True",
    ),
    "writer max_pending str": (lambda tmp: AsyncWriter(max_pending="1"), "max_pending must be an integer"),
    "writer pinned_bytes str": (lambda tmp: AsyncWriter(pinned_bytes="1"), "pinned_bytes must be an integer"),
    "pool cap str": (lambda tmp: SnapshotPool("1"), "cap_bytes must be an integer or None, got '1'"),
    "quantize_state_dict metadata list": (
        lambda tmp: tw_triton.quantize_state_dict({"w": torch.zeros(8)}, metadata=[1]),
        "metadata must be a mapping or None, got list",
    ),
    "quantize_state_dict checkpoint_id int": (
        lambda tmp: tw_triton.quantize_state_dict({"w": torch.zeros(8)}, checkpoint_id=3),
        "checkpoint_id must be a str or None, got 3",
    ),
    "quantize_state_dict max_expansion str": (
        lambda tmp: tw_triton.quantize_state_dict({"w": torch.zeros(8)}, max_expansion="3"),
        "max_expansion must be None or a number",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrongly_typed_argument_is_a_library_error_naming_it(tmp_path, case):
    call, match = CASES[case]
    with pytest.raises(TwTritonError, match=match):
        call(tmp_path)


def test_integers_of_any_integer_type_and_paths_of_any_pathlike_still_work(tmp_path):
    q = qstate()
    assert tw_triton.save(q, tmp_path / "a.tw") > 0 and "w" in tw_triton.load(tmp_path / "a.tw")
    with Checkpointer(tmp_path / "ck", keyframe_every=np.int64(2), keep_last=np.int32(1), fsync=False) as ck:
        assert ck.keyframe_every == 2 and type(ck.keyframe_every) is int
        ck.save(np.int64(1), w=torch.nn.Linear(2, 2))
        assert ck.steps() == [1] and ck.path_for(np.int64(1)).endswith("step-00000001.tw.safetensors")
