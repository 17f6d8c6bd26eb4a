"""Checks of the public API's plain arguments: counts, sizes, steps and paths.

A wrongly typed argument is refused with an error of the library's family
(:mod:`tw_triton.errors`) that names the argument and what was expected, instead of a
``TypeError`` from deep inside (``keep_last="3" < 1``, ``os.fspath(3)``). A ``bool`` is not
taken for an integer (``keep_last=True`` is a mistake, not 1), as
:func:`~tw_triton.ops.layout.check_params` refuses ``bits=True`` and
:func:`~tw_triton.format.check_max_expansion` ``max_expansion=True``. Other checks live
beside what they check: rules, bits and block (:func:`~tw_triton.rules.check_rules`),
devices (:func:`~tw_triton.codecs.arguments.parse_device`).
"""

from __future__ import annotations

import operator
import os
from typing import Any

from .errors import CheckpointError, TwTritonError


def as_int(
    value: Any,
    name: str,
    *,
    minimum: int = 0,
    optional: bool = False,
    error: type[TwTritonError] = CheckpointError,
) -> Any:
    """``value`` as an ``int`` (any integer type but ``bool``) at least ``minimum``.

    Args:
        value: the argument.
        name: its name, for the message.
        minimum: the smallest value allowed.
        optional: ``None`` is allowed too (and returned).
        error: what to raise.

    Raises:
        error: not an integer (or ``None`` where ``optional``), or below ``minimum``.
    """
    if value is None and optional:
        return None
    or_none = " or None" if optional else ""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer{or_none}, got {value!r} ({type(value).__name__})") from None
    if number < minimum:
        expected = "non-negative" if minimum == 0 else f"at least {minimum}"
        raise error(f"{name} must be {expected}{or_none}, got {number}")
    return number


def as_path(value: Any, name: str, *, error: type[TwTritonError] = CheckpointError) -> str:
    """``value`` (a ``str`` or an ``os.PathLike`` of one) as a ``str`` path.

    Raises:
        error: anything else (bytes too: names in a directory are matched as ``str``).
    """
    try:
        path = os.fspath(value)
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise error(f"{name} must be a path (a str or os.PathLike), got {value!r} ({type(value).__name__})")
    return path


__all__ = ["as_int", "as_path"]
