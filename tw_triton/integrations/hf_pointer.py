"""The ``tw_checkpoint.json`` pointer of a ``TwTrainer`` ``checkpoint-N`` folder: which
tw_triton file holds that step (JSON; no transformers import, so any tool can read it)."""

from __future__ import annotations

import json
import os
from typing import Any

from ..checkpoint_dir import checkpoint_name
from ..errors import CheckpointError
from ..format.files import io_error, remove_quietly

POINTER_NAME = "tw_checkpoint.json"
POINTER_FORMAT = "tw_triton.hf_trainer"
POINTER_VERSION = 1


def read_pointer(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``tw_checkpoint.json`` of a ``checkpoint-N`` folder, or ``None`` if it has none.

    The returned dict has ``step`` and ``path`` (the tw_triton file, absolute).

    Raises:
        CheckpointError: the pointer exists but is malformed.
    """
    where = os.path.join(os.fspath(checkpoint_dir), POINTER_NAME)
    if not os.path.isfile(where):
        return None
    try:
        with open(where, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != POINTER_FORMAT or data.get("version") != POINTER_VERSION:
            raise ValueError(f"format {data.get('format')!r} v{data.get('version')!r}")
        step = data["step"]
        rel = data["file"]
        if not isinstance(step, int) or isinstance(step, bool) or not isinstance(rel, str):
            raise ValueError("'step' must be an int and 'file' a string")
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(
            f"{where}: not a valid tw_triton checkpoint pointer (expected JSON with format "
            f"{POINTER_FORMAT!r} v{POINTER_VERSION}, 'step' and 'file'): {e}"
        ) from e
    path = os.path.normpath(os.path.join(os.fspath(checkpoint_dir), rel))
    return {"step": step, "path": path}


def write_pointer(checkpoint_dir: str, tw_dir: str, step: int) -> None:
    """Write the ``tw_checkpoint.json`` of ``checkpoint_dir`` naming step ``step``'s file in
    ``tw_dir`` (relative, so a moved output_dir still resolves; atomic by rename).

    Raises:
        CheckpointIOError: the operating system failed (``errno`` kept); no temp file left.
    """
    os.makedirs(checkpoint_dir, exist_ok=True)
    rel = os.path.relpath(os.path.join(tw_dir, checkpoint_name(step)), checkpoint_dir)
    data = {"format": POINTER_FORMAT, "version": POINTER_VERSION, "step": step, "file": rel}
    final = os.path.join(checkpoint_dir, POINTER_NAME)
    tmp = final + ".tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, final)
    except OSError as exc:  # a full disk, no permission: named, in tw_triton's errors
        remove_quietly(tmp)
        raise io_error(exc, f"cannot write the checkpoint pointer {final}") from exc


__all__ = ["POINTER_FORMAT", "POINTER_NAME", "POINTER_VERSION", "read_pointer", "write_pointer"]
