"""The Checkpointer's default rules, ``"auto"``: a preset chosen by the steps between saves.

``smallest`` resumes within the noise floor at saves 5 to 100 steps apart, and on the GPT
trained from scratch at 200; on a long fine-tune saved every 200 steps it ends at the floor,
and ``safe`` (every part at 8 bits) does not. The interval is the steps since the last save
made or restored, or for a first save, since the newest checkpoint before it in the
directory (:func:`counted_from`). Why, and what was measured: docs/performance.md ("Save
intervals").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

AUTO = "auto"
SHORT_INTERVAL_PRESET = "smallest"
LONG_INTERVAL_PRESET = "safe"
# Saves at least this many steps apart take LONG_INTERVAL_PRESET: on the fine-tune smallest
# measured 0.14x, 0.69x and 1.11x of its floor at 50, 100 and 200 steps; switching at 100
# keeps a margin (where between 100 and 200 it reaches the floor is not measured).
LONG_INTERVAL_STEPS = 100


def is_auto(rules: Any) -> bool:
    """Whether ``rules`` is ``"auto"``: a preset chosen per save by its interval."""
    return isinstance(rules, str) and rules == AUTO


def rules_at(rules: Any, interval: int | None) -> Any:
    """The rules a save codes with, ``interval`` steps after the save before it (``None``:
    unknown): ``rules`` itself unless it is ``"auto"``."""
    if not is_auto(rules):
        return rules
    if interval is not None and interval >= LONG_INTERVAL_STEPS:
        return LONG_INTERVAL_PRESET
    return SHORT_INTERVAL_PRESET


def candidates(rules: Any) -> list[Any]:
    """Every rules value ``rules`` may code a save with (two for ``"auto"``)."""
    if is_auto(rules):
        return [SHORT_INTERVAL_PRESET, LONG_INTERVAL_PRESET]
    return [rules]


def counted_from(step: int, steps: Iterable[int]) -> int:
    """The step the first save of a Checkpointer that restored nothing counts its interval
    from: the newest of ``steps`` (the checkpoints in its directory) before ``step``. With
    none, ``step`` itself: no interval is known, and an interval of 0 takes the short
    interval's preset, as ``None`` does in :func:`rules_at`; never the steps since step 0
    (a first save at step 1000 of saves 50 apart is not 1000 steps after anything)."""
    return max((s for s in steps if s < step), default=step)


__all__ = [
    "AUTO",
    "LONG_INTERVAL_PRESET",
    "LONG_INTERVAL_STEPS",
    "SHORT_INTERVAL_PRESET",
    "candidates",
    "counted_from",
    "is_auto",
    "rules_at",
]
