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
from ..format import MAX_EXPANSION, read_file
from ..state import dequantize_state_dict
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

    def regions(self, wanted: list[RegionKey], device: torch.device | None = None) -> list[torch.Tensor]:
        """The keyframe's values over each ``(fqn, offsets, sizes)``, decoded, on ``device``.

        Each needed file is read and decoded once per call; results are cached per device.

        Raises:
            ReferenceMismatchError: a tensor the keyframe lacks, or a region it does not
                cover completely (another global shape).
        """
        dev = torch.device(device) if device is not None else torch.device("cpu")
        out: list[torch.Tensor | None] = [self._regions.get((k, str(dev))) for k in wanted]
        files: dict[str, dict[str, torch.Tensor]] = {}
        for i, key in enumerate(wanted):
            if out[i] is None:
                region = self._assemble(key, files).to(dev)
                self._regions[(key, str(dev))] = region
                out[i] = region
        return out  # type: ignore[return-value]

    def _assemble(self, key: RegionKey, files: dict[str, dict[str, torch.Tensor]]) -> torch.Tensor:
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
        out = torch.empty(sizes, dtype=md.properties.dtype)
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
            if info.file not in files:
                files[info.file] = self._decode(info.file)
            src = files[info.file][info.entry]
            dst_sl = tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, offsets))
            src_sl = tuple(slice(a - o, h - o) for a, h, o in zip(lo, hi, c_off))
            out[dst_sl] = src[src_sl]
            covered += math.prod(h - a for a, h in zip(lo, hi))
        if covered != out.numel():
            raise ReferenceMismatchError(
                f"{where}: its chunks cover {covered} of the {out.numel()} elements of "
                f"{fqn!r} at {list(offsets)} size {list(sizes)}"
            )
        return out

    def _decode(self, name: str) -> dict[str, torch.Tensor]:
        """The decoded entries of rank file ``name``, which must be of this checkpoint.

        Raises:
            ReferenceMismatchError: the file belongs to another checkpoint (copied in, or
                left by another run), so its values are not the ones the deltas were coded
                against.
        """
        path = os.path.join(self.path, name)
        qstate = read_file(path, verify=self.verify, max_expansion=self.max_expansion)
        if qstate.checkpoint_id != self.checkpoint_id:
            raise ReferenceMismatchError(
                f"{path}: a file of checkpoint {qstate.checkpoint_id!r}, but reference "
                f"{self.path} is checkpoint {self.checkpoint_id!r} (files and metadata do not match)"
            )
        tensors, _ = flatten(dequantize_state_dict(qstate, source=path, verify=self.verify))
        return tensors


def open_reference(
    reference: str | os.PathLike | Keyframe | None, *, max_expansion: float | None = MAX_EXPANSION
) -> Keyframe | None:
    """``reference`` as a :class:`Keyframe` (``None`` stays ``None``; a path is opened with
    ``max_expansion``)."""
    if reference is None or isinstance(reference, Keyframe):
        return reference
    return Keyframe(reference, max_expansion=max_expansion)


__all__ = ["Keyframe", "open_reference", "decode_file"]
