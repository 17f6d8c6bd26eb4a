"""The exit codes of ``tw`` and the error that means "bad arguments" (docs/cli.md)."""

from __future__ import annotations

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


__all__ = ["EXIT_OK", "EXIT_CHECKPOINT", "EXIT_USAGE", "EPILOG", "UsageError"]
