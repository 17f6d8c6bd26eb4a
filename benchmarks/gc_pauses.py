"""Python's full garbage collections during a run of saves, with and without ``gc.freeze()``.

    python benchmarks/gc_pauses.py               # MiniLM + AdamW, 24 saves per mode
    python benchmarks/gc_pauses.py --quick       # tiny state, 4 saves (a smoke run)

A training process holds ~170,000 objects that the garbage collector tracks, most of them
from importing torch. A full collection walks them all (75-110 ms on the 2-core VM), and
it runs whenever enough objects have outlived two younger collections, which a save's own
Python objects do. It runs on whichever thread allocates at that moment, often the training
loop inside ``save()``, and stops every thread that holds the GIL while it runs.

``gc.freeze()`` after setup moves every tracked object to a permanent generation that
collections skip. This script saves the same state with a default ``Checkpointer`` in a
fresh process per mode (``default``, then ``frozen``: ``gc.freeze()`` once the state and
the Checkpointer exist) and prints per save the loop's pause, the total, and the full
collections with their time (from ``gc.callbacks``). Results go to
``results/gc_pauses.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_description  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("default", "frozen")


def run_mode(mode: str, saves: int, quick: bool, directory: str) -> dict[str, Any]:
    """In this process: save ``saves`` times and time each save and its full collections."""
    from profile_save_load import _perturb, minilm_shaped_state

    import tw_triton

    torch.set_num_threads(2)
    state, what = minilm_shaped_state(quick)
    ckpt = tw_triton.Checkpointer(directory)
    if mode == "frozen":
        gc.freeze()
    full: list[float] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            full.append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_gc)
    rows = []
    try:
        for step in range(saves):
            _perturb(state)
            full.clear()
            t0 = time.perf_counter()
            future = ckpt.save(step, model=state["model"], optimizer=state["optimizer"])
            t1 = time.perf_counter()
            future.result()
            t2 = time.perf_counter()
            rows.append({"pause_s": t1 - t0, "total_s": t2 - t0, "full_collections": len(full),
                         "full_collection_s": sum(full)})
    finally:
        gc.callbacks.remove(on_gc)
        ckpt.close()
    return {"mode": mode, "state": what, "tracked_objects_frozen": gc.get_freeze_count(), "saves": rows}


def _summary(result: dict[str, Any]) -> dict[str, float]:
    rows = result["saves"][1:] or result["saves"]  # the first fills the snapshot pool: not steady
    return {
        "median_pause_s": statistics.median(r["pause_s"] for r in rows),
        "max_pause_s": max(r["pause_s"] for r in rows),
        "median_total_s": statistics.median(r["total_s"] for r in rows),
        "max_total_s": max(r["total_s"] for r in rows),
        "full_collections": sum(r["full_collections"] for r in rows),
        "full_collection_s_each": (
            sum(r["full_collection_s"] for r in rows) / max(1, sum(r["full_collections"] for r in rows))
        ),
        "first_pause_s": result["saves"][0]["pause_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=None, help="saves per mode (default 24; 4 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny state (a smoke run); writes no results")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    saves = args.saves or (4 if args.quick else 24)
    if args.child:
        print(json.dumps(run_mode(args.child, saves, args.quick, args.dir)))
        return 0
    results = []
    for mode in MODES:
        with tempfile.TemporaryDirectory() as d:
            cmd = [sys.executable, __file__, "--child", mode, "--dir", d, "--saves", str(saves)]
            out = subprocess.run(cmd + (["--quick"] if args.quick else []), check=True,
                                 capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{machine_description()}; {results[0]['state']}; {saves} saves per mode, a fresh process each")
    print("| mode | first pause (s) | median pause (s) | max pause (s) | median total (s) | max total (s) "
          "| full collections | s each |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        s = _summary(r)
        print(f"| {r['mode']} | {s['first_pause_s']:.3f} | {s['median_pause_s']:.3f} | {s['max_pause_s']:.3f} | "
              f"{s['median_total_s']:.3f} | {s['max_total_s']:.3f} | {s['full_collections']} | "
              f"{s['full_collection_s_each']:.4f} |")
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gc_pauses.json").write_text(json.dumps(
            {"machine": machine_description(), "saves": saves, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
