"""The GPU validation: one command by default, or three phases of under 8 minutes each.

Run ``bash benchmarks/gpu/validate.sh`` (installs offline what is missing, then runs this)
or ``python benchmarks/gpu/validate.py``; docs/gpu-validation.md.

Without ``--phase`` (``all``) every step runs in one command sharing one budget
(``ONE_CALL``, 360 s), the most telling first: a lease of 15 minutes holds the machine's
start, this command and a rerun of what fails. With more time, three phases:

``smoke`` (1, at most 3 minutes): the essentials, its table written before anything runs
  ``precompile``     the kernel variants every preset uses, compiled by a process pool
  ``identity_grid``  device vs CPU byte identity on that grid, random and adversarial inputs
  ``save_load``      a real model state saved and loaded on the device, decoded as on the CPU
``kernels`` (2): ``precompile_all`` (also the sweep's variants), ``identity`` (the full
  sweep, ``_identity.py``), ``pytest`` (``-m cuda``; a skip with a GPU fails), ``throughput``
``end-to-end`` (3): ``concurrency`` (saves while training overwrites the state) and
  ``end_to_end`` (a ~2.2 GB transformer + AdamW: save/load vs torch, safetensors, DCP)

Each step has a time budget (``--budget-scale`` stretches them) and the run one. A step that
checks the clock itself (``SELF_STOPPING``) starts with what is left, if that is at least
its minimum, and stops when it is spent; any other starts only when its whole budget fits.
A step not started is ``SKIPPED`` in the table, with the seconds left. The budgets were
set by design and checked against the first H100 run (docs/gpu-validation.md).

Results go to ``--out``, else ``$OUT`` when set, else ``benchmarks/results/gpu/<device>/``:
``summary-<phase>.md`` (the table), ``results-<phase>.json`` and ``steps-<phase>.jsonl``
(one line per finished step, flushed as it finishes: a command killed at its limit still
returns what it did), and with the pytest step ``pytest.log`` and ``pytest.xml``; without
``--phase`` the names are ``summary.md``, ``results.json`` and ``steps.jsonl``. A rerun of a
phase replaces its files. The exit status is 0 only when every step passed; performance
goals fail the run only with ``--strict-goals``.

Without CUDA, or with ``--dry-run``, every step runs on the CPU through the same code with
tiny sizes (precompile lists its grid, pytest only collects): results then go to
``benchmarks/results/gpu/cpu-dry-run/`` (or ``--out``/``$OUT``), marked ``dry_run``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _end_to_end  # noqa: E402
import _identity  # noqa: E402
import _precompile  # noqa: E402
import _smoke  # noqa: E402
import _throughput  # noqa: E402
import torch  # noqa: E402
from _gpu_pytest import HUGE, HUGE_HOME  # noqa: E402
from harness.common import device_slug as slug  # noqa: E402

# The reason tests/conftest.py gives a test of more GPUs than the machine has.
NEEDS_DEVICES = re.compile(r"needs \d+ CUDA devices, this machine has \d+")

RESULTS_ROOT = REPO / "benchmarks" / "results" / "gpu"
_clock = time.perf_counter  # the run's clock; a test replaces it
DRY_RUN_SLUG = "cpu-dry-run"

# Seconds per step on a GPU (x --budget-scale). Steps check the clock between cases; the
# pytest step is killed at its budget; precompile and the save/load steps run to the end.
BUDGETS = {
    "precompile": 60.0,
    "identity_grid": 50.0,
    "save_load": 40.0,
    "precompile_all": 90.0,
    "identity": 140.0,
    "pytest": 150.0,
    "throughput": 50.0,
    "concurrency": 40.0,
    "end_to_end": 300.0,
}
# Steps that check the clock themselves (between grid entries, cases or rounds; pytest is
# killed): the least each needs to report anything. They may start with less than BUDGETS.
SELF_STOPPING = {
    "precompile": 20.0,
    "precompile_all": 20.0,
    "identity_grid": 10.0,
    "identity": 20.0,
    "pytest": 60.0,
    "throughput": 15.0,
    "end_to_end": 90.0,  # the warm-up round and one timed round of the 2.2 GB state
}
# The phases: steps in order and the phase's own budget in seconds (x --budget-scale), under
# the 10-minute limit of one command with room for the install and the interpreter start.
PHASES: dict[str, tuple[tuple[str, ...], float]] = {
    "smoke": (("precompile", "identity_grid", "save_load"), 170.0),
    "kernels": (("precompile_all", "identity", "pytest", "throughput"), 450.0),
    "end-to-end": (("concurrency", "end_to_end"), 420.0),
}
# The default: every step in one command, for a lease of 15 minutes of device time all told
# (about 2 for the machine's start, this command's 360 s plus the install, and enough left
# to start a machine again and rerun what failed with --steps). The correctness checks come
# first, the CUDA tests (streams, events, pinned memory, the device memory bound) among them:
# end_to_end, after them, would otherwise take every second left (up to 300 s) and skip
# them; it still gets its warm-up and timed rounds when the steps before take their usual
# time, and what it leaves goes to throughput and the full identity sweep.
ONE_CALL: tuple[tuple[str, ...], float] = (
    (
        "precompile",
        "identity_grid",
        "save_load",
        "concurrency",
        "pytest",
        "end_to_end",
        "throughput",
        "precompile_all",
        "identity",
    ),
    360.0,
)
PHASE_ALIASES = {"1": "smoke", "2": "kernels", "3": "end-to-end", "end_to_end": "end-to-end"}


@dataclass
class Step:
    """Outcome of one step."""

    name: str
    title: str
    status: str = "NOT RUN"  # PASS, FAIL, INCOMPLETE
    seconds: float = 0.0
    detail: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    goal: str | None = None  # "MET", "MISSED" or None (no goal, or not on a GPU)


@dataclass
class Ctx:
    """What a step runs with."""

    device: torch.device
    dry: bool
    budget: float
    work: Path
    out: Path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ steps


def step_precompile(c: Ctx, grid: list[_precompile.Entry] | None = None) -> Step:
    s = Step("precompile", "(1) precompile the kernel variants the presets use, in parallel")
    grid = _precompile.default_grid() if grid is None else grid
    r = _precompile.precompile(grid, c.device, budget_s=c.budget)
    s.data = r
    s.status = "PASS" if grid else "FAIL"
    if r["ran"]:
        done = len(r["seconds"])
        s.detail = f"{done} of {len(grid)} grid entries in {r['workers']} processes, {r['wall_s']} s"
        if done < len(grid):
            s.status, s.detail = "INCOMPLETE", s.detail + " (budget spent: the rest compiles on first use)"
    else:
        s.detail = f"{len(grid)} grid entries listed in {r['workers']} shares; nothing compiles here"
    return s


def precompile_all_grid(dry: bool) -> list[_precompile.Entry]:
    """The default grid and every contiguous configuration of the identity sweep."""
    cases = list(_identity.plan(_identity.kernel_codecs()[0], dry))
    extra = {
        _precompile.Entry(
            k.codec,
            tuple(sorted({"bits": k.bits, "block": k.block, **dict(k.extra)}.items())),
            str(k.dtype).removeprefix("torch."),
            k.ref_dtype is not None,
        ): None
        for k in cases
        if k.layout == "contiguous" and k.ref_dtype in (None, k.dtype)
    }
    return list(dict.fromkeys(_precompile.default_grid() + list(extra)))


def step_precompile_all(c: Ctx) -> Step:
    s = step_precompile(c, precompile_all_grid(c.dry))
    s.name, s.title = "precompile_all", "(2) precompile the grid and the identity sweep's variants"
    return s


def step_identity_grid(c: Ctx) -> Step:
    cases = _identity.plan_grid(_precompile.default_grid())
    rep = _identity.run_identity(c.device, dry_run=c.dry, budget_s=c.budget, log=log, cases=cases)
    s = _identity_step(rep)
    s.name, s.title = "identity_grid", "(1) device vs CPU byte identity on the default grid"
    return s


def step_save_load(c: Ctx) -> Step:
    s = Step("save_load", "(1) a model state saved and loaded on the device, as on the CPU")
    r = _smoke.save_load_once(c.device, c.work, size="tiny" if c.dry else "medium", log=log)
    s.data = r
    if r["problem_count"]:
        s.status, s.detail = "FAIL", f"{r['problem_count']} problem(s); first: {r['problems'][0]}"
    else:
        s.status = "PASS"
        s.detail = f"{r['parameters'] / 1e6:.1f} M parameters, keyframe and delta: {r['tensors_compared']} tensors identical"
    return s


def step_identity(device: torch.device, dry: bool, budget: float, work: Path) -> Step:
    rep = _identity.run_identity(device, dry_run=dry, budget_s=budget, log=log)
    return _identity_step(rep)


def _identity_step(rep: _identity.IdentityReport) -> Step:
    s = Step("identity", "(b) device vs CPU byte identity, every codec with a kernel")
    s.data = _identity.as_json(rep)
    if not rep.codecs:
        s.status, s.detail = "FAIL", "no registered codec declares a kernel"
    elif rep.failures:
        s.status = "FAIL"
        s.detail = f"{len(rep.failures)} difference(s) in {rep.run} cases; first: {rep.failures[0]}"
    elif rep.run < rep.planned:
        s.status = "INCOMPLETE"
        s.detail = (
            f"{rep.run} of {rep.planned} cases within the budget (a rerun is faster: "
            "Triton's compile cache is warm); no difference so far"
        )
    else:
        s.status = "PASS"
        s.detail = (
            f"{rep.run} cases, codecs {', '.join(rep.codecs)} (no kernel: {', '.join(rep.without_kernel)})"
        )
    return s


def step_concurrency(device: torch.device, dry: bool, budget: float, work: Path) -> Step:
    s = Step("concurrency", "(e) saves while training overwrites the state")
    runs = [_end_to_end.run_concurrency(device, work, size="tiny" if dry else "medium", saves=5, log=log)]
    if device.type == "cpu":
        runs.append(
            _end_to_end.run_concurrency(device, work, size="tiny", saves=5, force_device_branch=True, log=log)
        )
    s.data = {"runs": runs}
    problems = [p for r in runs for p in r["problems"]]
    count = sum(r["problem_count"] for r in runs)
    if count:
        s.status, s.detail = "FAIL", f"{count} problem(s); first: {problems[0]}"
    else:
        s.status = "PASS"
        s.detail = f"{sum(r['saves'] for r in runs)} saves hold the values at save()"
    return s


# A test's line in pytest -v's output, serial (``tests/a.py::test PASSED 1.2s [ 5%]``) or
# from an xdist worker (``[gw3] [  5%] PASSED 1.2s tests/a.py::test``).
_ENDED = r"(?:::\S+ |\[gw\d+\] \[\s*\d+%\] ){}\b"


def pytest_workers() -> int:
    """pytest-xdist workers for the pytest step: half the cores, 2 to 8; 0 (one process)
    without xdist. The first H100 run's serial pytest ran 53 of its 140 tests in its 150 s
    budget; the workers compile the variants the precompile did not in parallel too."""
    import importlib.util

    if importlib.util.find_spec("xdist") is None:
        return 0
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def pytest_runs(workers: int, xml: Path, huge_xml: Path) -> list[tuple[list[str], Path]]:
    """The pytest runs of the step, as (arguments after ``-m pytest``, junit XML): one
    process without workers; with them, every test but the huge ones on the workers, then
    the huge ones in one process, one after the other. (xdist's ``--dist loadgroup`` cannot
    keep them on one worker under pytest 9.2, whose nodes no longer take the group suffix
    xdist 3.8 writes into their ids.)"""
    base = ["-v", "-m", "cuda", "-p", "no:cacheprovider", "-p", "_gpu_pytest"]
    if not workers:
        return [(base + ["tests", f"--junitxml={xml}"], xml)]
    return [
        (base + ["tests", f"--junitxml={xml}", "-k", f"not {HUGE}", "-n", str(workers)], xml),
        # Collecting only their folder saves importing the rest of the suite again.
        (base + [HUGE_HOME, f"--junitxml={huge_xml}", "-k", HUGE], huge_xml),
    ]


def step_pytest(device: torch.device, dry: bool, budget: float, work: Path, out: Path) -> Step:
    s = Step("pytest", "(a) pytest -m cuda (a skip with a GPU is a failure)")
    log_path = out / "pytest.log"
    if dry:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "cuda",
            "tests",
            "-p",
            "no:cacheprovider",
            "--collect-only",
        ]
        with open(log_path, "w", encoding="utf-8") as log_file:
            rc = subprocess.run(
                cmd, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT, timeout=budget
            ).returncode
        output = log_path.read_text(encoding="utf-8", errors="replace")
        m = re.search(r"(\d+)/\d+ tests collected|(\d+) tests? collected", output)
        n = int(next(g for g in m.groups() if g)) if m else 0
        s.data = {"command": " ".join(cmd[1:]), "returncode": rc, "collected": n}
        s.status = "PASS" if rc == 0 and n > 0 else "FAIL"
        s.detail = f"collect only (no GPU): {n} tests under -m cuda"
        return s
    # -v: one line per test as it ends, so a run killed at its budget still says which ran.
    # The huge tests' XML stays in the work folder: $OUT brings back few files.
    runs = pytest_runs(pytest_workers(), out / "pytest.xml", work / "pytest-huge.xml")
    # Streamed to pytest.log as it runs (unbuffered): a whole command killed at its limit
    # mid-pytest still brings back the lines of the tests that ended.
    # Each failure's traceback as it happens (_gpu_pytest.py): the summary comes only at the end.
    here = str(Path(__file__).resolve().parent)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
        "TW_PYTEST_FAILURES": str(out / "pytest_failures.log"),
    }
    commands = [" ".join(["pytest", *args]) for args, _ in runs]
    deadline = time.monotonic() + budget
    returncodes: list[int] = []
    try:
        for i, (args, _) in enumerate(runs):
            with open(log_path, "w" if i == 0 else "a", encoding="utf-8") as log_file:
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", *args],
                    cwd=REPO,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    timeout=max(deadline - time.monotonic(), 1.0),
                    env=env,
                )
            returncodes.append(proc.returncode)
    except subprocess.TimeoutExpired:
        output = log_path.read_text(encoding="utf-8", errors="replace")
        ended = {
            k: len(re.findall(_ENDED.format(k), output)) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")
        }
        s.data = {"commands": commands, "killed": True, **{k.lower(): n for k, n in ended.items()}}
        bad = ended["FAILED"] + ended["ERROR"] + ended["SKIPPED"]
        s.status = "FAIL" if bad else "INCOMPLETE"
        s.detail = (
            f"killed at its budget of {budget:.0f} s after {sum(ended.values())} tests: "
            f"{ended['FAILED']} failed, {ended['ERROR']} errors, {ended['SKIPPED']} skipped (see pytest.log)"
        )
        return s
    s.data = {"commands": commands, "returncodes": returncodes}
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    not_collected: dict[str, str] = {}
    more_devices: list[str] = []
    for _, xml in runs:
        if not xml.exists():
            continue
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for k in counts:
            counts[k] += int(suite.get(k, 0))
        # A module that skips itself on import (pytest.importorskip of an optional extra the
        # GPU image lacks) is a "skipped" testcase of the XML even under -m cuda, though
        # none of its tests was selected; no cuda test module skips so (a cuda test that
        # skips is an ordinary skipped testcase). Each run's XML lists it again.
        for case in suite.iter("testcase"):
            skipped = case.find("skipped")
            if skipped is not None and skipped.get("message") == "collection skipped":
                counts["tests"] -= 1
                counts["skipped"] -= 1
                not_collected[case.get("name") or ""] = f"{case.get('name')}: {skipped.text or ''}".strip()
            # A test of several GPUs (tests/conftest.py: cuda(devices=N)) on a machine with
            # fewer: not run here, listed, not failed.
            elif skipped is not None and NEEDS_DEVICES.match(skipped.get("message") or ""):
                counts["skipped"] -= 1
                more_devices.append(f"{case.get('classname')}::{case.get('name')}: {skipped.get('message')}")
    s.data.update(
        counts, modules_skipped_on_import=list(not_collected.values()), needs_more_devices=more_devices
    )
    bad = counts["failures"] + counts["errors"] + counts["skipped"]
    # pytest exits 5 when a run selects no test (no huge test under -m cuda, say).
    ok = all(rc in (0, 5) for rc in returncodes) and returncodes[0] == 0
    s.status = "PASS" if ok and counts["tests"] > 0 and bad == 0 else "FAIL"
    s.detail = (
        f"{counts['tests']} tests: {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped (rc {', '.join(map(str, returncodes))}; see pytest.log)"
    )
    if not_collected:
        s.detail += f"; {len(not_collected)} module(s) of optional extras skipped on import"
    if more_devices:
        s.detail += f"; {len(more_devices)} test(s) of more GPUs than this machine has not run"
    return s


def step_throughput(device: torch.device, dry: bool, budget: float, work: Path) -> Step:
    s = Step("throughput", "(c) codec throughput vs device-to-device copy")
    sizes = (256 << 10,) if dry else (64 << 20, 256 << 20, 1 << 30)
    # A partner codec encodes only with its partner's decode (through the state API): the
    # Codec.encode this times raises for it; its kernels are the identity steps' to check.
    codecs = [n for n in _identity.kernel_codecs()[0] if not _identity.has_partners(n)]
    r = _throughput.run_throughput(device, sizes_bytes=sizes, codecs=codecs, budget_s=budget, log=log)
    s.data = r
    s.status = "PASS" if r["complete"] and r["rows"] else "INCOMPLETE"
    s.detail = f"{len(r['rows'])} timings" + ("" if r["complete"] else " (budget spent before the last)")
    if r["goal_met"] is not None:
        s.goal = "MET" if r["goal_met"] else "MISSED"
    return s


def step_end_to_end(device: torch.device, dry: bool, budget: float, work: Path) -> Step:
    s = Step("end_to_end", "(d) ~2.2 GB state: save blocking, total, load, peak memory")
    r = _end_to_end.run_save_load(
        device, work, size="tiny" if dry else "large", rounds=1 if dry else 3, budget_s=budget, log=log
    )
    s.data = r
    s.status = "PASS"
    s.detail = (
        f"{r['state_bytes'] / 2**30:.2f} GiB state, {r['rounds']} rounds; "
        f"tw blocking / torch.save: {r['goals']['tw_blocking_vs_torch_save']}"
    )
    if "blocking_goal_met" in r["goals"]:
        met = r["goals"]["blocking_goal_met"] and r["goals"]["load_goal_met"]
        s.goal = "MET" if met else "MISSED"
    return s


# ------------------------------------------------------------------------------ report


def status_table(steps: list[Step]) -> str:
    lines = ["| step | status | goal | seconds | detail |", "|---|---|---|---:|---|"]
    for s in steps:
        detail = s.detail.replace("|", "/")
        lines.append(f"| {s.title} | **{s.status}** | {s.goal or '-'} | {s.seconds:.1f} | {detail} |")
    return "\n".join(lines)


def throughput_table(data: dict[str, Any]) -> str:
    lines = [
        "| codec | op | dtype | ref | bits | MiB | GB/s | G elements/s | copy GB/s | % of copy |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data.get("rows", []):
        lines.append(
            f"| {r['codec']} | {r['op']} | {r['dtype']} | {'yes' if r['reference'] else 'no'} | "
            f"{r['bits']} | {r['input_mib']} | {r['gb_per_s']} | {r.get('g_elements_per_s', '-')} | "
            f"{r['copy_gb_per_s']} | {100 * r['fraction_of_copy']:.0f} |"
        )
    return "\n".join(lines)


def end_to_end_table(data: dict[str, Any]) -> str:
    if not data.get("save"):
        return ""
    lines = [
        "| method | blocks the loop (s) | right after a step (s) | total save (s) | peak device MiB | file MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m, r in data["save"].items():
        peak = "-" if r["peak_device_bytes"] is None else f"{r['peak_device_bytes'] / 2**20:.0f}"
        after = r.get("blocked_in_loop_s")
        lines.append(
            f"| {m} | {r['blocked_s']:.4f} | {'-' if after is None else f'{after:.4f}'} | "
            f"{r['total_s']:.4f} | {peak} | {r['file_bytes'] / 2**20:.1f} |"
        )
    lines += ["", "| load method | load to the device (s) |", "|---|---:|"]
    for m, r in data["load"].items():
        links = (
            f" ({r['links']:g} links, {r['per_link_s']:.4f} s a link)"
            if r.get("per_link_s") is not None
            else ""
        )
        lines.append(f"| {m}{links} | {r['load_s']:.4f} |")
    sweep = data.get("keyframe_load_by_threads")
    if sweep and sweep.get("seconds"):
        lines += [
            "",
            f"The keyframe loaded with TW_TRITON_THREADS at each count (best of two; "
            f"the default here is {sweep['default_threads']}):",
            "",
            "| reading threads | load to the device (s) |",
            "|---:|---:|",
        ]
        lines += [f"| {count} | {secs:.4f} |" for count, secs in sweep["seconds"].items()]
    elif sweep and sweep.get("skipped"):
        lines += ["", f"The keyframe load by reading threads was skipped: {sweep['skipped']}."]
    for m, prof in (data.get("load_profile") or {}).items():
        lines += [
            "",
            f"Load of a {m.removeprefix('tw ')} under cProfile ({prof['wall_s']:.3f} s; its own thread only):",
            "",
            "| function | calls | own (s) | cumulative (s) |",
            "|---|---:|---:|---:|",
        ]
        rows = prof["top_own_time"][:10] + [{"function": "tw_triton, by cumulative time:"}]
        rows += prof.get("top_cumulative", [])[:15]
        for row in rows:
            if "calls" not in row:
                lines.append(f"| *{row['function']}* | | | |")
                continue
            lines.append(
                f"| `{row['function']}` | {row['calls']} | {row['own_s']:.4f} | {row['cumulative_s']:.4f} |"
            )
        if prof.get("phases"):
            lines += [
                "",
                f"The same load's phases in every thread ({prof['phases_wall_s']:.3f} s; seconds summed "
                "over calls and threads, nested phases inside their parents):",
                "",
                "| phase | calls | threads | seconds |",
                "|---|---:|---:|---:|",
            ]
            for label, row in prof["phases"].items():
                lines.append(f"| {label} | {row['calls']} | {row['threads']} | {row['seconds']:.4f} |")
    return "\n".join(lines)


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.machine(),
        # The kernel names the sandbox (4.4.0: gVisor, whose GPU proxy behaves differently).
        "kernel": platform.release(),
        "cpu_count": os.cpu_count(),
    }
    try:
        from tw_triton.format.checksum import CRC32_LIBRARY

        info["crc32"] = CRC32_LIBRARY  # zlib where isal did not travel: slower load timings
    except ImportError:
        info["crc32"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            device_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            device_count=torch.cuda.device_count(),
        )
    else:
        info["device_name"] = "CPU (dry run)"
    return info


def _replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a kill mid-write leaves the last one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_row(path: Path, step: Step) -> None:
    """One finished step as a JSON line, flushed to the disk before the next step starts."""
    row = {"name": step.name, "title": step.title, "status": step.status, "goal": step.goal}
    row.update(seconds=round(step.seconds, 2), detail=step.detail, data=step.data)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def report_names(phase: str) -> dict[str, str]:
    """File names of a phase's results (``all``: the names of the one-command run)."""
    suffix = "" if phase == "all" else f"-{phase}"
    return {
        k: f"{k}{suffix}.{ext}" for k, ext in (("summary", "md"), ("results", "json"), ("steps", "jsonl"))
    }


def write_report(
    out: Path,
    steps: list[Step],
    info: dict[str, Any],
    dry: bool,
    started: float,
    phase: str = "all",
    planned: list[str] | None = None,
    running: tuple[str, float, float] | None = None,
) -> None:
    """The table and the JSON of the steps so far; the planned ones not run yet as PENDING,
    ``running`` (its name, the run's second it started at and its budget) as RUNNING."""
    done = {s.name for s in steps}
    pending = [Step(n, n, "PENDING", detail="not run yet") for n in (planned or []) if n not in done]
    for p in pending:
        if running is not None and p.name == running[0]:
            p.status = "RUNNING"
            p.detail = (
                f"started {running[1]:.0f} s into the run with a budget of {running[2]:.0f} s "
                "(a command killed now loses only this step)"
            )
    names = report_names(phase)
    payload = {
        "dry_run": dry,
        "phase": phase,
        "device": info,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "seconds": round(time.time() - started, 1),
        "passed": bool(steps) and not pending and all(s.status == "PASS" for s in steps),
        "steps": {
            s.name: {
                "title": s.title,
                "status": s.status,
                "goal": s.goal,
                "seconds": round(s.seconds, 2),
                "detail": s.detail,
                "data": s.data,
            }
            for s in steps + pending
        },
    }
    _replace(out / names["results"], json.dumps(payload, indent=1, default=str) + "\n")
    by = {s.name: s for s in steps}
    md = [
        f"# GPU validation: {info['device_name']}",
        "",
        (
            "**Dry run on the CPU**: tiny sizes, the same code paths; no GPU number here."
            if dry
            else f"torch {info['torch']}, triton {info.get('triton')}, CUDA {info.get('cuda')}, "
            f"compute capability {info.get('capability')}, CRC-32 by {info.get('crc32')}."
        ),
        "",
        f"Overall: **{'PASS' if payload['passed'] else 'RUNNING' if pending else 'FAIL'}** in "
        f"{payload['seconds']} s (`python benchmarks/gpu/validate.py"
        f"{'' if phase == 'all' else ' --phase ' + phase}{' --dry-run' if dry else ''}`).",
        "",
        status_table(steps + pending),
    ]
    if "throughput" in by and by["throughput"].data:
        md += [
            "",
            "## Throughput",
            "",
            _throughput.__doc__.split("\n\n")[1].replace("\n", " "),
            "",
            throughput_table(by["throughput"].data),
        ]
    if "end_to_end" in by and by["end_to_end"].data:
        md += [
            "",
            "## End to end",
            "",
            end_to_end_table(by["end_to_end"].data),
            "",
            f"Goals: {json.dumps(by['end_to_end'].data.get('goals'))}",
        ]
    _replace(out / names["summary"], "\n".join(md) + "\n")


# ------------------------------------------------------------------------------ main


RUNNERS: dict[str, Callable[[Ctx], Step]] = {
    "precompile": step_precompile,
    "identity_grid": step_identity_grid,
    "save_load": step_save_load,
    "precompile_all": step_precompile_all,
    "identity": lambda c: step_identity(c.device, c.dry, c.budget, c.work),
    "pytest": lambda c: step_pytest(c.device, c.dry, c.budget, c.work, c.out),
    "throughput": lambda c: step_throughput(c.device, c.dry, c.budget, c.work),
    "concurrency": lambda c: step_concurrency(c.device, c.dry, c.budget, c.work),
    "end_to_end": lambda c: step_end_to_end(c.device, c.dry, c.budget, c.work),
}


def libcuda_for_triton(maps: str = "/proc/self/maps") -> str | None:
    """Make sure Triton can link its launcher against ``libcuda.so.1``.

    Triton looks it up in ``/sbin/ldconfig -p`` (else ``LD_LIBRARY_PATH``) and fails every
    launch when that finds nothing (no ldconfig, or a cache without it), though torch has
    loaded it: then ``TRITON_LIBCUDA_PATH`` is set to the directory torch loaded it from
    (the steps' child processes inherit it).

    Returns:
        That directory, or ``None`` when Triton finds it itself, the variable is set
        already, or torch's copy is not found either.
    """
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return None
    from triton.backends.nvidia.driver import libcuda_dirs

    try:
        libcuda_dirs()
        return None
    except Exception as exc:  # noqa: BLE001 - an assertion, or no /sbin/ldconfig at all
        problem = f"{type(exc).__name__}: {exc}".splitlines()[0]
    torch.cuda.init()  # loads libcuda
    with open(maps, encoding="utf-8") as f:
        loaded = sorted({line.split()[-1] for line in f if "/libcuda.so" in line})
    dirs = [
        os.path.dirname(p) for p in loaded if os.path.exists(os.path.join(os.path.dirname(p), "libcuda.so.1"))
    ]
    if not dirs:
        log(f"Triton does not find libcuda.so.1 ({problem}), nor where torch loaded it: kernels will fail")
        return None
    os.environ["TRITON_LIBCUDA_PATH"] = dirs[0]
    log(
        f"Triton does not find libcuda.so.1 ({problem}): TRITON_LIBCUDA_PATH={dirs[0]}, where torch loaded it"
    )
    return dirs[0]


def device_error(device: torch.device) -> str | None:
    """``None`` while ``device`` still runs work; else the error it raises (a CUDA error
    such as an illegal address is sticky: the process cannot use the device again)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).cpu()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - any error here means the context is gone
        return f"{type(exc).__name__}: {exc}".splitlines()[0]
    return None


def restart(args: argparse.Namespace, phase: str, out: Path, steps: list[str], budget: float) -> None:
    """Replace this process with a fresh run of ``steps`` (a budget of ``budget`` seconds
    before ``--budget-scale``) that appends to the same results (``--resume``)."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--phase", phase, "--out", str(out)]
    argv += ["--steps", ",".join(steps), "--phase-budget", f"{max(budget, 1e-3):.3f}"]
    argv += ["--budget-scale", str(args.budget_scale), "--resume"]
    argv += ["--dry-run"] * args.dry_run + ["--strict-goals"] * args.strict_goals
    os.execv(sys.executable, argv)


def plan_phase(phase: str, steps: str | None) -> tuple[list[str], float]:
    """The steps of ``phase`` (``all``: ``ONE_CALL``) and its budget in seconds."""
    if phase == "all":
        names, budget = list(ONE_CALL[0]), ONE_CALL[1]
    else:
        names, budget = list(PHASES[phase][0]), PHASES[phase][1]
    if steps:
        names = [n.strip() for n in steps.split(",") if n.strip()]
    return names, budget


def step_budget(name: str, left: float, scale: float = 1.0) -> float | None:
    """The seconds step ``name`` runs with when ``left`` remain of the run's; None: skip it."""
    full = BUDGETS[name] * scale
    if name in SELF_STOPPING:
        return min(full, left) if left >= SELF_STOPPING[name] * scale else None
    return full if full <= left else None


def results_dir(arg: Path | None, dry: bool, device_name: str) -> Path:
    """``--out``, else ``$OUT`` (what comes back from a lent GPU machine), else by device."""
    if arg is not None:
        return arg
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return RESULTS_ROOT / (DRY_RUN_SLUG if dry else slug(device_name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", default="all", help="smoke|kernels|end-to-end (or 1|2|3); default all")
    p.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes")
    p.add_argument("--out", type=Path, default=None, help="results folder (default: $OUT, else by device)")
    p.add_argument("--steps", default=None, help="comma-separated subset, in the order given")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every time budget")
    p.add_argument("--phase-budget", type=float, default=None, help="the phase's budget in seconds")
    p.add_argument("--strict-goals", action="store_true", help="a missed performance goal fails the run")
    # Internal: a run restarted after the device failed (see device_error) goes on with the
    # steps already in the phase's .jsonl, appending to it.
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    phase = PHASE_ALIASES.get(args.phase, args.phase)
    if phase != "all" and phase not in PHASES:
        p.error(f"unknown phase {args.phase!r}; phases: {', '.join(PHASES)} (or 1, 2, 3)")
    names, phase_budget = plan_phase(phase, args.steps)
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        p.error(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(RUNNERS)}")
    phase_budget = (args.phase_budget or phase_budget) * args.budget_scale

    dry = args.dry_run or not torch.cuda.is_available()
    if not args.dry_run and dry:
        log("no CUDA device: running the dry run on the CPU")
    device = torch.device("cpu") if dry else torch.device("cuda", torch.cuda.current_device())
    if not dry:
        libcuda_for_triton()
    info = device_info(device)
    out = results_dir(args.out, dry, info["device_name"])
    out.mkdir(parents=True, exist_ok=True)
    files = report_names(phase)
    stale = list(files.values()) + (["pytest.log", "pytest.xml"] if "pytest" in names else [])
    steps: list[Step] = []
    if args.resume:
        steps = [Step(**json.loads(line)) for line in (out / files["steps"]).read_text().splitlines()]
        stale = ["pytest.log", "pytest.xml"] if "pytest" in names else []
    for name in stale:
        (out / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tw-validate-"))
    started = time.time()
    clock0 = _clock()
    planned = [s.name for s in steps] + names
    # The table first, every step PENDING: a command killed at once still says what it planned.
    write_report(out, steps, info, dry, started, phase, planned)
    try:
        for name in names:
            left = phase_budget - (_clock() - clock0)
            budget = step_budget(name, left, args.budget_scale)
            if budget is None:
                need = SELF_STOPPING.get(name, BUDGETS[name]) * args.budget_scale
                step = Step(name, name, "SKIPPED")
                step.detail = (
                    f"run budget: {max(left, 0):.0f} of {phase_budget:.0f} s left, "
                    f"the step needs {need:.0f} s"
                )
                log(f"--- {name}: skipped ({step.detail})")
            else:
                log(f"--- {name} (budget {budget:.0f} s)")
                t0 = _clock()
                write_report(out, steps, info, dry, started, phase, planned, (name, t0 - clock0, budget))
                try:
                    step = RUNNERS[name](Ctx(device, dry, budget, work, out))
                except Exception as exc:  # noqa: BLE001 - one broken step must not hide the others
                    step = Step(
                        name,
                        name,
                        "FAIL",
                        detail=f"raised {type(exc).__name__}: {exc}",
                        data={"traceback": traceback.format_exc()},
                    )
                    log(traceback.format_exc())
                step.seconds = _clock() - t0
            steps.append(step)
            broken = device_error(device)
            if broken is not None:
                step.data["device_error_after"] = broken
            append_row(out / files["steps"], step)
            write_report(out, steps, info, dry, started, phase, planned)  # partial results survive a kill
            rest = names[names.index(name) + 1 :]
            if broken is not None and rest:
                # A CUDA error poisons the process's context: every later step would fail
                # on it. A fresh process goes on with the steps left and what is left of
                # the run's budget.
                left = max(phase_budget - (_clock() - clock0), 0.0) / args.budget_scale
                log(f"--- the device failed after {name} ({broken}): a new process runs {', '.join(rest)}")
                shutil.rmtree(work, ignore_errors=True)
                sys.stdout.flush()
                restart(args, phase, out, rest, left)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(status_table(steps))
    print(f"\nresults: {out}")
    failed = [s for s in steps if s.status != "PASS"]
    missed = [s for s in steps if s.goal == "MISSED"]
    print(
        f"VALIDATION{'' if phase == 'all' else ' ' + phase} "
        + ("FAILED: " + ", ".join(s.name for s in failed) if failed else "PASSED")
        + (f"; goals missed: {', '.join(s.name for s in missed)}" if missed else "")
    )
    return 1 if failed or (args.strict_goals and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
