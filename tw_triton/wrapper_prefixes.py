"""A module's state saved under another wrapper than the module it is restored into.

``torch.compile`` names every key of the module it wraps ``_orig_mod.<key>`` (also inside
a model when a submodule was compiled), and DDP / DataParallel ``module.<key>``. A run is
often restored into a module wrapped otherwise: compiled only after the restore, or
wrapped by DDP on some runs and not others. :func:`rekeyed_for` gives the saved state
under the module's own keys when the two differ by those wrappers alone, so
``load_state_dict`` sees the same weights under the names it expects. Why:
docs/training-loop.md ("Restoring into the objects' own memory").
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILED = "_orig_mod"  # torch.compile's OptimizedModule, anywhere in a key
DATA_PARALLEL = "module"  # DDP / DataParallel, leading a key


def bare_key(key: str) -> str:
    """``key`` without the components the wrappers add."""
    parts = [p for p in key.split(".") if p != COMPILED]
    while len(parts) > 1 and parts[0] == DATA_PARALLEL:
        parts = parts[1:]
    return ".".join(parts)


def rekeyed_for(state: Any, module: Any, *, name: str, source: str) -> Any:
    """``state`` under ``module``'s own keys when its keys differ from them by the
    wrappers alone (each key maps to exactly one); else ``state`` as it is, for
    ``load_state_dict`` to accept or refuse.

    Args:
        state: the state saved under ``name``.
        module: the object it is restored into.
        name, source: for the log line (the state's name and the file).
    """
    if not isinstance(module, torch.nn.Module) or not isinstance(state, Mapping):
        return state
    expected = module.state_dict(keep_vars=True)
    if state.keys() == expected.keys():
        return state
    own = {bare_key(k): k for k in expected}
    saved = {bare_key(k): k for k in state}
    if len(own) != len(expected) or len(saved) != len(state) or own.keys() != saved.keys():
        return state
    rekeyed: OrderedDict[str, Any] = OrderedDict((own[b], state[saved[b]]) for b in saved)
    metadata = getattr(expected, "_metadata", None)
    if metadata is not None:  # the module's own versions: the same classes saved them
        rekeyed._metadata = metadata  # type: ignore[attr-defined]
    logger.info(
        "%s: the state named %r is restored into the %s under its own keys: they differ from the "
        "saved ones only by the prefixes that torch.compile (%s.) and DDP (%s.) add",
        source,
        name,
        type(module).__name__,
        COMPILED,
        DATA_PARALLEL,
    )
    return rekeyed


__all__ = ["bare_key", "rekeyed_for"]
