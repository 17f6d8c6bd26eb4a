"""A keyframe checkpoint directory as the reference of delta saves, read region by region.

A delta chunk is coded against the keyframe's values over exactly its own region of the
global tensor. The keyframe may have been saved with another sharding, so a region is
assembled from every keyframe chunk that overlaps it; decoding is therefore the same on any
number of ranks. Regions are cached where they were asked for (the training device), so a
:class:`Keyframe` passed to successive writers keeps the reference there and reads the
directory once. See docs/distributed.md.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from ..errors import ReferenceMismatchError
from ..format import MAX_EXPANSION, HeaderCache, one_ring, read_file, read_manifest
from ..state import dequantize_entries, dequantize_state_dict
from ..state.entries import wants_pinned
from ..tree import flatten
from .meta import Record, read_record

RegionKey = tuple[str, tuple[int, ...], tuple[int, ...]]


def decode_file(
    path: str, *, reference: Any = None, verify: bool = True, max_expansion: float | None = MAX_EXPANSION
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Read and decode one tw_triton file of a DCP checkpoint: ``(qstate, {entry: tensor})``
    (``max_expansion``: the decoded-size bound of :func:`tw_triton.format.read_file`)."""
    qstate = read_file(path, verify=verify, max_expansion=max_expansion)
    decoded = dequantize_state_dict(qstate, reference=reference, source=path, verify=verify)
    tensors, _ = flatten(decoded)
    return qstate, tensors


class Keyframe:
    """A complete tw_triton DCP checkpoint used as the reference of delta saves.

    Args:
        path: the keyframe's checkpoint directory.
        verify: check every buffer's CRC-32 when its file is read.
        max_expansion: the bound on what a rank file's compressed buffers may decode to,
            times its size (:func:`tw_triton.format.read_file`); ``None`` lifts it.

    Raises:
        CheckpointError: the directory is not a complete tw_triton DCP checkpoint.
        ReferenceMismatchError: the directory is itself a delta (chains are not followed).
    """

    def __init__(
        self, path: str | os.PathLike, *, verify: bool = True, max_expansion: float | None = MAX_EXPANSION
    ) -> None:
        self.path = os.fspath(path)
        self.verify = verify
        self.max_expansion = max_expansion
        self.record: Record = read_record(self.path)
        if self.record.reference is not None:
            raise ReferenceMismatchError(
                f"{self.path}: a delta from checkpoint {self.record.reference['checkpoint_id']!r} "
                "cannot be a reference; use a keyframe (a save without reference)"
            )
        self._regions: dict[tuple[RegionKey, str], torch.Tensor] = {}

    @property
    def checkpoint_id(self) -> str:
        """The keyframe's checkpoint id (recorded by every delta against it)."""
        return self.record.checkpoint_id

    @one_ring()  # the rank files read for one call share one ring of pinned slots
    def regions(self, wanted: list[RegionKey], device: torch.device | None = None) -> list[torch.Tensor]:
        """The keyframe's values over each ``(fqn, offsets, sizes)``, decoded, on ``device``.

        Regions are assembled on ``device`` from the keyframe chunks decoded there; each
        needed file is read once per call, and only its entries that overlap a region are
        decoded (one file's at a time). Results are cached per device.

        Raises:
            ReferenceMismatchError: a tensor the keyframe lacks, or a region it does not
                cover completely (another global shape).
        """
        dev = torch.device(device) if device is not None else torch.device("cpu")
        out: list[torch.Tensor | None] = [self._regions.get((k, str(dev))) for k in wanted]
        pieces: dict[str, list[tuple[int, str, tuple[slice, ...], tuple[slice, ...]]]] = {}
        for i, key in enumerate(wanted):
            if out[i] is None:
                dtype = self._pieces(key, i, pieces)
                out[i] = torch.empty(key[2], dtype=dtype, device=dev)
        for name, file_pieces in pieces.items():
            tensors = self._decode(name, {entry for _, entry, _, _ in file_pieces}, dev)
            for i, entry, dst_sl, src_sl in file_pieces:
                out[i][dst_sl] = tensors[entry][src_sl]  # type: ignore[index]
        for i, key in enumerate(wanted):
            self._regions.setdefault((key, str(dev)), out[i])  # type: ignore[arg-type]
        return out  # type: ignore[return-value]

    def _pieces(
        self, key: RegionKey, i: int, pieces: dict[str, list[tuple[int, str, tuple, tuple]]]
    ) -> torch.dtype:
        """Add to ``pieces[file]`` the keyframe chunks that overlap region ``key`` (the
        ``i``-th asked for), as ``(i, entry, region slices, chunk slices)``; its dtype.

        Raises:
            ReferenceMismatchError: as :meth:`regions`.
        """
        fqn, offsets, sizes = key
        md = self.record.metadata.state_dict_metadata.get(fqn)
        where = f"reference {self.path} (checkpoint {self.checkpoint_id!r})"
        if md is None or not hasattr(md, "chunks"):
            raise ReferenceMismatchError(f"{where} has no tensor {fqn!r}")
        if len(md.size) != len(sizes) or any(o + s > n for o, s, n in zip(offsets, sizes, md.size)):
            raise ReferenceMismatchError(
                f"{where}: tensor {fqn!r} has size {list(md.size)}, which does not hold the "
                f"region at {list(offsets)} of size {list(sizes)}"
            )
        covered = 0
        for index, info in self.record.metadata.storage_data.items():
            if index.fqn != fqn:
                continue
            c_off = tuple(index.offset) if index.offset is not None else (0,) * len(sizes)
            chunk_md = next((c for c in md.chunks if tuple(c.offsets) == c_off), None)
            if chunk_md is None:
                continue
            lo = [max(a, b) for a, b in zip(offsets, c_off)]
            hi = [min(a + s, b + t) for a, s, b, t in zip(offsets, sizes, c_off, chunk_md.sizes)]
            if any(h <= a for a, h in zip(lo, hi)):
                continue
            dst_sl = tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offsets))
            src_sl = tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, c_off))
            pieces.setdefault(info.file, []).append((i, info.entry, dst_sl, src_sl))
            covered += math.prod(h - a for a, h in zip(lo, hi))
        if covered != math.prod(sizes):
            raise ReferenceMismatchError(
                f"{where}: its chunks cover {covered} of the {math.prod(sizes)} elements of "
                f"{fqn!r} at {list(offsets)} size {list(sizes)}"
            )
        return md.properties.dtype

    def _decode(self, name: str, entries: set[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The ``entries`` of rank file ``name``, which must be of this checkpoint, decoded
        on ``device``.

        Raises:
            ReferenceMismatchError: the file belongs to another checkpoint (copied in, or
                left by another run), so its values are not the ones the deltas were coded
                against.
            CheckpointError: the file lacks one of ``entries``.
        """
        path = os.path.join(self.path, name)
        headers = HeaderCache()
        found = read_manifest(path, headers=headers)["checkpoint_id"]
        if found != self.checkpoint_id:
            raise ReferenceMismatchError(
                f"{path}: a file of checkpoint {found!r}, but reference "
                f"{self.path} is checkpoint {self.checkpoint_id!r} (files and metadata do not match)"
            )
        # Only those entries, to a GPU straight through the ring of pinned slots.
        qstate = read_file(
            path,
            verify=self.verify,
            max_expansion=self.max_expansion,
            headers=headers,
            entries=entries,
            device=device if wants_pinned(device) else None,
        )
        return dequantize_entries(qstate, entries, device=device, source=path, verify=self.verify)


def open_reference(
    reference: str | os.PathLike | Keyframe | None, *, max_expansion: float | None = MAX_EXPANSION
) -> Keyframe | None:
    """``reference`` as a :class:`Keyframe` (``None`` stays ``None``; a path is opened with
    ``max_expansion``)."""
    if reference is None or isinstance(reference, Keyframe):
        return reference
    return Keyframe(reference, max_expansion=max_expansion)


__all__ = ["Keyframe", "open_reference", "decode_file"]
