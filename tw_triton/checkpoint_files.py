"""Checkpoint file names and what a directory listing knows of one file.

A Checkpointer names the file of step ``s`` ``step-<8 digits>.tw.safetensors``
(:func:`checkpoint_name`); :func:`parse_checkpoint_name` recognises those names (never a
temp file's). :class:`CheckpointInfo` is the listing's record of one complete file. Why
one file per step: docs/training-loop.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHECKPOINT_SUFFIX = ".tw.safetensors"
STEP_DIGITS = 8
NAME_RE = re.compile(r"step-(\d+)\.tw\.safetensors")
# The ``kind`` a Checkpointer records in each file's metadata (docs/training-loop.md); a
# file without one (``tw_triton.save``'s) is not a Checkpointer's checkpoint.
KIND_KEYFRAME = "keyframe"  # everything exact, no reference
KIND_DELTA = "delta"  # quantized entries are deltas from a keyframe
KIND_STANDALONE = "standalone"  # quantized without a reference (delta=False mode)
CHECKPOINTER_KINDS = (KIND_KEYFRAME, KIND_DELTA, KIND_STANDALONE)


def checkpoint_name(step: int) -> str:
    """File name of the checkpoint of ``step``, e.g. ``step-00000100.tw.safetensors``."""
    return f"step-{step:0{STEP_DIGITS}d}{CHECKPOINT_SUFFIX}"


def parse_checkpoint_name(name: str) -> int | None:
    """The step of a checkpoint file name, or ``None`` if it is not one (temp files too)."""
    m = NAME_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class CheckpointInfo:
    """What the directory listing knows of one complete checkpoint file (from its header).

    Attributes:
        step: training step (from the file name).
        path: the file.
        checkpoint_id: its id.
        reference_id: id of the keyframe it is a delta from, or ``None``.
        kind: ``"keyframe"``, ``"delta"`` or ``"standalone"`` (from the manifest metadata;
            ``"unknown"`` for a file not written by a Checkpointer).
        nbytes: file size.
    """

    step: int
    path: str
    checkpoint_id: str
    reference_id: str | None
    kind: str
    nbytes: int

    @property
    def by_checkpointer(self) -> bool:
        """Whether a Checkpointer wrote the file (its metadata records one of its kinds)."""
        return self.kind in CHECKPOINTER_KINDS


__all__ = [
    "CHECKPOINTER_KINDS",
    "KIND_DELTA",
    "KIND_KEYFRAME",
    "KIND_STANDALONE",
    "CHECKPOINT_SUFFIX",
    "STEP_DIGITS",
    "CheckpointInfo",
    "checkpoint_name",
    "parse_checkpoint_name",
]
