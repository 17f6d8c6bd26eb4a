"""Save and load one state file; the objects a load may decode into.

:func:`save` writes a :class:`~tw_triton.qstate.QuantizedState` atomically through
:func:`tw_triton.format.write_file`; :func:`load` reads one back and decodes it (a delta
against its reference). Why the CPU load reads a reference file on its own thread:
docs/design.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..arguments import as_path
from ..codecs.entropy import EntropyPolicy
from ..errors import QuantizationError, TwTritonError
from ..format import MAX_EXPANSION, one_ring
from ..qstate import QuantizedState
from ..tree import flatten
from .decode import Progress, decode_device, decode_state
from .entries import disjoint_paths, manifest_delta_paths, wants_pinned
from .references import PathLike, read_reference


def save(
    qstate: QuantizedState,
    path: PathLike,
    *,
    fsync: bool = True,
    entropy: str | EntropyPolicy | None = "auto",
) -> int:
    """Write ``qstate`` to one safetensors file at ``path`` (atomically); return its size.

    Buffers on a GPU are copied to the host first. ``entropy`` picks the lossless stage:
    ``"auto"`` (default policy), ``None``/``"none"`` (raw), or an
    :class:`~tw_triton.codecs.entropy.EntropyPolicy`. See :func:`tw_triton.format.write_file`.
    """
    from ..format import write_file

    return write_file(qstate, as_path(path, "path"), fsync=fsync, entropy=entropy)


@one_ring()  # a reference chain's files share one ring of pinned slots
def load(
    path: PathLike,
    *,
    device: torch.device | str = "cpu",
    reference: Any = None,
    verify: bool = True,
    progress: Progress | None = None,
    into: Any = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> Any:
    """Load a checkpoint written by :func:`save` and decode it on ``device``.

    To a CUDA device each buffer is read through a bounded ring of pinned slots
    (:class:`~tw_triton.pinned_memory.PinnedRing`), copied to the device from there and
    decoded there by the Triton kernels. To the CPU, exact tensors are the
    buffers read from the file (no extra copy), and a reference given as a path is read on
    a thread of its own while this file is read and its entries that need no reference
    are decoded.

    Args:
        path: the checkpoint file.
        device: where the tensors go.
        reference: for a delta checkpoint, its reference: a path or a decoded state.
        verify: check per-buffer checksums while reading.
        progress: called as ``progress(done, total)`` after each entry is decoded.
        into: live objects laid out as the saved state (see :func:`decode_targets`):
            on the CPU, their tensors that the file (or, for a delta, its reference file)
            stores exact are filled in place, and the returned state holds them. If the
            load fails part way, they may hold part of what was read.
        max_expansion: the bound on what the compressed buffers of the file (and of a
            reference file given as a path, and of each earlier link of a closed-loop
            chain found beside it) may decode to: ``max_expansion`` times the
            file's size plus :data:`~tw_triton.format.EXPANSION_SLACK_BYTES`, checked before
            anything is decoded (see :func:`~tw_triton.format.read_file`). Raise it, or
            pass ``None``, for a file that stores large constant tensors on purpose.

    Raises:
        CheckpointError: the file is malformed, corrupted, uses an unknown codec, or its
            compressed buffers decode to more than ``max_expansion`` allows.
        ReferenceMismatchError: a delta checkpoint with a missing or different reference.
    """
    from ..format import HeaderCache, read_file, read_manifest

    source = path = as_path(path, "path")
    # CUDA missing is not the file's fault: not a CheckpointError, which callers take for one.
    dev = decode_device("cpu" if device is None else device, source, no_cuda=TwTritonError)
    targets = decode_targets(into) if into is not None and dev.type == "cpu" else None
    headers = HeaderCache()  # the manifest read first is the read's header too
    pending = None
    if dev.type == "cpu" and isinstance(reference, (str, os.PathLike)):
        # A reference file is read while this file is: the delta's manifest names the
        # entries it needs. (Alone, the delta file's hundreds of small buffers run on this
        # thread while a core waits for them.)
        manifest = read_manifest(source, headers=headers)
        delta = manifest_delta_paths(manifest)
        if delta:
            # A reference read from a path takes the targets too: the delta is decoded over them.
            pending = read_reference(
                reference, manifest.get("reference_id"), delta, dev, verify, source, targets, max_expansion
            )
    try:
        qstate = read_file(
            path,
            verify=verify,
            device=dev if wants_pinned(dev) else None,
            into=targets,
            headers=headers,
            max_expansion=max_expansion,
        )
    except BaseException:
        if pending is not None:
            pending.wait()
        raise
    return decode_state(
        qstate,
        pending or reference,
        dev,
        source,
        progress,
        verify,
        False,
        True,
        ref_into=targets,
        max_expansion=max_expansion,
    )


def state_of(value: Any) -> Any:
    """An object's ``state_dict()``, or a plain value (a tensor too) as it is."""
    state_dict = getattr(value, "state_dict", None)
    if callable(state_dict) and not isinstance(value, torch.Tensor):
        return state_dict()
    return value


def decode_targets(into: Any) -> dict[str, torch.Tensor]:
    """The tensors a load may decode into, by the paths of the saved state.

    ``into`` is laid out as the state that was saved: an object with ``state_dict()`` (a
    module, an optimizer) stands for its state dict, at the top or as a value of a dict
    (``{"model": model, "optimizer": opt}`` for ``{"model": model.state_dict(), ...}``);
    plain dicts, lists and tensors stand for themselves. Kept: contiguous CPU tensors of
    the plain ``torch.Tensor`` type (no subclass) that share no memory with another (tied
    weights are left out). A structure the format cannot hold gives none.
    """
    top = state_of(into)
    if isinstance(top, dict):
        top = {k: state_of(v) for k, v in top.items()}
    try:
        tensors, _ = flatten(top)
    except QuantizationError:
        return {}
    # Plain tensors only: a subclass (a DTensor's shard, a wrapper) may not own the memory
    # its data pointer shows; load_state_dict knows how to fill it.
    fit = {
        p: t
        for p, t in tensors.items()
        if type(t) is torch.Tensor and t.device.type == "cpu" and t.is_contiguous() and t.numel()
    }
    return {p: fit[p] for p in disjoint_paths(fit, fit)}
