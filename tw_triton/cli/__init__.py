"""The ``tw`` command: list a Checkpointer directory; inspect, verify, export and convert
tw_triton checkpoints.

Run ``tw --help`` or ``tw COMMAND --help``; also ``python -m tw_triton`` (or
``python -m tw_triton.cli``). :func:`main` returns the exit code (:mod:`.exits`): 0 success,
1 a checkpoint that is invalid or cannot be loaded, 2 a usage error. Every command is a
module here (:mod:`.listing`, :mod:`.inspecting`, :mod:`.verifying`, :mod:`.converting`);
all output is escaped by :mod:`.output`. The why: docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import TextIO

from ..errors import TwTritonError
from .exits import EXIT_CHECKPOINT, EXIT_OK, EXIT_USAGE, UsageError
from .inspecting import inspect_lines
from .listing import list_lines, trainer_folder
from .output import ProgressBar, printable, say
from .parser import build_parser


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    """Run ``tw``.

    Args:
        argv: the arguments (default: the process arguments).
        stdout: where the report goes (default: ``sys.stdout``); errors go to stderr.

    Returns:
        The exit code.
    """
    out = stdout if stdout is not None else sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    for name in ("path", "input", "reference"):
        value = getattr(args, name, None)
        if value is not None and not os.path.isfile(value):
            why = "is a directory, not a checkpoint file" if os.path.isdir(value) else "no such file"
            folder = trainer_folder(value) if os.path.isdir(value) else None
            why += f"; {folder}" if folder is not None else ""
            say(f"tw {args.command}: error: {value}: {why}", sys.stderr)
            return EXIT_USAGE
    directory = getattr(args, "directory", None)
    if directory is not None and not os.path.isdir(directory):
        why = "not a directory" if os.path.exists(directory) else "no such directory"
        say(f"tw {args.command}: error: {directory}: {why}", sys.stderr)
        return EXIT_USAGE
    func: Callable[[argparse.Namespace, TextIO], int] = args.func
    try:
        return func(args, out)
    except UsageError as e:
        say(f"tw {args.command}: error: {e}", sys.stderr)
        return EXIT_USAGE
    except (TwTritonError, OSError) as e:
        say(f"tw {args.command}: error: {e}", sys.stderr)
        return EXIT_CHECKPOINT


__all__ = [
    "main",
    "build_parser",
    "EXIT_OK",
    "EXIT_CHECKPOINT",
    "EXIT_USAGE",
    "ProgressBar",
    "printable",
    "inspect_lines",
    "list_lines",
]
