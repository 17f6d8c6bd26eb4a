"""``tw verify`` and ``tw export``: decode a checkpoint, with the reference chain a delta
needs found beside it by checkpoint id (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, TextIO

import torch

from ..codecs import get_codec
from ..deltas import missing_reference
from ..errors import CheckpointIOError, ReferenceMismatchError, checkpoint_label
from ..format import read_manifest, verify_file
from ..state import find_checkpoint, load
from ..tree import flatten
from .exits import EXIT_OK, refuse_overwrite
from .output import ProgressBar, plural, say


def run_verify(args: argparse.Namespace, out: TextIO) -> int:
    """``tw verify PATH [--reference REF] [--checksums-only]``."""
    manifest = read_manifest(args.path)
    count = plural(len(manifest["entries"]), "entry", "entries")
    if args.checksums_only:
        verify_file(args.path)
        say(
            f"{args.path}: checksums OK ({count}; --checksums-only: the entries were not decoded and "
            "the reference was not checked)",
            out,
        )
        return EXIT_OK
    # The library's verification of every file (each buffer's CRC-32 and, for a staged one,
    # its frame, as `tw ls --verify` and Checkpointer.latest() check), then a load: every
    # entry decoded, and a delta against the reference it names.
    chain = reference_chain(args.path, manifest, args.reference)
    for path, _ in [(args.path, manifest), *chain]:
        verify_file(path)
    bar = ProgressBar("verify")
    try:
        load(args.path, reference=chain[0][0] if chain else None, verify=True, progress=bar)
    finally:
        bar.close()
    say(f"{args.path}: checksums OK, all {count} decode", out)
    if args.reference is not None and not chain:
        say(f"{args.path}: needs no reference; --reference was not used", out)
    for path, m in chain:
        label = checkpoint_label(m["checkpoint_id"], (m.get("metadata") or {}).get("step"), path)
        say(f"{args.path}: reference OK: {label}, checksums OK", out)
    return EXIT_OK


def run_export(args: argparse.Namespace, out: TextIO) -> int:
    """``tw export PATH OUT.safetensors [--reference REF]``."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    manifest = read_manifest(args.path)
    chain = reference_chain(args.path, manifest, args.reference)
    refuse_overwrite(args.out, [args.path, *(path for path, _ in chain)])
    bar = ProgressBar("export")
    try:
        state = load(args.path, reference=chain[0][0] if chain else None, verify=True, progress=bar)
    finally:
        bar.close()
    tensors, _ = flatten(state)
    # safetensors refuses tensors that share memory: tied weights are written once per key.
    plain: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, t in tensors.items():
        ptr = t.untyped_storage().data_ptr() if t.numel() else -1
        plain[k] = t.clone() if ptr in seen or not t.is_contiguous() else t
        seen.add(ptr)
    meta = {
        "format": "pt",
        "tw_triton.source_checkpoint": manifest["checkpoint_id"],
        "tw_triton.skeleton": json.dumps(manifest["skeleton"]),
    }
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        save_file(plain, tmp, metadata=meta)
        os.replace(tmp, args.out)
    except OSError as e:
        raise CheckpointIOError(e.errno, f"cannot write {args.out}: {e.strerror}") from e
    except SafetensorError as e:
        raise CheckpointIOError(f"cannot write {args.out}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    say(f"wrote {args.out}: {len(plain)} tensors, {os.path.getsize(args.out)} bytes", out)
    return EXIT_OK


def _is_delta(manifest: dict[str, Any]) -> bool:
    for entry in manifest["entries"].values():
        codec = get_codec(entry["codec"])
        if codec is not None and codec.uses_reference(entry["params"]):
            return True
    return False


def reference_chain(
    path: str, manifest: dict[str, Any], reference: str | None
) -> list[tuple[str, dict[str, Any]]]:
    """The reference files a load of ``path`` reads, nearest first, with their manifests.

    ``reference`` (``--reference``) or the file beside ``path`` whose checkpoint id is the
    one ``path`` names; then, for a reference that is itself a delta (a closed-loop chain),
    the file beside it that it names, back to a keyframe.

    Args:
        path: the checkpoint file.
        manifest: its manifest.
        reference: the file ``--reference`` names, or ``None``.

    Returns:
        ``[(path, manifest), ...]``; ``[]`` for a checkpoint that needs no reference.
    """
    chain: list[tuple[str, dict[str, Any]]] = []
    current, current_manifest = path, manifest
    while _is_delta(current_manifest):
        found = reference if not chain and reference is not None else _find_beside(current, current_manifest)
        if any(os.path.samefile(found, p) for p, _ in chain):
            break  # a cycle: the load names it
        found_manifest = read_manifest(found)
        chain.append((found, found_manifest))
        if found_manifest["checkpoint_id"] != current_manifest["reference_id"]:
            break  # a wrong --reference: the load names the mismatch
        current, current_manifest = found, found_manifest
    return chain


def _find_beside(path: str, manifest: dict[str, Any]) -> str:
    """The file beside the delta ``path`` that is the checkpoint it names, by checkpoint id
    (never a file whose id differs): the lookup a load does for each link of a chain.

    Raises:
        ReferenceMismatchError: no file there is that checkpoint; names its step, the file a
            Checkpointer gives that step and why that file is not it, and ``--reference``.
    """
    directory = os.path.dirname(path) or "."
    try:
        return find_checkpoint(directory, manifest["reference_id"], path)
    except ReferenceMismatchError:
        pass
    error = missing_reference(path, manifest["reference_id"], directory)
    raise ReferenceMismatchError(
        f"{error}. Pass the reference file with --reference REF (tw verify --checksums-only checks "
        "this file alone)"
    )


__all__ = ["run_verify", "run_export", "reference_chain"]
