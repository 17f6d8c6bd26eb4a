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
from .errors import TwTritonError, checkpoint_label
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


def printable(text: str, encoding: str | None = None) -> str:
    """``text`` as a terminal can show it: what is not printable escaped.

    A crafted file's entry names, or a path of non-UTF-8 bytes, may hold lone surrogates,
    control characters or format characters (a terminal escape, a right-to-left override).
    Each becomes a Python-style escape (``\\udc80``, ``\\x1b``), and so does every
    character ``encoding`` (a stream's; ``None``: any) cannot encode, so printing never
    raises ``UnicodeEncodeError`` and never shows a name as something it is not.

    Args:
        text: what to print.
        encoding: the encoding of the stream it goes to, or ``None``.

    Returns:
        The escaped text; ``text`` itself when nothing needs escaping.
    """
    if text.isprintable() and _encodes(text, encoding):
        return text
    return "".join(c if c.isprintable() and _encodes(c, encoding) else _escape(c) for c in text)


def _encodes(text: str, encoding: str | None) -> bool:
    try:
        text.encode(encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _escape(c: str) -> str:
    o = ord(c)
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def _say(line: str, stream: TextIO) -> None:
    """Print one line to ``stream``, escaped for it (see :func:`printable`)."""
    print(printable(line, getattr(stream, "encoding", None)), file=stream)


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
    rows = [tuple(printable(c) for c in r) for r in rows]  # widths of what is shown
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
    checkpoint in it can be loaded (checked only with ``verify``; else ``True``).

    Every checkpoint file is a row, those whose header cannot be read too (a truncated or
    damaged file: its row says why, and with ``verify`` it counts as not loadable).
    """
    from .checkpoint_dir import CheckpointDirectory

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
            row = (str(step), info.kind, _human(info.nbytes), _reference_cell(d, info, step_of, unreadable))
        else:
            row = (str(step), "unreadable", _human(unreadable[step][0]), "?")
        if verify:
            row += ("ok" if problems[step] is None else f"cannot load: {problems[step]}",)
        rows.append(row)
    rows = [tuple(printable(c) for c in r) for r in rows]  # widths of what is shown
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def fmt(r: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in (0, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    listed = len(rows) - 1
    lines = [fmt(r) for r in rows] if listed else []
    total = sum(info.nbytes for info in found.values()) + sum(n for n, _ in unreadable.values())
    lines.append(f"{_plural(listed, 'checkpoint', 'checkpoints')}, {_human(total)} in {directory}")
    if not verify:
        lines += [f"step {step}: its header cannot be read: {why}" for step, (_, why) in sorted(unreadable.items())]
    if not listed and _looks_distributed(directory):
        lines.append("this looks like a DistributedCheckpointer directory (step_*/ folders with "
                     "tw_dcp.json): tw ls lists the files of a Checkpointer")
    temps = d.temp_files()
    if temps:
        lines.append(f"{_plural(len(temps), 'temp file', 'temp files')} of interrupted saves (Checkpointer."
                     f"remove_temp_files() deletes them): " + ", ".join(os.path.basename(t) for t in temps))
    if verify:
        loadable = [s for s in sorted(problems) if problems[s] is None]
        lines.append(f"latest loadable: step {loadable[-1]}" if loadable else "latest loadable: none")
    elif listed:
        lines.append(f"newest: step {max(set(found) | set(unreadable))} (not verified; --verify checks every "
                     "file and chain)")
    return lines, all(p is None for p in problems.values())


def _unreadable_files(d: Any, found: dict[int, Any]) -> dict[int, tuple[int, str]]:
    """The checkpoint files of ``d`` that its listing left out because their header cannot
    be read: by step, their size and why."""
    from .checkpoint_dir import parse_checkpoint_name

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


def _reference_cell(d: Any, info: Any, step_of: dict[str, int], unreadable: dict[int, Any]) -> str:
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
        _say(line, out)
    return EXIT_OK if ok else EXIT_CHECKPOINT


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    for line in inspect_lines(args.path):
        _say(line, out)
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    manifest = read_manifest(args.path)
    count = _plural(len(manifest["entries"]), "entry", "entries")
    if args.checksums_only:
        verify_file(args.path)
        _say(f"{args.path}: checksums OK ({count}; --checksums-only: the entries were not decoded and "
             "the reference was not checked)", out)
        return EXIT_OK
    # The library's verification of every file (each buffer's CRC-32 and, for a staged one,
    # its frame, as `tw ls --verify` and Checkpointer.latest() check), then a load: every
    # entry decoded, and a delta against the reference it names.
    chain = _reference_chain(args.path, manifest, args.reference)
    for path, _ in [(args.path, manifest), *chain]:
        verify_file(path)
    bar = _ProgressBar("verify")
    try:
        load(args.path, reference=chain[0][0] if chain else None, verify=True, progress=bar)
    finally:
        bar.close()
    _say(f"{args.path}: checksums OK, all {count} decode", out)
    if args.reference is not None and not chain:
        _say(f"{args.path}: needs no reference; --reference was not used", out)
    for path, m in chain:
        label = checkpoint_label(m["checkpoint_id"], (m.get("metadata") or {}).get("step"), path)
        _say(f"{args.path}: reference OK: {label}, checksums OK", out)
    return EXIT_OK


def _reference_chain(
    path: str, manifest: dict[str, Any], reference: str | None
) -> list[tuple[str, dict[str, Any]]]:
    """The reference files a load of ``path`` reads, nearest first, with their manifests:
    ``reference`` (``--reference``) or the file beside ``path`` whose checkpoint id is the
    one ``path`` names; then, for a reference that is itself a delta (a closed-loop chain),
    the file beside it that it names, back to a keyframe. ``[]`` for a checkpoint that
    needs no reference."""
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
    from .deltas import missing_reference
    from .errors import ReferenceMismatchError
    from .state import _find_checkpoint

    directory = os.path.dirname(path) or "."
    try:
        return _find_checkpoint(directory, manifest["reference_id"], path)
    except ReferenceMismatchError:
        pass
    error = missing_reference(path, manifest["reference_id"], directory)
    raise ReferenceMismatchError(
        f"{error}. Pass the reference file with --reference REF (tw verify --checksums-only checks "
        "this file alone)"
    )


def _cmd_export(args: argparse.Namespace, out: TextIO) -> int:
    from safetensors.torch import save_file

    manifest = read_manifest(args.path)
    chain = _reference_chain(args.path, manifest, args.reference)
    bar = _ProgressBar("export")
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
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _say(f"wrote {args.out}: {len(plain)} tensors, {os.path.getsize(args.out)} bytes", out)
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
    rules = _convert_rules(args)
    state = _read_input(args.input)
    bar = _ProgressBar("convert")
    try:
        qstate = quantize_state_dict(
            state,
            reference=args.reference,
            rules=rules,
            bits=8 if args.bits is None else args.bits,
            block=128 if args.block is None else args.block,
            progress=bar,
        )
    finally:
        bar.close()
    size = save(qstate, args.output)
    raw = sum(e.raw_nbytes for e in qstate.entries.values())
    in_size = os.path.getsize(args.input)
    _say(
        f"wrote {args.output}: {size} bytes ({in_size / size:.2f}x smaller than "
        f"{args.input}); {len(qstate.entries)} entries, {raw} raw tensor bytes",
        out,
    )
    _say(_loss_line(qstate, rules), out)
    return EXIT_OK


def _convert_rules(args: argparse.Namespace) -> str:
    """The rules preset ``tw convert`` encodes with: ``exact`` (lossless) unless quantizing
    is asked for by name, ``--lossy`` (the default rules) or ``--rules``.

    Raises:
        _UsageError: an option that only quantizing uses, without asking to quantize.
    """
    if args.rules is not None:
        if args.lossy and args.rules == "exact":
            raise _UsageError("--lossy and --rules exact contradict each other")
        return args.rules
    if args.lossy:
        return "default"
    given = [flag for flag, value in (("--bits", args.bits), ("--block", args.block),
                                      ("--reference", args.reference)) if value is not None]
    if given:
        raise _UsageError(
            f"{' and '.join(given)} only apply when quantizing, which is lossy: add --lossy (or "
            "--rules PRESET); without them tw convert stores every tensor exactly"
        )
    return "exact"


def _loss_line(qstate: Any, rules: str) -> str:
    """What the conversion kept: lossless, or which entries were quantized and how."""
    lossy = {p: e for p, e in qstate.entries.items() if e.codec != "exact"}
    if not lossy:
        return f"lossless: every tensor stored exactly (rules {rules})"
    codecs = sorted({_codec_label(e.codec, e.params) for e in lossy.values()})
    return (f"lossy: {len(lossy)} of {_plural(len(qstate.entries), 'entry', 'entries')} quantized "
            f"({', '.join(codecs)}; rules {rules}), the rest stored exactly; without --lossy and "
            "--rules, tw convert is lossless")


class _UsageError(TwTritonError):
    """Arguments that parse but do not go together (exit code 2)."""


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
        description="Check every buffer's checksum (and each compressed buffer's frame), "
        "decode every entry, and for a delta check its reference: REF, or else the file beside "
        "PATH whose checkpoint id is the one the delta names (a closed-loop chain back to its "
        "keyframe), checksums, id and per-tensor fingerprints. A checkpoint that cannot be "
        "loaded is not verified: a delta whose reference is missing exits 1. With "
        "--checksums-only only PATH's checksums are checked (nothing decoded, no reference).",
    )
    p.add_argument("path", help="tw_triton checkpoint file")
    p.add_argument("--reference", metavar="REF",
                   help="the reference checkpoint of a delta (default: found beside PATH by id)")
    p.add_argument("--checksums-only", action="store_true",
                   help="check PATH's checksums only: entries are not decoded, the reference not checked")
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
    p.add_argument("--reference", metavar="REF",
                   help="the reference checkpoint of a delta (default: found beside PATH by id)")
    p.set_defaults(func=_cmd_export)

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
    p.add_argument("--lossy", action="store_true",
                   help="quantize with the default rules (lossy; default: lossless, every tensor exact)")
    p.add_argument("--bits", type=int, default=None, choices=(8, 4, 2),
                   help="code width when quantizing (default 8; needs --lossy or --rules)")
    p.add_argument("--block", type=_block_arg, default=None,
                   help="elements per scale when quantizing, power of two 32..4096 (default 128; needs "
                   "--lossy or --rules)")
    p.add_argument("--reference", metavar="REF",
                   help="tw_triton checkpoint to store quantized deltas against (needs --lossy or --rules)")
    p.add_argument(
        "--rules",
        metavar="PRESET",
        default=None,
        choices=PRESETS,
        help=f"rules preset: {', '.join(PRESETS)} (default: exact, lossless; --lossy: default)",
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
            _say(f"tw {args.command}: error: {value}: no such file", sys.stderr)
            return EXIT_USAGE
    directory = getattr(args, "directory", None)
    if directory is not None and not os.path.isdir(directory):
        _say(f"tw {args.command}: error: {directory}: no such directory", sys.stderr)
        return EXIT_USAGE
    func: Callable[[argparse.Namespace, TextIO], int] = args.func
    try:
        return func(args, out)
    except _UsageError as e:
        _say(f"tw {args.command}: error: {e}", sys.stderr)
        return EXIT_USAGE
    except (TwTritonError, OSError) as e:
        _say(f"tw {args.command}: error: {e}", sys.stderr)
        return EXIT_CHECKPOINT


if __name__ == "__main__":
    sys.exit(main())
