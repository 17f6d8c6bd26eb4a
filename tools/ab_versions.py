"""A developer tool: two versions of tw_triton side by side: the same save, resume or load methods of
``speed_compare.py``, each in a fresh process, alternating old, new, old, new.

A change to the CPU path is judged against the code before it, not against last week's
run: the 2-core VM's timings drift between runs by more than most changes move them. This
script checks out ``--base`` (a git revision) into a temporary worktree and runs
``speed_compare.py``'s own save child (``--child-save``) for each method, once per round
with the base on ``PYTHONPATH`` and once with this checkout, plus ``torch.save`` of the
same state in every round as the yardstick. It prints each round and the medians of the
time the save blocks, its total time and its peak extra RSS.

    python tools/ab_versions.py --base 4477262 --method "tw default delta" --rounds 5

With ``--resume`` the methods are ``speed_compare.py``'s resume methods instead (a restore
into a freshly built MiniLM and AdamW): each version writes its own files once, and
*this* checkout's save and resume children run with either version of tw_triton on
``PYTHONPATH`` (a base from before the resume rows existed has no such child of its own;
a version may not read the other's files).

    python tools/ab_versions.py --base f22bf4d --resume --method "tw restore default delta" --rounds 5

With ``--load`` they are its load methods (``tw_triton.load`` of the files to the CPU, a
delta with its keyframe's path as the reference), the files written the same way, against
``torch.load`` in every round:

    python tools/ab_versions.py --base 84952d9 --load --method "tw default delta" --rounds 7

Needs git (for the worktree) and the MiniLM fixture of ``speed_compare.py`` (built once,
about 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BENCH = REPO / "benchmarks"  # speed_compare.py and its harness


def save_child(method: str, source: Path, fixture: Path, out: Path, threads: int) -> dict[str, Any]:
    """One ``speed_compare.py --child-save`` run with tw_triton imported from ``source``."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(source))
    proc = subprocess.run(
        [
            sys.executable,
            str(source / "benchmarks" / "speed_compare.py"),
            "--child-save",
            method,
            "--fixture",
            str(fixture),
            "--out",
            str(out),
            "--threads",
            str(threads),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=source / "benchmarks",
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{method} from {source} failed:\n{proc.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _this_child(args: list[str], source: Path, threads: int) -> subprocess.CompletedProcess:
    """This checkout's ``speed_compare.py`` with ``args``, tw_triton imported from ``source``."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(source))
    return subprocess.run(
        [
            sys.executable,
            str(BENCH / "speed_compare.py"),
            *args,
            "--threads",
            str(threads),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=source.parent,
        check=False,
    )


def write_resume_files(method: str, source: Path, fixture: Path, out: Path, threads: int) -> None:
    """The files of save method ``method`` (kept in ``out``), written by this checkout's
    ``speed_compare.py --child-save`` with tw_triton imported from ``source``."""
    proc = _this_child(
        ["--child-save", method, "--fixture", str(fixture), "--out", str(out)], source, threads
    )
    if proc.returncode != 0:
        raise RuntimeError(f"writing {method} with {source} failed:\n{proc.stderr[-3000:]}")


def resume_child(method: str, source: Path, files: Path, threads: int) -> dict[str, Any]:
    """One resume (``speed_compare.py --child-resume`` of this checkout) with tw_triton
    imported from ``source``; the Checkpointer directory it links is removed after."""
    proc = _this_child(["--child-resume", method, "--out", str(files)], source, threads)
    subprocess.run(["rm", "-rf", str(files / "resume")], check=True)
    return _read_time(proc, method, source)


def _read_time(proc: subprocess.CompletedProcess, method: str, source: Path) -> dict[str, Any]:
    """A resume or load child's time and peak, as rows of a save (its time in both columns)."""
    if proc.returncode != 0:
        raise RuntimeError(f"{method} from {source} failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"blocked_s": out["load_s"], "total_s": out["load_s"], "peak_extra_bytes": out["peak_extra_bytes"]}


def load_child(method: str, source: Path, files: Path, threads: int, fixture: Path) -> dict[str, Any]:
    """One load (``speed_compare.py --child-load`` of this checkout) with tw_triton
    imported from ``source`` (``fixture``: the state, which DCP's load takes as its template)."""
    proc = _this_child(
        ["--child-load", method, "--fixture", str(fixture), "--out", str(files)], source, threads
    )
    return _read_time(proc, method, source)


def build_native(tree: Path) -> None:
    """Build a checkout's compiled CPU codec in place, as ``pip install -e`` does for this
    one: a base without it would run the slower torch path, and the A/B would measure
    that. Versions from before the compiled codec have nothing to build."""
    if not (tree / "tw_triton" / "csrc").is_dir():
        return
    done = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, capture_output=True, text=True
    )
    if done.returncode != 0 or not list((tree / "tw_triton").glob("_native*.so")):
        print(
            f"warning: the base's compiled codec did not build; it runs the torch path\n{done.stderr[-2000:]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare this checkout with")
    parser.add_argument(
        "--method",
        action="append",
        required=True,
        dest="methods",
        help="a save method of speed_compare.py, or a resume or load one with --resume or "
        "--load (repeat for more; names may hold commas)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument(
        "--resume", action="store_true", help="compare resume methods (restores) instead of saves"
    )
    kind.add_argument("--load", action="store_true", help="compare load methods instead of saves")
    args = parser.parse_args()
    methods = args.methods
    reads = args.resume or args.load  # the methods read files written once per side

    sys.path.insert(0, str(BENCH))
    import speed_compare

    if args.resume:
        known, yard, files_of = (
            speed_compare.RESUME_METHODS,
            speed_compare.RESUME_METHODS[0],
            speed_compare.RESUME_FILES,
        )
        child = resume_child
    elif args.load:
        known, yard = speed_compare.LOAD_METHODS, "torch.load"
        files_of = {m: speed_compare.LOAD_FILES.get(m, m) for m in known}
    else:
        known, yard = speed_compare.SAVE_METHODS, "torch.save"
    unknown = [m for m in methods if m not in known]
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {list(known)}")
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        base = tmpdir / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base), args.base], check=True
        )
        try:
            build_native(base)
            fixture = tmpdir / "fixture.pt"
            speed_compare.build_fixture(fixture)
            if args.load:

                def child(method: str, source: Path, files: Path, threads: int) -> dict[str, Any]:
                    return load_child(method, source, files, threads, fixture)

            sides = {"base": base, "new": REPO}
            rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
            files: dict[tuple[str, str], Path] = {}
            if reads:
                # The files each resume or load reads, written once per side by that side's
                # tw_triton (this checkout's save child), so a change of the stored bytes is
                # measured with the files each version writes.
                for method in {*methods, yard}:
                    for side, source in sides.items():
                        saved = files_of[method]
                        files[method, side] = tmpdir / side / saved.replace(" ", "_")
                        files[method, side].mkdir(parents=True, exist_ok=True)
                        write_resume_files(saved, source, fixture, files[method, side], args.threads)
            for rnd in range(args.rounds):
                for method in methods:
                    for side, source in sides.items():
                        if reads:
                            r = child(method, source, files[method, side], args.threads)
                            ts = child(yard, source, files[yard, side], args.threads)
                        else:
                            r = save_child(method, source, fixture, tmpdir / "out", args.threads)
                            ts = save_child("torch.save", base, fixture, tmpdir / "out", args.threads)
                        r["torch_save_s"] = ts["total_s"]
                        rows.setdefault((method, side), []).append(r)
                        print(
                            f"round {rnd} {side:4s} {method}: blocks {r['blocked_s']:.3f} s, total "
                            f"{r['total_s']:.3f} s, peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB "
                            f"({yard} {ts['total_s']:.3f} s)",
                            flush=True,
                        )
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)

    print(f"\nmedians of {args.rounds} alternating rounds, {args.threads} torch thread(s); base {args.base}")
    if reads:
        print(f"({'resumes' if args.resume else 'loads'}: 'blocks' and 'total' are both its time)")
    print(f"| method | side | blocks (s) | total (s) | peak extra RSS (MiB) | {yard} (s) |")
    print("|---|---|---|---|---|---|")
    for (method, side), rs in rows.items():
        med = {
            k: statistics.median(r[k] for r in rs)
            for k in ("blocked_s", "total_s", "peak_extra_bytes", "torch_save_s")
        }
        print(
            f"| {method} | {side} | {med['blocked_s']:.3f} | {med['total_s']:.3f} | "
            f"{med['peak_extra_bytes'] / 2**20:.0f} | {med['torch_save_s']:.3f} |"
        )


if __name__ == "__main__":
    main()
