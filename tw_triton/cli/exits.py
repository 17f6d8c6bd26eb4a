"""The exit codes of ``tw`` and the error that means "bad arguments" (docs/cli.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import TwTritonError

EXIT_OK = 0
EXIT_CHECKPOINT = 1
EXIT_USAGE = 2

EPILOG = """\
exit codes:
  0  success
  1  the checkpoint is invalid, corrupted, or its reference is missing or different
     (also: an input that cannot be converted, an I/O failure)
  2  usage error: bad arguments, or an input file that does not exist
"""


class UsageError(TwTritonError):
    """Arguments that parse but do not go together (exit code 2)."""


def refuse_overwrite(output: str, inputs: Iterable[str | None]) -> None:
    """Refuse an output that is one of the files the command reads.

    Raises:
        UsageError: ``output`` is the same file as one of ``inputs``.
    """
    if not os.path.isfile(output):
        return
    for path in inputs:
        if path is not None and os.path.exists(path) and os.path.samefile(output, path):
            raise UsageError(f"{output}: writing it would overwrite the input {path}; choose another output")


__all__ = ["EXIT_OK", "EXIT_CHECKPOINT", "EXIT_USAGE", "EPILOG", "UsageError", "refuse_overwrite"]
