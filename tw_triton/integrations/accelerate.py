"""accelerate loops: tw_triton checkpoints through a :class:`~tw_triton.Checkpointer`.

``save_state`` / ``load_state`` hooks of ``Accelerator`` see only the models and their
weights (accelerate still pickles the optimizer and the rest), so the loop calls a
Checkpointer instead::

    save_state(accelerator, ckpt, step, model=model, optimizer=opt, scheduler=sched)
    state = load_state(accelerator, ckpt, model=model, optimizer=opt, scheduler=sched)

:func:`save_state` and :func:`load_state` unwrap modules and add the grad scaler of a
mixed-precision accelerator and the objects registered with
``accelerator.register_for_checkpointing`` (as ``custom_checkpoint_<i>``, accelerate's own
names) and the accelerator's batch counter (``accelerator_step``); single process only (else a :class:`~tw_triton.errors.TwTritonError`). The why:
docs/integrations.md#accelerate.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..errors import TwTritonError
from . import require

require("accelerate", "hf")

SCALER_NAME = "scaler"
CUSTOM_PREFIX = "custom_checkpoint_"
# accelerate's batch counter (accelerator.step), which accelerate's own save_state keeps:
# with gradient accumulation it decides which batches step the optimizer.
STEP_NAME = "accelerator_step"


def _check_single_process(accelerator: Any) -> None:
    if accelerator.num_processes > 1:
        raise TwTritonError(
            f"tw_triton's accelerate helpers save single-process state; this run has "
            f"{accelerator.num_processes} processes (use accelerator.save_state there)"
        )


def _objects(accelerator: Any, objects: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, obj in objects.items():
        out[name] = accelerator.unwrap_model(obj) if isinstance(obj, torch.nn.Module) else obj
    added = {}
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        added[SCALER_NAME] = (scaler, "the accelerator's grad scaler")
    # register_for_checkpointing keeps them here (accelerate's save_state reads the same list).
    for i, obj in enumerate(getattr(accelerator, "_custom_objects", ())):
        added[f"{CUSTOM_PREFIX}{i}"] = (obj, "an object registered for checkpointing")
    for name, (obj, what) in added.items():
        if name in out:
            raise TwTritonError(f"{name!r} is {what} here; use another name")
        out[name] = obj
    return out


def save_state(accelerator: Any, checkpointer: Checkpointer, step: int, **objects: Any) -> Future:
    """Save ``objects`` (modules unwrapped), the accelerator's grad scaler, registered
    objects and batch counter at ``step``.

    Returns:
        The Checkpointer's Future (resolves when the file is written).

    Raises:
        TwTritonError: more than one process, or a name clash with ``scaler``,
            ``custom_checkpoint_<i>`` or ``accelerator_step``.
    """
    _check_single_process(accelerator)
    objects = _objects(accelerator, objects)
    if STEP_NAME in objects:
        raise TwTritonError(f"{STEP_NAME!r} is the accelerator's batch counter here; use another name")
    return checkpointer.save(step, **objects, **{STEP_NAME: int(accelerator.step)})


def load_state(
    accelerator: Any,
    checkpointer: Checkpointer,
    step: int | None = None,
    *,
    allow_optimizer_mismatch: bool = False,
    **objects: Any,
) -> dict[str, Any]:
    """Restore ``objects`` (and the grad scaler, registered objects, RNG states and the
    accelerator's batch counter) from ``step`` (default: latest). ``allow_optimizer_mismatch``:
    as for :meth:`Checkpointer.restore` (the prepared optimizer's class is that of the one it
    wraps).

    Returns:
        The loaded state, as :meth:`Checkpointer.restore` (``state["step"]``, ...).

    Raises:
        CheckpointError: the checkpoint lacks one of these (e.g. an object registered after
            it was saved), or an optimizer of another class, as :meth:`Checkpointer.restore`.
    """
    _check_single_process(accelerator)
    objects = _objects(accelerator, objects)
    state = checkpointer.restore(
        step, device=accelerator.device, allow_optimizer_mismatch=allow_optimizer_mismatch, **objects
    )
    counter = state.get(STEP_NAME)
    if isinstance(counter, int) and not isinstance(counter, bool):
        accelerator.step = counter  # files saved before it was kept leave it as it is
    return state


__all__ = ["save_state", "load_state"]
