"""``tw ls``: the checkpoints of a Checkpointer directory, optionally verified (docs/cli.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

from ..checkpoint_dir import CheckpointDirectory, parse_checkpoint_name
from ..errors import TwTritonError
from ..format import read_manifest
from ..integrations.hf_pointer import read_pointer
from .exits import EXIT_CHECKPOINT, EXIT_OK
from .output import human, plural, say, table


def list_lines(directory: str, *, verify: bool) -> tuple[list[str], bool]:
    """The ``tw ls`` report of a Checkpointer directory.

    Every checkpoint file is a row, those whose header cannot be read too (a truncated or
    damaged file: its row says why, and with ``verify`` it counts as not loadable).

    Args:
        directory: a directory a Checkpointer writes.
        verify: read every file and check its checksums and chain.

    Returns:
        The lines to print, and whether every checkpoint can be loaded (checked only with
        ``verify``; else ``True``).
    """
    d = CheckpointDirectory(directory)
    found = d.scan()
    unreadable = _unreadable_files(d, found)
    step_of = {info.checkpoint_id: step for step, info in found.items()}
    problems: dict[int, str | None] = {}
    if verify:
        problems = d.problems(verify=True)
        problems.update({step: f"it cannot be read: {why}" for step, (_, why) in unreadable.items()})
    rows = [("step", "kind", "size", "reference") + (("status",) if verify else ())]
    for step in sorted(set(found) | set(unreadable)):
        if step in found:
            info = found[step]
            row = (str(step), info.kind, human(info.nbytes), _reference_cell(d, info, step_of, unreadable))
        else:
            row = (str(step), "unreadable", human(unreadable[step][0]), "?")
        if verify:
            row += ("ok" if problems[step] is None else f"cannot load: {problems[step]}",)
        rows.append(row)

    listed = len(rows) - 1
    lines = table(rows, right={0, 2}) if listed else []
    total = sum(info.nbytes for info in found.values()) + sum(n for n, _ in unreadable.values())
    lines.append(f"{plural(listed, 'checkpoint', 'checkpoints')}, {human(total)} in {directory}")
    if not verify:
        lines += [
            f"step {step}: its header cannot be read: {why}" for step, (_, why) in sorted(unreadable.items())
        ]
    if not listed:
        lines += _other_writers(directory)
    temps = d.temp_files()
    if temps:
        lines.append(
            f"{plural(len(temps), 'temp file', 'temp files')} of interrupted saves (Checkpointer."
            f"remove_temp_files() deletes them): " + ", ".join(os.path.basename(t) for t in temps)
        )
    if verify:
        loadable = [s for s in sorted(problems) if problems[s] is None]
        lines.append(f"latest loadable: step {loadable[-1]}" if loadable else "latest loadable: none")
    elif found:
        # Not an unreadable file's step: that one is known not to load.
        lines.append(f"newest: step {max(found)} (not verified; --verify checks every file and chain)")
    elif listed:
        lines.append("newest: none whose header reads")
    return lines, all(p is None for p in problems.values())


def _unreadable_files(d: CheckpointDirectory, found: dict[int, Any]) -> dict[int, tuple[int, str]]:
    """The checkpoint files of ``d`` that its listing left out because their header cannot
    be read: by step, their size and why."""
    out: dict[int, tuple[int, str]] = {}
    for name in sorted(os.listdir(d.path)):
        step = parse_checkpoint_name(name)
        path = os.path.join(d.path, name)
        if step is None or step in found or not os.path.isfile(path):
            continue
        try:
            read_manifest(path)
            continue  # written since the listing: readable, left to the next ``tw ls``
        except (TwTritonError, OSError) as e:
            out[step] = (os.path.getsize(path), str(e))
    return out


def _reference_cell(
    d: CheckpointDirectory, info: Any, step_of: dict[str, int], unreadable: dict[int, Any]
) -> str:
    """The reference column of a row: ``-``, the step it names, or why that step is not
    listed (its file unreadable, or missing)."""
    if info.reference_id is None:
        return "-"
    if info.reference_id in step_of:
        return f"step {step_of[info.reference_id]}"
    try:
        step = (read_manifest(info.path, headers=d.headers).get("metadata") or {}).get("reference_step")
    except (TwTritonError, OSError):
        step = None  # changed since it was listed: its status says what verifying it found
    if not isinstance(step, int) or isinstance(step, bool):
        return f"missing {info.reference_id}"
    return f"step {step} (unreadable)" if step in unreadable else f"missing: step {step}"


def trainer_folder(directory: str) -> str | None:
    """What a ``TwTrainer`` ``checkpoint-N`` folder holds (the file its pointer names), or
    ``None`` for any other directory (an unreadable pointer included: ``tw`` only reads)."""
    try:
        pointer = read_pointer(directory)
    except TwTritonError:
        return None
    if pointer is None:
        return None
    file, run = pointer["path"], os.path.dirname(pointer["path"])
    return f"a TwTrainer checkpoint folder: its file is {file} (tw inspect {file}; tw ls {run} lists the run)"


def _other_writers(directory: str) -> list[str]:
    """Where the checkpoints are in a directory another writer of tw_triton files made (a
    DistributedCheckpointer's, a TwTrainer output_dir or checkpoint folder, a Lightning
    checkpoint directory)."""
    folder = trainer_folder(directory)
    if folder is not None:
        return [f"this is {folder}"]
    if _looks_distributed(directory):
        return [
            "this looks like a DistributedCheckpointer directory (step_*/ folders with "
            "tw_dcp.json): tw ls lists the files of a Checkpointer"
        ]
    sub = os.path.join(directory, "tw_triton")
    if os.path.isdir(sub) and any(parse_checkpoint_name(n) is not None for n in os.listdir(sub)):
        return [f"this looks like a TwTrainer output_dir: its checkpoints are in {sub} (tw ls {sub})"]
    named = [n for n in sorted(os.listdir(directory)) if _is_checkpoint_file(os.path.join(directory, n))]
    if not named:
        return []
    shown = ", ".join(named[:3]) + (", ..." if len(named) > 3 else "")
    return [
        f"{plural(len(named), 'tw_triton file', 'tw_triton files')} not named as a Checkpointer "
        f"names them: {shown} (tw inspect / tw verify each)"
    ]


def _is_checkpoint_file(path: str) -> bool:
    """Whether ``path`` is a file whose header reads as a tw_triton checkpoint's."""
    if not os.path.isfile(path):
        return False
    try:
        read_manifest(path)
    except (TwTritonError, OSError):
        return False
    return True


def _looks_distributed(directory: str) -> bool:
    """Whether ``directory`` holds a DistributedCheckpointer's step folders."""
    steps = [name for name in os.listdir(directory) if name.startswith("step_")]
    if not steps:
        return False
    from ..dcp.meta import METADATA_NAME  # imports torch.distributed.checkpoint: only here

    return any(os.path.isfile(os.path.join(directory, name, METADATA_NAME)) for name in steps)


def run_ls(args: argparse.Namespace, out: TextIO) -> int:
    """``tw ls DIRECTORY [--verify]``: exit 1 if a checkpoint cannot be loaded."""
    lines, ok = list_lines(args.directory, verify=args.verify)
    for line in lines:
        say(line, out)
    return EXIT_OK if ok else EXIT_CHECKPOINT


__all__ = ["list_lines", "run_ls"]
