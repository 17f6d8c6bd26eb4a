"""CheckpointDirectory: listing, noting written files, discarding, finding."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from _read_spy import spy_on_reads

import tw_triton
from tw_triton import format as fmt
from tw_triton.checkpoint_dir import CheckpointDirectory, VerifiedRead, checkpoint_name, parse_checkpoint_name
from tw_triton.checkpointer import Checkpointer
from tw_triton.errors import CheckpointError


def _write(
    directory: CheckpointDirectory, step: int, *, kind: str = "keyframe", ref: str | None = None
) -> str:
    q = tw_triton.quantize_state_dict(
        {"w": torch.full((8,), float(step))},
        rules="exact",
        checkpoint_id=f"id{step}",
        metadata={"kind": kind},
    )
    q.reference_id = ref
    path = directory.path_for(step)
    tw_triton.save(q, path)
    return path


def test_names_round_trip():
    assert checkpoint_name(42) == "step-00000042.tw.safetensors"
    assert parse_checkpoint_name(checkpoint_name(42)) == 42
    assert parse_checkpoint_name(".step-00000042.tw.safetensors.0123456789abcdef.tmp") is None
    assert parse_checkpoint_name("step-42.pt") is None


def test_scan_lists_complete_files_only(tmp_path, caplog):
    d = CheckpointDirectory(tmp_path / "new")  # created if missing
    assert os.path.isdir(d.path) and d.scan() == {}
    _write(d, 1)
    _write(d, 3)
    (tmp_path / "new" / ".step-00000005.tw.safetensors.0123456789abcdef.tmp").write_bytes(b"partial")
    (tmp_path / "new" / "notes.txt").write_text("hello")
    (tmp_path / "new" / checkpoint_name(7)).write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        found = d.scan()
    assert sorted(found) == [1, 3]
    assert found[3].checkpoint_id == "id3" and found[3].kind == "keyframe"
    assert "step-00000007" in caplog.text and "cannot be read" in caplog.text


def test_a_noted_file_is_not_parsed_unless_its_size_differs(tmp_path, parses):
    d = CheckpointDirectory(tmp_path)
    path = _write(d, 2)
    size = os.path.getsize(path)
    d.note(2, path, size, ("noted-id", None, "keyframe"))
    assert d.scan()[2].checkpoint_id == "noted-id" and parses == []
    # A size that is not the file's: the note is not trusted, the header is read.
    d.note(2, path, size + 1, ("wrong", None, "keyframe"))
    other = CheckpointDirectory(tmp_path)
    other.note(2, path, size + 1, ("wrong", None, "keyframe"))
    assert other.scan()[2].checkpoint_id == "id2" and parses == [checkpoint_name(2)]


def test_discard_takes_a_file_out_and_leaves_a_temp_file_for_cleanup(tmp_path):
    d = CheckpointDirectory(tmp_path)
    _write(d, 1)
    _write(d, 2)
    found = d.scan()
    doomed = d.discard(found[1])
    assert doomed is not None and fmt.is_temp_file(doomed) and os.path.exists(doomed)
    assert sorted(d.scan()) == [2]
    assert d.discard(found[1]) is None  # already gone: nothing to do
    assert d.remove_temp_files() == [doomed] and not os.path.exists(doomed)


def test_find_names_the_steps_there_are_and_latest_skips_a_broken_chain(tmp_path, caplog):
    d = CheckpointDirectory(tmp_path)
    _write(d, 1)
    _write(d, 2, kind="delta", ref="missing-keyframe")
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 5 .*steps: \[1, 2\]"):
        d.find(5, verify=False)
    with caplog.at_level(logging.WARNING):
        assert d.latest(verify=True) == 1
    assert "missing-keyframe" in caplog.text
    found, info = d.find(None, verify=True)
    assert info.step == 1 and sorted(found) == [1, 2]


def _training_chain(directory, steps: int, keyframe_every: int):
    """A Checkpointer directory of a model and an optimizer-like state; the weights move."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    saved = []
    with Checkpointer(directory, keyframe_every=keyframe_every, keep_last=None, fsync=False) as ck:
        for step in range(steps):
            w = w + torch.randn(64, 128, generator=gen) * 1e-3
            state = {
                "model": {"w": w.clone()},
                "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 128, generator=gen)}}},
            }
            ck.save(step, **state)
            saved.append(state)
    return Checkpointer(directory, keep_last=None), saved


def _flip_buffer_byte(path: str, entry: str, buffer: str) -> None:
    data = bytearray(open(path, "rb").read())
    begin = fmt.read_manifest(path)["entries"][entry]["buffers"][buffer]["data_offsets"][0]
    data[8 + int.from_bytes(data[:8], "little") + begin + 1] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_latest_read_keeps_of_a_keyframe_only_what_its_delta_needs(tmp_path, monkeypatch):
    ck, _ = _training_chain(tmp_path, 2, keyframe_every=10)
    asked = spy_on_reads(monkeypatch)
    found, info, reads = ck._dir.latest_read(upload=None)
    keyframe = ck.path_for(0)
    assert info.step == 1 and reads[info.path].entries is None  # the delta itself: whole
    assert reads[keyframe].entries == {"model/w"}  # of its keyframe: the weights alone
    assert set(reads[keyframe].state.entries) == {"model/w"}
    assert asked == [(checkpoint_name(1), None), (checkpoint_name(0), ["model/w"])]
    # Those reads are the ones decoded: nothing is read again.
    state = ck._dir.decode(info, found, reads, torch.device("cpu"))
    assert len(asked) == 2 and torch.equal(state["model"]["w"], ck.load(1)["model"]["w"])


def test_latest_skips_a_delta_whose_keyframe_is_corrupt_where_the_delta_does_not_read(tmp_path, caplog):
    ck, _ = _training_chain(tmp_path, 4, keyframe_every=2)  # keyframes 0 and 2, deltas 1 and 3
    # The keyframe's optimizer state: a load of delta 3 never decodes it, but the file is
    # not intact, so neither it nor the delta that needs it is the latest good checkpoint.
    _flip_buffer_byte(ck.path_for(2), "optimizer/state/0/exp_avg", "codes")
    with caplog.at_level(logging.WARNING):
        assert ck.load()["step"] == 1
    assert "step-00000002" in caplog.text and "checksum mismatch" in caplog.text
    assert ck.latest() == 1  # the streaming verification agrees


def test_a_partial_read_is_read_whole_when_its_file_is_the_one_loaded(tmp_path, monkeypatch):
    ck, _ = _training_chain(tmp_path, 2, keyframe_every=10)
    found = ck._dir.scan()
    whole = ck.load(0)
    partial = fmt.read_file(ck.path_for(0), entries=["model/w"])
    asked = spy_on_reads(monkeypatch)
    reads = {ck.path_for(0): VerifiedRead(partial, frozenset({"model/w"}))}
    state = ck._dir.decode(found[0], found, reads, torch.device("cpu"))
    assert asked == [(checkpoint_name(0), None)]
    assert torch.equal(state["optimizer"]["state"][0]["exp_avg"], whole["optimizer"]["state"][0]["exp_avg"])


@pytest.mark.parametrize("where", ["the path", "a parent"])
def test_a_directory_that_is_a_file_is_a_checkpoint_io_error_naming_it(tmp_path, where):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    path = afile if where == "the path" else afile / "runs"
    with pytest.raises(
        tw_triton.CheckpointIOError, match=f"{path}: cannot be made or used as a checkpoint directory"
    ) as err:
        Checkpointer(path)
    assert err.value.errno is not None


def test_a_reader_whose_listing_a_live_writer_outdates_loads_what_the_writer_left(tmp_path, monkeypatch):
    # An evaluation process loads the latest checkpoint of a run still training with
    # keep_last=1: between its listing and its reads the writer lands a new keyframe and
    # retention deletes every file the listing held. The load raised "no complete,
    # verified checkpoint" (the newest "fails verification: [Errno 2]") while the
    # directory held a good one.
    model = torch.nn.Linear(64, 64)
    with Checkpointer(tmp_path / "run", keyframe_every=2, keep_last=None) as ckpt:
        for step in range(3):  # 0 keyframe, 1 delta, 2 keyframe
            with torch.no_grad():
                model.weight.add_(0.01)
            ckpt.save(step, model=model)
    landed = tmp_path / checkpoint_name(2)
    os.replace(tmp_path / "run" / checkpoint_name(2), landed)  # not written yet at the listing
    reader = Checkpointer(tmp_path / "run")
    real_read, real_verify = fmt.read_file, fmt.verify_file
    writer_ran = []

    def the_writer_moves_on():
        if not writer_ran:
            writer_ran.append(True)
            os.replace(landed, tmp_path / "run" / checkpoint_name(2))  # the new keyframe lands
            for step in (0, 1):  # and retention drops the files before it
                os.unlink(tmp_path / "run" / checkpoint_name(step))

    def read_file(*args, **kwargs):
        the_writer_moves_on()
        return real_read(*args, **kwargs)

    def verify_file(*args, **kwargs):
        the_writer_moves_on()
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(fmt, "read_file", read_file)
    monkeypatch.setattr(fmt, "verify_file", verify_file)
    state = reader.load()
    assert writer_ran and state["step"] == 2
    assert torch.equal(state["model"]["weight"], model.weight)
    reader.close()
