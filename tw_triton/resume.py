"""Loading a Checkpointer's checkpoint, and putting it back into live objects.

:class:`~tw_triton.checkpointer.Checkpointer` ``.load`` and ``.restore`` are these steps
after the saves in flight; the why (what is decoded in place, the RNG states):
docs/training-loop.md.
"""

from __future__ import annotations

from typing import Any

import torch

from .arguments import as_int
from .checkpoint_dir import CheckpointDirectory, CheckpointInfo
from .codecs.arguments import parse_device
from .errors import CheckpointError, TwTritonError
from .format import one_ring
from .optimizer_classes import RESTORE_ADVICE, check_file
from .rng import restore_rng_state
from .state import state_of
from .state.entries import wants_pinned
from .wrapper_prefixes import rekeyed_for

# Names a Checkpointer stores beside the user's own.
RESERVED_NAMES = ("step", "rng")


@one_ring()  # the files of a chain, verified then decoded, share one ring of pinned slots
def load_from(
    directory: CheckpointDirectory,
    step: int | None,
    *,
    device: torch.device | str,
    verify: bool,
    into: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, Any], CheckpointInfo]:
    """Load the checkpoint of ``step`` (``None``: the latest good one) from ``directory``.

    For the latest checkpoint with ``verify``, the files are read once: the reads that
    verified them (checksums checked as they come in) are the ones decoded.

    Args:
        directory: the Checkpointer's directory.
        step: which checkpoint; ``None`` for the latest that verifies.
        device: where the tensors are loaded.
        verify: check the checksums (and, for the latest, pass over checkpoints that fail).
        into: tensors to read exact entries into, by path (CPU only).

    Returns:
        The state as saved, and the info of the file it came from.

    Raises:
        CheckpointError: no good checkpoint, no checkpoint for ``step``, a bad file, or a
            file that is not a Checkpointer's.
    """
    dev = load_device(device, directory.path)  # no CUDA: not a bad file, said first
    step = None if step is None else as_step(step)
    if step is None and verify:
        found, info, reads = directory.latest_read(upload=dev if wants_pinned(dev) else None, into=into)
    else:
        found, info = directory.find(step, verify=verify)
        reads = {}
    state = directory.decode(info, found, reads, dev, verify=verify, into=into)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(
            f"{info.path}: not a Checkpointer checkpoint (expected a dict with 'step' at the top)"
        )
    return state, info


def check_restorable(objects: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` for an object without ``load_state_dict``."""
    for name, obj in objects.items():
        if not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointError(
                f"cannot restore {name!r}: {type(obj).__name__} has no load_state_dict(); "
                f"plain values are in the dict restore() returns"
            )


def restore_into(
    state: dict[str, Any],
    source: str,
    objects: dict[str, Any],
    *,
    rng: bool,
    any_optimizer: bool = False,
    headers: Any = None,
) -> None:
    """Call each object's ``load_state_dict`` with the state saved under its name, and
    (with ``rng``) put back the RNG states. ``headers``: the directory's header cache, for
    the optimizer record's check.

    Raises:
        CheckpointError: ``state`` (read from ``source``) holds no state of that name, no
            RNG states, an optimizer of a class other than the file records (unless
            ``any_optimizer``: :mod:`~tw_triton.optimizer_classes`), or an object's
            ``load_state_dict`` refused its state (a missing or extra key, another shape:
            its error is the cause).
    """
    if not any_optimizer:
        check_file(source, objects, RESTORE_ADVICE, headers)
    for name, obj in objects.items():
        if name not in state:
            saved = sorted(k for k in state if k not in RESERVED_NAMES)
            raise CheckpointError(f"{source}: holds no state named {name!r}; it holds {saved}")
        try:
            obj.load_state_dict(rekeyed_for(state[name], obj, name=name, source=source))
        except TwTritonError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"{source}: the state named {name!r} does not fit the {type(obj).__name__} given "
                f"to restore ({type(err).__name__}: {err})"
            ) from err
    if rng:
        if "rng" not in state:
            raise CheckpointError(f"{source}: holds no RNG states")
        restore_rng_state(state["rng"], source=source)


# Why a module on the meta device cannot be restored into, and what to do instead.
META_ADVICE = (
    "its tensor %r is on the meta device, which holds no data, and load_state_dict does not "
    "fill such tensors; materialize the module first (module.to_empty(device='cpu'), then "
    "restore), or take the state from load() and call "
    "module.load_state_dict(state[name], assign=True)"
)


def as_step(step: Any) -> int:
    """``step`` as a non-negative ``int`` (any integer type but ``bool``), or CheckpointError."""
    return as_int(step, "step")


def load_device(device: Any, directory: str) -> torch.device:
    """``device`` as a :class:`torch.device` for a load from ``directory``: CheckpointError
    naming both for one torch cannot parse, TwTritonError (not a bad file) for CUDA where
    none is available (:func:`~tw_triton.codecs.arguments.parse_device`)."""
    what = f"the checkpoints of {directory!r}"
    return parse_device(device, what, CheckpointError, meta=True, no_cuda=TwTritonError)


def default_device(objects: dict[str, Any], device: Any = None, directory: str = "") -> torch.device:
    """Where a restore loads to: ``device`` if given (checked, see :func:`load_device`),
    else the device of the first parameter of the object named ``model`` (or of any module
    given), else the CPU.

    Raises:
        CheckpointError: the meta device, given or where a module's tensors are:
            ``load_state_dict`` cannot fill tensors that hold no data.
    """
    for name, obj in objects.items():
        held = obj.state_dict(keep_vars=True).items() if isinstance(obj, torch.nn.Module) else ()
        on_meta = next((key for key, t in held if isinstance(t, torch.Tensor) and t.is_meta), None)
        if on_meta is not None:
            raise CheckpointError(f"cannot restore {name!r} from {directory!r}: {META_ADVICE % on_meta}")
    if device is not None:
        dev = load_device(device, directory)
        if dev.type == "meta":
            raise CheckpointError(
                f"cannot restore from {directory!r} to device {device!r}: the meta device holds no data"
            )
        return dev
    candidates = [objects["model"]] if "model" in objects else []
    candidates += [o for o in objects.values() if isinstance(o, torch.nn.Module)]
    for obj in candidates:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                return p.device
    return torch.device("cpu")


def named_state(state: dict[str, Any]) -> dict[str, Any]:
    """What ``save(**state)`` stores under each name, after checking the reserved names."""
    for name in RESERVED_NAMES:
        if name in state:
            raise CheckpointError(
                f"'{name}' is a reserved name in a checkpoint (it holds the "
                f"{'step number' if name == 'step' else 'RNG states'}); use another name"
            )
    return {name: state_of(value) for name, value in state.items()}
