"""The on-disk format: one checkpoint is one safetensors file with a JSON manifest.

Layout (the safetensors layout, so stock ``safetensors`` opens every file written here)::

    [8 bytes: N, unsigned little-endian]
    [N bytes: JSON header, padded with spaces so that 8 + N is a multiple of 8]
    [data: every buffer's bytes, back to back, no gaps]

The header maps each tensor key to ``{"dtype", "shape", "data_offsets"}`` (offsets relative
to the start of the data) and holds ``__metadata__`` (str -> str) with two keys:

* ``"tw_triton"``: the manifest, a JSON document (schema below);
* ``"tw_triton.crc32"``: CRC-32 of the manifest's UTF-8 bytes, 8 lowercase hex digits, so a
  flipped bit anywhere in the manifest is caught even where the JSON stays valid.

Tensor keys are ``"<entry path>:<buffer name>"``. Buffer names match ``[A-Za-z0-9_.-]+``
(no colon), so the last colon splits a key unambiguously whatever the entry path holds.

Buffers are laid out by decreasing element size (stable in entry order; a staged buffer
counts as bytes), so with the data section starting 8-byte aligned every buffer starts
aligned to its element size, as safetensors' own writer does.

Manifest, version 2::

    {"format": "tw_triton", "version": 2,
     "checkpoint_id": str, "reference_id": str | null, "checksum": "crc32",
     "entries": {path: {"codec": str, "params": {...}, "dtype": "bfloat16", "shape": [..],
                        "buffers": {name: {"key": str, "dtype": "U8", "shape": [..],
                                           "data_offsets": [begin, end], "crc32": "89abcdef",
                                           "stage": {"name": "zstd", "params": {"level": 3},
                                                     "raw_nbytes": int}}}}},
     "aliases": {path: path}, "skeleton": any JSON, "rules": [...], "metadata": {...},
     "stats": {"raw_bytes": int, "stored_bytes": int, "entries": int, "buffers": int}}

A buffer record's ``dtype`` and ``shape`` are always those of the buffer as the codec made
it (what :func:`read_file` returns); ``data_offsets`` and ``crc32`` are those of the bytes
stored in the file. ``"stage"`` is optional (version 2 only): the buffer went through the
lossless entropy stage ``name`` of :mod:`tw_triton.codecs.entropy` with ``params``, and
``raw_nbytes`` (equal to shape x dtype size) is its size before the stage. A staged buffer
is, in the safetensors tensor table, a 1-D ``U8`` tensor of its stored bytes, so stock
``safe_open`` opens every file and returns those bytes. The CRC-32 covers the stored bytes
(every verified read checks it, see below); the decoder checks the decoded size
(see the entropy module: the stored frame must state ``raw_nbytes`` and be able to make
that many bytes before the destination is allocated, and never writes past it).
``stats.stored_bytes`` is the data section (stored bytes), ``raw_bytes`` the original
tensors.

Version 1 (format 0.1) is version 2 without stage records; both are read. Any other
version is refused with a :class:`~tw_triton.errors.CheckpointError` naming it. The writer
writes version 2, with stages chosen by the ``entropy`` policy of :func:`write_file`.

The format knows no codec: it stores ``EncodedEntry.codec``, ``params`` and ``buffers``
as they are. Whether a codec name is known, and whether an entry's buffers fit its shape,
is checked by the codec registry when the entry is decoded (``tw_triton.load``).

Reading validates everything before it allocates (:mod:`tw_triton.file_header` parses and
checks the header; this module reads and writes the buffers): header length against the
file size, the JSON, every offset (in range, contiguous, covering the data exactly), shape
x dtype size against each byte span (against ``raw_nbytes`` for a staged buffer), dtypes against a
whitelist, stage names and params, the manifest schema and version, and that the manifest
and the tensor table agree key by key. Every allocation of a raw buffer is bounded by the
file size; a staged buffer's allocation is bounded by what its stored zstd blocks can
decode to (at most 32768 times their size, by the zstd format), checked before allocating,
and all staged buffers of a file together may decode to at most :data:`MAX_EXPANSION`
times the file's size plus :data:`EXPANSION_SLACK_BYTES` (``max_expansion`` of
:func:`read_file` and :func:`verify_file` sets the factor, ``None`` lifts the bound), also
checked from the header, so a small file cannot make a load allocate gigabytes.
Data checksums are verified on load unless ``verify=False``; the manifest's own
checksum is always verified (it costs nothing). One verification, one answer: a read with
``verify`` checks every buffer's CRC-32 over its stored bytes, as :func:`verify_file` does,
before a staged buffer is decoded (and zstd checks its frame's content checksum as it
decodes). Trusting the content checksum alone would let a frame whose bytes changed but
still decode to checksum-valid content (zstd ignores some header bits) load while
``verify_file`` calls the file corrupted, so that ``latest()`` and ``restore()`` could
pick different checkpoints. The CRC pass runs over the compressed bytes only, on the
threads that decode.

Errors: every malformed file raises :class:`~tw_triton.errors.CheckpointError` naming the
file and, where it applies, the entry and buffer and what was expected. Failures of the
operating system raise :class:`~tw_triton.errors.CheckpointIOError`, which is also an
``OSError`` carrying the original ``errno`` (and chains the original error).

No pickle anywhere: the file holds JSON and raw little-endian bytes only.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import secrets
import struct
import sys
import threading
import zlib
from dataclasses import dataclass
# What json.dumps does with a str under ensure_ascii (the same C function), without the
# encoder object each json.dumps call builds: a header quotes thousands of strings. Only
# for values known to be str; anything else goes through _json.
from json.encoder import encode_basestring_ascii as _quote
from typing import Any, BinaryIO, Iterable, Mapping

import torch

from .codecs.entropy import EntropyPolicy, encode_buffer, resolve_policy
from .errors import CheckpointError
from .file_header import (  # noqa: F401  (re-exported: part of this module's API)
    BUFFER_DTYPES,
    BUFFER_NAME_RE,
    CHECKSUM_NAME,
    ENTRY_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_CRC_KEY,
    MANIFEST_KEY,
    MAX_HEADER_BYTES,
    READABLE_VERSIONS,
    _BUFFER_DTYPE_NAMES,
    _ENTRY_DTYPE_NAMES,
    _STAGED_DTYPE,
    _BufferSpec,
    _Layout,
    _check_shape,
    _io_error,
    _read_layout,
    _where,
    tensor_key,
)
from .parallel import parallel_map
from .qstate import EncodedEntry, QuantizedState
from .writeback import can_start_writeback, start_writeback

logger = logging.getLogger(__name__)

# Reads, writes and checksums go in chunks of this size: large enough that syscalls are
# cheap, small enough that the CRC of a chunk runs while the chunk is still in cache.
IO_CHUNK_BYTES = 8 << 20
# Positional reads let worker threads read one file at once; without them (Windows) the
# file position is shared and one thread reads.
_POSITIONAL_READS = hasattr(os, "preadv")

# The bound on what a file's staged buffers may decode to, before anything is decoded:
# MAX_EXPANSION times the file's size plus EXPANSION_SLACK_BYTES. zstd alone would let a
# file of a few hundred KB declare gigabytes of zeros. Real checkpoints stay far below: in
# the Checkpointer files of a transformer, an MLP and a LoRA model with a zero-initialised
# B matrix and a bool mask buffer (keyframes and open- and closed-loop deltas, moments
# coded), the decoded buffers were at most 3.3 times the file. The slack leaves room for
# legitimately constant tensors (a mask, a zero-initialised adapter) in a small file.
MAX_EXPANSION = 32.0
EXPANSION_SLACK_BYTES = 64 << 20

_TEMP_RANDOM_BYTES = 8
_TEMP_NAME_RE = re.compile(r"\..+\.[0-9a-f]{%d}\.tmp" % (2 * _TEMP_RANDOM_BYTES), re.DOTALL)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def temp_path_for(path: str | os.PathLike) -> str:
    """A fresh temporary name next to ``path``: ``.<final name>.<16 hex>.tmp``.

    Kept in the same directory so that ``os.replace`` is an atomic rename on one filesystem.
    """
    path = os.fspath(path)
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{secrets.token_hex(_TEMP_RANDOM_BYTES)}.tmp")


def is_temp_file(name: str | os.PathLike) -> bool:
    """Whether ``name`` (a file name or a path) is a temporary file left by :func:`write_file`.

    A writer that crashed mid-write leaves such a file; retention may delete it, and
    checkpoint listings must skip it.
    """
    return _TEMP_NAME_RE.fullmatch(os.path.basename(os.fspath(name))) is not None


def write_file(
    qstate: QuantizedState,
    path: str | os.PathLike,
    *,
    fsync: bool = True,
    entropy: str | EntropyPolicy | None = "auto",
) -> int:
    """Write ``qstate`` to ``path`` as one safetensors file, atomically.

    The bytes go to a temporary file in the same directory (see :func:`temp_path_for`),
    which is flushed and fsynced, renamed over ``path`` with ``os.replace``, and then the
    directory is fsynced so the rename itself survives a crash. On any error the temporary
    file is removed and a file already at ``path`` is left untouched.

    Buffers are written straight from the tensors (no copy of the whole file in memory),
    in file order with large sequential writes, after the header. With ``fsync``, Linux is
    asked to start writing each chunk to the disk as soon as it is written
    (:mod:`tw_triton.writeback`), so the final fsync waits for less. The CRC-32 of each
    buffer's stored bytes is taken while planning, on the worker threads that stage the
    buffers (:mod:`tw_triton.parallel`), so the header is written once, already final.
    Buffers that are not on the CPU are copied there first (the async writer hands over
    pinned host copies already).

    The entropy stage runs here, before the header is laid out (the offsets need the
    stored sizes): each buffer the policy picks is compressed in memory, and kept only if
    it saved enough (:mod:`tw_triton.codecs.entropy`). Compressed buffers are small, the
    rest are streamed from the tensors as before.

    Args:
        qstate: the encoded state. Its skeleton, params, rules and metadata must be
            JSON-serializable; buffer names must match ``[A-Za-z0-9_.-]+``.
        path: destination file.
        fsync: fsync the file and its directory (turn off only for throwaway files).
        entropy: ``"auto"`` (the default policy of :mod:`tw_triton.codecs.entropy`),
            ``None`` or ``"none"`` (every buffer raw, as format version 1 stored them), or
            an :class:`~tw_triton.codecs.entropy.EntropyPolicy`.

    Returns:
        The number of bytes in the file.

    Raises:
        CheckpointError: ``qstate`` cannot be represented (bad names, dtypes, non-JSON
            fields, a header over 100 MB).
        CheckpointIOError: the operating system failed (``errno`` kept; the original
            ``OSError`` is chained).
    """
    path = os.fspath(path)
    _require_little_endian(path)
    try:
        policy = resolve_policy(entropy)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
    plan = _plan(qstate, path, policy)
    tmp = temp_path_for(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            # The checksums were taken while planning, so the header is final: one pass.
            header = _encode_header(plan, path)
            f.write(header)
            _write_buffers(f, plan, len(header), writeback=fsync)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
            size = f.seek(0, os.SEEK_END)
        os.replace(tmp, path)
    except BaseException as exc:
        remove_quietly(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise _io_error(exc, f"cannot write checkpoint {path}") from exc
        raise
    if fsync:
        try:
            _fsync_directory(os.path.dirname(os.path.abspath(path)))
        except OSError as exc:
            raise _io_error(
                exc, f"checkpoint {path} was written but its directory could not be fsynced"
            ) from exc
    return size


class HeaderCache:
    """Validated headers of checkpoint files, kept while each file stays the same.

    Loading a checkpoint reads headers more than once: a directory listing reads every
    file's manifest (ids, kinds), then the reads of a chain read those of its files again.
    Parsing and validating a header costs ~6 ms on the MiniLM + AdamW state (408 entries, a
    250 KB header); :func:`read_manifest`, :func:`read_file` and :func:`verify_file` given a
    cache parse each file once. A file is the same while its device, inode, size and
    modification time (ns) are: a rewrite or a rename over it is a new file, and a cached
    header is only used for the file descriptor it was checked against.

    The manifests are shared by everything read through the cache: treat them as read-only.
    Thread-safe.
    """

    def __init__(self) -> None:
        self._layouts: dict[str, tuple[tuple[int, int, int, int], _Layout]] = {}
        self._lock = threading.Lock()

    def layout(self, f: BinaryIO, path: str) -> _Layout:
        """The validated header of the open file ``f`` (at ``path``), parsed at most once."""
        try:
            st = os.fstat(f.fileno())
        except OSError as exc:
            raise _io_error(exc, f"cannot stat checkpoint {path}") from exc
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._layouts.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        layout = _read_layout(f, path)
        with self._lock:
            self._layouts[path] = (key, layout)
        return layout

    def retain(self, paths: Iterable[str]) -> None:
        """Forget the headers of every file but ``paths`` (say, those still listed)."""
        keep = set(paths)
        with self._lock:
            for path in [p for p in self._layouts if p not in keep]:
                del self._layouts[path]

    def __len__(self) -> int:
        with self._lock:
            return len(self._layouts)


def _layout_of(f: BinaryIO, path: str, headers: HeaderCache | None) -> _Layout:
    return _read_layout(f, path) if headers is None else headers.layout(f, path)


def read_manifest(path: str | os.PathLike, *, headers: HeaderCache | None = None) -> dict[str, Any]:
    """Read and validate only the header of a checkpoint and return its manifest.

    Cheap: it reads the header, not the data. Everything in the header is validated (the
    manifest's checksum, its schema and version, the tensor table and its agreement with
    the manifest), so a file that passes here can only fail later on truncated or
    corrupted data. With ``headers``, a header parsed before for the same file is reused
    (and the manifest is that cache's: read-only).

    Returns:
        The manifest as a dict of JSON values (see the module docstring): ``checkpoint_id``,
        ``reference_id``, ``entries``, ``metadata``, ``stats``, ...

    Raises:
        CheckpointError: the header is malformed; CheckpointIOError if it cannot be read.
    """
    path = os.fspath(path)
    with _open_for_reading(path) as f:
        return _layout_of(f, path, headers).manifest


def read_file(
    path: str | os.PathLike,
    *,
    verify: bool = True,
    pin_memory: bool = False,
    entries: Iterable[str] | None = None,
    headers: HeaderCache | None = None,
    check_others: bool = False,
    into: Mapping[str, torch.Tensor] | None = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> QuantizedState:
    """Read a checkpoint into a :class:`QuantizedState` whose buffers are CPU tensors.

    The header is validated completely before anything is allocated; then each buffer is
    read into a freshly allocated tensor of its dtype and shape, on several threads
    (:mod:`tw_triton.parallel`): a raw one with positional reads straight into the tensor, a
    staged one decoded into it from a memory map of the file (see :class:`_MappedCheckpoint`).

    Args:
        path: the checkpoint file.
        verify: check each buffer's CRC-32 while reading (a corrupted buffer raises). The
            manifest's checksum is checked either way.
        pin_memory: allocate the buffers in page-locked memory for a fast non-blocking copy
            to the GPU. Needs CUDA; without it the buffers are ordinary memory (logged).
        entries: read only these entries (paths, or aliases of them); the others are left
            out of the result, which then cannot be unflattened, only decoded entry by
            entry (what a link of a delta chain needs). ``None``: every entry.
        headers: reuse the header this cache parsed for the same file (see
            :class:`HeaderCache`).
        check_others: with ``entries`` and ``verify``, check the stored bytes of every
            other buffer against its CRC-32 too, without decoding or keeping them: the
            whole file is then known intact at a fraction of the cost of reading it all
            (what choosing the latest good checkpoint needs of a delta's keyframe).
        into: tensors to read exact entries into, by entry path (say, a live model's
            ``state_dict()``, so that a restore decodes into the parameters and needs no
            second copy of them). An exact entry is read into its tensor when that is a
            contiguous CPU tensor of the entry's dtype and shape and without
            ``pin_memory``; the entry's buffer is then that tensor, and any other entry
            gets a new tensor. A read that fails may have written part of these tensors.
            Tensors that share memory must not both be given
            (:func:`tw_triton.state.disjoint_paths` picks those that do not).
        max_expansion: refuse a file whose staged (compressed) buffers decode to more than
            ``max_expansion`` times the file's size plus :data:`EXPANSION_SLACK_BYTES`,
            checked from the header before anything is decoded (a decompression bomb).
            The default, :data:`MAX_EXPANSION`, is far above what real checkpoints
            reach; pass a larger value, or ``None`` for no bound, to load a file that
            stores large constant tensors on purpose.

    Returns:
        The state as written: entries in their original order with codec, params, shape,
        dtype and buffers, plus skeleton, ids, aliases, rules and metadata.

    Raises:
        CheckpointError: malformed, truncated or corrupted file, naming the entry, or an
            entry asked for that the file does not hold;
        CheckpointIOError: the operating system failed.
    """
    path = os.fspath(path)
    pin = pin_memory and _can_pin(path)
    with _MappedCheckpoint(
        path, verify=verify, pin=pin, entries=entries, headers=headers, into=into, max_expansion=max_expansion,
    ) as ck:
        specs = [s for s in ck.layout.buffers if ck.wanted is None or s.entry in ck.wanted]
        others = [] if not (check_others and verify) or ck.wanted is None else [
            s for s in ck.layout.buffers if s.entry not in ck.wanted
        ]
        # One pool of work: a CRC check (~6 GB/s) is a cheap piece beside the reads.
        work = [(ck.read_buffer, s) for s in specs] + [(ck.check_crc, s) for s in others]
        tensors = parallel_map(
            lambda item: item[0](item[1]), work, sizes=[s.raw_nbytes or s.nbytes for _, s in work],
            threads=None if _POSITIONAL_READS else 1,
        )[: len(specs)]
    return _to_qstate(ck.layout.manifest, {(s.entry, s.name): t for s, t in zip(specs, tensors)}, only=ck.wanted)


class _MappedCheckpoint:
    """A checkpoint file held open for reading its buffers (a context manager: the file and
    its map close on exit), its header validated.

    Buffers with an entropy stage are decoded from a read-only memory map of the file:
    the checksum and zstd read the page cache directly, where a read would first zero
    fresh memory and copy into it (on the MiniLM keyframe: 0.014 instead of 0.05
    CPU-seconds for reading and checking 81 MiB). Each buffer's pages leave the process
    once it is decoded (:func:`_unmap_pages`), so the resident size never holds the whole
    file next to the decoded state. As with any memory-mapped load, a file truncated by
    another process *while* it is read can end the process with SIGBUS; the Checkpointer
    never rewrites a file in place (it writes a new one and renames it). Where the file
    system cannot map the file, staged buffers are read into memory instead (same bytes).
    Raw buffers are read with positional reads straight into their tensors, so threads may
    read one file at once.
    """

    def __init__(
        self, path: str, *, verify: bool, pin: bool, entries: Iterable[str] | None,
        headers: HeaderCache | None = None, into: Mapping[str, torch.Tensor] | None = None,
        max_expansion: float | None = MAX_EXPANSION,
    ) -> None:
        self.path = path
        self._max_expansion = max_expansion
        self._headers = headers
        self.verify = verify
        self.pin = pin
        self._entries = entries
        self._into = into or {}
        self._opener = _open_for_reading(path)
        self.wanted: set[str] | None = None
        self._map: mmap.mmap | None = None

    def __enter__(self) -> _MappedCheckpoint:
        self.file = self._opener.__enter__()
        try:
            self.layout = _layout_of(self.file, self.path, self._headers)
            _check_expansion(self.layout, self.path, self._max_expansion)
            if self._entries is not None:
                aliases = self.layout.manifest["aliases"]
                self.wanted = {aliases.get(p, p) for p in self._entries}
                missing = sorted(self.wanted - set(self.layout.manifest["entries"]))
                if missing:
                    raise CheckpointError(f"checkpoint {self.path}: has no entry {missing[0]!r}")
            if any(spec.stage is not None for spec in self.layout.buffers):
                # The layout was validated against the file's size: every buffer is inside.
                try:
                    self._map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as exc:
                    # A file system that cannot map files: the same bytes, read instead.
                    logger.debug("checkpoint %s: cannot memory-map it (%s); reading it", self.path, exc)
        except BaseException as exc:
            self._opener.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self._map is not None:
                try:
                    self._map.close()
                except BufferError:
                    # A view of the map is still held (by a traceback's frame, when an
                    # error propagates): the map closes when it is collected.
                    pass
        finally:
            self._opener.__exit__(exc_type, exc, tb)

    def read_buffer(self, spec: _BufferSpec) -> torch.Tensor:
        """Read one buffer into a new tensor, or into its destination (see :func:`read_file`'s
        ``into``): straight in, or through its stage; thread-safe."""
        out = self._destination(spec)
        if spec.stage is not None:
            tensor = _decode_staged(self.stored(spec), spec, self.path, verify=self.verify, pin=self.pin, out=out)
            self.done_with(spec)
            return tensor
        return _read_raw(self.file, spec, self.layout.data_start + spec.begin, self.path, verify=self.verify,
                         pin=self.pin, out=out)

    def _destination(self, spec: _BufferSpec) -> torch.Tensor | None:
        """The tensor given for this buffer's entry, if it can take the buffer as it is."""
        dest = self._into.get(spec.entry)
        if dest is None or self.pin or spec.name != "data":
            return None
        if self.layout.manifest["entries"][spec.entry]["codec"] != "exact":
            return None
        # The same shape, not only the same size: a tensor that load_state_dict would refuse
        # (a model changed since the save) must not be overwritten on the way.
        if (dest.device.type != "cpu" or dest.dtype != spec.dtype or not dest.is_contiguous()
                or tuple(dest.shape) != tuple(spec.shape) or dest.layout != torch.strided):
            return None
        return dest

    def check_crc(self, spec: _BufferSpec) -> None:
        """Check a buffer's stored bytes against its CRC-32, keeping nothing: from the map
        for a staged buffer, through a chunk-sized scratch for a raw one; thread-safe.

        Raises:
            CheckpointError: the checksum differs, or the file ends early.
        """
        if spec.stage is not None:
            _check_crc(self.path, spec, zlib.crc32(self.stored(spec)))
            self.done_with(spec)
            return
        offset = self.layout.data_start + spec.begin
        scratch = memoryview(bytearray(min(IO_CHUNK_BYTES, max(spec.nbytes, 1))))
        crc = 0
        done = 0
        while done < spec.nbytes:
            n = min(spec.nbytes - done, len(scratch))
            _read_exact_into(self.file, scratch[:n], offset + done, self.path, spec)
            crc = zlib.crc32(scratch[:n], crc)
            done += n
        _check_crc(self.path, spec, crc)

    def stored(self, spec: _BufferSpec) -> memoryview:
        """A buffer's stored bytes: a view of the map, or a copy read from the file where it
        cannot be mapped. Not released explicitly: a decoder's error may still hold it."""
        offset = self.layout.data_start + spec.begin
        if self._map is None:
            view = memoryview(bytearray(spec.nbytes))
            _read_exact_into(self.file, view, offset, self.path, spec)
            return view
        return memoryview(self._map)[offset : offset + spec.nbytes]

    def done_with(self, spec: _BufferSpec) -> None:
        """The buffer's stored bytes are not needed any more: its pages leave the process."""
        if self._map is not None:
            _unmap_pages(self._map, self.layout.data_start + spec.begin, spec.nbytes)


def _check_expansion(layout: _Layout, path: str, max_expansion: float | None) -> None:
    """Refuse a file whose staged buffers decode to more than ``max_expansion`` times its
    size plus :data:`EXPANSION_SLACK_BYTES` (from the header: nothing is decoded yet)."""
    if max_expansion is None:
        return
    decoded = sum(spec.raw_nbytes for spec in layout.buffers if spec.stage is not None)
    size = layout.data_start + layout.data_size
    limit = max_expansion * size + EXPANSION_SLACK_BYTES
    if decoded > limit:
        raise CheckpointError(
            f"checkpoint {path}: its compressed buffers decode to {decoded} bytes, more than "
            f"{max_expansion:g} times its {size} bytes plus {EXPANSION_SLACK_BYTES} "
            f"({int(limit)} bytes): refused before decoding (a decompression bomb?); to load a "
            "file that stores large constant tensors on purpose, pass a larger max_expansion "
            "(or None)"
        )


def verify_file(
    path: str | os.PathLike, *, headers: HeaderCache | None = None, max_expansion: float | None = MAX_EXPANSION,
) -> None:
    """Validate a checkpoint completely and check every buffer's CRC-32 (``headers``: see
    :class:`HeaderCache`; ``max_expansion``: the bound on what staged buffers decode to, as
    for :func:`read_file`, so that a file a load would refuse does not verify).

    Streams each raw buffer through a chunk-sized scratch, so memory stays small whatever
    the file size. A staged buffer is checked from the file's memory map (as a load reads
    it): its frame is checked and decoded in chunks that are thrown away, so the decoded
    content is checked too. Buffers are checked on several threads (:mod:`tw_triton.parallel`).

    Raises:
        CheckpointError: naming the file, the entry and the buffer that failed.
    """
    path = os.fspath(path)
    with _MappedCheckpoint(
        path, verify=True, pin=False, entries=None, headers=headers, max_expansion=max_expansion,
    ) as ck:

        def verify_one(spec: _BufferSpec) -> None:
            if spec.stage is None:
                ck.check_crc(spec)
                return
            stored = ck.stored(spec)
            _check_crc(path, spec, zlib.crc32(stored))
            spec.stage.verify(stored, spec.stage_params, spec.raw_nbytes, _where(path, spec))
            ck.done_with(spec)

        parallel_map(verify_one, ck.layout.buffers, sizes=[s.raw_nbytes or s.nbytes for s in ck.layout.buffers],
                     threads=None if _POSITIONAL_READS else 1)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------


# The tensor's byte view is made when it is written, not kept: a plan lives until its file
# is written, long enough for Python's collector to promote what it holds, and a view costs
# two tracked objects and a tensor (on the MiniLM delta 1,396 of the 6,240 objects alive
# during a write); fewer put the next full collection further off (benchmarks/gc_pauses.py).
@dataclass(frozen=True)
class _PlannedBuffer:
    entry: str
    name: str
    key: str
    tensor: torch.Tensor  # CPU, contiguous: the buffer as the codec made it
    st_dtype: str  # the safetensors name of the tensor's dtype
    begin: int
    end: int
    staged: Any  # the stage's output (bytes-like), None when the tensor's bytes are stored
    stage: dict[str, Any] | None  # the manifest record of the stage, None when raw
    crc32: int  # of the stored bytes

    @property
    def data(self) -> memoryview:
        """The bytes stored in the file: the tensor's, or its stage's output."""
        return _byte_view(self.tensor) if self.staged is None else memoryview(self.staged)

    @property
    def table_dtype(self) -> str:
        """The dtype in the safetensors tensor table: U8 bytes for a staged buffer."""
        return _STAGED_DTYPE if self.stage is not None else self.st_dtype

    @property
    def table_shape(self) -> list[int]:
        return [self.end - self.begin] if self.stage is not None else list(self.tensor.shape)


@dataclass(frozen=True)
class _Plan:
    qstate: QuantizedState
    buffers: list[_PlannedBuffer]  # in file order
    by_entry: dict[str, dict[str, _PlannedBuffer]]  # entry path -> buffer name -> plan
    data_size: int


def _plan(qstate: QuantizedState, path: str, policy: EntropyPolicy | None) -> _Plan:
    """Check what can be checked before touching the disk, run the entropy stage, and lay
    the buffers out."""
    if not isinstance(qstate, QuantizedState):
        raise CheckpointError(
            f"checkpoint {path}: expected a QuantizedState, got {type(qstate).__name__}"
        )
    if not isinstance(qstate.entries, dict):
        raise CheckpointError(f"checkpoint {path}: entries must be a dict")
    if not isinstance(qstate.checkpoint_id, str):
        raise CheckpointError(f"checkpoint {path}: checkpoint_id must be a str")
    if qstate.reference_id is not None and not isinstance(qstate.reference_id, str):
        raise CheckpointError(f"checkpoint {path}: reference_id must be a str or None")
    pending: list[tuple[str, str, torch.Tensor, str]] = []
    for entry_path, entry in qstate.entries.items():
        where = f"checkpoint {path}: entry {entry_path!r}"
        if not isinstance(entry_path, str):
            raise CheckpointError(f"{where}: entry paths must be str")
        try:
            entry_path.encode("utf-8")
        except UnicodeEncodeError as exc:
            # Tensor keys hold the path, and safetensors headers must be valid UTF-8.
            raise CheckpointError(f"{where}: entry path is not valid UTF-8 ({exc.reason})") from exc
        if not isinstance(entry, EncodedEntry):
            raise CheckpointError(f"{where}: expected an EncodedEntry, got {type(entry).__name__}")
        if not isinstance(entry.codec, str) or not entry.codec:
            raise CheckpointError(f"{where}: codec must be a non-empty str")
        if not isinstance(entry.params, dict):
            raise CheckpointError(f"{where}: params must be a dict")
        if entry.dtype not in _ENTRY_DTYPE_NAMES:
            raise CheckpointError(f"{where}: dtype {entry.dtype} cannot be recorded")
        _check_shape(tuple(entry.shape), entry.dtype.itemsize, where)
        if not isinstance(entry.buffers, dict):
            raise CheckpointError(f"{where}: buffers must be a dict")
        for name, tensor in entry.buffers.items():
            bwhere = f"{where} buffer {name!r}"
            if not isinstance(name, str) or not BUFFER_NAME_RE.fullmatch(name):
                raise CheckpointError(f"{bwhere}: buffer names must match [A-Za-z0-9_.-]+")
            if not isinstance(tensor, torch.Tensor):
                raise CheckpointError(f"{bwhere}: expected a tensor, got {type(tensor).__name__}")
            if tensor.layout != torch.strided:
                raise CheckpointError(f"{bwhere}: only dense tensors can be stored")
            if tensor.dtype not in _BUFFER_DTYPE_NAMES:
                raise CheckpointError(f"{bwhere}: dtype {tensor.dtype} has no safetensors name")
            st_dtype = _BUFFER_DTYPE_NAMES[tensor.dtype]
            pending.append((entry_path, name, _host_contiguous(tensor), st_dtype))
        _check_json_keys(entry.params, f"{where} params")
    for field_name in ("skeleton", "rules", "metadata"):
        _check_json_keys(getattr(qstate, field_name), f"checkpoint {path}: {field_name}")
    if not isinstance(qstate.aliases, dict):
        raise CheckpointError(f"checkpoint {path}: aliases must be a dict")
    for alias, target in qstate.aliases.items():
        if not isinstance(alias, str) or not isinstance(target, str):
            raise CheckpointError(f"checkpoint {path}: aliases must map str to str")
        if target not in qstate.entries:
            raise CheckpointError(
                f"checkpoint {path}: alias {alias!r} points to {target!r}, which is not an entry"
            )
        if alias in qstate.entries:
            raise CheckpointError(f"checkpoint {path}: alias {alias!r} is also an entry")

    def stage(item: tuple[str, str, torch.Tensor, str]) -> tuple[Any, dict[str, Any] | None, int, int]:
        """(stage output or None, its record or None, CRC-32 and size of the stored bytes)"""
        entry_path, name, tensor, _ = item
        view = _byte_view(tensor)
        staged = None
        if policy is not None:
            try:
                staged = encode_buffer(tensor, view, policy)
            except Exception as exc:
                # zstd's own errors (out of memory, a bad level) name no checkpoint.
                raise CheckpointError(
                    f"checkpoint {path}: entry {entry_path!r} buffer {name!r}: entropy stage "
                    f"failed: {type(exc).__name__}: {exc}"
                ) from exc
        if staged is None:
            return None, None, zlib.crc32(view), len(view)
        return staged.data, staged.record, zlib.crc32(staged.data), len(staged.data)

    # Buffers are staged and checksummed independently, so on several threads (zstd and
    # zlib.crc32 release the GIL).
    stored = parallel_map(
        stage, pending, sizes=[t.numel() * t.element_size() for _, _, t, _ in pending],
    )

    # Decreasing element size keeps every buffer aligned to its element size (staged
    # buffers are bytes); the sort is stable, so within one size the file follows the
    # entry order.
    def stored_itemsize(i: int) -> int:
        return 1 if stored[i][1] is not None else pending[i][2].element_size()

    order = sorted(range(len(pending)), key=lambda i: -stored_itemsize(i))
    buffers: list[_PlannedBuffer] = []
    by_entry: dict[str, dict[str, _PlannedBuffer]] = {p: {} for p in qstate.entries}
    offset = 0
    for i in order:
        entry_path, name, tensor, st_dtype = pending[i]
        staged, stage, crc, nbytes = stored[i]
        key = tensor_key(entry_path, name)
        buffers.append(
            _PlannedBuffer(entry_path, name, key, tensor, st_dtype, offset, offset + nbytes, staged, stage, crc)
        )
        offset += nbytes
    # by_entry keeps each entry's own buffer order for the manifest.
    lookup = {(b.entry, b.name): b for b in buffers}
    for entry_path, name, _, _ in pending:
        by_entry[entry_path][name] = lookup[(entry_path, name)]
    return _Plan(qstate, buffers, by_entry, offset)


def _check_json_keys(value: Any, where: str) -> None:
    """Refuse dict keys that are not str: JSON would silently turn ``1`` into ``"1"``
    (and ``{1: a, "1": b}`` into a duplicate key that no reader accepts)."""
    stack = [value]
    seen: set[int] = set()  # a cycle must not loop here; json.dumps reports it below
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
        if isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str):
                    raise CheckpointError(
                        f"{where}: dict key {k!r} is a {type(k).__name__}, expected str "
                        "(JSON keys are strings)"
                    )
                stack.append(v)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def _host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous()


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def _ints(values: Iterable[int]) -> str:
    """A JSON array of ints, as :func:`_json` writes it."""
    return "[" + ",".join(str(int(v)) for v in values) + "]"


def _checked_json(value: Any, what: str, path: str) -> str:
    """:func:`_json` of one part of the manifest; a failure names that part."""
    try:
        return _json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {path}: {what} is not JSON-serializable: {exc}") from exc


# Param values that equal each other only when json.dumps writes them alike (not floats:
# -0.0 == 0.0; not containers: (1,) == (True,)).
_MEMO_TYPES = frozenset({str, int, bool, type(None)})


def _params_json(params: dict[str, Any], memo: dict[Any, str], what: str, path: str) -> str:
    """:func:`_checked_json` of an entry's params, once per distinct params dict of str keys
    and plain scalar values (most entries of a state share a handful, and most have none)."""
    if type(params) is not dict or not all(
        type(k) is str and type(v) in _MEMO_TYPES for k, v in params.items()
    ):
        return _checked_json(params, what, path)
    key = tuple((k, type(v), v) for k, v in params.items())
    text = memo.get(key)
    if text is None:
        text = memo[key] = _checked_json(params, what, path)
    return text


# The header is written as JSON text piece by piece, the same bytes as json.dumps of the
# nested dicts would give (tests/test_format.py checks it): a dict and two lists per buffer
# and per entry, built all at once, would be a few thousand objects alive together while the
# writer thread runs, which Python's collector then promotes towards a full collection
# (benchmarks/gc_pauses.py). Strings are not tracked by the collector.
def _manifest_json(plan: _Plan, path: str) -> str:
    """The manifest's JSON text (see the module docstring for its fields)."""
    q = plan.qstate
    parts = [
        '{"format":', _json(FORMAT_NAME), ',"version":', _json(FORMAT_VERSION),
        ',"checkpoint_id":', _json(q.checkpoint_id), ',"reference_id":', _json(q.reference_id),
        ',"checksum":', _json(CHECKSUM_NAME), ',"entries":{',
    ]
    memo: dict[Any, str] = {}
    # _plan checked that entry paths, codecs and buffer names are str; keys and dtype
    # names are made here.
    for i, (entry_path, entry) in enumerate(q.entries.items()):
        params = _params_json(entry.params, memo, f"entry {entry_path!r} params", path)
        parts.append(
            f'{"," if i else ""}{_quote(entry_path)}:{{"codec":{_quote(entry.codec)},"params":{params},'
            f'"dtype":{_quote(_ENTRY_DTYPE_NAMES[entry.dtype])},"shape":{_ints(entry.shape)},"buffers":{{'
        )
        for j, (name, b) in enumerate(plan.by_entry[entry_path].items()):
            stage = "" if b.stage is None else ',"stage":' + _json(b.stage)
            parts.append(
                f'{"," if j else ""}{_quote(name)}:{{"key":{_quote(b.key)},"dtype":{_quote(b.st_dtype)},'
                f'"shape":{_ints(b.tensor.shape)},"data_offsets":[{b.begin},{b.end}],'
                f'"crc32":"{b.crc32:08x}"{stage}}}'
            )
        parts.append("}}")
    stats = {
        "raw_bytes": sum(e.raw_nbytes for e in q.entries.values()),
        "stored_bytes": plan.data_size,
        "entries": len(q.entries),
        "buffers": len(plan.buffers),
    }
    parts += [
        '},"aliases":', _json(dict(q.aliases)),
        ',"skeleton":', _checked_json(q.skeleton, "skeleton", path),
        ',"rules":', _checked_json(q.rules, "rules", path),
        ',"metadata":', _checked_json(q.metadata, "metadata", path),
        ',"stats":', _json(stats), "}",
    ]
    return "".join(parts)


def _encode_header(plan: _Plan, path: str) -> bytes:
    """The length prefix and the padded JSON header (written as text: see _manifest_json)."""
    manifest = _manifest_json(plan, path)
    metadata = {MANIFEST_KEY: manifest, MANIFEST_CRC_KEY: f"{zlib.crc32(manifest.encode('utf-8')):08x}"}
    parts = ['{"__metadata__":', _json(metadata)]
    for b in plan.buffers:
        parts.append(
            f',{_quote(b.key)}:{{"dtype":{_quote(b.table_dtype)},"shape":{_ints(b.table_shape)},'
            f'"data_offsets":[{b.begin},{b.end}]}}'
        )
    parts.append("}")
    raw = "".join(parts).encode("ascii")
    raw += b" " * (-(8 + len(raw)) % 8)
    if len(raw) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint {path}: header is {len(raw)} bytes, above the {MAX_HEADER_BYTES}-byte "
            "limit of safetensors (a very large skeleton or metadata?)"
        )
    return struct.pack("<Q", len(raw)) + raw


def _write_buffers(f: BinaryIO, plan: _Plan, offset: int, *, writeback: bool) -> None:
    """Write the buffers in file order, the first at ``offset``. With ``writeback``, the
    kernel is asked to start putting each ``IO_CHUNK_BYTES`` on the disk as soon as it is
    written (:mod:`tw_triton.writeback`), so the fsync after waits for less."""
    # File writes release the GIL on large chunks, so a training thread keeps running
    # while the writer thread works.
    writeback = writeback and can_start_writeback()
    unsynced = offset  # where the bytes not yet handed to writeback begin
    for b in plan.buffers:
        view = b.data
        for start in range(0, len(view), IO_CHUNK_BYTES):
            chunk = view[start : start + IO_CHUNK_BYTES]
            f.write(chunk)
            offset += len(chunk)
            if writeback and offset - unsynced >= IO_CHUNK_BYTES:
                f.flush()  # small buffers wait in the file object's buffer otherwise
                start_writeback(f.fileno(), unsynced, offset - unsynced)
                unsynced = offset


def _fsync_directory(directory: str) -> None:
    if os.name == "nt":  # Windows cannot open a directory; its renames are journaled.
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(path: str) -> None:
    """Delete ``path``: a file already gone is fine, another failure is logged, not raised
    (a failed write's own error matters more; a retired checkpoint has no caller to raise
    to)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not delete %s: %s", path, exc)


def _require_little_endian(path: str) -> None:
    if sys.byteorder != "little":
        raise CheckpointError(
            f"checkpoint {path}: the format is little-endian and this machine is big-endian"
        )


# --------------------------------------------------------------------------------------
# Reading and validation
# --------------------------------------------------------------------------------------
class _open_for_reading:
    """``open(path, "rb", buffering=0)`` whose OS errors become CheckpointIOError."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        _require_little_endian(self.path)
        try:
            self.file = open(self.path, "rb", buffering=0)
        except OSError as exc:
            raise _io_error(exc, f"cannot open checkpoint {self.path}") from exc
        return self.file

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self.file is not None
        self.file.close()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise _io_error(exc, f"cannot read checkpoint {self.path}") from exc


def _read_exact_into(f: BinaryIO, view: memoryview, offset: int, path: str, spec: _BufferSpec) -> None:
    """Fill ``view`` from byte ``offset`` of ``f``: a positional read where the OS has one
    (threads may read one file at once), else seek and read."""
    got = 0
    n = len(view)
    while got < n:
        if _POSITIONAL_READS:
            k = os.preadv(f.fileno(), [view[got:]], offset + got)
        else:
            f.seek(offset + got)
            k = f.readinto(view[got:])
        if not k:
            raise CheckpointError(
                f"checkpoint {path}: entry {spec.entry!r} buffer {spec.name!r}: file ended "
                f"before the buffer's {spec.nbytes} bytes (truncated or modified while read)"
            )
        got += k


def _can_pin(path: str) -> bool:
    if torch.cuda.is_available():
        return True
    logger.warning("read_file(%s, pin_memory=True): no CUDA, so buffers are not pinned", path)
    return False


def _unmap_pages(mapped: mmap.mmap, offset: int, nbytes: int) -> None:
    """Drop the pages of ``mapped`` that cover these bytes from the process (they stay in the
    page cache): a mapped page counts in the resident size, and a load would otherwise hold
    the whole file resident next to the state it decodes. Another thread still reading a
    page it shares at an end faults it back in: the mapping is read-only and file-backed."""
    if nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = offset - offset % mmap.PAGESIZE
    mapped.madvise(mmap.MADV_DONTNEED, start, min(offset + nbytes, len(mapped)) - start)


def _read_raw(
    f: BinaryIO, spec: _BufferSpec, offset: int, path: str, *, verify: bool, pin: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Read a raw buffer straight into a new tensor (or ``out``), checking its CRC as it goes."""
    # Bounded: validation proved that all buffers together fit in the file.
    tensor = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=pin) if out is None else out
    view = _byte_view(tensor)
    crc = 0
    for start in range(0, len(view), IO_CHUNK_BYTES):
        chunk = view[start : start + IO_CHUNK_BYTES]
        _read_exact_into(f, chunk, offset + start, path, spec)
        if verify:
            crc = zlib.crc32(chunk, crc)
    if verify:
        _check_crc(path, spec, crc)
    return tensor


def _decode_staged(
    stored: memoryview, spec: _BufferSpec, path: str, *, verify: bool, pin: bool, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Check a staged buffer's stored bytes and decode them into a new tensor (or ``out``).

    The stage checks its frame against the raw size before the tensor is allocated, so a
    manifest that promises more than the stored bytes can make allocates nothing. With
    ``verify`` the CRC-32 of the stored bytes is checked first, whatever checksum the stage
    carries itself, so that a read accepts exactly the bytes :func:`verify_file` accepts,
    and corruption stops before the decoder runs.
    """
    assert spec.stage is not None and spec.stage_params is not None
    where = _where(path, spec)
    if verify:
        _check_crc(path, spec, zlib.crc32(stored))
    spec.stage.check(stored, spec.stage_params, spec.raw_nbytes, where)
    tensor = torch.empty(spec.shape, dtype=spec.dtype, pin_memory=pin) if out is None else out
    spec.stage.decode(stored, spec.stage_params, _byte_view(tensor), where)
    return tensor


def _check_crc(path: str, spec: _BufferSpec, crc: int) -> None:
    if crc != spec.crc32:
        raise CheckpointError(
            f"checkpoint {path}: entry {spec.entry!r} buffer {spec.name!r}: checksum mismatch "
            f"(expected crc32 {spec.crc32:08x}, computed {crc:08x}): the data is corrupted"
        )


def _to_qstate(
    manifest: dict[str, Any], tensors: dict[tuple[str, str], torch.Tensor], only: set[str] | None = None
) -> QuantizedState:
    entries: dict[str, EncodedEntry] = {}
    for entry_path, entry in manifest["entries"].items():
        if only is not None and entry_path not in only:
            continue
        entries[entry_path] = EncodedEntry(
            codec=entry["codec"],
            params=dict(entry["params"]),  # the manifest may be a HeaderCache's: not shared
            shape=tuple(entry["shape"]),
            dtype=ENTRY_DTYPES[entry["dtype"]],
            buffers={name: tensors[(entry_path, name)] for name in entry["buffers"]},
        )
    return QuantizedState(
        entries=entries,
        skeleton=manifest["skeleton"],
        checkpoint_id=manifest["checkpoint_id"],
        reference_id=manifest["reference_id"],
        aliases={a: t for a, t in manifest["aliases"].items() if only is None or t in only},
        rules=manifest["rules"],
        metadata=dict(manifest["metadata"]),
    )
