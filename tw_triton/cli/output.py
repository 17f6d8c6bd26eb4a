"""What ``tw`` prints: escaped text, sizes, counts, codec labels and a progress bar.

Every line a command prints goes through :func:`say`, so a crafted file's names can neither
break the output nor pass for something else (see docs/cli.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO


class ProgressBar:
    """A few lines of progress on stderr, drawn only when stderr is a terminal.

    Args:
        label: the word in front of the bar (``convert``).
        stream: where to draw (default: ``sys.stderr``).
    """

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
        """End the bar's line, if one was drawn."""
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


def say(line: str, stream: TextIO) -> None:
    """Print one line to ``stream``, escaped for it (see :func:`printable`)."""
    print(printable(line, getattr(stream, "encoding", None)), file=stream)


def table(rows: list[Sequence[str]], right: set[int]) -> list[str]:
    """``rows`` (the first one the heading) as aligned lines, escaped.

    Args:
        rows: the cells of each row.
        right: the columns aligned right.

    Returns:
        One line per row; widths are those of the escaped cells.
    """
    shown = [tuple(printable(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in shown) for i in range(len(shown[0]))]

    def line(r: Sequence[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    return [line(r) for r in shown]


def human(n: float) -> str:
    """A byte count as ``12 B``, ``3.4 KiB`` ... ``5.6 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def plural(n: int, one: str, many: str) -> str:
    """``1 entry``, ``2 entries``."""
    return f"{n} {one if n == 1 else many}"


def _width(params: dict[str, Any]) -> str:
    """``int3`` for 4-bit codes that use -3..3 only (``qmax`` 3), else ``int<bits>``."""
    bits, qmax = params.get("bits"), params.get("qmax")
    if qmax is None or (isinstance(bits, int) and qmax == (1 << (bits - 1)) - 1):
        return f"int{bits}"
    return "int3" if (bits, qmax) == (4, 3) else f"int{bits} qmax {qmax}"


def codec_label(codec: str, params: dict[str, Any]) -> str:
    """A codec and its parameters in a few characters: ``int8/128 delta``, ``exact``."""
    if codec == "blockwise":
        return f"{_width(params)}/{params.get('block')}" + (" delta" if params.get("delta") else "")
    if codec == "blockwise-update":
        partner = str(params.get("partner", "")).rpartition("/")[2]
        return f"update {_width(params)}/{params.get('block')} by {partner}"
    if codec in ("log2", "log2-temporal"):
        label = f"{codec} {params.get('bits')}/{params.get('block')}"
        return label + (" delta" if params.get("delta") else "")
    if not params:
        return codec
    shown = {k: v for k, v in params.items() if k != "ref_fp"}
    return f"{codec} {json.dumps(shown, separators=(',', ':'))}" if shown else codec
