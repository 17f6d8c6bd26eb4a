"""Section 4 of the results page: the GPU validations under ``results/gpu/<device>/``.

:func:`gpu_section` shows every non-dry run of ``benchmarks/gpu/validate.py`` (and the
``speed_compare.py --device cuda`` results beside it), or says "not run" when there is none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.common import RESULTS_DIR, fmt_table, mib


def _gpu_runs(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """``(folder, results)`` of every GPU validation under ``root``; dry runs left out. A
    validation run phase by phase (``results-<phase>.json``) counts as one run, its steps
    in phase order."""
    runs = []
    for folder in sorted(p for p in root.glob("*") if p.is_dir()):
        data = _folder_results(folder)
        if data is not None and not data.get("dry_run", True):
            runs.append((folder, data))
    return runs


def _folder_results(folder: Path) -> dict[str, Any] | None:
    """The results of the validation in ``folder``: ``results.json``, or the phases' files
    merged (the summary link goes to the first phase's)."""
    whole = folder / "results.json"
    if whole.exists():
        return json.loads(whole.read_text(encoding="utf-8"))
    order = {"smoke": 0, "kernels": 1, "end-to-end": 2}
    phases = sorted(folder.glob("results-*.json"), key=lambda p: order.get(p.stem[len("results-") :], 9))
    if not phases:
        return None
    parts = [json.loads(p.read_text(encoding="utf-8")) for p in phases]
    merged = dict(parts[0])
    merged["steps"] = {k: v for part in parts for k, v in part["steps"].items()}
    merged["passed"] = all(part["passed"] for part in parts)
    merged["dry_run"] = any(part.get("dry_run", True) for part in parts)
    merged["summary"] = f"summary-{phases[0].stem[len('results-') :]}.md"
    return merged


def _gpu_device_block(folder: Path, data: dict[str, Any]) -> list[str]:
    """The part of section 4 for one device, from its validation (and other GPU results)."""
    dev = data["device"]
    steps = data["steps"]
    rel = f"{folder.parent.name}/{folder.name}"  # links from results/README.md
    lines = [
        f"### {dev['device_name']}",
        "",
        f"Validation of {data['started_at']}: **{'PASS' if data['passed'] else 'FAIL'}** "
        f"(torch {dev['torch']}, triton {dev.get('triton')}, CUDA {dev.get('cuda')}; "
        f"[summary]({rel}/{data.get('summary', 'summary.md')})).",
        "",
        fmt_table(
            ["step", "status", "goal", "detail"],
            [
                [s["title"], s["status"], s.get("goal") or "-", s["detail"].replace("|", "/")]
                for s in steps.values()
            ],
        ),
    ]
    rows = (steps.get("throughput") or {}).get("data", {}).get("rows", [])
    big = [r for r in rows if r["input_mib"] >= 64]
    if big:
        lines += [
            "",
            "Codec throughput from 64 MiB up, as a fraction of a device-to-device copy of "
            "the same bytes (`triton.testing.do_bench`, same run):",
            "",
        ]
        table = []
        for codec in sorted({r["codec"] for r in big}):
            for op in ("encode", "decode"):
                sel = [r["fraction_of_copy"] for r in big if r["codec"] == codec and r["op"] == op]
                if sel:
                    table.append([codec, op, f"{100 * min(sel):.0f} %", f"{100 * max(sel):.0f} %"])
        lines.append(fmt_table(["codec", "op", "lowest", "highest"], table))
    e2e = (steps.get("end_to_end") or {}).get("data", {})
    if e2e.get("save"):
        lines += [
            "",
            f"End to end on a {e2e['state_bytes'] / 2**30:.2f} GiB state on the device "
            f"(medians of {e2e['rounds']} rounds):",
            "",
        ]
        load = e2e["load"]
        table = []
        for m, r in e2e["save"].items():
            peak = "-" if r["peak_device_bytes"] is None else f"{mib(r['peak_device_bytes']):.0f}"
            lm = {"torch.save": "torch.load"}.get(m, m)
            ld = f"{load[lm]['load_s']:.3f}" if lm in load else "-"
            table.append(
                [m, f"{r['blocked_s']:.3f}", f"{r['total_s']:.3f}", ld, peak, f"{mib(r['file_bytes']):.0f}"]
            )
        lines.append(
            fmt_table(
                [
                    "method",
                    "blocks the loop (s)",
                    "total save (s)",
                    "load to device (s)",
                    "peak device MiB",
                    "file MiB",
                ],
                table,
            )
        )
    extra = []
    speed = folder / "speed_compare.json"
    if speed.exists():
        sp = json.loads(speed.read_text(encoding="utf-8"))
        extra.append(
            f"[speed_compare.json]({rel}/speed_compare.json) (`speed_compare.py --device cuda`, "
            f"{sp['repeats']} repeats)"
        )
    if extra:
        lines += ["", "Also measured on this device: " + "; ".join(extra) + "."]
    return lines


def gpu_section(root: Path = RESULTS_DIR / "gpu") -> str:
    """Markdown for part 4, from ``results/gpu/<device>/`` (the validation script's output);
    says "not run" when there is none. No GPU number is written anywhere else."""
    lines = ["## 4. GPU", ""]
    runs = _gpu_runs(root) if root.is_dir() else []
    if not runs:
        lines.append(
            "**Not run.** No GPU was lent to the tasks that produced these numbers, so this page "
            "has no GPU results: no kernel throughput, no device-side save stall, no load to the "
            "device. The Triton kernels were checked for values under `TRITON_INTERPRET=1` and "
            "compiled ahead of time for sm_80/sm_90 (see the tests), which says nothing about their "
            "speed. On a machine with a GPU, `bash benchmarks/gpu/validate.sh` runs the GPU "
            "validation in one command and writes `benchmarks/results/gpu/<device>/`, which this "
            "section then shows."
        )
        return "\n".join(lines)
    lines.append(
        "From `bash benchmarks/gpu/validate.sh` (`benchmarks/gpu/validate.py`), one folder per "
        "device under `benchmarks/results/gpu/`."
    )
    for folder, data in runs:
        lines += [""] + _gpu_device_block(folder, data)
    return "\n".join(lines)
