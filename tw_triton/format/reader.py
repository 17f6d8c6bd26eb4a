"""Reading checkpoint files: :func:`read_manifest`, :func:`read_file`, :func:`verify_file`.

The header is validated completely (:mod:`tw_triton.format.header`) before anything is
allocated. Every allocation of a raw buffer is bounded by the file size; staged buffers
together may decode to at most :data:`MAX_EXPANSION` times the file's size plus
:data:`EXPANSION_SLACK_BYTES` (checked from the header: the decompression-bomb bound). A
read with ``verify`` checks every buffer's CRC-32 over its stored bytes, as
:func:`verify_file` does, so that the two give one answer. Malformed files raise
:class:`~tw_triton.errors.CheckpointError`, failures of the operating system
:class:`~tw_triton.errors.CheckpointIOError`. Why: docs/format.md.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..parallel import parallel_map
from ..pinned_memory import PinnedRing
from ..qstate import QuantizedState
from .buffer_io import (
    POSITIONAL_READS,
    can_pin,
    check_crc,
    decode_staged,
    read_exact_into,
    read_raw,
    unmap_pages,
    upload_raw,
    upload_staged,
)
from .checksum import crc32
from .files import IO_CHUNK_BYTES, open_for_reading
from .header import HeaderCache, Layout, layout_of
from .manifest import BufferSpec, to_qstate
from .upload_ring import ring_for_read

logger = logging.getLogger(__name__)

# The bound on what a file's staged buffers may decode to, before anything is decoded:
# MAX_EXPANSION times the file's size plus EXPANSION_SLACK_BYTES. zstd alone would let a
# file of a few hundred KB declare gigabytes of zeros; real checkpoints decode to a few
# times their size at most (tests/format/test_untrusted_files.py keeps them under a quarter of the
# bound). The slack leaves room for legitimately constant tensors (a mask, a
# zero-initialised adapter) in a small file.
MAX_EXPANSION = 32.0
EXPANSION_SLACK_BYTES = 64 << 20


def check_max_expansion(max_expansion: Any) -> None:
    """Refuse a ``max_expansion`` that is not a bound: NaN would compare false with every
    size (no bound at all), a negative one refuses every file.

    Raises:
        CheckpointError: not ``None`` or a number at least 0 (``math.inf`` is ``None``).
    """
    if max_expansion is None:
        return
    number = isinstance(max_expansion, (int, float)) and not isinstance(max_expansion, bool)
    if not number or not max_expansion >= 0:
        raise CheckpointError(f"max_expansion must be None or a number at least 0, got {max_expansion!r}")


def check_expansion(layout: Layout, path: str, max_expansion: float | None) -> None:
    """Refuse a file whose staged buffers decode to more than ``max_expansion`` times its
    size plus :data:`EXPANSION_SLACK_BYTES` (from the header: nothing is decoded yet;
    ``None``: no bound).

    Raises:
        CheckpointError: over the bound, saying how to lift it.
    """
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


def read_manifest(path: str | os.PathLike, *, headers: HeaderCache | None = None) -> dict[str, Any]:
    """Read and validate only the header of a checkpoint and return its manifest.

    Cheap: it reads the header, not the data. Everything in the header is validated, so a
    file that passes here can only fail later on truncated or corrupted data.

    Args:
        path: the checkpoint file.
        headers: reuse a header this cache parsed before for the same file (the manifest
            is then that cache's: read-only).

    Returns:
        The manifest as a dict of JSON values (see :mod:`tw_triton.format.spec`):
        ``checkpoint_id``, ``reference_id``, ``entries``, ``metadata``, ``stats``, ...

    Raises:
        CheckpointError: the header is malformed; CheckpointIOError if it cannot be read.
    """
    path = os.fspath(path)
    with open_for_reading(path) as f:
        return layout_of(f, path, headers).manifest


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
    device: torch.device | str | None = None,
) -> QuantizedState:
    """Read a checkpoint into a :class:`QuantizedState` whose buffers are CPU tensors
    (or tensors on ``device``).

    The header is validated completely before anything is allocated; then each buffer is
    read into a freshly allocated tensor of its dtype and shape, on several threads
    (:mod:`tw_triton.parallel`): a raw one with positional reads straight into the tensor, a
    staged one decoded into it from a memory map of the file (see :class:`MappedCheckpoint`).

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
            :class:`~tw_triton.format.HeaderCache`).
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
        device: a device to read the buffers to (CUDA): each one goes there chunk by
            chunk through a bounded ring of pinned host memory
            (:class:`~tw_triton.pinned_memory.PinnedRing`; a compressed buffer is decoded
            into its slots piece by piece), instead of the whole file being pinned: the
            ring of the enclosing :func:`~tw_triton.format.one_ring` block, or one made
            for this read (sizes: :mod:`tw_triton.format.upload_ring`). ``pin_memory`` and
            ``into`` are then ignored. ``None`` or the CPU: host memory.

    Returns:
        The state as written: entries in their original order with codec, params, shape,
        dtype and buffers, plus skeleton, ids, aliases, rules and metadata.

    Raises:
        CheckpointError: malformed, truncated or corrupted file, naming the entry, or an
            entry asked for that the file does not hold;
        CheckpointIOError: the operating system failed.
    """
    path = os.fspath(path)
    dev = torch.device(device) if device is not None else None
    to_device = dev is not None and dev.type != "cpu"
    stream = None
    if to_device and dev.type == "cuda":  # type: ignore[union-attr]
        # The uploads run on worker threads, whose current device and stream are their own
        # (device 0 and its default stream): the caller's are fixed here.
        if dev.index is None:  # type: ignore[union-attr]
            dev = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.current_stream(dev)
    pin = pin_memory and not to_device and can_pin(path)
    with MappedCheckpoint(
        path,
        verify=verify,
        pin=pin,
        entries=entries,
        headers=headers,
        into=None if to_device else into,
        max_expansion=max_expansion,
        device=dev if to_device else None,
        stream=stream,
    ) as ck:
        specs = [s for s in ck.layout.buffers if ck.wanted is None or s.entry in ck.wanted]
        others = (
            []
            if not (check_others and verify) or ck.wanted is None
            else [s for s in ck.layout.buffers if s.entry not in ck.wanted]
        )
        # One pool of work: a CRC check is a cheap piece beside the reads.
        work = [(ck.read_buffer, s) for s in specs] + [(ck.check_crc, s) for s in others]
        tensors = parallel_map(
            lambda item: item[0](item[1]),
            work,
            sizes=[s.raw_nbytes or s.nbytes for _, s in work],
            threads=None if POSITIONAL_READS else 1,
        )[: len(specs)]
    return to_qstate(
        ck.layout.manifest, {(s.entry, s.name): t for s, t in zip(specs, tensors)}, only=ck.wanted
    )


def verify_file(
    path: str | os.PathLike,
    *,
    headers: HeaderCache | None = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> None:
    """Validate a checkpoint completely and check every buffer's CRC-32.

    Streams each raw buffer through a chunk-sized scratch, so memory stays small whatever
    the file size. A staged buffer is checked from the file's memory map (as a load reads
    it): its frame is checked and decoded in chunks that are thrown away, so the decoded
    content is checked too. Buffers are checked on several threads (:mod:`tw_triton.parallel`).

    Args:
        path: the checkpoint file.
        headers: see :class:`~tw_triton.format.HeaderCache`.
        max_expansion: the bound on what staged buffers decode to, as for :func:`read_file`,
            so that a file a load would refuse does not verify.

    Raises:
        CheckpointError: naming the file, the entry and the buffer that failed.
    """
    path = os.fspath(path)
    with MappedCheckpoint(
        path,
        verify=True,
        pin=False,
        entries=None,
        headers=headers,
        max_expansion=max_expansion,
    ) as ck:

        def verify_one(spec: BufferSpec) -> None:
            if spec.stage is None:
                ck.check_crc(spec)
                return
            stored = ck.stored(spec)
            check_crc(path, spec, crc32(stored))
            spec.stage.verify(stored, spec.stage_params, spec.raw_nbytes, spec.where(path))
            ck.done_with(spec)

        parallel_map(
            verify_one,
            ck.layout.buffers,
            sizes=[s.raw_nbytes or s.nbytes for s in ck.layout.buffers],
            threads=None if POSITIONAL_READS else 1,
        )


class MappedCheckpoint:
    """A checkpoint file held open for reading its buffers (a context manager: the file and
    its map close on exit), its header validated and its expansion bounded.

    Buffers with an entropy stage are decoded from a read-only memory map of the file (the
    checksum and zstd read the page cache directly, where a read would first zero fresh
    memory and copy into it); each buffer's pages leave the process once it is decoded, so
    the resident size never holds the whole file next to the decoded state. As with any
    memory-mapped load, a file truncated by another process *while* it is read can end the
    process with SIGBUS; the Checkpointer never rewrites a file in place. Where the file
    system cannot map the file, staged buffers are read into memory instead (same bytes).
    Raw buffers are read with positional reads straight into their tensors.

    Attributes (once entered): ``file``, ``layout``, ``wanted`` (the entries asked for, or
    ``None``), ``file_map`` (the memory map, or ``None``).
    """

    def __init__(
        self,
        path: str,
        *,
        verify: bool,
        pin: bool,
        entries: Iterable[str] | None,
        headers: HeaderCache | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
        max_expansion: float | None = MAX_EXPANSION,
        device: torch.device | None = None,
        stream: Any = None,
    ) -> None:
        self.path = path
        self.device = device  # buffers go there through a ring of pinned slots
        self.stream = stream  # the CUDA stream the uploads are queued on (any thread's)
        self.ring: PinnedRing | None = None
        self._owns_ring = False
        check_max_expansion(max_expansion)
        self._max_expansion = max_expansion
        self._headers = headers
        self.verify = verify
        self.pin = pin
        self._entries = entries
        self._into = into or {}
        self._opener = open_for_reading(path)
        self.wanted: set[str] | None = None
        self.file_map: mmap.mmap | None = None

    def __enter__(self) -> MappedCheckpoint:
        self.file = self._opener.__enter__()
        try:
            self.layout = layout_of(self.file, self.path, self._headers)
            check_expansion(self.layout, self.path, self._max_expansion)
            if self._entries is not None:
                aliases = self.layout.manifest["aliases"]
                self.wanted = {aliases.get(p, p) for p in self._entries}
                missing = sorted(self.wanted - set(self.layout.manifest["entries"]))
                if missing:
                    raise CheckpointError(f"checkpoint {self.path}: has no entry {missing[0]!r}")
            if any(spec.stage is not None for spec in self.layout.buffers):
                # The layout was validated against the file's size: every buffer is inside.
                try:
                    self.file_map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ)
                except (OSError, ValueError) as exc:
                    # A file system that cannot map files: the same bytes, read instead.
                    logger.debug("checkpoint %s: cannot memory-map it (%s); reading it", self.path, exc)
            if self.device is not None:
                self.ring, self._owns_ring = ring_for_read(self.device)
        except BaseException as exc:
            self._opener.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            if self.ring is not None and self._owns_ring:
                self.ring.close()  # after the copies still reading its slots
            if self.file_map is not None:
                try:
                    self.file_map.close()
                except BufferError:
                    # A view of the map is still held (by a traceback's frame, when an
                    # error propagates): the map closes when it is collected.
                    pass
        finally:
            self._opener.__exit__(exc_type, exc, tb)

    def _on_stream(self) -> Any:
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)

    def read_buffer(self, spec: BufferSpec) -> torch.Tensor:
        """Read one buffer into a new tensor, or into its destination (see :func:`read_file`'s
        ``into``): straight in, or through its stage; thread-safe."""
        out = self._destination(spec)
        if spec.stage is not None:
            if self.ring is not None and self.device is not None:
                with self._on_stream():
                    tensor = upload_staged(
                        self.stored(spec),
                        spec,
                        self.path,
                        verify=self.verify,
                        ring=self.ring,
                        device=self.device,
                    )
            else:
                tensor = decode_staged(
                    self.stored(spec), spec, self.path, verify=self.verify, pin=self.pin, out=out
                )
            self.done_with(spec)
            return tensor
        if self.ring is not None and self.device is not None:
            start = self.layout.data_start + spec.begin
            with self._on_stream():
                return upload_raw(
                    self.file, spec, start, self.path, verify=self.verify, ring=self.ring, device=self.device
                )
        return read_raw(
            self.file,
            spec,
            self.layout.data_start + spec.begin,
            self.path,
            verify=self.verify,
            pin=self.pin,
            out=out,
        )

    def _destination(self, spec: BufferSpec) -> torch.Tensor | None:
        """The tensor given for this buffer's entry, if it can take the buffer as it is."""
        dest = self._into.get(spec.entry)
        if dest is None or self.pin or spec.name != "data":
            return None
        if self.layout.manifest["entries"][spec.entry]["codec"] != "exact":
            return None
        # The same shape, not only the same size: a tensor that load_state_dict would refuse
        # (a model changed since the save) must not be overwritten on the way.
        if (
            dest.device.type != "cpu"
            or dest.dtype != spec.dtype
            or not dest.is_contiguous()
            or tuple(dest.shape) != tuple(spec.shape)
            or dest.layout != torch.strided
        ):
            return None
        return dest

    def check_crc(self, spec: BufferSpec) -> None:
        """Check a buffer's stored bytes against its CRC-32, keeping nothing: from the map
        for a staged buffer, through a chunk-sized scratch for a raw one; thread-safe.

        Raises:
            CheckpointError: the checksum differs, or the file ends early.
        """
        if spec.stage is not None:
            check_crc(self.path, spec, crc32(self.stored(spec)))
            self.done_with(spec)
            return
        offset = self.layout.data_start + spec.begin
        scratch = memoryview(bytearray(min(IO_CHUNK_BYTES, max(spec.nbytes, 1))))
        crc = 0
        done = 0
        while done < spec.nbytes:
            n = min(spec.nbytes - done, len(scratch))
            read_exact_into(self.file, scratch[:n], offset + done, self.path, spec)
            crc = crc32(scratch[:n], crc)
            done += n
        check_crc(self.path, spec, crc)

    def stored(self, spec: BufferSpec) -> memoryview:
        """A buffer's stored bytes: a view of the map, or a copy read from the file where it
        cannot be mapped. Not released explicitly: a decoder's error may still hold it."""
        offset = self.layout.data_start + spec.begin
        if self.file_map is None:
            view = memoryview(bytearray(spec.nbytes))
            read_exact_into(self.file, view, offset, self.path, spec)
            return view
        return memoryview(self.file_map)[offset : offset + spec.nbytes]

    def done_with(self, spec: BufferSpec) -> None:
        """The buffer's stored bytes are not needed any more: its pages leave the process."""
        if self.file_map is not None:
            unmap_pages(self.file_map, self.layout.data_start + spec.begin, spec.nbytes)
