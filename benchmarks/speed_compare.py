"""Speed and memory on one training state, against torch.save, safetensors and DCP.

The state is all-MiniLM-L6-v2 with its AdamW state after one real contrastive training step
(22.7 M parameters, both moments populated: ~260 MiB of fp32). Each method saves and loads
that same state; every measurement runs in a fresh subprocess so that peak memory is the
method's own, and the methods take turns (round-robin) so that load from other processes on
a shared machine hits them alike. Reported per method, as medians over ``--repeats`` (and,
for the total save and the load, the best run too: disk time on a shared machine varies
several-fold from run to run and only ever adds):

* **blocks the loop**: seconds until the save call returns control to the training loop;
* **total save**: seconds until the file is durable (every method fsyncs: ``torch.save``
  and ``save_file`` are followed by an fsync of the file and of its directory, as
  tw_triton's writer does; DCP's writer fsyncs its files itself);
* **load to CPU**: seconds from the file(s) to a state on the CPU whose every tensor has been
  read once (so a memory-mapped load pays for its page faults too; warm page cache);
* **peak extra RSS**: high-water resident memory during the save (or load) above the
  process's resident size just before it (``/proc/self/clear_refs`` resets the mark).

Methods: ``torch.save``/``torch.load``; ``safetensors`` ``save_file``/``load_file`` (the
state flattened, non-tensor leaves in the header metadata); ``torch.distributed.checkpoint``
``save`` and ``async_save``, single process (``no_dist=True``: no process group needed);
tw_triton through its ``Checkpointer`` (async writer): an exact keyframe, an int8 delta save
(default rules), and an int8 delta save with the ``int8-exp-avg`` preset (AdamW's
``exp_avg`` at int8 delta too, ``exp_avg_sq`` exact); and the Checkpointer with its
defaults: a keyframe (the first save of a process), the same keyframe after
``Checkpointer.prepare`` (its snapshot buffers faulted in before the timed save, and
before the peak's baseline), and a delta.

Run: ``python benchmarks/speed_compare.py`` (about 5 minutes on 2 cores). Writes
``benchmarks/results/speed_compare.json``.

With ``--device cuda`` the state lives on the GPU: every save starts from device tensors
(``tw_triton`` encodes there and copies on a side stream; the others copy to the host
themselves), every load ends with the tensors on the GPU (``torch.load(map_location=...)``,
``load_file(device=...)``, DCP into a device template, ``tw_triton.load(device=...)``) and a
device sync, and the peak device memory of each save (``torch.cuda.max_memory_allocated``
above the level before it) is recorded too. Results go to
``benchmarks/results/gpu/<device-name-slug>/speed_compare.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from harness.fixture import build_fixture, empty_like_tree, flatten, non_tensors, perturb
from harness.memory import fsync_path, peak_bytes, reset_peak, rss_bytes
from harness.speed_summary import summarize, tables

HERE = Path(__file__).resolve().parent

# Where the state lives, saves start and loads end: "cpu", or "cuda" (--device cuda). Set
# by main() in the parent and in every child.
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _device_peak_start() -> int:
    if DEVICE.type != "cuda":
        return 0
    torch.cuda.synchronize(DEVICE)
    torch.cuda.reset_peak_memory_stats(DEVICE)
    return torch.cuda.memory_allocated(DEVICE)


def _device_peak_since(base: int) -> int | None:
    return torch.cuda.max_memory_allocated(DEVICE) - base if DEVICE.type == "cuda" else None


SAVE_METHODS = (
    "torch.save",
    "safetensors",
    "dcp.save",
    "dcp.async_save",
    "tw keyframe (exact)",
    "tw int8 delta",
    "tw int8 delta + exp_avg int8",
    "tw default keyframe",
    "tw default keyframe after prepare",
    "tw default delta",
    "tw default delta after prepare",
    "tw default delta, steady state",
)
# Which save method's files each load method reads.
LOAD_METHODS = (
    "torch.load",
    "safetensors",
    "dcp.load",
    "tw keyframe (exact)",
    "tw int8 delta",
    "tw int8 delta + exp_avg int8",
    "tw default keyframe",
    "tw default delta",
)
LOAD_FILES = {
    "torch.load": "torch.save",
    "safetensors": "safetensors",
    "dcp.load": "dcp.save",
}
# A resume: the files back into a freshly built MiniLM and AdamW (no optimizer state yet), as
# a restarted job does, against torch.load followed by the objects' load_state_dict.
RESUME_METHODS = (
    "torch.load + load_state_dict",
    "tw restore default keyframe",
    "tw restore default delta",
)
RESUME_FILES = {
    "torch.load + load_state_dict": "torch.save",
    "tw restore default keyframe": "tw default keyframe",
    "tw restore default delta": "tw default delta",
}

# The Checkpointer rules of each tw method (the library defaults apply to what is left out):
# None = the rule defaults (int8 weight deltas, optimizer exact); "int8-exp-avg" adds AdamW's
# exp_avg at int8; the "default" methods run the Checkpointer as constructed with no options
# (its DEFAULT_RULES preset, closed-loop deltas).
TW_RULES = {
    "tw keyframe (exact)": {"rules": None},
    "tw int8 delta": {"rules": None},
    "tw int8 delta + exp_avg int8": {"rules": "int8-exp-avg"},
    "tw default keyframe": {},
    "tw default keyframe after prepare": {},
    "tw default delta": {},
    "tw default delta after prepare": {},
    "tw default delta, steady state": {},
}
TW_KEYFRAMES = ("tw keyframe (exact)", "tw default keyframe", "tw default keyframe after prepare")
# Methods that call Checkpointer.prepare before the measured save: its snapshot buffers are
# faulted in outside the timed region (and outside the peak, which the pool then holds).
TW_PREPARED = ("tw default keyframe after prepare", "tw default delta after prepare")
# Deltas saved (untimed, each after a perturbation) between the keyframe and the measured
# delta: a training loop saves many deltas per keyframe, and from the second on a delta
# reuses the buffers of the one before; "tw default delta" is the first after the
# keyframe. Save only: loading the steady delta needs its whole closed-loop chain
# (benchmarks/chain_load.py measures that).
TW_WARMUP_DELTAS = {"tw default delta, steady state": 3}


# ----------------------------------------------------------------------------- children


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def child_save(method: str, fixture: Path, out: Path) -> dict[str, Any]:
    """Save the fixture state with ``method``; return timings, peak memory and file bytes."""
    state = torch.load(fixture, weights_only=True, map_location=DEVICE)
    ckpt = None
    if method.startswith("tw"):
        from tw_triton import Checkpointer

        ckpt = Checkpointer(out, keyframe_every=1_000_000, keep_last=None, **TW_RULES[method])
        if method in TW_PREPARED:
            # Before the keyframe, as a training loop calls it (after its first step).
            ckpt.prepare(model=state["model"], optimizer=state["optimizer"])
        if method not in TW_KEYFRAMES:
            # The keyframe first (not measured); the measured save is the delta after it.
            ckpt.save(0, model=state["model"], optimizer=state["optimizer"]).result()
            perturb(state)
            for warm in range(1, 1 + TW_WARMUP_DELTAS.get(method, 0)):
                ckpt.save(warm, model=state["model"], optimizer=state["optimizer"]).result()
                perturb(state)
    _sync()
    # The fixture's load left garbage behind; a full collection inside the timed region
    # would be charged to whichever method happened to trigger it.
    gc.collect()
    dev_base = _device_peak_start()
    base = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    if method == "torch.save":
        torch.save(state, out / "state.pt")
        fsync_path(out / "state.pt")
        blocked = total = time.perf_counter() - t0
    elif method == "safetensors":
        from safetensors.torch import save_file

        save_file(
            flatten(state), str(out / "state.safetensors"), metadata={"tree": json.dumps(non_tensors(state))}
        )
        fsync_path(out / "state.safetensors")
        blocked = total = time.perf_counter() - t0
    elif method in ("dcp.save", "dcp.async_save"):
        import torch.distributed.checkpoint as dcp

        if method == "dcp.save":
            with _single_process_dcp():
                dcp.save(state, checkpoint_id=str(out / "dcp"), no_dist=True)
            blocked = total = time.perf_counter() - t0
        else:
            with _single_process_dcp():
                fut = dcp.async_save(state, checkpoint_id=str(out / "dcp"), no_dist=True)
            blocked = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
    else:
        step = 0 if method in TW_KEYFRAMES else 1 + TW_WARMUP_DELTAS.get(method, 0)
        fut = ckpt.save(step, model=state["model"], optimizer=state["optimizer"])
        blocked = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
    peak = peak_bytes() - base
    dev_peak = _device_peak_since(dev_base)
    if ckpt is not None:
        ckpt.close()
        if method in TW_WARMUP_DELTAS:
            from tw_triton.checkpointer import checkpoint_name

            step_file = out / checkpoint_name(1 + TW_WARMUP_DELTAS[method])
            os.replace(step_file, out / "state.tw.safetensors")  # for its size
        elif method not in TW_KEYFRAMES:
            # Keep only what a load of the delta needs, named for the load child.
            os.replace(out / "step-00000000.tw.safetensors", out / "reference.tw.safetensors")
            os.replace(out / "step-00000001.tw.safetensors", out / "state.tw.safetensors")
        else:
            os.replace(out / "step-00000000.tw.safetensors", out / "state.tw.safetensors")
    return {
        "blocked_s": blocked,
        "total_s": total,
        "peak_extra_bytes": peak,
        "peak_device_bytes": dev_peak,
        "file_bytes": _size_of_checkpoint(out, method),
    }


def _size_of_checkpoint(out: Path, method: str) -> int:
    if method.startswith("dcp"):
        return sum(p.stat().st_size for p in (out / "dcp").rglob("*") if p.is_file())
    names = {"torch.save": "state.pt", "safetensors": "state.safetensors"}
    return (out / names.get(method, "state.tw.safetensors")).stat().st_size


def load_with(method: str, files: Path, template: Any = None) -> dict[str, torch.Tensor]:
    """Load the checkpoint in ``files`` with ``method``; return its tensors, flattened.

    ``template`` is the state's structure, which DCP needs (it loads in place).
    """
    if method == "torch.load":
        state = torch.load(files / "state.pt", weights_only=True, map_location=DEVICE)
    elif method == "safetensors":
        from safetensors.torch import load_file

        state = load_file(str(files / "state.safetensors"), device=str(DEVICE))
    elif method == "dcp.load":
        import torch.distributed.checkpoint as dcp

        state = empty_like_tree(template)
        with _single_process_dcp():
            dcp.load(state, checkpoint_id=str(files / "dcp"), no_dist=True)
    else:
        import tw_triton

        ref = files / "reference.tw.safetensors"
        state = tw_triton.load(
            files / "state.tw.safetensors", device=DEVICE, reference=str(ref) if ref.exists() else None
        )
    flat = flatten(state)
    # Read every byte once: a memory-mapped load (safetensors) is otherwise only a promise,
    # and the first training step would pay for the page faults instead.
    for t in flat.values():
        t.sum()
    _sync()
    # The training state only (tw_triton's Checkpointer adds RNG states).
    return {k: v for k, v in flat.items() if k.startswith(("model/", "optimizer/"))}


def child_load(method: str, fixture: Path, files: Path) -> dict[str, Any]:
    """Load the checkpoint in ``files`` with ``method`` to the CPU; time and peak memory."""
    template = None
    if method == "dcp.load":
        # DCP loads in place: the caller needs the state's structure and allocations, which
        # a resuming job has (its model and optimizer). Built before the clock starts, but
        # the allocation itself is inside the measured region (it is memory the load needs).
        template = torch.load(fixture, weights_only=True, mmap=True, map_location=DEVICE)
    if method.startswith("tw"):
        import tw_triton  # noqa: F401  (import cost outside the clock, like torch's)

    gc.collect()  # as in child_save: no setup garbage collected on the clock
    base = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    flat = load_with(method, files, template)
    elapsed = time.perf_counter() - t0
    peak = peak_bytes() - base
    return {"load_s": elapsed, "peak_extra_bytes": peak, "tensors": len(flat)}


def child_resume(method: str, files: Path) -> dict[str, Any]:
    """Resume from the files in ``files`` into a fresh MiniLM and AdamW with ``method``."""
    from harness.minilm import load_minilm

    model, _ = load_minilm()
    model.to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    directory = files / "resume"
    if method.startswith("tw"):
        from tw_triton import Checkpointer
        from tw_triton.checkpointer import checkpoint_name

        # A Checkpointer directory of the saved files (links: the load children read them too).
        directory.mkdir(exist_ok=True)
        names = ["reference", "state"] if (files / "reference.tw.safetensors").exists() else ["state"]
        for step, name in enumerate(names):
            os.link(files / f"{name}.tw.safetensors", directory / checkpoint_name(step))
    gc.collect()
    base = rss_bytes()
    reset_peak()
    t0 = time.perf_counter()
    if method == "torch.load + load_state_dict":
        state = torch.load(files / "state.pt", weights_only=True, map_location=DEVICE)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    else:
        Checkpointer(directory, keep_last=None).restore(model=model, optimizer=opt, rng=False)
    _sync()
    elapsed = time.perf_counter() - t0
    peak = peak_bytes() - base
    return {"load_s": elapsed, "peak_extra_bytes": peak, "moments": len(opt.state)}


def run_child(args: list[str], threads: int) -> dict[str, Any]:
    """Run this script as a child and parse the JSON line it prints."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            *args,
            "--threads",
            str(threads),
            "--device",
            DEVICE.type,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed with code {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- parent


def run(
    repeats: int, threads: int, log: Callable[[str], None], only: list[str] | None = None
) -> dict[str, Any]:
    """Build the state once, then measure every method ``repeats`` times, round-robin.

    ``only``: measure these methods (and torch.save / torch.load, the yardsticks) alone.
    """
    save_methods = [m for m in SAVE_METHODS if only is None or m in only or m == "torch.save"]
    load_methods = [m for m in LOAD_METHODS if only is None or m in only or m == "torch.load"]
    # A resume is measured where the save method that writes its files is.
    resume_methods = [m for m in RESUME_METHODS if RESUME_FILES[m] in save_methods]

    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        fixture = tmpdir / "fixture.pt"
        info = build_fixture(fixture)
        log(f"state: {info['state_tensors']} tensors, {info['state_bytes'] / 2**20:.1f} MiB")
        saves: dict[str, list[dict[str, Any]]] = {m: [] for m in save_methods}
        loads: dict[str, list[dict[str, Any]]] = {m: [] for m in load_methods}
        resumes: dict[str, list[dict[str, Any]]] = {m: [] for m in resume_methods}
        for rep in range(repeats):
            for method in save_methods:
                out = tmpdir / f"save-{rep}-{method.replace(' ', '_')}"
                out.mkdir()
                # Whatever earlier children left for the disk (renames, metadata) is flushed
                # here, off the clock: otherwise the fsync of the next save waits for it, and a
                # method's total would depend on which method ran before it.
                os.sync()
                r = run_child(["--child-save", method, "--fixture", str(fixture), "--out", str(out)], threads)
                saves[method].append(r)
                log(
                    f"rep {rep} save {method}: blocked {r['blocked_s']:.3f} s, total {r['total_s']:.3f} s, "
                    f"peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB, {r['file_bytes'] / 2**20:.1f} MiB"
                )
            for method in load_methods:
                src = tmpdir / f"save-{rep}-{LOAD_FILES.get(method, method).replace(' ', '_')}"
                r = run_child(["--child-load", method, "--fixture", str(fixture), "--out", str(src)], threads)
                loads[method].append(r)
                log(
                    f"rep {rep} load {method}: {r['load_s']:.3f} s, peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB"
                )
            for method in resume_methods:
                src = tmpdir / f"save-{rep}-{RESUME_FILES[method].replace(' ', '_')}"
                r = run_child(["--child-resume", method, "--out", str(src)], threads)
                resumes[method].append(r)
                log(
                    f"rep {rep} resume {method}: {r['load_s']:.3f} s, peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB"
                )
            # Free the disk space of this round before the next.
            for p in sorted(tmpdir.glob(f"save-{rep}-*")):
                subprocess.run(["rm", "-rf", str(p)], check=True)

    rows, load_rows, resume_rows = summarize(saves, loads, resumes)
    from tw_triton.parallel import cpu_threads

    return {
        "state": info,
        "repeats": repeats,
        "threads": threads,
        "tw_threads": cpu_threads(),
        "save_rows": rows,
        "load_rows": load_rows,
        "resume_rows": resume_rows,
        "raw_saves": saves,
        "raw_loads": loads,
        "raw_resumes": resumes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads in every child (1: steadier on a shared machine)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the state lives and loads go (cuda: results/gpu/<device>/)",
    )
    parser.add_argument(
        "--methods", default=None, help="comma-separated subset of methods to measure (printed, not written)"
    )
    parser.add_argument("--child-save", metavar="METHOD", help=argparse.SUPPRESS)
    parser.add_argument("--child-load", metavar="METHOD", help=argparse.SUPPRESS)
    parser.add_argument("--child-resume", metavar="METHOD", help=argparse.SUPPRESS)
    parser.add_argument("--fixture", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device")
    DEVICE = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if args.child_save:
        print(json.dumps(child_save(args.child_save, args.fixture, args.out)))
        return
    if args.child_load:
        print(json.dumps(child_load(args.child_load, args.fixture, args.out)))
        return
    if args.child_resume:
        print(json.dumps(child_resume(args.child_resume, args.out)))
        return

    from harness.common import gpu_results_dir, log, write_result

    only = None
    if args.methods:
        only = [m.strip() for m in args.methods.split(",")]
        unknown = sorted(set(only) - set(SAVE_METHODS) - set(LOAD_METHODS))
        if unknown:
            parser.error(f"unknown methods {unknown}; known: {list(SAVE_METHODS)}")
    result = run(args.repeats, args.threads, log, only)
    result["device"] = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    if DEVICE.type == "cuda":
        # The GPU results sit apart, under the device's name (make_results.py reads them there).
        name = str((gpu_results_dir() / "speed_compare").relative_to(HERE / "results"))
    else:
        # The results page reads the 1-thread run; other thread counts sit beside it.
        name = "speed_compare" if args.threads == 1 else f"speed_compare_threads{args.threads}"
    path = write_result(name, result) if only is None else None
    print(
        f"{result['state']['params']} parameters + AdamW moments, "
        f"{result['state']['state_bytes'] / 2**20:.1f} MiB of tensors; medians of {args.repeats} runs, "
        f"{args.threads} torch thread(s)"
    )
    print(tables(result))
    if path is not None:
        log(f"wrote {path}")


if __name__ == "__main__":
    main()
