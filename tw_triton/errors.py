"""The one exception family of tw_triton.

Every error the library raises on purpose derives from :class:`TwTritonError`, so a
training loop can catch the family with one ``except``. Subclasses also derive from the
builtin that best describes them (``ValueError`` for bad arguments), so code that already
catches those keeps working.
"""

from __future__ import annotations


class TwTritonError(Exception):
    """Base class of every error raised by tw_triton."""


class QuantizationError(TwTritonError, ValueError):
    """Bad arguments to the codec: unsupported dtype, bits, block, or a mismatched reference."""


class CheckpointError(TwTritonError):
    """A checkpoint file is malformed, corrupted, truncated, or cannot be read or written.

    The message names the file and, where it applies, the entry and what was expected.
    """


class ReferenceMismatchError(CheckpointError):
    """A delta checkpoint was loaded with a missing or different reference checkpoint."""


class CheckpointIOError(CheckpointError, OSError):
    """The operating system failed to read or write a checkpoint file.

    Also an :class:`OSError`, so ``errno`` stays visible (``ENOSPC``, ``ENOENT``, ...) and
    code that already catches ``OSError`` keeps working; the original error is chained as
    ``__cause__``.
    """


__all__ = [
    "TwTritonError",
    "QuantizationError",
    "CheckpointError",
    "ReferenceMismatchError",
    "CheckpointIOError",
]
