"""``save`` / ``load``: ``dcp.save`` / ``dcp.load`` with tw_triton storage and tw_triton errors.

DCP wraps every rank's exception in a ``CheckpointException`` (a ``BaseException``, so an
``except Exception`` does not see it). These helpers re-raise the lowest rank's tw_triton
error as itself, chained to DCP's exception, so ``except CheckpointError`` works.
See docs/distributed.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import TwTritonError
from . import compat
from .reader import StorageReader
from .writer import StorageWriter


def tw_error(exc: BaseException) -> BaseException:
    """The lowest rank's tw_triton error in DCP's ``CheckpointException`` ``exc``, chained
    to it, or ``exc`` itself when no rank's error is one (or ``exc`` is not DCP's)."""
    if isinstance(exc, CheckpointException):
        for err in compat.rank_errors(exc):
            if isinstance(err, TwTritonError):
                err.__cause__ = exc
                return err
    return exc


def _reraise(exc: CheckpointException) -> None:
    raise tw_error(exc)


def save(state: dict[str, Any], path: str | os.PathLike, *, no_dist: bool = False, **writer_kw: Any) -> None:
    """``dcp.save(state)`` into ``path`` with a :class:`StorageWriter` (``writer_kw``: its options).

    Raises:
        TwTritonError: the first rank's tw_triton error (others as DCP raised them).
    """
    try:
        dcp.save(state, storage_writer=StorageWriter(path, **writer_kw), no_dist=no_dist)
    except CheckpointException as exc:
        _reraise(exc)


def load(state: dict[str, Any], path: str | os.PathLike, *, no_dist: bool = False, **reader_kw: Any) -> None:
    """``dcp.load(state)`` from ``path`` with a :class:`StorageReader`, in place.

    Raises:
        CheckpointError, ReferenceMismatchError: as the reader raised them on the first
            failing rank.
    """
    reader = StorageReader(path, **reader_kw)
    # DCP turns a read_metadata failure into an AssertionError holding only its text, so
    # the checkpoint-level checks run here first, where their errors keep their type.
    reader.preflight()
    try:
        dcp.load(state, storage_reader=reader, no_dist=no_dist)
    except CheckpointException as exc:
        _reraise(exc)


__all__ = ["save", "load", "tw_error"]
