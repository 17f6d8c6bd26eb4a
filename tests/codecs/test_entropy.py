"""The lossless entropy stage: stages round-trip bytes exactly, the policy, the frame checks
that run before any allocation, and the write path (write_file, save, AsyncWriter)."""

from __future__ import annotations

import os
import struct
import threading
import zlib
from unittest import mock

import numpy as np
import pytest
import torch
import zstandard
from _format_samples import STAGE_EVERYTHING, assert_same_state, sample_state
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tw_triton
from tw_triton import format as fmt
from tw_triton.codecs import entropy
from tw_triton.codecs.entropy import (
    EntropyPolicy,
    ZstdSettings,
    candidate_stages,
    check_zstd_frame,
    get_stage,
)
from tw_triton.errors import CheckpointError
from tw_triton.format import plan as format_plan
from tw_triton.ops.backends import native
from tw_triton.writer import AsyncWriter

STAGES = ["zstd", "zstd-bytegroup", "zstd-planes"]


def one_frame_params(name: str, stored: bytes) -> dict:
    """The params under which ``stored``, one zstd frame of 1-byte elements, is what the
    stage ``name`` stored (zstd-planes: that frame as its one plane)."""
    if name == "zstd":
        return {"level": 3}
    if name == "zstd-bytegroup":
        return {"level": 3, "width": 1}
    return {"level": 3, "width": 1, "frames": [len(stored)]}


DTYPES = [
    torch.uint8,
    torch.int8,
    torch.bool,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
]


def as_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")


def round_trip(name: str, t: torch.Tensor, level: int = 3, threads: int = 0) -> tuple[bytes, bytes]:
    stage = get_stage(name)
    raw = as_bytes(t)
    stored, params = stage.encode(raw, t.element_size(), ZstdSettings(level=level, threads=threads))
    stage.check_params(params, t.element_size(), "w")
    stage.check(memoryview(stored), params, len(raw), "w")
    out = bytearray(len(raw))
    stage.decode(memoryview(stored), params, memoryview(out), "w")
    stage.verify(memoryview(stored), params, len(raw), "w")
    return bytes(raw), bytes(out)


def _tensor(kind: str, dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "bytes":  # any bit pattern, NaN payloads included
        return torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g).view(dtype)
    if kind == "zeros":
        return torch.zeros(n, dtype=dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.3
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 1e-3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -9), min(info.max, 9), (n,), generator=g).to(dtype)


# --------------------------------------------------------------------------------------
# Stages: bytes back identical
# --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(STAGES),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 3000) | st.sampled_from([1, 2, 7, 4096, 70001]),
    kind=st.sampled_from(["bytes", "zeros", "values"]),
    seed=st.integers(0, 2**16),
    level=st.sampled_from([1, 3, 9]),
)
def test_every_stage_gives_the_bytes_back(name, dtype, n, kind, seed, level):
    raw, back = round_trip(name, _tensor(kind, dtype, n, seed), level)
    assert back == raw


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(STAGES),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 3000) | st.sampled_from([4096, 70001]),
    kind=st.sampled_from(["bytes", "values"]),
    seed=st.integers(0, 2**16),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=6),
    one_shot=st.booleans(),
)
@example(name="zstd-planes", dtype=torch.float32, n=1000, kind="values", seed=0, cuts=[5, 9], one_shot=True)
@example(name="zstd-planes", dtype=torch.bfloat16, n=4096, kind="bytes", seed=1, cuts=[1, 3], one_shot=False)
def test_every_stage_streams_the_bytes_back_in_any_pieces(name, dtype, n, kind, seed, cuts, one_shot):
    """What a load to a device does: the decoded bytes a piece at a time into slots, pieces
    that may end inside an element; one byte more than the buffer is an error."""
    t = _tensor(kind, dtype, n, seed)
    stage = get_stage(name)
    raw = as_bytes(t)
    stored, params = stage.encode(raw, t.element_size(), ZstdSettings(level=3))
    stage.check(memoryview(stored), params, len(raw), "w")
    bounds = sorted({0, len(raw), *(c % (len(raw) + 1) for c in cuts)})
    with mock.patch.object(entropy.zstd, "ONE_SHOT_MAX_BYTES", 1 << 20 if one_shot else 0):
        stream = stage.stream(memoryview(stored), params, len(raw), "w")
        out = bytearray(len(raw))
        for start, stop in zip(bounds, bounds[1:]):
            stream.fill(memoryview(out)[start:stop])
        stream.finish()
        assert bytes(out) == bytes(raw)
        stream = stage.stream(memoryview(stored), params, len(raw), "w")
        with pytest.raises(CheckpointError, match="w"):
            stream.fill(memoryview(bytearray(len(raw) + 1)))


@pytest.mark.parametrize("name", STAGES)
def test_chunked_and_multithreaded_paths_give_the_bytes_back(name, monkeypatch):
    """Small chunks and 2 zstd threads, so that a 1 MiB buffer takes the paths that only
    buffers of many MiB take by default."""
    monkeypatch.setattr(entropy.zstd, "CHUNK_BYTES", 4099)
    monkeypatch.setattr(entropy.zstd, "ONE_SHOT_MAX_BYTES", 0)  # decoding streams too
    t = (torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)) * 1e-2).to(torch.float32)
    raw, back = round_trip(name, t, threads=2)
    assert back == raw


def test_default_threads(monkeypatch):
    big = entropy.MT_MIN_BYTES
    for cores, expected in ((None, 0), (1, 0), (2, 0), (3, 0), (4, 2), (16, 8), (256, entropy.MAX_THREADS)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert entropy.default_threads(big) == expected, cores
        assert entropy.default_threads(big - 1) == 0
    seen = []
    real = ZstdSettings.compressor
    monkeypatch.setattr(
        ZstdSettings, "compressor", lambda self, size: seen.append(self.threads) or real(self, size)
    )
    t = torch.zeros(5000)
    entropy.encode_buffer(t, as_bytes(t), EntropyPolicy(threads=2))
    entropy.encode_buffer(t, as_bytes(t), entropy.AUTO)
    assert seen == [2, 0]


def test_bytegroup_puts_byte_k_of_every_element_together():
    t = torch.tensor([0x04030201, 0x08070605, 0x0C0B0A09], dtype=torch.int32)
    stored, params = get_stage("zstd-bytegroup").encode(as_bytes(t), 4, ZstdSettings(level=3))
    assert params == {"level": 3, "width": 4}
    assert zstandard.ZstdDecompressor().decompress(stored) == bytes([1, 5, 9, 2, 6, 10, 3, 7, 11, 4, 8, 12])


def test_bytegroup_beats_plain_zstd_on_floats():
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1)) * 1e-3
    sizes = {n: len(get_stage(n).encode(as_bytes(t), 4, ZstdSettings(level=3))[0]) for n in STAGES}
    assert sizes["zstd-bytegroup"] < 0.97 * sizes["zstd"]


def test_decode_writes_into_the_destination_and_nowhere_else():
    t = (torch.arange(5000) % 7).to(torch.int16)
    for name in STAGES:
        stage = get_stage(name)
        stored, params = stage.encode(as_bytes(t), 2, ZstdSettings(level=3))
        big = bytearray(b"\xee" * (16 + 10000 + 16))
        out = memoryview(big)[16 : 16 + 10000]
        stage.decode(memoryview(stored), params, out, "w")
        assert bytes(out) == bytes(as_bytes(t))
        assert big[:16] == b"\xee" * 16 and big[-16:] == b"\xee" * 16


# --------------------------------------------------------------------------------------
# Byte grouping: the stored bytes are the format, whatever the stage does to be fast
# --------------------------------------------------------------------------------------


def reference_bytegroup(raw: bytes, width: int, level: int, threads: int = 0, **match: int) -> bytes:
    """A zstd-bytegroup frame written the plain way: byte k of every element (numpy's
    column ``[:, k]``), the planes concatenated, one zstd frame with content size and
    checksum (``match``: zstd's min_match / hash_log). Streamed with the size pledged, like
    the stage: for inputs of tens of MiB a one-shot ``ZstdCompressor.compress`` finds other
    (valid) matches, so other bytes."""
    elements = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
    planes = b"".join(elements[:, k].tobytes() for k in range(width))
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(raw), threads=threads, write_checksum=True, write_content_size=True, **match
    )
    cctx = zstandard.ZstdCompressor(compression_params=params)
    obj = cctx.compressobj(size=len(raw))
    return obj.compress(planes) + obj.flush()


def _elements(kind: str, width: int, n: int, seed: int) -> bytes:
    """``n`` elements of ``width`` bytes: random bytes, zeros, or float values where the
    width is a float's (their planes differ: sign and exponent bytes repeat)."""
    g = torch.Generator().manual_seed(seed)
    floats = {2: torch.float16, 4: torch.float32, 8: torch.float64, 16: torch.complex128}
    if kind == "values" and width in floats:
        return bytes(as_bytes((torch.randn(n, generator=g) * 1e-3).to(floats[width])))
    if kind == "zeros":
        return bytes(n * width)
    return bytes(torch.randint(0, 256, (n * width,), dtype=torch.uint8, generator=g).numpy())


# What the byte-plane stages' property tests share: element widths (2, 4, 8, complex's 16
# and odd ones), chunk sizes, kinds of content and seeds (``data`` draws the length).
PLANE_CASES = dict(
    data=st.data(),
    width=st.sampled_from([2, 4, 8, 16, 1, 3, 6, 12]),
    chunk=st.sampled_from([1, 5, 64, 4096]),
    kind=st.sampled_from(["bytes", "zeros", "values"]),
    seed=st.integers(0, 2**16),
)


def _unaligned(raw: bytes, offset: int, fill: int = 0) -> memoryview:
    """``raw`` in a buffer that starts ``offset`` bytes into its allocation, with 3 more
    ``fill`` bytes after it."""
    return memoryview(bytearray([fill]) * offset + bytearray(raw) + bytearray([fill]) * 3)[
        offset : offset + len(raw)
    ]


@settings(max_examples=80, deadline=None)
@given(
    **PLANE_CASES,
    level=st.sampled_from([1, 3]),
    match=st.sampled_from([{}, {"min_match": 7, "hash_log": 6}, {"min_match": 5}]),
    little=st.booleans(),
    offset=st.sampled_from([0, 1, 3]),
    one_shot=st.booleans(),
    compiled=st.booleans(),
)
def test_bytegroup_writes_the_reference_bytes_and_reads_them(
    data, width, chunk, kind, seed, level, match, little, offset, one_shot, compiled
):
    """Every width (2, 4, 8, complex's 16 and odd ones), counts on and off the chunk size,
    empty and tiny buffers, the big-endian path (single bytes) on this machine too, buffers
    not aligned to their words, a destination full of garbage, and both decodes: the
    one-shot one of small buffers and the streaming one in chunks; with the compiled plane
    split and merge and without them."""
    on_chunks = st.builds(lambda m, e: max(m * chunk + e, 0), st.integers(0, 3), st.integers(-1, 1))
    n = data.draw(st.integers(0, 700) | on_chunks)
    raw = _elements(kind, width, n, seed)
    stage = get_stage("zstd-bytegroup")
    with (
        mock.patch.object(entropy.zstd, "CHUNK_BYTES", chunk),
        mock.patch.object(entropy.planes, "LITTLE_ENDIAN", little),
        mock.patch.object(entropy.zstd, "ONE_SHOT_MAX_BYTES", 1 << 20 if one_shot else 0),
        mock.patch.dict(os.environ, {native.ENV_NATIVE: "1" if compiled else "0"}),
    ):
        zstd = ZstdSettings(
            level=level, min_match=match.get("min_match", 0), hash_log=match.get("hash_log", 0)
        )
        stored, params = stage.encode(_unaligned(raw, offset), width, zstd)
        assert params == {"level": level, "width": width}
        assert stored == reference_bytegroup(raw, width, level, **match)
        stage.check(memoryview(stored), params, len(raw), "w")
        out = _unaligned(b"\xa5" * len(raw), offset, fill=0xEE)
        stage.decode(memoryview(stored), params, out, "w")
    assert bytes(out) == raw
    assert bytes(out.obj[:offset]) == b"\xee" * offset and bytes(out.obj[offset + len(raw) :]) == b"\xee" * 3


@pytest.mark.parametrize("threads", [0, 2])
def test_bytegroup_bytes_at_the_real_chunk_size(threads):
    """A float32 buffer of two encode chunks per plane (and five decode chunks), plus 3
    elements, with and without zstd's worker threads."""
    n = entropy.CHUNK_BYTES + 3
    raw = _elements("values", 4, n, 0)
    stage = get_stage("zstd-bytegroup")
    min_match, hash_log = get_stage("zstd-bytegroup").match_for(len(raw))
    assert (min_match, hash_log) == entropy.PLANE_MATCH
    stored, params = stage.encode(
        memoryview(raw), 4, ZstdSettings(min_match=min_match, hash_log=hash_log, threads=threads)
    )
    match = {"min_match": min_match, "hash_log": hash_log}
    assert stored == reference_bytegroup(raw, 4, entropy.DEFAULT_LEVEL, threads, **match)
    out = bytearray(b"\xff" * len(raw))
    stage.decode(memoryview(stored), params, memoryview(out), "w")
    assert out == raw


# --------------------------------------------------------------------------------------
# zstd-planes: a frame per plane, or the plane raw
# --------------------------------------------------------------------------------------


def reference_plane_choice(elements: np.ndarray) -> list[bool]:
    """The stage's rule written the plain way: the order-0 entropy of every plane over
    ``PLANE_SAMPLE`` elements at an even stride; zstd where it is at most
    ``8 * (1 - PLANE_MIN_SAVING)`` bits per byte."""
    n = elements.shape[0]
    sample = elements[:: max(n // entropy.planes.PLANE_SAMPLE, 1)][: entropy.planes.PLANE_SAMPLE]
    chosen = []
    for k in range(elements.shape[1]):
        _, counts = np.unique(sample[:, k], return_counts=True)
        freq = counts / max(sample.shape[0], 1)
        bits = float(-(freq * np.log2(freq)).sum()) if len(freq) else 0.0
        chosen.append(bits <= 8 * (1 - entropy.PLANE_MIN_SAVING))
    return chosen


def reference_planes(
    raw: bytes, width: int, level: int, threads: int = 0, **match: int
) -> tuple[bytes, list[int]]:
    """zstd-planes written the plain way: each plane numpy's column ``[:, k]``, through its
    own streamed zstd frame (content size and checksum) where the rule picks it, else as it
    is; returns the stored bytes and the ``frames`` param."""
    elements = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width)
    out, frames = b"", []
    for k, coded in enumerate(reference_plane_choice(elements)):
        plane = elements[:, k].tobytes()
        if coded:
            params = zstandard.ZstdCompressionParameters.from_level(
                level,
                source_size=len(plane),
                threads=threads,
                write_checksum=True,
                write_content_size=True,
                **match,
            )
            obj = zstandard.ZstdCompressor(compression_params=params).compressobj(size=len(plane))
            plane = obj.compress(plane) + obj.flush()
        frames.append(len(plane) if coded else 0)
        out += plane
    return out, frames


@settings(max_examples=80, deadline=None)
@given(
    **PLANE_CASES,
    match=st.sampled_from([{}, {"min_match": 7, "hash_log": 6}]),
    little=st.booleans(),
    offset=st.sampled_from([0, 1, 3]),
    one_shot=st.booleans(),
    sample=st.sampled_from([4096, 7]),
    compiled=st.booleans(),
)
def test_planes_writes_the_reference_bytes_and_reads_them(
    data, width, chunk, kind, seed, match, little, offset, one_shot, sample, compiled
):
    """As for zstd-bytegroup, and a sample smaller than the buffer (an uneven stride)."""
    on_chunks = st.builds(lambda m, e: max(m * chunk + e, 0), st.integers(0, 3), st.integers(-1, 1))
    n = data.draw(st.integers(0, 700) | on_chunks)
    raw = _elements(kind, width, n, seed)
    stage = get_stage("zstd-planes")
    with (
        mock.patch.object(entropy.zstd, "CHUNK_BYTES", chunk),
        mock.patch.object(entropy.planes, "LITTLE_ENDIAN", little),
        mock.patch.object(entropy.zstd, "ONE_SHOT_MAX_BYTES", 1 << 20 if one_shot else 0),
        mock.patch.object(entropy.planes, "PLANE_SAMPLE", sample),
        mock.patch.dict(os.environ, {native.ENV_NATIVE: "1" if compiled else "0"}),
    ):
        zstd = ZstdSettings(level=1, min_match=match.get("min_match", 0), hash_log=match.get("hash_log", 0))
        stored, params = stage.encode(_unaligned(raw, offset), width, zstd)
        expected, frames = reference_planes(raw, width, 1, **match)
        assert params == {"level": 1, "width": width, "frames": frames}
        assert stored == expected
        stage.check_params(params, width, "w")
        stage.check(memoryview(stored), params, len(raw), "w")
        out = _unaligned(b"\xa5" * len(raw), offset, fill=0xEE)
        stage.decode(memoryview(stored), params, out, "w")
    assert bytes(out) == raw
    assert bytes(out.obj[:offset]) == b"\xee" * offset and bytes(out.obj[offset + len(raw) :]) == b"\xee" * 3


def test_planes_codes_only_the_planes_that_compress():
    """Float weights: the three mantissa planes raw, sign and exponent through zstd;
    zeros: every plane; a float buffer whose low bytes are all zero (values from bf16):
    those planes too; random bytes: none (and the policy then keeps the buffer raw)."""
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(1 << 17, generator=g) * 0.02
    from_bf16 = weights.to(torch.bfloat16).to(torch.float32)
    noise = torch.randint(0, 256, (1 << 19,), dtype=torch.uint8, generator=g).view(torch.float32)
    stage = get_stage("zstd-planes")
    for t, coded in (
        (weights, [False, False, False, True]),
        (torch.zeros(1 << 17), [True] * 4),
        (from_bf16, [True, True, False, True]),
        (noise, [False] * 4),
    ):
        stored, params = stage.encode(as_bytes(t), 4, ZstdSettings())
        assert [bool(n) for n in params["frames"]] == coded
        assert len(stored) == sum(n or t.numel() for n in params["frames"])
    assert entropy.encode_buffer(noise, as_bytes(noise), entropy.AUTO) is None
    staged = entropy.encode_buffer(weights, as_bytes(weights), entropy.AUTO)
    assert staged.record["name"] == "zstd-planes"
    # The sign-and-exponent plane alone saves more than MIN_SAVING of the buffer.
    assert len(staged.data) < (1 - entropy.MIN_SAVING) * weights.numel() * 4


@pytest.mark.parametrize(
    "frames, match",
    [
        ([0, 0, 0], "the planes take 300 bytes"),
        ([0, 0, 0, 0, 5], "the planes take 405 bytes"),
        ([0, 0, 0, 9], "the planes take 309 bytes"),
        ([0, 0, 0, 1000], "the planes take 1300 bytes"),
    ],
)
def test_planes_check_refuses_planes_that_do_not_fill_the_stored_bytes(frames, match):
    """100 float32 elements stored as three raw planes and one 10-byte zstd frame."""
    body = frame(b"\0" * 100)
    stored = memoryview(b"\1" * 300 + body)
    params = {"level": 3, "width": 4, "frames": [0, 0, 0, len(body)]}
    get_stage("zstd-planes").check(stored, params, 400, "w")
    bad = {**params, "width": len(frames), "frames": frames}
    raw = 100 * len(frames) if len(frames) != 4 else 400
    with pytest.raises(CheckpointError, match=match) as info:
        get_stage("zstd-planes").check(stored, bad, raw, "checkpoint f: entry 'e' buffer 'b'")
    assert "entry 'e' buffer 'b'" in str(info.value)


def test_planes_check_names_the_plane_of_a_bad_frame():
    body = frame(b"\0" * 100)
    stored = memoryview(b"\1" * 100 + body[:-1] + b"\1" * 100)
    params = {"level": 3, "width": 3, "frames": [0, len(body) - 1, 0]}
    with pytest.raises(
        CheckpointError, match=r"w plane 1: the zstd frame is \d+ bytes but \d+ are stored \(truncated\)"
    ):
        get_stage("zstd-planes").check(stored, params, 300, "w")
    # A frame that states another size than a plane holds.
    other = frame(b"\0" * 99)
    stored = memoryview(other + b"\1" * 100)
    with pytest.raises(CheckpointError, match="w plane 0: the zstd frame holds 99 bytes"):
        get_stage("zstd-planes").check(stored, {"level": 3, "width": 2, "frames": [len(other), 0]}, 200, "w")


# --------------------------------------------------------------------------------------
# The frame check: what it refuses before anything is allocated
# --------------------------------------------------------------------------------------


def frame(content: bytes, **kw) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_checksum=True, **kw).compress(content)


def hand_frame(
    content_size: int, blocks: list[tuple[int, int, bytes]], checksum: bool = False, window: bool = False
) -> bytes:
    """A zstd frame built by hand (RFC 8878): 8-byte content size, single segment (or a
    1 KiB window when ``window``), the given blocks as (type, size field, body), the last
    one marked last."""
    fhd = (3 << 6) | (int(not window) << 5) | (int(checksum) << 2)
    out = b"\x28\xb5\x2f\xfd" + bytes([fhd]) + (b"\0" if window else b"") + struct.pack("<Q", content_size)
    for i, (kind, size, body) in enumerate(blocks):
        word = int(i == len(blocks) - 1) | (kind << 1) | (size << 3)
        out += word.to_bytes(3, "little") + body
    return out + (b"\0\0\0\0" if checksum else b"")


def test_frame_check_accepts_what_zstd_writes():
    for content in (b"", b"a", bytes(range(256)) * 999, b"\0" * 300000):
        check_zstd_frame(memoryview(frame(content)), len(content), "w")
    # A hand-made frame: one raw block, one RLE block.
    f = hand_frame(5, [(0, 2, b"ab"), (1, 3, b"c")])
    check_zstd_frame(memoryview(f), 5, "w")
    assert zstandard.ZstdDecompressor().decompress(f) == b"abccc"


@pytest.mark.parametrize(
    "stored, raw, match",
    [
        (b"", 0, "magic"),
        (b"\x28\xb5\x2f", 0, "magic"),
        (b"PK\x03\x04" + b"\0" * 20, 4, "magic"),
        (b"\x50\x2a\x4d\x18" + b"\4\0\0\0abcd", 0, "magic"),  # a skippable frame
        (frame(b"x" * 100), 101, "holds 100 bytes, the manifest says raw_nbytes 101"),
        (frame(b"x" * 100), 99, "holds 100 bytes"),
        (frame(b"x" * 100, write_content_size=False), 100, "does not state its content size"),
        (frame(b"x" * 100) + b"\0", 100, "trailing bytes"),
        (frame(b"x" * 100) + frame(b""), 100, "trailing bytes"),
        (frame(bytes(range(256)) * 40)[:-9], 10240, "truncated"),
        (frame(b"x" * 100)[:-1], 100, "truncated"),
        # The bomb: a few bytes that claim 2**40 bytes of content; the blocks hold 1.
        (hand_frame(2**40, [(0, 1, b"z")]), 2**40, "hold at most 1 bytes, fewer than the 1099511627776"),
        (hand_frame(300000, [(1, 128 << 10, b"z")] * 2), 300000, "hold at most 262144"),
        (hand_frame(10, [(3, 0, b"")]), 10, "bad zstd block header"),
        # Single segment: the window is the content size, and no block may be larger.
        (hand_frame(1, [(0, 2, b"ab")]), 1, "bad zstd block header"),
        (hand_frame(2**20, [(1, (128 << 10) + 1, b"z")]), 2**20, "bad zstd block header"),
    ],
)
def test_frame_check_refuses(stored, raw, match):
    with pytest.raises(CheckpointError, match=match) as info:
        check_zstd_frame(memoryview(stored), raw, "checkpoint f: entry 'e' buffer 'b'")
    assert "entry 'e' buffer 'b'" in str(info.value)


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "streaming"])
def test_a_frame_that_decodes_to_more_than_it_states_is_an_error(one_shot, monkeypatch):
    """Header and blocks agree with 1 byte of content, the blocks make 2: zstd stops it,
    and the decoder never writes past the 1-byte destination."""
    monkeypatch.setattr(entropy.zstd, "ONE_SHOT_MAX_BYTES", 1 << 20 if one_shot else 0)
    stored = memoryview(hand_frame(1, [(0, 2, b"ab")], window=True))
    check_zstd_frame(stored, 1, "w")
    for name in STAGES:
        big = bytearray(b"\xee" * 3)
        params = one_frame_params(name, stored)
        with pytest.raises(CheckpointError, match="w( plane 0)?: zstd"):
            get_stage(name).decode(stored, params, memoryview(big)[:1], "w")
        assert big[1:] == b"\xee\xee"


@pytest.mark.parametrize("one_shot", [True, False], ids=["one-shot", "streaming"])
def test_corrupted_content_is_caught_by_the_zstd_checksum(one_shot, monkeypatch):
    monkeypatch.setattr(entropy.zstd, "ONE_SHOT_MAX_BYTES", 1 << 20 if one_shot else 0)
    content = bytes(range(256)) * 64
    stored = bytearray(frame(content))
    stored[-1] ^= 0x40  # the frame's content checksum
    for name in STAGES:
        params = one_frame_params(name, stored)
        with pytest.raises(CheckpointError, match="checksum mismatch .zstd.s content checksum"):
            get_stage(name).decode(memoryview(stored), params, memoryview(bytearray(len(content))), "w")
        with pytest.raises(CheckpointError, match="checksum mismatch .zstd.s content checksum"):
            get_stage(name).verify(memoryview(stored), params, len(content), "w")


@pytest.mark.parametrize(
    "name, params, itemsize, match",
    [
        ("zstd", {}, 1, "keys"),
        ("zstd", {"level": 3, "x": 1}, 1, "keys"),
        ("zstd", {"level": "3"}, 1, "'level' must be an int"),
        ("zstd", [3], 1, "keys"),
        ("zstd-bytegroup", {"level": 3}, 4, "keys"),
        ("zstd-bytegroup", {"level": 3, "width": 2}, 4, "'width' must be the element size 4"),
        ("zstd-bytegroup", {"level": 3, "width": 0}, 4, "'width'"),
        ("zstd-bytegroup", {"level": True, "width": 4}, 4, "'level'"),
        ("zstd-planes", {"level": 3, "width": 4}, 4, "keys"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": [0, 0]}, 4, "'width' must be the element size 4"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": [0]}, 2, "'frames' must be 2 sizes"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": [0, -1]}, 2, "'frames'"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": [0, True]}, 2, "'frames'"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": "00"}, 2, "'frames'"),
        ("zstd-planes", {"level": 3, "width": 2, "frames": [0, 1.5]}, 2, "'frames'"),
    ],
)
def test_stage_params_are_checked(name, params, itemsize, match):
    with pytest.raises(CheckpointError, match=match):
        get_stage(name).check_params(params, itemsize, "w")


def test_match_settings_reach_zstd():
    """Byte planes get PLANE_MATCH by default from PLANE_MATCH_MIN_BYTES up (zstd-planes),
    smaller ones (zstd-bytegroup)
    and 1-byte codes the level's own, and a policy's settings override both: each choice
    makes the bytes a plain zstd compressor with those settings makes. Files record the
    level alone (readers of format version 2 accept exactly that)."""
    g = torch.Generator().manual_seed(3)
    floats = torch.randn(entropy.PLANE_MATCH_MIN_BYTES // 4, generator=g) * 1e-3
    small = floats[: entropy.PLANE_MATCH_MIN_BYTES // 4 - 1]
    # Codes of a small alphabet: many short repeats, where the match finder matters.
    codes = (128 + torch.randint(-1, 2, (1 << 16,), generator=g)).to(torch.uint8)

    def plain(raw: memoryview, **match: int) -> bytes:
        params = zstandard.ZstdCompressionParameters.from_level(
            1, source_size=len(raw), write_checksum=True, write_content_size=True, **match
        )
        return zstandard.ZstdCompressor(compression_params=params).compress(raw)

    cases = [
        (floats, entropy.AUTO, dict(zip(("min_match", "hash_log"), entropy.PLANE_MATCH))),
        (floats, EntropyPolicy(min_match=0, hash_log=0), {}),
        (small, entropy.AUTO, {}),
        (codes, entropy.AUTO, {}),
        (codes, EntropyPolicy(min_match=5, hash_log=8), {"min_match": 5, "hash_log": 8}),
    ]
    stored = []
    for t, policy, match in cases:
        staged = entropy.encode_buffer(t, as_bytes(t), policy)
        if t.dtype == torch.uint8:
            assert staged.record["params"] == {"level": 1}
            assert staged.data == plain(as_bytes(t), **match)
        elif t is small:
            assert staged.record["params"] == {"level": 1, "width": 4}
            assert staged.data == reference_bytegroup(bytes(as_bytes(t)), 4, 1, **match)
        else:
            expected, frames = reference_planes(bytes(as_bytes(t)), 4, 1, **match)
            assert staged.record["params"] == {"level": 1, "width": 4, "frames": frames}
            assert staged.data == expected
        stored.append(staged.data)
    assert stored[0] != stored[1] and stored[3] != stored[4]  # the settings change the bytes


# --------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------


def test_policy_picks_the_stage_by_dtype_and_size():
    auto = entropy.AUTO
    big = entropy.MIN_STAGE_BYTES
    assert candidate_stages(torch.uint8, big, auto) == ("zstd",)
    assert candidate_stages(torch.bool, big, auto) == ("zstd",)
    planes = entropy.PLANES_MIN_BYTES
    assert candidate_stages(torch.int64, big, auto) == ("zstd-bytegroup", "zstd")
    assert candidate_stages(torch.int32, planes, auto) == ("zstd-planes", "zstd")
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert candidate_stages(dt, big, auto) == ("zstd-bytegroup",)
        assert candidate_stages(dt, planes - 1, auto) == ("zstd-bytegroup",)
        assert candidate_stages(dt, planes, auto) == ("zstd-planes",)
    assert candidate_stages(torch.float32, big - 1, auto) == ()
    assert candidate_stages(torch.uint8, 0, EntropyPolicy(min_bytes=0)) == ()
    assert candidate_stages(torch.float32, big, EntropyPolicy(stage="zstd")) == ("zstd",)


def test_integers_get_the_smaller_of_both_stages():
    g = torch.Generator().manual_seed(0)
    counters = torch.randint(-9, 9, (4096,), generator=g)  # int64: zstd wins
    # Grouping wins (at 4096 elements zstd codes neither one's literals: a tie).
    float_bits = (torch.randn(1 << 16, generator=g) * 1e-3).view(torch.int32)
    for t, winner in ((counters, "zstd"), (float_bits, "zstd-bytegroup")):
        nbytes = t.numel() * t.element_size()
        sizes = {
            n: len(
                get_stage(n).encode(
                    as_bytes(t), t.element_size(), ZstdSettings(1, *get_stage(n).match_for(nbytes))
                )[0]
            )
            for n in candidate_stages(t.dtype, nbytes, entropy.AUTO)
        }
        assert min(sizes, key=sizes.get) == winner
        staged = entropy.encode_buffer(t, as_bytes(t), entropy.AUTO)
        assert staged.record["name"] == winner and len(staged.data) == sizes[winner]


def test_policy_keeps_a_stage_only_when_it_saves_enough():
    g = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    assert entropy.encode_buffer(noise, as_bytes(noise), entropy.AUTO) is None
    forced = entropy.encode_buffer(noise, as_bytes(noise), EntropyPolicy(min_saving=None))
    assert forced is not None and len(forced.data) > len(as_bytes(noise))  # incompressible
    codes = (128 + torch.randn(1 << 16, generator=g).mul(6).round().clamp(-127, 127)).to(torch.uint8)
    staged = entropy.encode_buffer(codes, as_bytes(codes), entropy.AUTO)
    assert staged is not None
    assert staged.record == {
        "name": "zstd",
        "params": {"level": entropy.DEFAULT_LEVEL},
        "raw_nbytes": 1 << 16,
    }
    assert len(staged.data) <= (1 - entropy.MIN_SAVING) * (1 << 16)
    tiny = codes[: entropy.MIN_STAGE_BYTES - 1]
    assert entropy.encode_buffer(tiny, as_bytes(tiny), entropy.AUTO) is None


@pytest.mark.parametrize("bad", ["zstd", "AUTO", 3, True, EntropyPolicy(stage="lz4")])
def test_bad_entropy_arguments_are_refused(tmp_path, bad):
    path = tmp_path / "x.tw"
    with pytest.raises(CheckpointError, match="entropy|unknown stage") as info:
        fmt.write_file(sample_state(0), path, entropy=bad)
    assert str(path) in str(info.value) and not path.exists()
    with pytest.raises(CheckpointError):
        AsyncWriter(entropy=bad)


# --------------------------------------------------------------------------------------
# The write path
# --------------------------------------------------------------------------------------


def _stages(path) -> dict[str, str]:
    m = fmt.read_manifest(path)
    return {
        b["key"]: b["stage"]["name"]
        for e in m["entries"].values()
        for b in e["buffers"].values()
        if "stage" in b
    }


@pytest.mark.parametrize("entropy_arg", ["auto", None, "none", STAGE_EVERYTHING, EntropyPolicy(level=1)])
def test_write_file_entropy_modes_round_trip(tmp_path, entropy_arg):
    state = sample_state(3, scale=8)
    path = tmp_path / "a.tw"
    fmt.write_file(state, path, fsync=False, entropy=entropy_arg)
    assert_same_state(state, fmt.read_file(path))
    fmt.verify_file(path)
    assert fmt.read_manifest(path)["version"] == fmt.FORMAT_VERSION
    staged = _stages(path)
    nonempty = [
        fmt.tensor_key(p, n) for p, e in state.entries.items() for n, b in e.buffers.items() if b.numel()
    ]
    if entropy_arg in (None, "none"):
        assert staged == {}
    elif entropy_arg is STAGE_EVERYTHING:
        assert sorted(staged) == sorted(nonempty)
    else:
        # The large codes and the exact float moments are staged, the small buffers are not.
        assert staged["model/encoder.0.weight:codes"] == "zstd"
        assert staged["optimizer/state/0/exp_avg:data"] == "zstd-bytegroup"
        assert "model/encoder.0.bias:data" not in staged


def test_read_with_pinned_memory_and_without_verify(tmp_path):
    state = sample_state(4, scale=4)
    fmt.write_file(state, tmp_path / "a.tw", fsync=False, entropy=STAGE_EVERYTHING)
    assert_same_state(state, fmt.read_file(tmp_path / "a.tw", verify=False, pin_memory=True))


def test_save_and_load_pass_entropy_through(tmp_path):
    g = torch.Generator().manual_seed(0)
    model = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
    opt = {"state": {0: {"exp_avg": torch.randn(256, 64, generator=g) * 1e-3}}}
    q = tw_triton.quantize_state_dict({"model": model, "optimizer": opt})
    a = tw_triton.save(q, tmp_path / "a.tw")
    b = tw_triton.save(q, tmp_path / "b.tw", entropy=None)
    assert a < b and _stages(tmp_path / "a.tw") and not _stages(tmp_path / "b.tw")
    for p in ("a.tw", "b.tw"):
        back = tw_triton.load(tmp_path / p)
        assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])


def test_async_writer_runs_the_stage_on_its_thread(tmp_path, monkeypatch):
    threads: list[str] = []
    real = format_plan.encode_buffer

    def recording(*args, **kw):
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(format_plan, "encode_buffer", recording)
    state = sample_state(5, scale=8)
    with AsyncWriter(fsync=False) as w:
        w.submit(state, tmp_path / "auto.tw").result()
    with AsyncWriter(fsync=False, entropy=None) as w:
        w.submit(state, tmp_path / "raw.tw").result()
    # The writer thread stages buffers itself or on its worker threads, never the caller.
    assert threads and threading.current_thread().name not in threads
    assert all(n == "tw_triton-writer" or n.startswith("tw_triton-cpu") for n in threads)
    assert _stages(tmp_path / "auto.tw") and not _stages(tmp_path / "raw.tw")
    assert_same_state(state, fmt.read_file(tmp_path / "auto.tw"))


def test_stage_failure_names_the_buffer_and_leaves_no_file(tmp_path, monkeypatch):
    def broken(*args, **kw):
        raise zstandard.ZstdError("out of memory")

    monkeypatch.setattr(entropy.ZstdStage, "encode", broken)
    path = tmp_path / "a.tw"
    with pytest.raises(
        CheckpointError, match="entry 'model/encoder.0.weight' buffer 'codes': entropy stage failed"
    ):
        fmt.write_file(sample_state(6, scale=8), path)
    assert list(tmp_path.iterdir()) == []


def test_staged_buffer_crc_covers_the_stored_bytes(tmp_path):
    path = tmp_path / "a.tw"
    fmt.write_file(sample_state(7, scale=8), path, fsync=False)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    blob = path.read_bytes()
    buf = fmt.read_manifest(path)["entries"]["model/encoder.0.weight"]["buffers"]["codes"]
    begin, end = buf["data_offsets"]
    assert "stage" in buf
    assert f"{zlib.crc32(blob[8 + n + begin : 8 + n + end]):08x}" == buf["crc32"]


def test_a_planes_buffer_round_trips_and_a_flipped_raw_plane_byte_is_caught(tmp_path):
    """An exact float buffer of 1 MiB is written as zstd-planes (mantissa planes raw); a
    byte flipped in a raw plane, which no zstd checksum covers, fails the CRC-32 on load
    and in verify_file, naming the entry and buffer."""
    w = torch.randn(1 << 18, generator=torch.Generator().manual_seed(8)) * 0.02
    path = tmp_path / "a.tw"
    tw_triton.save(tw_triton.quantize_state_dict({"w": w}, rules="exact"), path, fsync=False)
    buf = fmt.read_manifest(path)["entries"]["w"]["buffers"]["data"]
    assert buf["stage"]["name"] == "zstd-planes" and buf["stage"]["params"]["frames"][:3] == [0, 0, 0]
    assert torch.equal(tw_triton.load(path)["w"], w)
    blob = bytearray(path.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    blob[8 + n + buf["data_offsets"][0] + 1000] ^= 0x10  # in plane 0, stored raw
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="entry 'w' buffer 'data': checksum mismatch .expected crc32"):
        tw_triton.load(path)
    with pytest.raises(CheckpointError, match="entry 'w' buffer 'data'"):
        fmt.verify_file(path)


def test_register_stage():
    class Identity(entropy.Stage):
        name = "identity-test"

        def encode(self, data, itemsize, zstd):
            return bytes(data), {}

        def check_params(self, params, itemsize, where):
            if params != {}:
                raise CheckpointError(f"{where}: no params")

        def check(self, stored, params, raw_nbytes, where):
            if len(stored) != raw_nbytes:
                raise CheckpointError(f"{where}: size")

        def decode(self, stored, params, out, where):
            out[:] = stored

    with pytest.raises(CheckpointError, match="already registered"):
        entropy.register_stage(entropy.ZstdStage())
    entropy.register_stage(Identity())
    try:
        assert "identity-test" in entropy.stage_names()
        raw, back = round_trip("identity-test", torch.arange(10, dtype=torch.int16))
        assert raw == back
    finally:
        entropy.unregister_stage("identity-test")
