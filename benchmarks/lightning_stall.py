"""How long a Lightning ``save_checkpoint`` call holds up training: stock vs TwCheckpointIO.

A Lightning-shaped checkpoint dict (``state_dict`` of three fp32 matrices, AdamW's
``optimizer_states`` with both moments, loop counters) is saved ``--saves`` times through
each plugin, every method in a fresh subprocess, methods taking turns for ``--repeats``
rounds. Between saves the plugin's pending write is waited for outside the timed region,
as in a loop whose saves are further apart than a write takes. Reported per method: the
pause of the first save of the process and the median pause of the others.

Methods:

* ``stock``: Lightning's ``TorchCheckpointIO`` (``torch.save`` inline, no fsync);
* ``tw``: :class:`~tw_triton.integrations.lightning.TwCheckpointIO` as constructed by
  default (async writer, snapshot pool);
* ``tw after prepare``: the same, :meth:`~tw_triton.integrations.lightning.TwCheckpointIO.prepare`
  called before the first save (what ``TwPrepareFirstSave`` does after the first batch);
* ``tw, no pool``: the same with ``snapshot_pool_bytes=0``, every copy in fresh memory.

    python benchmarks/lightning_stall.py               # 3 x (2048 x 4096) weights: 288 MiB with AdamW
    python benchmarks/lightning_stall.py --quick       # tiny, for the tests

Writes ``benchmarks/results/lightning_stall.md`` (not with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
METHODS = ("stock", "tw", "tw after prepare", "tw, no pool")


def checkpoint_dict(rows: int, cols: int, count: int) -> dict[str, Any]:
    """What Lightning hands ``save_checkpoint``: weights, AdamW state, counters."""
    g = torch.Generator().manual_seed(0)
    weights = OrderedDict((f"net.{i}.weight", torch.randn(rows, cols, generator=g)) for i in range(count))
    state = {i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(rows, cols, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(rows, cols, generator=g) * 1e-6} for i in range(count)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01, "params": list(range(count))}]
    return {"epoch": 0, "global_step": 10, "state_dict": weights,
            "optimizer_states": [{"state": state, "param_groups": groups}]}


def make_io(method: str) -> Any:
    if method == "stock":
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        return TorchCheckpointIO()
    from tw_triton.integrations.lightning import TwCheckpointIO

    return TwCheckpointIO(snapshot_pool_bytes=0 if method == "tw, no pool" else None)  # "tw", "tw after prepare"


def child(method: str, rows: int, cols: int, count: int, saves: int) -> dict[str, Any]:
    """Run one method's saves in this process; return its pauses in seconds."""
    ckpt = checkpoint_dict(rows, cols, count)
    io = make_io(method)
    if method == "tw after prepare":
        io.prepare(ckpt)
    pauses = []
    with tempfile.TemporaryDirectory() as out:
        for k in range(saves):
            ckpt["global_step"] = 10 + k
            t0 = time.perf_counter()
            io.save_checkpoint(ckpt, f"{out}/step={k}.ckpt")
            pauses.append(time.perf_counter() - t0)
            if hasattr(io, "flush"):
                io.flush()  # outside the timed region: the writer is idle at the next save
        if hasattr(io, "teardown"):
            io.teardown()
    nbytes = sum(t.nbytes for t in ckpt["state_dict"].values()) * 3
    return {"pauses_s": pauses, "state_bytes": nbytes}


def run(rows: int, cols: int, count: int, saves: int, repeats: int) -> dict[str, Any]:
    """Every method ``repeats`` times, each in a fresh subprocess, methods alternating."""
    per: dict[str, list[list[float]]] = {m: [] for m in METHODS}
    state_bytes = 0
    for _ in range(repeats):
        for method in METHODS:
            cmd = [sys.executable, __file__, "--child", method, "--shape", f"{rows}x{cols}x{count}",
                   "--saves", str(saves)]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            per[method].append(got["pauses_s"])
            state_bytes = got["state_bytes"]
    rows_out = []
    for method in METHODS:
        firsts = [p[0] for p in per[method]]
        later = [statistics.median(p[1:]) for p in per[method] if len(p) > 1]
        rows_out.append({"method": method, "first_s": statistics.median(firsts),
                         "later_s": statistics.median(later) if later else None})
    stock = rows_out[0]
    for r in rows_out:
        r["first_vs_stock"] = r["first_s"] / stock["first_s"]
        r["later_vs_stock"] = r["later_s"] / stock["later_s"] if r["later_s"] and stock["later_s"] else None
    return {"state_bytes": state_bytes, "shape": [rows, cols, count], "saves": saves, "repeats": repeats,
            "rows": rows_out, "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__}


def table(result: dict[str, Any]) -> str:
    lines = ["| plugin | first save blocks | vs stock | later saves block (median) | vs stock |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        later = f"{1e3 * r['later_s']:.1f} ms" if r["later_s"] is not None else "-"
        ratio = f"{r['later_vs_stock']:.2f}" if r["later_vs_stock"] is not None else "-"
        lines.append(f"| {r['method']} | {1e3 * r['first_s']:.1f} ms | {r['first_vs_stock']:.2f} | {later} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny state, 1 round, nothing written")
    parser.add_argument("--saves", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="2048x4096x3", help="rows x cols x matrices")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows, cols, count = (int(v) for v in args.shape.split("x"))
    if args.child:
        print(json.dumps(child(args.child, rows, cols, count, args.saves)))
        return
    if args.quick:
        rows, cols, count, args.saves, args.repeats = 256, 256, 2, 3, 1
    result = run(rows, cols, count, args.saves, args.repeats)
    text = table(result)
    print(text)
    if args.quick:
        return
    page = "\n".join([
        "# Lightning: how long a save holds up training",
        "",
        f"Machine: {result['machine']}; torch {result['torch']}. State: {count} fp32 matrices of "
        f"{rows} x {cols} with AdamW's two moments, {result['state_bytes'] / 2**20:.0f} MiB. "
        f"{result['saves']} saves per process (the writer idle at each), each method in a fresh "
        f"process, methods alternating, {result['repeats']} rounds; medians.",
        "",
        "Command: `python benchmarks/lightning_stall.py`",
        "",
        text,
        "",
        "`stock` writes inline without fsync; the tw rows copy the state and write (with fsync) "
        "on a background thread. The first save of a process copies into fresh memory either "
        "way unless `prepare` reserved it; later ones reuse the pool's buffers unless `snapshot_pool_bytes=0`.",
        "",
    ])
    (HERE / "results" / "lightning_stall.md").write_text(page, encoding="utf-8")
    (HERE / "results" / "lightning_stall.json").write_text(json.dumps(result, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
