"""The reference a delta is coded against: in memory, or a checkpoint file (and its chain).

A reference given as a path is read (only the entries a delta needs), decoded against its
own reference where it is itself a delta (found by id beside it, back to a keyframe), and
each reference tensor is checked against the entry it serves (presence, shape, dtype,
fingerprint). Why references are checked this way: docs/design.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..codecs.blockwise import FLOAT_DTYPES
from ..errors import CheckpointError, ReferenceMismatchError, checkpoint_label
from ..format import MAX_EXPANSION
from ..parallel import Background
from ..qstate import QuantizedState
from ..tree import flatten
from . import fingerprints
from .entries import delta_paths, wants_pinned
from .fingerprints import FINGERPRINT_PREFIX

PathLike = str | os.PathLike


def flat_reference(
    reference: Any,
    *,
    device: torch.device | None,
    verify: bool,
    expect_id: str | None = None,
    where: str = "",
    paths: Iterable[str] | None = None,
    into: Mapping[str, torch.Tensor] | None = None,
    max_expansion: float | None = MAX_EXPANSION,
) -> tuple[dict[str, torch.Tensor], str | None, str, bool]:
    """``(tensors by path, checkpoint id or None, description, owned)`` of a reference.

    ``owned``: the tensors were decoded here from a file, so nothing else holds them and a
    delta may be decoded over them.

    For a path, ``expect_id`` (a checkpoint id, not a fingerprint) is checked against the
    reference's manifest before its data is read, and with ``paths`` only those of its
    entries are read and decoded (a delta needs the tensors it is a delta of, not the
    reference's optimizer state); paths the file lacks are left out, for the caller to
    report. ``into``: tensors to read the reference file's exact entries into, and
    ``max_expansion``: the bound on its compressed buffers and on those of every earlier
    link it is decoded against (see :func:`~tw_triton.format.read_file`).
    """
    if isinstance(reference, (str, os.PathLike)):
        from ..format import HeaderCache, read_file, read_manifest

        # A reference file may itself be a delta: decoding it recurses through .decode.
        from .decode import dequantize_entries, dequantize_state_dict

        source = os.fspath(reference)
        headers = HeaderCache()  # the manifest read first is the read's header too
        manifest = read_manifest(reference, headers=headers)
        if expect_id is not None and not expect_id.startswith(FINGERPRINT_PREFIX):
            found = manifest.get("checkpoint_id")
            if found != expect_id:
                found_step = (manifest.get("metadata") or {}).get("step")
                raise ReferenceMismatchError(
                    f"{where} is a delta from reference checkpoint {expect_id!r}, but "
                    f"reference file {source!r} is {checkpoint_label(found, found_step)}"
                )
        wanted = None
        if paths is not None:
            held = set(manifest["entries"]) | set(manifest["aliases"])
            wanted = sorted(p for p in set(paths) if p in held)
        rq = read_file(
            reference,
            verify=verify,
            device=device if wants_pinned(device) else None,
            entries=wanted,
            headers=headers,
            into=into,
            max_expansion=max_expansion,
        )
        prev = None
        if delta_paths(rq, source):
            # A link of a closed-loop chain: it decodes against its own reference, found by
            # checkpoint id among the files beside it (recursively, back to a keyframe).
            prev = find_checkpoint(
                os.path.dirname(source),
                rq.reference_id,
                f"{where or 'quantize_state_dict'}: reference file {source!r}",
                step=(rq.metadata or {}).get("reference_step"),
            )
        if wanted is not None:
            tensors = dequantize_entries(
                rq,
                wanted,
                reference=prev,
                device=device,
                source=source,
                verify=verify,
                release_buffers=True,
                max_expansion=max_expansion,
            )
        else:
            state = dequantize_state_dict(
                rq,
                reference=prev,
                device=device,
                source=source,
                verify=verify,
                release_buffers=True,
                max_expansion=max_expansion,
            )
            tensors, _ = flatten(state)
        return tensors, rq.checkpoint_id, f"reference file {source!r}", True
    tensors, _ = flatten(reference)
    return tensors, None, "the in-memory reference", False


def find_checkpoint(directory: str, checkpoint_id: str | None, where: str, step: Any = None) -> str:
    """The path of the checkpoint file in ``directory`` whose id is ``checkpoint_id``
    (``step``: its step where recorded, for the message).

    Raises:
        ReferenceMismatchError: no readable checkpoint file there has that id.
    """
    from ..format import read_manifest

    directory = directory or "."
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise ReferenceMismatchError(
            f"{where}: cannot list {directory!r} to find checkpoint {checkpoint_id!r}: {e}"
        ) from e
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            if read_manifest(path).get("checkpoint_id") == checkpoint_id:
                return path
        except (CheckpointError, OSError):
            continue  # not a tw_triton checkpoint, or unreadable: not the one
    raise ReferenceMismatchError(
        f"{where} is itself a delta from {checkpoint_label(checkpoint_id, step)}, and no checkpoint "
        f"file in {directory!r} is that checkpoint"
    )


def reference_tensor(
    ref_tensors: dict[str, torch.Tensor], path: str, x_shape: tuple[int, ...], where: str, what: str
) -> torch.Tensor:
    r = ref_tensors.get(path)
    if r is None:
        raise ReferenceMismatchError(f"{where}: entry {path!r} has no tensor in {what}")
    if tuple(r.shape) != tuple(x_shape):
        raise ReferenceMismatchError(
            f"{where}: entry {path!r} has shape {tuple(x_shape)} but {what} has {tuple(r.shape)} there"
        )
    if r.dtype not in FLOAT_DTYPES:
        raise ReferenceMismatchError(
            f"{where}: entry {path!r}: {what} holds a {r.dtype} tensor there, expected a float tensor"
        )
    return r


def read_reference(
    reference: PathLike,
    reference_id: str | None,
    delta: set[str],
    dev: torch.device | None,
    verify: bool,
    where: str,
    into: Mapping[str, torch.Tensor] | None,
    max_expansion: float | None = MAX_EXPANSION,
) -> Background[ReadReference]:
    """Start reading and decoding the tensors of a reference file that ``delta`` needs, on a
    thread of its own (what :func:`checked_reference` then takes)."""
    first = sorted(delta)[0]

    def run() -> ReadReference:
        tensors, _, what, _ = flat_reference(
            reference,
            device=dev,
            verify=verify,
            expect_id=reference_id,
            where=f"{where}: entry {first!r}",
            paths=delta,
            into=into,
            max_expansion=max_expansion,
        )
        return ReadReference(tensors, what)

    return Background(run, name="tw_triton-reference")


@dataclass(frozen=True)
class ReadReference:
    """The tensors of a reference file read by :func:`read_reference` (owned: read for the
    one decode that takes them), and how messages name that file."""

    tensors: dict[str, torch.Tensor]
    what: str


def checked_reference(
    qstate: QuantizedState,
    delta: set[str],
    reference: Any,
    dev: torch.device | None,
    verify: bool,
    where: str,
    into: Mapping[str, torch.Tensor] | None,
    max_expansion: float | None = MAX_EXPANSION,
) -> tuple[dict[str, torch.Tensor], bool]:
    """The reference tensors of the ``delta`` entries, on ``dev``, each checked against its
    entry (presence, shape, dtype, fingerprint), and whether they are owned (read from a
    file). ``reference``: a state, a path, or a :class:`ReadReference`."""
    first = sorted(delta)[0]
    if isinstance(reference, ReadReference):
        ref_tensors, ref_what, owned = reference.tensors, reference.what, True
    else:
        ref_tensors, _, ref_what, owned = flat_reference(
            reference,
            device=dev,
            verify=verify,
            expect_id=qstate.reference_id,
            where=f"{where}: entry {first!r}",
            paths=delta,
            into=into,
            max_expansion=max_expansion,
        )
    rid = qstate.reference_id
    checked: dict[torch.device, list[str]] = {}
    for path in sorted(delta):
        entry = qstate.entries[path]
        r = reference_tensor(ref_tensors, path, tuple(entry.shape), where, ref_what)
        if dev is not None and r.device != dev:
            r = r.to(dev)
        ref_tensors[path] = r
        if "ref_fp" in entry.params:
            checked.setdefault(r.device, []).append(path)
    # One grouped op per device (launches that do not grow with the count of tensors), one
    # read of them all.
    checks: list[tuple[str, torch.Tensor]] = []
    buffers = []
    for device, paths in checked.items():
        out = torch.zeros(len(paths), dtype=torch.int64, device=device)
        ops.fingerprints([ref_tensors[p] for p in paths], out=out)
        buffers.append(out)
        checks += [(p, out[k]) for k, p in enumerate(paths)]
    for (path, _), fp in zip(checks, fingerprints.read_device_scalars([f for _, f in checks], buffers)):
        want = qstate.entries[path].params["ref_fp"]
        if fingerprints.fp_hex(fp) != want:
            raise ReferenceMismatchError(
                f"{where}: entry {path!r} is a delta from reference {rid!r}, but the "
                f"reference tensor given for it differs from the one it was encoded "
                f"against (fingerprint {fingerprints.fp_hex(fp)}, expected {want}); {ref_what} is "
                "not that reference"
            )
    return ref_tensors, owned
