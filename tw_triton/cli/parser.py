"""The argument parser of ``tw``: its commands, options and help texts (docs/cli.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ..codecs.blockwise import check_params
from ..errors import TwTritonError
from ..rules import PRESETS
from .converting import run_convert
from .exits import EPILOG
from .inspecting import run_inspect
from .listing import run_ls
from .verifying import run_export, run_verify


def _block_arg(text: str) -> int:
    try:
        block = int(text)
        check_params(8, block)
    except (ValueError, TwTritonError) as e:
        raise argparse.ArgumentTypeError(f"block must be a power of two from 32 to 4096, got {text!r}") from e
    return block


def _command(sub: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand of ``tw``: its help line, its description, and the exit codes."""
    return sub.add_parser(
        name,
        help=help,
        description=description,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tw``."""
    parser = argparse.ArgumentParser(
        prog="tw",
        description="List Checkpointer directories; inspect, verify, export and convert tw_triton "
        "checkpoints (one safetensors file each, with a JSON manifest).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(
        sub,
        "ls",
        help="the checkpoints of a Checkpointer directory: step, kind, size, reference",
        description="List the complete checkpoint files of a Checkpointer directory, oldest "
        "first: step, kind (keyframe, delta, standalone), size, and the step of the checkpoint "
        "a delta is coded against; then the temp files that interrupted saves left. With "
        "--verify every file is read and its checksums checked, each delta's chain back to its "
        "keyframe too, and the newest checkpoint that can be loaded is named (what "
        "Checkpointer.restore() picks); the exit code is 1 if any checkpoint cannot be loaded.",
    )
    p.add_argument("directory", help="a directory that a Checkpointer writes")
    p.add_argument("--verify", action="store_true", help="read every file and check its checksums and chain")
    p.set_defaults(func=run_ls)

    p = _command(
        sub,
        "inspect",
        help="table of entries: shape, dtype, codec, stored bytes, ratio; totals; reference",
        description="Print the table of a checkpoint's entries from its header (the data is "
        "not read): entry, shape, dtype, codec, stored bytes and compression ratio, the totals, "
        "and the id of the reference checkpoint a delta needs.",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.set_defaults(func=run_inspect)

    p = _command(
        sub,
        "verify",
        help="check checksums, decode every entry, and check the reference",
        description="Check every buffer's checksum (and each compressed buffer's frame), "
        "decode every entry, and for a delta check its reference: REF, or else the file beside "
        "PATH whose checkpoint id is the one the delta names (a closed-loop chain back to its "
        "keyframe), checksums, id and per-tensor fingerprints. A checkpoint that cannot be "
        "loaded is not verified: a delta whose reference is missing exits 1. With "
        "--checksums-only only PATH's checksums are checked (nothing decoded, no reference).",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.add_argument(
        "--reference",
        metavar="REF",
        help="the reference checkpoint of a delta (default: found beside PATH by id)",
    )
    p.add_argument(
        "--checksums-only",
        action="store_true",
        help="check PATH's checksums only: entries are not decoded, the reference not checked",
    )
    p.set_defaults(func=run_verify)

    p = _command(
        sub,
        "export",
        help="write a dequantized, plain safetensors file",
        description="Decode a checkpoint and write its tensors (keys: flattened paths such as "
        "model/encoder.0.weight) to a plain safetensors file that any tool reads. The nested "
        "structure is kept as JSON in the metadata key tw_triton.skeleton.",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.add_argument("out", metavar="OUT.safetensors", help="output file")
    p.add_argument(
        "--reference",
        metavar="REF",
        help="the reference checkpoint of a delta (default: found beside PATH by id)",
    )
    p.set_defaults(func=run_export)

    p = _command(
        sub,
        "convert",
        help="make a tw_triton checkpoint from .safetensors or a weights-only torch file",
        description="Read IN, a .safetensors file or a torch checkpoint, and write a "
        "tw_triton checkpoint OUT. Lossless by default: every tensor is stored exactly "
        "(rules exact, compressed by the entropy stage). --lossy quantizes with the default "
        "rules (large float tensors of the model to int8 blocks; --bits, --block and "
        "--reference tune it), --rules PRESET with a preset; the output says which entries "
        "were quantized. A torch checkpoint is read with torch.load(weights_only=True) - torch's "
        "restricted unpickler that builds only tensors and plain containers; files that need "
        "anything else are refused. This is the only place tw reads a pickle.",
    )
    p.add_argument("input", metavar="IN", help=".safetensors file or weights-only torch checkpoint")
    p.add_argument("output", metavar="OUT", help="tw_triton checkpoint to write")
    p.add_argument(
        "--lossy",
        action="store_true",
        help="quantize with the default rules (lossy; default: lossless, every tensor exact)",
    )
    p.add_argument(
        "--bits",
        type=int,
        default=None,
        choices=(8, 4, 2),
        help="code width when quantizing (default 8; needs --lossy or --rules)",
    )
    p.add_argument(
        "--block",
        type=_block_arg,
        default=None,
        help="elements per scale when quantizing, power of two 32..4096 (default 128; needs "
        "--lossy or --rules)",
    )
    p.add_argument(
        "--reference",
        metavar="REF",
        help="tw_triton checkpoint to store quantized deltas against (needs --lossy or --rules)",
    )
    p.add_argument(
        "--rules",
        metavar="PRESET",
        default=None,
        choices=PRESETS,
        help=f"rules preset: {', '.join(PRESETS)} (default: exact, lossless; --lossy: default)",
    )
    p.set_defaults(func=run_convert)
    return parser


__all__ = ["build_parser"]
