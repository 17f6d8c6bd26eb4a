"""The lossless entropy stage: a buffer's bytes become fewer stored bytes, and back.

A stage sits after the codecs: it sees one stored buffer (packed codes, per-block scales,
an exact tensor) as bytes and returns other bytes plus JSON parameters that the manifest
records next to the buffer (``tw_triton.format``, version 2). It never changes a value:
decoding gives back the very same bytes.

Built in:

``zstd``
    Zstandard at :data:`DEFAULT_LEVEL`, one frame with its content size and content
    checksum. Best for 1-byte buffers: the blockwise and log2 codes cluster near the middle
    code, so they carry well under 8 bits of information per byte.
``zstd-bytegroup``
    For buffers of ``width`` > 1 bytes per element: byte ``k`` of every element is put
    together (plane ``k``), the planes are concatenated in order and the whole goes through
    zstd. The high bytes of floats (sign and exponent) repeat a few values and compress
    well once they are together; the low mantissa bytes are near random either way.
    Parameter ``width`` is the element size; decoding undoes the grouping. zstd runs with
    :data:`PLANE_MATCH` (long minimum matches, a small hash table) on buffers of
    :data:`PLANE_MATCH_MIN_BYTES` and more, unless the policy says otherwise. Decoding needs
    none of the zstd settings: a file records the level and the width.

``zstd-planes``
    The same planes, each its own zstd frame or stored raw where its sampled order-0
    entropy promises less than :data:`PLANE_MIN_SAVING` (the near-random low mantissa
    bytes of trained weights). Parameter ``frames`` gives each plane's frame size (0: raw).
    The policy's stage for wide buffers from :data:`PLANES_MIN_BYTES` up.

:func:`candidate_stages` and :func:`encode_buffer` are the policy: which stage a buffer
gets (by dtype), buffers under :data:`MIN_STAGE_BYTES` stay raw, and a stage is kept only
where it saves at least :data:`MIN_SAVING` of the bytes. ``benchmarks/entropy_stage.py`` measures the stages on a
real training state (``benchmarks/results/entropy_stage.md``).

Reading is bounded: :meth:`Stage.check` walks the zstd frame's block headers before the
destination is allocated. The frame must state its content size, equal to the raw size
the manifest records, and its blocks must be able to produce that many bytes, so a
lying manifest is refused before any allocation; the decoder then writes into the
destination buffer and never past it. Every failure is a
:class:`~tw_triton.errors.CheckpointError` naming the file, the entry and the buffer.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import zstandard

from ..errors import CheckpointError
from . import native

# zstd's fastest regular level. On the MiniLM + AdamW checkpoints of the default
# Checkpointer it wrote *smaller* files than level 3 (keyframe 81.5 vs 82.4 MiB, delta
# 12.1 vs 12.4 MiB) in 0.7x the time: its coarser matching suits byte planes and 2-bit
# codes; level 9 gained < 1 % on quantized codes (benchmarks/entropy_stage.py).
DEFAULT_LEVEL = 1
# zstd's fastest level (ZSTD_minCLevel: -ZSTD_TARGETLENGTH_MAX); the python binding exports
# only the largest. A recorded level outside zstd's range was not written by zstd.
MIN_LEVEL = -(1 << 17)
# zstd's match finder for float byte planes (zstd-bytegroup): (min_match, hash_log). The
# sign-and-exponent plane repeats a few symbols in no long pattern, so level 1's 4-byte
# matches cost more bits than Huffman literals, and a 64-entry hash table stays in the L1
# cache. On the MiniLM exact tensors of 512 KiB and more (its 576 KiB attention matrices
# included) it stores less in less time (benchmarks/entropy_stage.py, last table). The
# sign-and-exponent plane alone, in a one-off check: 0.342 vs 0.370, at levels 1, 3 and 9
# alike. Buffers under PLANE_MATCH_MIN_BYTES keep the level's own: on the tiny GPT's and
# the README example's (<= 256 KiB each, a sparse embedding among them) the small table
# wrote 0.6-2.6 % more bytes, and their time is small either way. 1-byte codes keep the
# level's own too: on that sparse embedding's moment codes the small table lost 25 %
# (benchmarks/entropy_stage.py). Decoders need neither value.
PLANE_MATCH = (7, 6)
PLANE_MATCH_MIN_BYTES = 1 << 19
# Wider buffers from this size up get zstd-planes (a frame per plane, near-random planes
# stored raw); smaller ones zstd-bytegroup (one frame: a frame per plane costs ~20 bytes
# of framing each, and a plane of a small buffer takes little time either way).
PLANES_MIN_BYTES = PLANE_MATCH_MIN_BYTES
# Buffers under this many bytes stay raw: the manifest record of a stage costs ~80 bytes
# and a zstd frame ~20, so a small buffer saves little and costs a decoder call.
MIN_STAGE_BYTES = 4096
# A stage is kept only where it saves at least this fraction of the raw bytes. Below it,
# the decode time (~1 GB/s) costs more than reading the few saved bytes from any disk.
MIN_SAVING = 0.03
# zstd compresses with several threads from this size up (its jobs are MBs each), with
# half the cores (the rest belong to the training process: data loading, the launch loop),
# at most MAX_THREADS, and only where that makes 2 threads or more. On the shared 2-core VM
# of the benchmark, 2 threads against 1 on a 64 MiB buffer went either way between runs,
# so a 2-core machine keeps the one writer thread.
MT_MIN_BYTES = 8 << 20
MAX_THREADS = 8
# Byte grouping and streaming decode work in chunks of this many bytes, so the scratch
# memory stays small whatever the buffer size.
CHUNK_BYTES = 4 << 20

# Plane k is byte k of every element in memory order. On a little-endian machine that is
# bits 8*(k % s) .. 8*(k % s) + 7 of the element's (k // s)-th s-byte word, so a plane is a
# shift of whole words (see _words); elsewhere the stage moves single bytes.
_LITTLE_ENDIAN = sys.byteorder == "little"

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# The zstd format caps a block's decoded size at 128 KiB (RFC 8878, 3.1.1.2).
_ZSTD_BLOCK_MAX = 128 << 10
# Block types; the third, 2, is a compressed block (it decodes to at most the block maximum).
_BLOCK_RAW, _BLOCK_RLE = 0, 1


class Stage(ABC):
    """One lossless transform of a buffer's bytes. Subclasses set :attr:`name`."""

    name: str = ""

    def match_for(self, nbytes: int) -> tuple[int, int]:
        """The ``(min_match, hash_log)`` zstd runs with on a buffer of ``nbytes`` unless the
        policy sets them (0: the level's own, the default)."""
        return (0, 0)

    @abstractmethod
    def encode(
        self, data: memoryview, itemsize: int, zstd: ZstdSettings
    ) -> tuple[bytes, dict[str, Any]]:
        """Encode the raw bytes of a buffer of ``itemsize``-byte elements with the zstd
        settings ``zstd``.

        Returns the stored bytes and the JSON params to record (decoding needs them).
        """

    @abstractmethod
    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        """Validate recorded params for a buffer of ``itemsize``-byte elements.

        Raises:
            CheckpointError: params this stage does not write.
        """

    @abstractmethod
    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        """Validate the stored bytes before the destination is allocated: they must be
        able to decode to exactly ``raw_nbytes`` bytes.

        Raises:
            CheckpointError: the stored bytes cannot decode to that size.
        """

    @abstractmethod
    def decode(
        self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str
    ) -> None:
        """Decode into ``out`` (exactly the raw size, writable), after :meth:`check`.

        Raises:
            CheckpointError: the stored bytes are corrupted.
        """

    def checks_content(self, stored: memoryview) -> bool:
        """Whether :meth:`decode` of these stored bytes checks every decoded byte against
        a checksum they carry (then a load needs no CRC pass over them). Default: no."""
        return False

    def verify(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        """Check that the stored bytes decode to ``raw_nbytes`` bytes, keeping nothing.

        The default decodes into a scratch buffer of the raw size; a streaming stage can
        do it in constant memory.
        """
        self.check(stored, params, raw_nbytes, where)
        self.decode(stored, params, memoryview(bytearray(raw_nbytes)), where)


def default_threads(nbytes: int) -> int:
    """Compression threads for a buffer of ``nbytes``: see :data:`MT_MIN_BYTES`."""
    if nbytes < MT_MIN_BYTES:
        return 0  # before os.cpu_count(), which reads /sys on every call (~8 us)
    threads = min((os.cpu_count() or 1) // 2, MAX_THREADS)
    return threads if threads >= 2 else 0


@dataclass(frozen=True)
class ZstdSettings:
    """How a stage runs zstd: the level, match-finder overrides and threads.

    Attributes:
        level: zstd compression level.
        min_match: shortest match zstd looks for (3-7); 0: the level's own (as in zstd).
        hash_log: log2 of the match finder's hash table entries (6 and up); 0: the level's
            own.
        threads: compression threads (0: the calling thread alone).
    """

    level: int = DEFAULT_LEVEL
    min_match: int = 0
    hash_log: int = 0
    threads: int = 0

    def compressor(self, size: int) -> zstandard.ZstdCompressor:
        """A new compressor for ``size`` bytes (one per call: they are not thread-safe, and
        cost microseconds). zstd fits the level's tables to the size, as it does when it
        is given the level alone."""
        overrides = {k: v for k, v in (("min_match", self.min_match), ("hash_log", self.hash_log)) if v}
        params = zstandard.ZstdCompressionParameters.from_level(
            self.level, source_size=size, threads=self.threads, write_checksum=True,
            write_content_size=True, **overrides,
        )
        return zstandard.ZstdCompressor(compression_params=params)

    def record(self) -> dict[str, int]:
        """What a file records of these settings: the level alone. The match settings and
        the threads are the writer's choice and decoding needs none of them; leaving them
        out keeps the files readable by every reader of format version 2 (which accepts
        exactly these params)."""
        return {"level": self.level}


def _check_level(params: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(params, dict) or sorted(params) != sorted(keys):
        raise CheckpointError(f"{where}: stage params must be an object with keys {list(keys)}, found {params!r}")
    level = params["level"]
    if not isinstance(level, int) or isinstance(level, bool) or not MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise CheckpointError(
            f"{where}: stage param 'level' must be an int from {MIN_LEVEL} to "
            f"{zstandard.MAX_COMPRESSION_LEVEL} (zstd's levels), found {level!r}"
        )


def check_zstd_frame(stored: memoryview, raw_nbytes: int, where: str) -> None:
    """Check that ``stored`` is exactly one zstd frame that decodes to ``raw_nbytes`` bytes,
    as far as its headers tell, without decoding it.

    Walks the block headers (3 bytes each, RFC 8878): the frame must end exactly at the
    end of ``stored``, state its content size (equal to ``raw_nbytes``), use no dictionary,
    and its blocks must be able to produce ``raw_nbytes`` bytes (raw and RLE blocks say
    their size; a compressed block makes at most 128 KiB). Costs one step per block.

    Raises:
        CheckpointError: naming ``where`` and what did not fit.
    """
    n = len(stored)
    if n < 4 or stored[:4] != _ZSTD_MAGIC:
        raise CheckpointError(f"{where}: stored bytes do not start with a zstd frame magic number")
    try:
        header_size = zstandard.frame_header_size(stored)
        frame = zstandard.get_frame_parameters(stored)
    except zstandard.ZstdError as exc:
        raise CheckpointError(f"{where}: bad zstd frame header: {exc}") from exc
    if frame.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise CheckpointError(f"{where}: the zstd frame does not state its content size")
    if frame.content_size != raw_nbytes:
        raise CheckpointError(
            f"{where}: the zstd frame holds {frame.content_size} bytes, the manifest says "
            f"raw_nbytes {raw_nbytes}"
        )
    if frame.dict_id != 0:
        raise CheckpointError(f"{where}: the zstd frame needs dictionary {frame.dict_id}; none is stored")
    block_max = min(frame.window_size, _ZSTD_BLOCK_MAX) if frame.window_size else _ZSTD_BLOCK_MAX
    pos = header_size
    capacity = 0
    while True:
        if pos + 3 > n:
            raise CheckpointError(f"{where}: the zstd frame is truncated (block header at byte {pos} of {n})")
        word = int.from_bytes(stored[pos : pos + 3], "little")
        last, kind, size = word & 1, (word >> 1) & 3, word >> 3
        if kind == 3 or size > block_max:
            raise CheckpointError(f"{where}: bad zstd block header at byte {pos} (type {kind}, size {size})")
        if kind == _BLOCK_RLE:
            pos += 4
            capacity += size
        else:
            pos += 3 + size
            capacity += size if kind == _BLOCK_RAW else block_max
        if pos > n:
            raise CheckpointError(f"{where}: the zstd frame is truncated (a block ends at byte {pos} of {n})")
        if last:
            break
    if frame.has_checksum:
        pos += 4
    if pos != n:
        raise CheckpointError(
            f"{where}: the zstd frame is {pos} bytes but {n} are stored "
            + ("(truncated)" if pos > n else "(trailing bytes)")
        )
    if capacity < raw_nbytes:
        raise CheckpointError(
            f"{where}: the zstd frame's blocks hold at most {capacity} bytes, fewer than the "
            f"{raw_nbytes} it states"
        )


def _decode_error(where: str, exc: zstandard.ZstdError) -> CheckpointError:
    """A CheckpointError for zstd's ``exc``; a wrong content checksum is reported as the
    CRC's is (zstd gives no error code through this binding, only its message)."""
    if "checksum" in str(exc):
        return CheckpointError(
            f"{where}: checksum mismatch (zstd's content checksum of the decoded bytes): the data "
            f"is corrupted ({exc})"
        )
    return CheckpointError(f"{where}: zstd could not decode the stored bytes: {exc}")


# Frames that decode to at most this many bytes are decoded in one call, by a decompressor
# kept per thread, into a bytes object that is then copied: a checkpoint holds hundreds of
# small buffers (scales, bounds, small tensors' codes), and a new streaming reader with its
# own context costs more than decoding one of them.
ONE_SHOT_MAX_BYTES = 1 << 20
_DECOMPRESSORS = threading.local()


def _decode_small(stored: memoryview, raw_nbytes: int, where: str) -> bytes:
    """Decode a whole frame (already checked against ``raw_nbytes`` by
    :func:`check_zstd_frame`) in one call; zstd checks its content checksum."""
    dctx = getattr(_DECOMPRESSORS, "dctx", None)
    if dctx is None:
        dctx = _DECOMPRESSORS.dctx = zstandard.ZstdDecompressor()
    try:
        data = dctx.decompress(stored, max_output_size=raw_nbytes)
    except zstandard.ZstdError as exc:
        raise _decode_error(where, exc) from exc
    if len(data) != raw_nbytes:
        raise CheckpointError(f"{where}: zstd decoded {len(data)} bytes, expected {raw_nbytes} (corrupted)")
    return data


class _Reader:
    """Reads exactly the decoded bytes of one zstd frame, into given buffers."""

    def __init__(self, stored: memoryview, where: str) -> None:
        self.where = where
        self._reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=False)
        self.done = 0

    def fill(self, out: memoryview) -> None:
        got = 0
        try:
            while got < len(out):
                k = self._reader.readinto(out[got:])
                if not k:
                    raise CheckpointError(
                        f"{self.where}: zstd stream ended after {self.done + got} bytes, "
                        f"expected more (corrupted)"
                    )
                got += k
        except zstandard.ZstdError as exc:
            raise _decode_error(self.where, exc) from exc
        self.done += got

    def finish(self) -> None:
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as exc:
            raise _decode_error(self.where, exc) from exc
        if extra:
            raise CheckpointError(f"{self.where}: zstd decodes to more than the expected {self.done} bytes")


class _ZstdFrameStage(Stage):
    """A stage whose stored bytes are one zstd frame of the raw size."""

    def checks_content(self, stored: memoryview) -> bool:
        # zstd checks a frame's content checksum when it reaches the frame's end, which
        # every decode here does (_Reader.finish). A header that cannot be parsed is not
        # trusted: the CRC then runs first, and check() reports the header.
        try:
            return bool(zstandard.get_frame_parameters(stored).has_checksum)
        except zstandard.ZstdError:
            return False

    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        check_zstd_frame(stored, raw_nbytes, where)

    def verify(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        # Decode in chunks and drop them: constant memory, and zstd's content checksum
        # still checks every decoded byte.
        self.check(stored, params, raw_nbytes, where)
        scratch = memoryview(bytearray(min(CHUNK_BYTES, max(raw_nbytes, 1))))
        reader = _Reader(stored, where)
        for start in range(0, raw_nbytes, len(scratch)):
            reader.fill(scratch[: min(len(scratch), raw_nbytes - start)])
        reader.finish()


class ZstdStage(_ZstdFrameStage):
    """Zstandard over the bytes as they are."""

    name = "zstd"

    def encode(
        self, data: memoryview, itemsize: int, zstd: ZstdSettings
    ) -> tuple[bytes, dict[str, Any]]:
        return zstd.compressor(len(data)).compress(data), zstd.record()

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        _check_level(params, ("level",), where)

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        if len(out) <= ONE_SHOT_MAX_BYTES:
            out[:] = _decode_small(stored, len(out), where)
            return
        # Straight into the destination: the stream reader decodes into ``out`` itself.
        reader = _Reader(stored, where)
        reader.fill(out)
        reader.finish()


def _words(buf: Any, width: int) -> np.ndarray:
    """The ``width``-byte elements of ``buf`` as rows of the widest unsigned words that tile
    them (8, 4, 2 or 1 bytes; 1 on a big-endian machine): float32 is one uint32 column,
    complex128 two uint64 columns.

    Numpy copies a byte column of stride ``width`` one byte at a time. A shift and a
    truncating cast of whole words gathers the same plane ~4x faster and the widen, shift
    and or put it back ~1.4x faster, while the data sits in the cache (a 4 MiB float32
    buffer). On buffers many times the cache both ways are bound by memory traffic (every
    plane reads, or rewrites, the whole buffer) and the gap shrinks to ~15 % (gather) and
    none (put back).
    """
    size = next(s for s in (8, 4, 2, 1) if width % s == 0) if _LITTLE_ENDIAN else 1
    return np.frombuffer(buf, dtype=np.dtype(f"u{size}")).reshape(-1, width // size)


def _plane_chunks(words: np.ndarray, plane: int, scratch: np.ndarray) -> Iterator[np.ndarray]:
    """Byte ``plane`` of every element of ``words`` (see :func:`_words`), in chunks of up to
    ``len(scratch)`` bytes written into ``scratch``: bounded memory. Each chunk is valid
    until the next is made, so a consumer must take it in (zstd's write() does) first."""
    size, count, rows = words.itemsize, words.shape[0], max(len(scratch), 1)
    column, shift = words[:, plane // size], 8 * (plane % size)
    for start in range(0, count, rows):
        chunk = scratch[: min(rows, count - start)]
        # The unsafe cast to uint8 keeps the low byte: byte ``plane`` of each element.
        np.right_shift(column[start : start + len(chunk)], shift, out=chunk, casting="unsafe")
        yield chunk


class _PlanePutter:
    """Puts byte planes back into element words, chunk by chunk, planes in order.

    Chunks of :data:`CHUNK_BYTES` of widened plane bytes: the scratch stays ~1.25
    ``CHUNK_BYTES``.
    """

    def __init__(self, words: np.ndarray) -> None:
        self.words = words
        self.rows = max(CHUNK_BYTES // words.itemsize, 1)
        self.scratch = np.empty(min(self.rows, words.shape[0]), dtype=np.uint8)
        self.wide = np.empty(len(self.scratch) if words.itemsize > 1 else 0, dtype=words.dtype)

    def fill_plane(self, plane: int, fill: Callable[[memoryview], None]) -> None:
        """Plane ``plane``'s bytes, read by ``fill`` into a scratch chunk at a time."""
        for start, stop in self._ranges():
            chunk = self.scratch[: stop - start]
            fill(memoryview(chunk))
            self.put(plane, start, chunk)

    def _ranges(self) -> Iterator[tuple[int, int]]:
        count = self.words.shape[0]
        for start in range(0, count, self.rows):
            yield start, min(start + self.rows, count)

    def put(self, plane: int, start: int, chunk: np.ndarray) -> None:
        size = self.words.itemsize
        shift = 8 * (plane % size)
        dest = self.words[start : start + len(chunk), plane // size]
        if shift == 0:
            # A word's first plane: widening sets its other bytes to 0, clearing whatever
            # the destination held, so later planes can be or-ed in.
            dest[...] = chunk
        else:
            # Widen, shift, or: three in-place passes, faster than one
            # left_shift(chunk, dtype=...) whose buffered cast is slow.
            spread = self.wide[: len(chunk)]
            spread[...] = chunk
            np.left_shift(spread, shift, out=spread)
            np.bitwise_or(dest, spread, out=dest)


def _chunk_rows(width: int, count: int) -> int:
    """Elements per chunk when all planes are handled together: a chunk of every plane
    adds up to :data:`CHUNK_BYTES`."""
    return max(min(CHUNK_BYTES // width, count), 1)


def _whole_plane(plane: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """A plane source (see :func:`_merge`) over a plane that is whole in memory."""
    return lambda start, stop: plane[start:stop]


class _StreamedPlane:
    """A plane source (see :func:`_merge`) that decodes a zstd frame chunk by chunk, into
    scratch of ``rows`` bytes; chunks must be asked for in order."""

    def __init__(self, reader: _Reader, rows: int) -> None:
        self.reader = reader
        self.scratch = np.empty(rows, dtype=np.uint8)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        chunk = self.scratch[: stop - start]
        self.reader.fill(memoryview(chunk))
        return chunk


def _merge(words: np.ndarray, width: int, sources: Sequence[Callable[[int, int], np.ndarray]]) -> None:
    """Put the byte planes back into ``words``, chunk by chunk; ``sources[k](start, stop)``
    gives plane ``k``'s bytes of elements ``[start, stop)``. One compiled pass per chunk
    where the library is built, else the numpy putter's passes per plane."""
    count = words.shape[0]
    out = words.reshape(-1).view(np.uint8)
    rows = _chunk_rows(width, count)
    putter = None
    for start in range(0, count, rows):
        stop = min(start + rows, count)
        chunks = [source(start, stop) for source in sources]
        if native.merge_planes(chunks, out[start * width : stop * width]):
            continue
        putter = putter or _PlanePutter(words)
        for plane, chunk in enumerate(chunks):
            putter.put(plane, start, chunk)


class _PlaneStage(Stage):
    """What the byte-plane stages share: zstd's match finder for planes, and the buffer as
    element words (:func:`_words`)."""

    def match_for(self, nbytes: int) -> tuple[int, int]:
        return PLANE_MATCH if nbytes >= PLANE_MATCH_MIN_BYTES else (0, 0)

    def _element_words(self, data: memoryview, itemsize: int) -> np.ndarray:
        if itemsize < 1 or len(data) % itemsize:
            raise CheckpointError(f"{self.name}: {len(data)} bytes are not whole {itemsize}-byte elements")
        return _words(data, itemsize)


class ByteGroupZstdStage(_PlaneStage, _ZstdFrameStage):
    """Byte planes (byte k of every element together), then zstd."""

    name = "zstd-bytegroup"

    def encode(
        self, data: memoryview, itemsize: int, zstd: ZstdSettings
    ) -> tuple[bytes, dict[str, Any]]:
        words = self._element_words(data, itemsize)
        scratch = np.empty(min(CHUNK_BYTES, words.shape[0]), dtype=np.uint8)
        # The frame goes straight into a BytesIO, whose getvalue() hands over its buffer
        # without a copy; joining per-chunk bytes copied the whole output once more (~17 ms
        # of ~165 on 87 MiB of float32). Same zstd stream calls, so the same bytes.
        sink = io.BytesIO()
        with zstd.compressor(len(data)).stream_writer(sink, size=len(data), closefd=False) as writer:
            for plane in range(itemsize):
                for chunk in _plane_chunks(words, plane, scratch):
                    writer.write(chunk)
        return sink.getvalue(), {**zstd.record(), "width": itemsize}

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        _check_level(params, ("level", "width"), where)
        if params["width"] != itemsize or isinstance(params["width"], bool):
            raise CheckpointError(
                f"{where}: stage param 'width' must be the element size {itemsize}, found {params['width']!r}"
            )

    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        super().check(stored, params, raw_nbytes, where)
        if raw_nbytes % params["width"]:
            raise CheckpointError(f"{where}: {raw_nbytes} bytes are not whole {params['width']}-byte elements")

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        words = _words(out, params["width"])
        if len(out) <= ONE_SHOT_MAX_BYTES:
            planes = np.frombuffer(_decode_small(stored, len(out), where), dtype=np.uint8).reshape(params["width"], -1)
            _merge(words, params["width"], [_whole_plane(plane) for plane in planes])
            return
        putter = _PlanePutter(words)
        reader = _Reader(stored, where)
        for plane in range(params["width"]):
            putter.fill_plane(plane, reader.fill)
        reader.finish()


class PlanesZstdStage(_PlaneStage):
    """Byte planes, each its own zstd frame or stored as it is.

    The low mantissa bytes of trained float weights are close to random: on the MiniLM
    weights zstd saved 3.0, 2.0 and 0.0 % of planes 0-2 and 66 % of plane 3 (sign and
    exponent), and it spent more time on the three low planes than on plane 3 while coding
    and decoding them. This stage runs zstd only on the planes whose sampled order-0
    entropy promises a saving of at least :data:`PLANE_MIN_SAVING` (see
    :func:`_planes_to_code`), and stores the others raw.

    Params: ``level``, ``width`` (the element size) and ``frames``: for each plane, the
    size in bytes of its zstd frame, or 0 where the plane is stored raw (``count`` bytes).
    The stored bytes are the planes in order. Raw planes carry no checksum of their own, so
    a load checks the buffer's CRC-32 (see :meth:`Stage.checks_content`).
    """

    name = "zstd-planes"

    def encode(
        self, data: memoryview, itemsize: int, zstd: ZstdSettings
    ) -> tuple[bytes, dict[str, Any]]:
        words = self._element_words(data, itemsize)
        count = words.shape[0]
        scratch = np.empty(min(CHUNK_BYTES, count), dtype=np.uint8)
        # Plane after plane into one BytesIO, whose getvalue() hands its buffer over: no
        # copy of the output. (Splitting a chunk into all its planes in one compiled pass
        # kept each plane apart until the end and joined them, a copy of the output: no
        # faster in a whole save, and 22 MiB more peak memory on the MiniLM keyframe.)
        sink = io.BytesIO()
        frames = []
        for plane, coded in enumerate(_planes_to_code(words, itemsize)):
            if coded:
                start = sink.tell()
                with zstd.compressor(count).stream_writer(sink, size=count, closefd=False) as writer:
                    for chunk in _plane_chunks(words, plane, scratch):
                        writer.write(chunk)
                frames.append(sink.tell() - start)
            else:
                for chunk in _plane_chunks(words, plane, scratch):
                    sink.write(chunk)
                frames.append(0)
        return sink.getvalue(), {**zstd.record(), "width": itemsize, "frames": frames}

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        _check_level(params, ("level", "width", "frames"), where)
        if params["width"] != itemsize or isinstance(params["width"], bool):
            raise CheckpointError(
                f"{where}: stage param 'width' must be the element size {itemsize}, found {params['width']!r}"
            )
        frames = params["frames"]
        if (
            not isinstance(frames, list) or len(frames) != itemsize
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in frames)
        ):
            raise CheckpointError(
                f"{where}: stage param 'frames' must be {itemsize} sizes (ints >= 0, one per "
                f"plane), found {frames!r}"
            )

    def _segments(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> Iterator[tuple[int, memoryview, str]]:
        """Each plane's stored bytes with its position in ``frames``, after checking that
        the planes fill the stored bytes exactly."""
        count = raw_nbytes // params["width"]
        sizes = [n or count for n in params["frames"]]
        if sum(sizes) != len(stored):
            raise CheckpointError(
                f"{where}: the planes take {sum(sizes)} bytes ({params['frames']!r}, {count} per "
                f"raw plane), but {len(stored)} are stored"
            )
        pos = 0
        for plane, n in enumerate(sizes):
            yield plane, stored[pos : pos + n], f"{where} plane {plane}"
            pos += n

    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        if raw_nbytes % params["width"]:
            raise CheckpointError(f"{where}: {raw_nbytes} bytes are not whole {params['width']}-byte elements")
        count = raw_nbytes // params["width"]
        for plane, segment, pwhere in self._segments(stored, params, raw_nbytes, where):
            if params["frames"][plane]:
                check_zstd_frame(segment, count, pwhere)

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        width = params["width"]
        words = _words(out, width)
        count = words.shape[0]
        sources: list[Callable[[int, int], np.ndarray]] = []
        readers = []
        for plane, segment, pwhere in self._segments(stored, params, len(out), where):
            if not params["frames"][plane]:
                sources.append(_whole_plane(np.frombuffer(segment, dtype=np.uint8)))
            elif count <= ONE_SHOT_MAX_BYTES:
                sources.append(_whole_plane(np.frombuffer(_decode_small(segment, count, pwhere), dtype=np.uint8)))
            else:
                readers.append(_Reader(segment, pwhere))
                sources.append(_StreamedPlane(readers[-1], _chunk_rows(width, count)))
        _merge(words, width, sources)
        for reader in readers:
            reader.finish()


# How a plane is judged before zstd runs on all of it: the order-0 entropy (bits per byte)
# of PLANE_SAMPLE elements taken at an even stride over the buffer, which costs ~0.1 ms per
# buffer. A plane goes through zstd where that entropy promises a saving of at least
# PLANE_MIN_SAVING. Mantissa planes of trained weights sit at 7.9-8.0 bits; zstd still
# saves a few percent on some where rows repeat (the MiniLM embedding's unused vocabulary
# rows: 3.5 and 2.4 % of planes 0 and 1, 0.7 MB), at about the cost in time of the sign-
# and-exponent plane that saves two thirds, coding and decoding. A zstd sample was tried
# first: on that embedding 4 slices of 4 KiB promised planes 0 and 1 33 and 17 %, 16
# slices 8 and 2 %, as a slice at the start falls in the repeated rows. Planes this rule
# stores raw lose only what matches would have found.
PLANE_SAMPLE = 1 << 12
PLANE_MIN_SAVING = 0.05


def _planes_to_code(words: np.ndarray, width: int) -> list[bool]:
    """For each byte plane, whether its sampled order-0 entropy is at most
    ``8 * (1 - PLANE_MIN_SAVING)`` bits per byte."""
    count = words.shape[0]
    sample = words[:: max(count // PLANE_SAMPLE, 1)][:PLANE_SAMPLE]
    size = words.itemsize
    plane_bytes = np.empty(sample.shape[0], dtype=np.uint8)
    limit = 8.0 * (1.0 - PLANE_MIN_SAVING)
    coded = []
    for plane in range(width):
        np.right_shift(sample[:, plane // size], 8 * (plane % size), out=plane_bytes, casting="unsafe")
        counts = np.bincount(plane_bytes, minlength=256)
        freq = counts[counts > 0] / max(len(plane_bytes), 1)
        coded.append(float(-(freq * np.log2(freq)).sum()) <= limit)
    return coded


# The stage registry, like the codec registry: a file names its stage, the reader looks it up.
_STAGES: dict[str, Stage] = {s.name: s for s in (ZstdStage(), ByteGroupZstdStage(), PlanesZstdStage())}


def register_stage(stage: Stage, *, replace: bool = False) -> None:
    """Make ``stage`` available to writing and reading under ``stage.name``.

    Raises:
        CheckpointError: not a :class:`Stage`, an empty name, or a taken name without ``replace``.
    """
    if not isinstance(stage, Stage) or not isinstance(stage.name, str) or not stage.name:
        raise CheckpointError(f"a stage must subclass Stage and have a name, got {stage!r}")
    if stage.name in _STAGES and not replace:
        raise CheckpointError(f"stage {stage.name!r} is already registered (pass replace=True)")
    _STAGES[stage.name] = stage


def get_stage(name: str) -> Stage | None:
    """The stage registered as ``name``, or ``None``."""
    return _STAGES.get(name)


def stage_names() -> list[str]:
    """Names of all registered stages."""
    return sorted(_STAGES)


@dataclass(frozen=True)
class EntropyPolicy:
    """Which buffers go through which stage when a checkpoint is written.

    Attributes:
        level: zstd level for every stage.
        min_match, hash_log: zstd match-finder settings for every stage (see
            :class:`ZstdSettings`; 0: the level's own); ``None``: each stage's
            :meth:`Stage.match_for` (``zstd-bytegroup``: :data:`PLANE_MATCH` from
            :data:`PLANE_MATCH_MIN_BYTES` up).
        min_bytes: buffers smaller than this stay raw.
        min_saving: a stage is kept only where it saves at least this fraction of the raw
            bytes; ``None`` keeps it whatever it gives (for tests of the format).
        stage: force this stage for every buffer it fits (``None``: by element size, see
            :func:`candidate_stages`).
        threads: zstd compression threads (0: the writer thread alone); ``None`` picks by
            buffer size and core count (:func:`default_threads`).
    """

    level: int = DEFAULT_LEVEL
    min_match: int | None = None
    hash_log: int | None = None
    min_bytes: int = MIN_STAGE_BYTES
    min_saving: float | None = MIN_SAVING
    stage: str | None = None
    threads: int | None = None


AUTO = EntropyPolicy()


def resolve_policy(entropy: Any) -> EntropyPolicy | None:
    """``"auto"`` -> the default policy, ``None``/``"none"`` -> no stage, a policy as is.

    Raises:
        CheckpointError: anything else, or a policy naming an unknown stage.
    """
    if entropy is None or entropy == "none":
        return None
    if isinstance(entropy, str) and entropy == "auto":
        return AUTO
    if isinstance(entropy, EntropyPolicy):
        if entropy.stage is not None and entropy.stage not in _STAGES:
            raise CheckpointError(f"entropy policy names unknown stage {entropy.stage!r}; known: {stage_names()}")
        return entropy
    raise CheckpointError(f"entropy must be 'auto', 'none', None or an EntropyPolicy, got {entropy!r}")


def candidate_stages(dtype: torch.dtype, nbytes: int, policy: EntropyPolicy) -> tuple[str, ...]:
    """The stages to try for a buffer (the smallest output wins); ``()`` to store it raw.

    * under ``policy.min_bytes`` (or empty): raw;
    * 1-byte elements (codes, int8, bool): ``zstd`` (grouping one byte changes nothing);
    * floating and complex: byte planes, which put sign and exponent bytes together (they
      beat plain zstd on every float kind of the benchmark): ``zstd-planes`` from
      :data:`PLANES_MIN_BYTES` up, ``zstd-bytegroup`` below;
    * wider integers: the planes stage and ``zstd``. Small counters give zstd long runs of
      equal 8-byte patterns that grouping breaks up, while integers that hold float bits
      (the log2 codec's per-block bounds) group like floats; both kinds occur, and integer
      buffers are few.
    """
    if nbytes < policy.min_bytes or nbytes == 0:
        return ()
    if policy.stage is not None:
        return (policy.stage,)
    if dtype.itemsize == 1:
        return ("zstd",)
    planes = "zstd-planes" if nbytes >= PLANES_MIN_BYTES else "zstd-bytegroup"
    if dtype.is_floating_point or dtype.is_complex:
        return (planes,)
    return (planes, "zstd")


@dataclass(frozen=True)
class StagedBytes:
    """A buffer after its stage: the stored bytes and the manifest record of the stage."""

    data: bytes
    record: dict[str, Any]  # {"name", "params", "raw_nbytes"}


def encode_buffer(tensor: torch.Tensor, data: memoryview, policy: EntropyPolicy) -> StagedBytes | None:
    """Run the policy's stage on one contiguous CPU buffer whose bytes are ``data``.

    Returns ``None`` where the buffer stays raw (too small, or the stage saved too little).
    """
    best: tuple[bytes, str, dict[str, Any]] | None = None
    threads = default_threads(len(data)) if policy.threads is None else policy.threads
    for name in candidate_stages(tensor.dtype, len(data), policy):
        stage = _STAGES[name]
        match = stage.match_for(len(data))
        min_match = match[0] if policy.min_match is None else policy.min_match
        hash_log = match[1] if policy.hash_log is None else policy.hash_log
        zstd = ZstdSettings(policy.level, min_match, hash_log, threads)
        stored, params = stage.encode(data, tensor.element_size(), zstd)
        if best is None or len(stored) < len(best[0]):
            best = (stored, name, params)
    if best is None:
        return None
    stored, name, params = best
    if policy.min_saving is not None and len(stored) > len(data) * (1.0 - policy.min_saving):
        return None
    return StagedBytes(stored, {"name": name, "params": params, "raw_nbytes": len(data)})


__all__ = [
    "DEFAULT_LEVEL",
    "PLANE_MATCH",
    "PLANE_MATCH_MIN_BYTES",
    "ZstdSettings",
    "MIN_STAGE_BYTES",
    "MIN_SAVING",
    "Stage",
    "ZstdStage",
    "ByteGroupZstdStage",
    "PlanesZstdStage",
    "EntropyPolicy",
    "StagedBytes",
    "register_stage",
    "get_stage",
    "stage_names",
    "resolve_policy",
    "candidate_stages",
    "default_threads",
    "encode_buffer",
    "check_zstd_frame",
]
