"""How long does a checkpoint pause the training loop, how fast does the writer write, and
how much host memory does a save take?

Three measurements, each a ratio taken side by side in one run:

1. **Loop pause**: wall time of ``Checkpointer.save()`` (snapshot + encode + hand-off to the
   writer thread; the writer idle at the start) against ``torch.save`` + ``fsync`` of the
   same state (which blocks the loop for the whole write). Keyframe saves (all exact) and
   delta saves (model weights int8) are timed separately, alternating with the baseline,
   ``--repeats`` times; medians are reported. Each is timed with the snapshot buffers
   reused across saves (the default) and in fresh memory (``snapshot_pool_bytes=0``), in
   the same rounds. Goal: <= 50 % on the CPU.
2. **Writer throughput**: bytes per second of ``AsyncWriter`` (submit to Future resolved,
   fsync on) against a plain sequential ``write`` + ``fsync`` of the same number of bytes
   from one buffer, into the same directory.
3. **Peak host memory**: RSS high-water mark of a fresh subprocess during one save, above
   its level before the save, for tw_triton keyframe and delta saves and for ``torch.save``
   (each in its own subprocess, since the high-water mark only rises).

On CUDA (``--device cuda``) part 1 times the loop pause with the model and optimizer on
the GPU: ``save()`` then enqueues the encode kernels and the device-to-host copies and syncs
once. That path is written but has NOT been run (no GPU where this was written). Its report
goes to ``benchmarks/results/gpu/<device-name-slug>/save_stall.md``.

    python benchmarks/save_stall.py                  # ~16 M parameters + AdamW, 5 repeats
    python benchmarks/save_stall.py --params 4 --repeats 3 --no-write   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tw_triton import Checkpointer, quantize_state_dict
from tw_triton.writer import AsyncWriter

RESULTS = Path(__file__).resolve().parent / "results" / "save_stall_cpu.md"
MACHINE = "2-core x86 VM (AMD EPYC), no GPU; other agents were loading the same CPU"


def make_training_state(params_m: float, device: str, seed: int = 0):
    """An MLP of about ``params_m`` million parameters with AdamW state (one step taken)."""
    torch.manual_seed(seed)
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width, device=device)).sum().backward()
    opt.step()
    return model, opt


def nudge(model) -> None:
    """A cheap stand-in for a training step between saves (changes every weight)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0001)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def torch_save_fsync(state, path: str) -> int:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


# The Checkpointer's snapshot buffers: reused across saves (the default) or fresh each save.
VARIANTS = {"reused": None, "fresh": 0}
LABELS = {"reused": "reused buffers", "fresh": "fresh buffers"}


def measure_pause(args, directory: str) -> dict:
    model, opt = make_training_state(args.params, args.device)
    ckpts = {v: Checkpointer(os.path.join(directory, f"ckpt-{v}"), keyframe_every=2, keep_last=2,
                             snapshot_pool_bytes=cap) for v, cap in VARIANTS.items()}
    base_path = os.path.join(directory, "torch_save.pt")
    times = {f"{kind}, {v}": [] for v in VARIANTS for kind in ("keyframe", "delta")}
    times["torch.save+fsync"] = []
    nbytes = {}
    step = 0
    # One untimed round first: page-cache and allocator (and pool) warm-up for every side.
    for rnd in range(args.repeats + 1):
        for v, ckpt in ckpts.items():
            for kind in ("keyframe", "delta"):
                nudge(model)
                sync(args.device)
                t0 = time.perf_counter()
                ckpt.save(step, model=model, optimizer=opt)
                pause = time.perf_counter() - t0
                ckpt.flush()  # the write itself is not part of the pause; the next save starts idle
                info = {i.step: i for i in ckpt.infos()}[step]
                assert info.kind == kind, (info.kind, kind)
                nbytes[kind] = info.nbytes
                step += 1
                if rnd:
                    times[f"{kind}, {v}"].append(pause)
        sync(args.device)
        t0 = time.perf_counter()
        nbytes["torch.save+fsync"] = torch_save_fsync({"model": model.state_dict(), "optimizer": opt.state_dict()}, base_path)
        if rnd:
            times["torch.save+fsync"].append(time.perf_counter() - t0)
    pool_bytes = ckpts["reused"].pool_bytes
    for ckpt in ckpts.values():
        ckpt.close()
    n_params = sum(p.numel() for p in model.parameters())
    return {"params": n_params, "times": times, "nbytes": nbytes, "pool_bytes": pool_bytes}


# glibc serves large allocations with fresh mmap()s and returns them on free, so every
# snapshot page-faults its memory in again; on this VM that is most of a keyframe's pause.
# These two settings make glibc keep freed memory for reuse (process-wide; costs RSS).
MALLOC_KEEP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 34)}


def measure_pause_tuned_malloc(args) -> dict:
    """``measure_pause`` in a subprocess whose glibc malloc keeps freed memory."""
    cmd = [sys.executable, os.path.abspath(__file__), "--pause-json", "--params", str(args.params),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--device", args.device]
    if args.dir:
        cmd += ["--dir", args.dir]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=dict(os.environ, **MALLOC_KEEP_ENV))
    if r.returncode != 0:
        raise RuntimeError(f"tuned-malloc child failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def measure_throughput(args, directory: str) -> dict:
    model, opt = make_training_state(args.params, "cpu")
    q = quantize_state_dict({"model": model.state_dict(), "optimizer": opt.state_dict()}, rules="exact")
    writer_s, plain_s, sizes = [], [], []
    with AsyncWriter() as w:
        for rnd in range(args.repeats + 1):
            path = os.path.join(directory, f"tp-{rnd}.tw.safetensors")
            t0 = time.perf_counter()
            n = w.submit(q, path).result()
            dt = time.perf_counter() - t0
            os.unlink(path)
            blob = torch.empty(n, dtype=torch.uint8).numpy()  # same byte count, one buffer
            blob[:] = 1
            plain = os.path.join(directory, f"plain-{rnd}.bin")
            t0 = time.perf_counter()
            with open(plain, "wb") as f:
                f.write(memoryview(blob))
                f.flush()
                os.fsync(f.fileno())
            dp = time.perf_counter() - t0
            os.unlink(plain)
            if rnd:
                writer_s.append(dt)
                plain_s.append(dp)
                sizes.append(n)
    return {"bytes": sizes[0], "writer_s": writer_s, "plain_s": plain_s}


_PEAK_CHILD = r"""
import json, os, resource, sys, tempfile, torch
sys.path.insert(0, {bench_dir!r})
from save_stall import make_training_state, torch_save_fsync, rss_and_reset_peak, peak_rss, _status_kb
from tw_triton import Checkpointer
torch.set_num_threads(1)
mode, params, directory = sys.argv[1], float(sys.argv[2]), sys.argv[3]
model, opt = make_training_state(params, "cpu")
ckpt = Checkpointer(directory, keyframe_every=100, keep_last=5,
                    snapshot_pool_bytes=0 if mode.endswith("fresh buffers") else None)
if mode.startswith("delta"):
    ckpt.save(0, model=model, optimizer=opt); ckpt.flush()
    with torch.no_grad():
        for p in model.parameters(): p.mul_(1.0001)
state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
state_bytes += sum(t.numel() * t.element_size() for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t))
import gc; gc.collect()
before = rss_and_reset_peak()
if mode == "torch.save":
    torch_save_fsync({{"model": model.state_dict(), "optimizer": opt.state_dict()}}, os.path.join(directory, "x.pt"))
else:
    ckpt.save(1, model=model, optimizer=opt); ckpt.flush()
after = peak_rss()
kept = _status_kb("VmRSS") - before
print(json.dumps({{"mode": mode, "state_bytes": state_bytes, "peak_extra": after - before, "kept": kept}}))
"""


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss_and_reset_peak() -> int:
    """Current RSS, after resetting the kernel's RSS high-water mark (Linux clear_refs).

    Where the reset is not possible, falls back to the process-lifetime high-water mark,
    which can hide a save's peak under an earlier one (reported as such).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss() -> int:
    try:
        return _status_kb("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_peak(args, directory: str) -> list[dict]:
    script = _PEAK_CHILD.format(bench_dir=str(Path(__file__).resolve().parent))
    out = []
    for mode in ("keyframe", "delta", "delta, fresh buffers", "torch.save"):
        d = tempfile.mkdtemp(dir=directory)
        r = subprocess.run([sys.executable, "-c", script, mode, str(args.params), d],
                           capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"peak-memory child ({mode}) failed:\n{r.stderr[-2000:]}")
        out.append(json.loads(r.stdout.strip().splitlines()[-1]))
        shutil.rmtree(d, ignore_errors=True)
    return out


def med(xs) -> float:
    return statistics.median(xs)


def run_once(args) -> tuple[list[str], dict[str, float], dict]:
    """One full measurement: (markdown lines of its tables, summary ratios, raw data)."""
    directory = tempfile.mkdtemp(prefix="tw_save_stall_", dir=args.dir)
    try:
        pause = measure_pause(args, directory)
        tuned = None
        if not args.no_malloc_variant and sys.platform.startswith("linux"):
            tuned = measure_pause_tuned_malloc(args)
        tput = measure_throughput(args, directory) if args.device == "cpu" else None
        peak = measure_peak(args, directory) if args.device == "cpu" else None
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    t = pause["times"]
    base = med(t["torch.save+fsync"])
    mb = 1e6
    summary: dict[str, float] = {}
    lines = [
        "### Loop pause per save",
        "",
        "| what | median pause (s) | min..max (s) | file (MB) | pause / torch.save+fsync |",
        "|---|---|---|---|---|",
    ]
    every = 10  # the Checkpointer's default keyframe_every
    for v in VARIANTS:
        for kind in ("keyframe", "delta"):
            xs = t[f"{kind}, {v}"]
            lines.append(f"| tw_triton save(), {kind}, {LABELS[v]} | {med(xs):.3f} | "
                         f"{min(xs):.3f}..{max(xs):.3f} | {pause['nbytes'][kind] / mb:.1f} | {med(xs) / base:.0%} |")
            summary[f"pause, {kind}, {LABELS[v]}"] = med(xs) / base
        amortized = (med(t[f"keyframe, {v}"]) + (every - 1) * med(t[f"delta, {v}"])) / every
        lines.append(f"| tw_triton, 1 keyframe + {every - 1} deltas (default keyframe_every={every}), "
                     f"per save, {LABELS[v]} | {amortized:.3f} | | | {amortized / base:.0%} |")
        summary[f"pause, 1 keyframe + {every - 1} deltas, {LABELS[v]}"] = amortized / base
    xs = t["torch.save+fsync"]
    lines.append(f"| torch.save+fsync | {med(xs):.3f} | {min(xs):.3f}..{max(xs):.3f} | "
                 f"{pause['nbytes']['torch.save+fsync'] / mb:.1f} | 100% |")
    summary[f"pause, keyframe: {LABELS['reused']} / {LABELS['fresh']}"] = (
        med(t["keyframe, reused"]) / med(t["keyframe, fresh"]))
    summary[f"pause, delta: {LABELS['reused']} / {LABELS['fresh']}"] = (
        med(t["delta, reused"]) / med(t["delta, fresh"]))
    lines += ["", f"Snapshot pool after the last save (reused buffers): {pause['pool_bytes'] / mb:.0f} MB "
              f"of host memory kept for the next save."]
    if tuned is not None:
        tt = tuned["times"]
        tbase = med(tt["torch.save+fsync"])
        lines += [
            "",
            "Same measurement in a subprocess whose glibc keeps freed memory (see the note):",
            "",
            "| what | median pause (s) | min..max (s) | pause / torch.save+fsync (same process) |",
            "|---|---|---|---|",
        ]
        for key in list(tt):
            xs = tt[key]
            label = key if key == "torch.save+fsync" else "tw_triton save(), " + key.replace(
                "reused", LABELS["reused"]).replace("fresh", LABELS["fresh"])
            lines.append(f"| {label} | {med(xs):.3f} | {min(xs):.3f}..{max(xs):.3f} | {med(xs) / tbase:.0%} |")
            if key != "torch.save+fsync":
                summary[f"pause, {key.replace('reused', LABELS['reused']).replace('fresh', LABELS['fresh'])}, "
                        "glibc keeping freed memory"] = med(xs) / tbase
    if tput is not None:
        w, pl = med(tput["writer_s"]), med(tput["plain_s"])
        summary["writer throughput / plain write+fsync"] = pl / w
        lines += [
            "",
            "### Writer throughput (fsync on)",
            "",
            "| what | bytes | median time (s) | MB/s | vs plain write |",
            "|---|---|---|---|---|",
            f"| AsyncWriter (submit to Future done) | {tput['bytes']} | {w:.3f} | {tput['bytes'] / w / mb:.0f} | {pl / w:.0%} |",
            f"| plain sequential write + fsync | {tput['bytes']} | {pl:.3f} | {tput['bytes'] / pl / mb:.0f} | 100% |",
        ]
    if peak is not None:
        lines += [
            "",
            "### Peak host memory during one save (RSS high-water above the level before it)",
            "",
            "| save | extra peak RSS (MB) | extra RSS kept after it (MB) | training state (MB) | extra peak / state |",
            "|---|---|---|---|---|",
        ]
        for row in peak:
            lines.append(f"| {row['mode']} | {row['peak_extra'] / mb:.0f} | {row['kept'] / mb:.0f} | "
                         f"{row['state_bytes'] / mb:.0f} | {row['peak_extra'] / row['state_bytes']:.2f} |")
            summary[f"peak extra RSS / state, {row['mode']}"] = row["peak_extra"] / row["state_bytes"]
            if row["mode"] != "torch.save":
                summary[f"peak, RSS kept after the save / state, {row['mode']}"] = row["kept"] / row["state_bytes"]
    return lines, summary, pause


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=16.0, help="model size, millions of parameters")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds per run")
    p.add_argument("--runs", type=int, default=2, help="independent runs (the machine is shared)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 keeps a shared machine's timings steadier)")
    p.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS.name}")
    p.add_argument("--no-malloc-variant", action="store_true",
                   help="skip the second pause measurement with glibc told to keep freed memory")
    p.add_argument("--pause-json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device")
    torch.set_num_threads(args.threads)
    if args.pause_json:  # child of measure_pause_tuned_malloc
        directory = tempfile.mkdtemp(prefix="tw_save_stall_", dir=args.dir)
        try:
            print(json.dumps(measure_pause(args, directory)))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return 0

    runs = [run_once(args) for _ in range(args.runs)]
    pause = runs[0][2]
    mb = 1e6
    keys = list(runs[0][1])
    env = " ".join(f"{k}={v}" for k, v in MALLOC_KEEP_ENV.items())
    lines = [
        f"# Save stall ({args.device})",
        "",
        f"Machine: {MACHINE if args.device == 'cpu' else torch.cuda.get_device_name()}; "
        f"torch {torch.__version__}, {args.threads} torch thread(s), Python {platform.python_version()}.",
        f"State: MLP of {pause['params'] / 1e6:.1f} M fp32 parameters + AdamW moments "
        f"({pause['nbytes']['torch.save+fsync'] / mb:.0f} MB with torch.save). {args.runs} runs of "
        f"{args.repeats} rounds; each round times both sides one after the other.",
        "Command: `python benchmarks/save_stall.py " + " ".join(argv if argv is not None else sys.argv[1:]) + "`",
        "",
        "## Summary (ratios; each run's medians, then the median over runs)",
        "",
        "| ratio | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |",
        "|---|" + "---:|" * (len(runs) + 1),
    ]
    for k in keys:
        vals = [r[1][k] for r in runs]
        fmt = (lambda v: f"{v:.2f}") if k.startswith("peak") else (lambda v: f"{v:.0%}")
        lines.append(f"| {k} | " + " | ".join(fmt(v) for v in vals) + f" | {fmt(med(vals))} |")
    for i, (run_lines, _, _) in enumerate(runs):
        lines += ["", f"## Run {i + 1}", ""] + run_lines
    lines += [
        "",
        "## Notes",
        "",
        "- The pause of a tw_triton save on the CPU is the snapshot: a copy of the state (a "
        "keyframe stores it exact; a delta's copy is then encoded by the writer thread, off the "
        "loop's path, and so is the file write, timed in the throughput table). The encode still "
        "takes CPU time while training goes on. A save that finds the previous one still writing "
        "waits for it (backpressure); this benchmark excludes that by flushing between saves.",
        "- *reused buffers* is the Checkpointer's default: the exact copies go into host buffers "
        "of earlier saves (`SnapshotPool`), returned to the pool when their save's Future is done. "
        "*fresh buffers* is `snapshot_pool_bytes=0` (every copy in new memory). Both run in the "
        "same rounds, one after the other. Not pooled: the codes and scales of quantized tensors "
        "and the encoder's temporaries, which the codec allocates itself (on the writer thread, "
        "so not in the pause).",
        "- The peak-memory rows run one save in a fresh process; *kept after the save* is the RSS "
        "still held once it is written (with reused buffers: the snapshot, kept for the next save; "
        "a delta's run starts after a keyframe, whose pooled buffers are already counted before it).",
        f"- glibc variant: `{env}`. By default glibc serves large allocations with fresh mmap()s "
        "and unmaps them on free, so every snapshot faults its pages in again; these settings "
        "keep freed memory for reuse (process-wide, costs RSS).",
        "- On CUDA the encode runs as kernels and the pause is the launches plus one sync "
        "(`--device cuda`; that path is untested).",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if not args.no_write:
        if args.device == "cuda":
            # GPU results sit apart, under the device's name (make_results.py reads them there).
            from _common import gpu_results_dir

            target = gpu_results_dir() / "save_stall.md"
        else:
            target = RESULTS
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(report)
        print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
