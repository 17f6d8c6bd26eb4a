"""The files' CRC-32 (``tw_triton.format.checksum.crc32``): zlib's values, from ISA-L."""

from __future__ import annotations

import importlib.util
import mmap
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tw_triton.format import checksum


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), cut=st.integers(0, 5000), start=st.integers(0, 2**32 - 1))
def test_the_checksum_is_zlibs_in_one_call_or_two(data: bytes, cut: int, start: int) -> None:
    cut = min(cut, len(data))
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data, start) == zlib.crc32(data, start)
    assert checksum.crc32(data[cut:], checksum.crc32(data[:cut])) == zlib.crc32(data)


def test_the_checksum_takes_the_buffers_a_read_hands_it(tmp_path) -> None:
    """Bytes, a bytearray, a memoryview slice, a numpy array and a view of a file's map (what
    the reads pass), over more than one chunk of ISA-L's folding loop."""
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 77, dtype=np.uint8).tobytes()
    path = tmp_path / "blob"
    path.write_bytes(data)
    want = zlib.crc32(data[13:])
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)[13:]
        try:
            assert checksum.crc32(view) == want
        finally:
            view.release()
    assert checksum.crc32(memoryview(bytearray(data))[13:]) == want
    assert checksum.crc32(np.frombuffer(data, dtype=np.uint8)[13:]) == want
    assert checksum.crc32(b"") == 0 and checksum.crc32(b"", 12345) == 12345


@pytest.mark.skipif(importlib.util.find_spec("isal") is None, reason="isal has no wheel for this machine")
def test_isal_computes_them_where_it_is_installed() -> None:
    from isal import isal_zlib

    assert checksum.crc32 is isal_zlib.crc32 and checksum.CRC32_LIBRARY == "isal"
