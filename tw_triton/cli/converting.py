"""``tw convert``: a .safetensors or weights-only torch file to a tw_triton checkpoint;
lossless unless quantizing is asked for (docs/cli.md)."""

from __future__ import annotations

import argparse
import os
from typing import Any, TextIO

import torch

from ..codecs import get_codec
from ..errors import QuantizationError, TwTritonError
from ..lowbit import installed_classes
from ..state import quantize_state_dict, save
from .exits import EXIT_OK, UsageError, refuse_overwrite
from .output import ProgressBar, codec_label, plural, say


class ConvertError(TwTritonError):
    """An input of ``tw convert`` that cannot be read."""


def _looks_like_safetensors(path: str) -> bool:
    """Whether ``path`` starts as a safetensors file does (an 8-byte header length that
    fits the file, then a JSON object); a torch file starts with a zip or pickle magic."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return head[8:9] == b"{" and 0 < n <= os.path.getsize(path) - 8


def read_input(path: str) -> Any:
    """The state in ``path``: a safetensors file (by its name or its first bytes), or a
    weights-only torch checkpoint.

    Raises:
        ConvertError: not readable as either, or already a tw_triton checkpoint.
    """
    if path.endswith(".safetensors") or _looks_like_safetensors(path):
        from safetensors import SafetensorError, safe_open
        from safetensors.torch import load_file

        from ..format import is_checkpoint_metadata

        try:
            with safe_open(path, framework="pt") as f:
                if is_checkpoint_metadata(f.metadata()):
                    raise ConvertError(
                        f"{path} is already a tw_triton checkpoint; `tw export` it first to "
                        "re-encode it with other settings"
                    )
            return load_file(path)
        except SafetensorError as e:
            raise ConvertError(f"{path}: not a readable safetensors file: {e}") from e
    import pickle

    try:
        # The one place a torch pickle is read, and only with weights_only=True: torch's
        # restricted unpickler, which builds tensors and containers and nothing else, and
        # the low-bit optimizer states tw_triton stores (its own allowlist, if installed).
        with torch.serialization.safe_globals(installed_classes()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        why = str(e) or ("the file is empty" if os.path.getsize(path) == 0 else type(e).__name__)
        raise ConvertError(f"{path}: not a weights-only torch checkpoint: {why}") from e


def run_convert(args: argparse.Namespace, out: TextIO) -> int:
    """``tw convert IN OUT [--lossy] [--rules PRESET] [--bits] [--block] [--reference]``."""
    rules = convert_rules(args)
    refuse_overwrite(args.output, [args.input, args.reference])
    state = read_input(args.input)
    bar = ProgressBar("convert")
    try:
        qstate = _quantize(args, state, rules, bar)
    finally:
        bar.close()
    size = save(qstate, args.output)
    raw = sum(e.raw_nbytes for e in qstate.entries.values())
    in_size = os.path.getsize(args.input)
    say(
        f"wrote {args.output}: {size} bytes ({in_size / size:.2f}x smaller than "
        f"{args.input}); {len(qstate.entries)} entries, {raw} raw tensor bytes",
        out,
    )
    say(_loss_line(qstate, rules), out)
    return EXIT_OK


def _quantize(args: argparse.Namespace, state: Any, rules: str, bar: ProgressBar) -> Any:
    """``state`` encoded; an error of the state names the input file."""
    try:
        return quantize_state_dict(
            state,
            reference=args.reference,
            rules=rules,
            bits=8 if args.bits is None else args.bits,
            block=128 if args.block is None else args.block,
            progress=bar,
        )
    except QuantizationError as e:
        raise ConvertError(f"{args.input}: cannot be stored: {e}") from e


def convert_rules(args: argparse.Namespace) -> str:
    """The rules preset ``tw convert`` encodes with: ``exact`` (lossless) unless quantizing
    is asked for by name, ``--lossy`` (the default rules) or ``--rules``.

    Raises:
        UsageError: an option that only quantizing uses, without asking to quantize.
    """
    if args.rules is not None:
        if args.lossy and args.rules == "exact":
            raise UsageError("--lossy and --rules exact contradict each other")
        return args.rules
    if args.lossy:
        return "default"
    given = [
        flag
        for flag, value in (("--bits", args.bits), ("--block", args.block), ("--reference", args.reference))
        if value is not None
    ]
    if given:
        raise UsageError(
            f"{' and '.join(given)} only apply when quantizing, which is lossy: add --lossy (or "
            "--rules PRESET); without them tw convert stores every tensor exactly"
        )
    return "exact"


def _loss_line(qstate: Any, rules: str) -> str:
    """What the conversion kept: lossless, or which entries were quantized and how."""
    # Sparse tensors of an exact conversion are bitmask entries: lossless too.
    lossy = {p: e for p, e in qstate.entries.items() if not getattr(get_codec(e.codec), "lossless", False)}
    if not lossy:
        return f"lossless: every tensor stored exactly (rules {rules})"
    codecs = sorted({codec_label(e.codec, e.params) for e in lossy.values()})
    return (
        f"lossy: {len(lossy)} of {plural(len(qstate.entries), 'entry', 'entries')} quantized "
        f"({', '.join(codecs)}; rules {rules}), the rest stored exactly; without --lossy and "
        "--rules, tw convert is lossless"
    )


__all__ = ["ConvertError", "read_input", "run_convert", "convert_rules"]
