"""The ``tw`` command: list a Checkpointer directory; inspect, verify, export and convert
tw_triton checkpoints.

Run ``tw --help`` or ``tw COMMAND --help``. Also runnable as ``python -m tw_triton`` (or
``python -m tw_triton.cli``); ``tw --version`` prints the version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Sequence, TextIO

import torch

from .codecs import get_codec
from .errors import TwTritonError
from .codecs.blockwise import check_params
from .format import read_manifest, verify_file
from .rules import PRESETS
from .state import load, quantize_state_dict, save
from .tree import flatten

EXIT_OK = 0
EXIT_CHECKPOINT = 1
EXIT_USAGE = 2

_EPILOG = """\
exit codes:
  0  success
  1  the checkpoint is invalid, corrupted, or its reference is missing or different
     (also: an input that cannot be converted, an I/O failure)
  2  usage error: bad arguments, or an input file that does not exist
"""


class _ProgressBar:
    """A few lines of progress on stderr, drawn only when stderr is a terminal."""

    WIDTH = 30

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total <= 0:
            return
        filled = self.WIDTH * done // total
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {done}/{total}")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _plural(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _codec_label(codec: str, params: dict[str, Any]) -> str:
    if codec == "blockwise":
        label = f"int{params.get('bits')}/{params.get('block')}"
        return label + (" delta" if params.get("delta") else "")
    if not params:
        return codec
    shown = {k: v for k, v in params.items() if k != "ref_fp"}
    return f"{codec} {json.dumps(shown, separators=(',', ':'))}" if shown else codec


def _entry_sizes(entry: dict[str, Any]) -> tuple[int, int, int]:
    """Bytes of the original tensor, of the codec's buffers, and stored in the file (after
    the entropy stage)."""
    from .format import BUFFER_DTYPES, ENTRY_DTYPES

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
    """The ``tw inspect`` report of a checkpoint, as lines (reads the header only)."""
    manifest = read_manifest(path)
    entries = manifest["entries"]
    aliases = manifest["aliases"]
    # coded: the codec's buffers; stored: the same after the entropy stage, in the file;
    # ratio: the original tensor over what is stored.
    rows = [("entry", "shape", "dtype", "codec", "stage", "coded", "stored", "ratio")]
    total_raw = total_coded = total_stored = 0
    for name, entry in entries.items():
        raw, coded, stored = _entry_sizes(entry)
        total_raw += raw
        total_coded += coded
        total_stored += stored
        shape = "x".join(map(str, entry["shape"])) or "scalar"
        ratio = f"{raw / stored:.2f}x" if stored else "-"
        rows.append((name, shape, entry["dtype"], _codec_label(entry["codec"], entry["params"]),
                     _stage_label(entry), _human(coded), _human(stored), ratio))
    for name, target in aliases.items():
        rows.append((name, "", "", f"alias of {target}", "-", "0 B", "0 B", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {5, 6, 7}

    def fmt(r: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    size = os.path.getsize(path)
    header = _header_bytes(path)
    ratio = f"{total_raw / total_stored:.2f}x" if total_stored else "-"
    lines = [
        f"checkpoint  {manifest['checkpoint_id']}  ({manifest['format']} v{manifest['version']})",
        f"reference   {manifest['reference_id'] or 'none (self-contained)'}",
        f"file        {size} bytes = {header} header + {total_stored} data",
        "",
        fmt(rows[0]),
        *[fmt(r) for r in rows[1:]],
        "",
        f"total       {_plural(len(entries), 'entry', 'entries')} + "
        f"{_plural(len(aliases), 'alias', 'aliases')}: "
        f"{_human(total_raw)} raw -> {_human(total_coded)} coded -> "
        f"{_human(total_stored)} stored ({ratio})",
    ]
    return lines


def _is_delta(manifest: dict[str, Any]) -> bool:
    for name, entry in manifest["entries"].items():
        codec = get_codec(entry["codec"])
        if codec is not None and codec.uses_reference(entry["params"]):
            return True
    return False


def list_lines(directory: str, *, verify: bool) -> tuple[list[str], bool]:
    """The ``tw ls`` report of a Checkpointer directory, as lines, and whether every
    checkpoint in it can be loaded (checked only with ``verify``; else ``True``)."""
    from .checkpoint_dir import CheckpointDirectory

    d = CheckpointDirectory(directory)
    found = d.scan()
    step_of = {info.checkpoint_id: step for step, info in found.items()}
    problems = d.problems(verify=verify) if verify else {}
    rows = [("step", "kind", "size", "reference") + (("status",) if verify else ())]
    for step in sorted(found):
        info = found[step]
        ref = "-" if info.reference_id is None else (
            f"step {step_of[info.reference_id]}" if info.reference_id in step_of else f"missing {info.reference_id}"
        )
        row = (str(step), info.kind, _human(info.nbytes), ref)
        if verify:
            row += ("ok" if problems[step] is None else f"cannot load: {problems[step]}",)
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def fmt(r: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in (0, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    lines = [fmt(r) for r in rows] if found else []
    total = sum(info.nbytes for info in found.values())
    lines.append(f"{_plural(len(found), 'checkpoint', 'checkpoints')}, {_human(total)} in {directory}")
    if not found and _looks_distributed(directory):
        lines.append("this looks like a DistributedCheckpointer directory (step_*/ folders with "
                     "tw_dcp.json): tw ls lists the files of a Checkpointer")
    temps = d.temp_files()
    if temps:
        lines.append(f"{_plural(len(temps), 'temp file', 'temp files')} of interrupted saves (Checkpointer."
                     f"remove_temp_files() deletes them): " + ", ".join(os.path.basename(t) for t in temps))
    if verify:
        loadable = [s for s in sorted(found) if problems[s] is None]
        lines.append(f"latest loadable: step {loadable[-1]}" if loadable else "latest loadable: none")
    elif found:
        lines.append(f"newest: step {max(found)} (not verified; --verify checks every file and chain)")
    return lines, all(p is None for p in problems.values())


def _looks_distributed(directory: str) -> bool:
    """Whether ``directory`` holds a DistributedCheckpointer's step folders."""
    steps = [name for name in os.listdir(directory) if name.startswith("step_")]
    if not steps:
        return False
    from .dcp._meta import METADATA_NAME  # imports torch.distributed.checkpoint: only here

    return any(os.path.isfile(os.path.join(directory, name, METADATA_NAME)) for name in steps)


def _cmd_ls(args: argparse.Namespace, out: TextIO) -> int:
    lines, ok = list_lines(args.directory, verify=args.verify)
    for line in lines:
        print(line, file=out)
    return EXIT_OK if ok else EXIT_CHECKPOINT


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    for line in inspect_lines(args.path):
        print(line, file=out)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    manifest = read_manifest(args.path)
    bar = _ProgressBar("verify")
    try:
        if _is_delta(manifest) and args.reference is None:
            verify_file(args.path)
            print(f"{args.path}: checksums OK ({len(manifest['entries'])} entries)", file=out)
            print(
                f"{args.path}: delta from reference {manifest['reference_id']}; reference not "
                "checked (pass --reference REF)",
                file=out,
            )
            return EXIT_OK
        # A full load checks checksums, every codec and entry, and the reference.
        load(args.path, reference=args.reference, verify=True, progress=bar)
    finally:
        bar.close()
    print(f"{args.path}: checksums OK, all {len(manifest['entries'])} entries decode", file=out)
    if args.reference is not None and _is_delta(manifest):
        print(f"{args.path}: reference OK ({manifest['reference_id']})", file=out)
    return EXIT_OK


def _cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from safetensors.torch import save_file

    manifest = read_manifest(args.path)
    bar = _ProgressBar("export")
    try:
        state = load(args.path, reference=args.reference, verify=True, progress=bar)
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
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    print(f"wrote {args.out}: {len(plain)} tensors, {os.path.getsize(args.out)} bytes", file=out)
    return EXIT_OK


def _read_input(path: str) -> Any:
    if path.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        from .format import MANIFEST_KEY

        try:
            with safe_open(path, framework="pt") as f:
                if MANIFEST_KEY in (f.metadata() or {}):
                    raise _ConvertError(
                        f"{path} is already a tw_triton checkpoint; `tw export` it first to "
                        "re-encode it with other settings"
                    )
            return load_file(path)
        except SafetensorError as e:
            raise _ConvertError(f"{path}: not a readable safetensors file: {e}") from e
    import pickle

    try:
        # The one place a torch pickle is read, and only with weights_only=True: torch's
        # restricted unpickler, which builds tensors and containers and nothing else.
        return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise _ConvertError(f"{path}: not a weights-only torch checkpoint: {e}") from e


class _ConvertError(TwTritonError):
    """An input of ``tw convert`` that cannot be read."""


def _cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    state = _read_input(args.input)
    bar = _ProgressBar("convert")
    try:
        qstate = quantize_state_dict(
            state,
            reference=args.reference,
            rules=args.rules,
            bits=args.bits,
            block=args.block,
            progress=bar,
        )
    finally:
        bar.close()
    size = save(qstate, args.output)
    raw = sum(e.raw_nbytes for e in qstate.entries.values())
    in_size = os.path.getsize(args.input)
    print(
        f"wrote {args.output}: {size} bytes ({in_size / size:.2f}x smaller than "
        f"{args.input}); {len(qstate.entries)} entries, {raw} raw tensor bytes",
        file=out,
    )
    return EXIT_OK


def _block_arg(text: str) -> int:
    try:
        block = int(text)
        check_params(8, block)
    except (ValueError, TwTritonError) as e:
        raise argparse.ArgumentTypeError(f"block must be a power of two from 32 to 4096, got {text!r}") from e
    return block


def _command(sub: Any, name: str, *, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand of ``tw``: its help line, its description, and the exit codes."""
    return sub.add_parser(name, help=help, description=description, epilog=_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``tw``."""
    parser = argparse.ArgumentParser(
        prog="tw",
        description="List Checkpointer directories; inspect, verify, export and convert tw_triton "
        "checkpoints (one safetensors file each, with a JSON manifest).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from . import __version__

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
    p.set_defaults(func=_cmd_ls)

    p = _command(
        sub,
        "inspect",
        help="table of entries: shape, dtype, codec, stored bytes, ratio; totals; reference",
        description="Print the table of a checkpoint's entries from its header (the data is "
        "not read): entry, shape, dtype, codec, stored bytes and compression ratio, the totals, "
        "and the id of the reference checkpoint a delta needs.",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.set_defaults(func=_cmd_inspect)

    p = _command(
        sub,
        "verify",
        help="check checksums, decode every entry, and check the reference",
        description="Check every buffer's checksum and decode every entry. For a delta "
        "checkpoint, --reference also checks that REF is the checkpoint it was encoded "
        "against (id and per-tensor fingerprints); without it the reference is not checked.",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.add_argument("--reference", metavar="REF", help="the reference checkpoint of a delta")
    p.set_defaults(func=_cmd_verify)

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
    p.add_argument("--reference", metavar="REF", help="the reference checkpoint (needed for a delta)")
    p.set_defaults(func=_cmd_export)

    p = _command(
        sub,
        "convert",
        help="make a tw_triton checkpoint from .safetensors or a weights-only torch file",
        description="Read IN, a .safetensors file or a torch checkpoint, and write a "
        "tw_triton checkpoint OUT with the default rules (large float tensors of the model "
        "quantized). A torch checkpoint is read with torch.load(weights_only=True) - torch's "
        "restricted unpickler that builds only tensors and plain containers; files that need "
        "anything else are refused. This is the only place tw reads a pickle.",
    )
    p.add_argument("input", metavar="IN", help=".safetensors file or weights-only torch checkpoint")
    p.add_argument("output", metavar="OUT", help="tw_triton checkpoint to write")
    p.add_argument("--bits", type=int, default=8, choices=(8, 4, 2), help="code width (default 8)")
    p.add_argument("--block", type=_block_arg, default=128, help="elements per scale, power of two 32..4096 (default 128)")
    p.add_argument("--reference", metavar="REF", help="tw_triton checkpoint to store deltas against")
    p.add_argument(
        "--rules",
        metavar="PRESET",
        default=None,
        choices=PRESETS,
        help=f"rules preset: {', '.join(PRESETS)} (default: default)",
    )
    p.set_defaults(func=_cmd_convert)
    return parser


def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    """Run ``tw`` with ``argv`` (default: the process arguments); return the exit code."""
    out = stdout if stdout is not None else sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    for name in ("path", "input", "reference"):
        value = getattr(args, name, None)
        if value is not None and not os.path.isfile(value):
            print(f"tw {args.command}: error: {value}: no such file", file=sys.stderr)
            return EXIT_USAGE
    directory = getattr(args, "directory", None)
    if directory is not None and not os.path.isdir(directory):
        print(f"tw {args.command}: error: {directory}: no such directory", file=sys.stderr)
        return EXIT_USAGE
    func: Callable[[argparse.Namespace, TextIO], int] = args.func
    try:
        return func(args, out)
    except TwTritonError as e:
        print(f"tw {args.command}: error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT
    except OSError as e:
        print(f"tw {args.command}: error: {e}", file=sys.stderr)
        return EXIT_CHECKPOINT


if __name__ == "__main__":
    sys.exit(main())
