"""``tw inspect``: the table of a checkpoint's entries, from its header alone (docs/cli.md)."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, TextIO

from ..format import BUFFER_DTYPES, ENTRY_DTYPES, read_manifest
from .exits import EXIT_OK
from .output import codec_label, human, plural, say, table


def _entry_sizes(entry: dict[str, Any]) -> tuple[int, int, int]:
    """Bytes of the original tensor, of the codec's buffers, and stored in the file (after
    the entropy stage)."""
    dtype = ENTRY_DTYPES[entry["dtype"]]
    raw = math.prod(entry["shape"]) * dtype.itemsize
    buffers = entry["buffers"].values()
    coded = sum(math.prod(b["shape"]) * BUFFER_DTYPES[b["dtype"]].itemsize for b in buffers)
    stored = sum(b["data_offsets"][1] - b["data_offsets"][0] for b in buffers)
    return raw, coded, stored


def _stage_label(entry: dict[str, Any]) -> str:
    """``buffer:stage`` for each staged buffer (``codes:zstd``), ``-`` when all are raw."""
    staged = [f"{n}:{b['stage']['name']}" for n, b in entry["buffers"].items() if "stage" in b]
    return ",".join(staged) or "-"


def _header_bytes(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def inspect_lines(path: str) -> list[str]:
    """The ``tw inspect`` report of a checkpoint, as lines (reads the header only).

    Args:
        path: a tw_triton checkpoint file.

    Returns:
        The lines to print, unescaped.
    """
    manifest = read_manifest(path)
    entries = manifest["entries"]
    aliases = manifest["aliases"]
    # coded: the codec's buffers; stored: the same after the entropy stage, in the file;
    # ratio: the original tensor over what is stored; bits/el: stored bits per element
    # (a temporal moment's changes come to a fraction of a bit after the stage).
    rows = [("entry", "shape", "dtype", "codec", "stage", "coded", "stored", "ratio", "bits/el")]
    total_raw = total_coded = total_stored = 0
    for name, entry in entries.items():
        raw, coded, stored = _entry_sizes(entry)
        total_raw += raw
        total_coded += coded
        total_stored += stored
        shape = "x".join(map(str, entry["shape"])) or "scalar"
        ratio = f"{raw / stored:.2f}x" if stored else "-"
        numel = math.prod(entry["shape"])
        rows.append(
            (
                name,
                shape,
                entry["dtype"],
                codec_label(entry["codec"], entry["params"]),
                _stage_label(entry),
                human(coded),
                human(stored),
                ratio,
                f"{8 * stored / numel:.3g}" if numel else "-",
            )
        )
    for name, target in aliases.items():
        rows.append((name, "", "", f"alias of {target}", "-", "0 B", "0 B", "-", "-"))

    size = os.path.getsize(path)
    header = _header_bytes(path)
    ratio = f"{total_raw / total_stored:.2f}x" if total_stored else "-"
    return [
        f"checkpoint  {manifest['checkpoint_id']}  ({manifest['format']} v{manifest['version']})",
        f"reference   {manifest['reference_id'] or 'none (self-contained)'}",
        f"file        {size} bytes = {header} header + {total_stored} data",
        "",
        *table(rows, right={5, 6, 7, 8}),
        "",
        f"total       {plural(len(entries), 'entry', 'entries')} + "
        f"{plural(len(aliases), 'alias', 'aliases')}: "
        f"{human(total_raw)} raw -> {human(total_coded)} coded -> "
        f"{human(total_stored)} stored ({ratio})",
    ]


def run_inspect(args: argparse.Namespace, out: TextIO) -> int:
    """``tw inspect PATH``."""
    for line in inspect_lines(args.path):
        say(line, out)
    return EXIT_OK


__all__ = ["inspect_lines", "run_inspect"]
