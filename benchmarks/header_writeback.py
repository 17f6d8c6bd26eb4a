"""The file header's cost and early writeback, each against the code path without it, in one run.

    python benchmarks/header_writeback.py            # MiniLM + AdamW (the bench extra), ~1 minute
    python benchmarks/header_writeback.py --quick    # a tiny state, a few saves (a smoke run)

Two measurements, both on the state of ``profile_save_load.py`` (MiniLM + AdamW after one
step, or its look-alike without the ``bench`` extra):

* **header**: a default ``Checkpointer`` writes a keyframe and a delta; the delta's header
  is then encoded (``format._encode_header``) and read back (``format._read_layout``)
  ``--repeats`` times, best of them. Beside them, the same header encoded with
  ``json.dumps`` per string (what ``format._json`` does), as the header was written before
  ``_quote``: the same bytes (checked), the difference is the encoder objects.
* **writeback**: ``--saves`` keyframe saves of one process with the ``sync_file_range``
  hint on and off by turns (``tw_triton.writeback``); each save's time from the end of its
  header's encoding to the file's rename, which is its write and fsync. Medians per side.
  Off Linux (no hint) both sides are the same code.

Prints a markdown table; times depend on the disk and the machine (named in the output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tw_triton  # noqa: E402
from tw_triton import format as fmt  # noqa: E402
from tw_triton.format import writeback  # noqa: E402
from _common import fmt_table, machine_description  # noqa: E402
from profile_save_load import _perturb, minilm_shaped_state  # noqa: E402


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The shortest of ``repeats`` timed calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class _Spy:
    """Keeps the last QuantizedState that ``format.write_file`` was given."""

    def __init__(self) -> None:
        self.qstate: Any = None
        self._real = fmt.write_file

    def __call__(self, qstate: Any, path: Any, **kwargs: Any) -> int:
        self.qstate = qstate
        return self._real(qstate, path, **kwargs)


def header_times(state: dict[str, Any], directory: Path, repeats: int) -> dict[str, Any]:
    """Encode and read times of a delta's header (see the module docstring)."""
    spy = _Spy()  # the Checkpointer and its writer call format.write_file through the module
    fmt.write_file = spy
    try:
        with tw_triton.Checkpointer(directory / "header", async_write=False) as ckpt:
            ckpt.save(0, **state).result()
            _perturb(state)
            ckpt.save(1, **state).result()
    finally:
        fmt.write_file = spy._real
    plan = fmt._plan(spy.qstate, "bench", None)
    header = fmt._encode_header(plan, "bench")
    quote = fmt._quote
    fmt._quote = fmt._json  # json.dumps per string: the header as it was written before
    try:
        assert fmt._encode_header(plan, "bench") == header
        per_call = best_of(lambda: fmt._encode_header(plan, "bench"), repeats)
    finally:
        fmt._quote = quote
    path = directory / "header.tw"
    fmt.write_file(spy.qstate, path, fsync=False)

    def read() -> None:
        with open(path, "rb") as f:
            fmt._read_layout(f, str(path))

    return {
        "buffers": len(plan.buffers),
        "header_bytes": len(header),
        "encode_json_dumps_s": per_call,
        "encode_s": best_of(lambda: fmt._encode_header(plan, "bench"), repeats),
        "read_layout_s": best_of(read, repeats),
    }


def writeback_times(state: dict[str, Any], directory: Path, saves: int) -> dict[str, list[float]]:
    """Write-and-fsync seconds of keyframe saves, hint on and off by turns."""
    times: dict[bool, list[float]] = {True: [], False: []}
    marks: dict[str, float] = {}
    real_encode, real_replace, real_can = fmt._encode_header, os.replace, fmt.can_start_writeback
    hint = {"on": True}

    def encode(plan: Any, path: str) -> bytes:
        out = real_encode(plan, path)
        marks["start"] = time.perf_counter()
        return out

    def replace(src: Any, dst: Any) -> None:
        marks["end"] = time.perf_counter()
        real_replace(src, dst)

    fmt._encode_header, os.replace = encode, replace
    fmt.can_start_writeback = lambda: hint["on"] and real_can()
    try:
        with tw_triton.Checkpointer(directory / "writeback", keyframe_every=1, keep_last=2) as ckpt:
            ckpt.prepare(**state)
            for step in range(saves):
                hint["on"] = step % 2 == 0
                ckpt.save(step, **state).result()
                times[hint["on"]].append(marks["end"] - marks["start"])
                time.sleep(0.2)  # the disk settles between saves, as between a loop's saves
    finally:
        fmt._encode_header, os.replace, fmt.can_start_writeback = real_encode, real_replace, real_can
    return {"hint": times[True], "no hint": times[False]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny state, a few saves")
    parser.add_argument("--repeats", type=int, default=None, help="header timings, best of (default 30)")
    parser.add_argument("--saves", type=int, default=None, help="keyframe saves, both sides (default 16)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 30)
    saves = args.saves or (4 if args.quick else 16)
    state, what = minilm_shaped_state(quick=args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        head = header_times(state, Path(tmp), repeats)
        wb = writeback_times(state, Path(tmp), saves)
    print(f"Machine: {machine_description()}")
    print(f"State: {what}")
    print(f"Early writeback available here: {writeback.can_start_writeback()}\n")
    print(fmt_table(
        ["delta header", "buffers", "bytes", "encode, json.dumps per string (ms)", "encode (ms)", "read_layout (ms)"],
        [["best of %d" % repeats, head["buffers"], head["header_bytes"], f"{1000 * head['encode_json_dumps_s']:.2f}",
          f"{1000 * head['encode_s']:.2f}", f"{1000 * head['read_layout_s']:.2f}"]],
    ))
    print()
    print(fmt_table(
        ["keyframe write + fsync", "saves", "median (ms)", "each (ms)"],
        [[side, len(v), f"{1000 * statistics.median(v):.1f}", " ".join(f"{1000 * x:.0f}" for x in v)]
         for side, v in wb.items()],
    ))


if __name__ == "__main__":
    main()
