"""Who may remove a directory's temp files: :class:`DirectoryClaim`, and the temp-file lists.

Every writer of this library holds a shared ``flock`` on its directory while open; a new
writer removes the temp files of interrupted saves only when it gets the exclusive lock
at once, that is when no other writer holds the directory. :func:`checkpoint_temp_files`
and :func:`dcp_temp_files` list the temp files of each layout. Why: docs/training-loop.md
("Crash safety").
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock, so no sweep (see DirectoryClaim)
    fcntl = None  # type: ignore[assignment]

from . import format as _format
from .checkpoint_files import parse_checkpoint_name

logger = logging.getLogger(__name__)

# format.temp_path_for: ".<final name>.<hex>.tmp" (format.is_temp_file checks the hex).
_WRITE_TEMP_RE = re.compile(r"\.(.+)\.[0-9a-f]+\.tmp", re.DOTALL)
# The layout of tw_triton.dcp: step directories, one file per rank and chunk, the record.
_DCP_STEP_RE = re.compile(r"step_\d{8,}")
_DCP_FILE_RE = re.compile(r"__\d+_\d+\.tw\.safetensors")
_DCP_RECORD_TEMP = "tw_dcp.json.tmp"


class DirectoryClaim:
    """A writer's hold on a directory, so that nobody removes the temp files it writes.

    How ownership of temp files is known: every writer (a :class:`Checkpointer`, each
    rank's :class:`~tw_triton.dcp.DistributedCheckpointer`) holds a shared ``flock`` on the
    directory itself from its construction until it is closed (or its process dies: the
    kernel drops the lock of a killed process). :meth:`sweep` removes temp files only
    when it gets the exclusive lock without waiting, that is when no other writer, in this
    process or any other on this filesystem, holds the directory: every temp file there is
    then a dead writer's. (``flock`` locks belong to the open file, so two Checkpointers of
    one process exclude each other too.) While another writer holds it, nothing is removed:
    temp names do not say whose they are, and the age of a file says nothing of whether a
    slow write is still going on. Where ``flock`` is missing (Windows) or refused (some
    network filesystems), nothing is removed either. Only writers of this library take the
    lock: a temp file of a process that writes here by another route (``format.write_file``
    itself) is not protected.

    Args:
        path: the directory (it exists).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        if fcntl is None:
            return
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            logger.debug("cannot open %s to lock it: %s; temp files there are left alone", path, exc)

    def sweep(self, find_temps: Callable[[], Iterable[str]]) -> list[str]:
        """Remove the temp files ``find_temps()`` lists if no other writer holds the
        directory (see the class), log one line naming how many files and bytes, and hold
        the directory from then on.

        Returns:
            The paths removed.
        """
        if self._fd is None:
            return []
        removed: list[str] = []
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.debug("another writer holds %s: its temp files are left alone", self.path)
        except OSError as exc:
            logger.debug("cannot lock %s (%s): its temp files are left alone", self.path, exc)
        else:
            removed, nbytes = _remove_files(find_temps())
            if removed:
                logger.warning(
                    "removed %d temp file(s) of %d bytes that killed or failed saves left in %s",
                    len(removed),
                    nbytes,
                    self.path,
                )
        try:
            # Not atomic after the exclusive lock (flock(2)), which is fine: this writer has
            # no temp file yet for another sweep to find.
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        except OSError as exc:
            logger.debug("cannot lock %s (%s)", self.path, exc)
        return removed

    def close(self) -> None:
        """Let go of the directory (closing twice is harmless)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit os may be gone; the fd goes with the process
            pass


def checkpoint_temp_files(directory: str) -> list[str]:
    """Temp files of a :class:`Checkpointer`'s naming in ``directory``: those of
    :func:`~tw_triton.format.write_file` (and of retention's renames) for a checkpoint
    file name (``.step-00000003.tw.safetensors.<16 hex>.tmp``)."""
    return _temp_files_for(directory, lambda final: parse_checkpoint_name(final) is not None)


def dcp_temp_files(directory: str) -> list[str]:
    """Temp files of a :class:`~tw_triton.dcp.DistributedCheckpointer`'s naming under
    ``directory``: in its ``step_<digits>`` directories, those of
    :func:`~tw_triton.format.write_file` for a rank's file (``__<rank>_<k>.tw.safetensors``)
    and ``tw_dcp.json.tmp``, the record's."""
    found = []
    for name in os.listdir(directory):
        sub = os.path.join(directory, name)
        if _DCP_STEP_RE.fullmatch(name) and os.path.isdir(sub):
            found += _temp_files_for(sub, _DCP_FILE_RE.fullmatch, also=(_DCP_RECORD_TEMP,))
    return sorted(found)


def write_temp_files(directory: str) -> list[str]:
    """Every temp file of :func:`~tw_triton.format.write_file` in ``directory``, whatever
    its final name (``.<final name>.<16 hex>.tmp``): a Lightning ``TwCheckpointIO`` writes
    files under names Lightning chooses."""
    return _temp_files_for(directory, lambda final: True)


def _temp_files_for(directory: str, is_final: Callable[[str], Any], also: tuple[str, ...] = ()) -> list[str]:
    """Temp files of :func:`~tw_triton.format.write_file` in ``directory`` whose final name
    passes ``is_final``, and the files named in ``also``."""
    found = []
    for name in os.listdir(directory):
        m = _WRITE_TEMP_RE.fullmatch(name)
        if name in also or (m is not None and _format.is_temp_file(name) and is_final(m.group(1))):
            found.append(os.path.join(directory, name))
    return sorted(found)


def _remove_files(paths: Iterable[str]) -> tuple[list[str], int]:
    """Unlink ``paths`` (plain files only); return those removed and their bytes."""
    removed, nbytes = [], 0
    for path in paths:
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("could not remove temp file %s: %s", path, exc)
            continue
        removed.append(path)
        nbytes += st.st_size
    return removed, nbytes


__all__ = ["DirectoryClaim", "checkpoint_temp_files", "dcp_temp_files"]
