"""The class of each optimizer a checkpoint was saved from, and the check on restore.

torch's ``Optimizer.load_state_dict`` takes the state of any optimizer over the same
parameter groups: an AdamW checkpoint restored into an SGD (or an Adam) raises nothing, and
training goes on with state of the wrong kind. So a :class:`~tw_triton.Checkpointer`'s
save records, in the file's manifest metadata under ``"optimizers"``, the class of each
object saved that is a torch optimizer, by the name it was saved under
(``{"optimizer": "torch.optim.AdamW"}``: :func:`class_record`), and a restore, or a load
into objects, refuses an optimizer that is not of that class or a subclass of it
(:func:`check_classes`). A file without the record (written before it) is not checked.
The file names a class as text only: nothing is imported. Why this rule for subclasses,
and what the integrations do: docs/training-loop.md ("Restoring another optimizer").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import format as _format
from .checkpoint_dir import CheckpointDirectory
from .errors import CheckpointError
from .skeleton import short_repr
from .state import decode_targets

# The manifest metadata key of the record.
METADATA_KEY = "optimizers"

# What a refused restore, and a refused load into objects, tell the user to do.
RESTORE_ADVICE = (
    "to switch optimizers, restore without it (restore(model=model, ...)) and let it start "
    "afresh, or pass allow_optimizer_mismatch=True to load the saved state into it anyway"
)
LOAD_ADVICE = "leave it out of into= (the state is returned all the same)"


def optimizer_of(obj: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer ``obj`` is, or wraps as its ``optimizer`` attribute (accelerate's
    ``AcceleratedOptimizer``, whose ``state_dict()`` is the wrapped one's); ``None`` for an
    object that is not a torch optimizer."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        inner = getattr(obj, "optimizer", None) if isinstance(obj, torch.optim.Optimizer) else None
        if not isinstance(inner, torch.optim.Optimizer) or inner is obj:
            break
        obj = inner
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def class_name(cls: type) -> str:
    """The name a file records for ``cls``: ``torch.optim.<Name>`` for a class torch.optim
    exports (so that torch moving it between its own modules changes nothing), else
    ``<module>.<qualified name>``."""
    if getattr(torch.optim, cls.__name__, None) is cls:
        return f"torch.optim.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def accepted_names(cls: type) -> list[str]:
    """The recorded names an optimizer of class ``cls`` may restore: its own and those of
    its bases up to the first that torch.optim exports. torch's own optimizers are distinct
    algorithms even where torch derives one from another (AdamW from Adam)."""
    names = []
    for base in cls.__mro__:
        names.append(class_name(base))
        if getattr(torch.optim, base.__name__, None) is base:
            break
    return names


def class_record(objects: Mapping[str, Any]) -> dict[str, str]:
    """What a save records: the class name of each torch optimizer in ``objects``, by name."""
    record = {}
    for name, obj in objects.items():
        opt = optimizer_of(obj)
        if opt is not None:
            record[name] = class_name(type(opt))
    return record


def recorded(metadata: Any, source: str) -> dict[str, str]:
    """The record in a file's manifest ``metadata`` (``{}`` where there is none).

    Raises:
        CheckpointError: a record that is not a map of names to class names.
    """
    record = metadata.get(METADATA_KEY) if isinstance(metadata, dict) else None
    if record is None:
        return {}
    if not isinstance(record, dict) or not all(isinstance(v, str) for v in record.values()):
        raise CheckpointError(
            f"{source}: metadata {METADATA_KEY!r} must map names to class names, found {short_repr(record)}"
        )
    return record


def mismatches(record: Mapping[str, str], objects: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """``{name: (class saved, class given)}`` for each optimizer in ``objects`` that the
    ``record`` says was saved from a class it is not (see :func:`accepted_names`)."""
    found = {}
    for name, obj in objects.items():
        opt = optimizer_of(obj)
        if opt is not None and name in record and record[name] not in accepted_names(type(opt)):
            found[name] = (record[name], class_name(type(opt)))
    return found


def check_classes(metadata: Any, source: str, objects: Mapping[str, Any], advice: str) -> None:
    """Refuse the optimizers of ``objects`` that the file ``source`` was not saved from.

    Args:
        metadata: the file's manifest metadata.
        source: the file, for the message.
        objects: what the state is going into, by the names it was saved under.
        advice: what the message tells the user to do instead.

    Raises:
        CheckpointError: naming the file, the state's name, the class saved and the one given.
    """
    for name, (saved, given) in mismatches(recorded(metadata, source), objects).items():
        raise CheckpointError(
            f"{source}: the state named {name!r} was saved from a {short_repr(saved)} optimizer, "
            f"and the optimizer given is a {given!r}, neither that class nor a subclass of it "
            f"(torch would load it without a word, and training would go on with state of the "
            f"wrong kind); {advice}"
        )


def check_file(path: str, objects: Mapping[str, Any], advice: str, headers: Any = None) -> None:
    """:func:`check_classes` of the checkpoint file ``path`` (its header only), if
    ``objects`` holds an optimizer (a file's record matters to nothing else)."""
    if class_record(objects):
        check_classes(_format.read_manifest(path, headers=headers).get("metadata"), path, objects, advice)


def targets_of(directory: CheckpointDirectory, objects: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """:func:`~tw_triton.state.decode_targets` of ``objects`` less the optimizers that some
    checkpoint of ``directory`` records another class for: a load decodes into these
    before it knows which file it loads (the newest that verifies), and an optimizer it
    then refuses must be left as it was."""
    refused: set[str] = set()
    for info in directory.scan().values() if class_record(objects) else ():
        try:
            metadata = _format.read_manifest(info.path, headers=directory.headers).get("metadata")
            refused |= set(mismatches(recorded(metadata, info.path), objects))
        except (CheckpointError, OSError):  # the load passes it over, or names what is wrong
            refused |= set(class_record(objects))
    return decode_targets({name: obj for name, obj in objects.items() if name not in refused})


__all__ = [
    "LOAD_ADVICE",
    "METADATA_KEY",
    "RESTORE_ADVICE",
    "accepted_names",
    "check_classes",
    "check_file",
    "class_name",
    "class_record",
    "mismatches",
    "optimizer_of",
    "recorded",
    "targets_of",
]
