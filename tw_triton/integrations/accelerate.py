"""accelerate loops: tw_triton checkpoints through a :class:`~tw_triton.Checkpointer`.

Why not ``save_state`` / ``load_state`` hooks
    ``Accelerator.register_save_state_pre_hook(hook)`` calls ``hook(models, weights,
    output_dir)`` and ``register_load_state_pre_hook(hook)`` calls ``hook(models,
    input_dir)``: the hooks see the models and their weights only. The optimizers (for
    AdamW two moments per parameter: most of a checkpoint, and what tw_triton's codecs
    shrink most), the LR schedulers, the grad scaler, the RNG states and the samplers are
    then written by accelerate with ``torch.save`` (``optimizer.bin``, ``scheduler.bin``,
    ``random_states_0.pkl``, ...) whatever a hook does; keeping them out would mean
    emptying the accelerator's private lists. A hook could move the model weights alone
    into a tw_triton file, which saves little and splits one checkpoint into two formats.

The route instead
    An accelerate user writes the loop, so the loop calls a Checkpointer, with the
    prepared optimizer and scheduler (they have ``state_dict``/``load_state_dict``) and the
    unwrapped model::

        ckpt = tw_triton.Checkpointer("runs/ckpt", keyframe_every=10)
        save_state(accelerator, ckpt, step, model=model, optimizer=opt, scheduler=sched)
        ...
        state = load_state(accelerator, ckpt, model=model, optimizer=opt, scheduler=sched)
        start = state["step"] + 1

    :func:`save_state` and :func:`load_state` unwrap modules and put back the grad scaler
    of a mixed-precision accelerator; everything else is the Checkpointer's (keyframes,
    deltas, retention, RNG states). Single process only: state sharded or per rank (FSDP,
    DeepSpeed, several processes) is refused with :class:`~tw_triton.errors.TwTritonError`.
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
    scaler = getattr(accelerator, "scaler", None)
    if scaler is not None:
        if SCALER_NAME in out:
            raise TwTritonError(f"{SCALER_NAME!r} is the accelerator's grad scaler here; use another name")
        out[SCALER_NAME] = scaler
    return out


def save_state(accelerator: Any, checkpointer: Checkpointer, step: int, **objects: Any) -> Future:
    """Save ``objects`` (modules unwrapped) and the accelerator's grad scaler at ``step``.

    Returns:
        The Checkpointer's Future (resolves when the file is written).

    Raises:
        TwTritonError: more than one process, or a name clash with ``scaler``.
    """
    _check_single_process(accelerator)
    return checkpointer.save(step, **_objects(accelerator, objects))


def load_state(
    accelerator: Any, checkpointer: Checkpointer, step: int | None = None, **objects: Any
) -> dict[str, Any]:
    """Restore ``objects`` (and the grad scaler, RNG states) from ``step`` (default: latest).

    Returns:
        The loaded state, as :meth:`Checkpointer.restore` (``state["step"]``, ...).
    """
    _check_single_process(accelerator)
    return checkpointer.restore(step, device=accelerator.device, **_objects(accelerator, objects))


__all__ = ["save_state", "load_state"]
