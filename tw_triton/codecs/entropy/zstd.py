"""The zstd stage and what every stage shares: the :class:`Stage` interface, zstd settings,
the bounded reading of one zstd frame.

A frame is checked (:func:`check_zstd_frame`) before its destination is allocated and then
decoded into exactly that destination; every failure is a
:class:`~tw_triton.errors.CheckpointError` naming the file, the entry and the buffer. The
stages and their records: docs/format.md; the policy: :mod:`.policy`.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zstandard

from ...errors import CheckpointError

# zstd's fastest regular level: its coarser matching suits byte planes and 2-bit codes, and
# higher levels gain little on quantized codes (docs/performance.md, the entropy stage).
DEFAULT_LEVEL = 1
# zstd's fastest level (ZSTD_minCLevel: -ZSTD_TARGETLENGTH_MAX); the python binding exports
# only the largest. A recorded level outside zstd's range was not written by zstd.
MIN_LEVEL = -(1 << 17)
# zstd compresses with several threads from this size up (its jobs are MBs each), with
# half the cores (the rest belong to the training process: data loading, the launch loop),
# at most MAX_THREADS, and only where that makes 2 threads or more: a 2-core machine keeps
# the one writer thread.
MT_MIN_BYTES = 8 << 20
MAX_THREADS = 8
# Byte grouping and streaming decode work in chunks of this many bytes, so the scratch
# memory stays small whatever the buffer size.
CHUNK_BYTES = 4 << 20

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
    def encode(self, data: memoryview, itemsize: int, zstd: ZstdSettings) -> tuple[bytes, dict[str, Any]]:
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
    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        """Decode into ``out`` (exactly the raw size, writable), after :meth:`check`.

        Raises:
            CheckpointError: the stored bytes are corrupted.
        """

    def stream(
        self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str
    ) -> DecodeStream:
        """The decoded bytes a piece at a time, after :meth:`check`: what a load to a device
        copies on slot by slot without holding the whole buffer on the host.

        The default decodes the whole buffer on the first piece; a streaming stage decodes
        only what each piece needs.
        """

        def decoded() -> memoryview:
            out = memoryview(bytearray(raw_nbytes))
            self.decode(stored, params, out, where)
            return out

        return WholeDecode(decoded, raw_nbytes, where)

    def verify(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        """Check that the stored bytes decode to ``raw_nbytes`` bytes, keeping nothing:
        decoded through :meth:`stream` into a scratch piece at a time (constant memory
        where the stage streams)."""
        self.check(stored, params, raw_nbytes, where)
        drain(self.stream(stored, params, raw_nbytes, where), raw_nbytes)


class DecodeStream(Protocol):
    """A buffer's decoded bytes, handed out in order (see :meth:`Stage.stream`)."""

    def fill(self, out: memoryview) -> None:
        """Write the next ``len(out)`` decoded bytes into ``out``.

        Raises:
            CheckpointError: the stored bytes are corrupted, or decode to fewer bytes.
        """

    def finish(self) -> None:
        """After the last piece: check that nothing is left over.

        Raises:
            CheckpointError: the stored bytes decode to more than was read.
        """


def drain(stream: DecodeStream, raw_nbytes: int) -> None:
    """Decode all ``raw_nbytes`` of ``stream`` into a chunk of scratch, dropping them."""
    scratch = memoryview(bytearray(min(CHUNK_BYTES, max(raw_nbytes, 1))))
    for start in range(0, raw_nbytes, len(scratch)):
        stream.fill(scratch[: min(len(scratch), raw_nbytes - start)])
    stream.finish()


class WholeDecode:
    """A :class:`DecodeStream` over a buffer that ``decoded()`` decodes whole (the
    ``raw_nbytes`` it was checked against), called when the first piece is asked for: the
    default for a stage that cannot stream, and small frames."""

    def __init__(self, decoded: Callable[[], bytes | memoryview], raw_nbytes: int, where: str) -> None:
        self._decoded = decoded
        self._where = where
        self._raw_nbytes = raw_nbytes
        self._data: memoryview | None = None
        self.done = 0

    def fill(self, out: memoryview) -> None:
        if self._data is None:
            self._data = memoryview(self._decoded())
        if self.done + len(out) > self._raw_nbytes:
            raise CheckpointError(f"{self._where}: read past the buffer's {self._raw_nbytes} decoded bytes")
        out[:] = self._data[self.done : self.done + len(out)]
        self.done += len(out)

    def finish(self) -> None:
        self._data = None


def default_threads(nbytes: int) -> int:
    """Compression threads for a buffer of ``nbytes``: see :data:`MT_MIN_BYTES`."""
    if nbytes < MT_MIN_BYTES:
        return 0  # before os.cpu_count(), which reads /sys on every call
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
            self.level,
            source_size=size,
            threads=self.threads,
            write_checksum=True,
            write_content_size=True,
            **overrides,
        )
        return zstandard.ZstdCompressor(compression_params=params)

    def record(self) -> dict[str, int]:
        """What a file records of these settings: the level alone. The match settings and
        the threads are the writer's choice and decoding needs none of them; leaving them
        out keeps the files readable by every reader of format version 2 (which accepts
        exactly these params)."""
        return {"level": self.level}


def check_level(params: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(params, dict) or sorted(params) != sorted(keys):
        raise CheckpointError(
            f"{where}: stage params must be an object with keys {list(keys)}, found {params!r}"
        )
    level = params["level"]
    if (
        not isinstance(level, int)
        or isinstance(level, bool)
        or not MIN_LEVEL <= level <= zstandard.MAX_COMPRESSION_LEVEL
    ):
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


def decode_error(where: str, exc: zstandard.ZstdError) -> CheckpointError:
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


def decode_small(stored: memoryview, raw_nbytes: int, where: str) -> bytes:
    """Decode a whole frame (already checked against ``raw_nbytes`` by
    :func:`check_zstd_frame`) in one call; zstd checks its content checksum."""
    dctx = getattr(_DECOMPRESSORS, "dctx", None)
    if dctx is None:
        dctx = _DECOMPRESSORS.dctx = zstandard.ZstdDecompressor()
    try:
        data = dctx.decompress(stored, max_output_size=raw_nbytes)
    except zstandard.ZstdError as exc:
        raise decode_error(where, exc) from exc
    if len(data) != raw_nbytes:
        raise CheckpointError(f"{where}: zstd decoded {len(data)} bytes, expected {raw_nbytes} (corrupted)")
    return data


class FrameReader:
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
            raise decode_error(self.where, exc) from exc
        self.done += got

    def finish(self) -> None:
        try:
            extra = self._reader.read(1)
        except zstandard.ZstdError as exc:
            raise decode_error(self.where, exc) from exc
        if extra:
            raise CheckpointError(f"{self.where}: zstd decodes to more than the expected {self.done} bytes")


class ZstdFrameStage(Stage):
    """A stage whose stored bytes are one zstd frame of the raw size."""

    def check(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        check_zstd_frame(stored, raw_nbytes, where)

    def verify(self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str) -> None:
        # The frame alone, decoded in chunks that are dropped: constant memory whatever the
        # stage does with the frame's bytes, and zstd's content checksum checks every one.
        self.check(stored, params, raw_nbytes, where)
        drain(FrameReader(stored, where), raw_nbytes)


class ZstdStage(ZstdFrameStage):
    """Zstandard over the bytes as they are."""

    name = "zstd"

    def encode(self, data: memoryview, itemsize: int, zstd: ZstdSettings) -> tuple[bytes, dict[str, Any]]:
        return zstd.compressor(len(data)).compress(data), zstd.record()

    def check_params(self, params: Any, itemsize: int, where: str) -> None:
        check_level(params, ("level",), where)

    def decode(self, stored: memoryview, params: Mapping[str, Any], out: memoryview, where: str) -> None:
        if len(out) <= ONE_SHOT_MAX_BYTES:
            out[:] = decode_small(stored, len(out), where)
            return
        # Straight into the destination: the stream reader decodes into ``out`` itself.
        reader = FrameReader(stored, where)
        reader.fill(out)
        reader.finish()

    def stream(
        self, stored: memoryview, params: Mapping[str, Any], raw_nbytes: int, where: str
    ) -> DecodeStream:
        if raw_nbytes <= ONE_SHOT_MAX_BYTES:
            return WholeDecode(lambda: decode_small(stored, raw_nbytes, where), raw_nbytes, where)
        return FrameReader(stored, where)
