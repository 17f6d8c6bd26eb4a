"""Early writeback of a checkpoint file (tw_triton.format.writeback): the ranges handed to the
kernel cover the file's bytes as they are written, the bytes are the same with or without
it, and it is off for files that are not fsynced."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _format_samples import exact_entry, sample_state

from tw_triton import format as fmt
from tw_triton.format import writeback, writer


def _spy(monkeypatch):
    calls = []

    def record(fd, offset, nbytes):
        # What the kernel would see now: the file holds every byte of the range.
        calls.append((offset, nbytes, os.fstat(fd).st_size))

    monkeypatch.setattr(writer, "start_writeback", record)
    monkeypatch.setattr(writer, "can_start_writeback", lambda: True)
    return calls


def _big_state():
    state = sample_state(3)
    g = torch.Generator().manual_seed(0)
    # ~20 MiB over several buffers, one of them larger than a write chunk.
    for i, n in enumerate((3 << 20, 1 << 20, 700_001)):
        state.entries[f"big/{i}"] = exact_entry(torch.randn(n, generator=g))
    return state


def test_writeback_ranges_follow_the_writes_and_cover_the_data(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "IO_CHUNK_BYTES", 1 << 20)
    calls = _spy(monkeypatch)
    path = tmp_path / "ckpt"
    size = fmt.write_file(_big_state(), path, entropy=None)
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert calls, "a file of ~20 MiB asked for no writeback"
    pos = header
    for offset, nbytes, file_size in calls:
        assert offset == pos and nbytes >= 1 << 20  # contiguous, from the data's start, chunk-sized
        assert file_size >= offset + nbytes  # flushed to the kernel before the hint
        pos += nbytes
    assert size - pos < 1 << 20  # the tail the final fsync writes is under one chunk


def test_bytes_are_the_same_with_and_without_writeback(tmp_path, monkeypatch):
    state = _big_state()
    monkeypatch.setattr(writer, "IO_CHUNK_BYTES", 1 << 20)
    a, b = tmp_path / "a", tmp_path / "b"
    fmt.write_file(state, a)  # the real hint, where the system has one
    monkeypatch.setattr(writer, "can_start_writeback", lambda: False)
    fmt.write_file(state, b)
    assert a.read_bytes() == b.read_bytes()


def test_no_writeback_for_a_file_that_is_not_fsynced(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "IO_CHUNK_BYTES", 1 << 20)
    calls = _spy(monkeypatch)
    fmt.write_file(_big_state(), tmp_path / "x", fsync=False, entropy=None)
    assert calls == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_linux_has_the_call_and_it_accepts_a_real_file(tmp_path):
    assert writeback.can_start_writeback()
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10000)
    with open(path, "rb+") as f:
        writeback.start_writeback(f.fileno(), 0, 10000)  # returns without raising
        writeback.start_writeback(f.fileno(), 0, 0)  # nothing to do
    assert path.read_bytes() == b"x" * 10000
