"""A delta loaded with its reference given as a path: the reference file is read on a thread
of its own while the delta file is read and its other entries are decoded. The result, the
errors and the progress calls are those of reading the two one after the other."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from _states import assert_same, make_state, perturbed

from tw_triton import (
    CheckpointError,
    ReferenceMismatchError,
    dequantize_state_dict,
    load,
    quantize_state_dict,
    save,
)
from tw_triton import format as fmt
from tw_triton.errors import CheckpointIOError

WAIT_S = 20.0  # far beyond any read here: a timeout means the two never ran at once


def _files(tmp_path):
    state = make_state()
    save(quantize_state_dict(perturbed(state), checkpoint_id="kf"), tmp_path / "k.tw")
    save(quantize_state_dict(state, reference=tmp_path / "k.tw"), tmp_path / "d.tw")
    return tmp_path / "d.tw", tmp_path / "k.tw"


def _reference_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tw_triton-reference"]


def test_the_reference_file_is_read_while_the_delta_file_is(tmp_path, monkeypatch):
    delta, key = _files(tmp_path)
    want = load(delta, reference=load(key))
    real = fmt.read_file
    reference_started = threading.Event()
    seen: dict[str, bool] = {}

    def spy(path, **kw):
        if str(path) == str(key):
            reference_started.set()
        else:
            # The delta's read holds until the reference's has begun: one after the other,
            # this would wait out the timeout.
            seen["overlapped"] = reference_started.wait(WAIT_S)
        return real(path, **kw)

    monkeypatch.setattr(fmt, "read_file", spy)
    got = load(delta, reference=key)
    assert seen == {"overlapped": True}
    assert_same(got, want)
    assert not _reference_threads()


def test_entries_without_a_reference_are_decoded_while_it_is_read(tmp_path, monkeypatch):
    delta, key = _files(tmp_path)
    q = fmt.read_file(delta)
    real = fmt.read_file
    decoded_one = threading.Event()
    seen: dict[str, bool] = {}

    def spy(path, **kw):
        # The reference's read holds until an entry that needs no reference is decoded.
        seen["overlapped"] = decoded_one.wait(WAIT_S)
        return real(path, **kw)

    calls: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        calls.append((done, total))
        decoded_one.set()

    monkeypatch.setattr(fmt, "read_file", spy)
    got = dequantize_state_dict(q, reference=key, progress=progress)
    assert seen == {"overlapped": True}
    total = len(q.entries)
    assert calls == [(k, total) for k in range(1, total + 1)]
    monkeypatch.setattr(fmt, "read_file", real)
    assert_same(got, load(delta, reference=load(key)))


def test_progress_counts_every_entry_once_in_order(tmp_path):
    delta, key = _files(tmp_path)
    calls: list[tuple[int, int]] = []
    load(delta, reference=key, progress=lambda done, total: calls.append((done, total)))
    total = len(fmt.read_manifest(delta)["entries"])
    assert calls == [(k, total) for k in range(1, total + 1)]


def _flip_a_byte(path, entry: str, buffer: str) -> None:
    spec = fmt.read_manifest(path)["entries"][entry]["buffers"][buffer]
    raw = bytearray(path.read_bytes())
    raw[8 + int.from_bytes(raw[:8], "little") + spec["data_offsets"][0] + 5] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "corrupt, entry, buffer",
    [("d.tw", "optimizer/state/0/exp_avg", "data"), ("k.tw", "model/w1", "codes")],
    ids=["the delta", "the reference"],
)
def test_a_corrupt_file_raises_its_own_error_and_leaves_no_read_behind(tmp_path, corrupt, entry, buffer):
    delta, key = _files(tmp_path)
    _flip_a_byte(tmp_path / corrupt, entry, buffer)
    with pytest.raises(CheckpointError, match=rf"{re.escape(corrupt)}: entry '{entry}' buffer '{buffer}'"):
        load(delta, reference=key)
    assert not _reference_threads()


def test_a_missing_or_wrong_reference_file_is_reported(tmp_path):
    delta, key = _files(tmp_path)
    with pytest.raises(CheckpointIOError, match="nope.tw"):
        load(delta, reference=tmp_path / "nope.tw")
    save(quantize_state_dict(make_state(), checkpoint_id="other"), tmp_path / "o.tw")
    with pytest.raises(ReferenceMismatchError, match=r"d\.tw: entry 'model/w1'.*'kf'.*o\.tw.*'other'"):
        load(delta, reference=tmp_path / "o.tw")
    assert not _reference_threads()


def test_the_intraop_thread_default_comes_back_after_a_delta_load(tmp_path):
    """The reference's read runs parallel_map on its own thread; the count a new thread
    inherits must be the caller's afterwards, whichever side finished last."""
    delta, key = _files(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        load(delta, reference=key)
        box: list[int] = []
        t = threading.Thread(target=lambda: box.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert box == [3]
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
