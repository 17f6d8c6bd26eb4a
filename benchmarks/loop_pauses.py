"""How long does each save pause a real training loop, first save included?

``speed_compare.py`` times one save per fresh process, after a ``gc.collect()``: it
measures the save, not what else lands in it. A training loop does not collect before it
saves, and Python's full garbage collection (which stops every thread) runs when the
objects made since the last one have piled up: in a process that has just imported
transformers and built a model, that is early in the run. This script trains MiniLM
(contrastive steps on the fixed sentences of ``harness/minilm.py``, AdamW) in a fresh process per
run and saves at steps 1, 3, 5 and 7, timing every save call and every full collection
(``gc.callbacks``). Modes:

* ``torch.save``: ``torch.save`` of model and optimizer state, then fsync (it blocks for
  the whole write);
* ``tw``: a default ``Checkpointer``, no ``prepare``;
* ``tw + prepare``: the same, with ``Checkpointer.prepare`` after the first optimizer step
  (as ``TwTrainer`` and the Lightning callback do).

The modes take turns, ``--runs`` times each. Prints a table and writes
``results/loop_pauses.json`` and ``results/loop_pauses.md``.

    python benchmarks/loop_pauses.py --runs 4      # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODES = ("torch.save", "tw", "tw + prepare")
STEPS = 8
SAVE_AT = (1, 3, 5, 7)


def child(mode: str, directory: Path, threads: int) -> dict[str, Any]:
    """Train in this process and time every save of ``mode``; return the timings."""
    import torch

    torch.set_num_threads(threads)
    from harness.minilm import SENTENCES, contrastive_step, load_minilm

    from tw_triton import Checkpointer

    model, tokenizer = load_minilm()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    half = len(SENTENCES) // 2
    left, right = list(SENTENCES[0::2][:half]), list(SENTENCES[1::2][:half])
    ckpt = Checkpointer(directory, keep_last=2) if mode != "torch.save" else None

    collections: list[list[float]] = []  # [start, seconds] of each full collection

    def timed(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            collections.append([time.perf_counter(), 0.0])
        else:
            collections[-1][1] = time.perf_counter() - collections[-1][0]

    gc.callbacks.append(timed)
    saves: list[dict[str, float]] = []
    step_s: list[float] = []
    for step in range(STEPS):
        t0 = time.perf_counter()
        contrastive_step(model, tokenizer, opt, left, right)
        opt.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - t0)
        if mode == "tw + prepare" and step == 0:
            ckpt.prepare(model=model, optimizer=opt)
        if step in SAVE_AT:
            t0 = time.perf_counter()
            if ckpt is not None:
                ckpt.save(step, model=model, optimizer=opt)
            else:
                path = directory / f"step-{step}.pt"
                with open(path, "wb") as f:
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())
            saves.append({"step": step, "start": t0, "pause_s": time.perf_counter() - t0})
    if ckpt is not None:
        ckpt.close()
    gc.callbacks.remove(timed)
    for s in saves:
        end = s["start"] + s["pause_s"]
        s["full_gc_s"] = sum(d for start, d in collections if s["start"] <= start <= end)
        del s["start"]
    return {
        "mode": mode,
        "saves": saves,
        "full_gcs_s": [d for _, d in collections],
        "median_step_s": statistics.median(step_s[1:]),
    }


def run_child(mode: str, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--child",
                mode,
                "--dir",
                tmp,
                "--threads",
                str(threads),
            ],
            capture_output=True,
            text=True,
            cwd=HERE,
            check=False,
            env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        )
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the first save's pause, the later saves' pauses, and full collections."""
    out: dict[str, Any] = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        first = [r["saves"][0]["pause_s"] for r in rs]
        later = [s["pause_s"] for r in rs for s in r["saves"][1:]]
        out[mode] = {
            "runs": len(rs),
            "first_pause_median_s": statistics.median(first),
            "first_pause_max_s": max(first),
            "later_pause_median_s": statistics.median(later),
            "later_pause_max_s": max(later),
            "saves_with_a_full_gc": sum(1 for r in rs for s in r["saves"] if s["full_gc_s"] > 0),
            "saves": sum(len(r["saves"]) for r in rs),
            "full_gcs_in_runs": sum(len(r["full_gcs_s"]) for r in rs),
            "median_step_s": statistics.median(r["median_step_s"] for r in rs),
        }
    return out


def table(summary: dict[str, Any]) -> str:
    rows = [
        "| mode | first save: median / max pause (s) | later saves: median / max pause (s) "
        "| saves with a full GC inside | full GCs in the runs | training step (s) |",
        "|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        rows.append(
            f"| {mode} | {s['first_pause_median_s']:.3f} / {s['first_pause_max_s']:.3f} | "
            f"{s['later_pause_median_s']:.3f} / {s['later_pause_max_s']:.3f} | "
            f"{s['saves_with_a_full_gc']} of {s['saves']} | {s['full_gcs_in_runs']} | {s['median_step_s']:.3f} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.threads)))
        return
    runs = []
    for rnd in range(args.runs):
        for mode in MODES:
            r = run_child(mode, args.threads)
            runs.append(r)
            print(
                f"run {rnd} {mode}: pauses "
                + " ".join(
                    f"{s['pause_s']:.3f}" + (f" (full GC {s['full_gc_s']:.3f})" if s["full_gc_s"] else "")
                    for s in r["saves"]
                ),
                flush=True,
            )
    summary = summarize(runs)
    text = table(summary)
    print(text)
    if args.no_write:
        return
    import torch

    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} torch thread(s)"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "loop_pauses.json").write_text(
        json.dumps({"machine": machine, "runs": runs, "summary": summary}, indent=1) + "\n"
    )
    (RESULTS / "loop_pauses.md").write_text(
        "# Save pauses in a MiniLM training loop\n\n"
        f"Written by `python benchmarks/loop_pauses.py --runs {args.runs}`. Machine: {machine}; "
        "a fresh process per run, the modes by turns. Each run trains MiniLM + AdamW for "
        f"{STEPS} contrastive steps and saves at steps {', '.join(map(str, SAVE_AT))}; a save's "
        "pause is the wall time of the save call, and a full garbage collection counts as inside a "
        "save when it starts during it (`gc.callbacks`). No `gc.collect()` before the saves: "
        "what a loop meets is measured.\n\n" + text + "\n"
    )
    print(f"wrote {RESULTS / 'loop_pauses.md'}")


if __name__ == "__main__":
    main()
