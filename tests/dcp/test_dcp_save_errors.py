"""A failed save of the DCP plug-in is a tw_triton error naming the directory, not DCP's
``CheckpointException`` (a ``BaseException``): ``StorageWriter`` turns the operating
system's failure to make the checkpoint directory into a ``CheckpointIOError``, and
``DistributedCheckpointer.save`` (and its asynchronous future, and ``wait``) re-raise it as
``tw_triton.dcp.save`` does (one process)."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import torch

import tw_triton.dcp as tw_dcp
from tw_triton.dcp import DistributedCheckpointer
from tw_triton.dcp import writer as dcp_writer
from tw_triton.dcp.meta import METADATA_NAME
from tw_triton.errors import CheckpointError, CheckpointIOError, QuantizationError


def state(seed: int) -> dict:
    return {"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)), "step": seed}


def test_a_directory_that_cannot_be_made_is_a_checkpoint_io_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(CheckpointIOError, match="file") as info:
        tw_dcp.save(state(0), blocker, no_dist=True)
    assert info.value.errno == errno.EEXIST


@pytest.mark.parametrize("under", [False, True])
def test_a_distributed_checkpointer_whose_directory_cannot_be_made_is_a_checkpoint_io_error(tmp_path, under):
    # DistributedCheckpointer(a file) raised the bare FileExistsError / NotADirectoryError
    # of os.makedirs, where a Checkpointer raises CheckpointIOError naming the directory.
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    where = blocker / "run" if under else blocker
    with pytest.raises(CheckpointIOError, match="cannot be made or used as a checkpoint directory") as info:
        DistributedCheckpointer(where)
    assert info.value.errno == (errno.ENOTDIR if under else errno.EEXIST)
    assert str(where) in str(info.value)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_failed_distributed_save_raises_the_tw_triton_error(tmp_path, asynchronous):
    ckpt = DistributedCheckpointer(tmp_path / "run", keyframe_every=2, keep=2)
    ckpt.save(state(0), 0)
    with open(ckpt.path_for(1), "w"):  # a file where step 1's directory goes
        pass
    with pytest.raises(CheckpointIOError, match="step_00000001"):
        fut = ckpt.save(state(1), 1, asynchronous=asynchronous)
        if asynchronous:
            with pytest.raises(CheckpointIOError, match="step_00000001"):
                fut.result()
            ckpt.wait()
    # The run goes on: the next save is written and loads.
    ckpt.save(state(2), 2, asynchronous=asynchronous)
    ckpt.wait()
    target = {"w": torch.zeros(64, 64), "step": -1}
    assert ckpt.load(target) == 2 and target["step"] == 2


@pytest.mark.parametrize("step", [-1, 1.5, "3"])
def test_a_step_that_is_not_a_non_negative_integer_is_refused_before_anything_is_written(tmp_path, step):
    # step -1 was written as step_-0000001, which latest() and retention never see.
    ckpt = DistributedCheckpointer(tmp_path / "run")
    with pytest.raises(CheckpointError, match=f"step must be .*{step}"):
        ckpt.save(state(0), step)
    assert [n for n in os.listdir(tmp_path / "run") if n.startswith("step_")] == []


@dataclasses.dataclass
class Config:
    lr: float = 0.1


def test_a_value_a_load_would_refuse_is_refused_at_the_save_naming_it(tmp_path):
    # DCP pickles non-tensor values; a load unpickles only plain data. A dataclass saved
    # before made every checkpoint of the run unloadable, found out at the resume.
    with pytest.raises(QuantizationError, match="'cfg'.*Config"):
        tw_dcp.save({"w": torch.zeros(4), "cfg": Config()}, tmp_path / "a", no_dist=True)
    assert not (tmp_path / "a" / METADATA_NAME).exists()
    ckpt = DistributedCheckpointer(tmp_path / "run")
    for asynchronous in (False, True):
        with pytest.raises(QuantizationError, match="'cfg'"):
            ckpt.save({"w": torch.zeros(4), "cfg": Config()}, 1, asynchronous=asynchronous)
            ckpt.wait()
    assert ckpt.latest() is None


def test_a_file_holding_such_a_value_is_refused_at_the_load_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(dcp_writer, "check_plain_data", lambda data, where: None)  # an older writer
    tw_dcp.save({"w": torch.zeros(4), "cfg": Config()}, tmp_path / "a", no_dist=True)
    with pytest.raises(CheckpointError, match="entry 'cfg': not plain data"):
        tw_dcp.load({"w": torch.zeros(4), "cfg": None}, tmp_path / "a", no_dist=True)


def test_rules_that_do_not_resolve_are_refused_when_the_checkpointer_is_made(tmp_path):
    with pytest.raises(QuantizationError, match="nonsense"):
        DistributedCheckpointer(tmp_path / "run", rules="nonsense")
