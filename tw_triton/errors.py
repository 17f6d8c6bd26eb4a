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


class UnsupportedTensorError(QuantizationError, CheckpointError):
    """A tensor the format cannot hold: a tensor subclass tw_triton does not know (it names
    the path and the type). Both a :class:`QuantizationError` (what a save raises for any
    other unsupported leaf) and a :class:`CheckpointError`."""


class ReferenceMismatchError(CheckpointError):
    """A delta checkpoint was loaded with a missing or different reference checkpoint."""


class CheckpointIOError(CheckpointError, OSError):
    """The operating system failed to read or write a checkpoint file.

    Also an :class:`OSError`, so ``errno`` stays visible (``ENOSPC``, ``ENOENT``, ...) and
    code that already catches ``OSError`` keeps working; the original error is chained as
    ``__cause__``.
    """


def checkpoint_label(checkpoint_id: str | None, step: int | None = None, path: str | None = None) -> str:
    """How a message names a checkpoint: its id, and its step and file where known.

    Ids are opaque hex; a reader looking at a directory knows steps and file names.

    Args:
        checkpoint_id: the checkpoint's id.
        step: its training step (a Checkpointer records it), or ``None``.
        path: its file, or ``None``.

    Returns:
        e.g. ``checkpoint '0a1b...' (step 3, file 'run/step-00000003.tw.safetensors')``.
    """
    known = ([f"step {step}"] if isinstance(step, int) and not isinstance(step, bool) else []) + (
        [f"file {path!r}"] if path is not None else []
    )
    return f"checkpoint {checkpoint_id!r}" + (f" ({', '.join(known)})" if known else "")


__all__ = [
    "checkpoint_label",
    "TwTritonError",
    "QuantizationError",
    "CheckpointError",
    "ReferenceMismatchError",
    "CheckpointIOError",
]
