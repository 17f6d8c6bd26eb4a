"""The byte-plane stages ``zstd-bytegroup`` and ``zstd-planes``: byte ``k`` of every element
put together (plane ``k``), so that the sign-and-exponent bytes of floats compress apart
from the near-random low mantissa bytes.

``zstd-bytegroup`` codes the concatenated planes as one zstd frame; ``zstd-planes`` gives
each plane its own frame, or stores it raw where a sample of its bytes promises less than
:data:`PLANE_MIN_SAVING`. Records and limits: docs/format.md.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ...errors import CheckpointError
from ...ops.backends import native
from . import zstd as zstd_stage
from .zstd import (
    FrameReader,
    Stage,
    ZstdFrameStage,
    ZstdSettings,
    check_level,
    check_zstd_frame,
    decode_small,
)

# zstd's match finder for float byte planes (zstd-bytegroup): (min_match, hash_log). The
# sign-and-exponent plane repeats a few symbols in no long pattern, so level 1's 4-byte
# matches cost more bits than Huffman literals, and a 64-entry hash table stays in the L1
# cache. Buffers under PLANE_MATCH_MIN_BYTES (and 1-byte codes) keep the level's own: the
# small table stored more bytes there (docs/performance.md, the entropy stage). Decoders need neither.
PLANE_MATCH = (7, 6)
PLANE_MATCH_MIN_BYTES = 1 << 19

# Plane k is byte k of every element in memory order. On a little-endian machine that is
# bits 8*(k % s) .. 8*(k % s) + 7 of the element's (k // s)-th s-byte word, so a plane is a
# shift of whole words (see element_words); elsewhere the stage moves single bytes.
LITTLE_ENDIAN = sys.byteorder == "little"


def element_words(buf: Any, width: int) -> np.ndarray:
    """The ``width``-byte elements of ``buf`` as rows of the widest unsigned words that tile
    them (8, 4, 2 or 1 bytes; 1 on a big-endian machine): float32 is one uint32 column,
    complex128 two uint64 columns.

    Numpy copies a byte column of stride ``width`` one byte at a time; a shift and a
    truncating cast of whole words gathers the same plane faster (and the widen, shift and
    or put it back), most while the data sits in the cache.
    """
    size = next(s for s in (8, 4, 2, 1) if width % s == 0) if LITTLE_ENDIAN else 1
    return np.frombuffer(buf, dtype=np.dtype(f"u{size}")).reshape(-1, width // size)


def plane_chunks(words: np.ndarray, plane: int, scratch: np.ndarray) -> Iterator[np.ndarray]:
    """Byte ``plane`` of every element of ``words`` (see :func:`element_words`), in chunks of up to
    ``len(scratch)`` bytes written into ``scratch``: bounded memory. Each chunk is valid
    until the next is made, so a consumer must take it in (zstd's write() does) first."""
    size, count, rows = words.itemsize, words.shape[0], max(len(scratch), 1)
    column, shift = words[:, plane // size], 8 * (plane % size)
    for start in range(0, count, rows):
        chunk = scratch[: min(rows, count - start)]
        # The unsafe cast to uint8 keeps the low byte: byte ``plane`` of each element.
        np.right_shift(column[start : start + len(chunk)], shift, out=chunk, casting="unsafe")
        yield chunk


class PlanePutter:
    """Puts byte planes back into element words, chunk by chunk, planes in order.

    Chunks of :data:`~tw_triton.codecs.entropy.zstd.CHUNK_BYTES` of widened plane bytes: the scratch stays ~1.25
    ``CHUNK_BYTES``.
    """

    def __init__(self, words: np.ndarray) -> None:
        self.words = words
        self.rows = max(zstd_stage.CHUNK_BYTES // words.itemsize, 1)
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


def chunk_rows(width: int, count: int) -> int:
    """Elements per chunk when all planes are handled together: a chunk of every plane
    adds up to :data:`~tw_triton.codecs.entropy.zstd.CHUNK_BYTES`."""
    return max(min(zstd_stage.CHUNK_BYTES // width, count), 1)


def whole_plane(plane: np.ndarray) -> Callable[[int, int], np.ndarray]:
    """A plane source (see :func:`merge`) over a plane that is whole in memory."""
    return lambda start, stop: plane[start:stop]


class StreamedPlane:
    """A plane source (see :func:`merge`) that decodes a zstd frame chunk by chunk, into
    scratch of ``rows`` bytes; chunks must be asked for in order."""

    def __init__(self, reader: FrameReader, rows: int) -> None:
        self.reader = reader
        self.scratch = np.empty(rows, dtype=np.uint8)

    def __call__(self, start: int, stop: int) -> np.ndarray:
        chunk = self.scratch[: stop - start]
        self.reader.fill(memoryview(chunk))
        return chunk


def merge(
    words: np.ndarray, width: int, sources: Sequence[Callable[[int, int], np.ndarray]], base: int = 0
) -> None:
    """Put the byte planes back into ``words``, chunk by chunk; ``sources[k](start, stop)``
    gives plane ``k``'s bytes of elements ``[start, stop)`` of the buffer, whose element
    ``base`` is ``words``' first. One compiled pass per chunk where the library is built,
    else the numpy putter's passes per plane."""
    count = words.shape[0]
    out = words.reshape(-1).view(np.uint8)
    rows = chunk_rows(width, count)
    putter = None
    for start in range(0, count, rows):
        stop = min(start + rows, count)
        chunks = [source(base + start, base + stop) for source in sources]
        if native.merge_planes(chunks, out[start * width : stop * width]):
            continue
        putter = putter or PlanePutter(words)
        for plane, chunk in enumerate(chunks):
            putter.put(plane, start, chunk)


class PlaneStream:
    """The decoded bytes of a byte-plane buffer in memory order, a piece at a time (a
    :class:`~tw_triton.codecs.entropy.zstd.DecodeStream`): each piece's elements merged
    from their planes' sources (see :func:`merge`), which ``readers`` feed in order. A piece
    that ends inside an element keeps the element's other bytes for the next one."""

    def __init__(
        self,
        sources: Sequence[Callable[[int, int], np.ndarray]],
        width: int,
        count: int,
        readers: Sequence[FrameReader],
        where: str,
    ) -> None:
        self.sources, self.width, self.count = sources, width, count
        self.readers, self.where = readers, where
        self.done = 0  # elements merged so far
        self._carry = memoryview(b"")  # the bytes of the last merged element not yet handed out

    def fill(self, out: memoryview) -> None:
        got = min(len(self._carry), len(out))
        out[:got] = self._carry[:got]
        self._carry = self._carry[got:]
        whole = (len(out) - got) // self.width
        if whole:
            self._merge(out[got : got + whole * self.width], whole)
            got += whole * self.width
        if got < len(out):
            element = memoryview(bytearray(self.width))
            self._merge(element, 1)
            rest = len(out) - got
            out[got:] = element[:rest]
            self._carry = element[rest:]

    def _merge(self, out: memoryview, elements: int) -> None:
        if self.done + elements > self.count:
            raise CheckpointError(f"{self.where}: read past the buffer's {self.count} elements")
        merge(element_words(out, self.width), self.width, self.sources, base=self.done)
        self.done += elements

    def finish(self) -> None:
        for reader in self.readers:
            reader.finish()


class PlaneStage(Stage):
    """What the byte-plane stages share: zstd's match finder for planes, and the buffer as
    element words (:func:`element_words`)."""

    def match_for(self, nbytes: int) -> tuple[int, int]:
        return PLANE_MATCH if nbytes >= PLANE_MATCH_MIN_BYTES else (0, 0)

    def _element_words(self, data: memoryview, itemsize: int) -> np.ndarray:
        if itemsize < 1 or len(data) % itemsize:
            raise CheckpointError(f"{self.name}: {len(data)} bytes are not whole {itemsize}-byte elements")
        return element_words(data, itemsize)


class ByteGroupZstdStage(PlaneStage, ZstdFrameStage):
    """Byte planes (byte k of every element together), then zstd."""

    name = "zstd-bytegroup"

    def encode(self, data: memoryview, itemsize: int, zstd: ZstdSettings) -> tuple[bytes, dict[str, Any]]:
        words = self._element_words(data, itemsize)
        scratch = np.empty(min(zstd_stage.CHUNK_BYTES, words.shape[0]), dtype=np.uint8)
        # The frame goes straight into a BytesIO, whose getvalue() hands over its buffer
        # without a copy (joining per-chunk bytes would copy the whole output once more).
        # Same zstd stream calls, so the same bytes.
        sink = io.BytesIO()
        with zstd.compressor(len(data)).stream_writer(sink, size=len(data), closefd=False) as writer:
            for plane in range(itemsize):
                for chunk in plane_chunks(words, plane, scratch):
                    writer.write(chunk)
        return sink.getvalue(), {**zstd.record(), "width": itemsize}

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        check_level(params, ("level", "width"), where)
        if params["width"] != itemsize or isinstance(params["width"], bool):
            raise CheckpointError(
                f"{where}: stage param 'width' must be the element size {itemsize}, found {params['width']!r}"
            )

    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        super().check(stored, params, raw_nbytes, where)
        if raw_nbytes % params["width"]:
            raise CheckpointError(
                f"{where}: {raw_nbytes} bytes are not whole {params['width']}-byte elements"
            )

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        words = element_words(out, params["width"])
        if len(out) <= zstd_stage.ONE_SHOT_MAX_BYTES:
            planes = np.frombuffer(decode_small(stored, len(out), where), dtype=np.uint8).reshape(
                params["width"], -1
            )
            merge(words, params["width"], [whole_plane(plane) for plane in planes])
            return
        putter = PlanePutter(words)
        reader = FrameReader(stored, where)
        for plane in range(params["width"]):
            putter.fill_plane(plane, reader.fill)
        reader.finish()


class PlanesZstdStage(PlaneStage):
    """Byte planes, each its own zstd frame or stored as it is.

    The low mantissa bytes of trained float weights are close to random: zstd saves little
    on them, at more time than on the sign-and-exponent plane, which it shrinks by about two
    thirds (docs/performance.md). This stage runs zstd only on the planes whose sampled order-0
    entropy promises a saving of at least :data:`PLANE_MIN_SAVING` (see
    :func:`planes_to_code`), and stores the others raw.

    Params: ``level``, ``width`` (the element size) and ``frames``: for each plane, the
    size in bytes of its zstd frame, or 0 where the plane is stored raw (``count`` bytes).
    The stored bytes are the planes in order. Raw planes carry no checksum of their own: a
    load checks the buffer's CRC-32, as for every stage.
    """

    name = "zstd-planes"

    def encode(self, data: memoryview, itemsize: int, zstd: ZstdSettings) -> tuple[bytes, dict[str, Any]]:
        words = self._element_words(data, itemsize)
        count = words.shape[0]
        scratch = np.empty(min(zstd_stage.CHUNK_BYTES, count), dtype=np.uint8)
        # Plane after plane into one BytesIO, whose getvalue() hands its buffer over: no
        # copy of the output. (Splitting a chunk into all its planes in one compiled pass
        # would keep each plane apart until the end and join them: a copy of the output and
        # more peak memory, for no faster save.)
        sink = io.BytesIO()
        frames = []
        for plane, coded in enumerate(planes_to_code(words, itemsize)):
            if coded:
                start = sink.tell()
                with zstd.compressor(count).stream_writer(sink, size=count, closefd=False) as writer:
                    for chunk in plane_chunks(words, plane, scratch):
                        writer.write(chunk)
                frames.append(sink.tell() - start)
            else:
                for chunk in plane_chunks(words, plane, scratch):
                    sink.write(chunk)
                frames.append(0)
        return sink.getvalue(), {**zstd.record(), "width": itemsize, "frames": frames}

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        check_level(params, ("level", "width", "frames"), where)
        if params["width"] != itemsize or isinstance(params["width"], bool):
            raise CheckpointError(
                f"{where}: stage param 'width' must be the element size {itemsize}, found {params['width']!r}"
            )
        frames = params["frames"]
        if (
            not isinstance(frames, list)
            or len(frames) != itemsize
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in frames)
        ):
            raise CheckpointError(
                f"{where}: stage param 'frames' must be {itemsize} sizes (ints >= 0, one per "
                f"plane), found {frames!r}"
            )

    def _segments(
        self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str
    ) -> Iterator[tuple[int, memoryview, str]]:
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
            raise CheckpointError(
                f"{where}: {raw_nbytes} bytes are not whole {params['width']}-byte elements"
            )
        count = raw_nbytes // params["width"]
        for plane, segment, pwhere in self._segments(stored, params, raw_nbytes, where):
            if params["frames"][plane]:
                check_zstd_frame(segment, count, pwhere)

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        stream = self.stream(stored, params, len(out), where)
        stream.fill(out)
        stream.finish()

    def stream(
        self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str
    ) -> PlaneStream:
        width = params["width"]
        count = raw_nbytes // width
        sources: list[Callable[[int, int], np.ndarray]] = []
        readers = []
        for plane, segment, pwhere in self._segments(stored, params, raw_nbytes, where):
            if not params["frames"][plane]:
                sources.append(whole_plane(np.frombuffer(segment, dtype=np.uint8)))
            elif count <= zstd_stage.ONE_SHOT_MAX_BYTES:
                sources.append(
                    whole_plane(np.frombuffer(decode_small(segment, count, pwhere), dtype=np.uint8))
                )
            else:
                readers.append(FrameReader(segment, pwhere))
                sources.append(StreamedPlane(readers[-1], chunk_rows(width, count)))
        return PlaneStream(sources, width, count, readers, where)


# How a plane is judged before zstd runs on all of it: the order-0 entropy (bits per byte)
# of PLANE_SAMPLE elements taken at an even stride over the buffer. A plane goes through
# zstd where that entropy promises a saving of at least PLANE_MIN_SAVING; near-random
# mantissa planes are stored raw, losing only what matches would have found.
PLANE_SAMPLE = 1 << 12
PLANE_MIN_SAVING = 0.05


def planes_to_code(words: np.ndarray, width: int) -> list[bool]:
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
