"""A tw_triton DCP checkpoint directory: is it complete, and where is its keyframe.

A directory is complete when ``tw_dcp.json`` is valid and every rank file it lists is
there with its recorded size; a delta's keyframe is found by checkpoint id, beside it first.
See docs/distributed.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from ..errors import CheckpointError, CheckpointIOError, ReferenceMismatchError
from .meta import METADATA_NAME, Record, read_record


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a complete checkpoint: valid metadata, every rank file there.

    The coordinator writes the metadata only after every rank's files are durable, so a
    save killed on any rank leaves a directory for which this is false.
    """
    try:
        complete_record(path)
    except CheckpointError:
        return False
    return True


def complete_record(path: str | os.PathLike) -> Record:
    """The record of the checkpoint in ``path``, once every rank file it lists is there
    with the size it recorded.

    Raises:
        CheckpointError: no valid metadata, or a rank file missing, replaced or truncated.
    """
    directory = os.fspath(path)
    rec = read_record(directory)
    for name, info in rec.files.items():
        fpath = os.path.join(directory, name)
        try:
            size = os.path.getsize(fpath)
        except FileNotFoundError:
            raise CheckpointError(
                f"{directory}: rank file {name} (written by rank {info['rank']}) is missing"
            ) from None
        except OSError as exc:
            raise CheckpointIOError(exc.errno, f"{directory}: cannot stat rank file {name}: {exc}") from exc
        if size != info["bytes"]:
            raise CheckpointError(
                f"{directory}: rank file {name} has {size} bytes, {METADATA_NAME} "
                f"recorded {info['bytes']} (replaced or truncated)"
            )
    return rec


def find_keyframe(path: str | os.PathLike, reference: dict[str, str]) -> str:
    """The directory of the keyframe that the delta checkpoint in ``path`` records.

    Looked for by checkpoint id beside ``path`` first (the directory with the recorded
    keyframe's name, then the others), so a copied or moved run reads its own keyframe
    even where another run now sits at the recorded path; the recorded absolute path is
    the last resort. A directory with another id, or one that is not complete, is never
    returned.

    Args:
        path: the delta checkpoint's directory.
        reference: its record's ``{"checkpoint_id", "path"}``.

    Returns:
        The keyframe's directory.

    Raises:
        ReferenceMismatchError: no complete checkpoint with that id; the message names the
            candidates looked at and why each was passed over.
    """
    want, recorded = reference["checkpoint_id"], reference["path"]
    here = os.path.abspath(os.fspath(path))
    named = os.path.join(os.path.dirname(here), os.path.basename(recorded))
    passed_over: list[str] = []
    for cand, always_say in _keyframe_candidates(here, named, recorded):
        if not os.path.exists(cand):
            passed_over.append(f"{cand} is not there")
            continue
        try:
            found_id = read_record(cand).checkpoint_id
        except CheckpointError as exc:
            if always_say:
                passed_over.append(f"{cand}: {exc}")
            continue
        if found_id != want:
            if always_say:
                passed_over.append(f"{cand} is checkpoint {found_id!r}")
            continue
        try:
            complete_record(cand)
        except CheckpointError as exc:
            passed_over.append(f"{cand} is that checkpoint but incomplete: {exc}")
            continue
        return cand
    raise ReferenceMismatchError(
        f"{path} is a delta from keyframe checkpoint {want!r} (recorded at {recorded}); no "
        f"complete checkpoint with that id beside it or at the recorded path"
        + (f" ({'; '.join(passed_over)})" if passed_over else "")
        + "; pass reference="
    )


def _keyframe_candidates(here: str, named: str, recorded: str) -> Iterator[tuple[str, bool]]:
    """Directories that may hold a delta's keyframe, in the order :func:`find_keyframe`
    tries them, each with whether it is named in the error when passed over (the other
    siblings of ``here`` are tried only if they hold a record, and named only if their id
    matches)."""
    parent = os.path.dirname(here)
    try:
        siblings = sorted(os.listdir(parent))
    except OSError:
        siblings = []
    order = [(named, True)] + [(os.path.join(parent, n), False) for n in siblings]
    order.append((os.path.abspath(recorded), True))
    seen = {here}
    for cand, always_say in order:
        if cand in seen:
            continue
        seen.add(cand)
        if always_say or os.path.isfile(os.path.join(cand, METADATA_NAME)):
            yield cand, always_say


__all__ = ["is_complete", "complete_record", "find_keyframe"]
