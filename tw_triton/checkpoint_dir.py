"""The complete checkpoint files of one directory: listing, latest good, verification, decoding.

:class:`CheckpointDirectory` is what a :class:`~tw_triton.checkpointer.Checkpointer` knows
of the files on disk (what is in flight is the Checkpointer's). Listing parses each
file's header once per file version, or takes what the writer noted (:meth:`note`);
verification checks every checksum of a file and of the chain it needs
(:func:`~tw_triton.deltas.chain_of`) under the directory's ``max_expansion``. Names:
:mod:`tw_triton.checkpoint_files`; temp files and their sweep:
:mod:`tw_triton.directory_claim`. Why: docs/training-loop.md ("Crash safety").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import format as _format
from .arguments import as_path
from .checkpoint_files import (  # noqa: F401 - re-exported: their documented home
    CHECKPOINT_SUFFIX,
    CHECKPOINTER_KINDS,
    CheckpointInfo,
    checkpoint_name,
    parse_checkpoint_name,
)
from .deltas import chain_of, decode_chain
from .directory_claim import DirectoryClaim, checkpoint_temp_files, dcp_temp_files  # noqa: F401 - re-exported
from .errors import CheckpointError, ReferenceMismatchError
from .format.files import io_error
from .qstate import QuantizedState
from .state import check_manifest, delta_paths
from .state.entries import wants_pinned

logger = logging.getLogger(__name__)

# How many times choosing the latest checkpoint lists the directory when a live writer
# changes its files meanwhile (each listing is tried whole before the next).
LISTINGS = 3


@dataclass(frozen=True)
class VerifiedRead:
    """A file read (and verified) while choosing the checkpoint to load.

    Attributes:
        state: what was read.
        entries: the entries read (the rest was checked, not kept); ``None``: all.
    """

    state: QuantizedState
    entries: frozenset[str] | None


class CheckpointDirectory:
    """The complete checkpoint files of one directory (created if missing).

    Args:
        path: the directory.
        max_expansion: the bound on what each file's compressed buffers may decode to,
            for every read and verification of a file here (a delta's keyframe and
            earlier links included): see :func:`~tw_triton.format.read_file`. ``None``
            lifts it.
    """

    def __init__(
        self, path: str | os.PathLike, *, max_expansion: float | None = _format.MAX_EXPANSION
    ) -> None:
        self.path = as_path(path, "directory")
        _format.check_max_expansion(max_expansion)
        self.max_expansion = max_expansion
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:  # a file of that name, or in its parents; no permission
            raise io_error(exc, f"{self.path}: cannot be made or used as a checkpoint directory") from exc
        # file -> ((mtime_ns, size), its info or None when its header cannot be read)
        self._listed: dict[str, tuple[tuple[int, int], CheckpointInfo | None]] = {}
        # The headers the listing parsed, for the reads of a load that follow it.
        self.headers = _format.HeaderCache()

    def path_for(self, step: int) -> str:
        """Path of the checkpoint file of ``step`` (whether or not it exists)."""
        return os.path.join(self.path, checkpoint_name(step))

    def scan(self, *, writing: Collection[str] = ()) -> dict[int, CheckpointInfo]:
        """Complete checkpoint files by step (headers read once per file version).

        Args:
            writing: paths this process is still writing; left out unread even if already
                renamed into place (their writer notes them once its Future is collected).
        """
        found: dict[int, CheckpointInfo] = {}
        seen = set()
        for name in os.listdir(self.path):
            step = parse_checkpoint_name(name)
            if step is None:
                continue
            path = os.path.join(self.path, name)
            seen.add(path)
            if path in writing:
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            key = (st.st_mtime_ns, st.st_size)
            cached = self._listed.get(path)
            if cached is not None and cached[0] == key:
                info = cached[1]
            else:
                info = _read_info(path, step, st.st_size, self.headers)
                self._listed[path] = (key, info)
            if info is not None:
                found[step] = info
        for path in set(self._listed) - seen:
            del self._listed[path]
        self.headers.retain(seen)
        return found

    def written_steps(self) -> list[int]:
        """Steps of the complete files here that a Checkpointer wrote (see :meth:`scan`)."""
        return sorted(step for step, info in self.scan().items() if info.by_checkpointer)

    def note(self, step: int, path: str, nbytes: int, fields: tuple[str, str | None, str]) -> None:
        """List a file just written here from what its writer knows of it, so that the next
        :meth:`scan` need not parse its header.

        ``fields`` are its id, reference id and kind; ``nbytes`` the size the write
        returned (parsing the header on the loop's thread would lengthen the save's pause,
        and a cached header slows Python's full garbage collections). A file whose size is
        not ``nbytes``, or that cannot be stat'ed, is left to :meth:`scan`.
        """
        try:
            st = os.stat(path)
        except OSError:
            return
        if st.st_size != nbytes:
            return
        checkpoint_id, reference_id, kind = fields
        info = CheckpointInfo(step, path, checkpoint_id, reference_id, kind, st.st_size)
        self._listed[path] = ((st.st_mtime_ns, st.st_size), info)

    def latest(self, *, verify: bool = True) -> int | None:
        """The newest step whose checkpoint (and the keyframe it needs) is good, or ``None``.

        With ``verify`` every candidate file is read and its checksums checked; a file that
        fails, or a delta whose keyframe is missing or fails, is skipped with a logged
        warning, and the next older one is tried; so is a file no Checkpointer wrote (its
        metadata records none of :data:`CHECKPOINTER_KINDS`), verified or not.
        """
        return self._newest_good(verify)[0]

    def _newest_good(self, verify: bool) -> tuple[int | None, str]:
        """:meth:`latest`, and why the newest file was passed over (``""``: it was not),
        for the error when none is good."""
        for _ in range(LISTINGS):
            found = self.scan()
            by_id = _by_id(found)
            verified: dict[str, str | None] = {}
            newest = ""
            for step in sorted(found, reverse=True):
                info = found[step]
                problem = self._problem(info, by_id, verified, verify)
                if problem is None:
                    return step, newest
                newest = newest or _passed_over(info, problem)
                logger.warning("skipping checkpoint %s: %s", info.path, problem)
            if not self._outdated(found):
                break
        return None, newest

    def problems(self, *, verify: bool = True) -> dict[int, str | None]:
        """Every checkpoint here by step, with why it cannot be loaded (``None``: it can).

        A delta needs its chain back to a keyframe; with ``verify`` every file is read and
        its checksums checked, each file once however many chains it is in. Failures are
        logged as :meth:`latest` logs them.
        """
        found = self.scan()
        by_id = _by_id(found)
        verified: dict[str, str | None] = {}
        return {step: self._problem(found[step], by_id, verified, verify) for step in sorted(found)}

    def temp_files(self) -> list[str]:
        """Paths of the temp files that interrupted writes (and discards) left here."""
        return checkpoint_temp_files(self.path)

    def latest_read(
        self, *, upload: torch.device | None, into: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[dict[int, CheckpointInfo], CheckpointInfo, dict[str, VerifiedRead]]:
        """:meth:`latest` with ``verify``, keeping the verified reads of the files it chose.

        Each candidate is verified by reading it (checksums checked while reading) instead
        of streaming it, and the reads of the newest good one and its keyframe are returned
        to be decoded. A delta's keyframe (and each earlier link of a closed-loop chain) is
        read only at the entries the next link is a delta of; the CRC-32 of its other
        buffers is checked without decoding them, so the whole file is still known intact.
        Same choice, same warnings as :meth:`latest`. ``upload``: the CUDA device the reads
        stream to (:func:`~tw_triton.format.read_file`'s ``device``). ``into``: as for
        :func:`~tw_triton.format.read_file` (the reads of the chosen checkpoint come last,
        so what its files hold is what is left in those tensors).

        Raises:
            CheckpointError: no checkpoint here verifies.
        """
        for _ in range(LISTINGS):
            found = self.scan()
            by_id = _by_id(found)
            verified: dict[str, str | None] = {}
            reads: dict[str, VerifiedRead] = {}
            newest = ""
            for step in sorted(found, reverse=True):
                info = found[step]
                problem = self._problem(info, by_id, verified, True, reads=reads, upload=upload, into=into)
                if problem is None:
                    return found, info, reads
                reads.pop(info.path, None)  # good, but its keyframe is not: keep no memory for it
                newest = newest or _passed_over(info, problem)
                logger.warning("skipping checkpoint %s: %s", info.path, problem)
            if not self._outdated(found):
                break
        raise CheckpointError(f"no complete, verified checkpoint in {self.path!r}{newest}")

    def _outdated(self, found: dict[int, CheckpointInfo]) -> bool:
        """Whether the files here are no longer those of ``found``: a live writer (another
        process's retention, a new save) changed them while they were being verified, so
        a choice that found none good is made again from a new listing."""
        now = self.scan()
        return {s: i.checkpoint_id for s, i in now.items()} != {s: i.checkpoint_id for s, i in found.items()}

    def find(self, step: int | None, *, verify: bool) -> tuple[dict[int, CheckpointInfo], CheckpointInfo]:
        """The listing and the info of ``step`` (``None``: the :meth:`latest` good one).

        Raises:
            CheckpointError: no good checkpoint, or none for ``step`` (naming the steps
                there are, or why the file of ``step`` cannot be read).
        """
        if step is None:
            step, newest = self._newest_good(verify)
            if step is None:
                raise CheckpointError(f"no complete, verified checkpoint in {self.path!r}{newest}")
        found = self.scan()
        if step not in found:
            path = self.path_for(step)
            if os.path.exists(path):
                _format.read_manifest(path)  # raises the reason, naming the file
            raise CheckpointError(f"no checkpoint for step {step} in {self.path!r}; steps: {sorted(found)}")
        if not found[step].by_checkpointer:
            raise CheckpointError(f"{found[step].path}: {not_written_here(found[step])}")
        return found, found[step]

    def decode(
        self,
        info: CheckpointInfo,
        found: dict[int, CheckpointInfo],
        reads: dict[str, VerifiedRead],
        device: torch.device,
        *,
        verify: bool = True,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> Any:
        """Decode ``info`` on ``device``, with the chain of checkpoints it is a delta of.

        Files already read (and verified) are taken from ``reads``; the others are read now,
        exact entries into the tensors of ``into`` where they fit (see
        :func:`~tw_triton.format.read_file`). Each link is checked to be the checkpoint its
        successor names; the per-entry fingerprints are checked by the decode.
        """
        chain = chain_of(info, _by_id(found), self.path)
        upload = device if wants_pinned(device) else None

        def read(item: CheckpointInfo, entries: list[str] | None) -> QuantizedState:
            held = reads.pop(item.path, None)
            if held is not None and (
                held.entries is None or (entries is not None and held.entries >= set(entries))
            ):
                return held.state
            return _format.read_file(
                item.path,
                verify=verify,
                device=upload,
                entries=entries,
                headers=self.headers,
                into=into,
                max_expansion=self.max_expansion,
            )

        return decode_chain(chain, read, device)

    def discard(self, info: CheckpointInfo) -> str | None:
        """Take ``info``'s file out of the listing by renaming it to a temp name, which is
        returned for the caller to unlink (``None``: the file is already gone).

        The rename is a metadata update; the unlink of a large file is slow (it frees the
        page cache), so a Checkpointer leaves it to its writer thread. A crash in between
        leaves a temp file that :meth:`remove_temp_files` deletes.
        """
        doomed = _format.temp_path_for(info.path)
        try:
            os.replace(info.path, doomed)
        except FileNotFoundError:
            return None
        self._listed.pop(info.path, None)
        return doomed

    def remove_temp_files(self) -> list[str]:
        """Delete the temp files that interrupted writes (and discards) left here; return
        their paths. Call it only when nothing else is writing to this directory."""
        removed = []
        for path in self.temp_files():
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            removed.append(path)
        if removed:
            logger.info("removed %d temp file(s) of interrupted saves in %s", len(removed), self.path)
        return removed

    def _problem(
        self,
        info: CheckpointInfo,
        by_id: dict[str, CheckpointInfo],
        verified: dict[str, str | None],
        verify: bool,
        *,
        reads: dict[str, VerifiedRead] | None = None,
        upload: torch.device | None = None,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> str | None:
        """Why ``info`` cannot be loaded, or ``None`` if it (and its keyframe) verify.

        ``verified`` keeps, by path, what verifying each file found (``None``: good; else
        the error), so each file is verified once. With ``reads``, files are verified by
        reading them whole, and each good read is kept there by path (for
        :meth:`latest_read`).
        """
        if not info.by_checkpointer:  # known from its header: verify or not
            return not_written_here(info)
        try:
            chain = chain_of(info, by_id, self.path)
        except ReferenceMismatchError as e:  # a missing link, or a cycle
            return str(e)
        if not verify:
            return None
        # With reads, newest first: each link before the last is read only at the entries
        # its successor is a delta of (the tensors a load decodes), and the rest of its
        # buffers are checked against their CRC-32 without being decoded or kept (a
        # keyframe's optimizer state is never needed to load a delta).
        needs: list[str] | None = None
        for item in chain if reads is None else reversed(chain):
            if item.path not in verified:
                try:
                    # Before any data is read (or written into ``into``): a file that
                    # could not be decoded is passed over like a corrupted one.
                    check_manifest(_format.read_manifest(item.path, headers=self.headers), item.path)
                    if reads is None:
                        _format.verify_file(item.path, headers=self.headers, max_expansion=self.max_expansion)
                    else:
                        q = _format.read_file(
                            item.path,
                            verify=True,
                            device=upload,
                            headers=self.headers,
                            entries=needs,
                            check_others=True,
                            into=into,
                            max_expansion=self.max_expansion,
                        )
                        reads[item.path] = VerifiedRead(q, None if needs is None else frozenset(needs))
                    verified[item.path] = None
                except (CheckpointError, OSError) as e:
                    verified[item.path] = str(e)
            error = verified[item.path]
            if error is not None:
                return (
                    f"it fails verification: {error}"
                    if item is info
                    else (f"its reference {item.path} fails verification: {error}")
                )
            if reads is not None and item is not chain[0]:
                # What the next older link must provide; a file verified for another chain
                # and not read again is read whole when it is decoded.
                held = reads.get(item.path)
                needs = delta_paths(held.state, item.path) if held is not None else None
        return None


def not_written_here(info: CheckpointInfo) -> str:
    """Why a file named like a step's is not loaded as one: no Checkpointer wrote it."""
    recorded = "records no kind" if info.kind == "unknown" else f"records kind {info.kind!r}"
    return (
        f"it is not a Checkpointer's checkpoint: its metadata {recorded}, not one of "
        f"{', '.join(CHECKPOINTER_KINDS)} (a file of tw_triton.save?)"
    )


def _passed_over(info: CheckpointInfo, problem: str) -> str:
    """What the error for a directory with no good checkpoint says of the newest one: the
    reason is often one the caller can act on (a bound to raise, a missing keyframe)."""
    return f"; the newest, {info.path}: {problem}"


def _by_id(found: dict[int, CheckpointInfo]) -> dict[str, CheckpointInfo]:
    return {info.checkpoint_id: info for info in found.values()}


def _read_info(path: str, step: int, size: int, headers: _format.HeaderCache) -> CheckpointInfo | None:
    try:
        manifest = _format.read_manifest(path, headers=headers)
    except (CheckpointError, OSError) as e:
        logger.warning("ignoring %s: its header cannot be read: %s", path, e)
        return None
    kind = (manifest.get("metadata") or {}).get("kind", "unknown")
    return CheckpointInfo(step, path, manifest["checkpoint_id"], manifest.get("reference_id"), kind, size)


__all__ = [
    "CHECKPOINT_SUFFIX",
    "CheckpointDirectory",
    "DirectoryClaim",
    "checkpoint_temp_files",
    "dcp_temp_files",
    "CheckpointInfo",
    "checkpoint_name",
    "parse_checkpoint_name",
]
