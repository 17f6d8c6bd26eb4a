"""The Checkpointer's default rules, ``"auto"``: a preset chosen by the steps between saves.

``smallest`` resumes within the noise floor at saves 5 to 100 steps apart, and on the GPT
trained from scratch at 200; on a long fine-tune saved every 200 steps it ends at the floor,
and ``safe`` (every part at 8 bits) does not. The interval is the steps since the last save
made or restored, or for a first save, since the newest checkpoint before it in the
directory, else since step 0 (:func:`counted_from`). Why, and what was measured: docs/performance.md ("Save
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
# The DistributedCheckpointer's short-interval preset: its chunks are coded on their own, so
# ``smallest``'s first moment in the update's domain (which needs its partner entry) and its
# 2-bit closed-loop weight deltas do not apply to its open-loop deltas.
DCP_SHORT_INTERVAL_PRESET = "small"


def is_auto(rules: Any) -> bool:
    """Whether ``rules`` is ``"auto"``: a preset chosen per save by its interval."""
    return isinstance(rules, str) and rules == AUTO


def rules_at(rules: Any, interval: int | None, *, short: str = SHORT_INTERVAL_PRESET) -> Any:
    """The rules a save codes with, ``interval`` steps after the save before it (``None``:
    unknown): ``rules`` itself unless it is ``"auto"``, then ``short`` below
    :data:`LONG_INTERVAL_STEPS` and :data:`LONG_INTERVAL_PRESET` from there."""
    if not is_auto(rules):
        return rules
    if interval is not None and interval >= LONG_INTERVAL_STEPS:
        return LONG_INTERVAL_PRESET
    return short


def rules_after(rules: Any, step: int, last_step: int | None, *, short: str = SHORT_INTERVAL_PRESET) -> Any:
    """:func:`rules_at` for a save of ``step`` after one of ``last_step`` (the last save
    made or restored; ``None``: none, the interval counts from step 0). A step before
    ``last_step`` (a run gone back) has no interval."""
    interval = step if last_step is None else (step - last_step if step >= last_step else None)
    return rules_at(rules, interval, short=short)


def candidates(rules: Any, *, short: str = SHORT_INTERVAL_PRESET) -> list[Any]:
    """Every rules value ``rules`` may code a save with (two for ``"auto"``)."""
    if is_auto(rules):
        return [short, LONG_INTERVAL_PRESET]
    return [rules]


def counted_from(step: int, steps: Iterable[int]) -> int:
    """The step the first save of a Checkpointer that restored nothing counts its interval
    from: the newest of ``steps`` (the checkpoints in its directory) before ``step``, else
    step 0 (a run starts there: its first save at step 500 of saves 500 apart takes the
    long interval's preset at once, not after a keyframe of the other preset)."""
    return max((s for s in steps if s < step), default=0)


__all__ = [
    "AUTO",
    "DCP_SHORT_INTERVAL_PRESET",
    "LONG_INTERVAL_PRESET",
    "LONG_INTERVAL_STEPS",
    "SHORT_INTERVAL_PRESET",
    "candidates",
    "counted_from",
    "is_auto",
    "rules_after",
    "rules_at",
]
